"""Turn what users hold (paths, encoded bytes, PIL images, numpy arrays) into a request image.

Validated before anything is sent, with messages showing what was received and what was expected:
a wrong shape found on the server costs a round trip and reads worse.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Union

import grpc
import numpy as np
from PIL import Image, ImageOps

from clients.errors import ScoremapError
from protos import scoring_pb2

__all__ = ["ImageLike", "IMAGE_SIGNATURES", "image_fields", "looks_like_image", "open_photo"]

ImageLike = Union[str, os.PathLike, bytes, bytearray, memoryview, Image.Image, np.ndarray]

# Leading bytes of the encodings the server decodes (protos/scoring.proto: ScoreRequest.encoded).
IMAGE_SIGNATURES: tuple[tuple[int, bytes], ...] = (
    (0, b"\xff\xd8\xff"),          # JPEG
    (0, b"\x89PNG\r\n\x1a\n"),     # PNG
    (0, b"BM"),                    # BMP
    (0, b"II*\x00"),               # TIFF, little-endian
    (0, b"MM\x00*"),               # TIFF, big-endian
    (8, b"WEBP"),                  # RIFF....WEBP
)


def looks_like_image(head: bytes) -> bool:
    """Whether the first bytes of a file carry an image signature (content, not extension)."""
    return any(head[offset:offset + len(magic)] == magic for offset, magic in IMAGE_SIGNATURES)


def _invalid(message: str) -> ScoremapError:
    return ScoremapError(grpc.StatusCode.INVALID_ARGUMENT, message)


def _raw_from_array(array: np.ndarray) -> scoring_pb2.RawImage:
    if array.dtype != np.uint8:
        raise _invalid(
            f"image array has dtype {array.dtype}; expected uint8 pixels 0..255 "
            "(convert with `(x * 255).clip(0, 255).astype(np.uint8)` for floats in 0..1)"
        )
    if array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3 or array.shape[2] not in (1, 3, 4):
        raise _invalid(
            f"image array has shape {tuple(array.shape)}; expected [height, width] or "
            "[height, width, channels] with 1, 3 or 4 channels"
        )
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise _invalid(f"image array has shape {tuple(array.shape)}; height and width must be positive")
    height, width, channels = array.shape
    return scoring_pb2.RawImage(
        data=np.ascontiguousarray(array).tobytes(), height=height, width=width, channels=channels
    )


def image_fields(image: ImageLike) -> dict[str, object]:
    """The ScoreRequest fields carrying `image`: {"encoded": bytes} or {"raw": RawImage}.

    Paths and bytes go as encoded bytes (smaller on the wire; the server decodes them), PIL images
    and arrays as raw RGB(A)/grey pixels.
    """
    if isinstance(image, (str, os.PathLike)):
        path = Path(image)
        if not path.is_file():
            raise _invalid(f"image path {str(path)!r} is not a file")
        data = path.read_bytes()
        if not looks_like_image(data[:16]):
            raise _invalid(
                f"{str(path)!r} does not start with a JPEG, PNG, WebP, BMP or TIFF signature "
                f"(first bytes {data[:8]!r})"
            )
        return {"encoded": data}
    if isinstance(image, (bytes, bytearray, memoryview)):
        data = bytes(image)
        if not looks_like_image(data[:16]):
            raise _invalid(
                f"encoded image bytes start with {data[:8]!r}; expected a JPEG, PNG, WebP, BMP "
                "or TIFF signature (pass raw pixels as a numpy array instead)"
            )
        return {"encoded": data}
    if isinstance(image, Image.Image):
        if image.mode not in ("L", "RGB", "RGBA"):
            image = image.convert("RGB")
        return {"raw": _raw_from_array(np.asarray(image))}
    if isinstance(image, np.ndarray):
        return {"raw": _raw_from_array(image)}
    raise _invalid(
        f"cannot score an image of type {type(image).__name__}; expected a path, encoded bytes, "
        "a PIL image or a uint8 numpy array [height, width(, channels)]"
    )


def open_photo(image: ImageLike) -> Image.Image:
    """The image as an RGB PIL image, EXIF orientation applied as the server does (for drawing)."""
    if isinstance(image, (str, os.PathLike)):
        with Image.open(image) as opened:
            return ImageOps.exif_transpose(opened).convert("RGB")
    if isinstance(image, (bytes, bytearray, memoryview)):
        with Image.open(io.BytesIO(bytes(image))) as opened:
            return ImageOps.exif_transpose(opened).convert("RGB")
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, np.ndarray):
        raw = _raw_from_array(image)
        pixels = np.frombuffer(raw.data, np.uint8).reshape(raw.height, raw.width, raw.channels)
        return Image.fromarray(pixels[:, :, 0] if raw.channels == 1 else pixels).convert("RGB")
    raise _invalid(f"cannot open an image of type {type(image).__name__}")
