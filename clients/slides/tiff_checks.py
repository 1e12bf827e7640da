"""What a TIFF must be before its first tile is read, and what a tile's bytes must be when it is.

tifffile trusts a file's tags: a declared size the tile table does not cover reads as zeros, a tile
with no bytes as its fill value, a truncated JPEG tile as grey, and its complaints about the file's
structure are log lines. Here each is an error that names the file, what disagrees, and the numbers.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tifffile import COMPRESSION, PHOTOMETRIC, TIFF

from clients.slides import MAX_DECODE_BYTES
from clients.slides.errors import SlideError, refused

__all__ = ["TIFF_MAGIC", "open_checked", "check_level", "tile_problem", "structure_complaints"]

# Colour models whose decoded samples are grey or RGB as they stand (libjpeg turns YCbCr JPEG tiles into RGB;
# tifffile leaves other YCbCr tiles, MINISWHITE, palettes and CMYK undecoded into RGB).
PHOTOMETRIC_READ = {PHOTOMETRIC.MINISBLACK: None, PHOTOMETRIC.RGB: None, PHOTOMETRIC.YCBCR: COMPRESSION.JPEG}
TIFF_MAGIC = (b"II*\0", b"MM\0*", b"II+\0", b"MM\0+")  # classic and BigTIFF, either byte order
JPEG_END = b"\xff\xd9"  # a JPEG stream's end-of-image marker: libjpeg decodes a tile cut before it as grey
JPEG_TAIL = 16  # bytes read from a JPEG tile's end to find the marker (some writers pad with zeros)
_REPR = re.compile(r"^<[^>]*>\s*")  # tifffile's messages start with the object's repr


@contextlib.contextmanager
def structure_complaints() -> Iterator[list[str]]:
    """tifffile's warnings and errors about a file's structure, kept (not logged) to be raised as errors."""
    complaints: list[str] = []

    def keep(record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        complaints.append(_REPR.sub("", record.getMessage()))
        return False

    logger = logging.getLogger("tifffile")
    logger.addFilter(keep)
    try:
        yield complaints
    finally:
        logger.removeFilter(keep)


def _refuse_complaints(path: Path, complaints: list[str]) -> None:
    if complaints:
        raise SlideError(f"{path}: the file's structure is damaged; tifffile says: {'; '.join(complaints)}")


def open_checked(path: Path):
    """The TiffFile at `path`, once its first series' every level passes check_level and tifffile has not
    complained of the file's structure while reading it; a SlideError otherwise."""
    import tifffile

    with structure_complaints() as complaints, refused(path, "not a readable TIFF"):
        tiff = tifffile.TiffFile(path)
        try:
            if not tiff.series:
                _refuse_complaints(path, complaints)
                raise SlideError(f"{path}: the file holds no image")
            for index, level in enumerate(tiff.series[0].levels):
                check_level(path, index, level.pages, tiff.filehandle.size)
            _refuse_complaints(path, complaints)
        except BaseException:
            tiff.close()
            raise
        return tiff


def _name(kind, value: int) -> str:
    try:
        return kind(value).name
    except ValueError:
        return "unknown"


def _describe(page) -> str:
    if page.is_tiled:
        return f"in {page.tilewidth}x{page.tilelength} tiles"
    return f"in strips of {page.rowsperstrip} rows"


def _check_format(path: Path, index: int, page) -> None:
    compression, photometric = int(page.compression), int(page.photometric)
    if compression not in TIFF.DECOMPRESSORS:
        raise SlideError(f"{path}: level {index} is compressed with {_name(COMPRESSION, compression)} "
                         f"({compression}), which this reader cannot decode")
    if photometric not in PHOTOMETRIC_READ or PHOTOMETRIC_READ[photometric] not in (None, compression):
        raise SlideError(f"{path}: level {index} has photometric {_name(PHOTOMETRIC, photometric)} ({photometric}) "
                         f"with compression {_name(COMPRESSION, compression)}; this reader reads MINISBLACK (grey), "
                         "RGB, and YCBCR in JPEG tiles")


def check_level(path: Path, index: int, pages, file_size: int) -> None:
    """Every page of level `index`: a codec and colour model the reader supports, a tile table as long as the
    declared size needs, and every tile's bytes inside the file."""
    for number, page in enumerate(pages):
        if page is None:
            raise SlideError(f"{path}: page {number} of level {index} is missing from the file")
        keyframe = page.keyframe
        _check_format(path, index, keyframe)
        itemsize = keyframe.bitspersample // 8
        chunk_bytes = math.prod(keyframe.chunks) * itemsize
        if chunk_bytes > MAX_DECODE_BYTES:
            raise SlideError(f"{path}: level {index} stores its pixels {_describe(keyframe)}, {chunk_bytes:,} bytes "
                             f"each decoded, over the {MAX_DECODE_BYTES:,} bytes one decode may take; write it as a "
                             "tiled TIFF (e.g. 512x512 tiles)")
        offsets = np.asarray(page.dataoffsets, np.int64)
        counts = np.asarray(page.databytecounts, np.int64)
        expected = math.prod(keyframe.chunked)
        if len(offsets) != expected or len(counts) != expected:
            raise SlideError(
                f"{path}: level {index} declares {keyframe.imagewidth}x{keyframe.imagelength} pixels "
                f"{_describe(keyframe)}, which takes {expected} tiles or strips, but its tile table holds "
                f"{len(offsets)} offsets and {len(counts)} byte counts; the header and the tile table disagree")
        past = np.flatnonzero((counts > 0) & (offsets + counts > file_size))
        if past.size:
            first = int(past[0])
            raise SlideError(
                f"{path}: the file is truncated or its tags are wrong: level {index} claims data at bytes "
                f"{offsets[first]}..{offsets[first] + counts[first]} (tile {first}, and {past.size - 1} more past "
                f"the end), but the file has {file_size} bytes")
        if int(keyframe.compression) == COMPRESSION.NONE:
            needed = keyframe.imagewidth * keyframe.imagelength * keyframe.samplesperpixel * itemsize
            if counts.sum() < needed:
                raise SlideError(
                    f"{path}: level {index} declares {keyframe.imagewidth}x{keyframe.imagelength} uncompressed "
                    f"pixels ({needed} bytes), but its tiles hold {counts.sum()} bytes")


def _chunks(page, rows: slice, columns: slice) -> Iterator[int]:
    """Indices into the tile table of the tiles or strips holding `rows` x `columns` (TIFF's order: planes,
    then rows of tiles, then tiles)."""
    height = page.tilelength if page.is_tiled else page.rowsperstrip
    width = page.tilewidth if page.is_tiled else page.imagewidth
    down, across = -(-page.imagelength // height), -(-page.imagewidth // width)
    planes = page.samplesperpixel if page.planarconfig == 2 else 1
    for plane in range(planes):
        for row in range(rows.start // height, -(-rows.stop // height)):
            for column in range(columns.start // width, -(-columns.stop // width)):
                yield (plane * down + row) * across + column


def tile_problem(page, rows: slice, columns: slice, filehandle) -> str | None:
    """Why the file's tiles under `rows` x `columns` would read as something they do not hold (no bytes: the fill
    value; a JPEG tile cut short: grey), or None."""
    keyframe = page.keyframe
    jpeg = int(keyframe.compression) == COMPRESSION.JPEG
    for chunk in _chunks(keyframe, rows, columns):
        offset, count = int(page.dataoffsets[chunk]), int(page.databytecounts[chunk])
        if not offset or not count:
            return f"tile {chunk} of the file's tile table has no bytes (offset {offset}, byte count {count})"
        if jpeg:
            with filehandle.lock:
                filehandle.seek(offset + max(count - JPEG_TAIL, 0))
                tail = filehandle.read(min(count, JPEG_TAIL))
            if not tail.rstrip(b"\0").endswith(JPEG_END):
                return (f"JPEG tile {chunk} (bytes {offset}..{offset + count}) ends without its end-of-image "
                        "marker: it is truncated")
    return None
