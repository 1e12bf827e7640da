"""The à trous rewrite equals literal shift-and-stitch in the interior (a VGG-style net on a large image)."""

import collections

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from convert import ConversionError, convert_classifier
from convert.card import read_card
from convert.preprocessing import to_input
from convert.verify import run, sample_pixels, shift_and_stitch
from protos.model_card_pb2 import CHANNEL_ORDER_RGB, INPUT_DTYPE_FLOAT32, LAYOUT_NCHW, Preprocessing

TRAINING = 64
IMAGE = 384
# The bar for à trous vs shift-and-stitch.
TOLERANCE = 1e-4
UNIT = Preprocessing(layout=LAYOUT_NCHW, dtype=INPUT_DTYPE_FLOAT32, channel_order=CHANNEL_ORDER_RGB, pixel_scale=1.0, mean=[127.5] * 3, std=[127.5] * 3)


def vgg_style(width: int = 8, classes: int = 5) -> onnx.ModelProto:
    """Five (conv3×3 pad 1, ReLU, max-pool 2) stages, then a Pad + conv at stride 32 and a two-FC head; random weights."""
    rng = np.random.default_rng(7)
    nodes, inits, current, channels = [], [], "image", 3
    for stage in range(5):
        w = f"w{stage}"
        inits.append(numpy_helper.from_array((rng.standard_normal((width, channels, 3, 3)) * (2 / (9 * channels)) ** 0.5).astype(np.float32), w))
        nodes += [helper.make_node("Conv", [current, w], [f"c{stage}"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c{stage}"], [f"r{stage}"]),
                  helper.make_node("MaxPool", [f"r{stage}"], [f"p{stage}"], kernel_shape=[2, 2], strides=[2, 2])]
        current, channels = f"p{stage}", width
    inits += [numpy_helper.from_array(np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64), "pads"),
              numpy_helper.from_array((rng.standard_normal((width, width, 3, 3)) * 0.2).astype(np.float32), "w5"),
              numpy_helper.from_array((rng.standard_normal((width * 4, 16)) * 0.2).astype(np.float32), "fc1"),
              numpy_helper.from_array((rng.standard_normal((16, classes)) * 0.2).astype(np.float32), "fc2"),
              numpy_helper.from_array(np.array([0, -1], np.int64), "flat_shape")]
    nodes += [helper.make_node("Pad", [current, "pads"], ["padded"]),
              helper.make_node("Conv", ["padded", "w5"], ["c5"], kernel_shape=[3, 3]),
              helper.make_node("Relu", ["c5"], ["r5"]),
              helper.make_node("Reshape", ["r5", "flat_shape"], ["flat"]),
              helper.make_node("MatMul", ["flat", "fc1"], ["h"]),
              helper.make_node("Relu", ["h"], ["hr"]),
              helper.make_node("MatMul", ["hr", "fc2"], ["logits"])]
    graph = helper.make_graph(nodes, "vgg_style", [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, TRAINING, TRAINING])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", classes])], inits)
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])


def interior(card, *, cells: int, stride: int, margin: int) -> slice:
    """Cells whose receptive field stays `margin` px off the top/left and inside the image bottom/right."""
    reach = (card.receptive_field.size - 1) / 2  # pixel indices: the field covers centre ± reach
    centres = card.receptive_field.center_y + stride * np.arange(cells)
    inside = np.nonzero((centres - reach >= margin) & (centres + reach <= IMAGE - 1))[0]
    assert inside.size >= 3, "the test image is too small to have an interior"
    return slice(int(inside[0]), int(inside[-1]) + 1)


@pytest.mark.parametrize("stride", [16, 8])
def test_atrous_interior_equals_shift_and_stitch(stride):
    model = vgg_style()
    coarse = convert_classifier(model, preprocessing=UNIT)
    fine = convert_classifier(model, preprocessing=UNIT, output_stride=stride)
    card = read_card(fine)
    assert (read_card(coarse).output_stride, card.output_stride) == (32, stride)
    assert card.verification.passed
    image = to_input(sample_pixels(count=1, height=IMAGE, width=IMAGE, channels=3, seed=5), UNIT)
    dense = run(fine, image)
    factor = 32 // stride
    literal = shift_and_stitch(coarse, image, shift=stride, factor=factor)
    assert dense.shape == literal.shape  # one cell per stride-px step, exactly as many as shift-and-stitch gives
    rows = interior(card, cells=dense.shape[2], stride=stride, margin=(factor - 1) * stride)
    got, expected = dense[:, :, rows, rows], literal[:, :, rows, rows]
    assert np.abs(expected).max() > 1e-2  # the comparison can fail
    np.testing.assert_allclose(got, expected, atol=TOLERANCE)


def test_atrous_rewrites_strides_dilations_and_pads():
    fine = convert_classifier(vgg_style(), preprocessing=UNIT, output_stride=8)
    by_output = {n.output[0]: n for n in fine.graph.node}
    attrs = lambda name: {a.name: list(helper.get_attribute_value(a)) for a in by_output[name].attribute if a.type == onnx.AttributeProto.INTS}
    assert attrs("p3")["strides"] == [1, 1] and attrs("p4")["strides"] == [1, 1]
    assert attrs("c4")["dilations"] == [2, 2] and attrs("c4")["pads"] == [2, 2, 2, 2]
    assert attrs("p4")["dilations"] == [2, 2]
    assert attrs("c5")["dilations"] == [4, 4]
    pad_node = by_output["padded"]
    pads = {i.name: numpy_helper.to_array(i) for i in fine.graph.initializer}[pad_node.input[1]]
    assert pads.tolist() == [0, 0, 4, 4, 0, 0, 4, 4]
    assert collections.Counter(n.op_type for n in fine.graph.node)["MaxPool"] == 5


def test_default_model_stride16_even_cells_equal_stride32(default_model_path, default_model_os16_path):
    coarse, fine = onnx.load(default_model_path), onnx.load(default_model_os16_path)
    card = read_card(fine)
    assert card.output_stride == 16 and card.verification.passed
    image = to_input(sample_pixels(count=1, height=IMAGE, width=IMAGE, channels=3, seed=9), card.preprocessing)
    a, b = run(coarse, image), run(fine, image)
    assert a.shape == (1, 1000, 6, 6) and b.shape == (1, 1000, 11, 11)
    np.testing.assert_allclose(b[:, :, ::2, ::2], a, atol=TOLERANCE * max(1.0, np.abs(a).max()))


def test_unsupported_output_stride_is_refused():
    with pytest.raises(ConversionError, match="output stride 4 is not supported"):
        convert_classifier(vgg_style(), preprocessing=UNIT, output_stride=4)
