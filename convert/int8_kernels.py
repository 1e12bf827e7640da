"""What this CPU's int8 kernels do with their sums: the one place that decides which int8 weights run here.

onnxruntime's uint8 x int8 convolution kernels on x86 CPUs with AVX2 or AVX-512BW but no VNNI multiply and add each
two neighbouring products into 16 bits (VPMADDUBSW), which saturates at 32,767; with VNNI (VPDPBUSD) or AMX they sum
in 32 bits and do not. Full 8-bit weights are exact only on the latter; pair-bounded weights run right on both
(convert.int8_passes, docs/design.md "int8 weights: full 8 bits where the kernels sum in 32 bits").

The answer is measured, not read from the CPU's flags (`pair_sums_saturate`): a QDQ convolution whose neighbouring
weights are 127 and 127, on inputs of 255, runs through the fused kernels onnxruntime picks on this CPU and is compared
with the same graph computed unfused. So it holds for whatever kernels this onnxruntime build and CPU pair up; on ARM,
whose NEON and dot-product kernels widen to 32 bits before they add, it should find no saturation (not measured by
the project).
"""

from __future__ import annotations

import functools

from protos.model_card_pb2 import Int8Weights

# numpy, onnx and onnxruntime are imported by the probe alone: the CLI's parser reads WEIGHT_CHOICES before any of them.

__all__ = ["instructions", "gemm_on_amx", "pair_sums_saturate", "weights_for", "WEIGHT_CHOICES", "describe", "refusal"]

# --int8-weights: auto (this CPU's kernels decide), or one of the two kinds of weights by name.
WEIGHT_CHOICES = {"full": Int8Weights.INT8_WEIGHTS_FULL, "pair-bounded": Int8Weights.INT8_WEIGHTS_PAIR_BOUNDED}
_PROBE_CHANNELS = 16
_PROBE_SIDE = 8
_PROBE_OUTPUT_SCALE = 4096.0  # the largest probe sum, 255 x 127 x 18 (a 3x3 kernel over two channels), in 142 levels


@functools.cache
def _flags() -> frozenset[str] | None:
    """The CPU's feature flags, x86's or ARM's, as Linux lists them; None where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return frozenset(next(line for line in cpuinfo if line.startswith(("flags", "Features"))).split())
    except (OSError, StopIteration):
        return None


def instructions() -> str:
    """The integer dot-product extensions this CPU offers, x86's or ARM's (onnxruntime's MLAS picks its int8 kernels
    by them), for messages and reports: `pair_sums_saturate` decides."""
    flags = _flags()
    if flags is None:
        return "unknown"
    found = [flag for flag in ("avx512_vnni", "avx_vnni", "amx_int8", "avx512bw", "avx2", "asimddp", "i8mm")
             if flag in flags]
    return ", ".join(found) or "none of avx2/avx512/vnni/dot-product"


def gemm_on_amx() -> bool:
    """Whether this CPU has AMX's int8 tiles, on which onnxruntime's MLAS runs its int8 GEMM (MLAS checks the same
    CPU feature; convert.int8_forms.gemm_weights sends deep pointwise convolutions there)."""
    return "amx_int8" in (_flags() or ())


def _probe_graph() -> bytes:
    """1x1 and 3x3 QDQ convolutions whose weights are 127 on input channels 0 and 1 (neighbours along the reduction in
    either layout; every tap of the 3x3), the rest 0, with a uint8 input quantized at scale 1."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    pointwise = np.zeros((1, _PROBE_CHANNELS, 1, 1), np.int8)
    pointwise[0, :2] = 127
    spatial = np.zeros((1, _PROBE_CHANNELS, 3, 3), np.int8)
    spatial[0, :2] = 127
    constants = {"one": np.array(1.0, np.float32), "zero": np.array(0, np.uint8),
                 "out_scale": np.array(_PROBE_OUTPUT_SCALE, np.float32), "w1": pointwise, "w3": spatial,
                 "w_scale": np.ones(1, np.float32), "w_zero": np.zeros(1, np.int8)}
    nodes = [helper.make_node("QuantizeLinear", ["x", "one", "zero"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "one", "zero"], ["xd"])]
    for name in ("w1", "w3"):
        nodes += [helper.make_node("DequantizeLinear", [name, "w_scale", "w_zero"], [f"{name}d"], axis=0),
                  helper.make_node("Conv", ["xd", f"{name}d"], [f"{name}y"]),
                  helper.make_node("QuantizeLinear", [f"{name}y", "out_scale", "zero"], [f"{name}q"]),
                  helper.make_node("DequantizeLinear", [f"{name}q", "out_scale", "zero"], [f"{name}out"])]
    graph = helper.make_graph(
        nodes, "pair_sum_probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, _PROBE_CHANNELS, _PROBE_SIDE, _PROBE_SIDE])],
        [helper.make_tensor_value_info(f"{name}out", TensorProto.FLOAT, None) for name in ("w1", "w3")],
        [numpy_helper.from_array(value, name) for name, value in constants.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9).SerializeToString()


@functools.cache
def pair_sums_saturate() -> bool:
    """Whether onnxruntime's fused uint8 x int8 convolutions on this CPU saturate two neighbouring products of 255 and
    127 (16-bit pair sums), measured once per process against the same graph computed unfused."""
    import numpy as np
    import onnxruntime

    graph, pixels = _probe_graph(), np.full((1, _PROBE_CHANNELS, _PROBE_SIDE, _PROBE_SIDE), 255.0, np.float32)
    outputs = []
    for level in (onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL, onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL):
        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = level
        options.intra_op_num_threads = 1
        session = onnxruntime.InferenceSession(graph, options, providers=["CPUExecutionProvider"])
        outputs.append(session.run(None, {"x": pixels}))
    return any(not np.array_equal(unfused, fused) for unfused, fused in zip(*outputs))


def weights_for(choice: str) -> int:
    """The Int8Weights of `choice` ("auto": full 8 bits where this CPU's kernels sum in 32 bits, else pair-bounded)."""
    if choice == "auto":
        return Int8Weights.INT8_WEIGHTS_PAIR_BOUNDED if pair_sums_saturate() else Int8Weights.INT8_WEIGHTS_FULL
    return WEIGHT_CHOICES[choice]


def describe(weights: int) -> str:
    """The weights' kind as the card and the CLI name it."""
    if weights == Int8Weights.INT8_WEIGHTS_FULL:
        return "full 8-bit"
    return "pair-bounded (portable)"


def refusal(weights: int, *, sums_saturate: bool) -> str | None:
    """Why an int8 graph with these weights computes wrong answers on a CPU whose kernels' pair sums saturate
    (`sums_saturate`, as `pair_sums_saturate` measures), or None where it runs right. Unrecorded weights
    (INT8_WEIGHTS_UNSPECIFIED) are pair-bounded: the only kind a card without the field holds."""
    if weights != Int8Weights.INT8_WEIGHTS_FULL or not sums_saturate:
        return None
    return (f"its int8 weights are full 8-bit, and this CPU's int8 kernels (extensions: {instructions()}; no VNNI or "
            "AMX) sum each two neighbouring products in 16 bits, which saturate on them: its scores would be wrong. "
            "Convert the model again with `--precision int8 --int8-weights pair-bounded` (weights that run right on "
            "every CPU), or serve it on a CPU with VNNI or AMX")
