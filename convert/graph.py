"""Small read/write helpers over onnx.GraphProto shared by the graph rewrites.

Kept deliberately thin: the rewrites work on plain ONNX protos so every stage is a function
from graph to graph that a test can build and check with onnx.helper.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

# The first IR version whose initializers need not be graph inputs (below it, onnx's shape inference ignores them).
MIN_IR_VERSION = 4
# Initializers up to this many elements keep their values in the shape-inference skeleton: shape
# tensors (Reshape targets, Pad amounts) must be known; weights need only their shapes.
SHAPE_VALUE_ELEMENTS = 64


def attr(node: onnx.NodeProto, name: str, default=None):
    """The value of attribute `name` of `node`, or `default`."""
    for attribute in node.attribute:
        if attribute.name == name:
            value = helper.get_attribute_value(attribute)
            return value.decode() if isinstance(value, bytes) else value
    return default


def set_attr(node: onnx.NodeProto, name: str, value) -> None:
    """Replace (or add) attribute `name` of `node`."""
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(kept)
    node.attribute.append(helper.make_attribute(name, value))


def describe(node: onnx.NodeProto) -> str:
    """How error messages name a node: its type, its name and its first output."""
    label = f" {node.name!r}" if node.name else ""
    return f"{node.op_type}{label} (output {node.output[0]!r})" if node.output else f"{node.op_type}{label}"


def opset(model: onnx.ModelProto) -> int:
    """The default-domain opset the model imports."""
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    return 1


def producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {output: node for node in graph.node for output in node.output if output}


class Initializers(Mapping):
    """A graph's initializer values by name, each read into numpy on first use: the rewrites ask
    which inputs are constant far more often than they read a weight, and weights are large."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self._protos = {init.name: init for init in graph.initializer}
        self._arrays: dict[str, np.ndarray] = {}

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._arrays:
            self._arrays[name] = numpy_helper.to_array(self._protos[name])
        return self._arrays[name]

    def __contains__(self, name: object) -> bool:
        return name in self._protos

    def __iter__(self) -> Iterator[str]:
        return iter(self._protos)

    def __len__(self) -> int:
        return len(self._protos)


def initializers(graph: onnx.GraphProto) -> Initializers:
    return Initializers(graph)


def data_inputs(node: onnx.NodeProto, constants: dict[str, np.ndarray]) -> list[str]:
    """The inputs of `node` that are computed from the image (not constants)."""
    return [name for name in node.input if name and name not in constants]


def input_dims(value: onnx.ValueInfoProto) -> list[int | str]:
    """The dims of a graph input: ints where static, names (or '?') where symbolic."""
    dims: list[int | str] = []
    for dim in value.type.tensor_type.shape.dim:
        dims.append(dim.dim_value if dim.HasField("dim_value") else (dim.dim_param or "?"))
    return dims


def set_input_dims(value: onnx.ValueInfoProto, dims: Iterable[int | str]) -> None:
    shape = value.type.tensor_type.shape
    shape.ClearField("dim")
    for size in dims:
        dim = shape.dim.add()
        if isinstance(size, str):
            dim.dim_param = size
        else:
            dim.dim_value = size


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


def static_shapes(model: onnx.ModelProto, input_shape: list[int]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape with the image input fixed to `input_shape` (tensors left unknown are absent)."""
    inferred = onnx.shape_inference.infer_shapes(skeleton(model, input_shape=input_shape), data_prop=True)
    shapes: dict[str, tuple[int, ...]] = {}
    for value in list(inferred.graph.value_info) + list(inferred.graph.output) + list(inferred.graph.input):
        tensor_type = value.type.tensor_type
        if not tensor_type.HasField("shape"):
            continue
        dims = tensor_type.shape.dim
        if all(d.HasField("dim_value") for d in dims):
            shapes[value.name] = tuple(d.dim_value for d in dims)
    for init in inferred.graph.initializer:
        shapes[init.name] = tuple(init.dims)
    return shapes


def real_inputs(graph: onnx.GraphProto) -> list[onnx.ValueInfoProto]:
    """Graph inputs that are not also initializers (old exporters list weights as inputs)."""
    names = {init.name for init in graph.initializer}
    return [value for value in graph.input if value.name not in names]


def prune(graph: onnx.GraphProto) -> onnx.GraphProto:
    """Drop nodes and initializers that no graph output depends on; returns `graph`."""
    image_inputs = {value.name for value in real_inputs(graph)}
    needed = {output.name for output in graph.output}
    kept: list[onnx.NodeProto] = []
    for node in reversed(graph.node):
        if any(name in needed for name in node.output):
            kept.append(node)
            needed.update(name for name in node.input if name)
    kept.reverse()
    del graph.node[:]
    graph.node.extend(kept)
    used_initializers = [init for init in graph.initializer if init.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(used_initializers)
    used_inputs = [value for value in graph.input if value.name in image_inputs or value.name in needed]
    del graph.input[:]
    graph.input.extend(used_inputs)
    return graph


def unique_name(graph: onnx.GraphProto, base: str) -> str:
    """A tensor name not yet used in `graph`."""
    taken = {name for node in graph.node for name in list(node.input) + list(node.output)}
    taken.update(init.name for init in graph.initializer)
    taken.update(value.name for value in graph.input)
    name, index = base, 0
    while name in taken:
        index += 1
        name = f"{base}_{index}"
    return name
