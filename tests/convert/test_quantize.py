"""int8 (convert.quantize, convert.calibration, scoremap-convert --precision int8): photos fed as the server feeds
them, the calibration method chosen by measurement, the check recorded in the card, refusal below the thresholds
naming the worst layer, --allow-precision-loss, and the profile of what onnxruntime runs."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from PIL import Image

from convert import int8_kernels
from convert.calibration import HELD_OUT_EVERY, as_fed, default_set, fed_sides, fed_size, folder_set
from convert.card import Precision, read_card, write_card
from convert.convert_cli import EXIT_CONVERSION, EXIT_OK, EXIT_USAGE, main
from convert.errors import ConversionError, UsageError
from convert.int8_forms import INTEGER_CLASSIFIER, INTEGER_HEAD
from convert.memory_model import PROVIDER_TERMS, Device
from convert.profile import _int8_scratch, profile_model
from convert.int8_passes import (PAIR_SUM_LEVELS, channel_means, correct_biases, float_layers, head_nodes, name_nodes,
                                 pair_bounded_levels, pair_bounded_scale, weight_sensitivity)
from convert import quantize as quantize_module
from convert.quantize import fallback_ranking, input_grid, quantize, to_int8
from server.geometry.dense import resized_size
from protos.model_card_pb2 import Int8Weights
from tests.tiny_models import heavy_net, int8_net, mobile_net, patch_net


@pytest.fixture(scope="module")
def photos():
    return default_set()


def small_net() -> onnx.ModelProto:
    """heavy_net narrow and shallow: quantizes in a second."""
    return heavy_net(width=8, depth=2)


def photo_folder(folder, count: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for index in range(count):
        Image.fromarray(rng.integers(0, 256, (48 + index, 80, 3), dtype=np.uint8)).save(folder / f"p{index:02d}.png")
    (folder / "notes.txt").write_text("not a photo")
    return folder


def test_photos_are_resized_as_a_request_at_each_side_is(photos):
    card = read_card(small_net())
    assert fed_sides(card) == (card.training_height, card.default_scale)
    for height, width in [(300, 451), (512, 384), (97, 1000)]:
        assert fed_size(height, width, side=224, multiple=32) == resized_size(height, width, scale=224, multiple=32)
    tensor = as_fed(photos.calibration[0], card, side=64)
    assert tensor.shape[0] == 1 and tensor.shape[1] == 3 and min(tensor.shape[2:]) == 64


def test_a_folder_holds_out_every_fourth_photo_and_skips_what_is_no_image(tmp_path):
    chosen = folder_set(photo_folder(tmp_path, 8))
    assert [photo.name for photo in chosen.held_out] == [f"p{index:02d}.png" for index in range(8)
                                                        if index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    assert len(chosen.calibration) == 6
    with pytest.raises(UsageError, match="holds 1 readable image"):
        folder_set(photo_folder(tmp_path / "one", 1) if (tmp_path / "one").mkdir() is None else None)


def test_the_default_set_holds_out_ten_photos_never_calibrated_on(photos):
    assert len(photos.held_out) >= 10
    assert not {photo.name for photo in photos.held_out} & {photo.name for photo in photos.calibration}


def test_the_input_is_quantized_on_the_pixel_grid_when_the_normalisation_allows():
    default = read_card(patch_net(classes=2))
    assert input_grid(default) == (1.0, 0)
    default.preprocessing.ClearField("mean")
    default.preprocessing.ClearField("std")
    default.preprocessing.mean.extend([127.0] * 3)
    default.preprocessing.std.extend([128.0] * 3)
    assert input_grid(default) == (1 / 128, 127)
    default.preprocessing.mean[0] = 120.0
    assert input_grid(default) is None


def test_the_method_is_chosen_by_measurement_and_the_check_recorded(photos):
    fp32 = mobile_net()  # a net that quantizes well (small_net's few dozen cells flip one in thirty by chance)
    int8 = to_int8(fp32, photos, methods=("minmax", "percentile"))
    card = read_card(int8)
    record = card.quantization
    assert card.precision == Precision.PRECISION_INT8 and card.verification.passed and not record.warning
    assert [trial.method for trial in record.trials] == ["minmax", "percentile"]
    best = max(record.trials, key=lambda trial: (trial.calibration.top1_agreement, trial.calibration.mean_map_correlation))
    assert record.method == best.method
    assert record.held_out.images == len(photos.held_out) and list(record.held_out.sides) == list(fed_sides(card))
    assert record.held_out.top1_agreement >= record.min_top1_agreement
    assert 0 < record.held_out.max_probability_diff < 1 and record.held_out.mean_probability_diff > 0
    assert any(f"{node.op_type} '{node.name}'" in record.worst_layer for node in fp32.graph.node)
    assert "dB" in record.worst_layer
    assert any(node.op_type == "DequantizeLinear" for node in int8.graph.node)


def test_a_net_that_quantizes_badly_is_refused_naming_its_worst_layer_unless_the_loss_is_allowed(photos):
    """Half the first layer's channels 10^4 times larger and the second layer's weights on them 10^4 times smaller:
    the same net in float, but one activation range for both halves rounds the small channels to nothing, and the map
    with them (the fallback off: it would keep the net's few layers in float)."""
    net = small_net()
    for name, axis, factor in (("w0", 0, 1e4), ("w1", 1, 1e-4)):
        weights = next(tensor for tensor in net.graph.initializer if tensor.name == name)
        values = onnx.numpy_helper.to_array(weights).copy()
        index = [slice(None)] * values.ndim
        index[axis] = slice(0, values.shape[axis] // 2)
        values[tuple(index)] *= factor
        weights.CopyFrom(onnx.numpy_helper.from_array(values, name))
    with pytest.raises(ConversionError, match=r"strays from the fp32 graph: .*top-1 agreement .*layer that loses the "
                                              r"most: Conv .*--allow-precision-loss"):
        to_int8(net, photos, methods=("minmax",), max_fallback_layers=0)
    written = read_card(to_int8(net, photos, methods=("minmax",), allow_precision_loss=True, max_fallback_layers=0))
    assert "below the thresholds" in written.quantization.warning and not written.verification.passed


def test_only_a_converted_fp32_graph_is_quantized(photos):
    with pytest.raises(ConversionError, match="int8 quantizes an fp32 graph"):
        to_int8(int8_net(small_net()), photos)


def test_an_int8_profile_counts_int8_weights_and_uint8_activations():
    fp32 = heavy_net()
    int8 = int8_net(fp32)
    full, quantized = (profile_model(model, height=320, width=320, batch=2) for model in (fp32, int8))
    assert quantized.dtype == "int8"
    assert 0.2 < quantized.weights_bytes / full.weights_bytes < 0.3  # int8 weights, int32 biases, float scales
    assert 0.2 < quantized.naive_activation_bytes / full.naive_activation_bytes < 0.35  # uint8 outputs
    # The first convolution (3 input channels: off onnxruntime's symmetric path) takes int32 sums of its output and
    # an im2col of its input for each image beside its uint8 input and output, the int8 run's peak.
    sums, im2col = 2 * 4 * 48 * 320 * 320, 2 * 3 * 9 * 320 * 320
    outputs = 2 * (3 + 48) * 320 * 320
    first = next(node.name for node in int8.graph.node if node.op_type == "Conv")
    assert quantized.peak_layer == first
    assert quantized.peak_activation_bytes >= sums + im2col + outputs


@pytest.mark.parametrize(("kernel", "group", "inputs", "outputs", "symmetric", "expected"), [
    ((1, 1), 1, 64, 128, True, 0),  # pointwise on the symmetric path: reads its input in place
    ((3, 3), 1, 64, 128, True, 8 * 9),  # a pointer per tap and pixel
    ((3, 3), 64, 1, 64, True, 8 * 9),  # depthwise over a multiple of 16 channels: pointers
    ((3, 3), 24, 1, 24, True, 4 * 24 + 8 * 9),  # depthwise over 24: int32 sums and pointers
    ((1, 1), 1, 320, 128, False, 4 * 128),  # a zero point of -1 (on the GEMM): int32 sums of the output
    ((3, 3), 1, 3, 48, True, 4 * 48 + 3 * 9),  # 3 input channels, off the symmetric path: sums and an im2col
])
def test_a_fused_int8_convolution_holds_its_kernels_buffers_for_each_image(kernel, group, inputs, outputs, symmetric,
                                                                           expected):
    """Bytes per output pixel, as onnxruntime's QLinearConv allocates them on x86 (qlinearconv.cc), for each image."""
    node = onnx.helper.make_node("Conv", ["x", "w"], ["y"], group=group, pads=[kernel[0] // 2] * 4)
    scratch = _int8_scratch(node, (outputs, inputs, *kernel), (2, outputs, 10, 12), symmetric=symmetric)
    assert scratch == 2 * 10 * 12 * expected


def test_a_layer_kept_in_float_inside_an_int8_graph_is_counted_in_float(photos):
    """Its input dequantized to float32 and its float32 output before the next QuantizeLinear are real tensors, where
    an int8 layer reads its uint8 input and writes uint8."""
    net = mobile_net(width=16)
    tensors = mobile_tensors(photos, net)[:2]
    int8, with_float = (quantize(net, tensors, method="minmax", keep_float=kept, bias_correction=False)
                        for kept in ((), ("depthwise",)))
    layers = [{layer.name: layer.bytes for layer in profile_model(model, height=512, width=512, batch=2).layers}
              for model in (int8, with_float)]
    uint8 = 2 * 16 * 256 * 256  # the depthwise convolution's output at 512x512 (after the stride-2 stem)
    assert layers[0]["depthwise"] == uint8
    assert layers[1]["depthwise"] == 4 * uint8 and layers[1]["depthwise_float_input"] == 4 * uint8


def test_each_int8_plan_keeps_its_own_copy_of_the_weights_its_kernels_pack():
    int8 = int8_net(heavy_net())
    packed = sum(t.raw_data and len(t.raw_data) or np.prod(t.dims) for t in int8.graph.initializer
                 if t.data_type == onnx.TensorProto.INT8 and len(t.dims) == 4)
    terms = profile_model(int8, height=64, width=64).terms
    assert terms.session_state == PROVIDER_TERMS[Device.CPU].session_bytes + packed
    assert profile_model(heavy_net(), height=64, width=64).terms.session_state == PROVIDER_TERMS[Device.CPU].session_bytes


@pytest.mark.parametrize("choice", ["auto", "full", "pair-bounded"])
def test_the_cli_writes_an_int8_model_and_prints_its_check(tmp_path, capsys, choice):
    source, out = tmp_path / "small.onnx", tmp_path / "int8.onnx"
    onnx.save(patch_classifier(), source)
    code = main([str(source), "-o", str(out), "--preprocessing", "raw", "--precision", "int8",
                 "--calibration", str(photo_folder(tmp_path / "photos", 6) if (tmp_path / "photos").mkdir() is None
                                      else None), "--calibration-method", "minmax", "--allow-precision-loss",
                 "--int8-weights", choice])
    printed = capsys.readouterr().out
    assert code == EXIT_OK, printed
    card = read_card(str(out))
    expected = int8_kernels.weights_for(choice)  # auto: this CPU's kernels decide
    assert card.precision == Precision.PRECISION_INT8 and card.quantization.weights == expected
    assert expected == (WEIGHTS[choice] if choice != "auto" else
                        WEIGHTS["pair-bounded" if int8_kernels.pair_sums_saturate() else "full"])
    assert f"int8: {int8_kernels.describe(expected)} weights, minmax calibration" in printed
    assert "held out: 1 photos" in printed


WEIGHTS = {"full": Int8Weights.INT8_WEIGHTS_FULL, "pair-bounded": Int8Weights.INT8_WEIGHTS_PAIR_BOUNDED}


def test_auto_weights_are_full_only_where_the_kernels_sum_in_32_bits(monkeypatch):
    for saturate, expected in ((True, "pair-bounded"), (False, "full")):
        monkeypatch.setattr(int8_kernels, "pair_sums_saturate", lambda saturate=saturate: saturate)
        assert int8_kernels.weights_for("auto") == WEIGHTS[expected]


def test_int8_options_without_int8_and_a_missing_folder_are_usage_errors(tmp_path, capsys):
    source = tmp_path / "small.onnx"
    onnx.save(patch_classifier(), source)
    with pytest.raises(SystemExit) as exit_:
        main([str(source), "-o", str(tmp_path / "out.onnx"), "--preprocessing", "raw", "--calibration", str(tmp_path)])
    assert exit_.value.code == EXIT_USAGE and "apply to --precision int8" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main([str(source), "-o", str(tmp_path / "out.onnx"), "--preprocessing", "raw", "--int8-weights", "full"])
    assert exit_.value.code == EXIT_USAGE and "--int8-weights apply to --precision int8" in capsys.readouterr().err
    assert main([str(source), "-o", str(tmp_path / "out.onnx"), "--preprocessing", "raw", "--precision", "int8",
                 "--calibration", str(tmp_path / "none")]) == EXIT_USAGE
    assert "is not a folder" in capsys.readouterr().err
    assert not (tmp_path / "out.onnx").exists()
    assert EXIT_CONVERSION != EXIT_USAGE


def patch_classifier() -> onnx.ModelProto:
    """A classifier (not yet converted) the CLI converts: conv 3x3 stride 2, ReLU, a 16x16 head, at 32x32."""
    from tests.convert.test_convert_cli import small_classifier

    return small_classifier()


def mobile_tensors(photos, net: onnx.ModelProto) -> list[np.ndarray]:
    card = read_card(net)
    return [as_fed(photo, card, side=side) for photo in photos.calibration for side in fed_sides(card)]


def dequantized(model: onnx.ModelProto, tensor_name: str) -> np.ndarray:
    """The float value of the DequantizeLinear output `tensor_name` of a QDQ graph (a weight or a bias)."""
    values = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    node = next(node for node in model.graph.node if node.output[0] == tensor_name)
    levels, scale = values[node.input[0]], values[node.input[1]]
    return (levels.astype(np.float64) * scale.reshape(-1, *[1] * (levels.ndim - 1))).astype(np.float32)


def conv_inputs(model: onnx.ModelProto, name: str) -> list[str]:
    return list(next(node for node in model.graph.node if node.name == name).input)


def test_the_head_from_its_pooling_to_the_output_and_the_sensitive_convolutions_stay_in_float(photos):
    net = mobile_net()
    assert head_nodes(net) == ["scores", "pool"]
    heavy = name_nodes(heavy_net())
    assert head_nodes(heavy) == [heavy.graph.node[-1].name]  # no pooling: the output's producer alone
    tensors = mobile_tensors(photos, net)[::2]
    sensitivity = weight_sensitivity(net, tensors, pointwise_bits=7)
    assert set(sensitivity) == {"stem", "depthwise", "project", "expand", "scores"}
    assert all(np.isfinite(snr) and snr > 10 for snr in sensitivity.values())
    assert list(float_layers(net, tensors, pointwise_bits=7, min_snr_db=-np.inf)) == ["scores", "pool"]
    everything = float_layers(net, tensors, pointwise_bits=7, min_snr_db=np.inf)
    assert set(everything) == {"scores", "pool", "stem", "depthwise", "project", "expand"}
    assert "dB of signal to noise" in everything["stem"]
    quantized = quantize(net, tensors, method="minmax", keep_float=("scores", "pool"))
    assert {node.op_type for node in quantized.graph.node if node.name in ("scores", "pool")} == {"Conv", "AveragePool"}
    assert conv_inputs(quantized, "scores")[1] == "scores_w"  # its float weights, no DequantizeLinear


@pytest.mark.parametrize("weights", ["pair-bounded", "full"])
def test_depthwise_weights_get_eight_bits_and_the_others_pair_bounded_or_full_as_asked(photos, weights):
    net = mobile_net()
    quantized = quantize(net, mobile_tensors(photos, net), method="minmax", bias_correction=False,
                         weights=WEIGHTS[weights])
    values = {t.name: onnx.numpy_helper.to_array(t) for t in quantized.graph.initializer}
    producers = {node.output[0]: node for node in quantized.graph.node}
    levels = {name: values[producers[conv_inputs(quantized, name)[1]].input[0]].astype(int)
              for name in ("depthwise", "project", "expand")}
    assert np.abs(levels["depthwise"]).max() == 127
    for name in ("project", "expand"):
        pairs = np.abs(levels[name].reshape(levels[name].shape[0], -1, 2)).sum(axis=2)  # neighbours in twos
        if weights == "full":  # every output channel reaches 127, and some pair of neighbours passes the bound
            assert np.all(np.abs(levels[name]).reshape(levels[name].shape[0], -1).max(axis=1) == 127)
            assert pairs.max() > PAIR_SUM_LEVELS
        else:
            assert pairs.max() <= PAIR_SUM_LEVELS
            assert np.abs(levels[name]).max() > 64  # finer than 7-bit weights
    original = {t.name: onnx.numpy_helper.to_array(t) for t in net.graph.initializer}
    weights = dequantized(quantized, conv_inputs(quantized, "depthwise")[1])
    assert np.abs(weights - original["depthwise_w"]).max() <= np.abs(original["depthwise_w"]).max() / 254 + 1e-6
    bias = dequantized(quantized, conv_inputs(quantized, "depthwise")[2])
    np.testing.assert_allclose(bias, original["depthwise_b"], atol=1e-3)  # rescaled with the weights


@pytest.mark.parametrize("shape", [(16, 32, 1, 1), (6, 5, 1, 1), (8, 3, 3, 3), (4, 7, 3, 3)])
def test_pair_bounded_weights_keep_every_pair_of_neighbours_within_the_sixteen_bit_sums(shape):
    rng = np.random.default_rng(0)
    weights = rng.normal(0, 1, shape) * rng.uniform(0.1, 3, (shape[0], 1, 1, 1))
    weights[0] *= 0.01
    weights[0, :2] = 5.0  # a channel whose two largest weights are neighbours: 64 levels each, as 7 bits give
    scale = pair_bounded_scale(weights)
    levels = pair_bounded_levels(weights, scale).astype(int)
    orders = [levels.reshape(shape[0], -1), levels.transpose(0, 2, 3, 1).reshape(shape[0], -1)]
    for flat in orders:
        padded = np.pad(flat, ((0, 0), (0, flat.shape[1] % 2)))
        assert np.abs(padded.reshape(shape[0], -1, 2)).sum(axis=2).max() <= PAIR_SUM_LEVELS
    assert 255 * PAIR_SUM_LEVELS <= 2 ** 15 - 1
    assert np.abs(levels).max() <= 127
    step = scale.reshape(-1, 1, 1, 1)
    assert np.all(np.abs(levels * step - weights) <= step)  # rounded, at most one level given back
    assert np.abs(levels[0]).max() == 64 and np.abs(levels[1:]).max() > 64


@pytest.mark.parametrize("weights", ["pair-bounded", "full"])
def test_the_fused_int8_kernels_compute_what_the_unfused_graph_computes(photos, weights):
    """The CPU's fused kernels (QLinearConv) against the same QDQ graph computed in float: pair-bounded weights cannot
    saturate AVX2's 16-bit pair sums, and full 8-bit ones are only made where the kernels sum in 32 bits, so the two
    differ by the requantization's rounding only."""
    if weights == "full" and int8_kernels.pair_sums_saturate():
        pytest.skip(f"this CPU's int8 kernels sum in 16 bits ({int8_kernels.instructions()}): full weights saturate")
    net = mobile_net()
    tensors = mobile_tensors(photos, net)
    quantized = quantize(net, tensors, method="minmax", weights=WEIGHTS[weights])
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    unfused = onnxruntime.InferenceSession(quantized.SerializeToString(), options, providers=["CPUExecutionProvider"])
    fused = onnxruntime.InferenceSession(quantized.SerializeToString(), providers=["CPUExecutionProvider"])
    step = next(onnx.numpy_helper.to_array(t) for t in quantized.graph.initializer
                if t.name == next(node.input[1] for node in quantized.graph.node if node.output[0] == "scores"))
    for tensor in tensors:
        expected, got = (session.run(None, {"image": tensor})[0] for session in (unfused, fused))
        # A saturated pair sum halves a product; the kernels' own rounding moves a score by a level or two.
        assert np.abs(got - expected).max() <= 2.5 * step, (np.abs(got - expected).max(), step)


def test_bias_correction_removes_the_mean_shift_that_rounding_leaves_in_each_convolution(photos):
    net = mobile_net()
    tensors = mobile_tensors(photos, net)
    plain = quantize(net, tensors, method="minmax", bias_correction=False)
    corrected = correct_biases(plain, net, tensors)

    def mean_shift(model: onnx.ModelProto) -> dict[str, float]:
        shifts = {}
        for name in ("stem", "depthwise", "project", "expand"):
            output = next(node.output[0] for node in model.graph.node if node.name == name)
            got = channel_means(model, [output], tensors, float_graph=False)[0]
            expected = channel_means(net, [name], tensors, float_graph=True)[0]
            shifts[name] = float(np.abs(got - expected).max())
        return shifts

    before, after = mean_shift(plain), mean_shift(corrected)
    assert sum(before.values()) > 0
    for name in before:
        assert after[name] <= 0.25 * before[name] + 1e-4, (name, before, after)
    assert quantize(net, tensors, method="minmax").SerializeToString() == corrected.SerializeToString()


def test_the_card_names_the_layers_kept_in_float_and_why(photos):
    int8 = to_int8(mobile_net(), photos, methods=("minmax",), allow_precision_loss=True)
    layers = read_card(int8).quantization.float_layers
    assert layers[:2] == [f"Conv 'scores': {INTEGER_CLASSIFIER}",
                          f"AveragePool 'pool': {INTEGER_HEAD}"]


def badly_quantizing_net(*, layers: tuple[str, ...]) -> onnx.ModelProto:
    """mobile_net with each of `layers` ("project", "expand") reading one dead input channel (always 0) through
    weights of 50: the same net in float, but its weights' int8 step (50 / 127 and coarser) rounds the live weights
    (about 0.3) to a level or none, and its output with them. Its classifier 10x stronger (the cells' top class
    follows the features, not the biases) and scored at 128 (a few dozen cells a photo), so the check can see that."""
    net = mobile_net()
    values = {tensor.name: onnx.numpy_helper.to_array(tensor).copy() for tensor in net.graph.initializer}
    values["depthwise_w"][0], values["depthwise_b"][0] = 0.0, -1.0  # ReLU6(-1): the project's input channel 0 is dead
    values["scores_w"] *= 10
    if "project" in layers:
        values["project_w"][:, 0] = 50.0
    if "expand" in layers:
        values["project_w"][0], values["project_b"][0] = 0.0, 0.0  # the expand's input channel 0 is dead
        values["expand_w"][:, 0] = 50.0
    for tensor in net.graph.initializer:
        tensor.CopyFrom(onnx.numpy_helper.from_array(values[tensor.name], tensor.name))
    card = read_card(net)
    card.default_scale = 128
    return write_card(net, card)


def test_the_fallback_keeps_the_badly_quantizing_layer_in_float_and_the_result_passes(photos, tmp_path):
    """No layer chosen up front (min_weight_snr_db=-inf): the check on the calibration photos falls short, the
    layer that loses the most is kept in float, and the quantized graph passes on both photo sets; the fused plan
    onnxruntime runs keeps that layer in float too (its input DequantizeLinear per channel)."""
    net = badly_quantizing_net(layers=("project",))
    with pytest.raises(ConversionError, match="strays from the fp32 graph"):
        to_int8(net, photos, methods=("minmax",), min_weight_snr_db=-np.inf, max_fallback_layers=0)
    int8 = to_int8(net, photos, methods=("minmax",), min_weight_snr_db=-np.inf)
    card = read_card(int8)
    record = card.quantization
    assert card.verification.passed and not record.warning
    assert [layer.split(":")[0] for layer in record.float_layers] == ["Conv 'scores'", "AveragePool 'pool'",
                                                                      "Conv 'project'"]
    assert "the fallback's choice 1" in record.float_layers[2] and "probabilities" in record.float_layers[2]
    for check in (record.calibration, record.held_out):
        assert check.top1_agreement >= record.min_top1_agreement and check.map_correlation >= record.min_map_correlation
    assert conv_inputs(int8, "project")[1] == "project_w"  # float weights
    options = onnxruntime.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "plan.onnx")
    onnxruntime.InferenceSession(int8.SerializeToString(), options, providers=["CPUExecutionProvider"])
    plan = onnx.load(options.optimized_model_filepath)
    assert not any(node.op_type == "QLinearConv" and node.name.startswith("project") for node in plan.graph.node)
    assert any(node.op_type == "QLinearConv" and node.name.startswith("expand") for node in plan.graph.node)


def test_a_layer_the_fallback_chose_that_the_later_choices_make_unneeded_goes_back_to_int8(photos, monkeypatch):
    """The ranking the fallback follows puts a harmless layer first ('expand'): it goes to float while the graph still
    falls short, the badly quantizing layer chosen after it makes the graph pass, and then 'expand' is put back in
    int8, as the graph passes without it. Without that last step both would stay in float."""
    net = badly_quantizing_net(layers=("project",))
    measured = quantize_module.fallback_ranking

    def harmless_first(*args, **kwargs):
        snr, ranking = measured(*args, **kwargs)
        return snr, sorted(ranking, key=lambda entry: entry[0] != "expand")  # stable: the rest in measured order

    monkeypatch.setattr(quantize_module, "fallback_ranking", harmless_first)
    int8 = to_int8(net, photos, methods=("minmax",), min_weight_snr_db=-np.inf)
    card = read_card(int8)
    layers = card.quantization.float_layers
    assert [layer.split(":")[0] for layer in layers] == ["Conv 'scores'", "AveragePool 'pool'", "Conv 'project'"]
    assert "the fallback's choice 2" in layers[2]
    assert card.verification.passed and not card.quantization.warning
    assert conv_inputs(int8, "expand")[1] != "expand_w" and conv_inputs(int8, "project")[1] == "project_w"


def test_a_float_layer_reading_a_per_tensor_dequantize_gets_its_own_per_channel_one(photos):
    net = badly_quantizing_net(layers=("project",))
    tensors = mobile_tensors(photos, net)
    guarded = quantize(net, tensors, method="minmax", keep_float=("scores", "pool", "project"), bias_correction=False)
    producers = {node.output[0]: node for node in guarded.graph.node}
    source = producers[conv_inputs(guarded, "project")[0]]
    scale = next(onnx.numpy_helper.to_array(t) for t in guarded.graph.initializer if t.name == source.input[1])
    assert source.op_type == "DequantizeLinear" and scale.shape == (8,) and np.all(scale == scale[0])
    shared = producers[conv_inputs(guarded, "expand")[0]]  # a quantized layer keeps its per-tensor one
    assert next(onnx.numpy_helper.to_array(t) for t in guarded.graph.initializer if t.name == shared.input[1]).ndim == 0


def test_at_the_fallback_bound_the_refusal_names_the_layers_kept_in_float(photos):
    net = badly_quantizing_net(layers=("project", "expand"))
    with pytest.raises(ConversionError, match=r"Kept in float \(the fallback's bound: at most 1 layers beyond the first "
                                              r"choice\): Conv 'scores', AveragePool 'pool', Conv '(project|expand)'\. "
                                              r"The layer that loses the most: Conv '\w+': in float, it lifts"):
        to_int8(net, photos, methods=("minmax",), min_weight_snr_db=-np.inf, max_fallback_layers=1)
    record = read_card(to_int8(net, photos, methods=("minmax",), min_weight_snr_db=-np.inf)).quantization
    assert {"Conv 'project'", "Conv 'expand'"} <= {layer.split(":")[0] for layer in record.float_layers[2:]}
    assert not record.warning


def test_the_fallback_ranks_each_quantized_layer_in_float_by_the_scores(photos):
    """Each layer with quantized weights, in turn in float, the rest of the int8 graph as it is: the badly quantizing
    layer lifts the scores' SNR the most; layers already in float are not measured."""
    net = badly_quantizing_net(layers=("project",))
    tensors = mobile_tensors(photos, net)
    quantized = quantize(net, tensors, method="minmax", keep_float=("scores", "pool"))
    snr, ranking = fallback_ranking(net, quantized, tensors, logits=True, keep_float=("scores", "pool"))
    assert [name for name, _ in ranking][0] == "project" and ranking[0][1] > snr + 6
    assert {name for name, _ in ranking} == {"stem", "depthwise", "project", "expand"}
    assert [lifted for _, lifted in ranking] == sorted((lifted for _, lifted in ranking), reverse=True)
    everything = ("scores", "pool", "stem", "depthwise", "project", "expand")
    assert fallback_ranking(net, quantize(net, tensors, method="minmax", keep_float=everything), tensors,
                            logits=True, keep_float=everything)[1] == []
