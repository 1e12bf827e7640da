"""Dense evaluation vs crops, and à trous vs literal shift-and-stitch (issue 2's speed targets).

Every ratio is measured within this one run on the same machine, each timing the best of a few
repetitions after a warm-up, so the shared machine's noise hurts both sides alike.
"""

from __future__ import annotations

import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from convert import convert_classifier
from convert.card import read_card
from convert.sources import load_source
from convert.verify import crops, preprocess, sample_pixels, session, shift_and_stitch
from convert.verify import run as forward

SCALE = 384
REPEATS = 5
TARGET_DENSE = 12.0
TARGET_ATROUS_DEFAULT = 1.6
TARGET_ATROUS_VGG = 3.0
# VGG16 (configuration D): conv widths per stage, then the classifier's FC widths.
VGG16_STAGES = [(64, 2), (128, 2), (256, 3), (512, 3), (512, 3)]
VGG16_FC = [4096, 4096, 1000]


def best_time(action, repeats: int = REPEATS) -> float:
    """Seconds of the fastest of `repeats` runs after one warm-up run."""
    action()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return min(times)


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


def atrous_ratio(coarse: onnx.ModelProto, fine: onnx.ModelProto, image: np.ndarray) -> tuple[float, float]:
    """(literal 4-shift seconds, à trous single-pass seconds) at stride 16."""
    coarse_session, fine_session = session(coarse), session(fine)
    literal = best_time(lambda: shift_and_stitch(coarse_session, image, shift=16, factor=2))
    single = best_time(lambda: forward(fine_session, image))
    return literal, single


def run_bench() -> dict:
    results = {}
    source = load_source("default")
    dense = convert_classifier("default")
    fine = convert_classifier("default", output_stride=16)
    card = read_card(dense)
    image = preprocess(sample_pixels(count=1, height=SCALE, width=SCALE, channels=3), card.preprocessing)
    batch = crops(image, layout="NCHW", training_size=(224, 224), stride=32)
    original_session, dense_session = session(source.model), session(dense)
    results["crops"] = best_time(lambda: forward(original_session, batch))
    results["dense"] = best_time(lambda: forward(dense_session, image))
    results["default_shift"], results["default_atrous"] = atrous_ratio(dense, fine, image)
    del original_session, dense_session
    vgg = vgg16()
    vgg_coarse = convert_classifier(vgg, training_size=224)
    vgg_fine = convert_classifier(vgg, training_size=224, output_stride=16)
    del vgg
    results["vgg_shift"], results["vgg_atrous"] = atrous_ratio(vgg_coarse, vgg_fine, image)
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
        f"Input {SCALE}x{SCALE}, one image, onnxruntime CPU provider, best of {REPEATS} after a warm-up.",
        "",
        "| comparison | baseline | dense | ratio | target |",
        "| --- | --- | --- | --- | --- |",
        f"| default model: one dense pass vs the classifier on all 36 crops (6x6 grid, one batch) | {r['crops'] * 1e3:.0f} ms | "
        f"{r['dense'] * 1e3:.0f} ms | {dense_ratio:.1f}x | >= {TARGET_DENSE:.0f}x ({verdict(dense_ratio, TARGET_DENSE)}) |",
        f"| default model, stride 16: à trous single pass vs literal 4-shift | {r['default_shift'] * 1e3:.0f} ms | "
        f"{r['default_atrous'] * 1e3:.0f} ms | {default_ratio:.2f}x | >= {TARGET_ATROUS_DEFAULT}x ({verdict(default_ratio, TARGET_ATROUS_DEFAULT)}) |",
        f"| VGG16 widths (random weights), stride 16: à trous vs literal 4-shift | {r['vgg_shift'] * 1e3:.0f} ms | "
        f"{r['vgg_atrous'] * 1e3:.0f} ms | {vgg_ratio:.2f}x | >= {TARGET_ATROUS_VGG:.0f}x ({verdict(vgg_ratio, TARGET_ATROUS_VGG)}) |",
    ])
