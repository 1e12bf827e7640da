"""Tiny classifiers for the tiling tests, built in code and converted by the real converter."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from protos.model_card_pb2 import CHANNEL_ORDER_RGB, Preprocessing
from server.settings import Settings

UNIT = Preprocessing(channel_order=CHANNEL_ORDER_RGB, pixel_scale=1.0, mean=[127.0] * 3, std=[64.0] * 3)
# No bucket holds a tile: every canvas is planned as the one pass's would be (image + slack, rounded up).
ON_DEMAND = Settings(warm_up=False, shape_buckets=((32, 32),))


def tiny_classifier(*, padded: bool, nhwc: bool, size: int, classes: int = 3, width: int = 6) -> onnx.ModelProto:
    """Five 3x3 stride-2 convolutions (stride 32), global average pool, fully connected: a classifier to convert."""
    rng = np.random.default_rng(7)
    nodes, inits, current, channels = [], [], "x", 3
    if nhwc:
        nodes.append(helper.make_node("Transpose", ["x"], ["nchw"], perm=[0, 3, 1, 2]))
        current = "nchw"
    for index in range(5):
        inits.append(numpy_helper.from_array(rng.normal(0, 0.4, (width, channels, 3, 3)).astype(np.float32), f"w{index}"))
        inits.append(numpy_helper.from_array(rng.normal(0, 0.1, (width,)).astype(np.float32), f"b{index}"))
        nodes.append(helper.make_node("Conv", [current, f"w{index}", f"b{index}"], [f"c{index}"], kernel_shape=[3, 3],
                                      strides=[2, 2], pads=[1, 1, 1, 1] if padded else [0, 0, 0, 0]))
        nodes.append(helper.make_node("Relu", [f"c{index}"], [f"r{index}"]))
        current, channels = f"r{index}", width
    inits += [numpy_helper.from_array(rng.normal(0, 0.5, (classes, width)).astype(np.float32), "fc_w"),
              numpy_helper.from_array(np.zeros(classes, np.float32), "fc_b")]
    nodes += [helper.make_node("GlobalAveragePool", [current], ["pooled"]),
              helper.make_node("Flatten", ["pooled"], ["flat"]),
              helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"], transB=1)]
    shape = [1, size, size, 3] if nhwc else [1, 3, size, size]
    graph = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, classes])], inits)
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])
