"""ONNX families built with onnx.helper: tf2onnx (Keras) graphs and Caffe-era model-zoo graphs."""

import collections

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from convert import convert_classifier
from convert.card import read_card
from convert.normalize import normalize, runnable
from convert.preprocessing import to_input
from convert.verify import compare_with_crops, run, sample_pixels
from convert.presets import preset
from protos.model_card_pb2 import (
    CHANNEL_ORDER_RGB,
    INPUT_DTYPE_FLOAT32,
    INPUT_DTYPE_UINT8,
    LAYOUT_NCHW,
    LAYOUT_NHWC,
    OUTPUT_KIND_LOGITS,
    OUTPUT_KIND_PROBABILITIES,
    Preprocessing,
)

CROP_TOLERANCE = 1e-5
UNIT_RANGE = Preprocessing(channel_order=CHANNEL_ORDER_RGB, pixel_scale=1.0, mean=[127.5] * 3, std=[127.5] * 3)
UNIT_NHWC = Preprocessing(layout=LAYOUT_NHWC, dtype=INPUT_DTYPE_FLOAT32, channel_order=CHANNEL_ORDER_RGB, pixel_scale=1.0, mean=[127.5] * 3, std=[127.5] * 3)
UNIT_NCHW = Preprocessing(layout=LAYOUT_NCHW, dtype=INPUT_DTYPE_FLOAT32, channel_order=CHANNEL_ORDER_RGB, pixel_scale=1.0, mean=[127.5] * 3, std=[127.5] * 3)
rng = np.random.default_rng(0)

RAW = preset("raw")


def weight(name: str, *shape: int, scale: float = 0.2) -> onnx.TensorProto:
    return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)


def int64s(name: str, values) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(values, np.int64), name)


def tf2onnx_classifier(size: int = 18) -> onnx.ModelProto:
    """Keras through tf2onnx: NHWC input, Transpose, flatten shape from Shape/Gather/Slice/Concat, Dense as MatMul+Add, BN as Mul+Add."""
    nodes = [
        helper.make_node("Transpose", ["input_1"], ["nchw"], perm=[0, 3, 1, 2]),
        helper.make_node("Conv", ["nchw", "conv1_w", "conv1_b"], ["c1"], kernel_shape=[3, 3]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "conv2_w", "conv2_b"], ["c2"], kernel_shape=[3, 3]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("MaxPool", ["r2"], ["p2"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Transpose", ["p2"], ["nhwc"], perm=[0, 2, 3, 1]),
        helper.make_node("Shape", ["nhwc"], ["shape"]),
        helper.make_node("Slice", ["shape", "zero", "one"], ["batch"]),
        helper.make_node("Gather", ["shape", "hwc_axes"], ["hwc"]),
        helper.make_node("ReduceProd", ["hwc"], ["features"], keepdims=1),
        helper.make_node("Concat", ["batch", "features"], ["flat_shape"], axis=0),
        helper.make_node("Reshape", ["nhwc", "flat_shape"], ["flat"]),
        helper.make_node("MatMul", ["flat", "dense1_w"], ["d1"]),
        helper.make_node("Add", ["d1", "dense1_b"], ["d1b"]),
        helper.make_node("Mul", ["d1b", "bn_scale"], ["bn1"]),
        helper.make_node("Add", ["bn1", "bn_shift"], ["bn2"]),
        helper.make_node("Relu", ["bn2"], ["r3"]),
        helper.make_node("MatMul", ["r3", "dense2_w"], ["d2"]),
        helper.make_node("Add", ["d2", "dense2_b"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["dense_2"], axis=-1),
    ]
    initializers = [
        weight("conv1_w", 4, 3, 3, 3), weight("conv1_b", 4), weight("conv2_w", 6, 4, 3, 3), weight("conv2_b", 6),
        int64s("zero", [0]), int64s("one", [1]), int64s("hwc_axes", [1, 2, 3]),
        weight("dense1_w", 3 * 3 * 6, 10), weight("dense1_b", 10), weight("bn_scale", 10, scale=1.0), weight("bn_shift", 10),
        weight("dense2_w", 10, 3), weight("dense2_b", 3),
    ]
    graph = helper.make_graph(
        nodes, "keras_model",
        [helper.make_tensor_value_info("input_1", TensorProto.FLOAT, ["unk__0", size, size, 3])],
        [helper.make_tensor_value_info("dense_2", TensorProto.FLOAT, ["unk__0", 3])],
        initializers,
    )
    return helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 13)], producer_name="tf2onnx")


def test_tf2onnx_graph_converts_keeping_nhwc_input_and_hwc_flatten_order():
    model = tf2onnx_classifier()
    converted = convert_classifier(model, preprocessing=UNIT_RANGE)
    card = read_card(converted)
    assert card.preprocessing.layout == LAYOUT_NHWC and card.preprocessing.input_name == "input_1"
    assert (card.training_height, card.output_stride, card.output_kind) == (18, 4, OUTPUT_KIND_PROBABILITIES)
    assert card.verification.passed
    image = to_input(sample_pixels(count=1, height=34, width=30, channels=3, seed=1), card.preprocessing)
    report = compare_with_crops(model, converted, image, layout=LAYOUT_NHWC, training_size=(18, 18), stride=4)
    assert report.grid == (5, 4) and report.max_abs_diff <= CROP_TOLERANCE and report.argmax_agreement == 1.0


def test_nhwc_graph_matches_the_classifier_at_the_training_size():
    """Cell (0, 0) equals the Keras output, so the h,w,c flatten order was permuted right."""
    model = tf2onnx_classifier()
    image = to_input(sample_pixels(count=2, height=18, width=18, channels=3), UNIT_NHWC)
    expected = run(model, image)
    dense = run(convert_classifier(model, preprocessing=UNIT_RANGE), image)[:, :, 0, 0]
    np.testing.assert_allclose(dense, expected, atol=1e-5)
    assert np.abs(expected - expected.mean(axis=0)).max() > 1e-3  # the two samples differ: the check can fail


def test_normalisation_folds_the_computed_flatten_shape():
    model = tf2onnx_classifier()
    counts = collections.Counter(n.op_type for n in normalize(model, input_shape=[1, 18, 18, 3]).graph.node)
    assert not {"Shape", "Gather", "Slice", "Concat", "ReduceProd"} & set(counts)
    assert counts["Reshape"] == 1


def caffe_classifier(size: int = 19) -> onnx.ModelProto:
    """A model-zoo graph of the Caffe era: opset 9, batch fixed at 1, weights as inputs and from constant subgraphs,
    LRN, Reshape + Gemm(transB=1), Dropout, Softmax with opset < 13 semantics."""
    def constant(name, array):
        return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(array), name + "_value"))

    fc6_flat = (rng.standard_normal(16 * 8 * 3 * 3) * 0.1).astype(np.float32)
    nodes = [
        constant("conv1_w", (rng.standard_normal((8, 3, 3, 3)) * 0.2).astype(np.float32)),
        helper.make_node("Conv", ["data_0", "conv1_w", "conv1_b"], ["conv1"], kernel_shape=[3, 3]),
        helper.make_node("Relu", ["conv1"], ["relu1"]),
        helper.make_node("LRN", ["relu1"], ["norm1"], size=3, alpha=1e-4, beta=0.75, bias=1.0),
        helper.make_node("MaxPool", ["norm1"], ["pool1"], kernel_shape=[3, 3], strides=[2, 2]),
        helper.make_node("Conv", ["pool1", "conv2_w", "conv2_b"], ["conv2"], kernel_shape=[3, 3]),
        helper.make_node("Relu", ["conv2"], ["relu2"]),
        helper.make_node("MaxPool", ["relu2"], ["pool2"], kernel_shape=[2, 2], strides=[2, 2]),
        constant("flat_shape", np.array([1, -1], np.int64)),
        helper.make_node("Reshape", ["pool2", "flat_shape"], ["flat"]),
        # fc6 weights computed by a constant subgraph: a flat Constant reshaped, then scaled.
        constant("fc6_flat", fc6_flat),
        constant("fc6_shape", np.array([16, 8 * 3 * 3], np.int64)),
        helper.make_node("Reshape", ["fc6_flat", "fc6_shape"], ["fc6_raw"]),
        constant("fc6_scale", np.array(0.5, np.float32)),
        helper.make_node("Mul", ["fc6_raw", "fc6_scale"], ["fc6_w"]),
        helper.make_node("Gemm", ["flat", "fc6_w", "fc6_b"], ["fc6"], transB=1),
        helper.make_node("Relu", ["fc6"], ["relu6"]),
        helper.make_node("Dropout", ["relu6"], ["drop6"], ratio=0.5),
        helper.make_node("Gemm", ["drop6", "fc7_w", "fc7_b"], ["fc7"], transB=1, alpha=0.5, beta=2.0),
        helper.make_node("Softmax", ["fc7"], ["prob_1"]),
    ]
    weights = [weight("conv1_b", 8), weight("conv2_w", 8, 8, 3, 3), weight("conv2_b", 8),
               weight("fc6_b", 16), weight("fc7_w", 5, 16), weight("fc7_b", 5)]
    inputs = [helper.make_tensor_value_info("data_0", TensorProto.FLOAT, [1, 3, size, size])]
    inputs += [helper.make_tensor_value_info(w.name, TensorProto.FLOAT, list(w.dims)) for w in weights]
    graph = helper.make_graph(nodes, "caffe_net", inputs,
                              [helper.make_tensor_value_info("prob_1", TensorProto.FLOAT, [1, 5])], weights)
    return helper.make_model(graph, ir_version=4, opset_imports=[helper.make_opsetid("", 9)])


def test_caffe_era_graph_converts_and_dense_cells_equal_crops():
    model = caffe_classifier()
    onnx.checker.check_model(model)
    converted = convert_classifier(model, preprocessing=UNIT_RANGE)
    card = read_card(converted)
    assert (card.output_stride, card.output_kind, len(card.labels)) == (4, OUTPUT_KIND_PROBABILITIES, 5)
    assert [value.name for value in converted.graph.input] == ["data_0"]  # weights are initializers, not inputs
    assert card.verification.passed
    image = to_input(sample_pixels(count=1, height=35, width=27, channels=3, seed=2), card.preprocessing)
    report = compare_with_crops(model, converted, image, layout=LAYOUT_NCHW, training_size=(19, 19), stride=4)
    assert report.grid == (5, 3) and report.max_abs_diff <= CROP_TOLERANCE and report.argmax_agreement == 1.0
    scores = run(converted, np.concatenate([image, image]))
    np.testing.assert_allclose(scores.sum(axis=1), 1.0, atol=1e-5)  # the softmax acts on the class axis per cell


def test_normalisation_of_caffe_graph_by_node_counts():
    model = caffe_classifier()
    before = collections.Counter(n.op_type for n in model.graph.node)
    after = collections.Counter(n.op_type for n in normalize(runnable(model), input_shape=[1, 3, 19, 19]).graph.node)
    assert before["Constant"] == 5 and before["Dropout"] == 1 and before["Mul"] == 1 and before["Reshape"] == 2
    assert after["Constant"] == 0 and after["Dropout"] == 0 and after["Mul"] == 0 and after["Reshape"] == 1
    assert sum(after.values()) == sum(before.values()) - 5 - 1 - 1 - 1


def conv_bn_identity() -> onnx.ModelProto:
    """A PyTorch-style export before fusion: Conv → BatchNormalization → Identity → GAP → Flatten → Gemm."""
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "g", "beta", "mean", "var"], ["bn"], epsilon=1e-3),
        helper.make_node("Identity", ["bn"], ["bn_id"]),
        helper.make_node("Relu", ["bn_id"], ["r"]),
        helper.make_node("GlobalAveragePool", ["r"], ["gap"]),
        helper.make_node("Flatten", ["gap"], ["flat"]),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"], transB=1),
    ]
    weights = [weight("w", 4, 3, 3, 3), weight("b", 4), weight("g", 4, scale=1.0), weight("beta", 4),
               weight("mean", 4), numpy_helper.from_array((rng.random(4) + 0.5).astype(np.float32), "var"),
               weight("fc_w", 2, 4), weight("fc_b", 2)]
    graph = helper.make_graph(nodes, "torch_bn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 2])], weights)
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])


def test_batch_norm_folds_into_the_conv_and_identity_goes():
    model = conv_bn_identity()
    cleaned = normalize(model, input_shape=[1, 3, 8, 8])
    counts = collections.Counter(n.op_type for n in cleaned.graph.node)
    assert counts == collections.Counter({"Conv": 1, "Relu": 1, "GlobalAveragePool": 1, "Flatten": 1, "Gemm": 1})
    image = to_input(sample_pixels(count=1, height=8, width=8, channels=3), UNIT_NCHW)  # normalised at batch 1
    np.testing.assert_allclose(run(cleaned, image), run(model, image), atol=1e-5)
    converted = convert_classifier(model, preprocessing=UNIT_RANGE)
    assert collections.Counter(n.op_type for n in converted.graph.node) == collections.Counter(
        {"Conv": 2, "Relu": 1, "AveragePool": 1})
    assert read_card(converted).output_kind == OUTPUT_KIND_LOGITS


def test_uint8_nhwc_input_with_logsoftmax_head():
    """A quantised-era export: uint8 NHWC pixels cast inside the graph, ReduceMean over H, W, LogSoftmax out."""
    nodes = [
        helper.make_node("Cast", ["pixels"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("Transpose", ["f"], ["nchw"], perm=[0, 3, 1, 2]),
        helper.make_node("Conv", ["nchw", "w"], ["c"], kernel_shape=[3, 3]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("ReduceMean", ["r"], ["mean"], axes=[2, 3], keepdims=0),
        helper.make_node("Gemm", ["mean", "fc_w"], ["logits"]),
        helper.make_node("LogSoftmax", ["logits"], ["log_probs"], axis=1),
    ]
    inits = [weight("w", 4, 3, 3, 3, scale=0.01), weight("fc_w", 4, 6)]
    graph = helper.make_graph(nodes, "uint8_net", [helper.make_tensor_value_info("pixels", TensorProto.UINT8, [None, 10, 10, 3])],
                              [helper.make_tensor_value_info("log_probs", TensorProto.FLOAT, [None, 6])], inits)
    model = helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 13)])
    converted = convert_classifier(model, preprocessing=RAW)
    card = read_card(converted)
    assert (card.preprocessing.dtype, card.preprocessing.layout, card.output_kind) == (INPUT_DTYPE_UINT8, LAYOUT_NHWC, OUTPUT_KIND_LOGITS)
    assert card.verification.passed
    pixels = to_input(sample_pixels(count=1, height=14, width=12, channels=3, seed=4), card.preprocessing)
    assert pixels.dtype == np.uint8
    report = compare_with_crops(model, converted, pixels, layout=LAYOUT_NHWC, training_size=(10, 10), stride=1)
    assert report.grid == (5, 3) and report.max_abs_diff <= CROP_TOLERANCE and report.argmax_agreement == 1.0
    np.testing.assert_allclose(np.exp(run(converted, pixels)).sum(axis=1), 1.0, atol=1e-5)


def squeezenet_style(*, global_pool: bool) -> onnx.ModelProto:
    """A classifier that ends in convolutions (SqueezeNet, Caffe era): conv classes, then an average pool as large as
    the map (or GlobalAveragePool), then Softmax on [N, K, 1, 1] with opset-9 semantics."""
    pool = (helper.make_node("GlobalAveragePool", ["r2"], ["pool10"]) if global_pool
            else helper.make_node("AveragePool", ["r2"], ["pool10"], kernel_shape=[4, 4]))
    nodes = [
        helper.make_node("Conv", ["data", "w1"], ["c1"], kernel_shape=[3, 3], strides=[2, 2]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], kernel_shape=[1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        pool,
        helper.make_node("Softmax", ["pool10"], ["softmaxout_1"]),
    ]
    inits = [weight("w1", 6, 3, 3, 3, scale=0.02), weight("w2", 7, 6, 1, 1), weight("b2", 7)]
    graph = helper.make_graph(nodes, "squeezenet_like", [helper.make_tensor_value_info("data", TensorProto.FLOAT, [1, 3, 9, 9])],
                              [helper.make_tensor_value_info("softmaxout_1", TensorProto.FLOAT, [1, 7, 1, 1])], inits)
    return helper.make_model(graph, ir_version=4, opset_imports=[helper.make_opsetid("", 9)])


@pytest.mark.parametrize("global_pool", [False, True], ids=["pool-as-large-as-the-map", "global-average-pool"])
def test_classifier_ending_in_convolutions_converts(global_pool):
    model = squeezenet_style(global_pool=global_pool)
    converted = convert_classifier(model, preprocessing=RAW)
    card = read_card(converted)
    assert (card.output_stride, card.output_kind, len(card.labels)) == (2, OUTPUT_KIND_PROBABILITIES, 7)
    assert card.verification.passed
    pixels = to_input(sample_pixels(count=1, height=15, width=13, channels=3, seed=6), card.preprocessing)
    report = compare_with_crops(model, converted, pixels, layout=LAYOUT_NCHW, training_size=(9, 9), stride=2)
    assert report.grid == (4, 3) and report.max_abs_diff <= CROP_TOLERANCE and report.argmax_agreement == 1.0
    np.testing.assert_allclose(run(converted, pixels).sum(axis=1), 1.0, atol=1e-5)
