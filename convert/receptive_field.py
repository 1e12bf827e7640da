"""Where each cell of a feature map looks in the input: (jump, size, start) per tensor.

The classic receptive-field recurrence (Dumoulin & Visin, "A guide to convolution arithmetic";
Araujo et al., "Computing Receptive Fields of CNNs", Distill 2019), propagated through the graph
in topological order. Coordinates are pixel indices (pixel i is centred at i), the convention of
the server's geometry, so a cell's field is the box centre ± size/2, i.e. pixels
centre - (size-1)/2 .. centre + (size-1)/2 (clipped by the image border).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import onnx_ir as ir

from convert.card import spatial_axes
from convert.errors import ConversionError
from convert.graph import attr, constant, describe, image_input, static_shapes

# Ops with a spatial window whose stride and dilation the recurrence follows.
WINDOWED = frozenset({"Conv", "MaxPool", "AveragePool", "LpPool"})


@dataclass(frozen=True)
class Field:
    """The receptive field of cell (0, 0) of a tensor and the step between cells, per axis (y, x)."""

    jump: tuple[int, int]
    size: tuple[int, int]
    start: tuple[float, float]


def tensor_spatial_axes(model: ir.Model, *, layout: int) -> dict[str, tuple[int, int]]:
    """The (y, x) axes of every rank-4 tensor derived from the image, by name, following Transposes."""
    axes = {image_input(model).name: spatial_axes(layout)}
    for node in model.graph:
        known = [axes[value.name] for value in node.inputs if value is not None and value.name in axes]
        if not known:
            continue
        if node.op_type == "Transpose":
            perm = list(attr(node, "perm", [3, 2, 1, 0]))
            y, x = known[0]
            axes[node.outputs[0].name] = (perm.index(y), perm.index(x))
        elif node.op_type in WINDOWED:
            axes[node.outputs[0].name] = (2, 3)
        else:
            for output in node.outputs:
                axes[output.name] = known[0]
    return axes


def explicit_pads(node: ir.Node, *, in_size: tuple[int, int], kernel: tuple[int, int]) -> list[int]:
    """The node's pads [y_begin, x_begin, y_end, x_end], resolving auto_pad at the given input size."""
    strides = list(attr(node, "strides", [1, 1]))
    dilations = list(attr(node, "dilations", [1, 1]))
    auto_pad = attr(node, "auto_pad", "NOTSET")
    if auto_pad in ("NOTSET", ""):
        return list(attr(node, "pads", [0, 0, 0, 0]))
    if auto_pad == "VALID":
        return [0, 0, 0, 0]
    begins, ends = [], []
    for size, k, s, d in zip(in_size, kernel, strides, dilations):
        total = max((math.ceil(size / s) - 1) * s + d * (k - 1) + 1 - size, 0)
        small, large = total // 2, total - total // 2
        begins.append(small if auto_pad == "SAME_UPPER" else large)
        ends.append(large if auto_pad == "SAME_UPPER" else small)
    return begins + ends


def window(node: ir.Node, shapes: dict[str, tuple[int, ...]]) -> tuple[int, int]:
    """The kernel size (y, x) of a windowed node."""
    if node.op_type == "Conv":
        weight = shapes.get(node.inputs[1].name)
        if weight is None or len(weight) != 4:
            raise ConversionError(f"{describe(node)}: expected a 2-D convolution with a 4-D weight, got shape {weight}")
        return weight[2], weight[3]
    kernel = list(attr(node, "kernel_shape", []))
    if len(kernel) != 2:
        raise ConversionError(f"{describe(node)}: expected a 2-D window, got kernel_shape {kernel}")
    return kernel[0], kernel[1]


def receptive_fields(model: ir.Model, *, input_shape: list[int], layout: int) -> dict[str, Field]:
    """The field of every tensor derived from the image, by name, with the image at `input_shape`."""
    shapes = static_shapes(model, input_shape)
    fields = {image_input(model).name: Field(jump=(1, 1), size=(1, 1), start=(0.0, 0.0))}
    axes = tensor_spatial_axes(model, layout=layout)
    for node in model.graph:
        source_name = node.inputs[0].name if node.inputs and node.inputs[0] is not None else None
        known = [fields[value.name] for value in node.inputs if value is not None and value.name in fields]
        if not known:
            continue
        widest = max(known, key=lambda field: field.size[0] * field.size[1])
        if node.op_type in WINDOWED:
            source = fields.get(source_name, widest)
            kernel = window(node, shapes)
            in_size = shapes.get(source_name, (0, 0, 0, 0))[2:]
            pads = explicit_pads(node, in_size=tuple(in_size), kernel=kernel)
            strides = list(attr(node, "strides", [1, 1]))
            dilations = list(attr(node, "dilations", [1, 1]))
            jump, size, start = [], [], []
            for axis in range(2):
                reach = dilations[axis] * (kernel[axis] - 1)
                size.append(source.size[axis] + reach * source.jump[axis])
                start.append(source.start[axis] + (reach / 2 - pads[axis]) * source.jump[axis])
                jump.append(source.jump[axis] * strides[axis])
            field = Field(jump=(jump[0], jump[1]), size=(size[0], size[1]), start=(start[0], start[1]))
        elif node.op_type == "Pad" and source_name in fields:
            source = fields[source_name]
            pads = pad_amounts(node)
            if len(pads) != 8:
                raise ConversionError(f"{describe(node)}: expected padding of a 4-D map, got pads {pads}")
            y, x = axes.get(source_name, (2, 3))
            field = Field(jump=source.jump, size=source.size,
                          start=(source.start[0] - pads[y] * source.jump[0], source.start[1] - pads[x] * source.jump[1]))
        else:
            field = widest
        for output in node.outputs:
            fields[output.name] = field
    return fields


def pad_amounts(node: ir.Node) -> list[int]:
    """The pads of a Pad node (attribute before opset 11, constant input after)."""
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        pads = constant(node.inputs[1])
        if pads is None:
            raise ConversionError(f"{describe(node)}: its pads are computed at run time; expected constant pads")
        pads = [int(v) for v in pads.ravel()]
    else:
        pads = [int(v) for v in attr(node, "pads", [])]
    if len(node.inputs) > 3 and node.inputs[3] is not None:
        raise ConversionError(f"{describe(node)}: Pad with an 'axes' input is not supported; expected pads for all axes")
    return pads


def output_field(model: ir.Model, *, input_shape: list[int], layout: int) -> Field:
    """The receptive field of the graph's (single) output."""
    fields = receptive_fields(model, input_shape=input_shape, layout=layout)
    return fields[model.graph.outputs[0].name]
