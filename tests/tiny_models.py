"""Tiny fully-convolutional graphs with model cards, built in code, shared by the server and client tests."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from convert.card import ModelCard, OutputKind, Preprocessing, ReceptiveField, parse_label, read_card, write_card

STRIDE = 32


def patch_net(*, classes: int, stride: int = STRIDE, seed: int = 0, name: str = "tiny",
              output_kind: str = "logits", weights: np.ndarray | None = None,
              default_scale: int = 64, end_pad: int = 0) -> onnx.ModelProto:
    """Conv(kernel = stride = `stride`): one cell per `stride` x `stride` patch.

    `end_pad` zero-pads the bottom and right only, like TensorFlow's 'SAME' padding, which puts
    the receptive fields off-centre: mirrored maps then need aligning before flip averaging."""
    if weights is None:
        weights = np.random.default_rng(seed).normal(0, 0.05, (classes, 3, stride, stride)).astype(np.float32)
    bias = np.zeros(classes, dtype=np.float32)
    conv = helper.make_node("Conv", ["image", "w", "b"], ["scores"], kernel_shape=[stride, stride],
                            strides=[stride, stride], pads=[0, 0, end_pad, end_pad])
    graph = helper.make_graph(
        [conv], name,
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, "H", "W"])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", classes, "h", "w"])],
        initializer=[numpy_helper.from_array(weights, "w"), numpy_helper.from_array(bias, "b")],
    )
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])
    card = ModelCard(
        name=name,
        labels=[f"class{i}" for i in range(classes)],
        preprocessing=Preprocessing(
            input_name="image", layout="LAYOUT_NCHW", dtype="INPUT_DTYPE_FLOAT32", channel_order="CHANNEL_ORDER_RGB", pixel_scale=1.0,
            mean=[0.0, 0.0, 0.0], std=[1.0, 1.0, 1.0], resize_filter="bilinear",
        ),
        training_height=stride, training_width=stride, output_stride=stride,
        receptive_field=ReceptiveField(size=stride, center_y=(stride - 1) / 2, center_x=(stride - 1) / 2),
        scores_name="scores", output_kind=parse_label(OutputKind, output_kind), precision="PRECISION_FP32",
        default_scale=default_scale, size_multiple=stride,
    )
    return write_card(model, card)


def coordinate_net(*, stride: int = STRIDE, end_pad: int = 0) -> onnx.ModelProto:
    """Scores that are a known function of position: channel 0 = mean of red, channel 1 = mean of green
    over the cell's patch; fed an image whose red is x and green is y, cell scores are its centre."""
    weights = np.zeros((2, 3, stride, stride), dtype=np.float32)
    weights[0, 0] = 1.0 / stride**2
    weights[1, 1] = 1.0 / stride**2
    return patch_net(classes=2, stride=stride, weights=weights, name="coords", output_kind="probabilities",
                     end_pad=end_pad)


def coordinate_image(size: int = 256) -> np.ndarray:
    """[size, size, 3] uint8: red = column, green = row, blue = 0."""
    rows, cols = np.mgrid[0:size, 0:size]
    return np.stack([cols, rows, np.zeros_like(rows)], axis=-1).astype(np.uint8)


def heavy_net(*, classes: int = 4, width: int = 48, depth: int = 3) -> onnx.ModelProto:
    """A stride-32 net with a few full-resolution 3x3 convs in front, slow enough to fill a queue."""
    rng = np.random.default_rng(1)
    nodes, initializers, current, channels = [], [], "image", 3
    for index in range(depth):
        weight = rng.normal(0, 0.1, (width, channels, 3, 3)).astype(np.float32)
        initializers.append(numpy_helper.from_array(weight, f"w{index}"))
        nodes.append(helper.make_node("Conv", [current, f"w{index}"], [f"c{index}"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]))
        nodes.append(helper.make_node("Relu", [f"c{index}"], [f"r{index}"]))
        current, channels = f"r{index}", width
    head = rng.normal(0, 0.01, (classes, channels, STRIDE, STRIDE)).astype(np.float32)
    initializers.append(numpy_helper.from_array(head, "head"))
    nodes.append(helper.make_node("Conv", [current, "head"], ["scores"],
                                  kernel_shape=[STRIDE, STRIDE], strides=[STRIDE, STRIDE]))
    graph = helper.make_graph(
        nodes, "heavy",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, "H", "W"])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", classes, "h", "w"])],
        initializer=initializers,
    )
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])
    card = read_card(patch_net(classes=classes, name="heavy"))
    card.receptive_field.size = STRIDE + 2 * depth
    return write_card(model, card)


CUDA = "CUDAExecutionProvider"
# onnxruntime's CUDA provider computes convolutions in TF32: 10 mantissa bits per product (~5e-4 relative),
# so a sum's error follows the size of its terms, not of the result, and which cuDNN algorithm runs (its
# order of summation) changes with the input shape and the batch size. Measured on an H200: the
# heavy net's logits near 15 differed by 0.037 between two canvas sizes, 2.5e-3 of their magnitude.
TF32_RTOL = 2e-3
TF32_ATOL_OF_PEAK = 3e-3  # x the largest |value| compared: the sums' scale


def tolerance(runs_on, expected=None) -> dict[str, float]:
    """assert_allclose tolerances for results of `runs_on` (a Pipeline, or the provider name a response
    gives): float32 on the CPU, as strict as ever; TF32 on CUDA, scaled by the largest |value| of `expected`
    (the values compared against) when given."""
    provider = runs_on if isinstance(runs_on, str) else runs_on.engine.facts.provider
    if provider != CUDA:
        return {"rtol": 1e-5, "atol": 1e-4}
    peak = float(np.nanmax(np.abs(expected))) if expected is not None and np.size(expected) else 0.0
    return {"rtol": TF32_RTOL, "atol": max(2e-3, TF32_ATOL_OF_PEAK * peak)}


def assert_same_top_k(got, expected, provider: str) -> None:
    """Two top-k lists (of .index and .probability) agree: each class's probability within `provider`'s
    tolerance, and the same order except between classes whose probabilities tie within it (under TF32 a
    batch of several images and a batch of one can rank a near tie either way)."""
    close = tolerance(provider)
    assert len(got) == len(expected)
    for rank, (mine, theirs) in enumerate(zip(got, expected)):
        if mine.index != theirs.index:
            gap = abs(mine.probability - theirs.probability)
            assert gap <= close["atol"] + close["rtol"] * abs(theirs.probability), (
                f"rank {rank}: class {mine.index} ({mine.probability}) where {theirs.index} "
                f"({theirs.probability}) was, {gap:.2g} apart on {provider}: not a tie")
    theirs = {label.index: label.probability for label in expected}
    for label in got:
        if label.index in theirs:
            np.testing.assert_allclose(label.probability, theirs[label.index], **close)


def int8_net(net: onnx.ModelProto, *, sides: tuple[int, ...] = (64, 96), seed: int = 0, method: str = "minmax",
             weights: int | None = None, float_head: bool = False) -> onnx.ModelProto:
    """`net` quantized to int8 (convert.quantize; `weights`: an Int8Weights, recorded in the card, else quantize's
    default, unrecorded), calibrated on a few random photos at `sides`, its card carried over with precision int8
    (unchecked: for tests of what runs an int8 graph, not of its accuracy). `float_head`: its head kept out of
    quantization and its classifier made integer sums where it can be, as `scoremap-convert --precision int8` leaves
    them; else every layer quantized."""
    from convert.card import Precision
    from convert.int8_forms import integer_classifier
    from convert.int8_passes import head_nodes, name_nodes
    from convert.preprocessing import to_input
    from convert.quantize import quantize
    from protos.model_card_pb2 import Int8Weights

    card = read_card(net)
    rng = np.random.default_rng(seed)
    tensors = [to_input(rng.integers(0, 256, (1, side, side, 3)).astype(np.float32), card.preprocessing)
               for side in sides for _ in range(2)]
    head = head_nodes(name_nodes(net)) if float_head else []
    quantized = quantize(net, tensors, method=method, keep_float=tuple(head),
                         **({} if weights is None else {"weights": weights}))
    if float_head:
        quantized = integer_classifier(quantized, head, pair_bounded=weights != Int8Weights.INT8_WEIGHTS_FULL)
    card.precision = Precision.PRECISION_INT8
    if weights is not None:
        card.quantization.weights = weights
    return write_card(quantized, card)


def mobile_net(*, classes: int = 4, width: int = 8, seed: int = 2) -> onnx.ModelProto:
    """A stride-32 MobileNet-like net with biases, as a converted EfficientNet-Lite is: a 3x3 stem at stride 2,
    a depthwise 3x3, a pointwise projection and a pointwise expansion (ReLU6 after all but the projection), then
    the head: a 16x16 average pool at stride 16 and a 1x1 classifier conv."""
    rng = np.random.default_rng(seed)
    nodes, initializers = [], [numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
                               numpy_helper.from_array(np.array(6.0, np.float32), "six")]

    def conv(source: str, name: str, shape: tuple[int, ...], *, relu6: bool, **attributes) -> str:
        initializers.extend([numpy_helper.from_array(rng.normal(0, 0.3, shape).astype(np.float32), f"{name}_w"),
                             numpy_helper.from_array(rng.normal(0.5, 0.5, shape[0]).astype(np.float32), f"{name}_b")])
        nodes.append(helper.make_node("Conv", [source, f"{name}_w", f"{name}_b"], [name], name=name,
                                      kernel_shape=list(shape[2:]), **attributes))
        if not relu6:
            return name
        nodes.append(helper.make_node("Clip", [name, "zero", "six"], [f"{name}_relu6"], name=f"{name}_relu6"))
        return f"{name}_relu6"

    current = conv("image", "stem", (width, 3, 3, 3), relu6=True, strides=[2, 2], pads=[1, 1, 1, 1])
    current = conv(current, "depthwise", (width, 1, 3, 3), relu6=True, group=width, pads=[1, 1, 1, 1])
    current = conv(current, "project", (width, width, 1, 1), relu6=False)
    current = conv(current, "expand", (2 * width, width, 1, 1), relu6=True)
    nodes.append(helper.make_node("AveragePool", [current], ["pooled"], name="pool", kernel_shape=[16, 16],
                                  strides=[16, 16]))
    conv("pooled", "scores", (classes, 2 * width, 1, 1), relu6=False)
    graph = helper.make_graph(
        nodes, "mobile",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, "H", "W"])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", classes, "h", "w"])],
        initializer=initializers,
    )
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])
    card = read_card(patch_net(classes=classes, name="mobile"))
    card.receptive_field.size = STRIDE + 6
    return write_card(model, card)
