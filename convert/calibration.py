"""Photos for int8 calibration and its check, fed as the server feeds them.

A photo is resized the way a request at a scale is (shorter side to the scale, both sides rounded to
the model's size multiple, the card's resize filter) and normalised by the card's preprocessing
(convert.preprocessing, the one definition the server uses too), at each of the sides
`fed_sides` names: the training size and the dense size the card serves by default.

Where the photos come from:

* `--calibration DIR`: the user's own images (every file PIL reads, sorted by name); every
  HELD_OUT_EVERY-th is held out of calibration and only checks the result.
* none given: the default set. Calibration on the four photos the project ships in samples/
  (people, an animal, objects, a scene, in daylight) and four of scikit-image's bundled images
  (textures and printed text, to widen the activation ranges seen); the check on ten other photos
  scikit-image bundles (greyscale ones as RGB). Its limits: eight small photos of everyday
  content. A net for microscopy, satellite or medical images should be calibrated on its own
  images (`--calibration DIR`).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

import numpy as np
from PIL import Image

from convert.card import ModelCard
from convert.errors import UsageError
from convert.preprocessing import to_input

__all__ = ["Photo", "PhotoSet", "HELD_OUT_EVERY", "MIN_PHOTOS", "read_folder", "default_set", "folder_set",
           "fed_sides", "fed_size", "as_fed"]

# In a user's folder, every HELD_OUT_EVERY-th photo (sorted by name) checks the result and is not calibrated on.
HELD_OUT_EVERY = 4
# A folder needs at least this many photos: some to calibrate on, one to hold out.
MIN_PHOTOS = 2
SAMPLES = pathlib.Path(__file__).resolve().parents[1] / "samples"
# scikit-image's bundled images (skimage/data, no download) in the default set: calibrated on ...
SKIMAGE_CALIBRATION = ("grass.png", "gravel.png", "page.png", "text.png")
# ... and held out: photos of scenes and objects, never calibrated on.
SKIMAGE_HELD_OUT = ("camera.png", "coins.png", "moon.png", "hubble_deep_field.jpg", "ihc.png", "retina.jpg",
                    "motorcycle_left.png", "motorcycle_right.png", "clock_motion.png", "brick.png")


@dataclasses.dataclass(frozen=True)
class Photo:
    """One decoded photo: RGB uint8 [H, W, 3], and the name the card records."""

    name: str
    pixels: np.ndarray


@dataclasses.dataclass(frozen=True)
class PhotoSet:
    """Calibration photos, held-out photos (never calibrated on) and where they came from."""

    calibration: tuple[Photo, ...]
    held_out: tuple[Photo, ...]
    source: str


def _read(path: pathlib.Path) -> Photo | None:
    """The photo at `path`, or None when PIL does not read it (a text file beside the photos)."""
    try:
        with Image.open(path) as image:
            return Photo(path.name, np.asarray(image.convert("RGB")))
    except (OSError, SyntaxError, ValueError):
        return None


def read_folder(folder: str | os.PathLike) -> list[Photo]:
    """Every image PIL reads in `folder` (not its subfolders), sorted by file name."""
    root = pathlib.Path(folder)
    if not root.is_dir():
        raise UsageError(f"--calibration {str(folder)!r} is not a folder; expected a folder of photos like those the "
                         "model will score")
    photos = [photo for path in sorted(root.iterdir()) if path.is_file() and (photo := _read(path)) is not None]
    if len(photos) < MIN_PHOTOS:
        raise UsageError(f"--calibration {str(folder)!r} holds {len(photos)} readable image(s); expected at least "
                         f"{MIN_PHOTOS} (every {HELD_OUT_EVERY}th is held out to check the result)")
    return photos


def folder_set(folder: str | os.PathLike) -> PhotoSet:
    """The user's photos, every HELD_OUT_EVERY-th (and at least one) held out."""
    photos = read_folder(folder)
    held = [index for index in range(len(photos)) if index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1] or [len(photos) - 1]
    return PhotoSet(tuple(photo for index, photo in enumerate(photos) if index not in held),
                    tuple(photos[index] for index in held), f"the folder {str(folder)!r}")


def default_set() -> PhotoSet:
    """The project's samples and scikit-image's bundled photos (module docstring)."""
    try:
        import skimage
    except ImportError as error:
        raise UsageError("no --calibration folder given and scikit-image (whose bundled photos are the default "
                         "held-out set) is not installed; pass --calibration DIR, or `pip install scikit-image`") from error
    data = pathlib.Path(skimage.__file__).parent / "data"
    samples = sorted(SAMPLES.glob("*.jpg"))
    calibration = [_read(path) for path in [*samples, *(data / name for name in SKIMAGE_CALIBRATION)]]
    held_out = [_read(data / name) for name in SKIMAGE_HELD_OUT]
    if None in calibration or None in held_out or len(samples) < 1:
        raise UsageError(f"the default calibration photos are incomplete ({SAMPLES} and {data}); pass --calibration DIR")
    return PhotoSet(tuple(calibration), tuple(held_out),
                    f"the project's samples/ ({len(samples)} photos) and scikit-image {skimage.__version__}'s bundled "
                    "images (calibration: textures and text; held out: photos of scenes and objects)")


def fed_sides(card: ModelCard) -> tuple[int, int]:
    """The shorter sides photos are fed at: the training size, rounded up to the model's size multiple (rounded to the
    nearest, as `fed_size` rounds, a training size off the multiple can fall below what the head needs for one cell),
    and the card's dense (default) scale."""
    multiple = max(card.size_multiple or card.output_stride, 1)
    training = -(-min(card.training_height, card.training_width) // multiple) * multiple
    return training, max(card.default_scale or training, training)


def fed_size(height: int, width: int, *, side: int, multiple: int) -> tuple[int, int]:
    """Shorter side to `side`, aspect kept, both rounded to the nearest `multiple` (as a request at scale `side` is)."""
    short = min(height, width)
    step = max(multiple, 1)
    return tuple(max(step, int(round(length * side / short / step)) * step) for length in (height, width))


def as_fed(photo: Photo, card: ModelCard, *, side: int) -> np.ndarray:
    """The graph's input tensor [1, ...] for `photo` at shorter side `side`, as the server makes it."""
    height, width = fed_size(*photo.pixels.shape[:2], side=side, multiple=card.size_multiple or card.output_stride)
    resample = getattr(Image.Resampling, (card.preprocessing.resize_filter or "bilinear").upper())
    resized = Image.fromarray(photo.pixels).resize((width, height), resample)
    return to_input(np.asarray(resized, np.float32)[None], card.preprocessing)
