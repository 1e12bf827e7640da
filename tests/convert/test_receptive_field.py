"""Receptive fields follow kernels, strides, dilations, explicit and automatic padding, Pad nodes and Transposes."""

import numpy as np
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from convert.receptive_field import receptive_fields
from protos.model_card_pb2 import LAYOUT_NCHW, LAYOUT_NHWC


def graph(nodes, inits, layout_dims) -> ir.Model:
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, layout_dims)],
                          [helper.make_tensor_value_info(nodes[-1].output[0], TensorProto.FLOAT, None)], inits)
    return ir.from_proto(helper.make_model(g, ir_version=10, opset_imports=[helper.make_opsetid("", 17)]))


def test_fields_through_conv_pool_and_dilation():
    w = numpy_helper.from_array(np.zeros((2, 1, 3, 3), np.float32), "w")
    w2 = numpy_helper.from_array(np.zeros((2, 2, 3, 3), np.float32), "w2")
    model = graph([
        helper.make_node("Conv", ["x", "w"], ["a"], pads=[1, 1, 1, 1]),             # pixels -1..1: size 3, centre 0
        helper.make_node("MaxPool", ["a"], ["b"], kernel_shape=[2, 2], strides=[2, 2]),  # pixels -1..2: size 4, centre 0.5, jump 2
        helper.make_node("Conv", ["b", "w2"], ["c"], dilations=[2, 2]),            # reach 4 cells of 2 px: size 12, centre 4.5
    ], [w, w2], [1, 1, 16, 16])
    fields = receptive_fields(model, input_shape=[1, 1, 16, 16], layout=LAYOUT_NCHW)
    assert fields["a"].size == (3, 3) and fields["a"].start == (0.0, 0.0)
    assert fields["b"].size == (4, 4) and fields["b"].start == (0.5, 0.5) and fields["b"].jump == (2, 2)
    assert fields["c"].size == (12, 12) and fields["c"].start == (4.5, 4.5) and fields["c"].jump == (2, 2)


def test_same_upper_padding_and_pad_nodes_on_nhwc():
    w = numpy_helper.from_array(np.zeros((1, 1, 3, 3), np.float32), "w")
    pads = numpy_helper.from_array(np.array([0, 2, 0, 0, 0, 1, 0, 0], np.int64), "pads")  # NHWC: 2 rows on top
    model = graph([
        helper.make_node("Pad", ["x", "pads"], ["p"]),
        helper.make_node("Transpose", ["p"], ["t"], perm=[0, 3, 1, 2]),
        helper.make_node("Conv", ["t", "w"], ["c"], strides=[2, 2], auto_pad="SAME_UPPER"),
    ], [w, pads], [1, 8, 8, 1])
    fields = receptive_fields(model, input_shape=[1, 8, 8, 1], layout=LAYOUT_NHWC)
    assert fields["p"].start == (-2.0, 0.0)
    # SAME_UPPER, stride 2, k 3: on 11 rows total pad 2, begin 1 → centre stays; on 8 columns total 1, begin 0 → +1.
    assert fields["c"].start == (-2.0, 1.0) and fields["c"].size == (3, 3) and fields["c"].jump == (2, 2)
