"""Corrupt or hostile slides, each crafted here, fail at once with a message naming the file, in bounded
memory; a tile that cannot be read fails that tile, never scored as zeros; one bad slide leaves the others scored."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tifffile
import zarr

from clients.batch.score_cli import main
from clients.slides.readers import SlideError, TileError, open_image
from tests.clients.slides.test_run import ROOT, mosaic, write_tiff
from tests.server.scoring.test_imaging import png_header

SECONDS = 10  # "at once": a refused slide's whole run, model loading included, well within this
PEAK_RSS_BYTES = 1 << 30  # what the lying headers would take decoded: 40 Gpx (120 GB), a 30 GB tile


def lying_size(path: Path, side: int) -> Path:
    """A 1536x1024 tiled TIFF (24 tiles of 256) whose header claims side x side pixels."""
    tifffile.imwrite(path, mosaic(1024, 1536), tile=(256, 256), compression="zlib")
    with tifffile.TiffFile(path, mode="r+b") as tiff:
        tiff.pages[0].tags["ImageWidth"].overwrite(side)
        tiff.pages[0].tags["ImageLength"].overwrite(side)
    return path


def consistent_header(path: Path, side: int, *, tile: int) -> Path:
    """A header claiming side x side RGB pixels in tile x tile tiles, its tile table as long as that takes, every
    entry naming one real zlib tile of 256 x 256: only its size gives it away."""
    tifffile.imwrite(path, np.zeros((256, 256, 3), np.uint8), tile=(256, 256), compression="zlib", metadata=None)
    with tifffile.TiffFile(path, mode="r+b") as tiff:
        page = tiff.pages[0]
        offset, count = page.dataoffsets[0], page.databytecounts[0]
        tags = page.tags
        tags["ImageWidth"].overwrite(side)
        tags["ImageLength"].overwrite(side)
        tags["TileWidth"].overwrite(tile)
        tags["TileLength"].overwrite(tile)
        tiles = (-(-side // tile)) ** 2
        tags["TileOffsets"].overwrite([offset] * tiles)
        tags["TileByteCounts"].overwrite([count] * tiles)
    return path


def garbage_after_magic(path: Path) -> Path:
    path.write_bytes(b"II*\0" + np.random.default_rng(1).bytes(100_000))
    return path


def jpeg_slide(path: Path) -> Path:
    tifffile.imwrite(path, mosaic(700, 900, seed=4), tile=(128, 128), compression="jpeg", photometric="rgb")
    return path


def cut_jpeg_tile(path: Path, chunk: int) -> bytes:
    """Halve tile `chunk`'s byte count (libjpeg decodes the rest as grey, with a warning only); the file before."""
    before = path.read_bytes()
    with tifffile.TiffFile(path, mode="r+b") as tiff:
        counts = list(tiff.pages[0].databytecounts)
        counts[chunk] //= 2
        tiff.pages[0].tags["TileByteCounts"].overwrite(counts)
    return before


def tiled(paths, out: Path, model: str, *extra: str) -> int:
    return main([*map(str, paths), "--out", str(out), "--local", model, "--tiled", "--canvas", "256",
                 "--no-progress", "--zarr-dtype", "float32", *extra])


def test_a_declared_size_the_tile_table_does_not_hold_is_refused_with_the_numbers(tmp_path):
    image = lying_size(tmp_path / "liar.tif", 60_000)  # under the pixel limit: the tile table gives it away
    started = time.monotonic()
    with pytest.raises(SlideError, match=r"liar.tif: level 0 declares 60000x60000 pixels in 256x256 tiles, which "
                                         r"takes 55225 tiles or strips, but its tile table holds 24 offsets"):
        open_image(image)
    assert time.monotonic() - started < 1
    other = tmp_path / "liar.scan"  # not a TIFF suffix: OpenSlide's route checks the tile table too
    other.write_bytes(image.read_bytes())
    with pytest.raises(SlideError, match=r"liar.scan: level 0 declares 60000x60000"):
        open_image(other)


def test_an_uncompressed_strip_shorter_than_the_declared_size_is_refused(tmp_path):
    """One strip for all rows agrees with any height: the strip's byte count is what gives the size away."""
    image = tmp_path / "flat.tif"
    tifffile.imwrite(image, mosaic(100, 100), rowsperstrip=100, metadata=None)
    with tifffile.TiffFile(image, mode="r+b") as tiff:
        for tag in ("ImageWidth", "ImageLength", "RowsPerStrip"):
            tiff.pages[0].tags[tag].overwrite(1000)
    with pytest.raises(SlideError, match=r"flat.tif: level 0 declares 1000x1000 uncompressed pixels \(3000000 bytes\), "
                                         r"but its tiles hold 30000 bytes"):
        open_image(image)


def test_a_tile_table_past_the_end_of_the_file_is_refused(tmp_path):
    image = write_tiff(tmp_path / "long.tif", mosaic(512, 512))
    size = image.stat().st_size
    with tifffile.TiffFile(image, mode="r+b") as tiff:
        counts = list(tiff.pages[0].databytecounts)
        counts[5] = size  # the file is whole; its table says tile 5 runs on past its end
        tiff.pages[0].tags["TileByteCounts"].overwrite(counts)
    with pytest.raises(SlideError, match=rf"long.tif: the file is truncated or its tags are wrong: level 0 claims "
                                         rf"data at bytes \d+\.\.\d+ \(tile 5, .*but the file has {image.stat().st_size}"):
        open_image(image)


@pytest.mark.parametrize("name", ["noise.tif", "noise.svs", "noise.scan"])
def test_garbage_after_a_tiff_magic_is_one_error_naming_the_file(tmp_path, name):
    with pytest.raises(SlideError, match=rf"{name}: "):  # was IndexError from tifffile's empty series list
        open_image(garbage_after_magic(tmp_path / name))


def test_a_slide_over_the_pixel_limit_is_refused_by_its_header(tmp_path):
    image = consistent_header(tmp_path / "vast.tif", 110_000, tile=256)  # 12.1 Gpx in 3 MB
    with pytest.raises(SlideError, match=r"vast.tif: level 0 declares 110000x110000 = 12,100,000,000 pixels, over "
                                         r"the limit of 10,000,000,000; raise --max-slide-pixels"):
        open_image(image)
    with open_image(image, max_pixels=110_000 ** 2) as reader:  # let in, its tiles are still real
        assert reader.read(slice(0, 64), slice(0, 64)).shape == (64, 64, 3)
    png = tmp_path / "small.png"
    png.write_bytes(png_header(300, 200))
    with pytest.raises(SlideError, match=r"small.png: level 0 declares 300x200 = 60,000 pixels, over the limit of "
                                         "59,999"):
        open_image(png, max_pixels=59_999)


def test_what_one_decode_would_take_is_bounded_whatever_the_header_says(tmp_path):
    one = consistent_header(tmp_path / "one.tif", 100_000, tile=100_000)  # 10 Gpx in one 30 GB tile
    with pytest.raises(SlideError, match=r"one.tif: level 0 stores its pixels in 100000x100000 tiles, "
                                         r"30,000,000,000 bytes each decoded, over the 1,073,741,824 bytes"):
        open_image(one)
    png = tmp_path / "wide.png"  # PIL decodes whole: a 2 Gpx header in 57 bytes
    png.write_bytes(png_header(50_000, 40_000))
    with pytest.raises(SlideError, match=r"wide.png: 50000x40000 PNG image, which PIL decodes whole"):
        open_image(png)


def test_a_cut_jpeg_tile_and_a_tile_without_bytes_fail_their_regions_only(tmp_path):
    image = jpeg_slide(tmp_path / "cut.tif")
    cut_jpeg_tile(image, 0)
    with tifffile.TiffFile(image, mode="r+b") as tiff:
        counts = list(tiff.pages[0].databytecounts)
        counts[7] = 0  # tifffile reads a tile without bytes as its fill value
        tiff.pages[0].tags["TileByteCounts"].overwrite(counts)
    with open_image(image) as reader:
        with pytest.raises(TileError, match=r"cut.tif: level 0 rows 0\.\.100, columns 0\.\.100 do not decode \(JPEG "
                                            r"tile 0 \(bytes \d+\.\.\d+\) ends without its end-of-image marker"):
            reader.read(slice(0, 100), slice(0, 100))
        with pytest.raises(TileError, match=r"cut.tif: .* \(tile 7 of the file's tile table has no bytes"):
            reader.read(slice(0, 100), slice(896, 900))
        assert reader.read(slice(300, 400), slice(300, 400)).shape == (100, 100, 3)


def test_one_good_slide_among_bad_ones_is_scored_as_alone(converted, tmp_path, capsys, caplog):
    model = converted(True, False)
    good = write_tiff(tmp_path / "good.tif", mosaic(600, 700, seed=2))
    assert tiled([good], tmp_path / "alone", model) == 0
    bad = [lying_size(tmp_path / "liar.tif", 200_000), garbage_after_magic(tmp_path / "noise.tif"),
           consistent_header(tmp_path / "vast.tif", 110_000, tile=256)]
    capsys.readouterr()
    started = time.monotonic()
    assert tiled([*bad[:2], good, bad[2]], tmp_path / "out", model, "--summary-json", str(tmp_path / "s.json")) == 2
    assert time.monotonic() - started < 3 * SECONDS
    printed = capsys.readouterr()
    assert "slides 4: 1 complete, 0 incomplete, 3 failed" in printed.out
    for path in bad:
        assert f"failed: {path}: " in printed.out and f"{path}: " in caplog.text
        assert not (tmp_path / "out" / f"{path.stem}.zarr").exists()  # refused before anything is written
    assert "Traceback" not in printed.err + caplog.text
    statuses = {Path(s["path"]).name: s["status"] for s in json.loads((tmp_path / "s.json").read_text())["slides"]}
    assert statuses == {"liar.tif": "failed", "noise.tif": "failed", "good.tif": "complete", "vast.tif": "failed"}
    alone = zarr.open_group(tmp_path / "alone" / "good.zarr", mode="r")
    among = zarr.open_group(tmp_path / "out" / "good.zarr", mode="r")
    np.testing.assert_array_equal(np.asarray(among["scores"]), np.asarray(alone["scores"]))
    assert among.attrs["scoremap_status"]["complete"]


def test_a_bad_slide_is_refused_before_the_model_loads(tmp_path, caplog):
    """The model file does not exist: had it been opened, the run would be refused for it (exit 4)."""
    started = time.monotonic()
    assert tiled([garbage_after_magic(tmp_path / "noise.tif")], tmp_path / "out", str(tmp_path / "missing.onnx")) == 2
    assert time.monotonic() - started < SECONDS and "noise.tif: " in caplog.text and "missing.onnx" not in caplog.text
    assert not (tmp_path / "out").exists()


def test_failed_tiles_are_recorded_said_and_retried_on_request(converted, tmp_path, capsys, caplog):
    model = converted(True, False)
    image = jpeg_slide(tmp_path / "slide.tif")
    assert tiled([image], tmp_path / "fresh", model) == 0
    whole = cut_jpeg_tile(image, 0)
    out = tmp_path / "out"
    assert tiled([image], out, model) == 2
    printed = capsys.readouterr()
    assert "1 incomplete" in printed.out and "tile (0, 0) failed: " in caplog.text
    status = zarr.open_group(out / "slide.zarr", mode="r").attrs["scoremap_status"]
    assert not status["complete"] and status["failed"] >= 1 and status["stored"] + status["failed"] == status["tiles"]
    assert "ends without its end-of-image marker" in status["failed_tiles"][0]["error"]
    scores = np.asarray(zarr.open_group(out / "slide.zarr", mode="r")["scores"])
    assert np.isnan(scores[:, 0, 0]).all()  # never scored as zeros: its cells hold no score
    assert not (out / "slide.png").exists()
    image.write_bytes(whole)
    assert tiled([image], out, model) == 2  # recorded as failed: skipped until asked
    assert tiled([image], out, model, "--retry-failed") == 0
    stored = zarr.open_group(out / "slide.zarr", mode="r")
    assert stored.attrs["scoremap_status"] == {**status, "complete": True, "stored": status["tiles"], "failed": 0,
                                               "failed_tiles": []}
    np.testing.assert_array_equal(np.asarray(stored["scores"]),
                                  np.asarray(zarr.open_group(tmp_path / "fresh" / "slide.zarr", mode="r")["scores"]))
    assert (out / "slide.png").exists()


def test_lying_and_hostile_headers_exit_2_at_once_in_bounded_memory_and_with_traceback_only_when_asked(converted, tmp_path):
    """Measured on the real command: wall time and peak RSS of a run over the lying and hostile headers."""
    model = converted(True, False)
    bad = [lying_size(tmp_path / "liar.tif", 200_000), garbage_after_magic(tmp_path / "noise.tif"),
           consistent_header(tmp_path / "one.tif", 100_000, tile=100_000)]
    # VmHWM: this process's peak RSS since its exec (ru_maxrss would count the forking test process too).
    command = ("import re, runpy, sys\ntry:\n    runpy.run_module('clients.batch.score_cli', run_name='__main__')\n"
               "finally:\n    status = open('/proc/self/status').read()\n"
               "    print('peak', int(re.search(r'VmHWM:\\s+(\\d+) kB', status)[1]) * 1024, file=sys.stderr)")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for extra in ([], ["--traceback"]):
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-c", command, *map(str, bad), "--out", str(tmp_path / "out"),
                               "--local", model, "--tiled", "--no-progress", *extra],
                              env=env, capture_output=True, text=True, timeout=120)
        seconds = time.monotonic() - started
        peak = int(done.stderr.rsplit("peak ", 1)[1])
        assert done.returncode == 2 and seconds < 3 * SECONDS and peak < PEAK_RSS_BYTES, (seconds, peak, done.stderr)
        assert all(f"scoremap-score: {path}: " in done.stderr for path in bad)
        assert ("Traceback" in done.stderr) == bool(extra)
