"""Graph cleanup before surgery: fold constants, drop Dropout/Identity, fold batch-norm into Conv.

Exporters leave work that is fixed once the training size is known: tf2onnx computes the
flatten shape with Shape/Gather/Slice/Concat, Caffe-era graphs compute weights with constant
subgraphs, PyTorch exports may keep BatchNormalization after Conv. Folding them first leaves
the surgery one plain pattern per head, and the server fewer nodes to run.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator

from convert.errors import ConversionError
from convert.graph import (
    MAX_IR_VERSION,
    attr,
    consumers,
    initializers,
    producers,
    prune,
    static_shapes,
)

# Shape folding can expose new constants (a folded Reshape target gives its output a known shape);
# folding repeats until nothing changes, at most this many rounds.
MAX_FOLD_ROUNDS = 8
# Ops never folded even when their inputs are constant: random ops must stay random.
NEVER_FOLDED = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"})
# Constants larger than this (elements) are not produced by folding: keeps a Tile or Expand from exploding the file.
MAX_FOLDED_ELEMENTS = 64 * 1024 * 1024


def cleanup(model: onnx.ModelProto, *, input_shape: list[int]) -> onnx.ModelProto:
    """A cleaned copy of `model`: constants folded (shapes taken at `input_shape`), Dropout/Identity removed, BN folded."""
    model = copy.deepcopy(model)
    model.ir_version = min(model.ir_version, MAX_IR_VERSION)
    graph = model.graph
    constant_nodes_to_initializers(graph)
    remove_passthrough(graph)
    for _ in range(MAX_FOLD_ROUNDS):
        if not fold_constants(model, input_shape=input_shape):
            break
    fold_batch_norms(graph)
    prune(graph)
    return model


def constant_nodes_to_initializers(graph: onnx.GraphProto) -> onnx.GraphProto:
    """Constant nodes become initializers (Caffe-era and tf2onnx graphs keep weights in Constant nodes)."""
    kept = []
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            value = ReferenceEvaluator(node).run(None, {})[0]
            graph.initializer.append(numpy_helper.from_array(np.asarray(value), node.output[0]))
        else:
            kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)
    return graph


def remove_passthrough(graph: onnx.GraphProto) -> onnx.GraphProto:
    """Drop inference no-ops (Dropout, Identity), wiring their consumers to their input."""
    outputs = {value.name for value in graph.output}
    kept = []
    renames: dict[str, str] = {}
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name]
        if node.op_type in ("Dropout", "Identity") and node.domain in ("", "ai.onnx"):
            if node.op_type == "Dropout" and len(node.output) > 1 and node.output[1]:
                uses_mask = any(node.output[1] in other.input for other in graph.node)
                if uses_mask:
                    kept.append(node)
                    continue
            source, result = node.input[0], node.output[0]
            if result in outputs:
                # Keep the graph output's name: rename the producer's output instead.
                for earlier in kept:
                    for j, name in enumerate(earlier.output):
                        if name == source:
                            earlier.output[j] = result
                    for j, name in enumerate(earlier.input):
                        if name == source:
                            earlier.input[j] = result
                renames[source] = result
            else:
                renames[result] = source
            continue
        kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)
    return graph


def fold_constants(model: onnx.ModelProto, *, input_shape: list[int]) -> bool:
    """One folding round: evaluate nodes whose inputs are all known; True when anything was folded."""
    graph = model.graph
    known = initializers(graph)
    try:
        shapes = static_shapes(model, input_shape)
    except onnx.shape_inference.InferenceError as error:
        raise ConversionError(f"shape inference fails at input shape {input_shape}: {error}") from error
    opsets = {entry.domain or "": entry.version for entry in model.opset_import}
    kept = []
    folded = False
    for node in graph.node:
        value = evaluate(node, known, shapes, opsets)
        if value is None:
            kept.append(node)
            continue
        for name, array in zip(node.output, value):
            if name:
                known[name] = array
                graph.initializer.append(numpy_helper.from_array(array, name))
        folded = True
    del graph.node[:]
    graph.node.extend(kept)
    prune(graph)
    return folded


def evaluate(node: onnx.NodeProto, known: dict[str, np.ndarray], shapes: dict[str, tuple[int, ...]],
             opsets: dict[str, int]) -> list[np.ndarray] | None:
    """The outputs of `node` when they are fixed by constants and static shapes, else None."""
    if node.domain not in ("", "ai.onnx") or node.op_type in NEVER_FOLDED:
        return None
    if node.op_type in ("Shape", "Size") and node.input[0] not in known:
        shape = shapes.get(node.input[0])
        if shape is None:
            return None
        if node.op_type == "Size":
            return [np.array(int(np.prod(shape)), dtype=np.int64)]
        start, end = attr(node, "start", 0), attr(node, "end", None)
        return [np.array(shape[start:end], dtype=np.int64)]
    inputs = [name for name in node.input if name]
    if not all(name in known for name in inputs) or any(a.type == onnx.AttributeProto.GRAPH for a in node.attribute):
        return None
    try:
        outputs = ReferenceEvaluator(node, opsets=opsets).run(None, {name: known[name] for name in inputs})
    except Exception:  # an op the reference evaluator lacks stays in the graph, unfolded
        return None
    arrays = [np.asarray(output) for output in outputs]
    if any(array.size > MAX_FOLDED_ELEMENTS for array in arrays):
        return None
    return arrays


def fold_batch_norms(graph: onnx.GraphProto) -> onnx.GraphProto:
    """BatchNormalization right after a Conv (its only consumer) is folded into the Conv's weights."""
    known = initializers(graph)
    made = producers(graph)
    users = consumers(graph)
    outputs = {value.name for value in graph.output}
    replaced: dict[str, onnx.TensorProto] = {}
    kept = []
    for node in graph.node:
        conv = made.get(node.input[0]) if node.op_type == "BatchNormalization" else None
        foldable = (
            conv is not None and conv.op_type == "Conv"
            and len(users.get(conv.output[0], [])) == 1 and conv.output[0] not in outputs
            and all(name in known for name in list(node.input[1:5]) + list(conv.input[1:]))
            and (len(node.output) == 1 or not any(node.output[1:]))
        )
        if not foldable:
            kept.append(node)
            continue
        scale, shift, mean, var = (known[name].astype(np.float64) for name in node.input[1:5])
        factor = scale / np.sqrt(var + attr(node, "epsilon", 1e-5))
        weight = known[conv.input[1]]
        bias = known[conv.input[2]] if len(conv.input) > 2 and conv.input[2] else np.zeros(weight.shape[0], weight.dtype)
        new_weight = (weight * factor.reshape(-1, *[1] * (weight.ndim - 1))).astype(weight.dtype)
        new_bias = ((bias - mean) * factor + shift).astype(weight.dtype)
        weight_name, bias_name = f"{conv.output[0]}_bn_weight", f"{conv.output[0]}_bn_bias"
        replaced[weight_name] = numpy_helper.from_array(new_weight, weight_name)
        replaced[bias_name] = numpy_helper.from_array(new_bias, bias_name)
        del conv.input[1:]
        conv.input.extend([weight_name, bias_name])
        conv.output[0] = node.output[0]
    del graph.node[:]
    graph.node.extend(kept)
    graph.initializer.extend(replaced.values())
    return graph

