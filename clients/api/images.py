"""Turn what users hold (paths, encoded bytes, PIL images, numpy arrays) into a request image.

Validated before anything is sent, with messages showing what was received and what was expected:
a wrong shape found on the server costs a round trip and reads worse.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Union

import grpc
import numpy as np
from PIL import Image, ImageFile, ImageOps

from clients.api.errors import ScoremapError
from protos import scoring_pb2

__all__ = ["ImageLike", "image_fields", "looks_like_image", "open_photo"]

ImageLike = Union[str, os.PathLike, bytes, bytearray, memoryview, Image.Image, np.ndarray]


def _invalid(message: str) -> ScoremapError:
    return ScoremapError(grpc.StatusCode.INVALID_ARGUMENT, message)


def _server_imaging():
    """server/scoring/imaging.py, the one definition of which bytes are an image and how any image mode becomes the
    RGB the model sees; imported when an image is checked or converted, so `--help` of the command lines
    imports nothing of the server."""
    from server.scoring import imaging

    return imaging


def looks_like_image(head: bytes) -> bool:
    """Whether the first bytes of a file carry the signature of a format the server opens (content, not
    extension), by the server's own test (server/scoring/imaging.py `signature`: PIL's plugins, BigTIFF included)."""
    return _server_imaging().signature(head) is not None


def _encoded(data: bytes, *, source: str = "") -> dict[str, object]:
    """{"encoded": data}, or the server's own refusal of `data` (named by `source`, a path, if given)."""
    imaging = _server_imaging()
    try:
        imaging.check_encoded(data)
    except imaging.ImageError as error:
        raise _invalid(f"{source!r}: {error}" if source else str(error)) from None
    return {"encoded": data}


def _refused(what: str, why: str) -> ScoremapError:
    return _invalid(f"cannot score {what} faithfully: {why}; convert it to 8-bit RGB first, "
                    "e.g. `(x * 255).clip(0, 255).astype(np.uint8)` for floats in 0..1")


def _check_shape(array: np.ndarray) -> None:
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] not in (1, 3, 4)):
        raise _invalid(
            f"image array has shape {tuple(array.shape)}; expected [height, width] or "
            "[height, width, channels] with 1, 3 or 4 channels"
        )
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise _invalid(f"image array has shape {tuple(array.shape)}; height and width must be positive")


def _array_pixels(array: np.ndarray) -> np.ndarray:
    """uint8 [H, W(, C)] pixels of an array, as the server would decode the array saved as a file.

    A one-channel array is the image PIL's `Image.fromarray` makes of it (bool: mode 1, uint16: I;16,
    other ints: I, floats: F), converted by the server's own rule (server/scoring/imaging.py `to_rgb`: 16 bits
    scaled, floats clipped). uint16 colour is what PIL reads from a 16-bit RGB(A) PNG: the high byte.
    Other colour dtypes are accepted only when every value is a whole number in 0..255 (a
    16-bit image sent as-is would score as noise)."""
    _check_shape(array)
    if array.dtype == np.uint8:
        return array
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    kind = array.dtype.kind
    if kind not in "biuf":
        raise _refused(f"an image array of dtype {array.dtype}", "expected bool, integer or float pixels")
    if array.ndim == 2:
        if kind in "iu" and array.dtype != np.uint16:
            low, high = (int(array.min()), int(array.max()))
            if low < np.iinfo(np.int32).min or high > np.iinfo(np.int32).max:
                raise _refused(f"an image array of dtype {array.dtype}", f"values {low}..{high} do not fit a 32-bit image")
            array = array.astype(np.int32)
        elif kind == "f":
            array = array.astype(np.float32)
        return np.asarray(_server_imaging().to_rgb(Image.fromarray(array)))
    if array.dtype == np.uint16:
        return (array >> 8).astype(np.uint8)
    if kind == "b":
        raise _refused(f"a {array.shape[2]}-channel image array of dtype bool", "no image file holds colour as booleans")
    finite = np.isfinite(array).all() if kind == "f" else True
    if not finite or array.min() < 0 or array.max() > 255 or (kind == "f" and (array != np.round(array)).any()):
        raise _refused(f"a {array.shape[2]}-channel image array of dtype {array.dtype}",
                       "only whole values 0..255 map to colours without guessing their range")
    return array.astype(np.uint8)


def _image_pixels(image: Image.Image) -> np.ndarray:
    """uint8 pixels of a PIL image, as the server decodes its file: EXIF orientation applied, then any mode
    but L, RGB and RGBA converted by the server's own rule (server/scoring/imaging.py `to_rgb`)."""
    image = ImageOps.exif_transpose(image)
    if image.mode not in ("L", "RGB", "RGBA"):
        try:
            image = _server_imaging().to_rgb(image)
        except (ValueError, OSError) as error:
            raise _refused(f"a PIL image of mode {image.mode}", str(error)) from error
    return np.asarray(image)


def _held_file(image: Image.Image) -> bytes | None:
    """The encoded bytes of an image PIL opened and has not decoded yet, if the server opens them as the same
    image; None otherwise (the object goes as its pixels).

    Sent as its file, a large JPEG is decoded by the server in draft mode, down to the size the scales need,
    so the object scores as its path does (its full pixels would give other scores, and 24 MP of them
    outgrow the message limit). Undecoded (`tile` still set) means unchanged: PIL decodes before any pixel
    edit, and `draft`, another frame or a rewritten file change the header compared here."""
    fp = getattr(image, "fp", None)
    if not isinstance(image, ImageFile.ImageFile) or not image.tile or fp is None or image.tell() != 0:
        return None
    try:
        position = fp.tell()
        fp.seek(0)  # Image.open reads a file from its start
        data = fp.read()
        fp.seek(position)  # where PIL left it
    except (OSError, ValueError):  # closed, or not seekable
        return None
    imaging = _server_imaging()
    try:
        opened = imaging.open_image(data, max_pixels=sys.maxsize).image
    except imaging.ImageError:
        return None
    same = (opened.mode, opened.size, opened.tile) == (image.mode, image.size, image.tile)
    return data if same else None


def _raw(pixels: np.ndarray) -> scoring_pb2.RawImage:
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    height, width, channels = pixels.shape
    return scoring_pb2.RawImage(
        data=np.ascontiguousarray(pixels).tobytes(), height=height, width=width, channels=channels
    )


def image_fields(image: ImageLike) -> dict[str, object]:
    """The ScoreRequest fields carrying `image`: {"encoded": bytes} or {"raw": RawImage}.

    Paths and bytes go as encoded bytes (smaller on the wire; the server decodes them), and so does a PIL
    image still holding its file undecoded; other PIL images and arrays go as raw RGB(A)/grey pixels
    converted as the server converts their files, so an image object scores as its file does.
    """
    if isinstance(image, (str, os.PathLike)):
        path = Path(image)
        if not path.is_file():
            raise _invalid(f"image path {str(path)!r} is not a file")
        return _encoded(path.read_bytes(), source=str(path))
    if isinstance(image, (bytes, bytearray, memoryview)):
        return _encoded(bytes(image))
    if isinstance(image, Image.Image):
        held = _held_file(image)
        return {"encoded": held} if held is not None else {"raw": _raw(_image_pixels(image))}
    if isinstance(image, np.ndarray):
        return {"raw": _raw(_array_pixels(image))}
    raise _invalid(
        f"cannot score an image of type {type(image).__name__}; expected a path, encoded bytes, "
        "a PIL image or a numpy array [height, width(, channels)]"
    )


def open_photo(image: ImageLike) -> Image.Image:
    """The image as an RGB PIL image, decoded and converted as the server does (for drawing under a map)."""
    if isinstance(image, (str, os.PathLike)):
        image = Path(image).read_bytes()
    if isinstance(image, (bytes, bytearray, memoryview)):
        imaging = _server_imaging()
        try:
            return imaging.decode(bytes(image), max_pixels=sys.maxsize)
        except imaging.ImageError as error:
            raise _invalid(str(error)) from error
    if isinstance(image, Image.Image):
        pixels = _image_pixels(image)
    elif isinstance(image, np.ndarray):
        pixels = _array_pixels(image)
    else:
        raise _invalid(f"cannot open an image of type {type(image).__name__}")
    return Image.fromarray(pixels).convert("RGB")
