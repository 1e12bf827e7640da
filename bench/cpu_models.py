"""Converted models of other shapes than the default one, for the CPU memory and speed benches.

A VGG-width net (VGG16's layout at a quarter of its widths: wide early activations, a large head)
and the same net taking NHWC input (a Keras-style export: a Transpose in front), both with random
weights, through the real converter so the server can load them.
"""

from __future__ import annotations

import math
import pathlib

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from convert import convert_classifier
from convert.card import Preprocessing

VGG_WIDTHS = (16, 16, "M", 32, 32, "M", 64, 64, 64, "M", 128, 128, 128, "M", 128, 128, 128, "M")
VGG_FC = 512
CLASSES = 100
TRAINING_SIZE = 224
UNIT_RANGE = Preprocessing(pixel_scale=1.0, mean=[127.5] * 3, std=[127.5] * 3)


def vgg_width_classifier(*, nhwc: bool = False) -> onnx.ModelProto:
    """VGG16's layout at a quarter width, He-initialised: 224 px in, CLASSES logits out."""
    rng = np.random.default_rng(0)
    nodes, weights = [], []

    def weight(name: str, shape: tuple[int, ...]) -> str:
        scale = np.float32(math.sqrt(2 / math.prod(shape[1:])))
        weights.append(numpy_helper.from_array(rng.standard_normal(shape, dtype=np.float32) * scale, f"{name}_w"))
        weights.append(numpy_helper.from_array(np.zeros(shape[0], np.float32), f"{name}_w_b"))
        return f"{name}_w"

    x, channels = "image", 3
    if nhwc:
        nodes.append(helper.make_node("Transpose", [x], ["nchw"], perm=[0, 3, 1, 2]))
        x = "nchw"
    for index, width in enumerate(VGG_WIDTHS):
        if width == "M":
            nodes.append(helper.make_node("MaxPool", [x], [f"pool{index}"], kernel_shape=[2, 2], strides=[2, 2]))
            x = f"pool{index}"
            continue
        w = weight(f"conv{index}", (width, channels, 3, 3))
        nodes.append(helper.make_node("Conv", [x, w, f"{w}_b"], [f"c{index}"], pads=[1, 1, 1, 1]))
        nodes.append(helper.make_node("Relu", [f"c{index}"], [f"r{index}"]))
        x, channels = f"r{index}", width
    nodes.append(helper.make_node("Flatten", [x], ["flat"]))
    side = TRAINING_SIZE // 32
    for name, (outputs, inputs) in (("fc6", (VGG_FC, channels * side * side)), ("fc7", (CLASSES, VGG_FC))):
        w = weight(name, (outputs, inputs))
        nodes.append(helper.make_node("Gemm", [nodes[-1].output[0], w, f"{w}_b"], [name], transB=1))
        if name == "fc6":
            nodes.append(helper.make_node("Relu", [name], [f"{name}_relu"]))
    shape = [1, TRAINING_SIZE, TRAINING_SIZE, 3] if nhwc else [1, 3, TRAINING_SIZE, TRAINING_SIZE]
    graph = helper.make_graph(nodes, "vgg_quarter" + ("_nhwc" if nhwc else ""),
                              [helper.make_tensor_value_info("image", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("fc7", TensorProto.FLOAT, [1, CLASSES])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def converted(folder: str | pathlib.Path, which: str) -> str:
    """'vgg' or 'nhwc' converted at stride 32 and saved in `folder`; the path."""
    path = pathlib.Path(folder) / f"{which}-quarter.onnx"
    if not path.exists():
        model = vgg_width_classifier(nhwc=which == "nhwc")
        onnx.save(convert_classifier(model, name=f"{which}-quarter", preprocessing=UNIT_RANGE), path)
    return str(path)
