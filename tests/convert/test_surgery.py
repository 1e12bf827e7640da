"""convert.surgery on tiny classifiers built in code: each head shape it makes dense, and each it refuses.

Every converted head is checked the strong way: each dense cell against the original classifier
run on that cell's crop of a larger image (convert.verify.compare_with_crops), so a wrong flatten
order, pool window or per-feature constant shows up as a numeric difference.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from convert import ConversionError
from convert.card import OutputKind
from convert.normalize import canonical
from convert.surgery import SCORES, find_head, fully_convolutional
from convert.verify import compare_with_crops, run
from protos.model_card_pb2 import LAYOUT_NCHW

# The body: a 3x3 Conv of stride 2 without padding, so a 9x9 image gives a 4x4 map (MAP) of CHANNELS,
# and a dense cell equals the classifier on its crop exactly (no padding differs at crop borders).
SIZE, STRIDE, MAP, CHANNELS, CLASSES = 9, 2, 4, 4, 3
FEATURES = CHANNELS * MAP * MAP
# Float32 sums in another order (an FC layer as a convolution).
TOLERANCE = 1e-5


def array(*shape: int, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * 0.3).astype(np.float32)


def classifier(head: list[onnx.NodeProto], constants: dict[str, np.ndarray], *, body: list[onnx.NodeProto] = (),
               outputs: tuple[str, ...] = ("out",), opset: int = 17) -> onnx.ModelProto:
    """image [1, 3, SIZE, SIZE] → Conv (stride 2) → Relu → `body` → tensor "map" [1, CHANNELS, MAP, MAP] → `head` → "out"."""
    stem = [helper.make_node("Conv", ["image", "body_w", "body_b"], ["conv"], kernel_shape=[3, 3], strides=[STRIDE, STRIDE]),
            helper.make_node("Relu", ["conv"], ["relu" if body else "map"])]
    weights = {"body_w": array(CHANNELS, 3, 3, 3, seed=1), "body_b": array(CHANNELS, seed=2), **constants}
    graph = helper.make_graph(
        [*stem, *body, *head], "classifier",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, SIZE, SIZE])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in outputs],
        [numpy_helper.from_array(np.asarray(value), name) for name, value in weights.items()])
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", opset)])


def node(op: str, inputs: list[str], output: str, **attributes) -> onnx.NodeProto:
    return helper.make_node(op, inputs, [output], name=output, **attributes)


def surgery(model: onnx.ModelProto):
    """(head, dense proto): the pipeline's steps from normalisation to the dense graph."""
    graph = canonical(ir.from_proto(model), input_shape=[1, 3, SIZE, SIZE])
    head = find_head(graph, training_size=(SIZE, SIZE), layout=LAYOUT_NCHW)
    return head, ir.to_proto(fully_convolutional(graph, head))


def assert_cells_equal_crops(model: onnx.ModelProto, dense: onnx.ModelProto, *, classes: int = CLASSES) -> None:
    """Every cell of the dense map on a 15x15 image (4x4 cells) equals the classifier on its 9x9 crop."""
    image = array(1, 3, SIZE + 3 * STRIDE, SIZE + 3 * STRIDE, seed=3) * 3
    report = compare_with_crops(model, dense, image, layout=LAYOUT_NCHW, training_size=(SIZE, SIZE), stride=STRIDE)
    assert report.grid == (4, 4)
    assert report.max_abs_diff <= TOLERANCE, report
    scores = run(dense, image)
    assert scores.shape == (1, classes, 4, 4)


def assert_dense_graph(dense: onnx.ModelProto, *, classes: int = CLASSES) -> None:
    """One output `scores` [N, K, h, w], and the image input of any batch and size."""
    (output,) = dense.graph.output
    assert output.name == SCORES
    dims = [d.dim_param or d.dim_value for d in output.type.tensor_type.shape.dim]
    assert dims == ["N", classes, "h", "w"]
    image = [d.dim_param or d.dim_value for d in dense.graph.input[0].type.tensor_type.shape.dim]
    assert image == ["N", 3, "H", "W"]


FC1, FC2 = 6, CLASSES


@pytest.mark.parametrize("flatten", ["Flatten", "Reshape"])
def test_flatten_of_a_map_then_gemm_chain_becomes_a_map_sized_conv_then_1x1(flatten):
    shape = {"shape": np.array([0, -1], np.int64)} if flatten == "Reshape" else {}
    model = classifier([
        node(flatten, ["map", *shape], "flat"),
        node("Gemm", ["flat", "fc1_w", "fc1_b"], "fc1", transB=1),
        node("Relu", ["fc1"], "fc1_relu"),
        node("Gemm", ["fc1_relu", "fc2_w", "fc2_b"], "out", alpha=0.5, beta=2.0),
    ], {**shape, "fc1_w": array(FC1, FEATURES, seed=4), "fc1_b": array(FC1, seed=5),
        "fc2_w": array(FC1, FC2, seed=6), "fc2_b": array(FC2, seed=7)})
    head, dense = surgery(model)
    assert (head.order, head.pool, head.map_shape) == ("chw", None, (CHANNELS, MAP, MAP))
    assert head.num_classes == CLASSES and head.output_kind == OutputKind.OUTPUT_KIND_LOGITS
    assert_dense_graph(dense)
    convs = [n for n in dense.graph.node if n.op_type == "Conv"]
    kernels = [list(helper.get_attribute_value(a)) for n in convs for a in n.attribute if a.name == "kernel_shape"]
    assert kernels == [[3, 3], [MAP, MAP], [1, 1]]
    assert_cells_equal_crops(model, dense)


def test_nchw_to_nhwc_transpose_before_the_flatten_keeps_the_hwc_weight_order():
    model = classifier([
        node("Transpose", ["map"], "nhwc", perm=[0, 2, 3, 1]),
        node("Reshape", ["nhwc", "shape"], "flat"),
        node("MatMul", ["flat", "fc_w"], "fc"),
        node("Add", ["fc", "fc_b"], "out"),
    ], {"shape": np.array([1, FEATURES], np.int64), "fc_w": array(FEATURES, CLASSES, seed=4), "fc_b": array(CLASSES, seed=5)})
    head, dense = surgery(model)
    assert head.order == "hwc"
    assert_dense_graph(dense)
    assert_cells_equal_crops(model, dense)


@pytest.mark.parametrize("pool, flatten", [
    ("GlobalAveragePool", "Flatten"), ("GlobalMaxPool", "Flatten"), ("GlobalAveragePool", "Squeeze"),
    ("ReduceMean", None), ("ReduceMax", None),
])
def test_global_pooling_becomes_a_map_sized_pool_with_stride_1(pool, flatten):
    constants = {"fc_w": array(CLASSES, CHANNELS, seed=4), "fc_b": array(CLASSES, seed=5)}
    if flatten is None:  # ReduceMean/Max over H, W without keepdims is the flatten itself
        nodes = [node(pool, ["map"], "flat", axes=[2, 3], keepdims=0)]
    else:
        nodes = [node(pool, ["map"], "pooled")]
        if flatten == "Squeeze":
            constants["axes"] = np.array([2, 3], np.int64)
            nodes.append(node("Squeeze", ["pooled", "axes"], "flat"))
        else:
            nodes.append(node("Flatten", ["pooled"], "flat"))
    model = classifier([*nodes, node("Gemm", ["flat", "fc_w", "fc_b"], "out", transB=1)], constants)
    head, dense = surgery(model)
    expected = "MaxPool" if "Max" in pool else "AveragePool"
    assert head.pool == expected and head.map_shape == (CHANNELS, MAP, MAP)
    pools = [n for n in dense.graph.node if n.op_type == expected]
    assert len(pools) == 1
    attributes = {a.name: list(helper.get_attribute_value(a)) for a in pools[0].attribute}
    assert attributes == {"kernel_shape": [MAP, MAP], "strides": [1, 1]}
    assert_cells_equal_crops(model, dense)


def test_reduce_over_the_hw_axes_of_an_nhwc_transpose_pools_the_nchw_map():
    model = classifier([
        node("Transpose", ["map"], "nhwc", perm=[0, 2, 3, 1]),
        node("ReduceMean", ["nhwc"], "flat", axes=[1, 2], keepdims=0),
        node("Gemm", ["flat", "fc_w"], "out", transB=1),
    ], {"fc_w": array(CLASSES, CHANNELS, seed=4)})
    head, dense = surgery(model)
    assert head.pool == "AveragePool" and head.source.name == "map"
    assert_cells_equal_crops(model, dense)


def test_squeezenet_like_conv_head_with_a_map_sized_pool_and_softmax():
    """SqueezeNet's end (Caffe): conv10 (1x1, to the classes) → Relu → AveragePool as large as the map → Softmax on [N, K, 1, 1]."""
    model = classifier([
        node("Conv", ["map", "conv10_w", "conv10_b"], "conv10", kernel_shape=[1, 1]),
        node("Relu", ["conv10"], "conv10_relu"),
        node("AveragePool", ["conv10_relu"], "pool10", kernel_shape=[MAP, MAP]),
        node("Softmax", ["pool10"], "out", axis=1),
    ], {"conv10_w": array(CLASSES, CHANNELS, 1, 1, seed=4), "conv10_b": array(CLASSES, seed=5)})
    head, dense = surgery(model)
    assert head.flatten.name == "pool10" and head.source.name == "conv10_relu"
    assert head.pool == "AveragePool" and head.output_kind == OutputKind.OUTPUT_KIND_PROBABILITIES
    assert_dense_graph(dense)
    assert_cells_equal_crops(model, dense)
    np.testing.assert_allclose(run(dense, array(1, 3, 15, 15, seed=8)).sum(axis=1), 1.0, rtol=1e-5)


def test_global_pool_then_pointwise_conv_head_without_a_flatten():
    """Caffe's DenseNet ends GAP → 1x1 Conv, its output [N, K, 1, 1]."""
    model = classifier([
        node("GlobalAveragePool", ["map"], "gap"),
        node("Conv", ["gap", "fc_w", "fc_b"], "out", kernel_shape=[1, 1]),
    ], {"fc_w": array(CLASSES, CHANNELS, 1, 1, seed=4), "fc_b": array(CLASSES, seed=5)})
    head, dense = surgery(model)
    assert [n.op_type for n in head.chain] == ["Conv"] and head.pool == "AveragePool"
    assert_cells_equal_crops(model, dense)


def test_per_feature_add_sub_mul_div_become_per_channel_constants():
    model = classifier([
        node("GlobalAveragePool", ["map"], "gap"),
        node("Flatten", ["gap"], "flat"),
        node("Gemm", ["flat", "fc_w"], "fc", transB=1),
        node("Sub", ["fc", "mean"], "centred"),                # per feature [K]
        node("Mul", ["centred", "scale"], "scaled"),           # per feature [1, K]
        node("Div", ["scaled", "two"], "halved"),              # a scalar
        node("Sub", ["one", "halved"], "flipped"),             # the constant first
        node("Add", ["flipped", "bias"], "out"),
    ], {"fc_w": array(CLASSES, CHANNELS, seed=4), "mean": array(CLASSES, seed=5), "scale": array(1, CLASSES, seed=6),
        "two": np.array(2.0, np.float32), "one": np.array([1.0], np.float32), "bias": array(CLASSES, seed=7)})
    head, dense = surgery(model)
    assert [n.op_type for n in head.chain] == ["Gemm", "Sub", "Mul", "Div", "Sub", "Add"]
    assert_cells_equal_crops(model, dense)


@pytest.mark.parametrize("activation, attributes, extra", [
    ("Sigmoid", {}, {}),
    ("LeakyRelu", {"alpha": 0.3}, {}),
    ("Clip", {}, {"low": np.array(-0.2, np.float32), "high": np.array(0.4, np.float32)}),
    ("HardSigmoid", {"alpha": 0.4, "beta": 0.3}, {}),
])
def test_elementwise_activations_carry_over_with_their_attributes_and_inputs(activation, attributes, extra):
    model = classifier([
        node("Flatten", ["map"], "flat"),
        node("Gemm", ["flat", "fc_w"], "fc", transB=1),
        node(activation, ["fc", *extra], "out", **attributes),
    ], {"fc_w": array(CLASSES, FEATURES, seed=4), **extra})
    head, dense = surgery(model)
    kind = OutputKind.OUTPUT_KIND_PROBABILITIES if activation == "Sigmoid" else OutputKind.OUTPUT_KIND_LOGITS
    assert head.output_kind == kind
    assert_cells_equal_crops(model, dense)


@pytest.mark.parametrize("softmax, opset, axis", [
    ("Softmax", 12, 1), ("Softmax", 17, -1), ("LogSoftmax", 17, 1), ("LogSoftmax", 12, None),
])
def test_softmax_and_logsoftmax_over_the_classes(softmax, opset, axis):
    attributes = {} if axis is None else {"axis": axis}
    model = classifier([
        node("Flatten", ["map"], "flat"),
        node("Gemm", ["flat", "fc_w"], "fc", transB=1),
        node(softmax, ["fc"], "out", **attributes),
    ], {"fc_w": array(CLASSES, FEATURES, seed=4)}, opset=opset)
    head, dense = surgery(model)
    kind = OutputKind.OUTPUT_KIND_PROBABILITIES if softmax == "Softmax" else OutputKind.OUTPUT_KIND_LOGITS
    assert head.output_kind == kind
    assert_cells_equal_crops(model, dense)


def test_the_callers_graph_is_only_read_by_find_head():
    model = classifier([node("Flatten", ["map"], "flat"), node("Gemm", ["flat", "fc_w"], "out", transB=1)],
                       {"fc_w": array(CLASSES, FEATURES, seed=4)})
    graph = canonical(ir.from_proto(model), input_shape=[1, 3, SIZE, SIZE])
    before = ir.to_proto(graph).SerializeToString()
    find_head(graph, training_size=(SIZE, SIZE), layout=LAYOUT_NCHW)
    assert ir.to_proto(graph).SerializeToString() == before


# ---- Refusals: each names the node and says what was expected ----

GEMM = {"fc_w": array(CLASSES, FEATURES, seed=4)}


@pytest.mark.parametrize("head, constants, message", [
    pytest.param([node("Flatten", ["map"], "flat"), node("Gemm", ["flat", "fc_w"], "fc", transB=1), node("Cos", ["fc"], "out")],
                 GEMM, r"cannot identify the classifier head at Cos 'out'", id="unknown-op"),
    pytest.param([node("Flatten", ["map"], "out")], {}, r"the head after Flatten 'out' .* is empty", id="empty-head"),
    pytest.param([node("Flatten", ["map"], "flat", axis=2), node("Gemm", ["flat", "w16"], "out", transB=1)],
                 {"w16": array(CLASSES, MAP * MAP, seed=4)}, r"expected a 4-D map flattened per sample", id="flatten-axis-2"),
    pytest.param([node("Transpose", ["map"], "t", perm=[0, 3, 2, 1]), node("Flatten", ["t"], "flat"),
                  node("Gemm", ["flat", "fc_w"], "out", transB=1)],
                 GEMM, r"Transpose 't' .* perm \[0, 3, 2, 1\].* expected \[0, 2, 3, 1\]", id="other-transpose"),
    pytest.param([node("ReduceMean", ["map"], "flat", axes=[1, 2], keepdims=0), node("Gemm", ["flat", "w4"], "out", transB=1)],
                 {"w4": array(CLASSES, MAP, seed=4)}, r"reduces axes \[1, 2\] of a tensor that is not an NCHW→NHWC Transpose",
                 id="reduce-c-and-h"),
    pytest.param([node("Flatten", ["map"], "flat"), node("Gemm", ["flat", "fc_w"], "fc", transB=1),
                  node("Softmax", ["fc"], "out", axis=0)],
                 GEMM, r"Softmax 'out' .* axis=0 .* expected the feature axis \(1\)", id="softmax-over-the-batch"),
    pytest.param([node("Flatten", ["map"], "flat"), node("Gemm", ["flat", "fc_w"], "a", transB=1),
                  node("Gemm", ["flat", "fc_w"], "b", transB=1), node("Add", ["a", "b"], "out")],
                 GEMM, r"Add 'out' .* has 2 computed inputs; expected one", id="two-branches"),
])
def test_heads_that_cannot_be_made_dense_are_refused_by_find_head(head, constants, message):
    graph = canonical(ir.from_proto(classifier(head, constants)), input_shape=[1, 3, SIZE, SIZE])
    with pytest.raises(ConversionError, match=message):
        find_head(graph, training_size=(SIZE, SIZE), layout=LAYOUT_NCHW)


@pytest.mark.parametrize("head, constants, message", [
    pytest.param([node("Flatten", ["map"], "flat"), node("Add", ["flat", "per_position"], "shifted"),
                  node("Gemm", ["shifted", "fc_w"], "out", transB=1)],
                 {"per_position": array(FEATURES, seed=5), **GEMM},
                 r"Add 'shifted' .* applies a different constant to each position", id="per-position-constant"),
    pytest.param([node("Flatten", ["map"], "flat"), node("Softmax", ["flat"], "soft", axis=1),
                  node("Gemm", ["soft", "fc_w"], "out", transB=1)],
                 GEMM, r"Softmax 'soft' .* acts on flattened map features before any FC layer", id="softmax-before-fc"),
    pytest.param([node("GlobalAveragePool", ["map"], "gap"),
                  node("Conv", ["gap", "w"], "out", kernel_shape=[1, 1], group=2)],
                 {"w": array(2, CHANNELS // 2, 1, 1, seed=4)}, r"group 2, .*expected a 1x1 convolution without groups",
                 id="grouped-pointwise-conv"),
    pytest.param([node("Flatten", ["map"], "flat"), node("Gemm", ["flat", "fc_w"], "fc", transB=1),
                  node("Mul", ["fc", "not_per_class"], "out")],
                 {**GEMM, "not_per_class": array(CLASSES, 1, seed=5)},
                 r"Mul 'out' .* uses a constant of shape \(3, 1\); expected one value per feature \(3\) or a scalar",
                 id="constant-of-another-shape"),
])
def test_heads_whose_constants_cannot_be_made_dense_are_refused_by_the_rebuild(head, constants, message):
    graph = canonical(ir.from_proto(classifier(head, constants)), input_shape=[1, 3, SIZE, SIZE])
    found = find_head(graph, training_size=(SIZE, SIZE), layout=LAYOUT_NCHW)
    with pytest.raises(ConversionError, match=message):
        fully_convolutional(graph, found)


def test_a_classifier_with_two_outputs_is_refused():
    model = classifier([node("Flatten", ["map"], "flat"), node("Gemm", ["flat", "fc_w"], "out", transB=1),
                        node("Relu", ["out"], "second")], GEMM, outputs=("out", "second"))
    graph = canonical(ir.from_proto(model), input_shape=[1, 3, SIZE, SIZE])
    with pytest.raises(ConversionError, match=r"expected a classifier with one output, got 2: \['out', 'second'\]"):
        find_head(graph, training_size=(SIZE, SIZE), layout=LAYOUT_NCHW)


HEAD = [node("GlobalAveragePool", ["map"], "gap"), node("Flatten", ["gap"], "flat"), node("Gemm", ["flat", "w"], "out", transB=1)]


@pytest.mark.parametrize("body, constants, message", [
    pytest.param([node("GlobalAveragePool", ["relu"], "squeezed"), node("Mul", ["relu", "squeezed"], "map")], {},
                 r"GlobalAveragePool 'squeezed' .*: global pooling inside the body", id="squeeze-excitation"),
    pytest.param([node("ReduceMean", ["relu"], "squeezed", axes=[3], keepdims=1), node("Mul", ["relu", "squeezed"], "map")], {},
                 r"ReduceMean 'squeezed' .*: a reduction over H, W inside the body", id="reduce-over-w"),
    pytest.param([node("Resize", ["relu", "", "scales"], "map", mode="nearest")], {"scales": np.array([1, 1, 1, 1], np.float32)},
                 r"Resize 'map' .*: it rescales the map", id="resize"),
    pytest.param([node("Slice", ["relu", "starts", "ends", "axes"], "map")],
                 {"starts": np.array([0], np.int64), "ends": np.array([4], np.int64), "axes": np.array([3], np.int64)},
                 r"Slice 'map' .*: a Slice with a fixed end on H or W", id="slice-fixed-end"),
    pytest.param([node("Reshape", ["relu", "shape"], "map")], {"shape": np.array([1, CHANNELS, MAP * MAP // 2, 2], np.int64)},
                 r"Reshape 'map' .*: a Reshape/Flatten of a feature map inside the body", id="reshape-in-body"),
    pytest.param([node("MatMul", ["relu", "relu"], "map")], {},
                 r"MatMul 'map' .*: a product of two computed tensors \(attention\)", id="attention"),
])
def test_bodies_that_mix_positions_are_refused(body, constants, message):
    model = classifier(HEAD, {"w": array(CLASSES, CHANNELS, seed=4), **constants}, body=body)
    graph = canonical(ir.from_proto(model), input_shape=[1, 3, SIZE, SIZE])
    with pytest.raises(ConversionError, match=f"cannot convert faithfully: {message}"):
        find_head(graph, training_size=(SIZE, SIZE), layout=LAYOUT_NCHW)


def test_a_slice_to_the_end_of_the_map_converts():
    """Trimming a border (start 1, end "to the end") reads each position alone: not refused, and exact."""
    body = [node("Slice", ["relu", "starts", "ends", "axes"], "map")]
    constants = {"starts": np.array([1], np.int64), "ends": np.array([2**62], np.int64), "axes": np.array([3], np.int64)}
    model = classifier(HEAD, {"w": array(CLASSES, CHANNELS, seed=4), **constants}, body=body)
    head, dense = surgery(model)
    assert head.map_shape == (CHANNELS, MAP, MAP - 1)
