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
from onnx import helper, numpy_helper

from convert.card import OutputKind, batch_shape, channel_axis
from convert.errors import ConversionError
from convert.graph import (
    attr,
    data_inputs,
    describe,
    initializers,
    opset,
    producers,
    prune,
    real_inputs,
    set_input_dims,
    skeleton,
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
    """What the surgery learnt about the classifier's head."""

    num_classes: int
    output_kind: int  # an OutputKind value


def fully_convolutional(model: onnx.ModelProto, *, training_size: tuple[int, int], layout: int) -> tuple[onnx.ModelProto, Head]:
    """The dense version of a normalised classifier graph, with output `scores` [N, K, h, w] and dynamic N, H, W.

    Rewrites `model` in place and returns it."""
    graph = model.graph
    if len(graph.output) != 1:
        raise ConversionError(f"expected a classifier with one output, got {len(graph.output)}: {[o.name for o in graph.output]}")
    image = real_inputs(graph)[0]
    input_shape = batch_one_shape(image, training_size=training_size, layout=layout)
    shapes = static_shapes(model, input_shape)
    constants = initializers(graph)
    made = producers(graph)
    chain, flatten = head_chain(graph.output[0].name, made, constants, shapes, opset(model))
    source, order, pool = flatten_point(flatten, made, constants, shapes)
    if len(shapes.get(source, ())) != 4:
        raise ConversionError(f"cannot prove the shape of the map {source!r} before the head at {training_size[0]}x{training_size[1]}; "
                              f"shape inference gives {shapes.get(source)}")
    channels, map_h, map_w = shapes[source][1:]
    refuse_position_mixing(graph, source, made, constants, shapes, tensor_spatial_axes(model, layout=layout), opset(model))
    builder = HeadBuilder(graph)
    current = source
    if pool is not None:
        current = builder.add(pool, [current], kernel_shape=[map_h, map_w], strides=[1, 1])
        map_h, map_w = 1, 1
    current, features = builder.rebuild(chain, current, channels=channels, spatial=(map_h, map_w), order=order)
    renamed = builder.nodes[-1] if builder.nodes else None
    if renamed is None:
        raise ConversionError(f"the head after {describe(flatten)} is empty: nothing to make dense")
    for i, name in enumerate(renamed.output):
        if name == current:
            renamed.output[i] = SCORES
    element_type = graph.output[0].type.tensor_type.elem_type
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info(SCORES, element_type, ["N", features, "h", "w"]))
    graph.node.extend(builder.nodes)
    graph.initializer.extend(builder.initializers)
    prune(graph)
    image = graph.input[0]
    set_input_dims(image, batch_shape(layout, batch="N", channels=input_shape[channel_axis(layout)], height="H", width="W"))
    del graph.value_info[:]
    try:
        frame = skeleton(model)
        onnx.checker.check_model(frame)
        onnx.shape_inference.infer_shapes(frame, strict_mode=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as error:
        raise ConversionError(f"the converted graph does not pass the ONNX checker: {error}") from error
    last = chain[-1].op_type if chain else ""
    kind = OutputKind.OUTPUT_KIND_PROBABILITIES if last in ("Softmax", "Sigmoid") else OutputKind.OUTPUT_KIND_LOGITS
    return model, Head(num_classes=features, output_kind=kind)


def batch_one_shape(image: onnx.ValueInfoProto, *, training_size: tuple[int, int], layout: int) -> list[int]:
    """The image input's shape at batch 1 and the training size."""
    dims = [d.dim_value if d.HasField("dim_value") else 0 for d in image.type.tensor_type.shape.dim]
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


def is_pooling_point(node: onnx.NodeProto, shapes: dict) -> bool:
    """A pooling that reduces a whole map to one cell: global pooling, or a window as large as the map (SqueezeNet's pool10)."""
    shape, source = shapes.get(node.output[0]), shapes.get(node.input[0]) if node.input else None
    if node.op_type in POOLS:
        return shape is not None and (len(shape) == 2 or per_cell(shape))
    if node.op_type in ("AveragePool", "MaxPool") and per_cell(shape) and source is not None and len(source) == 4:
        window = list(attr(node, "kernel_shape", []))
        return window == list(source[2:]) and not any(attr(node, "pads", [0])) and attr(node, "auto_pad", "NOTSET") in ("NOTSET", "VALID")
    return False


def head_chain(output: str, made: dict, constants: dict, shapes: dict, graph_opset: int) -> tuple[list[onnx.NodeProto], onnx.NodeProto]:
    """The head's nodes from the flatten point to the output (in order) and the flatten node itself."""
    chain: list[onnx.NodeProto] = []
    name = output
    while True:
        node = made.get(name)
        if node is None:
            raise ConversionError(f"cannot identify the classifier head: tensor {name!r} comes from the input or a constant")
        shape = shapes.get(node.output[0])
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
        data = data_inputs(node, constants)
        if len(data) != 1:
            raise ConversionError(f"head node {describe(node)} has {len(data)} computed inputs; expected one (the head must be a chain)")
        chain.append(node)
        name = data[0]


def flatten_point(flatten: onnx.NodeProto, made: dict, constants: dict, shapes: dict) -> tuple[str, str, str | None]:
    """(map tensor in NCHW, flatten order 'chw'/'hwc', dense pool op or None) for the node that flattens the map."""
    out_shape = shapes.get(flatten.output[0])
    if flatten.op_type in ("AveragePool", "MaxPool"):
        return flatten.input[0], "chw", flatten.op_type
    if flatten.op_type in POOLS:
        source, pool = pooled_map(flatten, made, constants, shapes)
        return source, "chw", pool
    if out_shape is None or len(out_shape) != 2:
        raise ConversionError(f"{describe(flatten)} produces shape {out_shape}; expected [N, features]")
    source = flatten.input[0]
    shape = shapes.get(source)
    if shape is None or len(shape) != 4 or int(np.prod(shape[1:])) != out_shape[1]:
        raise ConversionError(f"{describe(flatten)} flattens a tensor of shape {shape} into {out_shape}; expected a 4-D map flattened per sample")
    if flatten.op_type == "Flatten" and attr(flatten, "axis", 1) != 1:
        raise ConversionError(f"{describe(flatten)} has axis={attr(flatten, 'axis')}; expected axis=1 (flatten per sample)")
    order = "chw"
    producer = made.get(source)
    if producer is not None and producer.op_type == "Transpose":
        perm = list(attr(producer, "perm", []))
        if perm != [0, 2, 3, 1]:
            raise ConversionError(f"{describe(producer)} permutes the map with perm {perm} before the flatten; expected [0, 2, 3, 1] (NCHW→NHWC)")
        order, source = "hwc", producer.input[0]
        producer = made.get(source)
    if producer is not None and producer.op_type in POOLS:
        pooled_shape = shapes.get(producer.output[0])
        if pooled_shape is not None and len(pooled_shape) == 4:
            pool_source, pool = pooled_map(producer, made, constants, shapes)
            return pool_source, order, pool
    return source, order, None


def pooled_map(node: onnx.NodeProto, made: dict, constants: dict, shapes: dict) -> tuple[str, str]:
    """(NCHW map, dense pool op) for a global pooling over H, W at the flatten point."""
    source = node.input[0]
    if node.op_type.startswith("Reduce"):
        axes = reduce_axes(node, constants)
        rank = len(shapes.get(source, ()))
        if rank != 4 or axes is None:
            raise ConversionError(f"{describe(node)} reduces axes {axes} of a rank-{rank} tensor; expected the H, W axes of a 4-D map")
        axes = sorted(a % 4 for a in axes)
        if axes == [1, 2]:
            producer = made.get(source)
            if producer is None or producer.op_type != "Transpose" or list(attr(producer, "perm", [])) != [0, 2, 3, 1]:
                raise ConversionError(f"{describe(node)} reduces axes [1, 2] of a tensor that is not an NCHW→NHWC Transpose; cannot tell H, W apart")
            source = producer.input[0]
        elif axes != [2, 3]:
            raise ConversionError(f"{describe(node)} reduces axes {axes}; expected the spatial axes [2, 3]")
    return source, POOLS[node.op_type]


def reduce_axes(node: onnx.NodeProto, constants: dict) -> list[int] | None:
    """The axes of a Reduce node (attribute before opset 18, input after); None when not constant."""
    if len(node.input) > 1 and node.input[1]:
        value = constants.get(node.input[1])
        return None if value is None else [int(a) for a in value.ravel()]
    axes = attr(node, "axes")
    return None if axes is None else list(axes)


def refuse_position_mixing(graph: onnx.GraphProto, source: str, made: dict, constants: dict, shapes: dict,
                           axes: dict, graph_opset: int) -> None:
    """Raise on any body node that mixes positions: then a dense cell would not equal the classifier on one window."""
    body, pending = [], [source]
    seen: set[str] = set()
    while pending:
        name = pending.pop()
        node = made.get(name)
        if name in seen or node is None:
            continue
        seen.add(name)
        body.append(node)
        pending.extend(data_inputs(node, constants))
    for node in body:
        data = data_inputs(node, constants)
        shape = shapes.get(data[0]) if data else None
        rank = len(shape) if shape is not None else 0
        op = node.op_type
        reason = None
        if op in GLOBAL_POOLS:
            reason = "global pooling inside the body (e.g. squeeze-excitation) mixes all positions"
        elif op.startswith("Reduce") and rank == 4:
            spatial = set(axes.get(data[0], (2, 3)))
            reduced = reduce_axes(node, constants)
            if reduced is None or spatial & {a % 4 for a in reduced}:
                reason = "a reduction over H, W inside the body (e.g. squeeze-excitation) mixes all positions"
        elif op in ("Reshape", "Flatten") and rank == 4:
            reason = "a Reshape/Flatten of a feature map inside the body hard-codes the map's size"
        elif op in PRODUCTS and len(data) >= 2:
            reason = "a product of two computed tensors (attention) mixes positions"
        elif op in PRODUCTS and rank == 4:
            reason = "a matrix product over a feature map's last axis mixes positions"
        elif op in SOFTMAXES | {"Hardmax"} and rank == 4:
            spatial = set(axes.get(data[0], (2, 3)))
            axis = attr(node, "axis", 1 if graph_opset < 13 else -1) % 4
            if graph_opset < 13 or axis in spatial:
                reason = "a softmax over positions (attention) mixes positions"
        elif op == "Slice" and rank == 4 and fixed_spatial_end(node, constants, set(axes.get(data[0], (2, 3)))):
            reason = "a Slice with a fixed end on H or W hard-codes the map's size"
        elif op in RESCALING:
            reason = "it rescales the map inside the body; dense geometry needs a fixed stride"
        if reason:
            raise ConversionError(f"cannot convert faithfully: {describe(node)}: {reason}")


# Slice ends at or beyond this mean "to the end" (exporters write INT_MAX or INT64_MAX).
OPEN_END = 2**30


def fixed_spatial_end(node: onnx.NodeProto, constants: dict, spatial: set[int]) -> bool:
    """True when a Slice cuts H or W at a fixed positive end (a crop of the training-size map)."""
    if len(node.input) < 3:  # opset < 10: starts/ends/axes are attributes
        ends, axes = list(attr(node, "ends", [])), list(attr(node, "axes", range(len(attr(node, "ends", [])))))
    else:
        if node.input[2] not in constants or (len(node.input) > 3 and node.input[3] and node.input[3] not in constants):
            return True
        ends = [int(v) for v in constants[node.input[2]].ravel()]
        axes = [int(v) for v in constants[node.input[3]].ravel()] if len(node.input) > 3 and node.input[3] else list(range(len(ends)))
    return any(axis % 4 in spatial and 0 <= end < OPEN_END for axis, end in zip(axes, ends))


class HeadBuilder:
    """Collects the new dense head's nodes and weights."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.constants = initializers(graph)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.count = 0

    def name(self, kind: str) -> str:
        self.count += 1
        return f"scoremap_head_{self.count}_{kind}"

    def weight(self, array: np.ndarray, kind: str) -> str:
        name = self.name(kind)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def add(self, op: str, inputs: list[str], **attributes) -> str:
        output = self.name(op.lower())
        self.nodes.append(helper.make_node(op, inputs, [output], name=output, **attributes))
        return output

    def rebuild(self, chain: list[onnx.NodeProto], current: str, *, channels: int, spatial: tuple[int, int], order: str) -> tuple[str, int]:
        """Append the dense equivalents of `chain`; returns (last tensor, its channel count)."""
        features = channels * spatial[0] * spatial[1]
        for node in chain:
            op = node.op_type
            if op in LINEAR or op == POINTWISE_CONV:
                weight, bias = self.linear(node, features)
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
                scale, shift, mean, var = (self.constants[name].astype(np.float64) for name in node.input[1:5])
                factor = scale / np.sqrt(var + attr(node, "epsilon", 1e-5))
                dtype = self.constants[node.input[1]].dtype
                current = self.add("Mul", [current, self.weight(self.per_channel(factor.astype(dtype), node, features, spatial), "scale")])
                current = self.add("Add", [current, self.weight(self.per_channel((shift - mean * factor).astype(dtype), node, features, spatial), "shift")])
            elif op in ACTIVATIONS:
                inputs = [current] + [name for name in node.input[1:]]
                output = self.name(op.lower())
                self.nodes.append(helper.make_node(op, inputs, [output], name=output, domain=node.domain))
                self.nodes[-1].attribute.extend(node.attribute)
                current = output
            elif op in SOFTMAXES:
                if spatial != (1, 1):
                    raise ConversionError(f"{describe(node)} acts on flattened map features before any FC layer; expected it after the classifier's FC layers")
                # Softmax over the class axis, right in every opset: classes last, then back.
                current = self.add("Transpose", [current], perm=[0, 2, 3, 1])
                current = self.add(op, [current], axis=3)
                current = self.add("Transpose", [current], perm=[0, 3, 1, 2])
        return current, features

    def linear(self, node: onnx.NodeProto, features: int) -> tuple[np.ndarray, np.ndarray | None]:
        """(weight [in, out], bias [out] or None) of a Gemm, MatMul or 1x1 Conv node."""
        if node.input[0] in self.constants or node.input[1] not in self.constants:
            raise ConversionError(f"{describe(node)}: expected the features as first input and constant weights as second")
        weight = self.constants[node.input[1]]
        if node.op_type == POINTWISE_CONV:
            if weight.ndim != 4 or weight.shape[2:] != (1, 1) or attr(node, "group", 1) != 1 or any(attr(node, "pads", [0])):
                raise ConversionError(f"{describe(node)} in the head has weights {weight.shape}, group {attr(node, 'group', 1)}, "
                                      f"pads {attr(node, 'pads', [0])}; expected a 1x1 convolution without groups or padding")
            bias = self.constants[node.input[2]].reshape(-1) if len(node.input) > 2 and node.input[2] else None
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
        if len(node.input) > 2 and node.input[2]:
            bias = self.constants[node.input[2]] * np.asarray(attr(node, "beta", 1.0), weight.dtype)
            bias = np.broadcast_to(bias.reshape(-1) if bias.size > 1 else bias.reshape(()), (weight.shape[1],)).copy()
        return weight, bias

    def per_channel(self, value: np.ndarray, node: onnx.NodeProto, features: int, spatial: tuple[int, int]) -> np.ndarray:
        """A per-feature constant as a per-channel [1, K, 1, 1] constant (a scalar stays a scalar)."""
        if value.size == 1:
            return value.reshape(())
        if value.size != features or tuple(value.shape) not in ((features,), (1, features), (features, 1, 1), (1, features, 1, 1)):
            raise ConversionError(f"{describe(node)} uses a constant of shape {value.shape}; expected one value per feature ({features}) or a scalar")
        if spatial != (1, 1):
            raise ConversionError(f"{describe(node)} applies a different constant to each position of the flattened map; cannot make it dense")
        return value.reshape(1, features, 1, 1)

    def per_feature(self, node: onnx.NodeProto, current: str, features: int, spatial: tuple[int, int]) -> str:
        inputs = []
        for name in node.input:
            if name in self.constants:
                inputs.append(self.weight(self.per_channel(self.constants[name], node, features, spatial), "constant"))
            else:
                inputs.append(current)
        return self.add(node.op_type, inputs)


def conv_kernel(weight: np.ndarray, *, channels: int, spatial: tuple[int, int], order: str) -> np.ndarray:
    """An FC weight [in, out] as an OIHW kernel, following the order the map was flattened in."""
    height, width = spatial
    outputs = weight.shape[1]
    if order == "chw":
        return weight.T.reshape(outputs, channels, height, width)
    return weight.T.reshape(outputs, height, width, channels).transpose(0, 3, 1, 2)
