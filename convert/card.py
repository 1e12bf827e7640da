"""The model card: read and write the ModelCard message stored in an ONNX file's metadata, and its Python view.

One schema (protos/model_card.proto), serialized as JSON so that tools such as Netron show it.
Layout, dtype, channel order, output kind and precision are enums there; `ImageInput` and the
helpers below are how code reads them, so no module compares strings or re-derives axes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from google.protobuf import json_format
from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper

from protos.model_card_pb2 import (
    ChannelOrder,
    InputDtype,
    Layout,
    ModelCard,
    OutputKind,
    Precision,
    Preprocessing,
    ReceptiveField,
    Verification,
)

METADATA_KEY = "scoremap.model_card"

__all__ = [
    "METADATA_KEY",
    "ModelCard",
    "Preprocessing",
    "ReceptiveField",
    "Verification",
    "Layout",
    "InputDtype",
    "ChannelOrder",
    "OutputKind",
    "Precision",
    "NUMPY_DTYPES",
    "CardError",
    "ImageInput",
    "channel_axis",
    "spatial_axes",
    "batch_shape",
    "is_logits",
    "label",
    "parse_label",
    "read_card",
    "write_card",
    "card_to_json",
]

NUMPY_DTYPES = {
    InputDtype.INPUT_DTYPE_FLOAT32: np.dtype(np.float32),
    InputDtype.INPUT_DTYPE_FLOAT16: np.dtype(np.float16),
    InputDtype.INPUT_DTYPE_UINT8: np.dtype(np.uint8),
}
# Enums whose labels are acronyms, shown upper-case ("NCHW", "RGB"); the others lower-case ("fp16").
_UPPER_CASE_LABELS = ("Layout", "ChannelOrder")
# Every enum field a card must set (the converter sets them all): (path, enum type).
_REQUIRED_ENUMS = (
    ("preprocessing.layout", Layout),
    ("preprocessing.dtype", InputDtype),
    ("preprocessing.channel_order", ChannelOrder),
    ("output_kind", OutputKind),
    ("precision", Precision),
)


class CardError(ValueError):
    """The ONNX file has no model card, or one that does not parse."""


def label(enum: EnumTypeWrapper, value: int) -> str:
    """How people read an enum value: LAYOUT_NCHW → "NCHW", PRECISION_FP16 → "fp16", OUTPUT_KIND_LOGITS → "logits"."""
    prefix = enum.Name(0).removesuffix("UNSPECIFIED")
    text = enum.Name(value).removeprefix(prefix)
    return text if enum.DESCRIPTOR.name in _UPPER_CASE_LABELS else text.lower()


def parse_label(enum: EnumTypeWrapper, text: str) -> int:
    """The enum value whose label is `text` (any case); the inverse of `label`."""
    for value in enum.values():
        if value and label(enum, value).lower() == text.lower():
            return value
    choices = [label(enum, v) for v in enum.values() if v]
    raise CardError(f"{text!r} is not a {enum.DESCRIPTOR.name}; expected one of {choices}")


def channel_axis(layout: int) -> int:
    """The channel axis of an image batch in `layout` (1 for NCHW, 3 for NHWC)."""
    return {Layout.LAYOUT_NCHW: 1, Layout.LAYOUT_NHWC: 3}[_known(Layout, layout)]


def spatial_axes(layout: int) -> tuple[int, int]:
    """The (height, width) axes of an image batch in `layout`."""
    return {Layout.LAYOUT_NCHW: (2, 3), Layout.LAYOUT_NHWC: (1, 2)}[_known(Layout, layout)]


def batch_shape(layout: int, *, batch: int, channels: int, height: int, width: int) -> list[int]:
    """The shape of an image batch in `layout`."""
    return [batch, channels, height, width] if channel_axis(layout) == 1 else [batch, height, width, channels]


def _known(enum: EnumTypeWrapper, value: int) -> int:
    if not value or value not in enum.values():
        raise CardError(f"{enum.DESCRIPTOR.name} value {value} is unset or unknown; expected one of "
                        f"{[label(enum, v) for v in enum.values() if v]}")
    return value


@dataclass(frozen=True)
class ImageInput:
    """The graph's image input as its card describes it: value[c] = (pixel[c] * pixel_scale - mean[c]) / std[c]."""

    name: str
    layout: int  # a Layout value
    channel_order: int  # a ChannelOrder value
    dtype: np.dtype
    pixel_scale: float
    mean: tuple[float, ...]
    std: tuple[float, ...]
    resize_filter: str

    @classmethod
    def of(cls, preprocessing: Preprocessing | ModelCard | ImageInput) -> ImageInput:
        """The view of a card (or of its preprocessing); unset mean/std mean 0 and 1, an unset scale 1."""
        if isinstance(preprocessing, ImageInput):
            return preprocessing
        if isinstance(preprocessing, ModelCard):
            preprocessing = preprocessing.preprocessing
        channels = len(preprocessing.mean) or len(preprocessing.std)
        return cls(
            name=preprocessing.input_name,
            layout=_known(Layout, preprocessing.layout),
            channel_order=_known(ChannelOrder, preprocessing.channel_order),
            dtype=NUMPY_DTYPES[_known(InputDtype, preprocessing.dtype)],
            pixel_scale=preprocessing.pixel_scale or 1.0,
            mean=tuple(preprocessing.mean) or (0.0,) * channels,
            std=tuple(preprocessing.std) or (1.0,) * channels,
            resize_filter=preprocessing.resize_filter or "bilinear",
        )

    @property
    def channels(self) -> int:
        """Channels the mean and std are given for (0 when the card gives neither)."""
        return len(self.mean)

    @property
    def channel_axis(self) -> int:
        return channel_axis(self.layout)

    @property
    def spatial_axes(self) -> tuple[int, int]:
        return spatial_axes(self.layout)

    @property
    def bgr(self) -> bool:
        return self.channel_order == ChannelOrder.CHANNEL_ORDER_BGR

    def size_of(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """(height, width) of an image batch of this layout."""
        y, x = self.spatial_axes
        return shape[y], shape[x]

    def describe(self) -> str:
        """One line for people: layout, dtype, channel order and the normalisation."""
        return (f"{self.name!r}: {label(Layout, self.layout)} {self.dtype} {label(ChannelOrder, self.channel_order)}, "
                f"(pixel x {self.pixel_scale:g} - mean {list(self.mean)}) / std {list(self.std)}, resized {self.resize_filter}")


def is_logits(card: ModelCard) -> bool:
    """Whether the scores are logits (softmax still to apply) rather than probabilities."""
    return _known(OutputKind, card.output_kind) == OutputKind.OUTPUT_KIND_LOGITS


def card_to_json(card: ModelCard) -> str:
    return json_format.MessageToJson(card, preserving_proto_field_name=True, indent=2)


def write_card(model: onnx.ModelProto, card: ModelCard) -> onnx.ModelProto:
    """Store `card` in `model`'s metadata, replacing any card already there; returns `model`."""
    kept = [p for p in model.metadata_props if p.key != METADATA_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    entry = model.metadata_props.add()
    entry.key = METADATA_KEY
    entry.value = card_to_json(card)
    return model


def read_card(model: onnx.ModelProto | str) -> ModelCard:
    """The card of a model (a ModelProto or a path; a path is read without its weights), its enums checked."""
    if isinstance(model, str):
        model = onnx.load(model, load_external_data=False)
    for prop in model.metadata_props:
        if prop.key == METADATA_KEY:
            try:
                card = json_format.Parse(prop.value, ModelCard())
            except json_format.ParseError as error:
                raise CardError(
                    f"the model card in metadata key {METADATA_KEY!r} does not parse: {error}; "
                    "a card from an older scoremap-convert (layout \"NCHW\" rather than \"LAYOUT_NCHW\") "
                    "needs the model converted again") from error
            check_enums(card)
            return card
    raise CardError(
        f"no model card (metadata key {METADATA_KEY!r}) in this ONNX file; "
        "convert the classifier with `scoremap-convert` first"
    )


def check_enums(card: ModelCard) -> ModelCard:
    """Raise CardError when an enum the server needs is unset; returns `card`."""
    for path, enum in _REQUIRED_ENUMS:
        holder = card
        *parents, field = path.split(".")
        for parent in parents:
            holder = getattr(holder, parent)
        if not getattr(holder, field):
            raise CardError(f"the model card leaves {path} unset; expected one of "
                            f"{[enum.Name(v) for v in enum.values() if v]}; convert the model again with scoremap-convert")
    return card
