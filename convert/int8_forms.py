"""Forms of a QDQ int8 graph that onnxruntime's CPU kernels run faster, each measured on the default model
(EfficientNet-Lite0 at 1x384x576 and 4x384x384, plans alternated; docs/design.md's int8 record).

* The classifier in integer sums (`integer_classifier`). The head stays out of QDQ quantization (its logits must stay
  float: convert.int8_passes); as a float 1x1 convolution over pooled, dequantized activations it is about a tenth of
  the int8 plan. Where its 1x1 classifier reads the uint8 activations through a DequantizeLinear (and a pooling), it
  becomes MatMulInteger over those activations as they are, with int8 weights per output channel:
  its int32 sums scaled to float logits, then the pooling, then the bias. Pooling and a 1x1 convolution are both
  linear, so pooling after the classifier computes the same scores, and no pooled value is rounded to 8 bits; pooling
  first would have fused into onnxruntime's QLinearAveragePool, 11x slower than the float pool here. The plan ran
  1.04x faster at 1x384x576, 1.01x at 4x384x384; the default photos' cells agreed with fp32 on 98.1% and 98.6% held
  out (98.4% and 98.0% with the float head).
* Deep pointwise convolutions on the GEMM (`gemm_weights`). onnxruntime runs a fused int8 convolution whose weights'
  zero point is 0 on its symmetric indirect convolution (AVX-512 VNNI here) and any other on its int8 GEMM, which on a
  CPU with AMX runs on AMX tiles. 1x1 convolutions with at least MIN_GEMM_CHANNELS input channels ran 1.10-1.68x
  faster on the GEMM (10 shapes from 320 to 2048 channels), those with 240-256 0.87-1.04x, and shallower ones
  slower; on the default model's plan 1.02-1.03x. Their levels move one down under a zero point of -1: the same
  values, and the plans' outputs were bit-identical. The GEMM path holds int32 sums of the layer's output for its run
  (convert.profile counts them): small at the depths moved, which run at low resolution in a classifier.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from convert.int8_passes import POOLS, pair_bounded_levels, pair_bounded_scale

__all__ = ["MIN_GEMM_CHANNELS", "INTEGER_CLASSIFIER", "INTEGER_HEAD", "INTEGER_SUMS", "integer_classifier", "gemm_weights",
           "on_gemm", "classifier_in_integers"]

MIN_GEMM_CHANNELS = 320
GEMM_ZERO_POINT = -1
GEMM_ZERO_POINT_SUFFIX = "/gemm_zero_point"  # a moved weight's new zero point: its levels' name and this
INTEGER_SUMS = "/integer_sums"  # an integer classifier's MatMulInteger is named after its Conv with this
# The card's reason for the classifier among the layers kept out of QDQ quantization, once it is integer sums.
INTEGER_CLASSIFIER = ("the classifier head: float logits, from int8 weights' integer sums over the uint8 activations "
                      "(MatMulInteger), pooled after")
INTEGER_HEAD = "the classifier head after its integer sums: on float logits"  # its other nodes' reason then


def _attribute(node: onnx.NodeProto, name: str, default):
    found = next((attribute for attribute in node.attribute if attribute.name == name), None)
    return default if found is None else helper.get_attribute_value(found)


def _pointwise(node: onnx.NodeProto, weights: np.ndarray) -> bool:
    """A 1x1 convolution at stride 1 without padding or groups: one matrix product over every pixel."""
    return (node.op_type == "Conv" and weights.ndim == 4 and weights.shape[2:] == (1, 1)
            and _attribute(node, "group", 1) == 1 and all(step == 1 for step in _attribute(node, "strides", [1]))
            and not any(_attribute(node, "pads", [0])))


def _per_channel_levels(weights: np.ndarray, *, pair_bounded: bool) -> tuple[np.ndarray, np.ndarray]:
    """(int8 levels, scale per output channel) of conv `weights`: symmetric at 8 bits, or pair-bounded
    (convert.int8_passes) for CPUs whose kernels sum neighbouring products in 16 bits."""
    values = weights.astype(np.float64)
    if pair_bounded:
        scale = pair_bounded_scale(values)
        return pair_bounded_levels(values, scale), scale
    largest = np.abs(values).reshape(values.shape[0], -1).max(axis=1)
    scale = np.where(largest > 0, largest / 127, 1.0)
    return np.clip(np.round(values / scale.reshape(-1, 1, 1, 1)), -127, 127).astype(np.int8), scale


def integer_classifier(quantized: onnx.ModelProto, head: list[str], *, pair_bounded: bool) -> onnx.ModelProto:
    """`quantized` with the float 1x1 classifier among its `head` nodes (convert.int8_passes.head_nodes) computed in
    integer sums from the uint8 activations it reads through a DequantizeLinear and, if any, a pooling of the head
    (module docstring); `quantized` itself where the head has another form."""
    producers = {output: node for node in quantized.graph.node for output in node.output}
    inits = {tensor.name: tensor for tensor in quantized.graph.initializer}
    conv = next((node for node in quantized.graph.node if node.name in head and node.op_type == "Conv"), None)
    if conv is None or conv.input[1] not in inits:
        return quantized
    weights = numpy_helper.to_array(inits[conv.input[1]])
    pool = producers.get(conv.input[0])
    source = producers.get(pool.input[0]) if pool is not None and pool.op_type in POOLS and pool.name in head else pool
    if pool is source:
        pool = None
    readers = [node for node in quantized.graph.node for name in node.input if pool is not None and name == pool.output[0]]
    pooled_elsewhere = pool is not None and (readers != [conv] or pool.output[0] in {v.name for v in quantized.graph.output})
    has_bias = len(conv.input) > 2 and bool(conv.input[2])
    if (not _pointwise(conv, weights) or source is None or source.op_type != "DequantizeLinear" or pooled_elsewhere
            or len(source.input) < 3 or not all(name in inits for name in source.input[1:3])
            or has_bias and conv.input[2] not in inits):
        return quantized
    input_scale, zero_point = (numpy_helper.to_array(inits[name]) for name in source.input[1:3])
    # Only activations quantized per tensor (or per channel, every channel alike) as uint8 have one zero point to
    # hand MatMulInteger.
    if zero_point.dtype != np.uint8 or np.unique(input_scale).size != 1 or np.unique(zero_point).size != 1:
        return quantized
    levels, scale = _per_channel_levels(weights, pair_bounded=pair_bounded)
    out = onnx.ModelProto()
    out.CopyFrom(quantized)
    name = conv.name
    constants = {f"{name}/levels": levels[:, :, 0, 0].T.copy(), f"{name}/zero_point": zero_point.reshape(-1)[0],
                 f"{name}/scale": (float(input_scale.reshape(-1)[0]) * scale).astype(np.float32)}
    nodes = [
        helper.make_node("Transpose", [source.input[0]], [f"{name}/nhwc"], name=f"{name}/nhwc", perm=[0, 2, 3, 1]),
        helper.make_node("MatMulInteger", [f"{name}/nhwc", f"{name}/levels", f"{name}/zero_point"],
                         [f"{name}/sums"], name=name + INTEGER_SUMS),
        helper.make_node("Cast", [f"{name}/sums"], [f"{name}/float_sums"], name=f"{name}/float_sums", to=TensorProto.FLOAT),
        helper.make_node("Mul", [f"{name}/float_sums", f"{name}/scale"], [f"{name}/scaled"], name=f"{name}/scaled"),
        helper.make_node("Transpose", [f"{name}/scaled"], [f"{name}/nchw"], name=f"{name}/nchw", perm=[0, 3, 1, 2]),
    ]
    if pool is not None:
        pooled = helper.make_node(pool.op_type, [f"{name}/nchw"], [f"{name}/pooled"], name=pool.name)
        pooled.attribute.extend(pool.attribute)
        nodes.append(pooled)
    if has_bias:
        bias = numpy_helper.to_array(inits[conv.input[2]]).astype(np.float32).reshape(1, -1, 1, 1)
        constants[f"{name}/bias"] = bias
        nodes.append(helper.make_node("Add", [nodes[-1].output[0], f"{name}/bias"], [conv.output[0]], name=f"{name}/bias"))
    else:
        nodes[-1].output[0] = conv.output[0]
    replaced = {conv.output[0]} | ({pool.output[0]} if pool is not None else set())
    position = min(index for index, node in enumerate(out.graph.node) if node.output[0] in replaced)
    kept = [node for node in out.graph.node if node.output[0] not in replaced]
    read = {value for node in kept for value in node.input} | {value.name for value in out.graph.output}
    if source.output[0] not in read:  # the dequantized activations had no other reader
        kept = [node for node in kept if node.output[0] != source.output[0]]
        position -= 1
    del out.graph.node[:]
    out.graph.node.extend(kept[:position] + nodes + kept[position:])
    used = {value for node in out.graph.node for value in node.input}
    remaining = [tensor for tensor in out.graph.initializer if tensor.name in used]
    del out.graph.initializer[:]
    out.graph.initializer.extend(remaining + [numpy_helper.from_array(np.asarray(value), key)
                                              for key, value in constants.items()])
    return out


def classifier_in_integers(model: onnx.ModelProto, name: str) -> bool:
    """Whether `integer_classifier` made the Conv `name` integer sums in `model`."""
    return any(node.name == name + INTEGER_SUMS for node in model.graph.node)


def on_gemm(model: onnx.ModelProto) -> int:
    """How many of `model`'s convolutions `gemm_weights` sent to the GEMM."""
    return sum(tensor.name.endswith(GEMM_ZERO_POINT_SUFFIX) for tensor in model.graph.initializer)


def gemm_weights(quantized: onnx.ModelProto) -> onnx.ModelProto:
    """`quantized` with the symmetric int8 weights of each 1x1 convolution over at least MIN_GEMM_CHANNELS input
    channels one level down under a zero point of GEMM_ZERO_POINT: the same values (-127..127 become -128..126), which
    onnxruntime runs on its int8 GEMM (module docstring). For full 8-bit weights only: a level moved could break a
    pair bound."""
    out = onnx.ModelProto()
    out.CopyFrom(quantized)
    producers = {output: node for node in out.graph.node for output in node.output}
    inits = {tensor.name: tensor for tensor in out.graph.initializer}
    readers: dict[str, int] = {}
    for node in out.graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    for node in out.graph.node:
        weight = producers.get(node.input[1]) if node.op_type == "Conv" else None
        if weight is None or weight.op_type != "DequantizeLinear" or len(weight.input) < 3:
            continue
        shifted = weight.input[0] + GEMM_ZERO_POINT_SUFFIX
        if (not all(name in inits for name in (weight.input[0], weight.input[2])) or readers[weight.input[0]] != 1
                or readers[weight.output[0]] != 1 or shifted in inits):
            continue  # levels another node reads too would be moved under it
        levels, zero_point = (numpy_helper.to_array(inits[name]) for name in (weight.input[0], weight.input[2]))
        if (levels.dtype != np.int8 or not _pointwise(node, levels) or levels.shape[1] < MIN_GEMM_CHANNELS
                or np.any(zero_point != 0) or levels.min() < -127):
            continue
        inits[weight.input[0]].CopyFrom(numpy_helper.from_array((levels.astype(np.int16) - 1).astype(np.int8),
                                                                weight.input[0]))
        out.graph.initializer.append(numpy_helper.from_array(np.full(zero_point.shape, GEMM_ZERO_POINT, np.int8),
                                                             shifted))
        inits[shifted] = out.graph.initializer[-1]
        weight.input[2] = shifted
    used = {value for node in out.graph.node for value in node.input}
    remaining = [tensor for tensor in out.graph.initializer if tensor.name in used]
    del out.graph.initializer[:]
    out.graph.initializer.extend(remaining)
    return out
