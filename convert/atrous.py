"""The à trous rewrite: a finer score map from one pass instead of shifted passes.

Chen et al., "DeepLab" (2015/2017) and Long et al., "Fully Convolutional Networks" (2015): the
last downsampling op gets stride 1 and every op after it sees a map twice as dense, so its
kernel is dilated ×2 (and its padding ×2). For stride 8 the second-to-last downsampling too, the
dilations compounding. In the interior the result equals literal shift-and-stitch.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from convert.errors import ConversionError
from convert.graph import add_constant, attr, check, describe, fresh_name, opset, set_attr, static_shapes
from convert.receptive_field import WINDOWED, explicit_pads, pad_amounts, receptive_fields, tensor_spatial_axes, window

# MaxPool takes dilations from opset 10, AveragePool from opset 19.
MAXPOOL_DILATION_OPSET = 10
AVERAGEPOOL_DILATION_OPSET = 19


def atrous(model: ir.Model, *, output_stride: int, input_shape: list[int], layout: int) -> ir.Model:
    """The dense graph `model` with cells `output_stride` px apart (no change when already that fine).

    Edits `model` and returns it."""
    fields = receptive_fields(model, input_shape=input_shape, layout=layout)
    native = fields[model.graph.outputs[0].name].jump
    if native[0] != native[1]:
        raise ConversionError(f"the net's stride differs per axis ({native[0]} x {native[1]}); à trous needs a square stride")
    if output_stride >= native[0]:
        return model
    if native[0] % output_stride:
        raise ConversionError(f"output stride {output_stride} does not divide the net's native stride {native[0]}")
    graph = model.graph
    shapes = static_shapes(model, input_shape)
    axes = tensor_spatial_axes(model, layout=layout)
    graph_opset = opset(model)
    for node in list(graph):
        source = fields.get(node.inputs[0].name) if node.inputs and node.inputs[0] is not None else None
        if source is None:
            continue
        jump_in = source.jump[0]
        jump_out = fields[node.outputs[0].name].jump[0]
        factor = jump_in // min(jump_in, output_stride)
        new_stride = min(jump_out, output_stride) // min(jump_in, output_stride)
        if node.op_type in WINDOWED:
            rewritten = rewrite_windowed(node, graph, factor=factor, new_stride=new_stride, shapes=shapes, graph_opset=graph_opset)
            pool_padding_as_pad_node(rewritten, graph)
        elif node.op_type == "Pad" and factor > 1:
            rewrite_pad(node, graph, factor=factor, axes=axes.get(node.inputs[0].name, (2, 3)))
    RemoveUnusedNodesPass()(model)  # the Pads' old amounts
    try:
        check(model)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as error:
        raise ConversionError(f"the à trous graph does not pass the ONNX checker: {error}") from error
    return model


def rewrite_windowed(node: ir.Node, graph: ir.Graph, *, factor: int, new_stride: int,
                     shapes: dict, graph_opset: int) -> ir.Node:
    """A Conv/pool with its stride reduced to `new_stride` and its dilation multiplied by `factor`: `node`
    edited, or the node that replaced it."""
    strides = list(attr(node, "strides", [1, 1]))
    kernel = window(node, shapes)
    if kernel == (1, 1) and new_stride == strides[0]:
        return node  # a 1x1 window reads one cell: nothing to dilate
    if factor == 1 and new_stride == strides[0]:
        return node
    if strides[0] != strides[1]:
        raise ConversionError(f"{describe(node)} has strides {strides}; à trous needs equal strides per axis")
    if factor > 1 and node.op_type == "MaxPool" and graph_opset < MAXPOOL_DILATION_OPSET:
        raise ConversionError(f"{describe(node)}: a dilated MaxPool needs opset >= {MAXPOOL_DILATION_OPSET}, the graph has {graph_opset}")
    if factor > 1 and node.op_type == "LpPool":
        raise ConversionError(f"{describe(node)}: LpPool has no dilation; cannot apply à trous after it")
    in_size = tuple(shapes.get(node.inputs[0].name, (0, 0, 0, 0))[2:])
    pads = explicit_pads(node, in_size=in_size, kernel=kernel)
    dilations = [d * factor for d in attr(node, "dilations", [1, 1])]
    # Pads scale with the map; a stride that drops to 1 keeps its pads, so the map has exactly the
    # cells literal shift-and-stitch has: (L + pads - k) // s + 1 summed over the shifts is L + pads - k + 1.
    begins = [p * factor for p in pads[:2]]
    ends = [p * factor for p in pads[2:]]
    set_attr(node, "strides", [new_stride, new_stride])
    set_attr(node, "pads", begins + ends)
    set_attr(node, "auto_pad", "NOTSET")
    if factor == 1:
        return node
    if node.op_type == "AveragePool":
        return averagepool_as_depthwise_conv(node, graph, kernel=kernel, dilations=dilations, shapes=shapes, graph_opset=graph_opset)
    set_attr(node, "dilations", dilations)
    return node


def pool_padding_as_pad_node(node: ir.Node, graph: ir.Graph) -> None:
    """onnxruntime wants pool pads smaller than the kernel; a dilated MaxPool's pads can exceed it, so they
    move into a Pad of -inf inserted before it."""
    if node.op_type != "MaxPool":
        return
    pads = list(attr(node, "pads", [0, 0, 0, 0]))
    kernel = list(attr(node, "kernel_shape"))
    if all(p < k for p, k in zip(pads, kernel + kernel)):
        return
    output = node.outputs[0].name
    amounts = add_constant(graph, np.array([0, 0, pads[0], pads[1], 0, 0, pads[2], pads[3]], np.int64), f"{output}_atrous_pads")
    minus_inf = add_constant(graph, np.array(-np.inf, np.float32), f"{output}_atrous_minus_inf")
    padded = fresh_name(graph, f"{output}_atrous_padded")
    pad = ir.node("Pad", [node.inputs[0], amounts, minus_inf], {"mode": "constant"}, name=padded)
    pad.outputs[0].name = padded
    graph.insert_before(node, pad)
    node.replace_input_with(0, pad.outputs[0])
    set_attr(node, "pads", [0, 0, 0, 0])


def averagepool_as_depthwise_conv(node: ir.Node, graph: ir.Graph, *, kernel: tuple[int, int],
                                  dilations: list[int], shapes: dict, graph_opset: int) -> ir.Node:
    """A dilated AveragePool as a depthwise Conv with weights 1/(kh·kw): exact when padding counts or is absent."""
    pads = list(attr(node, "pads", [0, 0, 0, 0]))
    if any(pads) and not attr(node, "count_include_pad", 0):
        if graph_opset < AVERAGEPOOL_DILATION_OPSET:
            raise ConversionError(
                f"{describe(node)}: a padded AveragePool without count_include_pad needs opset >= {AVERAGEPOOL_DILATION_OPSET} to dilate")
        set_attr(node, "dilations", dilations)
        return node
    shape = shapes.get(node.inputs[0].name)
    if shape is None:
        raise ConversionError(f"{describe(node)}: its input's channel count is unknown; cannot build a depthwise Conv")
    channels = shape[1]
    weight = add_constant(graph, np.full((channels, 1, kernel[0], kernel[1]), 1.0 / (kernel[0] * kernel[1]), np.float32),
                          f"{node.outputs[0].name}_atrous_mean")
    conv = ir.node("Conv", [node.inputs[0], weight], {
        "kernel_shape": list(kernel), "strides": list(attr(node, "strides", [1, 1])), "pads": pads,
        "dilations": dilations, "group": channels}, name=node.name or weight.name)
    output = node.outputs[0]
    ir.convenience.replace_nodes_and_values(graph, node, [node], [conv], [output], [conv.outputs[0]])
    return conv


def rewrite_pad(node: ir.Node, graph: ir.Graph, *, factor: int, axes: tuple[int, int]) -> None:
    """A Pad node's spatial pads multiplied by `factor` (the map it pads is `factor` times denser)."""
    pads = pad_amounts(node)
    rank = len(pads) // 2
    for axis in axes:
        pads[axis] *= factor
        pads[axis + rank] *= factor
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        node.replace_input_with(1, add_constant(graph, np.asarray(pads, np.int64), f"{node.inputs[1].name}_atrous"))
    else:
        set_attr(node, "pads", pads)
