"""Pixels into a graph's input tensor, as its model card says: the one definition of preprocessing.

The converter verifies with it and the server serves with it, so a graph is checked on exactly
the tensors it will be given. Each function takes the card's `Preprocessing` or its `ImageInput` view.
"""

from __future__ import annotations

import numpy as np

from convert.card import ImageInput
from protos.model_card_pb2 import Preprocessing

__all__ = ["normalize", "to_layout", "to_input"]


def normalize(pixels: np.ndarray, preprocessing: Preprocessing | ImageInput) -> np.ndarray:
    """[..., H, W, C] RGB pixels 0..255 as (pixel * pixel_scale - mean) / std in the card's channel
    order and dtype, channels last (a uint8 input gets the values rounded and clipped to 0..255)."""
    image = ImageInput.of(preprocessing)
    if image.bgr:
        pixels = pixels[..., ::-1]
    channels = pixels.shape[-1]
    mean = np.asarray(image.mean or (0.0,) * channels, dtype=np.float32)
    std = np.asarray(image.std or (1.0,) * channels, dtype=np.float32)
    values = (pixels.astype(np.float32) * np.float32(image.pixel_scale) - mean) / std
    if image.dtype == np.uint8:
        values = np.clip(np.rint(values), 0, 255)
    return np.ascontiguousarray(values, dtype=image.dtype)


def to_layout(batch: np.ndarray, preprocessing: Preprocessing | ImageInput) -> np.ndarray:
    """A channels-last batch [n, H, W, C] in the card's layout and dtype."""
    image = ImageInput.of(preprocessing)
    if image.channel_axis == 1:
        batch = batch.transpose(0, 3, 1, 2)
    return np.ascontiguousarray(batch, dtype=image.dtype)


def to_input(pixels: np.ndarray, preprocessing: Preprocessing | ImageInput) -> np.ndarray:
    """Pixels [n, H, W, C] (RGB, 0..255) as the graph's input tensor."""
    image = ImageInput.of(preprocessing)
    return to_layout(normalize(pixels, image), image)
