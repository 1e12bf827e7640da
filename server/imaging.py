"""Images in, input tensors out: decode, orient, convert to RGB, resize, normalize per the model card.

Everything here follows the card (protos/model_card.proto `Preprocessing`); the arithmetic
(`normalize`, layout, dtype) is convert.preprocessing's, the one the converter verified with.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from convert.preprocessing import normalize, to_layout
from protos.model_card_pb2 import Preprocessing
from protos.scoring_pb2 import RawImage

__all__ = ["FILTERS", "FORMATS", "ImageError", "check_pixels", "decode", "from_raw", "normalize", "resize",
           "to_batch", "to_rgb"]

FILTERS = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
    "box": Image.Resampling.BOX,
    "hamming": Image.Resampling.HAMMING,
}
FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "TIFF")
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")


class ImageError(ValueError):
    """Bytes or pixels that are not a usable image; the message says what was received."""


def decode(data: bytes, *, max_pixels: int) -> Image.Image:
    """An RGB image from encoded bytes, EXIF orientation applied; bombs refused before decoding."""
    if not data:
        raise ImageError("the image is empty (0 bytes); send JPEG, PNG, WebP, BMP or TIFF bytes, or raw pixels")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
        check_pixels(image.width, image.height, max_pixels=max_pixels)
        image.load()
        image = ImageOps.exif_transpose(image)
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        raise ImageError(f"image refused as a decompression bomb: {error}") from error
    except UnidentifiedImageError as error:
        raise ImageError(
            f"{len(data)} bytes starting {data[:8]!r} are not a JPEG, PNG, WebP, BMP or TIFF image"
        ) from error
    except (OSError, SyntaxError, ValueError) as error:
        raise ImageError(f"the image ({len(data)} bytes) could not be decoded: {error}") from error
    return to_rgb(image)


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


def from_raw(raw: RawImage, *, max_pixels: int) -> Image.Image:
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
    return Image.fromarray(np.ascontiguousarray(pixels[:, :, :3]), mode="RGB")


def resize(image: Image.Image, size: tuple[int, int], *, filter_name: str) -> np.ndarray:
    """[H, W, 3] uint8 at `size` (height, width), resized with the card's PIL filter."""
    try:
        resample = FILTERS[(filter_name or "bilinear").lower()]
    except KeyError as error:
        raise ImageError(f"model card resize_filter {filter_name!r} is not one of {sorted(FILTERS)}") from error
    height, width = size
    if (image.height, image.width) != (height, width):
        image = image.resize((width, height), resample=resample)
    return np.asarray(image, dtype=np.uint8)


def to_batch(images: list[np.ndarray], preprocessing: Preprocessing) -> np.ndarray:
    """Stack normalized [H, W, C] arrays into the graph's input: the card's layout and dtype."""
    return to_layout(np.stack(images), preprocessing)
