"""convert.int8_forms: the classifier as integer sums computes what the float classifier computes on the same uint8
activations, and deep pointwise weights moved to onnxruntime's GEMM keep their values, their fused kernels and their
outputs."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest

from convert import int8_kernels
from convert.calibration import as_fed, default_set, fed_sides
from convert.card import read_card
from convert.int8_forms import (INTEGER_CLASSIFIER, MIN_GEMM_CHANNELS, classifier_in_integers, gemm_weights,
                                integer_classifier, on_gemm)
from convert.int8_passes import with_outputs
from convert.quantize import quantize, to_int8
from protos.model_card_pb2 import Int8Weights
from tests.tiny_models import mobile_net

FULL, PAIR_BOUNDED = Int8Weights.INT8_WEIGHTS_FULL, Int8Weights.INT8_WEIGHTS_PAIR_BOUNDED
HEAD = ("scores", "pool")


@pytest.fixture(scope="module")
def photos():
    return default_set()


def tensors_for(photos, net: onnx.ModelProto) -> list[np.ndarray]:
    card = read_card(net)
    return [as_fed(photo, card, side=side) for photo in photos.calibration[:4] for side in fed_sides(card)]


def values(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {tensor.name: onnx.numpy_helper.to_array(tensor) for tensor in model.graph.initializer}


def node(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    return next(each for each in model.graph.node if each.name == name)


def fused(model: onnx.ModelProto, optimized=None) -> onnxruntime.InferenceSession:
    options = onnxruntime.SessionOptions()
    if optimized is not None:
        options.optimized_model_filepath = str(optimized)
    return onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def with_representable_classifier(net: onnx.ModelProto) -> tuple[onnx.ModelProto, np.ndarray]:
    """`net` with classifier weights that 8-bit levels per output channel hold exactly (each channel's largest 127
    levels), so that the integer classifier's only difference from the float one is float rounding, and its pooling
    reading the expansion before its ReLU6: signed activations, whose uint8 zero point is not 0."""
    weights = values(net)["scores_w"]
    levels = np.random.default_rng(0).integers(-127, 128, weights.shape)
    levels[:, 0] = 127
    exact = (levels * np.linspace(0.001, 0.01, weights.shape[0]).reshape(-1, 1, 1, 1)).astype(np.float32)
    out = onnx.ModelProto()
    out.CopyFrom(net)
    out.graph.node.remove(node(out, "expand_relu6"))
    node(out, "pool").input[0] = "expand"
    tensor = next(t for t in out.graph.initializer if t.name == "scores_w")
    tensor.CopyFrom(onnx.numpy_helper.from_array(exact, "scores_w"))
    return out, exact


def test_the_classifier_as_integer_sums_computes_the_float_classifier_over_the_same_uint8_activations(photos):
    net, weights = with_representable_classifier(mobile_net())
    tensors = tensors_for(photos, net)
    floats = quantize(net, tensors, method="minmax", keep_float=HEAD, weights=FULL, bias_correction=False)
    assert not classifier_in_integers(floats, "scores")  # quantize leaves it float; to_int8 decides
    quantized = integer_classifier(floats, list(HEAD), pair_bounded=False)
    assert classifier_in_integers(quantized, "scores")
    assert not any(each.op_type == "Conv" and each.name == "scores" for each in quantized.graph.node)
    uint8 = node(quantized, "scores/nhwc").input[0]  # what the integer sums read, channels last
    bias, pool = values(net)["scores_b"], node(net, "pool")
    kernel = next(attribute.ints for attribute in pool.attribute if attribute.name == "kernel_shape")
    producer = next(each for each in quantized.graph.node if each.output[0] == uint8)
    assert producer.op_type == "QuantizeLinear"  # the activations as quantized, not dequantized and pooled first
    scale, zero_point = (values(quantized)[name] for name in producer.input[1:3])
    assert int(zero_point) > 0
    session = fused(with_outputs(quantized, [uint8]))
    for tensor in tensors:
        scores, levels = session.run(["scores", uint8], {"image": tensor})
        real = (levels.astype(np.float64) - int(zero_point)) * float(scale)
        rows, columns = real.shape[2] // kernel[0], real.shape[3] // kernel[1]
        pooled = real[:, :, :rows * kernel[0], :columns * kernel[1]].reshape(
            *real.shape[:2], rows, kernel[0], columns, kernel[1]).mean(axis=(3, 5))
        expected = np.einsum("nchw,kc->nkhw", pooled, weights[:, :, 0, 0]) + bias.reshape(1, -1, 1, 1)
        assert scores.shape == expected.shape
        np.testing.assert_allclose(scores, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_pair_bounded_weights_keep_the_classifier_sums_within_the_sixteen_bit_pairs(photos):
    net = mobile_net()
    quantized = integer_classifier(quantize(net, tensors_for(photos, net), method="minmax", keep_float=HEAD,
                                            weights=PAIR_BOUNDED, bias_correction=False), list(HEAD), pair_bounded=True)
    levels = values(quantized)[node(quantized, "scores/integer_sums").input[1]].astype(int)  # [C, K]
    assert np.abs(levels).max() <= 127
    assert np.abs(np.pad(levels.T, ((0, 0), (0, levels.shape[0] % 2))).reshape(levels.shape[1], -1, 2)).sum(axis=2).max() <= 128


def test_a_classifier_whose_input_is_not_quantized_stays_a_float_convolution(photos):
    net = mobile_net()
    floats = quantize(net, tensors_for(photos, net), method="minmax", keep_float=(*HEAD, "expand"), weights=FULL,
                      bias_correction=False)
    quantized = integer_classifier(floats, list(HEAD), pair_bounded=False)
    assert quantized is floats and not classifier_in_integers(quantized, "scores")
    assert node(quantized, "scores").input[1] == "scores_w"  # its float weights: the pool reads float activations


def test_deep_pointwise_weights_move_to_the_gemm_with_their_values_kernels_and_outputs_kept(photos, monkeypatch, tmp_path):
    monkeypatch.setattr(int8_kernels, "gemm_on_amx", lambda: False)
    net = mobile_net(width=MIN_GEMM_CHANNELS)  # a projection over 320 channels and an expansion from them
    tensors = tensors_for(photos, net)[:2]
    symmetric = quantize(net, tensors, method="minmax", keep_float=HEAD, weights=FULL, bias_correction=False)
    moved = gemm_weights(symmetric)
    before, after = values(symmetric), values(moved)
    producers = {each.output[0]: each for each in moved.graph.node}
    for name in ("stem", "depthwise", "project", "expand"):
        dequantize = producers[node(moved, name).input[1]]
        levels, zero_point = after[dequantize.input[0]].astype(int), after[dequantize.input[2]].astype(int)
        original = before[next(each for each in symmetric.graph.node if each.output[0] == dequantize.output[0]).input[0]]
        deep = name in ("project", "expand")  # 1x1 over at least MIN_GEMM_CHANNELS input channels
        assert np.all(zero_point == (-1 if deep else 0)), name
        np.testing.assert_array_equal(levels - zero_point.reshape(-1, 1, 1, 1), original.astype(int))
    kinds = []
    for model, path in ((symmetric, tmp_path / "symmetric.onnx"), (moved, tmp_path / "moved.onnx")):
        session = fused(model, optimized=path)
        kinds.append(sorted(each.op_type for each in onnx.load(path).graph.node if "Conv" in each.op_type))
        outputs = [session.run(None, {"image": tensor})[0] for tensor in tensors]
        if model is symmetric:
            expected = outputs
    assert kinds[0] == kinds[1] and kinds[0].count("QLinearConv") == 4  # still fused: int8 kernels, not float
    for got, want in zip(outputs, expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize(("amx", "weights", "moved"), [(True, FULL, True), (False, FULL, False),
                                                       (True, PAIR_BOUNDED, False)])
def test_quantize_moves_them_on_a_cpu_with_amx_and_full_weights_only(photos, monkeypatch, amx, weights, moved):
    monkeypatch.setattr(int8_kernels, "gemm_on_amx", lambda: amx)
    net = mobile_net(width=MIN_GEMM_CHANNELS)
    quantized = quantize(net, tensors_for(photos, net)[:1], method="minmax", keep_float=HEAD, weights=weights,
                         bias_correction=False)
    producers = {each.output[0]: each for each in quantized.graph.node}
    zero_point = values(quantized)[producers[node(quantized, "project").input[1]].input[2]]
    assert np.all(zero_point == (-1 if moved else 0))
    assert on_gemm(quantized) == (2 if moved else 0)  # the projection and the expansion


def test_to_int8_makes_the_classifier_integer_sums_where_the_calibration_photos_still_pass(photos):
    int8 = to_int8(mobile_net(), photos, methods=("minmax",), weights=FULL)
    record = read_card(int8).quantization
    assert classifier_in_integers(int8, "scores")
    assert record.float_layers[0] == f"Conv 'scores': {INTEGER_CLASSIFIER}"
    assert "MatMulInteger" not in record.float_ops and "AveragePool" in record.float_ops
    assert record.calibration.top1_agreement >= record.min_top1_agreement


def test_to_int8_keeps_a_classifier_in_float_when_its_integer_sums_fall_short(photos, monkeypatch):
    from convert import quantize as quantize_module

    def coarse(quantized, head, *, pair_bounded):  # the classifier's weights at a few levels: far off
        model = integer_classifier(quantized, head, pair_bounded=pair_bounded)
        tensor = next(t for t in model.graph.initializer if t.name == "scores/levels")
        levels = onnx.numpy_helper.to_array(tensor)
        tensor.CopyFrom(onnx.numpy_helper.from_array((np.sign(levels) * 127).astype(np.int8), tensor.name))
        return model

    monkeypatch.setattr(quantize_module, "integer_classifier", coarse)
    int8 = to_int8(mobile_net(), photos, methods=("minmax",), weights=FULL)
    assert not classifier_in_integers(int8, "scores")
    assert read_card(int8).quantization.float_layers[0] == "Conv 'scores': the classifier head (float logits and pooling)"


def test_a_classifier_whose_pooled_features_are_read_elsewhere_stays_as_it_is(photos):
    """The pooled features as a second output (an embedding beside the scores): the pool must stay, so the classifier
    does too."""
    net = mobile_net()
    net.graph.output.append(onnx.helper.make_empty_tensor_value_info("pooled"))
    floats = quantize(net, tensors_for(photos, net), method="minmax", keep_float=HEAD, weights=FULL,
                      bias_correction=False)
    assert integer_classifier(floats, list(HEAD), pair_bounded=False) is floats


def test_a_classifier_without_a_bias_runs_as_integer_sums_on_a_batch(photos):
    net, weights = with_representable_classifier(mobile_net())
    conv = node(net, "scores")
    del conv.input[2]
    tensors = tensors_for(photos, net)
    floats = quantize(net, tensors, method="minmax", keep_float=HEAD, weights=FULL, bias_correction=False)
    quantized = integer_classifier(floats, list(HEAD), pair_bounded=False)
    assert classifier_in_integers(quantized, "scores")
    assert next(each for each in quantized.graph.node if each.output[0] == "scores").op_type == "AveragePool"
    batch = np.concatenate([tensors[0], tensors[0][:, :, ::-1]])  # two images of one size
    expected, got = (fused(model).run(["scores"], {"image": batch})[0] for model in (floats, quantized))
    assert got.shape == expected.shape and got.shape[0] == 2
    # The float head pools rounded activations the same way; only float rounding and summation order differ.
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-3 * np.abs(expected).max())
