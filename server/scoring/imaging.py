"""The decode stage: image bytes or raw pixels to uint8 canvases, one per scale (and its mirror).

An image is first *opened* (`open_image`): PIL reads the header only, so its size is known, and
bombs are refused, before any pixel is decoded. `canvases` then takes one of two paths (`direct_path`):
- direct: an upright colour JPEG that every scale keeps at its size, or enlarges on both axes with the
  card's bilinear filter, is decoded by libjpeg-turbo straight into numpy (`stored_pixels`, bit for bit
  PIL's decode) and resized by OpenCV onto its canvas (`enlarge`): within one grey level of PIL's
  bilinear, which defines the filter, at a third of the CPU (cat.jpg to 576x384, 0.9 ms against 2.7;
  docs/design.md: OpenCV only for enlarging);
- PIL: everything else. `load` decodes — a large JPEG in PIL's draft mode, which lets the decoder skip
  detail finer than the largest size asked for (12 MP: 67 ms full, 32 ms draft on a 2-core CPU) —
  applies the EXIF orientation and converts any mode to RGB; `resize` uses the card's PIL filter. A
  shrink stays here: PIL's filters are antialiased and OpenCV's are not.
Normalisation happens on the device (server/engine/device_graph.py), so everything here stays uint8.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass

import cv2
import imagecodecs
import numpy as np
import pillow_heif
from PIL import Image, ImageOps

from protos import image_formats
from protos.scoring_pb2 import RawImage
from server.geometry import dense
from server.scoring.request import ItemKey, ScaleJob

__all__ = ["FILTERS", "FORMATS", "FORMAT_NAMES", "ImageError", "OpenedImage", "check_encoded", "check_pixels", "decode", "direct_path",
           "from_raw", "load", "open_image", "resample_filter", "resize", "to_rgb"]

FILTERS = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
    "box": Image.Resampling.BOX,
    "hamming": Image.Resampling.HAMMING,
}
FORMATS = tuple(image_formats.FORMATS)  # PIL's names of the formats opened (protos/image_formats.py)
FORMAT_NAMES = image_formats.NAMES
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")
TRANSPOSED_ORIENTATIONS = (5, 6, 7, 8)  # EXIF orientations that swap width and height
EXIF_ORIENTATION = 0x0112
JPEG_END = b"\xff\xd9"  # the EOI marker a whole JPEG ends with
# What the decoders raise for bytes they cannot read (UnidentifiedImageError is an OSError; Pillow's AVIF
# decoder raises RuntimeError for some broken files).
DECODE_ERRORS = (OSError, SyntaxError, ValueError, RuntimeError)
DRAFT_FACTOR = 2  # draft-decode only when the image is at least this much larger than needed
# `check_pixels` applies --max-image-pixels to every image's header before any pixel is decoded; PIL's
# own fixed guard (89 Mpx) would otherwise refuse larger images whatever the flag says.
Image.MAX_IMAGE_PIXELS = None
# HEIC through pillow-heif, which applies the container's rotation and mirror as it decodes and reports the
# EXIF orientation 1 (the original in info["original_orientation"]), so an image is turned once, as a JPEG is.
pillow_heif.register_heif_opener()
# One thread per resize: the server already decodes several requests at once (--decode-threads, one per core),
# and OpenCV's own pool would only contend with them.
cv2.setNumThreads(1)


class ImageError(ValueError):
    """Bytes or pixels that are not a usable image; the message says what was received."""


@dataclass
class OpenedImage:
    """An image whose header is read: its upright size, and the PIL image not yet decoded (or raw pixels);
    `encoded` the request's bytes and `orientation` their EXIF orientation (1: stored upright)."""

    height: int
    width: int
    image: Image.Image
    encoded_bytes: int = 0
    encoded: bytes | None = None
    orientation: int = 1


def signature(data: bytes) -> str | None:
    """The accepted format the bytes start like, if any, as PIL's plugins (which open them) tell it."""
    Image.init()  # registers the plugins; at once after the first call
    return next((name for name in FORMATS if Image.OPEN[name][1](data[:16])), None)


def check_encoded(data: bytes) -> None:
    """Refuse bytes that cannot be an accepted image, from their first bytes alone (no header parsed)."""
    if not data:
        raise ImageError(f"the image is empty (0 bytes); send the bytes of an image file ({FORMAT_NAMES}), or raw "
                         "pixels")
    if signature(data) is None:
        raise ImageError(f"{len(data)} bytes starting {data[:8]!r} are not an image this server reads: it takes "
                         f"{FORMAT_NAMES}")


def open_image(data: bytes, *, max_pixels: int) -> OpenedImage:
    """Read the header of encoded bytes (no pixel decoded): the upright size; bombs refused here."""
    check_encoded(data)
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
        check_pixels(image.width, image.height, max_pixels=max_pixels)
        # The base class's reader: PNG's own decodes every pixel to look for EXIF after them. An EXIF block
        # stored after a PNG's pixels (rare; PIL and cameras write it before) is then not applied, at
        # load either (PIL keeps the EXIF read here): the image stays as stored, never distorted.
        orientation = Image.Image.getexif(image).get(EXIF_ORIENTATION, 1)
    except ImageError:
        raise
    except DECODE_ERRORS as error:
        raise ImageError(f"cannot decode the {signature(data)} image ({len(data)} bytes): {error}") from error
    height, width = image.height, image.width
    if orientation in TRANSPOSED_ORIENTATIONS and stored_size(image) == (width, height):
        height, width = width, height
    return OpenedImage(height, width, image, len(data), data, orientation)


def stored_size(image: Image.Image) -> tuple[int, int]:
    """(width, height) as the pixels are stored, from the decoder tiles: Pillow's TIFF reader already reports
    the upright size of an Orientation 5-8 image, where the other readers report the stored one."""
    if not image.tile:
        return image.size
    return max(tile.extents[2] for tile in image.tile), max(tile.extents[3] for tile in image.tile)


def load(opened: OpenedImage, *, largest: tuple[int, int]) -> Image.Image:
    """Decode an opened image upright in RGB; a JPEG much larger than `largest` (height, width) in draft mode."""
    image = opened.image
    try:
        if image.format == "JPEG" and min(opened.height / largest[0], opened.width / largest[1]) >= DRAFT_FACTOR:
            needed = largest if (image.height, image.width) == (opened.height, opened.width) else largest[::-1]
            image.draft("RGB", (needed[1], needed[0]))
        image.load()
        ImageOps.exif_transpose(image, in_place=True)  # not a copy of every upright image
    except DECODE_ERRORS as error:
        raise ImageError(f"cannot decode the {image.format} image ({opened.encoded_bytes} bytes): {error}") from error
    return to_rgb(image)


def stored_pixels(opened: OpenedImage) -> np.ndarray | None:
    """An upright colour JPEG's pixels as libjpeg-turbo decodes them, straight into numpy (imagecodecs), or None
    for any other image. The same values as PIL's decoder, built on the same library (tested bit for bit),
    without PIL's copy to numpy, which holds the GIL throughout: about 0.55x the CPU of PIL's path, measured
    (docs/design.md: the host's cost per request). Used where `direct_path` says so."""
    image = opened.image
    if image.format != "JPEG" or image.mode != "RGB" or opened.orientation != 1 or opened.encoded is None:
        return None
    if not opened.encoded.endswith(JPEG_END):  # cut short, or data after the image: PIL's decoder says which
        return None  # (libjpeg-turbo fills a cut image with grey where PIL refuses it)
    try:
        return imagecodecs.jpeg8_decode(opened.encoded)
    except imagecodecs.Jpeg8Error as error:
        raise ImageError(f"cannot decode the JPEG image ({opened.encoded_bytes} bytes): {error}") from error


def decode(data: bytes, *, max_pixels: int) -> Image.Image:
    """An RGB image from encoded bytes, EXIF orientation applied, at full resolution."""
    opened = open_image(data, max_pixels=max_pixels)
    return load(opened, largest=(opened.height, opened.width))


def check_pixels(width: int, height: int, *, max_pixels: int) -> None:
    if width <= 0 or height <= 0:
        raise ImageError(f"image size {width}x{height} is empty")
    if width * height > max_pixels:
        raise ImageError(
            f"image of {width}x{height} = {width * height} pixels exceeds the limit of {max_pixels} pixels "
            "(decompression-bomb guard; raise --max-image-pixels if this is intended)"
        )


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB from any mode: 16-bit scaled to 8 bits (not clipped), alpha dropped, CMYK/palette converted."""
    if image.mode == "RGB":
        return image
    if image.mode in SIXTEEN_BIT_MODES:
        values = np.asarray(image).astype(np.float64)
        peak = 65535.0 if image.mode != "I" or values.max(initial=0) > 255 else 255.0
        gray = np.clip(np.round(values * 255.0 / peak), 0, 255).astype(np.uint8)
        return Image.fromarray(gray).convert("RGB")
    if image.mode == "F":
        return Image.fromarray(np.clip(np.asarray(image), 0, 255).astype(np.uint8)).convert("RGB")
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    return image.convert("RGB")


def from_raw(raw: RawImage, *, max_pixels: int) -> OpenedImage:
    """An RGB image from raw uint8 [height, width, channels] pixels (channels 1, 3 or 4)."""
    if raw.channels not in (1, 3, 4):
        raise ImageError(f"raw image channels must be 1, 3 or 4; received {raw.channels}")
    if raw.height <= 0 or raw.width <= 0:
        raise ImageError(f"raw image height and width must be positive; received {raw.height}x{raw.width}")
    check_pixels(raw.width, raw.height, max_pixels=max_pixels)
    expected = raw.height * raw.width * raw.channels
    if len(raw.data) != expected:
        raise ImageError(
            f"raw image data has {len(raw.data)} bytes; shape [{raw.height}, {raw.width}, {raw.channels}] of "
            f"uint8 needs {expected}"
        )
    pixels = np.frombuffer(raw.data, dtype=np.uint8).reshape(raw.height, raw.width, raw.channels)
    if raw.channels == 1:
        pixels = np.repeat(pixels, 3, axis=2)
    image = Image.fromarray(np.ascontiguousarray(pixels[:, :, :3]), mode="RGB")
    return OpenedImage(raw.height, raw.width, image)


def resample_filter(name: str) -> Image.Resampling:
    """The PIL filter a card names (bilinear when it names none); ImageError naming the choices."""
    try:
        return FILTERS[(name or "bilinear").lower()]
    except KeyError:
        raise ImageError(f"model card resize_filter {name!r} is not one of {sorted(FILTERS)}") from None


def resize(image: Image.Image, size: tuple[int, int], *, filter_name: str) -> np.ndarray:
    """[H, W, 3] uint8 at `size` (height, width), resized with the card's PIL filter."""
    resample = resample_filter(filter_name)
    height, width = size
    if (image.height, image.width) != (height, width):
        image = image.resize((width, height), resample=resample)
    return np.asarray(image, dtype=np.uint8)


def direct_path(opened: OpenedImage, jobs: list[ScaleJob], *, resize_filter: str) -> bool:
    """Whether the request's pixels may skip PIL (libjpeg-turbo, then OpenCV): every scale keeps the stored size,
    or the card's filter is bilinear and every scale keeps or enlarges both axes. Enlarging, OpenCV's bilinear is
    within one grey level of PIL's (fixed-point rounding); shrinking, PIL's is antialiased and OpenCV's is not (up
    to 40 levels apart), and PIL's other filters have no OpenCV twin. `stored_pixels` still refuses all but an
    upright colour JPEG."""
    stored = (opened.height, opened.width)
    if all(job.resized == stored for job in jobs):
        return True
    enlarged = all(job.resized[0] >= stored[0] and job.resized[1] >= stored[1] for job in jobs)
    return enlarged and resample_filter(resize_filter) == Image.Resampling.BILINEAR


def enlarge(pixels: np.ndarray, size: tuple[int, int], *, out: np.ndarray | None = None) -> np.ndarray:
    """`pixels` at `size` (height, width), no axis smaller, into `out` if given: OpenCV's bilinear, within one
    grey level of PIL's (tested) at about a fifth of its CPU, to numpy."""
    if pixels.shape[:2] != size:
        return cv2.resize(pixels, (size[1], size[0]), dst=out, interpolation=cv2.INTER_LINEAR)
    if out is None:
        return pixels
    out[...] = pixels
    return out


def on_canvas(region: np.ndarray, size: tuple[int, int], fill: np.ndarray, *, mirrored: bool,
              out: np.ndarray | None = None) -> np.ndarray:
    """`region` at the top left of a canvas of `size` (`out` when given), flipped left to right if `mirrored`: by
    OpenCV, straight onto the canvas, 20x cheaper than numpy's copy of a reversed view, which goes 3-byte pixel by
    pixel."""
    if not mirrored:
        return dense.canvas(region, size, fill, out=out)
    height, width = region.shape[:2]
    out = dense.frame((height, width), size, fill, out=out)
    cv2.flip(region, 1, dst=out[:height, :width])
    return out


def canvases(opened: OpenedImage, jobs: list[ScaleJob], flips: tuple[bool, ...], *, fill: np.ndarray,
             resize_filter: str, allocate: Callable[[tuple[int, ...]], np.ndarray] | None = None,
             ) -> dict[ItemKey, np.ndarray]:
    """Decode once (down to the largest size asked for), then per scale resize and put on its canvas, and its
    mirror (a tiled scale: each tile's region on the bucket's canvas): one canvas per item, by its key, each made
    by `allocate` (the engine's shared memory; else the heap). On the direct path an untiled scale is resized
    straight onto its canvas."""
    allocate = allocate or (lambda shape: np.empty(shape, dtype=np.uint8))
    largest = max((job.resized for job in jobs), key=lambda size: size[0] * size[1])
    stored = stored_pixels(opened) if direct_path(opened, jobs, resize_filter=resize_filter) else None
    image = load(opened, largest=largest) if stored is None else None
    placed = {}
    for index, job in enumerate(jobs):
        height, width = job.resized
        whole = None
        if stored is None:
            pixels = resize(image, job.resized, filter_name=resize_filter)
        elif job.tiles:
            pixels = enlarge(stored, job.resized)
        else:
            whole = dense.frame(job.resized, job.canvas, fill, out=allocate((*job.canvas, 3)))
            pixels = enlarge(stored, job.resized, out=whole[:height, :width])
        regions = [pixels[tile.tile.region] for tile in job.tiles] or [pixels]
        for flip in flips:
            for part, region in enumerate(regions):
                done = whole is not None and not flip  # resized onto its canvas already
                key = ItemKey(index, flip, part)
                placed[key] = whole if done else on_canvas(region, job.canvas, fill, mirrored=flip,
                                                           out=allocate((*job.canvas, 3)))
    return placed
