"""Reading a region of an image too large to decode whole: TIFF (tiled, striped, BigTIFF, pyramidal OME-TIFF and SVS)
through tifffile's Zarr view, other whole-slide formats through OpenSlide, anything else through PIL.

A reader decodes only the tiles or strips a region touches, so memory follows the region, not the
image (PIL formats excepted: PIL decodes the whole image). Large files are untrusted: a level that
does not exist, samples that are not 8-bit RGB or grey, tags that promise data the file does not
hold, or a tile that does not decode give a SlideError naming the file and what is wrong.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TIFF_SUFFIXES = (".tif", ".tiff", ".btf", ".tf8", ".svs", ".ome.tif", ".ome.tiff")


class SlideError(Exception):
    """A large image that cannot be read as asked; the message names the file and the problem."""


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


def choose_level(path: Path, levels: tuple[Level, ...], index: int) -> Level:
    if not 0 <= index < len(levels):
        raise SlideError(f"{path}: level {index} does not exist; the file has levels {describe_levels(levels)} "
                         "(width x height); choose one with --level")
    return levels[index]


def to_rgb(path: Path, pixels: np.ndarray, axes: str) -> np.ndarray:
    """[h, w, 3] uint8 from a region in `axes` order ('YX', 'YXS' or 'SYX'/'CYX' with 1, 3 or 4 samples)."""
    if pixels.dtype != np.uint8:
        raise SlideError(f"{path}: samples are {pixels.dtype}; expected 8-bit (uint8) RGB or grey images")
    if axes in ("SYX", "CYX"):
        pixels = np.moveaxis(pixels, 0, -1)
    if pixels.ndim == 2:
        pixels = pixels[..., None]
    if pixels.shape[-1] not in (1, 3, 4):
        raise SlideError(f"{path}: {pixels.shape[-1]} samples per pixel; expected 1 (grey), 3 (RGB) or 4 (RGBA)")
    if pixels.shape[-1] == 1:
        return np.repeat(pixels, 3, axis=-1)
    return np.ascontiguousarray(pixels[..., :3])


class TiffReader(Reader):
    """TIFF through tifffile: each pyramid level a Zarr array whose chunks are the file's own tiles or strips."""

    def __init__(self, path: Path, *, level: int) -> None:
        import tifffile
        import zarr

        self.path = path
        try:
            self._tiff = tifffile.TiffFile(path)
        except (tifffile.TiffFileError, OSError, ValueError) as error:
            raise SlideError(f"{path}: not a readable TIFF ({error})") from error
        try:
            series = self._tiff.series[0]
            base = series.levels[0]
            self._axes = "".join(axis for axis, size in zip(base.axes, base.shape) if size > 1 or axis in "YX")
            if self._axes not in ("YX", "YXS", "SYX", "CYX"):
                raise SlideError(f"{path}: image axes {base.axes} of shape {base.shape}; expected a 2-D image "
                                 "(YX, YXS or CYX) in the first series")
            self.levels = tuple(Level(i, *self._size(lvl), base_shape_ratio(base, lvl))
                                for i, lvl in enumerate(series.levels))
            self.level = choose_level(path, self.levels, level)
            chosen = series.levels[level]
            self._check_data(chosen)
            self._array = zarr.open(chosen.aszarr(), mode="r")
        except BaseException:
            self._tiff.close()
            raise

    @staticmethod
    def _size(level) -> tuple[int, int]:
        shape = dict(zip(level.axes, level.shape))
        return int(shape["Y"]), int(shape["X"])

    def _check_data(self, level) -> None:
        """Every tile or strip the tags promise lies inside the file (a truncated or lying file is refused now)."""
        size = self._tiff.filehandle.size
        for page in level.pages:
            if page is None:
                continue
            for offset, count in zip(page.dataoffsets, page.databytecounts):
                if count and offset + count > size:
                    raise SlideError(
                        f"{self.path}: the file is truncated or its tags are wrong: level {self.level.index} "
                        f"claims data at bytes {offset}..{offset + count}, but the file has {size} bytes")

    def read(self, rows: slice, columns: slice) -> np.ndarray:
        index = {"YX": (rows, columns), "YXS": (rows, columns, slice(None))}.get(self._axes, (slice(None), rows, columns))
        squeeze = tuple(0 for _ in range(self._array.ndim - len(index)))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # tifffile warns, and fills with zeros, on a tile it cannot decode
                pixels = np.asarray(self._array[squeeze + index])
        except Exception as error:
            raise SlideError(f"{self.path}: level {self.level.index} rows {rows.start}..{rows.stop}, columns "
                             f"{columns.start}..{columns.stop} do not decode ({type(error).__name__}: {error})") from error
        return to_rgb(self.path, pixels, self._axes)

    def close(self) -> None:
        self._tiff.close()


def base_shape_ratio(base, level) -> float:
    """How many level-0 pixels one pixel of `level` spans (along X)."""
    return dict(zip(base.axes, base.shape))["X"] / dict(zip(level.axes, level.shape))["X"]


class OpenSlideReader(Reader):
    """Whole-slide formats OpenSlide reads (MIRAX, Hamamatsu, Leica, Ventana ...); transparent areas come out white."""

    def __init__(self, path: Path, *, level: int) -> None:
        import openslide

        self.path = path
        try:
            self._slide = openslide.OpenSlide(path)
        except openslide.OpenSlideError as error:
            raise SlideError(f"{path}: OpenSlide cannot read it ({error})") from error
        self.levels = tuple(Level(i, h, w, float(d)) for i, ((w, h), d) in
                            enumerate(zip(self._slide.level_dimensions, self._slide.level_downsamples)))
        self.level = choose_level(path, self.levels, level)

    def read(self, rows: slice, columns: slice) -> np.ndarray:
        import openslide

        downsample = self.level.downsample
        try:
            region = self._slide.read_region((int(columns.start * downsample), int(rows.start * downsample)),
                                             self.level.index, (columns.stop - columns.start, rows.stop - rows.start))
        except openslide.OpenSlideError as error:
            raise SlideError(f"{self.path}: rows {rows.start}..{rows.stop}, columns {columns.start}..{columns.stop} "
                             f"do not decode ({error})") from error
        rgba = np.asarray(region, dtype=np.float32)
        alpha = rgba[..., 3:] / 255
        return np.rint(rgba[..., :3] * alpha + 255 * (1 - alpha)).astype(np.uint8)

    def close(self) -> None:
        self._slide.close()


class PilReader(Reader):
    """Anything PIL opens; PIL decodes the whole image (its decompression-bomb limit applies)."""

    def __init__(self, path: Path, *, level: int) -> None:
        from PIL import Image, UnidentifiedImageError

        self.path = path
        try:
            with Image.open(path) as image:
                self._pixels = np.asarray(image.convert("RGB"))
        except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as error:
            raise SlideError(f"{path}: cannot be read as an image ({error})") from error
        height, width = self._pixels.shape[:2]
        self.levels = (Level(0, height, width, 1.0),)
        self.level = choose_level(path, self.levels, level)

    def read(self, rows: slice, columns: slice) -> np.ndarray:
        return self._pixels[rows, columns]


def open_image(path: str | Path, *, level: int = 0) -> Reader:
    """A reader of `level` of the image at `path`: tifffile for TIFF, OpenSlide for other slides, else PIL."""
    path = Path(path)
    if not path.is_file():
        raise SlideError(f"{path}: no such file")
    if path.name.lower().endswith(TIFF_SUFFIXES):
        return TiffReader(path, level=level)
    with contextlib.suppress(ImportError):
        import openslide

        if openslide.OpenSlide.detect_format(path) is not None:
            return OpenSlideReader(path, level=level)
    return PilReader(path, level=level)
