"""convert_classifier: source → ONNX → normalisation → surgery → (à trous) → verification → model card.

The passes share one IR and one convention, onnx-graphsurgeon's: a pass takes an onnx_ir
`ir.Model`, edits it in place and returns it, so the steps read as a chain
(`atrous(fully_convolutional(canonical(model, ...), head), ...)`). Editing in place, not copying:
a classifier's weights are most of its size (VGG's are 0.5 GB), onnx_ir's own passes edit in place,
and the one copy is made where the source is read, so the caller's proto is never touched. What a
pass needs to know first is read by functions that only read and return values (`find_head`,
`receptive_fields`); a pass that refuses raises ConversionError, and the half-edited model is
dropped with the conversion. ONNX protos appear only at the
edges: the source and onnx's version converter (`runnable`, which never edits the caller's proto)
on the way in; onnxruntime (verification), the model card and the returned `onnx.ModelProto` on the
way out. convert.precision works on such a finished proto and returns a second one, since its
check compares the two.
"""

from __future__ import annotations

import logging

import onnx
import onnx_ir as ir

from convert.arguments import DEFAULT_OUTPUT_STRIDE, SUPPORTED_OUTPUT_STRIDES
from convert.atrous import atrous
from convert.card import (
    ChannelOrder,
    InputDtype,
    Layout,
    ModelCard,
    Precision,
    ReceptiveField,
    batch_shape,
    channel_axis,
    spatial_axes,
    write_card,
)
from convert.errors import ConversionError, UsageError
from convert.graph import input_dims, opset, real_inputs
from convert.normalize import canonical, reference, runnable
from convert.presets import PRESETS
from convert.receptive_field import output_field
from convert.sources import load_source
from convert.surgery import SCORES, find_head, fully_convolutional
from convert.verify import verify
from protos.model_card_pb2 import Preprocessing

log = logging.getLogger(__name__)

# default_scale for sources that do not say: the default model's 384/224, rounded to the stride.
DEFAULT_SCALE_RATIO = 384 / 224
ONNX_DTYPES = {onnx.TensorProto.FLOAT: InputDtype.INPUT_DTYPE_FLOAT32, onnx.TensorProto.FLOAT16: InputDtype.INPUT_DTYPE_FLOAT16,
               onnx.TensorProto.UINT8: InputDtype.INPUT_DTYPE_UINT8}


def convert_classifier(
    source: str | onnx.ModelProto | object,
    *,
    training_size: int | tuple[int, int] | None = None,
    output_stride: int = DEFAULT_OUTPUT_STRIDE,
    name: str | None = None,
    labels: list[str] | None = None,
    preprocessing: Preprocessing | None = None,
    state_dict: str | None = None,
    default_scale: int | None = None,
    size_multiple: int | None = None,
    require_preprocessing: bool = False,
) -> onnx.ModelProto:
    """The classifier `source` as a verified dense scorer with its model card; raises ConversionError.

    `output_stride` is the finest spacing of cells wanted: a net whose native stride is coarser
    gets the à trous rewrite (16 or 8), a net already finer keeps its own. `preprocessing` (see
    convert.presets; one mean or std value stands for every channel) is needed unless the source
    carries its own (the default model) or takes uint8 pixels: without it a float input gets raw
    0..255 values with a warning, or a UsageError with `require_preprocessing` (scoremap-convert).
    """
    if output_stride not in SUPPORTED_OUTPUT_STRIDES:
        raise UsageError(f"output stride {output_stride} is not supported; expected one of {SUPPORTED_OUTPUT_STRIDES}")
    size = None if training_size is None else (training_size, training_size) if isinstance(training_size, int) else tuple(training_size)
    loaded = load_source(source, training_size=size, state_dict=state_dict)
    upgraded = runnable(loaded.model)
    images = real_inputs(upgraded.graph)
    if len(images) != 1:
        raise ConversionError(f"expected a classifier with one image input, got {len(images)}: {[v.name for v in images]}")
    image = images[0]
    layout = detect_layout(image)
    size = resolve_training_size(image, layout=layout, given=size or loaded.training_size)
    dtype = ONNX_DTYPES.get(image.type.tensor_type.elem_type)
    if dtype is None:
        raise ConversionError(f"input {image.name!r} has element type {image.type.tensor_type.elem_type}; expected float32, float16 or uint8")
    channels = input_dims(image)[channel_axis(layout)]
    if not isinstance(channels, int) or channels <= 0:
        raise ConversionError(f"input {image.name!r} has a symbolic channel count {channels!r}; expected a fixed number of channels")
    prep = image_preprocessing(preprocessing or loaded.preprocessing, image=image, layout=layout, dtype=dtype,
                               channels=channels, required=require_preprocessing)
    batch_one = batch_shape(layout, batch=1, channels=channels, height=size[0], width=size[1])

    model = canonical(ir.from_proto(upgraded), input_shape=batch_one)
    head = find_head(model, training_size=size, layout=layout)
    names = labels or loaded.labels or [f"class_{k}" for k in range(head.num_classes)]
    if len(names) != head.num_classes:
        raise UsageError(f"got {len(names)} labels for a classifier with {head.num_classes} classes; expected one per class")
    model = fully_convolutional(model, head)
    native = output_field(model, input_shape=batch_one, layout=layout).jump[0]
    model = atrous(model, output_stride=output_stride, input_shape=batch_one, layout=layout)
    field = output_field(model, input_shape=batch_one, layout=layout)
    dense = ir.to_proto(model)
    compared = reference(loaded.model, upgraded)
    check = verify(compared, dense, preprocessing=prep, training_size=size, channels=channels)
    if compared is not loaded.model:
        check.reference += f" (the source upgraded to opset {opset(compared)}: onnxruntime does not run its own)"
    if not check.passed:
        raise ConversionError(
            f"verification failed: converted and original differ by {check.max_abs_diff:.3g} at the training size "
            f"(allowed {check.tolerance:.3g}); nothing written")
    stride = field.jump[0]
    card = ModelCard(
        name=name or loaded.name, labels=names, preprocessing=prep,
        training_height=size[0], training_width=size[1], output_stride=stride,
        receptive_field=ReceptiveField(size=max(field.size), center_y=field.start[0], center_x=field.start[1]),
        scores_name=SCORES, output_kind=head.output_kind, source=loaded.description, verification=check,
        precision=Precision.PRECISION_FP32, native_output_stride=native,
        default_scale=default_scale or loaded.default_scale or round_up(max(size) * DEFAULT_SCALE_RATIO, stride),
        size_multiple=size_multiple if size_multiple is not None else (loaded.size_multiple or 0),
    )
    log.info("converted %s: %d classes, stride %d, max abs diff %.3g", card.name, head.num_classes, stride, check.max_abs_diff)
    return write_card(dense, card)


def detect_layout(image: onnx.ValueInfoProto) -> int:
    """NCHW unless the last axis looks like channels (1, 3 or 4) and axis 1 does not."""
    dims = input_dims(image)
    if len(dims) != 4:
        raise ConversionError(f"input {image.name!r} has shape {dims}; expected an image batch [N, C, H, W] or [N, H, W, C]")
    channel_like = (1, 3, 4)
    if dims[3] in channel_like and dims[1] not in channel_like:
        return Layout.LAYOUT_NHWC
    if dims[1] in channel_like:
        return Layout.LAYOUT_NCHW
    raise ConversionError(f"input {image.name!r} has shape {dims}; cannot tell its channel axis (expected 1, 3 or 4 channels)")


def resolve_training_size(image: onnx.ValueInfoProto, *, layout: int, given: tuple[int, int] | None) -> tuple[int, int]:
    """The input's static H, W, or the given size when they are symbolic; a conflict is an error."""
    dims = input_dims(image)
    spatial = [dims[axis] for axis in spatial_axes(layout)]
    static = tuple(spatial) if all(isinstance(d, int) and d > 0 for d in spatial) else None
    if static and given and tuple(given) != static:
        raise UsageError(f"input {image.name!r} is fixed at {static[0]}x{static[1]} but training size {given[0]}x{given[1]} was given")
    if static:
        return static
    if given:
        return tuple(given)
    raise UsageError(f"input {image.name!r} has symbolic size {spatial}: cannot prove the training size; pass it (--training-size)")


def image_preprocessing(given: Preprocessing | None, *, image: onnx.ValueInfoProto, layout: int, dtype: int,
                        channels: int, required: bool) -> Preprocessing:
    """The card's preprocessing: the given one completed with the input's name, layout and dtype.

    Raw pixels into a net trained on normalised input score confidently and wrongly, so a float
    input with none given is refused when `required`, warned about otherwise. uint8 pixels take
    none (the graph normalises them itself)."""
    if given is None and dtype != InputDtype.INPUT_DTYPE_UINT8:
        problem = (f"input {image.name!r} takes floats, and the classifier does not say how pixels were normalised in "
                   f"training; choose a preprocessing: one of {sorted(PRESETS)} (--preprocessing NAME), or "
                   "--mean/--std/--pixel-scale (--preprocessing raw keeps 0..255)")
        if required:
            raise UsageError(problem)
        log.warning("%s; converting with raw 0..255 values", problem)
    prep = Preprocessing(channel_order=ChannelOrder.CHANNEL_ORDER_RGB, pixel_scale=1.0, resize_filter="bilinear")
    if given is not None:
        prep.MergeFrom(given)
    prep.input_name, prep.layout, prep.dtype = image.name, layout, dtype
    for field_name, neutral in (("mean", 0.0), ("std", 1.0)):
        values = list(getattr(prep, field_name)) or [neutral]
        if len(values) == 1:
            values *= channels
        if len(values) != channels:
            raise UsageError(f"preprocessing {field_name} has {len(values)} values {values}; the input has {channels} channels "
                             "(give one value per channel, or one for all)")
        prep.ClearField(field_name)
        getattr(prep, field_name).extend(values)
    return prep


def round_up(value: float, multiple: int) -> int:
    return int(-(-value // multiple) * multiple)
