"""The model card: read and write the ModelCard message stored in an ONNX file's metadata.

One schema (protos/model_card.proto), serialized as JSON so that tools such as Netron show it.
"""

from __future__ import annotations

import onnx
from google.protobuf import json_format

from protos.model_card_pb2 import ModelCard, Preprocessing, ReceptiveField, Verification

METADATA_KEY = "scoremap.model_card"

__all__ = [
    "METADATA_KEY",
    "ModelCard",
    "Preprocessing",
    "ReceptiveField",
    "Verification",
    "CardError",
    "read_card",
    "write_card",
    "card_to_json",
]


class CardError(ValueError):
    """The ONNX file has no model card, or one that does not parse."""


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
    """The card of a model (a ModelProto or a path; a path is read without its weights)."""
    if isinstance(model, str):
        model = onnx.load(model, load_external_data=False)
    for prop in model.metadata_props:
        if prop.key == METADATA_KEY:
            try:
                return json_format.Parse(prop.value, ModelCard())
            except json_format.ParseError as error:
                raise CardError(f"the model card in metadata key {METADATA_KEY!r} does not parse: {error}") from error
    raise CardError(
        f"no model card (metadata key {METADATA_KEY!r}) in this ONNX file; "
        "convert the classifier with `scoremap-convert` first"
    )
