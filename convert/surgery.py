"""Net surgery: a classifier's head becomes convolutions, so the graph scores every window at once.

The FC→Conv rewrite of OverFeat (Sermanet et al. 2014), VGG's dense evaluation (Simonyan &
Zisserman 2015) and Caffe's net-surgery example: the first FC layer over an Hf×Wf×C map becomes
an Hf×Wf convolution, later FC layers 1×1 convolutions, global average pooling an average pool
with the training-size window and stride 1. Every cell of the output is then the classifier
applied to one window of the input.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from convert.card import OutputKind, batch_shape, channel_axis
from convert.errors import ConversionError
from convert.graph import (
    add_constant,
    attr,
    check,
    computed_inputs,
    constant,
    describe,
    image_input,
    opset,
    static_shapes,
)
from convert.receptive_field import tensor_spatial_axes

SCORES = "scores"
LINEAR = frozenset({"Gemm", "MatMul"})
# A 1x1 Conv on the pooled [N, C, 1, 1] features is an FC layer (Caffe's DenseNet ends GAP → Conv).
POINTWISE_CONV = "Conv"
PER_FEATURE = frozenset({"Add", "Sub", "Mul", "Div", "PRelu"})
# Elementwise activations: they act on each feature alone, so they carry over to a map unchanged.
ACTIVATIONS = frozenset({
    "Relu", "Clip", "Sigmoid", "Tanh", "LeakyRelu", "Elu", "Selu", "Celu", "HardSigmoid", "HardSwish",
    "Softplus", "Softsign", "ThresholdedRelu", "Gelu", "Mish", "Erf", "Exp", "Abs", "Neg", "Sqrt",
})
SOFTMAXES = frozenset({"Softmax", "LogSoftmax"})
FLATTENS = frozenset({"Flatten", "Reshape", "Squeeze"})
POOLS = {"GlobalAveragePool": "AveragePool", "GlobalMaxPool": "MaxPool", "ReduceMean": "AveragePool", "ReduceMax": "MaxPool"}
# Body ops that change the scale of the map: the dense geometry (one cell per stride) would not hold.
RESCALING = frozenset({"Resize", "Upsample", "ConvTranspose", "SpaceToDepth", "DepthToSpace", "Col2Im"})
# Body ops that read all positions of a map at once.
GLOBAL_POOLS = frozenset({"GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool"})
PRODUCTS = frozenset({"MatMul", "Gemm", "Einsum", "MatMulInteger", "QLinearMatMul"})


@dataclass(frozen=True)
class Head:
    """A classifier's head as `find_head` reads it: what `fully_convolutional` rebuilds, and what the card says of it."""

    chain: tuple[ir.Node, ...]  # from the flatten point to the output, in order
    flatten: ir.Node  # the node that flattens (or pools) the map
    source: ir.Value  # the NCHW map before it
    map_shape: tuple[int, int, int]  # its C, H, W at the training size
    order: str  # how the map was flattened: "chw", or "hwc" after an NCHW→NHWC Transpose
    pool: str | None  # the dense pool op replacing a pooling over the whole map, or None
    input_shape: tuple[int, ...]  # the image at batch 1 and the training size
    layout: int  # a Layout value
    num_classes: int
    output_kind: int  # an OutputKind value


def find_head(model: ir.Model, *, training_size: tuple[int, int], layout: int) -> Head:
    """The head of a normalised classifier graph; raises ConversionError when it cannot be made dense faithfully.

    Reads `model` only."""
    graph = model.graph
    if len(graph.outputs) != 1:
        raise ConversionError(f"expected a classifier with one output, got {len(graph.outputs)}: {[o.name for o in graph.outputs]}")
    input_shape = batch_one_shape(image_input(model), training_size=training_size, layout=layout)
    shapes = static_shapes(model, input_shape)
    graph_opset = opset(model)
    output = graph.outputs[0]
    chain, flatten = head_chain(output, shapes, graph_opset)
    source, order, pool = flatten_point(flatten, shapes)
    if len(shapes.get(source.name, ())) != 4:
        raise ConversionError(f"cannot prove the shape of the map {source.name!r} before the head at {training_size[0]}x{training_size[1]}; "
                              f"shape inference gives {shapes.get(source.name)}")
    if not chain and pool is None:
        raise ConversionError(f"the head after {describe(flatten)} is empty: nothing to make dense")
    refuse_position_mixing(source, shapes, tensor_spatial_axes(model, layout=layout), graph_opset)
    last = chain[-1].op_type if chain else ""
    kind = OutputKind.OUTPUT_KIND_PROBABILITIES if last in ("Softmax", "Sigmoid") else OutputKind.OUTPUT_KIND_LOGITS
    return Head(chain=tuple(chain), flatten=flatten, source=source, map_shape=tuple(shapes[source.name][1:]), order=order,
                pool=pool, input_shape=tuple(input_shape), layout=layout, num_classes=shapes[output.name][1], output_kind=kind)


def fully_convolutional(model: ir.Model, head: Head) -> ir.Model:
    """`model` made dense: its `head` rebuilt as convolutions, output `scores` [N, K, h, w], dynamic N, H, W.

    Edits `model` and returns it."""
    graph = model.graph
    channels, map_h, map_w = head.map_shape
    builder = HeadBuilder(graph)
    current = head.source
    if head.pool is not None:
        current = builder.add(head.pool, [current], kernel_shape=[map_h, map_w], strides=[1, 1])
        map_h, map_w = 1, 1
    current, features = builder.rebuild(head.chain, current, channels=channels, spatial=(map_h, map_w), order=head.order)
    dtype = graph.outputs[0].dtype
    graph.outputs.clear()
    graph.outputs.append(current)
    RemoveUnusedNodesPass()(model)
    current.name = SCORES
    current.dtype, current.shape = dtype, ir.Shape(["N", features, "h", "w"])
    image = image_input(model)
    image.shape = ir.Shape(batch_shape(head.layout, batch="N", channels=head.input_shape[channel_axis(head.layout)],
                                       height="H", width="W"))
    for node in graph:  # their shapes were those at the training size
        for value in node.outputs:
            if not value.is_graph_output():
                value.shape = None
    try:
        check(model)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as error:
        raise ConversionError(f"the converted graph does not pass the ONNX checker: {error}") from error
    return model


def batch_one_shape(image: ir.Value, *, training_size: tuple[int, int], layout: int) -> list[int]:
    """The image input's shape at batch 1 and the training size."""
    dims = [d if isinstance(d, int) else 0 for d in (image.shape or ())]
    if len(dims) != 4:
        raise ConversionError(f"input {image.name!r} has {len(dims)} dims; expected an image batch [N, C, H, W] or [N, H, W, C]")
    channels = dims[channel_axis(layout)]
    if channels <= 0:
        raise ConversionError(f"input {image.name!r}: its channel count is not static; expected a fixed number of channels")
    height, width = training_size
    return batch_shape(layout, batch=1, channels=channels, height=height, width=width)


def per_cell(shape: tuple[int, ...] | None) -> bool:
    """A head tensor: [N, features], or [N, features, 1, 1] in classifiers that end in convolutions."""
    return shape is not None and (len(shape) == 2 or (len(shape) == 4 and tuple(shape[2:]) == (1, 1)))


def is_pooling_point(node: ir.Node, shapes: dict) -> bool:
    """A pooling that reduces a whole map to one cell: global pooling, or a window as large as the map (SqueezeNet's pool10)."""
    shape = shapes.get(node.outputs[0].name)
    source = shapes.get(node.inputs[0].name) if node.inputs and node.inputs[0] is not None else None
    if node.op_type in POOLS:
        return shape is not None and (len(shape) == 2 or per_cell(shape))
    if node.op_type in ("AveragePool", "MaxPool") and per_cell(shape) and source is not None and len(source) == 4:
        window = list(attr(node, "kernel_shape", []))
        return window == list(source[2:]) and not any(attr(node, "pads", [0])) and attr(node, "auto_pad", "NOTSET") in ("NOTSET", "VALID")
    return False


def head_chain(output: ir.Value, shapes: dict, graph_opset: int) -> tuple[list[ir.Node], ir.Node]:
    """The head's nodes from the flatten point to `output` (in order) and the flatten node itself."""
    chain: list[ir.Node] = []
    value = output
    while True:
        node = value.producer()
        if node is None:
            raise ConversionError(f"cannot identify the classifier head: tensor {value.name!r} comes from the input or a constant")
        shape = shapes.get(node.outputs[0].name)
        if node.op_type in FLATTENS or is_pooling_point(node, shapes):
            chain.reverse()
            return chain, node
        if node.op_type not in LINEAR | PER_FEATURE | ACTIVATIONS | SOFTMAXES | {"BatchNormalization", POINTWISE_CONV}:
            raise ConversionError(
                f"cannot identify the classifier head at {describe(node)}: expected Gemm, MatMul, 1x1 Conv, Add/Mul by "
                "per-feature constants, elementwise activations or Softmax between a Flatten/Reshape or global "
                "pooling and the output")
        if not per_cell(shape) or (node.op_type in LINEAR and len(shape) != 2):
            raise ConversionError(f"head node {describe(node)} produces shape {shape}; expected [N, features] after a flatten")
        if node.op_type in SOFTMAXES:
            axis = attr(node, "axis", 1 if graph_opset < 13 else -1)
            if axis % len(shape) != 1:
                raise ConversionError(f"{describe(node)} has axis={axis} on shape {shape}; expected the feature axis (1)")
        data = computed_inputs(node)
        if len(data) != 1:
            raise ConversionError(f"head node {describe(node)} has {len(data)} computed inputs; expected one (the head must be a chain)")
        chain.append(node)
        value = data[0]


def flatten_point(flatten: ir.Node, shapes: dict) -> tuple[ir.Value, str, str | None]:
    """(map tensor in NCHW, flatten order 'chw'/'hwc', dense pool op or None) for the node that flattens the map."""
    out_shape = shapes.get(flatten.outputs[0].name)
    if flatten.op_type in ("AveragePool", "MaxPool"):
        return flatten.inputs[0], "chw", flatten.op_type
    if flatten.op_type in POOLS:
        source, pool = pooled_map(flatten, shapes)
        return source, "chw", pool
    if out_shape is None or len(out_shape) != 2:
        raise ConversionError(f"{describe(flatten)} produces shape {out_shape}; expected [N, features]")
    source = flatten.inputs[0]
    shape = shapes.get(source.name)
    if shape is None or len(shape) != 4 or int(np.prod(shape[1:])) != out_shape[1]:
        raise ConversionError(f"{describe(flatten)} flattens a tensor of shape {shape} into {out_shape}; expected a 4-D map flattened per sample")
    if flatten.op_type == "Flatten" and attr(flatten, "axis", 1) != 1:
        raise ConversionError(f"{describe(flatten)} has axis={attr(flatten, 'axis')}; expected axis=1 (flatten per sample)")
    order = "chw"
    producer = source.producer()
    if producer is not None and producer.op_type == "Transpose":
        perm = list(attr(producer, "perm", []))
        if perm != [0, 2, 3, 1]:
            raise ConversionError(f"{describe(producer)} permutes the map with perm {perm} before the flatten; expected [0, 2, 3, 1] (NCHW→NHWC)")
        order, source = "hwc", producer.inputs[0]
        producer = source.producer()
    if producer is not None and producer.op_type in POOLS:
        pooled_shape = shapes.get(producer.outputs[0].name)
        if pooled_shape is not None and len(pooled_shape) == 4:
            pool_source, pool = pooled_map(producer, shapes)
            return pool_source, order, pool
    return source, order, None


def pooled_map(node: ir.Node, shapes: dict) -> tuple[ir.Value, str]:
    """(NCHW map, dense pool op) for a global pooling over H, W at the flatten point."""
    source = node.inputs[0]
    if node.op_type.startswith("Reduce"):
        axes = reduce_axes(node)
        rank = len(shapes.get(source.name, ()))
        if rank != 4 or axes is None:
            raise ConversionError(f"{describe(node)} reduces axes {axes} of a rank-{rank} tensor; expected the H, W axes of a 4-D map")
        axes = sorted(a % 4 for a in axes)
        if axes == [1, 2]:
            producer = source.producer()
            if producer is None or producer.op_type != "Transpose" or list(attr(producer, "perm", [])) != [0, 2, 3, 1]:
                raise ConversionError(f"{describe(node)} reduces axes [1, 2] of a tensor that is not an NCHW→NHWC Transpose; cannot tell H, W apart")
            source = producer.inputs[0]
        elif axes != [2, 3]:
            raise ConversionError(f"{describe(node)} reduces axes {axes}; expected the spatial axes [2, 3]")
    return source, POOLS[node.op_type]


def reduce_axes(node: ir.Node) -> list[int] | None:
    """The axes of a Reduce node (attribute before opset 18, input after); None when not constant."""
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        value = constant(node.inputs[1])
        return None if value is None else [int(a) for a in value.ravel()]
    axes = attr(node, "axes")
    return None if axes is None else list(axes)


def refuse_position_mixing(source: ir.Value, shapes: dict, axes: dict, graph_opset: int) -> None:
    """Raise on any body node before `source` that mixes positions: then a dense cell would not equal the classifier on one window."""
    body, pending = [], [source]
    seen: set[str] = set()
    while pending:
        value = pending.pop()
        node = value.producer()
        if value.name in seen or node is None:
            continue
        seen.add(value.name)
        body.append(node)
        pending.extend(computed_inputs(node))
    for node in body:
        data = computed_inputs(node)
        first = data[0].name if data else None
        shape = shapes.get(first) if data else None
        rank = len(shape) if shape is not None else 0
        op = node.op_type
        reason = None
        if op in GLOBAL_POOLS:
            reason = "global pooling inside the body (e.g. squeeze-excitation) mixes all positions"
        elif op.startswith("Reduce") and rank == 4:
            spatial = set(axes.get(first, (2, 3)))
            reduced = reduce_axes(node)
            if reduced is None or spatial & {a % 4 for a in reduced}:
                reason = "a reduction over H, W inside the body (e.g. squeeze-excitation) mixes all positions"
        elif op in ("Reshape", "Flatten") and rank == 4:
            reason = "a Reshape/Flatten of a feature map inside the body hard-codes the map's size"
        elif op in PRODUCTS and len(data) >= 2:
            reason = "a product of two computed tensors (attention) mixes positions"
        elif op in PRODUCTS and rank == 4:
            reason = "a matrix product over a feature map's last axis mixes positions"
        elif op in SOFTMAXES | {"Hardmax"} and rank == 4:
            spatial = set(axes.get(first, (2, 3)))
            axis = attr(node, "axis", 1 if graph_opset < 13 else -1) % 4
            if graph_opset < 13 or axis in spatial:
                reason = "a softmax over positions (attention) mixes positions"
        elif op == "Slice" and rank == 4 and fixed_spatial_end(node, set(axes.get(first, (2, 3)))):
            reason = "a Slice with a fixed end on H or W hard-codes the map's size"
        elif op in RESCALING:
            reason = "it rescales the map inside the body; dense geometry needs a fixed stride"
        if reason:
            raise ConversionError(f"cannot convert faithfully: {describe(node)}: {reason}")


# Slice ends at or beyond this mean "to the end" (exporters write INT_MAX or INT64_MAX).
OPEN_END = 2**30


def fixed_spatial_end(node: ir.Node, spatial: set[int]) -> bool:
    """True when a Slice cuts H or W at a fixed positive end (a crop of the training-size map)."""
    if len(node.inputs) < 3:  # opset < 10: starts/ends/axes are attributes
        ends, axes = list(attr(node, "ends", [])), list(attr(node, "axes", range(len(attr(node, "ends", [])))))
    else:
        ends = constant(node.inputs[2])
        has_axes = len(node.inputs) > 3 and node.inputs[3] is not None
        given_axes = constant(node.inputs[3]) if has_axes else None
        if ends is None or (has_axes and given_axes is None):
            return True
        ends = [int(v) for v in ends.ravel()]
        axes = [int(v) for v in given_axes.ravel()] if has_axes else list(range(len(ends)))
    return any(axis % 4 in spatial and 0 <= end < OPEN_END for axis, end in zip(axes, ends))


class HeadBuilder:
    """Appends the new dense head's nodes and weights to a graph."""

    def __init__(self, graph: ir.Graph) -> None:
        self.graph = graph
        self.count = 0

    def name(self, kind: str) -> str:
        self.count += 1
        return f"scoremap_head_{self.count}_{kind}"

    def weight(self, array: np.ndarray, kind: str) -> ir.Value:
        return add_constant(self.graph, array, self.name(kind))

    def append(self, op: str, inputs: list[ir.Value | None], attributes, *, domain: str = "") -> ir.Value:
        name = self.name(op.lower())
        node = ir.Node(domain, op, inputs, attributes=attributes, name=name)
        node.outputs[0].name = name
        self.graph.append(node)
        return node.outputs[0]

    def add(self, op: str, inputs: list[ir.Value], **attributes) -> ir.Value:
        return self.append(op, inputs, [ir.convenience.convert_attribute(key, value) for key, value in attributes.items()])

    def rebuild(self, chain: tuple[ir.Node, ...], current: ir.Value, *, channels: int, spatial: tuple[int, int],
                order: str) -> tuple[ir.Value, int]:
        """Append the dense equivalents of `chain`; returns (last tensor, its channel count)."""
        features = channels * spatial[0] * spatial[1]
        for node in chain:
            op = node.op_type
            if op in LINEAR or op == POINTWISE_CONV:
                weight, bias = self.linear(node)
                if weight.shape[0] != features:
                    raise ConversionError(f"{describe(node)} takes {weight.shape[0]} features; expected {features}")
                outputs = weight.shape[1]
                kernel = conv_kernel(weight, channels=features // (spatial[0] * spatial[1]), spatial=spatial, order=order)
                inputs = [current, self.weight(kernel, "weight")]
                if bias is not None:
                    inputs.append(self.weight(bias.astype(kernel.dtype), "bias"))
                current = self.add("Conv", inputs, kernel_shape=list(spatial))
                features, spatial = outputs, (1, 1)
            elif op in PER_FEATURE:
                current = self.per_feature(node, current, features, spatial)
            elif op == "BatchNormalization":
                scale, shift, mean, var = (constant(value).astype(np.float64) for value in node.inputs[1:5])
                factor = scale / np.sqrt(var + attr(node, "epsilon", 1e-5))
                dtype = constant(node.inputs[1]).dtype
                current = self.add("Mul", [current, self.weight(self.per_channel(factor.astype(dtype), node, features, spatial), "scale")])
                current = self.add("Add", [current, self.weight(self.per_channel((shift - mean * factor).astype(dtype), node, features, spatial), "shift")])
            elif op in ACTIVATIONS:
                copied = [ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()]
                current = self.append(op, [current, *node.inputs[1:]], copied, domain=node.domain)
            elif op in SOFTMAXES:
                if spatial != (1, 1):
                    raise ConversionError(f"{describe(node)} acts on flattened map features before any FC layer; expected it after the classifier's FC layers")
                # Softmax over the class axis, right in every opset: classes last, then back.
                current = self.add("Transpose", [current], perm=[0, 2, 3, 1])
                current = self.add(op, [current], axis=3)
                current = self.add("Transpose", [current], perm=[0, 3, 1, 2])
        return current, features

    def linear(self, node: ir.Node) -> tuple[np.ndarray, np.ndarray | None]:
        """(weight [in, out], bias [out] or None) of a Gemm, MatMul or 1x1 Conv node."""
        weight = constant(node.inputs[1])
        if constant(node.inputs[0]) is not None or weight is None:
            raise ConversionError(f"{describe(node)}: expected the features as first input and constant weights as second")
        given_bias = constant(node.inputs[2]) if len(node.inputs) > 2 else None
        if given_bias is None and len(node.inputs) > 2 and node.inputs[2] is not None:
            raise ConversionError(f"{describe(node)}: its bias is computed; expected a constant bias")
        if node.op_type == POINTWISE_CONV:
            if weight.ndim != 4 or weight.shape[2:] != (1, 1) or attr(node, "group", 1) != 1 or any(attr(node, "pads", [0])):
                raise ConversionError(f"{describe(node)} in the head has weights {weight.shape}, group {attr(node, 'group', 1)}, "
                                      f"pads {attr(node, 'pads', [0])}; expected a 1x1 convolution without groups or padding")
            bias = given_bias.reshape(-1) if given_bias is not None else None
            return weight.reshape(weight.shape[0], weight.shape[1]).T, bias
        if weight.ndim != 2:
            raise ConversionError(f"{describe(node)} has weights of shape {weight.shape}; expected a 2-D matrix")
        if node.op_type == "MatMul":
            return weight, None
        if attr(node, "transA", 0):
            raise ConversionError(f"{describe(node)} has transA=1; expected features as rows (transA=0)")
        if attr(node, "transB", 0):
            weight = weight.T
        weight = weight * np.asarray(attr(node, "alpha", 1.0), weight.dtype)
        bias = None
        if given_bias is not None:
            bias = given_bias * np.asarray(attr(node, "beta", 1.0), weight.dtype)
            bias = np.broadcast_to(bias.reshape(-1) if bias.size > 1 else bias.reshape(()), (weight.shape[1],)).copy()
        return weight, bias

    def per_channel(self, value: np.ndarray, node: ir.Node, features: int, spatial: tuple[int, int]) -> np.ndarray:
        """A per-feature constant as a per-channel [1, K, 1, 1] constant (a scalar stays a scalar)."""
        if value.size == 1:
            return value.reshape(())
        if value.size != features or tuple(value.shape) not in ((features,), (1, features), (features, 1, 1), (1, features, 1, 1)):
            raise ConversionError(f"{describe(node)} uses a constant of shape {value.shape}; expected one value per feature ({features}) or a scalar")
        if spatial != (1, 1):
            raise ConversionError(f"{describe(node)} applies a different constant to each position of the flattened map; cannot make it dense")
        return value.reshape(1, features, 1, 1)

    def per_feature(self, node: ir.Node, current: ir.Value, features: int, spatial: tuple[int, int]) -> ir.Value:
        inputs = []
        for value in node.inputs:
            array = constant(value)
            inputs.append(current if array is None else self.weight(self.per_channel(array, node, features, spatial), "constant"))
        return self.add(node.op_type, inputs)


def conv_kernel(weight: np.ndarray, *, channels: int, spatial: tuple[int, int], order: str) -> np.ndarray:
    """An FC weight [in, out] as an OIHW kernel, following the order the map was flattened in."""
    height, width = spatial
    outputs = weight.shape[1]
    if order == "chw":
        return weight.T.reshape(outputs, channels, height, width)
    return weight.T.reshape(outputs, height, width, channels).transpose(0, 3, 1, 2)
