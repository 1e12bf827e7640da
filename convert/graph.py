"""Helpers over the graph for the conversion passes (onnx_ir) and a few ONNX-proto readers for the edges.

The passes work on one IR, onnx_ir's `ir.Model` (see convert.pipeline for the convention). Protos
appear only where a tool reads or writes them: the source and onnx's version converter on the way
in, onnxruntime, the model card and the profile's skeleton on the way out.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper
from onnx_ir.passes.common import _c_api_utils

# The first IR version whose initializers need not be graph inputs (below it, onnx's shape inference ignores them).
MIN_IR_VERSION = 4
# Initializers up to this many elements keep their values in the shape-inference skeleton: shape
# tensors (Reshape targets, Pad amounts) must be known; weights need only their shapes.
SHAPE_VALUE_ELEMENTS = 64


# ---- Reading and editing an ir.Model (the passes) ----


def attr(node: ir.Node, name: str, default=None):
    """The value of attribute `name` of `node` (int lists as lists), or `default`."""
    attribute = node.attributes.get(name)
    if attribute is None:
        return default
    value = attribute.value
    return list(value) if isinstance(value, tuple) else value


def set_attr(node: ir.Node, name: str, value) -> None:
    """Replace (or add) attribute `name` of `node`."""
    node.attributes[name] = ir.convenience.convert_attribute(name, value)


def describe(node: ir.Node) -> str:
    """How error messages name a node: its type, its name and its first output."""
    label = f" {node.name!r}" if node.name else ""
    return f"{node.op_type}{label} (output {node.outputs[0].name!r})" if node.outputs else f"{node.op_type}{label}"


def constant(value: ir.Value | None) -> np.ndarray | None:
    """The value of a constant tensor (an initializer) in numpy, or None for a computed one."""
    if value is None or value.const_value is None:
        return None
    return value.const_value.numpy()


def computed_inputs(node: ir.Node) -> list[ir.Value]:
    """The inputs of `node` that are computed from the image (not constants)."""
    return [value for value in node.inputs if value is not None and value.const_value is None]


def image_input(model: ir.Model) -> ir.Value:
    """The graph's first input that is not a weight (old exporters list weights as inputs)."""
    return next(value for value in model.graph.inputs if not value.is_initializer())


def fresh_name(graph: ir.Graph, base: str) -> str:
    """A value name not yet used in `graph`."""
    taken = {value.name for value in graph.inputs} | set(graph.initializers)
    taken.update(output.name for node in graph for output in node.outputs)
    name, index = base, 0
    while name in taken:
        index += 1
        name = f"{base}_{index}"
    return name


def add_constant(graph: ir.Graph, array: np.ndarray, name: str) -> ir.Value:
    """A new initializer of `graph` holding `array`, named `name` (made unique)."""
    value = ir.Value(name=fresh_name(graph, name), const_value=ir.tensor(np.ascontiguousarray(array)))
    value.shape, value.dtype = value.const_value.shape, value.const_value.dtype
    graph.register_initializer(value)
    return value


def inferred(model: ir.Model, input_shape: list[int | str] | None = None, *, strict: bool = False) -> onnx.ModelProto:
    """onnx's shape inference over the model without its weights' data, the image fixed at `input_shape`
    when given (output shapes are then left to inference); `model` is left as it was.

    The weights are left out the way onnx_ir's own ShapeInferencePass leaves them out."""
    image = image_input(model)
    saved = image.shape, [output.shape for output in model.graph.outputs]
    if input_shape is not None:
        image.shape = ir.Shape(input_shape)
        for output in model.graph.outputs:
            output.shape = None
    try:
        return _c_api_utils.call_onnx_api(
            lambda proto: onnx.shape_inference.infer_shapes(proto, strict_mode=strict, data_prop=True), model)
    finally:
        image.shape = saved[0]
        for output, shape in zip(model.graph.outputs, saved[1]):
            output.shape = shape


# ---- ONNX protos (the edges) ----


def opset(model: onnx.ModelProto | ir.Model) -> int:
    """The default-domain opset the model imports."""
    if isinstance(model, ir.Model):
        return model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1))
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    return 1


def input_dims(value: onnx.ValueInfoProto) -> list[int | str]:
    """The dims of a graph input: ints where static, names (or '?') where symbolic."""
    dims: list[int | str] = []
    for dim in value.type.tensor_type.shape.dim:
        dims.append(dim.dim_value if dim.HasField("dim_value") else (dim.dim_param or "?"))
    return dims


def skeleton(model: onnx.ModelProto, *, input_shape: list[int | str] | None = None) -> onnx.ModelProto:
    """The graph without its weights' data, for onnx's checker and shape inference (which serialize
    what they are given): large initializers become graph inputs of their type and shape; the image
    input is fixed at `input_shape` when given, and output shapes are left to inference then."""
    graph = model.graph
    image = real_inputs(graph)[0]
    small = [init for init in graph.initializer if int(np.prod(init.dims)) <= SHAPE_VALUE_ELEMENTS]
    weights = [helper.make_tensor_value_info(init.name, init.data_type, list(init.dims))
               for init in graph.initializer if int(np.prod(init.dims)) > SHAPE_VALUE_ELEMENTS]
    inputs, outputs = list(graph.input), list(graph.output)
    if input_shape is not None:
        inputs = [helper.make_tensor_value_info(image.name, image.type.tensor_type.elem_type, input_shape)]
        outputs = [helper.make_tensor_value_info(output.name, output.type.tensor_type.elem_type, None) for output in graph.output]
    return helper.make_model(helper.make_graph(graph.node, graph.name, [*inputs, *weights], outputs, small),
                             ir_version=max(model.ir_version, MIN_IR_VERSION), opset_imports=model.opset_import)


def static_shapes(model: onnx.ModelProto | ir.Model, input_shape: list[int]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, by name, with the image input fixed to `input_shape` (tensors left unknown are absent)."""
    if isinstance(model, ir.Model):
        result = inferred(model, input_shape)
    else:
        result = onnx.shape_inference.infer_shapes(skeleton(model, input_shape=input_shape), data_prop=True)
    shapes: dict[str, tuple[int, ...]] = {}
    for value in list(result.graph.value_info) + list(result.graph.output) + list(result.graph.input):
        tensor_type = value.type.tensor_type
        if not tensor_type.HasField("shape"):
            continue
        dims = tensor_type.shape.dim
        if all(d.HasField("dim_value") for d in dims):
            shapes[value.name] = tuple(d.dim_value for d in dims)
    for init in result.graph.initializer:
        shapes[init.name] = tuple(init.dims)
    return shapes


def real_inputs(graph: onnx.GraphProto) -> list[onnx.ValueInfoProto]:
    """Graph inputs that are not also initializers (old exporters list weights as inputs)."""
    names = {init.name for init in graph.initializer}
    return [value for value in graph.input if value.name not in names]


def check(model: ir.Model) -> None:
    """onnx's checker and strict shape inference over the model without its weights' data; raises their errors."""
    def both(proto: onnx.ModelProto) -> None:
        onnx.checker.check_model(proto)
        onnx.shape_inference.infer_shapes(proto, strict_mode=True)

    _c_api_utils.call_onnx_api(both, model)
