"""Large images scored tile by tile into Zarr: exact against one pass, resumable after SIGKILL, damaged tiles recorded."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tifffile
import zarr
from PIL import Image

from clients.batch.local import LocalScorer
from clients.slides.readers import SlideError, open_image
from clients.slides.run import RunError, SlideOptions, score_slide
from clients.slides.tiles import TileOptions, score_map
from protos.scoring_pb2 import SHIFT_GRID
from tests.clients.slides.nets import ON_DEMAND
from tests.tiny_models import tolerance

ROOT = Path(__file__).resolve().parents[3]
KILLED_PACE_S = 0.1  # the least time each tile of the run to be killed takes
KILLED_CONCURRENCY = 4


def mosaic(height: int, width: int, seed: int = 0) -> np.ndarray:
    """Smooth colour fields with noise: something a net's scores vary over."""
    rng = np.random.default_rng(seed)
    rows, columns = np.mgrid[0:height, 0:width]
    base = np.stack([np.sin(columns / 37.0), np.cos(rows / 23.0), np.sin((rows + columns) / 51.0)], -1)
    noise = rng.normal(0, 0.2, (height, width, 3))
    return np.clip((base + noise + 1) * 110, 0, 255).astype(np.uint8)


def write_tiff(path: Path, pixels: np.ndarray, *, pyramid: bool = False, tile=(128, 128)) -> Path:
    with tifffile.TiffWriter(path, bigtiff=True) as tiff:
        tiff.write(pixels, tile=tile, compression="zlib", subifds=1 if pyramid else 0)
        if pyramid:
            tiff.write(pixels[::2, ::2], tile=tile, compression="zlib", subfiletype=1)
    return path


def test_a_tiled_bigtiff_stitches_into_zarr_as_one_pass(converted, tmp_path):
    path = converted(True, False)
    pixels = mosaic(700, 900)
    image = write_tiff(tmp_path / "slide.tif", pixels)
    options = SlideOptions(tile=TileOptions(output_stride=16, shift=SHIFT_GRID, flip=True), canvas=320, dtype="float32")
    with LocalScorer([path], settings=ON_DEMAND) as scorer, open_image(image) as reader:
        summary = score_slide(reader, scorer.score_request, scorer.model(), tmp_path / "out", options=options)
        whole = score_map(scorer.score_request, pixels, options.tile)
    assert summary.exact and summary.tiles > 4 and summary.scored == summary.tiles
    group = zarr.open_group(tmp_path / "out" / "slide.zarr", mode="r")
    stored = np.asarray(group["scores"])
    assert stored.shape == whole.shape and np.nanmax(np.abs(stored - whole)) <= 1e-5
    attributes = group.attrs["scoremap"]
    assert attributes["exact"] and attributes["halo"] == summary.halo and attributes["geometry"]["stride_x"] == 16
    assert (tmp_path / "out" / "slide.png").exists()
    lines = (tmp_path / "out" / "slide.tiles.jsonl").read_text().splitlines()
    assert len(lines) == len(set(lines)) == summary.tiles
    # Run again: everything is recorded, nothing is scored twice.
    with LocalScorer([path], settings=ON_DEMAND) as scorer, open_image(image) as reader:
        again = score_slide(reader, scorer.score_request, scorer.model(), tmp_path / "out", options=options)
    assert (again.skipped, again.scored) == (summary.tiles, 0)


def test_top_k_per_cell_of_a_pyramid_level_in_float16(converted, tmp_path):
    path = converted(True, False)
    pixels = mosaic(1000, 800, seed=3)
    image = write_tiff(tmp_path / "pyramid.tif", pixels, pyramid=True)
    options = SlideOptions(canvas=288, cell_top_k=2)
    with LocalScorer([path], settings=ON_DEMAND) as scorer, open_image(image, level=1) as reader:
        assert [(level.height, level.width) for level in reader.levels] == [(1000, 800), (500, 400)]
        score_slide(reader, scorer.score_request, scorer.model(), tmp_path, options=options)
        whole = score_map(scorer.score_request, pixels[::2, ::2], TileOptions())
    group = zarr.open_group(tmp_path / "pyramid.zarr", mode="r")
    assert group["top_k_scores"].dtype == np.float16 and group.attrs["scoremap"]["level_downsample"] == 2
    np.testing.assert_array_equal(np.asarray(group["top_k_indices"][0]), whole.argmax(axis=0))
    np.testing.assert_allclose(np.asarray(group["top_k_scores"][0], np.float32), whole.max(axis=0), rtol=2e-3, atol=2e-3)


def test_a_resumed_run_after_sigkill_records_every_tile_once(converted, tmp_path):
    path = converted(True, False)
    image = write_tiff(tmp_path / "big.tif", mosaic(1600, 1600, seed=5))
    out = tmp_path / "out"
    arguments = [str(image), "--out", str(out), "--local", path, "--tiled", "--canvas", "256", "--no-progress",
                 "--zarr-dtype", "float32", "--concurrency", str(KILLED_CONCURRENCY)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    ledger = out / "big.tiles.jsonl"
    # The killed run is paced (each tile takes at least KILLED_PACE_S): its 225 tiles last over 5 s on any
    # machine, so it is still running when its third tile is recorded (unpaced, on an H200, it would not be).
    paced = [sys.executable, "-m", "tests.clients.slides.paced_score", str(KILLED_PACE_S), *arguments]
    process = subprocess.Popen(paced, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if ledger.exists() and ledger.read_text().count("\n") >= 3:
            break
        time.sleep(0.01)
    assert process.poll() is None, f"the run ended before it could be killed:\n{process.communicate()[1].decode()[-2000:]}"
    process.send_signal(signal.SIGKILL)
    process.wait()
    killed_at = ledger.read_text().count("\n")
    command = [sys.executable, "-m", "clients.batch.score_cli", *arguments]  # the real command, unpaced
    finished = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr
    records = [json.loads(line) for line in ledger.read_text().splitlines()]
    keys = [(r["row"], r["column"]) for r in records]
    attributes = zarr.open_group(out / "big.zarr", mode="r").attrs["scoremap"]
    rows, columns = attributes["tiles"]
    assert len(keys) == len(set(keys)) == rows * columns > killed_at >= 3
    assert "already stored" in finished.stdout and "exact" in finished.stdout
    # And the map is the uninterrupted one: bit for bit on the CPU; on CUDA within TF32's tolerance, as tiles
    # run in batches of other sizes there (batching is on by default) and TF32 sums depend on the batch.
    providers = set()
    with LocalScorer([path], settings=ON_DEMAND) as scorer, open_image(image) as reader:
        def score(request, **kwargs):
            response = scorer.score_request(request, **kwargs)
            providers.add(response.execution_provider)
            return response

        fresh = score_slide(reader, score, scorer.model(), tmp_path / "fresh",
                            options=SlideOptions(canvas=256, dtype="float32"))
    resumed = np.asarray(zarr.open_group(out / "big.zarr", mode="r")["scores"])
    uninterrupted = np.asarray(zarr.open_group(fresh.map_path, mode="r")["scores"])
    (provider,) = providers
    if provider == "CPUExecutionProvider":
        np.testing.assert_array_equal(resumed, uninterrupted)
    else:
        np.testing.assert_allclose(resumed, uninterrupted, **tolerance(provider, uninterrupted))


def test_a_missing_level_names_the_levels_there_are(tmp_path):
    image = write_tiff(tmp_path / "pyramid.tif", mosaic(256, 256), pyramid=True)
    with pytest.raises(SlideError, match=r"pyramid.tif: level 4 does not exist; the file has levels 0: 256x256, 1: 128x128"):
        open_image(image, level=4)


def test_a_truncated_tiff_is_refused_naming_the_file(tmp_path):
    image = write_tiff(tmp_path / "cut.tif", mosaic(512, 512))
    data = image.read_bytes()
    image.write_bytes(data[: len(data) // 2])
    with pytest.raises(SlideError, match=r"cut.tif: .*truncated or its tags are wrong"):
        open_image(image)


def test_a_tile_that_does_not_decode_is_recorded_failed_and_the_others_are_stored(converted, tmp_path):
    pixels = mosaic(700, 700, seed=9)
    image = write_tiff(tmp_path / "bad.tif", pixels, tile=(128, 128))
    with tifffile.TiffFile(image) as tiff:
        page = tiff.pages[0]
        offset, count = page.dataoffsets[0], page.databytecounts[0]  # the top-left tile
        last = page.dataoffsets[-1], page.databytecounts[-1]  # the bottom-right one, whose map sizes the image's
    data = bytearray(image.read_bytes())
    data[offset:offset + count] = b"\xff" * count  # not zlib
    image.write_bytes(bytes(data))
    path = converted(True, False)
    with LocalScorer([path], settings=ON_DEMAND) as scorer, open_image(image) as reader:
        summary = score_slide(reader, scorer.score_request, scorer.model(), tmp_path / "out",
                              options=SlideOptions(canvas=256))
    assert summary.failed and not summary.complete and summary.scored + len(summary.failed) == summary.tiles
    assert all(re.match(r".*bad.tif: level 0 rows \d+\.\.\d+, columns \d+\.\.\d+ do not decode \(DeflateError", error)
               for error in summary.failed.values())
    records = [json.loads(line) for line in (tmp_path / "out" / "bad.tiles.jsonl").read_text().splitlines()]
    assert sum("failed" in record for record in records) == len(summary.failed)
    data[last[0]:last[0] + last[1]] = b"\xff" * last[1]
    image.write_bytes(bytes(data))
    with LocalScorer([path], settings=ON_DEMAND) as scorer, open_image(image) as reader:
        with pytest.raises(SlideError, match=r"bad.tif: .* do not decode .*; the map's size is taken from this tile"):
            score_slide(reader, scorer.score_request, scorer.model(), tmp_path / "again",
                        options=SlideOptions(canvas=256))
    assert not (tmp_path / "again" / "bad.zarr").exists()


def test_resuming_with_other_options_is_refused(converted, tmp_path):
    path = converted(True, False)
    image = write_tiff(tmp_path / "s.tif", mosaic(400, 400))
    with LocalScorer([path], settings=ON_DEMAND) as scorer:
        with open_image(image) as reader:
            score_slide(reader, scorer.score_request, scorer.model(), tmp_path, options=SlideOptions(canvas=256))
        with open_image(image) as reader, pytest.raises(RunError, match="other options .*halo"):
            score_slide(reader, scorer.score_request, scorer.model(), tmp_path, options=SlideOptions(canvas=256, halo=40))


def test_openslide_and_pil_read_the_same_pixels_as_tifffile(tmp_path):
    pixels = mosaic(300, 500, seed=11)
    tiff = write_tiff(tmp_path / "slide.tif", pixels)
    other = tmp_path / "slide.scan"  # not a TIFF suffix: OpenSlide recognises the tiled TIFF by its content
    other.write_bytes(tiff.read_bytes())
    png = tmp_path / "photo.png"
    Image.fromarray(pixels).save(png)
    region = (slice(37, 250), slice(101, 433))
    for path, kind in ((tiff, "TiffReader"), (other, "OpenSlideReader"), (png, "PilReader")):
        with open_image(path) as reader:
            assert type(reader).__name__ == kind
            np.testing.assert_array_equal(reader.read(*region), pixels[region])
