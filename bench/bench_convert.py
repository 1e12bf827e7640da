"""Dense evaluation vs crops, and à trous vs literal shift-and-stitch, against their speed targets.

Every ratio is measured within this one run on the same machine: baseline and candidate alternate,
and each side keeps its fastest run, so load on a shared machine hits both sides alike.
"""

from __future__ import annotations

import time

import numpy as np
import onnx
import onnxruntime
from onnx import TensorProto, helper, numpy_helper

from convert import convert_classifier
from convert.card import Layout, read_card
from convert.graph import static_shapes
from convert.presets import preset
from convert.preprocessing import to_input
from convert.sources import load_source
from convert.verify import PROVIDERS, crops, sample_pixels, shift_and_stitch
from convert.verify import run as forward

SCALE = 384
REPEATS = 7
# VGG16's passes take seconds each on a CPU: fewer rounds.
VGG_REPEATS = 3
TARGET_DENSE = 12.0
TARGET_ATROUS_DEFAULT = 1.6
TARGET_ATROUS_VGG = 3.0
# VGG16 (configuration D): conv widths per stage, then the classifier's FC widths.
VGG16_STAGES = [(64, 2), (128, 2), (256, 3), (512, 3), (512, 3)]
VGG16_FC = [4096, 4096, 1000]


def session(model: onnx.ModelProto) -> onnxruntime.InferenceSession:
    """A CPU session whose idle threads sleep: with two sessions alive on a small machine, one's spinning
    threads would otherwise steal the cores the other is being timed on."""
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return onnxruntime.InferenceSession(model.SerializeToString(), options, providers=PROVIDERS)


def best_times(baseline, candidate, *, repeats: int = REPEATS) -> tuple[float, float]:
    """Seconds of the fastest run of each, after a warm-up, the two alternating so load on the shared machine hits both alike."""
    baseline()
    candidate()
    first, second = [], []
    for _ in range(repeats):
        for action, times in ((baseline, first), (candidate, second)):
            start = time.perf_counter()
            action()
            times.append(time.perf_counter() - start)
    return min(first), min(second)


def vgg16(seed: int = 0) -> onnx.ModelProto:
    """VGG16's layer widths with random (He-scaled) weights: only the arithmetic matters here."""
    rng = np.random.default_rng(seed)
    nodes, inits, current, channels = [], [], "image", 3
    for stage, (width, convs) in enumerate(VGG16_STAGES):
        for index in range(convs):
            name = f"conv{stage + 1}_{index + 1}"
            weight = (rng.standard_normal((width, channels, 3, 3), np.float32) * np.float32((2 / (9 * channels)) ** 0.5))
            inits += [numpy_helper.from_array(weight, f"{name}_w"), numpy_helper.from_array(np.zeros(width, np.float32), f"{name}_b")]
            nodes += [helper.make_node("Conv", [current, f"{name}_w", f"{name}_b"], [name], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
                      helper.make_node("Relu", [name], [f"{name}_relu"])]
            current, channels = f"{name}_relu", width
        nodes.append(helper.make_node("MaxPool", [current], [f"pool{stage + 1}"], kernel_shape=[2, 2], strides=[2, 2]))
        current = f"pool{stage + 1}"
    nodes.append(helper.make_node("Flatten", [current], ["flat"]))
    current, features = "flat", channels * 7 * 7
    for index, width in enumerate(VGG16_FC):
        name = f"fc{index + 6}"
        weight = rng.standard_normal((width, features), np.float32) * np.float32((2 / features) ** 0.5)
        inits += [numpy_helper.from_array(weight, f"{name}_w"), numpy_helper.from_array(np.zeros(width, np.float32), f"{name}_b")]
        nodes.append(helper.make_node("Gemm", [current, f"{name}_w", f"{name}_b"], [name], transB=1))
        current, features = name, width
        if index < len(VGG16_FC) - 1:
            nodes.append(helper.make_node("Relu", [name], [f"{name}_relu"]))
            current = f"{name}_relu"
    graph = helper.make_graph(nodes, "vgg16", [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, 224, 224])],
                              [helper.make_tensor_value_info(current, TensorProto.FLOAT, ["N", features])], inits)
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])


def conv_macs(model: onnx.ModelProto, height: int, width: int) -> float:
    """Multiply-accumulates of the Conv nodes (the bulk of the work) for one image of the given size."""
    shapes = static_shapes(model, [1, 3, height, width])
    total = 0.0
    for node in model.graph.node:
        if node.op_type == "Conv" and node.output[0] in shapes:
            weight = shapes[node.input[1]]
            total += float(np.prod(shapes[node.output[0]])) * float(np.prod(weight[1:]))
    return total


def flop_ratio(coarse: onnx.ModelProto, fine: onnx.ModelProto) -> float:
    """Conv work of the four shifted stride-32 passes over the à trous pass, at SCALE."""
    shifted = sum(conv_macs(coarse, SCALE - a, SCALE - b) for a in (0, 16) for b in (0, 16))
    return shifted / conv_macs(fine, SCALE, SCALE)


def atrous_ratio(coarse: onnx.ModelProto, fine: onnx.ModelProto, image: np.ndarray, *, repeats: int = REPEATS) -> tuple[float, float]:
    """(literal 4-shift seconds, à trous single-pass seconds) at stride 16."""
    coarse_session, fine_session = session(coarse), session(fine)
    return best_times(lambda: shift_and_stitch(coarse_session, image, shift=16, factor=2),
                      lambda: forward(fine_session, image), repeats=repeats)


def run_bench() -> dict:
    results = {}
    source = load_source("default")
    dense = convert_classifier("default")
    fine = convert_classifier("default", output_stride=16)
    card = read_card(dense)
    image = to_input(sample_pixels(count=1, height=SCALE, width=SCALE, channels=3), card.preprocessing)
    batch = crops(image, layout=Layout.LAYOUT_NCHW, training_size=(224, 224), stride=32)
    original_session, dense_session = session(source.model), session(dense)
    results["crops"], results["dense"] = best_times(lambda: forward(original_session, batch), lambda: forward(dense_session, image))
    results["crop_flops"] = 36 * conv_macs(dense, 224, 224) / conv_macs(dense, SCALE, SCALE)
    results["default_shift"], results["default_atrous"] = atrous_ratio(dense, fine, image)
    results["default_flops"] = flop_ratio(dense, fine)
    del original_session, dense_session
    vgg = vgg16()
    vgg_coarse = convert_classifier(vgg, training_size=224, preprocessing=preset("imagenet"))
    vgg_fine = convert_classifier(vgg, training_size=224, output_stride=16, preprocessing=preset("imagenet"))
    del vgg
    results["vgg_shift"], results["vgg_atrous"] = atrous_ratio(vgg_coarse, vgg_fine, image, repeats=VGG_REPEATS)
    results["vgg_flops"] = flop_ratio(vgg_coarse, vgg_fine)
    return results


def run() -> str:
    r = run_bench()
    dense_ratio = r["crops"] / r["dense"]
    default_ratio = r["default_shift"] / r["default_atrous"]
    vgg_ratio = r["vgg_shift"] / r["vgg_atrous"]
    verdict = lambda ratio, target: "meets" if ratio >= target else "MISSES"
    return "\n".join([
        "## Conversion: dense evaluation and à trous (bench_convert)",
        "",
        f"Input {SCALE}x{SCALE}, one image, onnxruntime CPU provider (idle threads not spinning), fastest of {REPEATS} alternating runs ({VGG_REPEATS} for VGG16)",
        "after a warm-up. The last column is",
        "the ratio of Conv multiply-accumulates (the work the speed-up can at most reflect); VGG16's FC head (fc6 as a",
        "7x7 conv over 512 channels) is the same work in both à trous and shift-and-stitch, which caps its ratio.",
        "",
        "| comparison | baseline | dense | ratio | target | Conv work ratio |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| default model: one dense pass vs the classifier on all 36 crops (6x6 grid, one batch) | {r['crops'] * 1e3:.0f} ms | "
        f"{r['dense'] * 1e3:.0f} ms | {dense_ratio:.1f}x | >= {TARGET_DENSE:.0f}x ({verdict(dense_ratio, TARGET_DENSE)}) | {r['crop_flops']:.1f}x |",
        f"| default model, stride 16: à trous single pass vs literal 4-shift | {r['default_shift'] * 1e3:.0f} ms | "
        f"{r['default_atrous'] * 1e3:.0f} ms | {default_ratio:.2f}x | >= {TARGET_ATROUS_DEFAULT}x ({verdict(default_ratio, TARGET_ATROUS_DEFAULT)}) | {r['default_flops']:.2f}x |",
        f"| VGG16 widths (random weights), stride 16: à trous vs literal 4-shift | {r['vgg_shift'] * 1e3:.0f} ms | "
        f"{r['vgg_atrous'] * 1e3:.0f} ms | {vgg_ratio:.2f}x | >= {TARGET_ATROUS_VGG:.0f}x ({verdict(vgg_ratio, TARGET_ATROUS_VGG)}) | {r['vgg_flops']:.2f}x |",
    ])
