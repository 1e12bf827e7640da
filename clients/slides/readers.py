"""Reading a region of an image too large to decode whole: TIFF (tiled, striped, BigTIFF, pyramidal OME-TIFF and SVS)
through tifffile's Zarr view, other whole-slide formats through OpenSlide, anything else through PIL.

A reader decodes only the tiles or strips a region touches, so memory follows the region, not the
image (PIL formats excepted: PIL decodes the whole image). Large files are untrusted: a
reader checks the header before the first tile (clients.slides.tiff_checks), refuses a slide declaring
more pixels than `max_pixels`, and turns every failure of its library into a SlideError naming the
file and what is wrong; a region whose bytes are missing or do not decode is a TileError.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from clients.slides import DEFAULT_MAX_SLIDE_PIXELS, MAX_DECODE_BYTES, tiff_checks
from clients.slides.errors import SlideError, TileError, refused

__all__ = ["Level", "Reader", "SlideError", "TileError", "TIFF_SUFFIXES", "open_image"]

TIFF_SUFFIXES = (".tif", ".tiff", ".btf", ".tf8", ".svs", ".ome.tif", ".ome.tiff")


@dataclass(frozen=True)
class Level:
    """One resolution of an image: its size and how many level-0 pixels one of its pixels spans."""

    index: int
    height: int
    width: int
    downsample: float


class Reader:
    """Regions of one level of an image, as [h, w, 3] uint8 RGB."""

    path: Path
    levels: tuple[Level, ...]
    level: Level

    def read(self, rows: slice, columns: slice) -> np.ndarray:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def describe_levels(levels: tuple[Level, ...]) -> str:
    return ", ".join(f"{level.index}: {level.width}x{level.height}" for level in levels)


def choose_level(path: Path, levels: tuple[Level, ...], index: int, max_pixels: int) -> Level:
    """Level `index`, once the largest level is known to declare no more than `max_pixels`."""
    largest = max(levels, key=lambda level: level.height * level.width)
    if largest.height * largest.width > max_pixels:
        raise SlideError(f"{path}: level {largest.index} declares {largest.width}x{largest.height} = "
                         f"{largest.height * largest.width:,} pixels, over the limit of {max_pixels:,}; raise "
                         "--max-slide-pixels if the slide is real")
    if not 0 <= index < len(levels):
        raise SlideError(f"{path}: level {index} does not exist; the file has levels {describe_levels(levels)} "
                         "(width x height); choose one with --level")
    return levels[index]


def region_failed(reader: Reader, rows: slice, columns: slice, problem: str) -> TileError:
    return TileError(f"{reader.path}: level {reader.level.index} rows {rows.start}..{rows.stop}, columns "
                     f"{columns.start}..{columns.stop} do not decode ({problem})")


def to_rgb(pixels: np.ndarray, axes: str) -> np.ndarray:
    """[h, w, 3] uint8 from a region in `axes` order ('YX', 'YXS' or 'SYX'/'CYX' with 1, 3 or 4 samples)."""
    if axes in ("SYX", "CYX"):
        pixels = np.moveaxis(pixels, 0, -1)
    if pixels.ndim == 2:
        pixels = pixels[..., None]
    if pixels.shape[-1] == 1:
        return np.repeat(pixels, 3, axis=-1)
    return np.ascontiguousarray(pixels[..., :3])


class TiffReader(Reader):
    """TIFF through tifffile: each pyramid level a Zarr array whose chunks are the file's own tiles or strips."""

    def __init__(self, path: Path, *, level: int, max_pixels: int = DEFAULT_MAX_SLIDE_PIXELS) -> None:
        import zarr

        self.path = path
        self._tiff = tiff_checks.open_checked(path)
        try:
            with refused(path, "not a readable TIFF"):
                series = self._tiff.series[0]
                base = series.levels[0]
                axes = [(axis, size) for axis, size in zip(base.axes, base.shape) if size > 1 or axis in "YX"]
                self._axes, sizes = "".join(axis for axis, _ in axes), dict(axes)
                if self._axes not in ("YX", "YXS", "SYX", "CYX"):
                    raise SlideError(f"{path}: image axes {base.axes} of shape {base.shape}; expected a 2-D image "
                                     "(YX, YXS or CYX) in the first series")
                samples = sizes.get("S", sizes.get("C", 1))
                if base.dtype != np.uint8 or samples not in (1, 3, 4):
                    raise SlideError(f"{path}: {samples} samples per pixel of {base.dtype}; expected 8-bit (uint8) "
                                     "grey (1), RGB (3) or RGBA (4)")
                self.levels = tuple(Level(i, *self._size(lvl), base_shape_ratio(base, lvl))
                                    for i, lvl in enumerate(series.levels))
                self.level = choose_level(path, self.levels, level, max_pixels)
                self._pages = series.levels[level].pages
                self._array = zarr.open(series.levels[level].aszarr(), mode="r")
        except BaseException:
            self._tiff.close()
            raise

    @staticmethod
    def _size(level) -> tuple[int, int]:
        shape = dict(zip(level.axes, level.shape))
        return int(shape["Y"]), int(shape["X"])

    def read(self, rows: slice, columns: slice) -> np.ndarray:
        index = {"YX": (rows, columns), "YXS": (rows, columns, slice(None))}.get(self._axes, (slice(None), rows, columns))
        squeeze = tuple(0 for _ in range(self._array.ndim - len(index)))
        try:
            problems = [tiff_checks.tile_problem(page, rows, columns, self._tiff.filehandle) for page in self._pages]
            problem = next(filter(None, problems), None)
            if problem is None:
                with tiff_checks.structure_complaints() as complaints, warnings.catch_warnings():
                    warnings.simplefilter("error")  # tifffile warns, and fills with zeros, on a tile it cannot decode
                    pixels = np.asarray(self._array[squeeze + index])
                problem = "; ".join(complaints) or None
        except Exception as error:
            raise region_failed(self, rows, columns, f"{type(error).__name__}: {error}") from error
        if problem:
            raise region_failed(self, rows, columns, problem)
        return to_rgb(pixels, self._axes)

    def close(self) -> None:
        self._tiff.close()


def base_shape_ratio(base, level) -> float:
    """How many level-0 pixels one pixel of `level` spans (along X)."""
    return dict(zip(base.axes, base.shape))["X"] / dict(zip(level.axes, level.shape))["X"]


class OpenSlideReader(Reader):
    """Whole-slide formats OpenSlide reads (MIRAX, Hamamatsu, Leica, Ventana ...); transparent areas come out white."""

    def __init__(self, path: Path, *, level: int, max_pixels: int = DEFAULT_MAX_SLIDE_PIXELS) -> None:
        import openslide

        self.path = path
        with path.open("rb") as head:
            if head.read(4) in tiff_checks.TIFF_MAGIC:  # OpenSlide shows a tile the file lacks as background
                tiff_checks.open_checked(path).close()
        with refused(path, "OpenSlide cannot read it"):
            self._slide = openslide.OpenSlide(path)
        try:
            self.levels = tuple(Level(i, h, w, float(d)) for i, ((w, h), d) in
                                enumerate(zip(self._slide.level_dimensions, self._slide.level_downsamples)))
            self.level = choose_level(path, self.levels, level, max_pixels)
        except BaseException:
            self._slide.close()
            raise

    def read(self, rows: slice, columns: slice) -> np.ndarray:
        downsample = self.level.downsample
        try:
            region = self._slide.read_region((int(columns.start * downsample), int(rows.start * downsample)),
                                             self.level.index, (columns.stop - columns.start, rows.stop - rows.start))
        except Exception as error:  # OpenSlideError, or whatever its C library's answer to a damaged tile raises
            raise region_failed(self, rows, columns, f"{type(error).__name__}: {error}") from error
        rgba = np.asarray(region, dtype=np.float32)
        alpha = rgba[..., 3:] / 255
        return np.rint(rgba[..., :3] * alpha + 255 * (1 - alpha)).astype(np.uint8)

    def close(self) -> None:
        self._slide.close()


class PilReader(Reader):
    """Anything PIL opens; PIL decodes the whole image, so its header must be within `max_pixels` and its pixels
    within MAX_DECODE_BYTES (PIL's own bomb guard is off once server.scoring.imaging is imported, as --local does)."""

    def __init__(self, path: Path, *, level: int, max_pixels: int = DEFAULT_MAX_SLIDE_PIXELS) -> None:
        from PIL import Image

        self.path = path
        with warnings.catch_warnings(record=True) as notes:  # said with the error when the file fails
            warnings.simplefilter("always")
            with refused(path, "cannot be read as an image", notes=notes), Image.open(path) as image:
                self.levels = (Level(0, image.height, image.width, 1.0),)
                self.level = choose_level(path, self.levels, level, max_pixels)
                if image.height * image.width * 3 > MAX_DECODE_BYTES:
                    raise SlideError(f"{path}: {image.width}x{image.height} {image.format} image, which PIL decodes "
                                     f"whole: more than the {MAX_DECODE_BYTES:,} bytes one decode may take; "
                                     "write it as a tiled TIFF (e.g. 512x512 tiles)")
                self._pixels = np.asarray(image.convert("RGB"))
        for note in notes:
            warnings.warn_explicit(note.message, note.category, note.filename, note.lineno)

    def read(self, rows: slice, columns: slice) -> np.ndarray:
        return self._pixels[rows, columns]


def open_image(path: str | Path, *, level: int = 0, max_pixels: int = DEFAULT_MAX_SLIDE_PIXELS) -> Reader:
    """A reader of `level` of the image at `path`: tifffile for TIFF, OpenSlide for other slides, else PIL; a
    slide whose largest level declares more than `max_pixels` is refused by its header."""
    path = Path(path)
    if not path.is_file():
        raise SlideError(f"{path}: no such file")
    if path.name.lower().endswith(TIFF_SUFFIXES):
        return TiffReader(path, level=level, max_pixels=max_pixels)
    with contextlib.suppress(ImportError):
        import openslide

        with refused(path, "OpenSlide cannot read it"):
            vendor = openslide.OpenSlide.detect_format(path)
        if vendor is not None:
            return OpenSlideReader(path, level=level, max_pixels=max_pixels)
    return PilReader(path, level=level, max_pixels=max_pixels)
