"""Passes that keep a QDQ int8 graph close to its fp32 graph, each chosen by measurement on the default model
(EfficientNet-Lite0, the default photo set; numbers in docs/design.md's int8 record and bench/RESULTS.md).

* Layers left in float (`float_layers`), before quantizing:
  - the classifier head, from its pooling (or, with none near the output, its last convolution) to the output:
    the scores are logits, and uint8 logits (1/16 of a logit apart on the default model) flip every cell whose two
    best classes lie closer than that; uint8 probabilities (1/255 apart) would round most of a thousand classes to 0;
    and onnxruntime's QLinearAveragePool ran 14x slower than the float pool on an AVX2 CPU;
  - every convolution whose weights alone, quantized, bring the output below FLOAT_LAYER_MIN_SNR_DB of
    signal-to-quantization-noise: on the default model its stem (23.5 dB) and first depthwise convolution
    (21.3 dB at 8 bits; 12 dB at 7: 3x3 filters of weights up to +-16 whose output is their small difference),
    where the next are at 24.7 dB and beyond. Keeping those two in float (which also keeps the stem's output,
    the most sensitive activation, in float) took the held-out cells' top-1 agreement from 92.5% to 96.6% (the
    calibration photos' from 78.2% to 90.9%).
* Weights quantized again from the fp32 graph's (`requantize_weights`), symmetric per output channel:
  - depthwise ones (one input and one output channel per group) at 8 bits: onnxruntime's depthwise int8 kernel sums
    products in 32 bits (checked: 3x3 filters of 127 on inputs of 255 give the unfused result);
  - the others, grouped ones with several channels per group included, pair-bounded (`pair_bounded_scale`,
    `pair_bounded_levels`): AVX2's VPMADDUBSW sums the products
    of each two neighbouring input channels in 16 bits, saturating past 32,767; with at most PAIR_SUM_LEVELS
    levels in any two neighbours, uint8 activations up to 255 cannot reach it (checked on a 1x1 conv: weights
    127, 127 on inputs of 255 saturate, 127, 0 and 64, 64 do not); or, asked for (`pair_bounded=False`: where the
    kernels sum in 32 bits, convert.int8_kernels), at 8 bits as the depthwise ones.
* Layers kept in float stay in float in onnxruntime's plans (`guard_float_layers`): its WeightBiasQuantization
  transform quantizes the float weights of any Conv (and Gemm) whose input comes from a DequantizeLinear with one scale,
  per tensor to int8, and the fusion then runs it as QLinearConv. On the default model, with three 1x1 projections
  kept in float that way, the fused plan's calibration cells agreed with fp32 on 90.8% where the same graph unfused
  gave 96.8% (a projection's output 0.38 levels from the unfused one on average, up to 2; 96.6% with the guard).
  Such a layer reads a DequantizeLinear of its own with one scale per channel (all equal: the same values), which that
  transform does not match.
* Empirical bias correction (`correct_biases`; Nagel et al., "Data-Free Quantization Through Weight
  Equalization and Bias Correction", ICCV 2019, section 4.2, measured on the calibration photos): rounded
  weights shift each channel's mean output, and after ReLU6 every input is positive, so the shifts do not
  average out; they add up through the net. Each convolution's int32 bias is corrected, in graph order, by the
  mean difference between its output and the fp32 graph's, the convolutions before it already corrected. On
  the default model the held-out photos' top-1 cell agreement went from 82% to 95.5%.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
from onnx import numpy_helper

from convert import verify

__all__ = ["FLOAT_LAYER_MIN_SNR_DB", "DEPTHWISE_WEIGHT_BITS", "PAIR_SUM_LEVELS", "POOLS", "head_nodes",
           "weight_sensitivity", "float_layers", "name_nodes", "pair_bounded_scale", "pair_bounded_levels",
           "requantize_weights", "guard_float_layers", "correct_biases", "with_outputs", "channel_means"]

# A convolution whose weights alone, quantized, leave the output less signal-to-noise than this stays in float.
FLOAT_LAYER_MIN_SNR_DB = 24.0
DEPTHWISE_WEIGHT_BITS = 8
POOLS = ("AveragePool", "GlobalAveragePool")
# Two neighbouring weights along a conv's reduction sum to at most this many levels: times the largest uint8
# activation (255), 32,640 fits the 16 bits AVX2's VPMADDUBSW sums each pair of products in (32,767).
PAIR_SUM_LEVELS = 128
# Largest int32 bias magnitude a rescaled weight keeps (2**24): room left for the bias correction's changes.
BIAS_HEADROOM = 2.0 ** 24


def _float_session(model: onnx.ModelProto) -> onnxruntime.InferenceSession:
    """A session that computes a QDQ graph unfused, in float: the values its int8 kernels compute."""
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    return onnxruntime.InferenceSession(model.SerializeToString(), options, providers=verify.PROVIDERS)


def _group(node: onnx.NodeProto) -> int:
    return next((attribute.i for attribute in node.attribute if attribute.name == "group"), 1)


def _is_depthwise(node: onnx.NodeProto, shape: tuple[int, ...]) -> bool:
    """One input and one output channel per group (weights of `shape`): what onnxruntime's depthwise int8 kernel runs.
    A grouped convolution with more channels per group (AlexNet's, ShuffleNet's) runs as one GEMM per group, whose
    kernels sum in pairs as any other convolution's."""
    return node.op_type == "Conv" and _group(node) > 1 and shape[1] == 1 and shape[0] == _group(node)


def name_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with a unique name on every node (onnxruntime's quantizer excludes nodes by name)."""
    named = onnx.ModelProto()
    named.CopyFrom(model)
    taken = {node.name for node in named.graph.node if node.name}
    for index, node in enumerate(named.graph.node):
        if not node.name:
            node.name = next(name for name in (f"{node.op_type}_{index}_{k}" for k in range(len(taken) + 1))
                             if name not in taken)
            taken.add(node.name)
    return named


def head_nodes(model: onnx.ModelProto) -> list[str]:
    """The nodes from the classifier's pooling to the graph's output; where the chain back from the output meets no
    pooling within a few ops (AlexNet's, VGG's: FC layers turned into convolutions), from the last convolution, the
    classifier's, so its logits and the Softmax after them stay in float (the output's producer alone when there is
    neither)."""
    producers = {output: node for node in model.graph.node for output in node.output}
    weights = {tensor.name for tensor in model.graph.initializer}
    chain, tensor, classifier = [], model.graph.output[0].name, 0
    while tensor in producers and len(chain) < 6:
        node = producers[tensor]
        chain.append(node.name)
        if node.op_type in POOLS:
            return chain
        if node.op_type == "Conv" and not classifier:
            classifier = len(chain)
        inputs = [name for name in node.input if name and name not in weights]
        if len(inputs) != 1:
            break
        tensor = inputs[0]
    return chain[:classifier or 1]


def _fake_quantized(weights: np.ndarray, bits: int) -> np.ndarray:
    """Symmetric per-output-channel quantization of conv weights, back in float."""
    top = 2 ** (bits - 1) - 1
    scale = np.abs(weights).reshape(weights.shape[0], -1).max(axis=1) / top
    scale = np.where(scale > 0, scale, 1.0).reshape(-1, *[1] * (weights.ndim - 1))
    return (np.clip(np.round(weights / scale), -top, top) * scale).astype(weights.dtype)


def _snr_db(expected: list[np.ndarray], got: list[np.ndarray]) -> float:
    signal = sum(float(np.sum(value.astype(np.float64) ** 2)) for value in expected)
    noise = sum(float(np.sum((a.astype(np.float64) - b) ** 2)) for a, b in zip(expected, got))
    return float(10 * np.log10(max(signal, 1e-30) / max(noise, 1e-30)))


def weight_sensitivity(model: onnx.ModelProto, tensors: list[np.ndarray], *, pointwise_bits: int) -> dict[str, float]:
    """{conv: the output's SNR in dB with only that conv's weights quantized} on `tensors` (depthwise at
    DEPTHWISE_WEIGHT_BITS, the others at `pointwise_bits`: 7 is the coarsest the pair bound `quantize` leaves)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    model = copy
    reference = verify.session(model)
    expected = [verify.run(reference, tensor) for tensor in tensors]
    initializers = {tensor.name: index for index, tensor in enumerate(model.graph.initializer)}
    sensitivity = {}
    for node in model.graph.node:
        if node.op_type != "Conv" or node.input[1] not in initializers:
            continue
        index = initializers[node.input[1]]
        original = model.graph.initializer[index]
        weights = numpy_helper.to_array(original).copy()
        bits = DEPTHWISE_WEIGHT_BITS if _is_depthwise(node, weights.shape) else pointwise_bits
        model.graph.initializer[index].CopyFrom(numpy_helper.from_array(_fake_quantized(weights, bits), original.name))
        session = verify.session(model)
        sensitivity[node.name] = _snr_db(expected, [verify.run(session, tensor) for tensor in tensors])
        model.graph.initializer[index].CopyFrom(numpy_helper.from_array(weights, original.name))
    return sensitivity


def float_layers(model: onnx.ModelProto, tensors: list[np.ndarray], *, pointwise_bits: int,
                 min_snr_db: float = FLOAT_LAYER_MIN_SNR_DB) -> dict[str, str]:
    """{node name: why it stays in float}: the head, and the convolutions too sensitive to their weights' rounding."""
    chosen = {name: "the classifier head (float logits and pooling)" for name in head_nodes(model)}
    for name, snr in sorted(weight_sensitivity(model, tensors, pointwise_bits=pointwise_bits).items(),
                            key=lambda item: item[1]):
        if snr < min_snr_db and name not in chosen:
            chosen[name] = (f"its weights alone, quantized, leave the output {snr:.1f} dB of signal to noise "
                            f"(below {min_snr_db:g})")
    return chosen


def _conv_pairs(quantized: onnx.ModelProto, model: onnx.ModelProto):
    """(quantized conv, fp32 conv, weight DQ, bias DQ or None) for each conv the quantizer quantized."""
    producers = {output: node for node in quantized.graph.node for output in node.output}
    originals = {node.name: node for node in model.graph.node}
    for node in quantized.graph.node:
        weight = producers.get(node.input[1]) if node.op_type == "Conv" else None
        if weight is None or weight.op_type != "DequantizeLinear" or node.name not in originals:
            continue
        bias = producers.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        yield node, originals[node.name], weight, bias if bias is not None and bias.op_type == "DequantizeLinear" else None


def _reduction_orders(shape: tuple[int, ...]) -> tuple[bool, ...]:
    """The orders (False: input channel outermost, as NCHW kernels reduce; True: innermost, as NHWC ones do) in
    which a conv's weights of `shape` meet the CPU's pair sums; one for 1x1 kernels, where both are the same."""
    return (False,) if len(shape) != 4 or shape[2:] == (1, 1) else (False, True)


def _flat(array: np.ndarray, nhwc: bool) -> np.ndarray:
    return (array.transpose(0, 2, 3, 1) if nhwc else array).reshape(array.shape[0], -1)


def _unflat(flat: np.ndarray, shape: tuple[int, ...], nhwc: bool) -> np.ndarray:
    return flat.reshape(shape[0], *shape[2:], shape[1]).transpose(0, 3, 1, 2) if nhwc else flat.reshape(shape)


def _pairs(flat: np.ndarray) -> np.ndarray:
    """[O, K] as [O, ceil(K / 2), 2]: neighbours along the reduction, the odd last one beside a zero."""
    return np.pad(flat, ((0, 0), (0, flat.shape[1] % 2))).reshape(flat.shape[0], -1, 2)


def pair_bounded_scale(weights: np.ndarray, *, pair_sum: int = PAIR_SUM_LEVELS) -> np.ndarray:
    """The smallest per-output-channel scale of conv `weights` [O, I, ...] at which each weight is at most 127
    levels and each pair of neighbours along the reduction (`_reduction_orders`) at most `pair_sum` together."""
    values = np.abs(weights.astype(np.float64))
    bound = np.max([_pairs(_flat(values, nhwc)).sum(axis=2).max(axis=1) for nhwc in _reduction_orders(values.shape)],
                   axis=0)
    scale = np.maximum(bound / pair_sum, values.reshape(values.shape[0], -1).max(axis=1) / 127)
    return np.where(scale > 0, scale, 1.0)


def pair_bounded_levels(weights: np.ndarray, scale: np.ndarray, *, pair_sum: int = PAIR_SUM_LEVELS) -> np.ndarray:
    """int8 levels of conv `weights` at per-output-channel `scale` (at least `pair_bounded_scale`'s): rounded, then a
    pair that rounding lifted past `pair_sum` gives one level of its larger weight back."""
    levels = np.clip(np.round(weights / scale.reshape(-1, *[1] * (weights.ndim - 1))), -127, 127)
    for nhwc in _reduction_orders(weights.shape):
        while True:
            flat = _flat(levels, nhwc).copy()
            grouped = _pairs(flat)
            channel, pair = np.nonzero(np.abs(grouped).sum(axis=2) > pair_sum)
            if not channel.size:
                break
            index = pair * 2 + np.abs(grouped[channel, pair]).argmax(axis=1)
            flat[channel, index] -= np.sign(flat[channel, index])
            levels = _unflat(flat, weights.shape, nhwc)
    return levels.astype(np.int8)


def requantize_weights(quantized: onnx.ModelProto, model: onnx.ModelProto, *, pair_bounded: bool = True,
                       depthwise_bits: int = DEPTHWISE_WEIGHT_BITS) -> onnx.ModelProto:
    """`quantized` with its conv weights quantized again from `model`'s (symmetric per output channel), their int32
    biases rescaled with them: depthwise ones at `depthwise_bits`, the others pair-bounded (module docstring), or at
    `depthwise_bits` too where `pair_bounded` is False."""
    out = onnx.ModelProto()
    out.CopyFrom(quantized)
    inits = {tensor.name: tensor for tensor in out.graph.initializer}
    originals = {tensor.name: tensor for tensor in model.graph.initializer}
    top = 2 ** (depthwise_bits - 1) - 1
    for node, original, weight, bias in _conv_pairs(out, model):
        if original.input[1] not in originals:
            continue
        values = numpy_helper.to_array(originals[original.input[1]]).astype(np.float64)
        old_scale = numpy_helper.to_array(inits[weight.input[1]]).astype(np.float64)
        full = _is_depthwise(node, values.shape) or not pair_bounded
        if full:
            largest = np.abs(values).reshape(values.shape[0], -1).max(axis=1)
            scale = np.where(largest > 0, largest / top, old_scale)
        else:
            scale = pair_bounded_scale(values)
        if bias is not None:
            bias_scale = numpy_helper.to_array(inits[bias.input[1]]).astype(np.float64)
            real_bias = numpy_helper.to_array(inits[bias.input[0]]).astype(np.float64) * bias_scale
            # One input scale for every channel (activations are quantized per tensor); a channel whose old weight
            # scale was zero tells nothing of it.
            known = (old_scale > 0) & (bias_scale > 0)
            input_scale = float(np.median(bias_scale[known] / old_scale[known])) if known.any() else 1.0
            # A channel of near-zero weights and a large bias keeps a weight scale its int32 bias fits.
            scale = np.maximum(scale, np.abs(real_bias) / input_scale / BIAS_HEADROOM)
            new_bias_scale = (input_scale * scale).astype(np.float32)
            inits[bias.input[0]].CopyFrom(numpy_helper.from_array(
                np.round(real_bias / new_bias_scale).astype(np.int32), bias.input[0]))
            inits[bias.input[1]].CopyFrom(numpy_helper.from_array(new_bias_scale, bias.input[1]))
        if full:
            levels = np.clip(np.round(values / scale.reshape(-1, 1, 1, 1)), -top, top).astype(np.int8)
        else:
            levels = pair_bounded_levels(values, scale)
        inits[weight.input[0]].CopyFrom(numpy_helper.from_array(levels, weight.input[0]))
        inits[weight.input[1]].CopyFrom(numpy_helper.from_array(scale.astype(np.float32), weight.input[1]))
    return out


def guard_float_layers(quantized: onnx.ModelProto, names: tuple[str, ...] | list[str]) -> onnx.ModelProto:
    """`quantized` with each Conv named in `names` (kept in float) that reads a per-tensor DequantizeLinear given one
    of its own, per channel, that one scale repeated (module docstring)."""
    out = onnx.ModelProto()
    out.CopyFrom(quantized)
    producers = {output: node for node in out.graph.node for output in node.output}
    inits = {tensor.name: tensor for tensor in out.graph.initializer}
    guarded = []
    for node in out.graph.node:
        source = producers.get(node.input[0])
        weights = inits.get(node.input[1]) if len(node.input) > 1 else None
        if (node.name not in names or node.op_type != "Conv" or weights is None or source is None
                or source.op_type != "DequantizeLinear" or source.input[1] not in inits
                or numpy_helper.to_array(inits[source.input[1]]).size != 1):
            continue
        channels = weights.dims[1] * _group(node)
        scale = numpy_helper.to_array(inits[source.input[1]]).reshape(())
        zero_point = (numpy_helper.to_array(inits[source.input[2]]).reshape(()) if len(source.input) > 2
                      and source.input[2] else np.zeros((), np.uint8))
        prefix = f"{node.name}_float_input"
        out.graph.initializer.extend([numpy_helper.from_array(np.full(channels, scale, scale.dtype), f"{prefix}_scale"),
                                      numpy_helper.from_array(np.full(channels, zero_point, zero_point.dtype),
                                                              f"{prefix}_zero_point")])
        guarded.append((node, onnx.helper.make_node("DequantizeLinear", [source.input[0], f"{prefix}_scale",
                                                                         f"{prefix}_zero_point"], [prefix],
                                                    name=prefix, axis=1)))
    for node, dequantize in guarded:
        index = list(out.graph.node).index(node)
        out.graph.node.insert(index, dequantize)
        node.input[0] = dequantize.output[0]
    return out


def _upto(model: onnx.ModelProto, output: str) -> onnx.ModelProto:
    """The part of `model` that computes `output`, with `output` its only output."""
    producers = {name: node for node in model.graph.node for name in node.output}
    needed, stack = set(), [output]
    while stack:
        node = producers.get(stack.pop())
        if node is not None and id(node) not in needed:
            needed.add(id(node))
            stack.extend(name for name in node.input if name)
    part = onnx.ModelProto()
    part.CopyFrom(model)
    kept = [node for node in model.graph.node if id(node) in needed]
    del part.graph.node[:]
    part.graph.node.extend(kept)
    del part.graph.output[:]
    part.graph.output.append(onnx.helper.make_empty_tensor_value_info(output))
    return part


def with_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """`model` with `names` added to its outputs."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    present = {value.name for value in copy.graph.output}
    copy.graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in names if name not in present)
    return copy


def channel_means(model: onnx.ModelProto, outputs: list[str], tensors: list[np.ndarray], *,
                   float_graph: bool) -> list[np.ndarray]:
    """Per-channel means of `outputs` [N, C, ...] of `model` over every position of every tensor."""
    graph = with_outputs(model, outputs) if len(outputs) > 1 else _upto(model, outputs[0])
    session = verify.session(graph) if float_graph else _float_session(graph)
    names = [value.name for value in session.get_outputs()]
    sums, counts = [0.0] * len(outputs), [0] * len(outputs)
    for tensor in tensors:
        values = dict(zip(names, session.run(None, {session.get_inputs()[0].name: tensor})))
        for index, name in enumerate(outputs):
            value = values[name].astype(np.float64)
            sums[index] = sums[index] + value.sum(axis=tuple(axis for axis in range(value.ndim) if axis != 1))
            counts[index] += value.size // value.shape[1]
    return [total / count for total, count in zip(sums, counts)]


def correct_biases(quantized: onnx.ModelProto, model: onnx.ModelProto, tensors: list[np.ndarray]) -> onnx.ModelProto:
    """`quantized` with each quantized conv's int32 bias corrected, in graph order, by the mean difference of its
    output from `model`'s on `tensors` (module docstring)."""
    out = onnx.ModelProto()
    out.CopyFrom(quantized)
    inits = {tensor.name: tensor for tensor in out.graph.initializer}
    pairs = [(node, original, bias) for node, original, _, bias in _conv_pairs(out, model) if bias is not None]
    if not pairs:
        return out
    expected = channel_means(model, [original.output[0] for _, original, _ in pairs], tensors, float_graph=True)
    for (node, _, bias), reference in zip(pairs, expected):
        got = channel_means(out, [node.output[0]], tensors, float_graph=False)[0]
        scale = numpy_helper.to_array(inits[bias.input[1]]).astype(np.float64)
        levels = numpy_helper.to_array(inits[bias.input[0]]).astype(np.float64) - (got - reference) / scale
        inits[bias.input[0]].CopyFrom(numpy_helper.from_array(
            np.clip(np.round(levels), -2 ** 31, 2 ** 31 - 1).astype(np.int32), bias.input[0]))
    return out
