"""Named input normalisations: how the common training recipes map 0..255 pixels to the net's input.

A bare ONNX or PyTorch classifier does not say how it was trained, and raw pixels into a net
trained on normalised input give confidently wrong scores, so the converter asks for one of
these (or explicit mean/std/scale) rather than guessing. Means and stds are in the graph's
channel order: `caffe` is BGR, so its mean is (B, G, R).
"""

from __future__ import annotations

from convert.errors import UsageError
from protos.model_card_pb2 import ChannelOrder, Preprocessing  # not convert.card: `--help` lists these without numpy/onnx

__all__ = ["PRESETS", "preset"]

RGB, BGR = ChannelOrder.CHANNEL_ORDER_RGB, ChannelOrder.CHANNEL_ORDER_BGR
# name: (channel order, pixel_scale, mean, std, what it is)
PRESETS = {
    "raw": (RGB, 1.0, (0.0,), (1.0,), "pixels 0..255 as they are (a graph that normalises itself)"),
    "unit": (RGB, 1 / 255, (0.0,), (1.0,), "pixels scaled to 0..1"),
    "inception": (RGB, 1.0, (127.5,), (127.5,), "pixels scaled to -1..1 (TF/Keras Inception, MobileNet, EfficientNet)"),
    "imagenet": (RGB, 1 / 255, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225),
                 "0..1, then ImageNet mean/std per channel (torchvision)"),
    "caffe": (BGR, 1.0, (103.939, 116.779, 123.68), (1.0,),
              "BGR, ImageNet mean subtracted, no scaling (Caffe model zoo, Keras VGG/ResNet50)"),
}


def preset(name: str) -> Preprocessing:
    """The preprocessing of preset `name`; a single mean or std value stands for every channel."""
    try:
        order, scale, mean, std, _ = PRESETS[name]
    except KeyError:
        raise UsageError(f"unknown preprocessing {name!r}; expected one of {sorted(PRESETS)}") from None
    return Preprocessing(channel_order=order, pixel_scale=scale, mean=mean, std=std, resize_filter="bilinear")
