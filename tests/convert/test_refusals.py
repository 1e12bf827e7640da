"""Graphs that cannot be converted faithfully are refused, naming the node and the reason."""

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from convert import ConversionError, convert_classifier
from convert.sources import export_module
from convert.verify import verify
from convert.presets import preset
from protos.model_card_pb2 import CHANNEL_ORDER_RGB, INPUT_DTYPE_FLOAT32, LAYOUT_NCHW, Preprocessing

rng = np.random.default_rng(0)

RAW = preset("raw")


def weight(name: str, *shape: int) -> onnx.TensorProto:
    return numpy_helper.from_array((rng.standard_normal(shape) * 0.2).astype(np.float32), name)


def classifier(body: list[onnx.NodeProto], body_out: str, channels: int, extra=(), *, size=8, input_dims=None,
               head: list[onnx.NodeProto] | None = None) -> onnx.ModelProto:
    """conv → body → GAP → Flatten → Gemm, with the body spliced in."""
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]), *body]
    nodes += head if head is not None else [
        helper.make_node("GlobalAveragePool", [body_out], ["gap"]),
        helper.make_node("Flatten", ["gap"], ["flat"]),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["out"], transB=1),
    ]
    inits = [weight("w0", 4, 3, 3, 3), weight("fc_w", 3, channels), weight("fc_b", 3), *extra]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, input_dims or ["N", 3, size, size])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])


class SqueezeExcite(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.gate = nn.Conv2d(4, 4, 1)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        x = self.conv(x)
        x = x * torch.sigmoid(self.gate(x.mean(dim=(2, 3), keepdim=True)))
        return self.fc(x.mean(dim=(2, 3)))


def test_squeeze_excitation_is_refused_naming_the_reduction():
    model = export_module(SqueezeExcite().eval(), training_size=(16, 16))
    with pytest.raises(ConversionError, match=r"ReduceMean.*squeeze-excitation"):
        convert_classifier(model, preprocessing=RAW)


def test_global_pool_inside_the_body_is_refused():
    body = [helper.make_node("GlobalAveragePool", ["c0"], ["se"]), helper.make_node("Mul", ["c0", "se"], ["gated"])]
    with pytest.raises(ConversionError, match=r"GlobalAveragePool .*'se'.*mixes all positions"):
        convert_classifier(classifier(body, "gated", 4), preprocessing=RAW)


def test_attention_is_refused():
    body = [
        helper.make_node("Transpose", ["c0"], ["t"], perm=[0, 2, 3, 1]),
        helper.make_node("Transpose", ["c0"], ["tt"], perm=[0, 2, 1, 3]),
        helper.make_node("MatMul", ["t", "tt"], ["att"]),
        helper.make_node("Softmax", ["att"], ["att_p"], axis=-1),
        helper.make_node("Transpose", ["att_p"], ["back"], perm=[0, 3, 1, 2]),
    ]
    with pytest.raises(ConversionError, match=r"(MatMul|Softmax).*(attention|mixes positions)"):
        convert_classifier(classifier(body, "back", 8), preprocessing=RAW)


def test_hard_coded_reshape_of_a_feature_map_is_refused():
    body = [helper.make_node("Reshape", ["c0", "shape"], ["r"]), helper.make_node("Relu", ["r"], ["rr"])]
    shape = numpy_helper.from_array(np.array([0, 8, 4, 8], np.int64), "shape")
    with pytest.raises(ConversionError, match=r"Reshape .*'r'.*hard-codes"):
        convert_classifier(classifier(body, "rr", 8, [shape]), preprocessing=RAW)


def test_slice_with_a_fixed_end_on_a_spatial_axis_is_refused():
    body = [helper.make_node("Slice", ["c0", "starts", "ends", "axes"], ["crop"])]
    extra = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in [("starts", [1]), ("ends", [7]), ("axes", [3])]]
    with pytest.raises(ConversionError, match=r"Slice .*'crop'.*fixed end"):
        convert_classifier(classifier(body, "crop", 4, extra), preprocessing=RAW)


def test_slice_trimming_a_border_to_the_end_converts():
    body = [helper.make_node("Slice", ["c0", "starts", "ends", "axes"], ["crop"])]
    extra = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in [("starts", [1, 1]), ("ends", [-1, 2**62]), ("axes", [2, 3])]]
    assert convert_classifier(classifier(body, "crop", 4, extra), preprocessing=RAW).graph.output[0].name == "scores"


def test_unidentifiable_head_is_refused():
    head = [helper.make_node("GlobalAveragePool", ["c0"], ["gap"]), helper.make_node("Flatten", ["gap"], ["flat"]),
            helper.make_node("TopK", ["flat", "k"], ["out", "idx"], axis=1)]
    k = numpy_helper.from_array(np.array([2], np.int64), "k")
    with pytest.raises(ConversionError, match=r"cannot identify the classifier head at TopK"):
        convert_classifier(classifier([], "c0", 4, [k], head=head), preprocessing=RAW)


def test_symbolic_input_size_without_training_size_is_refused():
    model = classifier([], "c0", 4, input_dims=["N", 3, "height", "width"])
    with pytest.raises(ConversionError, match=r"cannot prove the training size"):
        convert_classifier(model, preprocessing=RAW)
    assert convert_classifier(model, training_size=8, preprocessing=RAW).graph.output[0].name == "scores"


def test_conflicting_training_size_is_refused():
    with pytest.raises(ConversionError, match=r"fixed at 8x8 but training size 16x16"):
        convert_classifier(classifier([], "c0", 4), training_size=16, preprocessing=RAW)


def test_verification_reports_a_mismatch():
    model = classifier([], "c0", 4)
    other = classifier([], "c0", 4)  # fresh random weights
    converted = convert_classifier(other, preprocessing=RAW)
    prep = Preprocessing(layout=LAYOUT_NCHW, dtype=INPUT_DTYPE_FLOAT32, channel_order=CHANNEL_ORDER_RGB, pixel_scale=1.0, mean=[127.5] * 3, std=[127.5] * 3)
    check = verify(model, converted, preprocessing=prep, training_size=(8, 8), channels=3)
    assert not check.passed and check.max_abs_diff > check.tolerance
    assert verify(other, converted, preprocessing=prep, training_size=(8, 8), channels=3).passed
