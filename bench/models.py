"""The converted models the benchmarks run, written once per benchmark run into a folder.

The default model at its native stride 32 (shifted passes) and with the à trous rewrite to 16,
and a null model: a converted stride-32 classifier that reads one pixel per 32-px cell, so a request's
time through it is the host path's own.
"""

from __future__ import annotations

import pathlib

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from convert import convert_classifier
from convert.card import Preprocessing

NULL_CLASSES = 1000  # as many as the default model, so responses are as large
NULL_TRAINING_SIZE = 32


def converted(folder: str | pathlib.Path, *, output_stride: int = 32) -> str:
    """The default model converted at `output_stride` (32: native, 16: à trous), saved in `folder`."""
    name = f"default-os{output_stride}"  # distinct names, so one server can load both
    path = pathlib.Path(folder) / f"{name}.onnx"
    if not path.exists():
        onnx.save(convert_classifier("default", output_stride=output_stride, name=name), path)
    return str(path)


def null_classifier() -> onnx.ModelProto:
    """A 32-px classifier that looks at one pixel of its input (a 1x1 pool at stride 32), global pool, a 3 -> 1000
    fully connected layer. Its 1000 logits per cell cost what any such model's last layer and softmax cost; a 32x32
    average pool instead read every pixel, 0.25 ms at 384x576 (onnxruntime's profile), which is the
    model's work, not the server's."""
    weights = np.random.default_rng(0).normal(0, 0.01, (NULL_CLASSES, 3)).astype(np.float32)
    nodes = [
        helper.make_node("AveragePool", ["image"], ["pooled"], kernel_shape=[1, 1], strides=[32, 32]),
        helper.make_node("GlobalAveragePool", ["pooled"], ["global"]),
        helper.make_node("Flatten", ["global"], ["features"]),
        helper.make_node("Gemm", ["features", "w", "b"], ["logits"], transB=1),
    ]
    size = NULL_TRAINING_SIZE
    graph = helper.make_graph(
        nodes, "null", [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, size, size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, NULL_CLASSES])],
        initializer=[numpy_helper.from_array(weights, "w"),
                     numpy_helper.from_array(np.zeros(NULL_CLASSES, np.float32), "b")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def null_model(folder: str | pathlib.Path, *, output_stride: int = 32) -> str:
    """The null classifier through the real converter (a dense graph with its card), saved in `folder`."""
    name = f"null-os{output_stride}"
    path = pathlib.Path(folder) / f"{name}.onnx"
    if not path.exists():
        # The default model's normalisation, so the device graph does the same work as for it.
        preprocessing = Preprocessing(mean=[127.0] * 3, std=[128.0] * 3)
        onnx.save(convert_classifier(null_classifier(), name=name, output_stride=output_stride,
                                     preprocessing=preprocessing), path)
    return str(path)


VGG_TRAINING_SIZE = 64
VGG_LAYOUT = ((16, 16), (32, 32), (64, 64, 64), (128, 128, 128), (128, 128, 128))  # VGG-16 at 1/4 width


def vgg_classifier(*, classes: int = 100) -> onnx.ModelProto:
    """VGG-16's layout (3x3 convolutions, 2x2 max pools: stride 32, a 212-px receptive field) at a quarter of its
    width with random He-initialised weights: VGG's geometry, small enough to score large images on a CPU."""
    rng = np.random.default_rng(16)
    nodes, inits, current, channels, index = [], [], "image", 3, 0
    for block in VGG_LAYOUT:
        for width in block:
            w = rng.normal(0, np.sqrt(2 / (9 * channels)), (width, channels, 3, 3)).astype(np.float32)
            inits += [numpy_helper.from_array(w, f"w{index}"),
                      numpy_helper.from_array(np.full(width, 0.01, np.float32), f"b{index}")]
            nodes += [helper.make_node("Conv", [current, f"w{index}", f"b{index}"], [f"c{index}"], kernel_shape=[3, 3],
                                       pads=[1, 1, 1, 1]),
                      helper.make_node("Relu", [f"c{index}"], [f"r{index}"])]
            current, channels, index = f"r{index}", width, index + 1
        nodes.append(helper.make_node("MaxPool", [current], [f"p{index}"], kernel_shape=[2, 2], strides=[2, 2]))
        current = f"p{index}"
    fc = rng.normal(0, np.sqrt(1 / channels), (classes, channels)).astype(np.float32)
    inits += [numpy_helper.from_array(fc, "fc_w"), numpy_helper.from_array(np.zeros(classes, np.float32), "fc_b")]
    nodes += [helper.make_node("GlobalAveragePool", [current], ["pooled"]),
              helper.make_node("Flatten", ["pooled"], ["flat"]),
              helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"], transB=1)]
    size = VGG_TRAINING_SIZE
    graph = helper.make_graph(nodes, "vgg-width", [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, size, size])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, classes])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def vgg_model(folder: str | pathlib.Path) -> str:
    """The VGG-width classifier through the real converter, saved in `folder`."""
    path = pathlib.Path(folder) / "vgg-width.onnx"
    if not path.exists():
        onnx.save(convert_classifier(vgg_classifier(), name="vgg-width", preprocessing=Preprocessing(
            mean=[127.0] * 3, std=[64.0] * 3)), path)
    return str(path)
