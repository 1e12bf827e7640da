"""Import normalisation: every ONNX source in one canonical form before cleanup and surgery.

Exporters of every era leave their own quirks: the ONNX model zoo's Caffe-era files are IR 3
(weights listed as graph inputs, which onnx shape inference needs below IR 4), opset 3-9 (Dropout's
`is_test`, Gemm's `broadcast`), with weights in Constant nodes or computed by ConstantOfShape and
constant arithmetic; tf2onnx computes flatten shapes from Shape chains. One step removes them all
with the well-kept tools, so later stages see one form and patch nothing:

- opsets below TARGET_OPSET are upgraded by onnx's version converter (tested from opset 1; a graph
  the converter cannot upgrade is refused naming the op; newer opsets are kept as they are);
- the IR version is raised to at least 4 and capped at what onnxruntime loads (IR_VERSIONS);
- initializers leave the graph inputs, Constant nodes become initializers, constant subgraphs
  (ConstantOfShape, arithmetic on constants, Shape-derived chains at the training size) are folded
  by onnxscript's constant folder, inference no-ops (Identity, Dropout) go, BatchNormalization
  after a Conv or Gemm is folded into its weights (onnxscript's rewrite rules), names are made
  unique, nodes sorted and shapes inferred (onnx_ir passes).
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnx_ir as ir
from onnx import version_converter
from onnx_ir.passes import common as passes
from onnxscript import rewriter
from onnxscript.optimizer import fold_constants
from onnxscript.rewriter.rules.common import fuse_batchnorm_into_conv_rule, fuse_batchnorm_into_gemm_rule

from convert.errors import ConversionError
from convert.graph import MIN_IR_VERSION, attr, describe, fresh_name, image_input, opset

log = logging.getLogger(__name__)

# Older opsets are upgraded to this one. 12 and not later: opset 13 changed Softmax from "flatten
# from the axis" to "one axis", and the converter then wraps a Caffe-era Softmax over [N, K, 1, 1]
# in Flatten/Reshape; 12 already has MaxPool dilations (à trous) and Dropout as a no-op input.
TARGET_OPSET = 12
# From MIN_IR_VERSION (initializers need not be graph inputs) to what onnxruntime 1.31 loads, IR 13
# (onnx 1.23 writes 14 by default).
IR_VERSIONS = range(MIN_IR_VERSION, 14)
# The last opset of "legacy" broadcasting (`broadcast`, `axis` attributes; opset 7 made it numpy's).
# Older graphs are upgraded to it first and their shapes inferred there: the converter's broadcast
# adapters need shapes onnx cannot infer for opset 1-5 ops (Relu's consumed_inputs), and
# explicit_broadcast_axes needs them too.
LEGACY_BROADCAST_OPSET = 6
# onnxruntime runs graphs from this opset on (and any IR version up to IR_VERSIONS' last).
ONNXRUNTIME_MIN_OPSET = 7
# Largest constant (elements) folding may create: an FC layer's weights computed by ConstantOfShape
# and arithmetic are folded (AlexNet's fc6 has 38M, VGG's 103M), a Tile or Expand cannot blow the file up.
MAX_FOLDED_ELEMENTS = 256 * 1024 * 1024


def runnable(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` at the opset and IR version normalisation starts from (and onnxruntime runs).

    Returns a new model when anything changes, `model` itself (not a copy) when nothing does."""
    version = opset(model)
    ir_version = min(max(model.ir_version, IR_VERSIONS.start), IR_VERSIONS.stop - 1)
    if version >= TARGET_OPSET and ir_version == model.ir_version:
        return model
    if version < TARGET_OPSET:  # the converter returns a new model (and reads IR 3 files as they are)
        try:
            upgraded = model
            if version <= LEGACY_BROADCAST_OPSET:
                if version < LEGACY_BROADCAST_OPSET:
                    upgraded = version_converter.convert_version(model, LEGACY_BROADCAST_OPSET)
                upgraded = ir.to_proto(explicit_broadcast_axes(ir.from_proto(onnx.shape_inference.infer_shapes(upgraded))))
            upgraded = version_converter.convert_version(upgraded, TARGET_OPSET)
        except Exception as error:  # the converter raises bare RuntimeErrors naming the op
            raise ConversionError(
                f"the graph's opset {version} cannot be upgraded to opset {TARGET_OPSET} by onnx's version converter: "
                f"{error}; expected a graph onnx.version_converter upgrades, or one at opset {TARGET_OPSET} or later") from error
        log.info("upgraded the graph from opset %d to %d", version, TARGET_OPSET)
    else:
        upgraded = onnx.ModelProto()
        upgraded.CopyFrom(model)
    upgraded.ir_version = ir_version
    return upgraded


def explicit_broadcast_axes(model: ir.Model) -> ir.Model:
    """Legacy `broadcast=1, axis=k` (Caffe2's per-channel Add/Mul of a [C] vector at axis 1) as an
    Unsqueeze to B's trailing axes, then plain suffix broadcasting. Edits `model` and returns it.

    onnx's version converter ignores `axis` (it unsqueezes a [C] bias to [C, 1, 1, 1] against
    [N, C, H, W]), so these nodes are made axis-free before it runs; it needs the inputs' shapes inferred."""
    graph = model.graph
    for node in list(graph):
        axis = attr(node, "axis")
        if attr(node, "broadcast", 0) != 1 or axis is None or len(node.inputs) != 2:
            continue
        a, b = node.inputs
        if a is None or b is None or a.shape is None or b.shape is None:
            raise ConversionError(f"{describe(node)} broadcasts at axis {axis} but the ranks of its inputs are unknown; "
                                  "expected shapes onnx can infer")
        trailing = len(a.shape) - (axis % len(a.shape)) - len(b.shape)
        if trailing > 0:
            name = fresh_name(graph, f"{b.name}_at_axis_{axis}")
            unsqueeze = ir.node("Unsqueeze", [b], {"axes": list(range(len(b.shape), len(b.shape) + trailing))}, name=name)
            unsqueeze.outputs[0].name = name
            graph.insert_before(node, unsqueeze)
            node.replace_input_with(1, unsqueeze.outputs[0])
        del node.attributes["axis"]
    return model


def reference(source: onnx.ModelProto, upgraded: onnx.ModelProto) -> onnx.ModelProto:
    """What a conversion is verified against: the source itself when onnxruntime runs it, so the
    check covers the upgrade too; else its upgraded form."""
    runs = opset(source) >= ONNXRUNTIME_MIN_OPSET and source.ir_version < IR_VERSIONS.stop
    return source if runs else upgraded


def fold_constant_of_shape(node: ir.Node) -> bool | None:
    """onnxscript's folder keeps ConstantOfShape (to keep files small), but Caffe-era graphs compute
    their weights from it: fold it when its shape is constant and the result not too large."""
    if node.op_type != "ConstantOfShape" or node.domain not in ("", "ai.onnx"):
        return None  # the folder's own rules
    shape = node.inputs[0].const_value if node.inputs and node.inputs[0] is not None else None
    return shape is not None and int(np.prod(shape.numpy())) <= MAX_FOLDED_ELEMENTS


def normalize(model: onnx.ModelProto, *, input_shape: list[int]) -> onnx.ModelProto:
    """`canonical` for a proto: a new, canonical copy of a runnable classifier (tools and tests that hold protos)."""
    return ir.to_proto(canonical(ir.from_proto(model), input_shape=input_shape))


def canonical(model: ir.Model, *, input_shape: list[int]) -> ir.Model:
    """A runnable classifier in canonical form, its image input fixed at `input_shape` (batch 1, training size).

    Edits `model` and returns it."""
    image_input(model).shape = ir.Shape(input_shape)
    passes.RemoveInitializersFromInputsPass()(model)
    passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model)
    fold_constants(model, onnx_shape_inference=True, input_size_limit=MAX_FOLDED_ELEMENTS,
                   output_size_limit=MAX_FOLDED_ELEMENTS, should_fold=fold_constant_of_shape)
    rewriter.rewrite(model, [fuse_batchnorm_into_conv_rule, fuse_batchnorm_into_gemm_rule])
    for step in (
        passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        passes.IdentityEliminationPass(),
        passes.RemoveUnusedNodesPass(),
        passes.NameFixPass(),
        passes.TopologicalSortPass(),
    ):
        step(model)
    try:  # the pass infers on the graph without its weights' data: no copy of them
        passes.ShapeInferencePass()(model)
    except Exception as error:  # onnx raises InferenceError, wrapped by the pass manager
        raise ConversionError(f"shape inference fails at input shape {input_shape}: {error}") from error
    return model
