"""Pixels into a graph's input tensor, as its model card says: the one definition of preprocessing.

The converter verifies with it and the server serves with it, so a graph is checked on exactly
the tensors it will be given.
"""

from __future__ import annotations

import numpy as np

from protos.model_card_pb2 import Preprocessing

__all__ = ["normalize", "to_layout", "to_input"]

DTYPES = {"float32": np.float32, "float16": np.float16, "uint8": np.uint8}


def _dtype(preprocessing: Preprocessing) -> type:
    name = preprocessing.dtype or "float32"
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"model card input dtype {name!r} is not one of {sorted(DTYPES)}") from None


def normalize(pixels: np.ndarray, preprocessing: Preprocessing) -> np.ndarray:
    """[..., H, W, C] RGB pixels 0..255 as (pixel * pixel_scale - mean) / std in the card's channel
    order and dtype, channels last (a uint8 input gets the values rounded and clipped to 0..255)."""
    if preprocessing.channel_order.upper() == "BGR":
        pixels = pixels[..., ::-1]
    channels = pixels.shape[-1]
    scale = np.float32(preprocessing.pixel_scale or 1.0)
    mean = np.asarray(list(preprocessing.mean) or [0.0] * channels, dtype=np.float32)
    std = np.asarray(list(preprocessing.std) or [1.0] * channels, dtype=np.float32)
    values = (pixels.astype(np.float32) * scale - mean) / std
    dtype = _dtype(preprocessing)
    if dtype is np.uint8:
        values = np.clip(np.rint(values), 0, 255)
    return np.ascontiguousarray(values, dtype=dtype)


def to_layout(batch: np.ndarray, preprocessing: Preprocessing) -> np.ndarray:
    """A channels-last batch [n, H, W, C] in the card's layout and dtype."""
    if preprocessing.layout.upper() != "NHWC":
        batch = batch.transpose(0, 3, 1, 2)
    return np.ascontiguousarray(batch, dtype=_dtype(preprocessing))


def to_input(pixels: np.ndarray, preprocessing: Preprocessing) -> np.ndarray:
    """Pixels [n, H, W, C] (RGB, 0..255) as the graph's input tensor."""
    return to_layout(normalize(pixels, preprocessing), preprocessing)
