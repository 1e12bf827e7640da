"""The graph a plan runs: pre-processing, shifted passes, the converted net and post-processing on the device.

Built at load time from the converted net and its model card: the host uploads
one uint8 canvas per image and gets back only the lattice and the image-level probabilities.
Every dimension is fixed, so an onnxruntime session built on it only ever sees one input shape
(a CUDA session re-plans its convolutions, 0.35-0.8 s, at every change of shape).

    pixels uint8 [B, H, W, 3] RGB  --cast, channel order, (x*scale - mean)/std, dtype, layout-->
    passes [B*P, ...] (pass p of image b at b*P + p: the canvas shifted down dy, right dx, 0-filled)
    --net--> [B*P, K, h, w] --DepthToSpace--> lattice float32 [B, K, f*h, f*w]
    passes' scores, valid float32 [B, f*h, f*w] --softmax (logits), masked mean--> probabilities [B, K]

A pass shifted by (dy, dx) sees the whole image moved into the canvas padding, which after
normalisation is 0 (the mean colour): no pixel of the photo is lost and none is smeared
(docs/design.md: shifted passes on a mean-colour canvas). Pass (dy, dx) fills lattice cells (f*i + f-1 - dy/s, f*j + f-1 - dx/s), so cell
(m, n) is centred at canvas pixel (c_y - (f-1)*s + s*m, c_x - (f-1)*s + s*n).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, compose, helper, numpy_helper, shape_inference, version_converter

from convert.card import ImageInput, ModelCard, batch_shape, is_logits

__all__ = [
    "PIXELS", "VALID", "LATTICE", "PROBABILITIES", "LATTICE_FP16", "MIN_OPSET", "MAX_IR_VERSION",
    "DeviceGraphError", "build_plan_graph", "lattice_cells", "scores_shape",
]

PIXELS = "pixels"
VALID = "valid"
LATTICE = "lattice"
PROBABILITIES = "probabilities"
LATTICE_FP16 = "lattice_fp16"
MIN_OPSET = 13  # ReduceSum, Unsqueeze, Split take their axes as inputs; Softmax acts on one axis
MAX_IR_VERSION = 13  # the newest onnxruntime 1.31 loads
NET_PREFIX = "net/"
OWN_PREFIX = "plan/"
SHAPE_TENSOR_ELEMENTS = 64  # initializers up to this size stay in shape inference's probe (Reshape shapes)


class DeviceGraphError(ValueError):
    """The net, its card or the plan's shape cannot make a plan graph; the message says why."""


class _Builder:
    """Nodes and initializers of the wrapper, every name under OWN_PREFIX."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count = 0

    def const(self, value: np.ndarray | list | float, dtype=np.float32) -> str:
        name = f"{OWN_PREFIX}c{len(self.initializers)}"
        self.initializers.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def ints(self, values) -> str:
        return self.const(list(values), np.int64)

    def op(self, op_type: str, inputs: list[str], *, output: str | None = None, outputs: int = 0, **attributes):
        """Append a node; its output name (a list of `outputs` names when that is given)."""
        self._count += 1
        name = f"{OWN_PREFIX}{op_type.lower()}{self._count}"
        names = [f"{name}_{i}" for i in range(outputs)] if outputs else [output or name]
        self.nodes.append(helper.make_node(op_type, inputs, names, name=name, **attributes))
        return names if outputs else names[0]


def _lattice_slots(offsets, *, factor: int, stride: int) -> list[int | None]:
    """For each sub-cell (a, c) of a lattice block, row-major, the index of the pass that fills it."""
    slots: list[int | None] = [None] * factor**2
    steps = [k * stride for k in range(factor)]
    for index, (dy, dx) in enumerate(offsets):
        if dy not in steps or dx not in steps:
            raise DeviceGraphError(
                f"offset {(dy, dx)} is not a multiple of the lattice stride {stride} in [0, {(factor - 1) * stride}] "
                f"(factor {factor}); passes shift by k*stride for k < factor, e.g. {((0, 0), (stride, stride))}"
            )
        slot = (factor - 1 - dy // stride) * factor + (factor - 1 - dx // stride)
        if slots[slot] is not None:
            raise DeviceGraphError(f"offset {(dy, dx)} is given twice in {offsets}; give each pass once")
        slots[slot] = index
    return slots


def _net_at_opset(net: onnx.ModelProto) -> onnx.ModelProto:
    """The net at MIN_OPSET or later (the wrapper's ops take their axes as inputs)."""
    opset = next((o.version for o in net.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None:
        raise DeviceGraphError("the net imports no default-domain ONNX opset; it is not a converted scoremap graph")
    if opset < MIN_OPSET:
        try:
            return version_converter.convert_version(net, MIN_OPSET)
        except Exception as error:  # the converter raises assorted types for ops it cannot move
            raise DeviceGraphError(
                f"the net uses opset {opset} and could not be upgraded to {MIN_OPSET}: {error}; "
                f"re-export it at opset >= {MIN_OPSET}"
            ) from error
    return net


def scores_shape(net: onnx.ModelProto, *, input_name: str, scores_name: str,
                 input_shape: list[int]) -> tuple[list[int], int]:
    """The net's scores shape [N, K, h, w] and ONNX element type when its input has the fixed `input_shape`."""
    # A probe without the weights: their shapes suffice, only small tensors (shapes) need values.
    probe = onnx.ModelProto(ir_version=net.ir_version, opset_import=net.opset_import, functions=net.functions)
    weights = {tensor.name for tensor in net.graph.initializer}
    probe.graph.node.extend(net.graph.node)
    probe.graph.input.extend(value for value in net.graph.input if value.name not in weights)
    for tensor in net.graph.initializer:
        if int(np.prod(tensor.dims)) <= SHAPE_TENSOR_ELEMENTS:
            probe.graph.initializer.append(tensor)
        else:
            probe.graph.input.append(helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
    probe.graph.output.extend(net.graph.output)
    for value in probe.graph.output:
        value.type.tensor_type.ClearField("shape")
    for value in probe.graph.input:
        if value.name == input_name:
            dims = value.type.tensor_type.shape.dim
            if len(dims) != len(input_shape):
                raise DeviceGraphError(f"the net's input {input_name!r} has {len(dims)} dims; expected {len(input_shape)}")
            for dim, size in zip(dims, input_shape):
                dim.Clear()
                dim.dim_value = size
    try:
        inferred = shape_inference.infer_shapes(probe, strict_mode=True, data_prop=True)
    except Exception as error:  # onnx raises InferenceError, ValidationError or RuntimeError
        raise DeviceGraphError(f"shape inference of the net at input {input_shape} failed: {error}") from error
    for value in list(inferred.graph.output) + list(inferred.graph.value_info):
        if value.name == scores_name:
            tensor_type = value.type.tensor_type
            dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]
            if len(dims) != 4 or None in dims:
                raise DeviceGraphError(
                    f"the net's scores {scores_name!r} have shape {dims} at input {input_shape}; expected a fixed "
                    "[N, K, h, w] (convert the classifier with `scoremap-convert`)"
                )
            return dims, tensor_type.elem_type
    raise DeviceGraphError(f"the net has no output {scores_name!r} (the card's scores_name)")


def _preprocess(b: _Builder, image: ImageInput, *, width: int, on_gpu: bool) -> str:
    """uint8 RGB channels-last pixels as the net's input values in float32, in its layout and channel
    order (the cast to its dtype comes after the passes' padding, `_passes`).

    (x * pixel_scale - mean) / std runs as x * a + b per channel, a = pixel_scale / std and b = -mean / std
    (within a few float32 ulps of the host's convert.preprocessing.normalize): on NCHW one
    BatchNormalization, one pass over the canvas where onnxruntime's CPU Sub and Div took two (0.28 against
    0.58 ms at 384x576). On NHWC a Mul and an Add by [1, 1, W, 3] rows, so the broadcast runs over long
    contiguous spans (by a [3] constant onnxruntime's CPU took 15-18 ms each). A CPU plan on NCHW whose mean
    is a whole pixel value in each channel (the default model's 127; 0 for `unit`) casts and normalises in
    one DequantizeLinear, (x - mean / pixel_scale) * a: 0.22 against 0.43 ms for Cast and BatchNormalization at
    384x576 on one thread (2026-11-28). GPU plans keep BatchNormalization: DequantizeLinear's CUDA kernel
    for a per-channel scale is not measured (no GPU lent since)."""
    x = PIXELS
    axis = image.channel_axis
    if axis == 1:
        x = b.op("Transpose", [x], perm=[0, 3, 1, 2])
    if image.bgr:
        x = b.op("Gather", [x, b.ints([2, 1, 0])], axis=axis)
    mean = np.broadcast_to(np.asarray(image.mean or 0.0, dtype=np.float32), 3)
    std = np.broadcast_to(np.asarray(image.std or 1.0, dtype=np.float32), 3)
    scale, shift = np.float32(image.pixel_scale) / std, -mean / std
    normalises = bool(np.any(scale != 1.0) or np.any(shift != 0.0))
    zero_point = mean.astype(np.float64) / image.pixel_scale  # the mean in pixel values
    whole_pixels = np.all((zero_point == np.round(zero_point)) & (zero_point >= 0) & (zero_point <= 255))
    if normalises and whole_pixels and axis == 1 and not on_gpu:
        x = b.op("DequantizeLinear", [x, b.const(scale), b.const(zero_point, dtype=np.uint8)], axis=1)
    else:
        x = b.op("Cast", [x], to=TensorProto.FLOAT)
        if normalises and axis == 1:
            # y = (x - 0) / sqrt(var + eps) * scale + shift, with var + eps exactly 1 (eps a power of two at or
            # above cuDNN's smallest, which onnxruntime's CUDA kernel clamps to)
            epsilon = 2.0**-16
            x = b.op("BatchNormalization", [x, b.const(scale), b.const(shift), b.const(np.zeros(3)),
                                            b.const(np.full(3, 1.0 - epsilon))], epsilon=epsilon)
        elif normalises:
            x = b.op("Add", [b.op("Mul", [x, b.const(np.tile(scale, (1, 1, width, 1)))]),
                             b.const(np.tile(shift, (1, 1, width, 1)))])
    if image.dtype == np.uint8:
        x = b.op("Round", [b.op("Clip", [x, b.const(0.0), b.const(255.0)])])
    return x


def _passes(b: _Builder, image: str, offsets, *, dtype: np.dtype, spatial: tuple[int, int], shape: list[int],
            output: str, zero_point: int | None = None) -> None:
    """Each pass the float32 `image` moved down dy and right dx in its canvas, 0-filled, as the net's
    `dtype`; pass p of image b at b*P + p. With `zero_point`, `image` is already the net's quantized uint8
    input, filled with its zero point (the value that dequantizes to 0).

    One Pad by the largest shift at the top and left, then each pass a window of it. The Pad runs in
    float32, before the cast to the net's dtype: onnxruntime's CUDA Pad has no uint8 kernel,
    and 0 is 0 in every dtype, so the values are the same."""
    top, left = max(dy for dy, _ in offsets), max(dx for _, dx in offsets)
    y, x = spatial
    padded = image
    if top or left:
        pads = [0] * 8
        pads[y], pads[x] = top, left
        fill = [] if zero_point is None else [b.const(zero_point, np.uint8)]
        padded = b.op("Pad", [image, b.ints(pads), *fill], mode="constant")
    if dtype != np.float32 and zero_point is None:
        padded = b.op("Cast", [padded], to=helper.np_dtype_to_tensor_dtype(dtype))
    shifted = []
    for dy, dx in offsets:
        moved = padded
        if top or left:  # pass (0, 0) too is a window of the padded (and cast) canvas
            moved = b.op("Slice", [padded, b.ints([top - dy, left - dx]),
                                   b.ints([top - dy + shape[y], left - dx + shape[x]]), b.ints(spatial)])
        shifted.append(b.op("Unsqueeze", [moved, b.ints([1])]))
    stacked = b.op("Concat", shifted, axis=1) if len(shifted) > 1 else shifted[0]
    b.op("Reshape", [stacked, b.ints([shape[0] * len(offsets), *shape[1:]])], output=output)


def _quantized_input(net: onnx.ModelProto, image: ImageInput) -> tuple[onnx.NodeProto, int] | None:
    """The net's QuantizeLinear of its image input and its zero point, when the uint8 canvas already is its output:
    the input's only reader, its scale pixel_scale / std and zero point mean / pixel_scale in every channel (an
    int8 graph quantized on the pixel grid, convert.quantize.input_grid); else None."""
    readers = [node for node in net.graph.node if image.name in node.input]
    if len(readers) != 1 or readers[0].op_type != "QuantizeLinear" or readers[0].input[0] != image.name:
        return None
    quantize = readers[0]
    constants = {tensor.name: numpy_helper.to_array(tensor) for tensor in net.graph.initializer}
    scale, zero_point = (constants.get(name) for name in (list(quantize.input) + [""])[1:3])
    if scale is None or zero_point is None or scale.size != 1 or zero_point.dtype != np.uint8 or image.dtype != np.float32:
        return None
    expected_scale = np.float32(image.pixel_scale) / np.asarray(image.std, np.float32)
    expected_zero = np.asarray(image.mean, np.float64) / image.pixel_scale
    if np.all(expected_scale == scale.reshape(-1)[0]) and np.all(expected_zero == float(zero_point.reshape(-1)[0])):
        return quantize, int(zero_point.reshape(-1)[0])
    return None


def _renameable(net: onnx.ModelProto, name: str) -> bool:
    """Whether a node of the net's top graph makes tensor `name` and no subgraph (If, Loop, Scan) exists that could
    read it by name: renaming it then renames every use."""
    made = any(name in node.output for node in net.graph.node)
    nested = any(attribute.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                 for node in net.graph.node for attribute in node.attribute)
    return made and not nested


def build_plan_graph(
    net: onnx.ModelProto,
    card: ModelCard,
    *,
    batch: int,
    height: int,
    width: int,
    offsets: tuple[tuple[int, int], ...],
    factor: int,
    stride: int,
    on_gpu: bool = True,
) -> onnx.ModelProto:
    """The plan graph for `batch` canvases of `height` x `width` pixels, scored by the passes `offsets`.

    `factor` 1: one pass (0, 0), the net's own lattice. `factor` 2: a stride-`stride` lattice from a
    stride-2*`stride` net; GRID offsets fill every cell, DIAGONAL ((0, 0), (s, s)) leaves the others NaN.
    Inputs `pixels` uint8 [batch, height, width, 3] and `valid` float32 [batch, HL, WL] (> 0: the cell
    counts in the image-level mean); outputs `lattice` float32 [batch, K, HL, WL] (the net's own
    scores, NaN where no pass looked), `probabilities` float32 [batch, K] (the mean over kept cells
    of the class probabilities, softmax applied when the card says logits; NaN when no cell is kept)
    and, `on_gpu`, `lattice_fp16` (half the bytes to copy back from a GPU; onnxruntime computes every output at
    every run, so a CPU plan, whose host casts the few cells it keeps, goes without). HL, WL = factor * the net's
    map size: read them with `lattice_cells`.
    """
    if min(batch, height, width, factor, stride) < 1:
        raise DeviceGraphError(
            f"batch {batch}, height {height}, width {width}, factor {factor} and stride {stride} must all be >= 1"
        )
    if not offsets:
        raise DeviceGraphError("no pass offsets given; a plan runs at least the pass (0, 0)")
    slots = _lattice_slots(offsets, factor=factor, stride=stride)
    ordered = tuple(offsets[slot] for slot in slots if slot is not None)  # the passes in lattice order
    passes = len(ordered)
    image = ImageInput.of(card)
    logits = is_logits(card)
    net = _net_at_opset(net)
    names = {value.name for value in net.graph.input}
    if image.name not in names:
        raise DeviceGraphError(f"the net has no input {image.name!r} (the card's input_name); its inputs: {sorted(names)}")
    pass_shape = batch_shape(image.layout, batch=batch, channels=3, height=height, width=width)
    (_, classes, h, w), scores_type = scores_shape(net, input_name=image.name, scores_name=card.scores_name,
                                                    input_shape=[batch * passes, *pass_shape[1:]])
    cells = [batch, classes, factor * h, factor * w]

    b = _Builder()
    # An int8 net quantized on the pixel grid takes the canvas as it is: its QuantizeLinear goes (CPU plans; a GPU
    # does not run int8 graphs, server.engine.client.EngineFacts.int8_refusal).
    quantized = None if on_gpu else _quantized_input(net, image)
    if quantized is not None:
        canvas = b.op("Transpose", [PIXELS], perm=[0, 3, 1, 2]) if image.channel_axis == 1 else PIXELS
        if image.bgr:
            canvas = b.op("Gather", [canvas, b.ints([2, 1, 0])], axis=image.channel_axis)
        _passes(b, canvas, ordered, dtype=np.dtype(np.uint8), spatial=image.spatial_axes, shape=pass_shape,
                output=NET_PREFIX + quantized[0].output[0], zero_point=quantized[1])
    else:
        _passes(b, _preprocess(b, image, width=width, on_gpu=on_gpu), ordered, dtype=image.dtype,
                spatial=image.spatial_axes, shape=pass_shape, output=NET_PREFIX + image.name)
    before_net = len(b.nodes)

    # At factor 1 the net's float32 scores are the lattice: the node making them writes the output itself (no copy),
    # when a node of the net's own graph makes them and no subgraph reads them by name.
    renamed = factor == 1 and scores_type == TensorProto.FLOAT and _renameable(net, card.scores_name)
    scores = LATTICE if renamed else NET_PREFIX + card.scores_name
    if scores_type != TensorProto.FLOAT:
        scores = b.op("Cast", [scores], to=TensorProto.FLOAT, output=LATTICE if factor == 1 else None)
    if factor == 1:
        lattice = LATTICE
        if scores != LATTICE:
            b.op("Identity", [scores], output=LATTICE)
    else:
        # [B*P, K, h, w] -> [B, P*K, h, w]: the passes of an image side by side on the channel axis.
        by_image = b.op("Reshape", [scores, b.ints([batch, passes * classes, h, w])])
        if passes < factor**2:
            parts = iter(b.op("Split", [by_image, b.ints([classes] * passes)], axis=1, outputs=passes))
            hole = b.op("ConstantOfShape", [b.ints([batch, classes, h, w])],
                        value=helper.make_tensor("nan", TensorProto.FLOAT, [1], [np.nan]))
            by_image = b.op("Concat", [hole if slot is None else next(parts) for slot in slots], axis=1)
        # [B, f*f*K, h, w] -> [B, K, f*h, f*w]: cell (f*i + a, f*j + c) from the pass in slot a*f + c.
        lattice = b.op("DepthToSpace", [by_image], output=LATTICE, blocksize=factor, mode="DCR")
    if on_gpu:
        b.op("Cast", [lattice], output=LATTICE_FP16, to=TensorProto.FLOAT16)

    # The image-level mean straight from the passes' scores [B*P, K, h, w], with `valid` taken back
    # to each pass's cells: no NaN holes to step around, nothing computed twice. Classes go last:
    # onnxruntime's CPU Softmax on axis 1 took 6-8x as long as a Transpose plus Softmax on the last
    # axis (3.2 vs 0.54 ms at 1000 x 12 x 18).
    probabilities = b.op("Transpose", [scores], perm=[0, 2, 3, 1])
    if logits:
        probabilities = b.op("Softmax", [probabilities], axis=-1)
    valid = VALID
    if factor > 1:  # [B, f*h, f*w] -> [B, f*f, h, w], slot a*f + c holding cells (f*i + a, f*j + c)
        valid = b.op("Reshape", [valid, b.ints([batch, h, factor, w, factor])])
        valid = b.op("Reshape", [b.op("Transpose", [valid], perm=[0, 2, 4, 1, 3]), b.ints([batch, factor**2, h, w])])
        if passes < factor**2:
            valid = b.op("Gather", [valid, b.ints([slot for slot, index in enumerate(slots) if index is not None])],
                         axis=1)
    # A 0/1 weight per cell, Cast from the comparison (Mul broadcasts it along the classes faster than Where on the
    # CPU; the passes' scores hold no NaN, unlike the lattice's holes). On the CPU the weighted sum over an image's
    # cells is one product [1, cells] x [cells, K] (Mul and ReduceSum took 0.15 ms at 216 x 1000, the MatMul a
    # tenth); on a GPU they stay, since onnxruntime's CUDA MatMul runs in TF32 (10-bit mantissas).
    cells_of_image = passes * h * w
    keep = b.op("Cast", [b.op("Greater", [b.op("Reshape", [valid, b.ints([batch, 1, cells_of_image])]),
                                          b.const(0.0)])], to=TensorProto.FLOAT)
    probabilities = b.op("Reshape", [probabilities, b.ints([batch, cells_of_image, classes])])
    if on_gpu:
        weights = b.op("Reshape", [keep, b.ints([batch, cells_of_image, 1])])
        total = b.op("ReduceSum", [b.op("Mul", [probabilities, weights]), b.ints([1])], keepdims=0)
    else:
        total = b.op("Reshape", [b.op("MatMul", [keep, probabilities]), b.ints([batch, classes])])
    b.op("Div", [total, b.op("ReduceSum", [keep, b.ints([2])], keepdims=0)], output=PROBABILITIES)  # [B, K] / [B, 1]

    # One copy of the net (its weights included), renamed under NET_PREFIX and wrapped in place.
    plan = onnx.ModelProto()
    plan.CopyFrom(net)
    compose.add_prefix(plan, NET_PREFIX, inplace=True)
    graph = plan.graph
    net_nodes = [node for node in graph.node
                 if quantized is None or list(node.output) != [NET_PREFIX + name for name in quantized[0].output]]
    graph.ClearField("node")
    if renamed:
        for node in net_nodes:
            for names in (node.input, node.output):
                names[:] = [LATTICE if name == NET_PREFIX + card.scores_name else name for name in names]
    graph.node.extend(b.nodes[:before_net] + net_nodes + b.nodes[before_net:])
    graph.initializer.extend(b.initializers)
    for field in ("input", "output", "value_info"):  # the net's symbolic N, H, W go with its value infos
        graph.ClearField(field)
    graph.input.extend([helper.make_tensor_value_info(PIXELS, TensorProto.UINT8, [batch, height, width, 3]),
                        helper.make_tensor_value_info(VALID, TensorProto.FLOAT, [batch, *cells[2:]])])
    graph.output.extend([helper.make_tensor_value_info(LATTICE, TensorProto.FLOAT, cells),
                         helper.make_tensor_value_info(PROBABILITIES, TensorProto.FLOAT, [batch, classes])])
    if on_gpu:
        graph.output.append(helper.make_tensor_value_info(LATTICE_FP16, TensorProto.FLOAT16, cells))
    graph.name = f"{card.name or net.graph.name}-plan-b{batch}-{height}x{width}-p{passes}"
    plan.ClearField("metadata_props")  # the card describes the net's input and output, not these
    plan.ir_version = min(max(net.ir_version, 7), MAX_IR_VERSION)
    plan.producer_name = "scoremap.device_graph"
    return plan


def lattice_cells(plan: onnx.ModelProto) -> tuple[int, int]:
    """(HL, WL): the lattice size of a plan graph, from its `valid` input."""
    for value in plan.graph.input:
        if value.name == VALID:
            dims = value.type.tensor_type.shape.dim
            return dims[1].dim_value, dims[2].dim_value
    raise DeviceGraphError(f"this graph has no input {VALID!r}; it was not made by build_plan_graph")
