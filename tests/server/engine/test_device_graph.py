"""The plan graph (server/engine/device_graph.py) against the host definition it replaces.

Reference: convert.preprocessing normalises on the host, each pass is the normalised canvas shifted
in numpy and 0-filled, the plain converted net scores it, numpy interleaves, softmaxes and takes
the masked mean. Both run on the same provider; on CUDA (TF32) the comparison loosens to 1e-3.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from convert.card import (
    ChannelOrder, ImageInput, InputDtype, Layout, ModelCard, OutputKind, Precision, Preprocessing, ReceptiveField,
    is_logits, read_card, write_card,
)
from convert.precision import to_fp16
from convert.presets import PRESETS, preset
from convert.preprocessing import normalize, to_layout
from server.engine.device_graph import (
    LATTICE, LATTICE_FP16, OWN_PREFIX, PIXELS, PROBABILITIES, VALID, DeviceGraphError, build_plan_graph,
    lattice_cells,
)
from server.engine.providers import cuda_device_present
from tests.tiny_models import coordinate_net, heavy_net, int8_net, patch_net

CUDA = "CUDAExecutionProvider"
ON_GPU = CUDA in onnxruntime.get_available_providers() and cuda_device_present()
PROVIDERS = [CUDA, "CPUExecutionProvider"] if ON_GPU else ["CPUExecutionProvider"]
S = 16  # the lattice stride of a stride-32 net's factor-2 plans
GRID = ((0, 0), (0, S), (S, 0), (S, S))
DIAGONAL = ((0, 0), (S, S))


def session(model: onnx.ModelProto) -> onnxruntime.InferenceSession:
    return onnxruntime.InferenceSession(model.SerializeToString(), providers=PROVIDERS)


def assert_close(actual: np.ndarray, expected: np.ndarray, *, on: onnxruntime.InferenceSession, fp16: bool = False):
    """To 1e-5 on the CPU; ~1e-3 relative on CUDA, whose convolutions run in TF32; NaN where expected NaN."""
    tolerance = 1e-3 if fp16 or on.get_providers()[0] == CUDA else 1e-5
    scale = max(1.0, float(np.nanmax(np.abs(expected))))
    np.testing.assert_allclose(actual.astype(np.float32), expected, rtol=tolerance, atol=tolerance * scale)


def small_patch_net(*, output_kind: str = "logits") -> onnx.ModelProto:
    """patch_net with weights small enough that the softmax over raw 0..255 pixels is not saturated."""
    weights = np.random.default_rng(3).normal(0, 2e-4, (5, 3, 32, 32)).astype(np.float32)
    return patch_net(classes=5, weights=weights, output_kind=output_kind)


def card_net(nodes, initializers, *, input_type: int, input_shape: list, preprocessing: Preprocessing,
             classes: int, name: str) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, name, [helper.make_tensor_value_info("input", input_type, input_shape)],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", classes, "h", "w"])], initializer=initializers,
    )
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])
    card = ModelCard(
        name=name, labels=[f"c{i}" for i in range(classes)], preprocessing=preprocessing,
        training_height=32, training_width=32, output_stride=32,
        receptive_field=ReceptiveField(size=32, center_y=15.5, center_x=15.5), scores_name="scores",
        output_kind=OutputKind.OUTPUT_KIND_LOGITS, precision=Precision.PRECISION_FP32, default_scale=64, size_multiple=32,
    )
    return write_card(model, card)


def nhwc_float16_net() -> onnx.ModelProto:
    """A Keras-like net: float16 NHWC input, ImageNet mean/std, a 3x3 conv (zero padding) before the stride-32 head."""
    rng = np.random.default_rng(4)
    nodes = [
        helper.make_node("Cast", ["input"], ["x32"], to=TensorProto.FLOAT),
        helper.make_node("Transpose", ["x32"], ["nchw"], perm=[0, 3, 1, 2]),
        helper.make_node("Conv", ["nchw", "w0"], ["c0"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c0"], ["r0"]),
        helper.make_node("Conv", ["r0", "w1"], ["scores"], kernel_shape=[32, 32], strides=[32, 32]),
    ]
    initializers = [numpy_helper.from_array(rng.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32), "w0"),
                    numpy_helper.from_array(rng.normal(0, 0.01, (6, 4, 32, 32)).astype(np.float32), "w1")]
    preprocessing = Preprocessing(
        input_name="input", layout=Layout.LAYOUT_NHWC, dtype=InputDtype.INPUT_DTYPE_FLOAT16,
        channel_order=ChannelOrder.CHANNEL_ORDER_RGB, pixel_scale=1.0, mean=[123.675, 116.28, 103.53],
        std=[58.395, 57.12, 57.375], resize_filter="bilinear",
    )
    return card_net(nodes, initializers, input_type=TensorProto.FLOAT16, input_shape=["N", "H", "W", 3],
                    preprocessing=preprocessing, classes=6, name="nhwc16")


def bgr_uint8_net() -> onnx.ModelProto:
    """A uint8 NCHW BGR input whose normalisation rounds and clips: x * 0.5 - 10 into 0..255."""
    weights = np.random.default_rng(5).normal(0, 1e-3, (4, 3, 32, 32)).astype(np.float32)
    weights[:, 0] *= 3.0  # the channels must not be interchangeable, or BGR would go unnoticed
    nodes = [
        helper.make_node("Cast", ["input"], ["x"], to=TensorProto.FLOAT),
        helper.make_node("Conv", ["x", "w"], ["scores"], kernel_shape=[32, 32], strides=[32, 32]),
    ]
    preprocessing = Preprocessing(
        input_name="input", layout=Layout.LAYOUT_NCHW, dtype=InputDtype.INPUT_DTYPE_UINT8,
        channel_order=ChannelOrder.CHANNEL_ORDER_BGR, pixel_scale=0.5, mean=[10.0, 10.0, 10.0], std=[1.0, 1.0, 1.0],
        resize_filter="bilinear",
    )
    return card_net(nodes, [numpy_helper.from_array(weights, "w")], input_type=TensorProto.UINT8,
                    input_shape=["N", 3, "H", "W"], preprocessing=preprocessing, classes=4, name="bgr8")


def reference(net: onnx.ModelProto, pixels: np.ndarray, valid: np.ndarray, *, offsets, factor: int, stride: int):
    """Lattice and probabilities as the host computes them with the plain converted net."""
    card = read_card(net)
    image = ImageInput.of(card)
    plain = session(net)
    normalised = normalize(pixels, image)
    height, width = pixels.shape[1:3]
    lattice = None
    for dy, dx in offsets:
        canvas = np.zeros_like(normalised)
        canvas[:, dy:, dx:] = normalised[:, : height - dy, : width - dx]
        scores = plain.run([card.scores_name], {image.name: to_layout(canvas, image)})[0].astype(np.float32)
        if lattice is None:
            batch, classes, h, w = scores.shape
            lattice = np.full((batch, classes, factor * h, factor * w), np.nan, dtype=np.float32)
        lattice[:, :, factor - 1 - dy // stride :: factor, factor - 1 - dx // stride :: factor] = scores
    probabilities = lattice
    if is_logits(card):
        exp = np.exp(lattice - np.nan_to_num(lattice, nan=-np.inf).max(axis=1, keepdims=True))
        probabilities = exp / exp.sum(axis=1, keepdims=True)
    keep = (valid > 0) & ~np.isnan(lattice[:, 0])
    mean = np.where(keep[:, None], probabilities, 0.0).sum(axis=(2, 3)) / keep.sum(axis=(1, 2))[:, None]
    return lattice, mean.astype(np.float32), plain


def run_plan(net: onnx.ModelProto, *, batch: int, height: int, width: int, offsets, factor: int, stride: int,
             seed: int = 0, drop: float = 0.0, on_gpu: bool = True):
    """The plan graph's outputs and the host reference on the same random canvases and `valid` mask."""
    plan = build_plan_graph(net, read_card(net), batch=batch, height=height, width=width,
                            offsets=offsets, factor=factor, stride=stride, on_gpu=on_gpu)
    onnx.checker.check_model(plan, full_check=True)
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (batch, height, width, 3), dtype=np.uint8)
    valid = (rng.random((batch, *lattice_cells(plan))) >= drop).astype(np.float32)
    valid[:, 0, 0] = 1.0  # at least one kept cell per image
    running = session(plan)
    names = [LATTICE, PROBABILITIES, LATTICE_FP16] if on_gpu else [LATTICE, PROBABILITIES]
    outputs = dict(zip(names, running.run(names, {PIXELS: pixels, VALID: valid})))
    return outputs, reference(net, pixels, valid, offsets=offsets, factor=factor, stride=stride), running, plan


@pytest.mark.parametrize("offsets", [GRID, DIAGONAL, tuple(reversed(GRID))], ids=["grid", "diagonal", "grid-reversed"])
def test_shifted_passes_equal_the_host_reference(offsets):
    outputs, (lattice, probabilities, _), running, _ = run_plan(
        small_patch_net(), batch=2, height=64, width=96, offsets=offsets, factor=2, stride=S, drop=0.3)
    assert outputs[LATTICE].shape == (2, 5, 4, 6)
    assert_close(outputs[LATTICE], lattice, on=running)
    assert_close(outputs[PROBABILITIES], probabilities, on=running)
    assert_close(outputs[LATTICE_FP16], lattice, on=running, fp16=True)
    assert outputs[LATTICE_FP16].dtype == np.float16


def test_diagonal_leaves_the_other_half_of_the_cells_nan():
    outputs, (lattice, _, _), _, _ = run_plan(small_patch_net(), batch=1, height=64, width=64, offsets=DIAGONAL,
                                              factor=2, stride=S)
    holes = np.isnan(outputs[LATTICE][0, 0])
    rows, cols = np.indices(holes.shape)
    assert (holes == ((rows + cols) % 2 == 1)).all()  # (0,0) fills odd/odd cells, (s,s) even/even
    assert (np.isnan(outputs[LATTICE_FP16]) == np.isnan(lattice)).all()


def test_a_shifted_pass_sees_the_whole_image_moved_into_zero_padding():
    """The coordinate net's cells are the mean red/green of their patch, so each cell tells where its pass looked."""
    net = coordinate_net()
    plan = build_plan_graph(net, read_card(net), batch=1, height=64, width=64, offsets=GRID, factor=2, stride=S)
    rows, cols = np.mgrid[0:64, 0:64]
    pixels = np.stack([cols, rows, np.zeros_like(rows)], axis=-1).astype(np.uint8)[None]
    lattice = session(plan).run([LATTICE], {PIXELS: pixels, VALID: np.ones((1, 4, 4), np.float32)})[0]
    # cell (0, 0) is the (16, 16) pass's first patch: pixels 0..15 of the image, the rest zeros.
    tolerance = 1e-3 if ON_GPU else 1e-6  # TF32 on CUDA
    assert lattice[0, 0, 0, 0] == pytest.approx(np.arange(16).sum() * 16 / 32**2, rel=tolerance)
    # cell (1, 1) is the unshifted pass's first patch: centred at pixel 15.5.
    assert lattice[0, 0, 1, 1] == pytest.approx(15.5, rel=tolerance)


def test_factor_one_is_the_net_itself_with_batch_and_valid_mask():
    outputs, (lattice, probabilities, _), running, plan = run_plan(
        small_patch_net(), batch=3, height=96, width=64, offsets=((0, 0),), factor=1, stride=32, drop=0.5)
    assert lattice_cells(plan) == (3, 2)
    assert_close(outputs[LATTICE], lattice, on=running)
    assert_close(outputs[PROBABILITIES], probabilities, on=running)


@pytest.mark.parametrize("offsets, factor, stride", [(((0, 0),), 1, 32), (GRID, 2, S), (DIAGONAL, 2, S)],
                         ids=["factor-1", "grid", "diagonal"])
def test_a_cpu_plan_goes_without_the_half_lattice_and_sums_by_matmul(offsets, factor, stride):
    """on_gpu=False (the CPU's plans): no float16 output for onnxruntime to compute at every run, the masked sum
    as a MatMul, and at factor 1 the net writes the lattice output itself (no Identity copying it)."""
    net = small_patch_net()
    plan = build_plan_graph(net, read_card(net), batch=2, height=64, width=96, offsets=offsets, factor=factor,
                            stride=stride, on_gpu=False)
    assert [output.name for output in plan.graph.output] == [LATTICE, PROBABILITIES]
    assert "MatMul" in {node.op_type for node in plan.graph.node}
    if factor == 1:
        assert not {"Identity", "Cast"} & {node.op_type for node in plan.graph.node if LATTICE in node.output}
    rng = np.random.default_rng(1)
    pixels = rng.integers(0, 256, (2, 64, 96, 3), dtype=np.uint8)
    valid = (rng.random((2, *lattice_cells(plan))) >= 0.3).astype(np.float32)
    valid[:, 0, 0] = 1.0
    running = session(plan)
    lattice, probabilities = running.run([LATTICE, PROBABILITIES], {PIXELS: pixels, VALID: valid})
    expected, expected_probabilities, _ = reference(net, pixels, valid, offsets=offsets, factor=factor, stride=stride)
    assert_close(lattice, expected, on=running)
    assert_close(probabilities, expected_probabilities, on=running)


def test_a_net_with_a_subgraph_gets_its_lattice_copied_not_renamed():
    """A subgraph (If, Loop, Scan) could read the scores by name, which renaming them would break: the plan copies
    them to the lattice output instead."""
    net = small_patch_net()
    branch = helper.make_graph([helper.make_node("Identity", ["one"], ["out"])], "branch", [],
                               [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1])],
                               initializer=[numpy_helper.from_array(np.ones(1, np.float32), "one")])
    net.graph.initializer.append(numpy_helper.from_array(np.array(True), "always"))
    net.graph.node.append(helper.make_node("If", ["always"], ["unused"], then_branch=branch, else_branch=branch))
    plan = build_plan_graph(net, read_card(net), batch=2, height=64, width=96, offsets=((0, 0),), factor=1,
                            stride=32, on_gpu=False)
    assert [node.op_type for node in plan.graph.node if LATTICE in node.output] == ["Identity"]
    rng = np.random.default_rng(2)
    pixels = rng.integers(0, 256, (2, 64, 96, 3), dtype=np.uint8)
    valid = np.ones((2, *lattice_cells(plan)), np.float32)
    running = session(plan)
    lattice, probabilities = running.run([LATTICE, PROBABILITIES], {PIXELS: pixels, VALID: valid})
    expected, expected_probabilities, _ = reference(net, pixels, valid, offsets=((0, 0),), factor=1, stride=32)
    assert_close(lattice, expected, on=running)
    assert_close(probabilities, expected_probabilities, on=running)


def test_a_probabilities_card_is_averaged_without_softmax():
    net = small_patch_net(output_kind="probabilities")
    outputs, (_, probabilities, _), running, plan = run_plan(
        net, batch=2, height=64, width=64, offsets=GRID, factor=2, stride=S, drop=0.3)
    assert "Softmax" not in {node.op_type for node in plan.graph.node}
    assert_close(outputs[PROBABILITIES], probabilities, on=running)


def own_ops(plan: onnx.ModelProto) -> set[str]:
    """The op types of the nodes the plan adds around the net."""
    return {node.op_type for node in plan.graph.node if node.name.startswith(OWN_PREFIX)}


@pytest.mark.parametrize("net", ["default", "uint8"], ids=["default-mean-127", "bgr-uint8-mean-20"])
def test_a_cpu_plan_casts_and_normalises_a_whole_pixel_mean_in_one_node(request, net):
    """The default model's (x - 127) / 128 and bgr_uint8_net's x * 0.5 - 10 (a mean of 20 pixel values, then
    rounded and clipped to the net's uint8) in one DequantizeLinear, to the host reference's tolerance."""
    model = onnx.load(request.getfixturevalue("default_model_path")) if net == "default" else bgr_uint8_net()
    outputs, (lattice, probabilities, _), running, plan = run_plan(
        model, batch=2, height=256, width=288, offsets=GRID, factor=2, stride=S, drop=0.2, on_gpu=False)
    assert "DequantizeLinear" in own_ops(plan) and "BatchNormalization" not in own_ops(plan)
    assert_close(outputs[LATTICE], lattice, on=running)
    assert_close(outputs[PROBABILITIES], probabilities, on=running)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_cpu_plan_normalises_every_preset_as_the_host_does(name):
    """Each of scoremap-convert's presets, on a CPU plan: `unit` (mean 0) in one DequantizeLinear, `raw` by the
    Cast alone, the others (means between pixel values) by Cast then BatchNormalization; all to 1e-5 of the
    host's normalisation."""
    net = small_patch_net()
    card = read_card(net)
    card.preprocessing.CopyFrom(preset(name))
    card.preprocessing.MergeFrom(Preprocessing(input_name="image", layout=Layout.LAYOUT_NCHW,
                                               dtype=InputDtype.INPUT_DTYPE_FLOAT32))
    net = write_card(net, card)
    outputs, (lattice, probabilities, _), running, plan = run_plan(
        net, batch=1, height=64, width=96, offsets=((0, 0),), factor=1, stride=32, on_gpu=False)
    normaliser = {"unit": "DequantizeLinear", "raw": None}.get(name, "BatchNormalization")
    assert {"DequantizeLinear", "BatchNormalization"} & own_ops(plan) == ({normaliser} if normaliser else set())
    assert_close(outputs[LATTICE], lattice, on=running)
    assert_close(outputs[PROBABILITIES], probabilities, on=running)


@pytest.mark.parametrize("mean, on_gpu", [(127.5, False), (-1.0, False), (256.0, False), (127.0, True)],
                         ids=["half-pixel", "below-0", "above-255", "gpu"])
def test_other_means_and_gpu_plans_cast_then_normalise(mean, on_gpu):
    """A mean between pixel values or outside 0..255 has no uint8 zero point; a GPU plan keeps BatchNormalization
    (its DequantizeLinear kernel per channel is not measured)."""
    net = small_patch_net()
    card = read_card(net)
    card.preprocessing.mean[:] = [mean] * 3
    card.preprocessing.std[:] = [128.0] * 3
    plan = build_plan_graph(net, card, batch=1, height=64, width=64, offsets=((0, 0),), factor=1, stride=32,
                            on_gpu=on_gpu)
    assert {"Cast", "BatchNormalization"} <= own_ops(plan) and "DequantizeLinear" not in own_ops(plan)


def fp16_precision_net() -> onnx.ModelProto:
    """`scoremap-convert --precision fp16`: float16 weights and activations, float32 input and scores."""
    return to_fp16(heavy_net())


@pytest.mark.parametrize("offsets, factor, stride", [(GRID, 2, S), (((0, 0),), 1, 32)], ids=["grid", "factor-1"])
@pytest.mark.parametrize("build", [nhwc_float16_net, bgr_uint8_net, heavy_net, fp16_precision_net],
                         ids=["nhwc-fp16-input", "bgr-uint8", "padded-convs", "fp16-precision"])
def test_layout_dtype_channel_order_and_padding_nets(build, offsets, factor, stride):
    outputs, (lattice, probabilities, _), running, _ = run_plan(
        build(), batch=2, height=64, width=96, offsets=offsets, factor=factor, stride=stride, drop=0.2)
    assert_close(outputs[LATTICE], lattice, on=running)
    assert_close(outputs[PROBABILITIES], probabilities, on=running)


def test_plan_graphs_have_fixed_shapes_and_a_loadable_ir_version():
    plan = build_plan_graph(small_patch_net(), read_card(small_patch_net()), batch=4, height=64, width=64,
                            offsets=GRID, factor=2, stride=S)
    inferred = onnx.shape_inference.infer_shapes(plan, strict_mode=True)
    for value in [*inferred.graph.input, *inferred.graph.output, *inferred.graph.value_info]:
        assert all(dim.HasField("dim_value") for dim in value.type.tensor_type.shape.dim), value.name
    assert plan.ir_version <= 13
    assert not plan.metadata_props  # the net's card describes the net's input and output, not the plan's


def test_an_old_opset_net_is_upgraded():
    net = small_patch_net()
    net.opset_import[0].version = 11
    outputs, (lattice, _, _), running, plan = run_plan(net, batch=1, height=64, width=64, offsets=GRID, factor=2, stride=S)
    assert plan.opset_import[0].version >= 13
    assert_close(outputs[LATTICE], lattice, on=running)


@pytest.mark.parametrize("offsets, factor, stride, message", [
    (((0, 0), (0, 8)), 2, S, "not a multiple of the lattice stride"),
    (((0, 0), (0, 0)), 2, S, "given twice"),
    (((0, 0), (S, S)), 1, 32, "not a multiple"),
    ((), 1, 32, "no pass offsets"),
])
def test_passes_that_do_not_tile_the_lattice_are_refused(offsets, factor, stride, message):
    net = small_patch_net()
    with pytest.raises(DeviceGraphError, match=message):
        build_plan_graph(net, read_card(net), batch=1, height=64, width=64, offsets=offsets, factor=factor, stride=stride)


def test_a_card_naming_an_input_the_net_lacks_is_refused():
    net = small_patch_net()
    card = read_card(net)
    card.preprocessing.input_name = "images"
    with pytest.raises(DeviceGraphError, match="no input 'images'"):
        build_plan_graph(net, card, batch=1, height=64, width=64, offsets=((0, 0),), factor=1, stride=32)


@pytest.mark.parametrize("fixture, offsets, factor", [
    ("default_model_path", GRID, 2), ("default_model_os16_path", ((0, 0),), 1),
], ids=["default-grid", "default-atrous"])
def test_the_default_model(request, fixture, offsets, factor):
    """EfficientNet-Lite0 (BatchNorm folded, 'SAME' pads, 1000 logits) wrapped as the server runs it."""
    net = onnx.load(request.getfixturevalue(fixture))
    outputs, (lattice, probabilities, _), running, _ = run_plan(
        net, batch=1, height=256, width=288, offsets=offsets, factor=factor, stride=S, drop=0.2)
    assert_close(outputs[LATTICE], lattice, on=running)
    assert_close(outputs[PROBABILITIES], probabilities, on=running)


# The (op, type) pairs plan graphs rely on, each with the file of onnxruntime 1.31 that registers its
# CUDA kernel (under onnxruntime/core/providers/cuda/). An op at a type not listed here may have no
# CUDA kernel and run on the CPU, with copies either side of it (Pad has float, double and float16 kernels
# only, tensor/pad.cc). Cast is keyed by its input type: cast_op.cc registers every
# source type with every target type. Checked against pad.cc and cast_op.cc; the others by
# onnxruntime's source layout and a placement check on a GPU (every node of these plans on
# CUDAExecutionProvider but a uint8 Pad, which is why plans pad in float32: server/engine/device_graph.py).
CUDA_KERNELS = {
    **{(op, t): "math/binary_elementwise_ops.cc" for op in ("Add", "Sub", "Mul", "Div") for t in ("FLOAT", "FLOAT16")},
    ("Greater", "FLOAT"): "math/binary_elementwise_ops.cc",
    **{("AveragePool", t): "nn/pool.cc" for t in ("FLOAT", "FLOAT16")},
    **{("Conv", t): "nn/conv.cc" for t in ("FLOAT", "FLOAT16")},
    **{("Relu", t): "activation/activations.cc" for t in ("FLOAT", "FLOAT16")},
    **{("Clip", t): "math/clip.cc" for t in ("FLOAT", "FLOAT16")},
    ("Round", "FLOAT"): "math/unary_elementwise_ops.cc",
    ("Softmax", "FLOAT"): "math/softmax.cc",
    ("ReduceSum", "FLOAT"): "reduction/reduction_ops.cc",
    ("BatchNormalization", "FLOAT"): "nn/batch_norm.cc",  # epsilon clamped to cuDNN's least, 1e-5 (batch_norm.h)
    **{("Pad", t): "tensor/pad.cc" for t in ("FLOAT", "FLOAT16")},
    ("DepthToSpace", "FLOAT"): "tensor/space_depth_ops.cc",
    ("Split", "FLOAT"): "tensor/split.cc",
    ("ConstantOfShape", "INT64"): "generator/constant_of_shape.cc",
    **{("Cast", t): "tensor/cast_op.cc" for t in ("UINT8", "FLOAT", "FLOAT16", "BOOL")},
    # Every fixed-size type (uint8 included): data movement only.
    **{(op, t): f"tensor/{file}" for op, file in (
        ("Transpose", "transpose.cc"), ("Gather", "gather.cc"), ("Slice", "slice.cc"), ("Concat", "concat.cc"),
        ("Reshape", "reshape.cc"), ("Unsqueeze", "unsqueeze.cc"), ("Identity", "identity_op.cc"))
       for t in ("FLOAT", "FLOAT16", "UINT8")},
}


def op_types(graph: onnx.ModelProto) -> set[tuple[str, str]]:
    """Each node's (op, type of its first input) in a graph with fixed shapes."""
    inferred = onnx.shape_inference.infer_shapes(graph, strict_mode=True)
    types = {value.name: value.type.tensor_type.elem_type
             for value in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]}
    types.update((tensor.name, tensor.data_type) for tensor in graph.graph.initializer)
    return {(node.op_type, TensorProto.DataType.Name(types[node.input[0]])) for node in graph.graph.node}


def without_cuda_kernel(graph: onnx.ModelProto) -> set[tuple[str, str]]:
    return {pair for pair in op_types(graph) if pair not in CUDA_KERNELS}


def test_the_kernel_check_finds_a_uint8_pad():
    """The check itself: a uint8 Pad (which a plan padding its uint8 input before the cast would have) is
    reported."""
    graph = helper.make_graph(
        [helper.make_node("Pad", ["x", "pads"], ["y"], mode="constant")], "pad8",
        [helper.make_tensor_value_info("x", TensorProto.UINT8, [1, 3, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, [1, 3, 6, 6])],
        [numpy_helper.from_array(np.array([0, 0, 2, 2, 0, 0, 0, 0], np.int64), "pads")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert without_cuda_kernel(model) == {("Pad", "UINT8")}


@pytest.mark.parametrize("net, batch, offsets, factor, stride", [
    ("default", 1, ((0, 0),), 1, 32),
    ("default", 4, GRID, 2, S),
    ("default", 4, DIAGONAL, 2, S),
    ("atrous", 1, ((0, 0),), 1, 16),
    ("fp16", 4, GRID, 2, S),
    ("uint8", 4, GRID, 2, S),
    ("uint8", 4, DIAGONAL, 2, S),
    ("nhwc-fp16-input", 2, GRID, 2, S),
], ids=["default-s32-b1", "default-grid-b4", "default-diagonal-b4", "atrous", "fp16-precision-grid",
        "uint8-grid-b4", "uint8-diagonal-b4", "nhwc-fp16-input-grid"])
def test_every_op_of_a_plan_graph_has_a_cuda_kernel(request, net, batch, offsets, factor, stride):
    """Checked on the CPU, by type: a node without a CUDA kernel would run on the host."""
    nets = {
        "default": lambda: onnx.load(request.getfixturevalue("default_model_path")),
        "atrous": lambda: onnx.load(request.getfixturevalue("default_model_os16_path")),
        "fp16": fp16_precision_net, "uint8": bgr_uint8_net, "nhwc-fp16-input": nhwc_float16_net,
    }
    model = nets[net]()
    plan = build_plan_graph(model, read_card(model), batch=batch, height=256, width=288, offsets=offsets,
                            factor=factor, stride=stride)
    assert not without_cuda_kernel(plan), f"no CUDA kernel listed for {sorted(without_cuda_kernel(plan))}"


def imagenet_heavy_net() -> onnx.ModelProto:
    """heavy_net normalised per channel (the imagenet preset): no one scale puts its input on the pixel grid."""
    net = heavy_net()
    card = read_card(net)
    card.preprocessing.ClearField("mean")
    card.preprocessing.ClearField("std")
    card.preprocessing.MergeFrom(preset("imagenet"))
    return write_card(net, card)


@pytest.mark.parametrize("offsets, factor, stride", [(GRID, 2, S), (((0, 0),), 1, 32)], ids=["grid", "factor-1"])
@pytest.mark.parametrize("build, on_grid", [(heavy_net, True), (imagenet_heavy_net, False)],
                         ids=["pixel-grid", "per-channel-normalised"])
def test_an_int8_plan_equals_its_net_on_host_preprocessed_passes(build, on_grid, offsets, factor, stride):
    """An int8 net quantized on the pixel grid takes the uint8 canvas as its quantized input (its QuantizeLinear gone,
    the padding its zero point); one normalised per channel is fed floats and quantizes them itself. Either way the
    plan computes what the int8 net computes on the host's normalised, shifted, 0-filled canvases."""
    net = int8_net(build())
    outputs, (lattice, probabilities, _), running, plan = run_plan(net, batch=2, height=96, width=128, offsets=offsets,
                                                                  factor=factor, stride=stride, on_gpu=False)
    quantizes_pixels = any(node.op_type == "QuantizeLinear" and node.input[0] == "net/image" for node in plan.graph.node)
    assert quantizes_pixels is not on_grid
    assert_close(outputs[LATTICE], lattice, on=running)
    assert_close(outputs[PROBABILITIES], probabilities, on=running)
