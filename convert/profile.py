"""Memory and compute profile of an ONNX graph for one input size, from the graph alone.

Dense scoring multiplies activation memory with image size and batch, and running out of memory
is how such services die. This module predicts, before a request runs, the peak memory
onnxruntime will need for it:

    predicted_peak = weights + peak of simultaneously live activations + runtime allowance

* weights: every initializer and Constant output, at its own dtype.
* live activations: buffers are allocated when a node runs, in the graph's (topological) node
  order, and freed after their last consumer; graph inputs live from the start and graph outputs
  to the end. View-like ops (Reshape, Flatten, Squeeze, Unsqueeze, Identity, Dropout) alias their
  input; element-wise ops reuse their input's buffer when that input dies at the op and has the
  same size (what onnxruntime's allocation planner does), so neither is counted twice.
* allowance: what the execution provider adds (weight copies, session state, run workspace, and
  its activation factor over the live peak), fitted per provider in convert.memory_model.

The image input's layout (NCHW or NHWC), channel count and dtype come from the model card when
the graph carries one (or from the caller, for a graph built at load time such as a server's
wrapper); a graph without either is read from its fixed dimensions when they leave no doubt.

The per-layer table follows the classic VGG16 breakdown (cs231n): each node's output shape,
activations (elements of the new buffers it writes; aliasing ops write none), parameters
(elements of its initializer inputs), multiply-accumulates (Conv, Gemm, MatMul only) and bytes.
Shapes come from onnx shape inference with the input's N/H/W set to the request.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import platform
import re

import onnx
from google.protobuf.message import DecodeError
from onnx import TensorProto, helper, numpy_helper, shape_inference

from convert.card import METADATA_KEY, CardError, ImageInput, Layout, batch_shape, channel_axis, label, read_card, spatial_axes
from convert.graph import real_inputs
from convert.graph import skeleton as graph_skeleton
from convert.memory_model import Device, MemoryTerms, predict

__all__ = [
    "ProfileError",
    "Layer",
    "Profile",
    "Skeleton",
    "load_skeleton",
    "profile_model",
    "largest_batch",
    "largest_square_size",
    "parse_bytes",
    "MAX_BATCH",
    "MAX_SIDE",
]

# Upper bounds of the searches in largest_batch / largest_square_size.
MAX_BATCH = 4096
MAX_SIDE = 16384

# onnxruntime's QLinearConv buffers (`_int8_scratch`): MLAS's x86 symmetric kernels (convsym.cpp) take depthwise
# convolutions over a multiple of 16 channels, and others with input channels a multiple of 4 and at least 16 output
# channels, a multiple of 8 (AVX2's alignment; AVX-512's 4 takes more of them, which then hold less).
X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
POINTER_BYTES = 8
INT32_BYTES = 4
SYMMETRIC_GROUP_ALIGN = 16
SYMMETRIC_INPUT_ALIGN = 4
SYMMETRIC_MIN_OUTPUTS = 16
SYMMETRIC_OUTPUT_ALIGN = 8

# Ops whose second input is their weights: in a QDQ graph, fused only with quantized (dequantized) weights.
WEIGHTED_OPS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})

# Ops whose output is a view of their first input (onnxruntime declares them as aliasing).
VIEW_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Dropout"})
# Quantization pairs around the ops of a QDQ (int8) graph, fused by onnxruntime into the ops' integer kernels.
QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})
# Element-wise ops whose output may overwrite an input that dies at the op.
IN_PLACE_OPS = frozenset({
    "Relu", "LeakyRelu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Elu", "Selu",
    "Softplus", "Neg", "Abs", "Exp", "Log", "Sqrt", "Reciprocal", "Add", "Sub", "Mul", "Div",
    "BatchNormalization",
})


class ProfileError(ValueError):
    """The graph cannot be profiled for the requested size (unknown shapes, unsupported input)."""


@dataclasses.dataclass(frozen=True)
class Layer:
    """One node of the graph, as a row of the per-layer table."""

    name: str
    op: str
    output_shape: tuple[int, ...]
    activations: int
    params: int
    macs: int
    bytes: int

    def to_dict(self) -> dict:
        return {
            "name": self.name, "op": self.op, "output_shape": list(self.output_shape),
            "activations": self.activations, "params": self.params, "macs": self.macs,
            "bytes": self.bytes,
        }


@dataclasses.dataclass(frozen=True)
class Profile:
    """The per-layer table and the predicted peak for one (height, width, batch) on one device."""

    height: int
    width: int
    batch: int
    dtype: str
    layers: tuple[Layer, ...]
    input_activations: int
    input_bytes: int
    weights_bytes: int
    naive_activation_bytes: int
    peak_activation_bytes: int
    peak_layer: str
    terms: MemoryTerms

    @property
    def device(self) -> Device:
        return self.terms.device

    @property
    def predicted_peak_bytes(self) -> int:
        return self.terms.total

    @property
    def allowance_bytes(self) -> int:
        """What the provider adds over weights + live peak (copies, session, workspace, factor)."""
        return self.terms.total - self.weights_bytes - self.peak_activation_bytes

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers)

    @property
    def activations(self) -> int:
        """Input elements plus every new buffer written by a layer (the cs231n convention)."""
        return self.input_activations + sum(layer.activations for layer in self.layers)

    @property
    def macs(self) -> int:
        return sum(layer.macs for layer in self.layers)

    def to_dict(self) -> dict:
        return {
            "height": self.height,
            "width": self.width,
            "batch": self.batch,
            "dtype": self.dtype,
            "device": self.device.value,
            "layers": [layer.to_dict() for layer in self.layers],
            "params": self.params,
            "activations": self.activations,
            "macs": self.macs,
            "input_bytes": self.input_bytes,
            "weights_bytes": self.weights_bytes,
            "naive_activation_bytes": self.naive_activation_bytes,
            "peak_activation_bytes": self.peak_activation_bytes,
            "peak_layer": self.peak_layer,
            "allowance_bytes": self.allowance_bytes,
            "terms": self.terms.to_dict(),
            "predicted_peak_bytes": self.predicted_peak_bytes,
        }


_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "tib": 2**40, "tb": 10**12,
}


def parse_bytes(text: str) -> int:
    """'2GiB' -> 2147483648. KiB/MiB/GiB and bare K/M/G are binary, kB/MB/GB decimal."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ProfileError(f"cannot read {text!r} as a memory size; expected a number with an optional "
                           "unit such as 512MiB, 2GiB, 1.5GB or 1000000")
    return int(float(match.group(1)) * _UNITS[unit])


def _element_size(elem_type: int) -> int:
    return helper.tensor_dtype_to_np_dtype(elem_type).itemsize


def _dtype_name(elem_type: int) -> str:
    return {TensorProto.FLOAT: "fp32", TensorProto.FLOAT16: "fp16", TensorProto.DOUBLE: "fp64",
            TensorProto.BFLOAT16: "bf16"}.get(elem_type, helper.tensor_dtype_to_np_dtype(elem_type).name)


@dataclasses.dataclass(frozen=True)
class Skeleton:
    """The graph without its large weights: what shape inference needs, cheap to copy. Every
    profile function takes one in place of a model, so a server keeps this, not the weights."""

    model: onnx.ModelProto
    image_input: str
    weights: dict[str, tuple[tuple[int, ...], int]]  # name -> (shape, element size)
    dtype: str  # of most weight bytes: an fp16 graph keeps float32 only at its edges
    layout: int  # a Layout value: where the channel and spatial axes of the image input are
    channels: int
    # DequantizeLinear inputs of weights whose zero point is 0 everywhere: the int8 convolutions reading them run
    # on onnxruntime's symmetric path (`_int8_scratch`).
    symmetric_weights: frozenset[str] = frozenset()


def _image_layout(model: onnx.ModelProto, image: onnx.ValueInfoProto, layout: int | None) -> tuple[int, int]:
    """(layout, channels) of the image input: the caller's layout, else the card's, else the one
    the graph's fixed dimensions allow (one of axes 1 and 3 fixed, the other symbolic); the
    channel count from the graph, else from the card's mean/std."""
    dims = image.type.tensor_type.shape.dim
    fixed = [dim.dim_value if dim.HasField("dim_value") else 0 for dim in dims]
    card_channels = 0
    if layout is None and any(prop.key == METADATA_KEY for prop in model.metadata_props):
        try:
            view = ImageInput.of(read_card(model))
        except CardError as error:
            raise ProfileError(f"the model card does not say how the image input is laid out: {error}") from error
        layout, card_channels = view.layout, view.channels
    if layout is None:
        candidates = [choice for choice in (Layout.LAYOUT_NCHW, Layout.LAYOUT_NHWC)
                      if fixed[channel_axis(choice)] and not any(fixed[axis] for axis in spatial_axes(choice))]
        if len(candidates) != 1:
            raise ProfileError(
                f"input {image.name!r} has shape {[d.dim_value or d.dim_param or '?' for d in dims]} and the graph "
                "has no model card saying its layout; convert it with scoremap-convert, or give the layout "
                "(NCHW or NHWC)")
        layout = candidates[0]
    channels = fixed[channel_axis(layout)] or card_channels
    if channels <= 0:
        raise ProfileError(f"the channel dimension of input {image.name!r} ({label(Layout, layout)}, axis "
                           f"{channel_axis(layout)}) is not fixed and the model card gives no mean/std to count them")
    return layout, channels


def _skeleton(model: onnx.ModelProto, layout: int | None = None) -> Skeleton:
    graph = model.graph
    inputs = real_inputs(graph)
    if len(inputs) != 1:
        raise ProfileError(f"expected a graph with one image input, got {len(inputs)}: "
                           f"{[value.name for value in inputs]}")
    image = inputs[0]
    dims = image.type.tensor_type.shape.dim
    if len(dims) != 4:
        raise ProfileError(f"expected a 4-d NCHW or NHWC image input, got {image.name!r} with {len(dims)} dimensions")
    layout, channels = _image_layout(model, image, layout)
    weights: dict[str, tuple[tuple[int, ...], int]] = {}
    bytes_by_type: dict[int, int] = {}
    for init in graph.initializer:
        shape = tuple(int(d) for d in init.dims)
        weights[init.name] = (shape, _element_size(init.data_type))
        bytes_by_type[init.data_type] = bytes_by_type.get(init.data_type, 0) + math.prod(shape) * _element_size(init.data_type)
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            tensor = node.attribute[0].t
            weights[node.output[0]] = (tuple(int(d) for d in tensor.dims), _element_size(tensor.data_type))
    symbolic = [dim.dim_value if dim.HasField("dim_value") else (dim.dim_param or f"unknown_{axis}")
                for axis, dim in enumerate(dims)]
    main_type = max(bytes_by_type, key=bytes_by_type.get) if bytes_by_type else image.type.tensor_type.elem_type
    initializers = {init.name: init for init in graph.initializer}
    # MLAS's symmetric convolutions take int8 weights with zero points of 0, on x86 only (its ARM64 build sends 1x1 and
    # narrow convolutions to the GEMM): elsewhere every int8 convolution is counted on the GEMM, the larger buffers.
    symmetric = frozenset(
        node.output[0] for node in graph.node
        if X86 and node.op_type == "DequantizeLinear" and node.input[0] in initializers
        and initializers[node.input[0]].data_type == TensorProto.INT8
        and (len(node.input) < 3 or node.input[2] in initializers
             and not numpy_helper.to_array(initializers[node.input[2]]).any()))
    return Skeleton(graph_skeleton(model, input_shape=symbolic), image.name, weights, _dtype_name(main_type),
                    layout, channels, symmetric)


@functools.lru_cache(maxsize=16)
def _skeleton_from_path(path: str, mtime_ns: int, layout: int | None) -> Skeleton:
    try:
        model = onnx.load(path, load_external_data=False)
    except DecodeError as error:
        raise ProfileError(f"{path!r} is not an ONNX model: {error}") from error
    return _skeleton(model, layout)


def load_skeleton(model: onnx.ModelProto | str | Skeleton, *, layout: int | None = None) -> Skeleton:
    """What the profile of `model` needs, without its large weights (a path is cached by mtime).

    `layout` (a Layout value) is for graphs without a model card, e.g. one a server builds at load
    time around the converted net; a converted graph's card says it."""
    if isinstance(model, Skeleton):
        return model
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        try:
            mtime_ns = os.stat(path).st_mtime_ns
        except OSError as error:
            raise ProfileError(f"cannot read an ONNX model from {path!r}: {error}") from error
        return _skeleton_from_path(os.path.abspath(path), mtime_ns, layout)
    return _skeleton(model, layout)


def _resolve_shapes(skeleton: Skeleton, *, height: int, width: int, batch: int) -> dict[str, tuple[tuple[int, ...], int]]:
    """name -> (static shape, elem_type) of every tensor, for this input size."""
    model = onnx.ModelProto()
    model.CopyFrom(skeleton.model)
    image = model.graph.input[0]
    dims = image.type.tensor_type.shape.dim
    shape = batch_shape(skeleton.layout, batch=batch, channels=skeleton.channels, height=height, width=width)
    for dim, value in zip(dims, shape):
        dim.Clear()
        dim.dim_value = value
    try:
        inferred = shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    except Exception as error:  # onnx raises InferenceError (and others) with a useful message
        raise ProfileError(f"shape inference failed for input {'x'.join(map(str, shape))} "
                           f"({label(Layout, skeleton.layout)}): "
                           f"{str(error).strip().splitlines()[-1]}") from error
    shapes: dict[str, tuple[tuple[int, ...], int]] = {}
    for value in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        tensor_type = value.type.tensor_type
        if not tensor_type.HasField("shape"):
            continue
        resolved = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tensor_type.shape.dim)
        shapes[value.name] = (resolved, tensor_type.elem_type)
    for init in inferred.graph.initializer:
        shapes[init.name] = (tuple(int(d) for d in init.dims), init.data_type)
    return shapes


def _macs(node: onnx.NodeProto, shapes: dict, out_shape: tuple[int, ...]) -> int:
    if node.op_type == "Conv":
        weight_shape = shapes[node.input[1]][0]
        # Each output element takes (C_in / groups) * kh * kw multiply-accumulates.
        return math.prod(out_shape) * math.prod(weight_shape[1:])
    if node.op_type in ("Gemm", "MatMul"):
        a_shape = shapes[node.input[0]][0]
        trans_a = any(a.name == "transA" and a.i for a in node.attribute)
        inner = a_shape[-2] if (node.op_type == "Gemm" and trans_a) else a_shape[-1]
        return math.prod(out_shape) * inner
    return 0


def profile_model(model: onnx.ModelProto | str | Skeleton, *, height: int, width: int, batch: int = 1,
                  device: Device = Device.CPU) -> Profile:
    """Per-layer table and predicted peak memory of one session running batch images of height x width
    on `device` (convert.memory_model's terms for that execution provider)."""
    for name, value in (("height", height), ("width", width), ("batch", batch)):
        if not isinstance(value, int) or value <= 0:
            raise ProfileError(f"{name} must be a positive integer, got {value!r}")
    return _profile(load_skeleton(model), height, width, batch, device)


def _profile(skeleton: Skeleton, height: int, width: int, batch: int, device: Device = Device.CPU) -> Profile:
    graph = skeleton.model.graph
    shapes = _resolve_shapes(skeleton, height=height, width=width, batch=batch)
    weights = skeleton.weights

    def size_of(name: str) -> tuple[tuple[int, ...], int, int]:
        """(shape, element count, bytes) of an activation tensor."""
        if name not in shapes:
            raise ProfileError(f"shape inference gave no shape for tensor {name!r}")
        shape, elem_type = shapes[name]
        if any(d <= 0 for d in shape):
            raise ProfileError(f"tensor {name!r} has shape {shape} at input {height}x{width}: the input is "
                               "too small for this graph, or a dimension could not be inferred")
        count = math.prod(shape)
        return shape, count, count * _element_size(elem_type)

    end = len(graph.node)
    # The index of the last node reading each tensor; graph outputs are read "after the end".
    last_read: dict[str, int] = {}
    for index, node in enumerate(graph.node):
        for name in node.input:
            last_read[name] = index
    for output in graph.output:
        last_read[output.name] = end

    # A QDQ (int8) graph as onnxruntime runs it: an op whose every data input is dequantized is fused with its
    # QuantizeLinear/DequantizeLinear pairs into an integer kernel, so if only a QuantizeLinear reads its output it
    # writes the quantized bytes itself; a DequantizeLinear of an activation that only such ops read writes nothing
    # new (one a float layer reads writes its float tensor); a QuantizeLinear writes nothing new; and a
    # DequantizeLinear of a weight is part of the weights.
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    weight_copies: set[str] = set()
    dequantized: set[str] = set()
    for node in graph.node:
        if node.op_type == "DequantizeLinear":
            (weight_copies if node.input[0] in weights else dequantized).add(node.output[0])

    def fused(node: onnx.NodeProto) -> bool:
        data = [name for name in node.input if name and name not in weights and name not in weight_copies]
        float_weights = node.op_type in WEIGHTED_OPS and len(node.input) > 1 and node.input[1] not in weight_copies
        return node.op_type not in QDQ_OPS and bool(data) and all(name in dequantized for name in data) and not float_weights

    outputs = {value.name for value in graph.output}
    quantized_as = {name: readers[name][0].output[0] for node in graph.node if fused(node) for name in node.output
                    if name and readers.get(name) and name not in outputs
                    and all(reader.op_type == "QuantizeLinear" for reader in readers[name])}
    float_dequantized = {name for name in dequantized if not all(fused(reader) for reader in readers.get(name, ()))}

    def scratch_of(node: onnx.NodeProto) -> int:
        """Bytes a fused int8 convolution (one whose output is quantized_as) allocates beside its input and output."""
        if node.op_type != "Conv" or node.output[0] not in quantized_as:
            return 0
        return _int8_scratch(node, shapes[node.input[1]][0], shapes[node.output[0]][0],
                             symmetric=node.input[1] in skeleton.symmetric_weights)

    def size_of(name: str, _size_of=size_of) -> tuple[tuple[int, ...], int, int]:
        shape, count, nbytes = _size_of(name)
        return (shape, count, count * _element_size(shapes[quantized_as[name]][1])) if name in quantized_as else (
            shape, count, nbytes)

    image = skeleton.image_input
    _, input_activations, input_bytes = size_of(image)
    # Buffers: activation tensors map to buffers; aliasing tensors share one, which dies with the last.
    buffer_of: dict[str, int] = {image: 0}
    buffer_bytes: list[int] = [input_bytes]
    buffer_death: list[int] = [end]  # the caller owns the input until the run returns
    live = {0}
    live_bytes = input_bytes
    peak_bytes, peak_layer = live_bytes, image
    naive_bytes = input_bytes
    layers: list[Layer] = []
    for index, node in enumerate(graph.node):
        if node.op_type == "Constant" or node.output[0] in weight_copies:
            continue
        params = sum(math.prod(weights[name][0]) for name in node.input if name in weights)
        first_shape: tuple[int, ...] = ()
        new_activations = new_bytes = 0
        for position, name in enumerate(node.output):
            if not name:
                continue
            shape, count, nbytes = size_of(name)
            if position == 0:
                first_shape = shape
            target = None if name in float_dequantized else _reused_buffer(node, position, nbytes, index, buffer_of,
                                                                           buffer_bytes, buffer_death)
            death = last_read.get(name, index)
            if target is None:
                target = len(buffer_bytes)
                buffer_bytes.append(nbytes)
                buffer_death.append(death)
                live.add(target)
                live_bytes += nbytes
                new_activations += count
                new_bytes += nbytes
            else:
                buffer_death[target] = max(buffer_death[target], death)
            buffer_of[name] = target
        naive_bytes += new_bytes
        name = node.name or f"{node.op_type}_{index}"
        layers.append(Layer(name, node.op_type, first_shape, new_activations, params,
                            _macs(node, shapes, first_shape), new_bytes))
        running = live_bytes + scratch_of(node)
        if running > peak_bytes:
            peak_bytes, peak_layer = running, name
        for buffer in [b for b in live if buffer_death[b] <= index]:
            live.discard(buffer)
            live_bytes -= buffer_bytes[buffer]

    weights_bytes = sum(math.prod(shape) * size for shape, size in weights.values())
    integer_inputs = {node.input[1] for node in graph.node if node.op_type == "MatMulInteger"} | {
        node.input[0] for node in graph.node if node.op_type == "DequantizeLinear" and node.output[0] in weight_copies}
    packed_bytes = sum(math.prod(weights[name][0]) * weights[name][1] for name in integer_inputs
                       if name in weights and weights[name][1] == 1)
    return Profile(
        height=height, width=width, batch=batch, dtype=skeleton.dtype, layers=tuple(layers),
        input_activations=input_activations, input_bytes=input_bytes, weights_bytes=weights_bytes,
        naive_activation_bytes=naive_bytes, peak_activation_bytes=peak_bytes, peak_layer=peak_layer,
        terms=predict(device, weights_bytes=weights_bytes, peak_activation_bytes=peak_bytes, packed_bytes=packed_bytes),
    )


def _int8_scratch(node: onnx.NodeProto, weight_shape: tuple[int, ...], output_shape: tuple[int, ...], *,
                  symmetric: bool) -> int:
    """What onnxruntime's QLinearConv (channels last) allocates for a run beside its input and output
    (onnxruntime/core/providers/cpu/quantization/qlinearconv.cc, 1.31), counted for every image of the batch: its
    source sizes them for one image, but a run's resident set grew as if each image had its own (measured alone, a
    symmetric 3x3 convolution over 48 channels at 320x320: 40 MiB at batch 1, 164 at batch 4). On its symmetric path
    (weights' zero point 0, and channels MLAS's x86 kernels take: SYMMETRIC_*) a pointer per kernel tap and output
    pixel, none for a pointwise convolution; else int32 sums of its output and, unless pointwise, the im2col of its
    input (a depthwise one: the pointers)."""
    outputs, group_inputs, *kernel = weight_shape
    group = next((attribute.i for attribute in node.attribute if attribute.name == "group"), 1)
    lists = {attribute.name: list(attribute.ints) for attribute in node.attribute}
    taps, pixels = math.prod(kernel), output_shape[0] * math.prod(output_shape[2:])
    pointwise = taps == 1 and not any(lists.get("pads", ())) and all(step == 1 for step in lists.get("strides", ()))
    depthwise = group > 1 and group_inputs == 1 and outputs == group
    pointers = POINTER_BYTES * taps * pixels
    if symmetric and (group % SYMMETRIC_GROUP_ALIGN == 0 if depthwise else
                      group == 1 and group_inputs % SYMMETRIC_INPUT_ALIGN == 0 and outputs >= SYMMETRIC_MIN_OUTPUTS
                      and outputs % SYMMETRIC_OUTPUT_ALIGN == 0):
        return 0 if pointwise and not depthwise else pointers
    sums = INT32_BYTES * outputs * pixels
    if depthwise:
        return sums + pointers
    return sums if pointwise else sums + group_inputs * taps * pixels


def _reused_buffer(node: onnx.NodeProto, position: int, nbytes: int, index: int, buffer_of: dict[str, int],
                   buffer_bytes: list[int], buffer_death: list[int]) -> int | None:
    """The input buffer this output may live in, or None when it needs a new one."""
    if position != 0:
        return None
    if node.op_type in VIEW_OPS or node.op_type in QDQ_OPS:
        return buffer_of.get(node.input[0]) if node.input else None
    if node.op_type not in IN_PLACE_OPS:
        return None
    for name in node.input:
        buffer = buffer_of.get(name)
        # The image input belongs to the caller (buffer 0): never overwritten.
        if buffer not in (None, 0) and buffer_death[buffer] == index and buffer_bytes[buffer] == nbytes:
            return buffer
    return None


def _fits(skeleton: Skeleton, height: int, width: int, batch: int, budget_bytes: int, device: Device,
          runs: int = 1) -> bool:
    return _profile(skeleton, height, width, batch, device).terms.running(runs) <= budget_bytes


def largest_batch(model: onnx.ModelProto | str | Skeleton, *, height: int, width: int, budget_bytes: int,
                  device: Device = Device.CPU, runs: int = 1) -> int:
    """The largest batch (up to MAX_BATCH) whose predicted peak fits the budget, with `runs` such batches running
    at once (MemoryTerms.running); 0 if none does."""
    skeleton = load_skeleton(model)
    one = _profile(skeleton, height, width, 1, device)
    if one.terms.running(runs) > budget_bytes:
        return 0
    two = _profile(skeleton, height, width, 2, device)
    low, high = 1, MAX_BATCH + 1  # low fits, high does not (or is past the end)
    if two.peak_activation_bytes == 2 * one.peak_activation_bytes and two.weights_bytes == one.weights_bytes:
        # Activations scale with the batch (every buffer is per image): solve for it, then check
        # the answer and its successor, so the search below starts from a two-wide bracket.
        per_image = one.terms.activations
        room = budget_bytes - one.terms.fixed
        guess = max(1, min(MAX_BATCH, int(room // per_image) if per_image else MAX_BATCH))
        if _fits(skeleton, height, width, guess, budget_bytes, device, runs):
            low = guess
            if guess == MAX_BATCH or not _fits(skeleton, height, width, guess + 1, budget_bytes, device, runs):
                return guess
        else:
            high = guess
    while high - low > 1:
        middle = (low + high) // 2
        if _fits(skeleton, height, width, middle, budget_bytes, device, runs):
            low = middle
        else:
            high = middle
    return low


def largest_square_size(model: onnx.ModelProto | str | Skeleton, *, budget_bytes: int, batch: int = 1, multiple: int = 32,
                        device: Device = Device.CPU) -> int:
    """The largest side (a multiple of `multiple`, up to MAX_SIDE) whose square input fits; 0 if none."""
    if multiple <= 0:
        raise ProfileError(f"multiple must be a positive integer, got {multiple!r}")
    skeleton = load_skeleton(model)
    steps = MAX_SIDE // multiple
    # Small sizes may be invalid (kernels larger than the feature map): start at the first valid one.
    first = None
    for step in range(1, steps + 1):
        side = step * multiple
        try:
            profile = _profile(skeleton, side, side, batch, device)
        except ProfileError:
            continue
        first = step
        break
    if first is None:
        raise ProfileError(f"no square input size up to {MAX_SIDE} px can be profiled for this graph")
    if profile.predicted_peak_bytes > budget_bytes:
        return 0
    low, high = first, steps + 1  # low fits, high does not (or is past the end)
    while high - low > 1:
        middle = (low + high) // 2
        if _fits(skeleton, middle * multiple, middle * multiple, batch, budget_bytes, device):
            low = middle
        else:
            high = middle
    return low * multiple
