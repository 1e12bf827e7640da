"""The à trous rewrite: a finer score map from one pass instead of shifted passes.

Chen et al., "DeepLab" (2015/2017) and Long et al., "Fully Convolutional Networks" (2015): the
last downsampling op gets stride 1 and every op after it sees a map twice as dense, so its
kernel is dilated ×2 (and its padding ×2). For stride 8 the second-to-last downsampling too, the
dilations compounding. In the interior the result equals literal shift-and-stitch.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
from onnx import helper, numpy_helper

from convert.errors import ConversionError
from convert.graph import attr, describe, initializers, opset, set_attr, static_shapes, unique_name
from convert.receptive_field import WINDOWED, explicit_pads, pad_amounts, receptive_fields, tensor_spatial_axes, window

# MaxPool takes dilations from opset 10, AveragePool from opset 19.
MAXPOOL_DILATION_OPSET = 10
AVERAGEPOOL_DILATION_OPSET = 19


def atrous(model: onnx.ModelProto, *, output_stride: int, input_shape: list[int], layout: int) -> onnx.ModelProto:
    """The dense graph `model` with cells `output_stride` px apart (no change when already that fine); rewrites in place."""
    fields = receptive_fields(model, input_shape=input_shape, layout=layout)
    native = fields[model.graph.output[0].name].jump
    if native[0] != native[1]:
        raise ConversionError(f"the net's stride differs per axis ({native[0]} x {native[1]}); à trous needs a square stride")
    if output_stride >= native[0]:
        return model
    if native[0] % output_stride:
        raise ConversionError(f"output stride {output_stride} does not divide the net's native stride {native[0]}")
    graph = model.graph
    shapes = static_shapes(model, input_shape)
    constants = initializers(graph)
    axes = tensor_spatial_axes(model, layout=layout)
    graph_opset = opset(model)
    nodes = []
    for node in graph.node:
        source = fields.get(node.input[0]) if node.input else None
        if source is None:
            nodes.append(node)
            continue
        jump_in = source.jump[0]
        jump_out = fields[node.output[0]].jump[0]
        factor = jump_in // min(jump_in, output_stride)
        new_stride = min(jump_out, output_stride) // min(jump_in, output_stride)
        if node.op_type in WINDOWED:
            nodes.extend(pool_padding_as_pad_node(
                rewrite_windowed(node, graph, factor=factor, new_stride=new_stride, shapes=shapes, graph_opset=graph_opset), graph))
        elif node.op_type == "Pad" and factor > 1:
            nodes.append(rewrite_pad(node, graph, constants, factor=factor, axes=axes.get(node.input[0], (2, 3))))
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as error:
        raise ConversionError(f"the à trous graph does not pass the ONNX checker: {error}") from error
    return model


def rewrite_windowed(node: onnx.NodeProto, graph: onnx.GraphProto, *, factor: int, new_stride: int,
                     shapes: dict, graph_opset: int) -> onnx.NodeProto:
    """A Conv/pool with its stride reduced to `new_stride` and its dilation multiplied by `factor`."""
    strides = list(attr(node, "strides", [1, 1]))
    kernel = window(node, shapes)
    if kernel == (1, 1) and new_stride == strides[0]:
        return node  # a 1x1 window reads one cell: nothing to dilate
    if factor == 1 and new_stride == strides[0]:
        return node
    if strides[0] != strides[1]:
        raise ConversionError(f"{describe(node)} has strides {strides}; à trous needs equal strides per axis")
    in_size = tuple(shapes.get(node.input[0], (0, 0, 0, 0))[2:])
    pads = explicit_pads(node, in_size=in_size, kernel=kernel)
    dilations = [d * factor for d in attr(node, "dilations", [1, 1])]
    # Pads scale with the map; a stride that drops to 1 keeps its pads, so the map has exactly the
    # cells literal shift-and-stitch has: (L + pads - k) // s + 1 summed over the shifts is L + pads - k + 1.
    begins = [p * factor for p in pads[:2]]
    ends = [p * factor for p in pads[2:]]
    rewritten = copy.deepcopy(node)
    set_attr(rewritten, "strides", [new_stride, new_stride])
    set_attr(rewritten, "pads", begins + ends)
    set_attr(rewritten, "auto_pad", "NOTSET")
    if factor == 1:
        return rewritten
    if node.op_type == "MaxPool" and graph_opset < MAXPOOL_DILATION_OPSET:
        raise ConversionError(f"{describe(node)}: a dilated MaxPool needs opset >= {MAXPOOL_DILATION_OPSET}, the graph has {graph_opset}")
    if node.op_type == "LpPool":
        raise ConversionError(f"{describe(node)}: LpPool has no dilation; cannot apply à trous after it")
    if node.op_type == "AveragePool":
        return averagepool_as_depthwise_conv(rewritten, graph, kernel=kernel, dilations=dilations, shapes=shapes, graph_opset=graph_opset)
    set_attr(rewritten, "dilations", dilations)
    return rewritten


def pool_padding_as_pad_node(node: onnx.NodeProto, graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """onnxruntime wants pool pads smaller than the kernel; a dilated MaxPool's pads can exceed it, so they move into a Pad of -inf."""
    if node.op_type != "MaxPool":
        return [node]
    pads = list(attr(node, "pads", [0, 0, 0, 0]))
    kernel = list(attr(node, "kernel_shape"))
    if all(p < k for p, k in zip(pads, kernel + kernel)):
        return [node]
    pads_name = unique_name(graph, f"{node.output[0]}_atrous_pads")
    value_name = unique_name(graph, f"{node.output[0]}_atrous_minus_inf")
    padded = unique_name(graph, f"{node.output[0]}_atrous_padded")
    graph.initializer.append(numpy_helper.from_array(np.array([0, 0, pads[0], pads[1], 0, 0, pads[2], pads[3]], np.int64), pads_name))
    graph.initializer.append(numpy_helper.from_array(np.array(-np.inf, np.float32), value_name))
    pad = helper.make_node("Pad", [node.input[0], pads_name, value_name], [padded], name=padded, mode="constant")
    pooled = copy.deepcopy(node)
    pooled.input[0] = padded
    set_attr(pooled, "pads", [0, 0, 0, 0])
    return [pad, pooled]


def averagepool_as_depthwise_conv(node: onnx.NodeProto, graph: onnx.GraphProto, *, kernel: tuple[int, int],
                                  dilations: list[int], shapes: dict, graph_opset: int) -> onnx.NodeProto:
    """A dilated AveragePool as a depthwise Conv with weights 1/(kh·kw): exact when padding counts or is absent."""
    pads = list(attr(node, "pads", [0, 0, 0, 0]))
    if any(pads) and not attr(node, "count_include_pad", 0):
        if graph_opset < AVERAGEPOOL_DILATION_OPSET:
            raise ConversionError(
                f"{describe(node)}: a padded AveragePool without count_include_pad needs opset >= {AVERAGEPOOL_DILATION_OPSET} to dilate")
        set_attr(node, "dilations", dilations)
        return node
    shape = shapes.get(node.input[0])
    if shape is None:
        raise ConversionError(f"{describe(node)}: its input's channel count is unknown; cannot build a depthwise Conv")
    channels = shape[1]
    weight = np.full((channels, 1, kernel[0], kernel[1]), 1.0 / (kernel[0] * kernel[1]), np.float32)
    weight_name = unique_name(graph, f"{node.output[0]}_atrous_mean")
    graph.initializer.append(numpy_helper.from_array(weight, weight_name))
    return helper.make_node("Conv", [node.input[0], weight_name], list(node.output), name=node.name or weight_name,
                            kernel_shape=list(kernel), strides=list(attr(node, "strides", [1, 1])), pads=pads,
                            dilations=dilations, group=channels)


def rewrite_pad(node: onnx.NodeProto, graph: onnx.GraphProto, constants: dict, *, factor: int, axes: tuple[int, int]) -> onnx.NodeProto:
    """A Pad node whose spatial pads are multiplied by `factor` (the map it pads is `factor` times denser)."""
    pads = pad_amounts(node, constants)
    rank = len(pads) // 2
    for axis in axes:
        pads[axis] *= factor
        pads[axis + rank] *= factor
    rewritten = copy.deepcopy(node)
    if len(node.input) > 1 and node.input[1]:
        name = unique_name(graph, f"{node.input[1]}_atrous")
        graph.initializer.append(numpy_helper.from_array(np.asarray(pads, np.int64), name))
        rewritten.input[1] = name
    else:
        set_attr(rewritten, "pads", pads)
    return rewritten
