"""The Open Inference Protocol (KServe v2) without a transport: tensors in, ScoreRequest; ScoreResponse, tensors out.

gRPC (server/edges/grpc/kserve.py) and HTTP/REST (server/edges/http/kserve_rest.py) each turn their own messages into
these plain values and back, so both edges take the same inputs, parameters and outputs, refuse
the same mistakes with the same words, and answer with the same tensors.

One inference request is one image:

    inputs      IMAGE   BYTES [1]        an encoded image (server/scoring/imaging.py FORMATS)
            or  PIXELS  UINT8 [H, W, C]  decoded pixels
    parameters  scales ("384,512" or an int), stride, shift (none|grid|diagonal|atrous), flip,
                top_k, cell_top_k, classes ("3,7"), map_dtype (float32|float16)
    outputs     TOP_K_INDICES INT32 [k], TOP_K_PROBABILITIES FP32 [k], TOP_K_LABELS BYTES [k];
                per scale s: SCORES_s [K, h, w] (FP32 or FP16), CELL_TOP_K_INDICES_s INT32 [k, h, w],
                CELL_TOP_K_SCORES_s FP32 [k, h, w]; the response parameter `maps` is a JSON list of
                each scale's cells, geometry and, when tiled, its tiling (scoring.proto's ScaleMap without its tensors).

Maps are computed only when no output is named or a SCORES_s output is. The protocol's byte
encodings and its model configuration are tritonclient's own (the `triton` extra), imported where
used: scoremap's own REST routes read parameters with `apply_parameters` without the extra.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from google.protobuf import json_format

from protos import scoring_pb2
from server.errors import Refusal, ScoringError
from server.scoring.fields import checked

if TYPE_CHECKING:
    from tritonclient.grpc import model_config_pb2

SERVER_NAME = "scoremap"
PLATFORM = "scoremap_dense"
MODEL_VERSION = "1"  # one version per served name: two versions are served as two names (NAME=PATH)
EXTENSIONS = ("parameters", "model_configuration")  # HTTP adds binary_tensor_data
IMAGE_INPUT = "IMAGE"
PIXELS_INPUT = "PIXELS"
TOP_K_INDICES = "TOP_K_INDICES"
TOP_K_PROBABILITIES = "TOP_K_PROBABILITIES"
TOP_K_LABELS = "TOP_K_LABELS"
SCORES = "SCORES_"  # + scale
CELL_TOP_K_INDICES = "CELL_TOP_K_INDICES_"
CELL_TOP_K_SCORES = "CELL_TOP_K_SCORES_"
PER_SCALE = (SCORES, CELL_TOP_K_INDICES, CELL_TOP_K_SCORES)
# Request parameters and the ScoreRequest field each sets.
PARAMETERS = ("scales", "stride", "shift", "flip", "top_k", "cell_top_k", "classes", "map_dtype")
SHIFTS = {"auto": scoring_pb2.SHIFT_UNSPECIFIED, "none": scoring_pb2.SHIFT_NONE, "grid": scoring_pb2.SHIFT_GRID,
          "diagonal": scoring_pb2.SHIFT_DIAGONAL, "atrous": scoring_pb2.SHIFT_ATROUS}
MAP_DTYPES = {"float32": scoring_pb2.FLOAT32, "float16": scoring_pb2.FLOAT16}
Parameter = bool | int | str | float


@dataclass(frozen=True)
class InputTensor:
    """One input as the transport received it: `raw` (binary data) or `elements` (typed contents)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    raw: bytes | None = None
    elements: Sequence | None = None


@dataclass(frozen=True)
class TensorSpec:
    """An input or output a model declares: name, protocol datatype, shape (-1: any)."""

    name: str
    datatype: str
    shape: tuple[int, ...]


def invalid(message: str) -> ScoringError:
    return ScoringError(Refusal.INVALID_ARGUMENT, message)


# --- request -> ScoreRequest ------------------------------------------------------------------------
def _int_list(name: str, value: Parameter, field: str) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [checked(name, value, field)]
    try:
        numbers = [int(item) for item in str(value).split(",") if item.strip()]
    except ValueError:
        raise invalid(f"parameter {name}={value!r}: expected an integer or integers separated by commas, "
                      "e.g. \"384,512\"") from None
    return [checked(name, number, field) for number in numbers]


def _int(name: str, value: Parameter, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"parameter {name}={value!r}: expected an int64 parameter")
    return checked(name, value, field)


def _choice(name: str, value: Parameter, choices: dict[str, int]) -> int:
    if not isinstance(value, str) or value not in choices:
        raise invalid(f"parameter {name}={value!r}: expected one of {', '.join(choices)}")
    return choices[value]


def apply_parameters(request: scoring_pb2.ScoreRequest, parameters: Mapping[str, Parameter]) -> None:
    """Set the ScoreRequest's options from request parameters as plain values (unknown names refused), each
    number checked against its field's range (server/scoring/fields.py) before the int32 field takes it."""
    for name, value in parameters.items():
        if name in ("scales", "classes"):
            getattr(request, name)[:] = _int_list(name, value, name)
        elif name == "stride":
            request.output_stride = _int(name, value, "output_stride")
        elif name in ("top_k", "cell_top_k"):
            setattr(request, name, _int(name, value, name))
        elif name == "flip":
            if not isinstance(value, bool):
                raise invalid(f"parameter flip={value!r}: expected a bool parameter")
            request.flip = value
        elif name == "shift":
            request.shift = _choice(name, value, SHIFTS)
        elif name == "map_dtype":
            request.map_dtype = _choice(name, value, MAP_DTYPES)
        else:
            raise invalid(f"unknown parameter {name!r}: this server takes {', '.join(PARAMETERS)}")


def _encoded(tensor: InputTensor) -> bytes:
    if tensor.datatype != "BYTES" or math.prod(tensor.shape) != 1:
        raise invalid(f"{IMAGE_INPUT} is {tensor.datatype} {list(tensor.shape)}: expected BYTES [1] holding one "
                      "encoded image (send several images as several requests, or stream them)")
    if tensor.raw is not None:
        from tritonclient.utils import deserialize_bytes_tensor

        try:
            (encoded,) = deserialize_bytes_tensor(tensor.raw)
        except (ValueError, IndexError, struct.error) as error:  # struct.error: a length beyond the bytes
            raise invalid(f"{IMAGE_INPUT}: its raw contents are not one length-prefixed BYTES element "
                          f"({len(tensor.raw)} bytes): {error}") from error
        return encoded
    elements = tensor.elements or ()
    if len(elements) != 1:
        raise invalid(f"{IMAGE_INPUT} has {len(elements)} elements: expected one")
    return elements[0]


def _pixels(tensor: InputTensor) -> scoring_pb2.RawImage:
    shape = list(tensor.shape)
    if tensor.datatype != "UINT8" or len(shape) != 3 or min(shape) < 1 or shape[2] not in (1, 3, 4):
        raise invalid(f"{PIXELS_INPUT} is {tensor.datatype} {shape}: expected UINT8 [H, W, C] with C 1, 3 or 4")
    try:
        data = tensor.raw if tensor.raw is not None else bytes(bytearray(tensor.elements or ()))
    except (ValueError, TypeError) as error:  # a value above 255, or not an integer
        raise invalid(f"{PIXELS_INPUT}: its elements are not all integers 0..255 ({error}): "
                      "UINT8 pixels are 0..255") from None
    height, width, channels = shape
    checked(f"{PIXELS_INPUT}'s height", height, "height")
    checked(f"{PIXELS_INPUT}'s width", width, "width")
    return scoring_pb2.RawImage(data=data, height=height, width=width, channels=channels)


def score_request(*, model: str, version: str, request_id: str, inputs: Sequence[InputTensor],
                  parameters: Mapping[str, Parameter], outputs: Sequence[str]) -> scoring_pb2.ScoreRequest:
    """The ScoreRequest an inference request asks for (maps only when wanted, see the module docstring)."""
    if version not in ("", MODEL_VERSION):
        raise ScoringError(Refusal.NOT_FOUND, f"model {model!r} has no version {version!r}: it has version "
                           f"{MODEL_VERSION} (or leave the version empty)")
    score = scoring_pb2.ScoreRequest(model=model, request_id=request_id)
    names = [tensor.name for tensor in inputs]
    if len(names) != 1 or names[0] not in (IMAGE_INPUT, PIXELS_INPUT):
        raise invalid(f"inputs {names}: expected exactly one, {IMAGE_INPUT} (BYTES [1], an encoded image) "
                      f"or {PIXELS_INPUT} (UINT8 [H, W, C])")
    if names[0] == IMAGE_INPUT:
        score.encoded = _encoded(inputs[0])
    else:
        score.raw.CopyFrom(_pixels(inputs[0]))
    apply_parameters(score, parameters)
    for name in outputs:
        fixed = name in (TOP_K_INDICES, TOP_K_PROBABILITIES, TOP_K_LABELS)
        if not fixed and not any(name.startswith(prefix) and name[len(prefix):].isdigit() for prefix in PER_SCALE):
            raise invalid(f"unknown output {name!r}: outputs are {TOP_K_INDICES}, {TOP_K_PROBABILITIES}, "
                          f"{TOP_K_LABELS} and, per scale s, {SCORES}s, {CELL_TOP_K_INDICES}s, {CELL_TOP_K_SCORES}s")
    score.return_maps = not outputs or any(name.startswith(SCORES) for name in outputs)
    return score


# --- ScoreResponse -> outputs ------------------------------------------------------------------------
def _array(tensor: scoring_pb2.Tensor) -> np.ndarray:
    return np.frombuffer(tensor.data, np.dtype(tensor.dtype).newbyteorder("<")).reshape(tuple(tensor.shape))


def output_arrays(response: scoring_pb2.ScoreResponse) -> dict[str, np.ndarray]:
    """Every output the response holds, by name (see the module docstring); labels as bytes objects."""
    top = response.top_k
    outputs = {
        TOP_K_INDICES: np.array([label.index for label in top], np.int32),
        TOP_K_PROBABILITIES: np.array([label.probability for label in top], np.float32),
        TOP_K_LABELS: np.array([label.label.encode() for label in top], np.object_),
    }
    for scale_map in response.maps:
        for prefix, tensor in ((SCORES, scale_map.scores), (CELL_TOP_K_INDICES, scale_map.cell_top_k_indices),
                               (CELL_TOP_K_SCORES, scale_map.cell_top_k_scores)):
            if tensor.shape:
                outputs[f"{prefix}{scale_map.scale}"] = _array(tensor)
    return outputs


def wanted_outputs(outputs: Sequence[str], response: scoring_pb2.ScoreResponse) -> dict[str, np.ndarray]:
    """The outputs asked for (all when none is named), in the order asked."""
    arrays = output_arrays(response)
    wanted = list(outputs) or list(arrays)
    absent = [name for name in wanted if name not in arrays]
    if absent:
        scales = [scale_map.scale for scale_map in response.maps]
        raise invalid(f"outputs {absent} are not in this answer (scales {scales}; cell top-k only with the "
                      f"cell_top_k parameter): ask for outputs of the scales requested")
    return {name: arrays[name] for name in wanted}


def datatype(array: np.ndarray) -> str:
    """The protocol's name of the array's element type (BYTES for objects)."""
    from tritonclient.utils import np_to_triton_dtype

    return np_to_triton_dtype(array.dtype)


def raw_bytes(array: np.ndarray) -> bytes:
    """The protocol's raw encoding: little-endian elements, BYTES as 4-byte length + content each."""
    if array.dtype == np.object_:
        from tritonclient.utils import serialize_byte_tensor

        return serialize_byte_tensor(array).item() if array.size else b""
    return array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()


def response_parameters(response: scoring_pb2.ScoreResponse) -> dict[str, str | int]:
    """What the response says beside its tensors: each scale's cells, geometry and tiling (`maps`, JSON), the
    execution provider, the stride and any warnings (JSON)."""
    maps = []
    for scale_map in response.maps:
        described = scoring_pb2.ScaleMap(scale=scale_map.scale, classes=scale_map.classes, height=scale_map.height,
                                         width=scale_map.width, geometry=scale_map.geometry)
        if scale_map.HasField("tiling"):
            described.tiling.CopyFrom(scale_map.tiling)
        maps.append(json_format.MessageToDict(described, preserving_proto_field_name=True))
    parameters: dict[str, str | int] = {"maps": json.dumps(maps), "execution_provider": response.execution_provider,
                                        "output_stride": response.output_stride}
    if response.warnings:
        parameters["warnings"] = json.dumps(list(response.warnings))
    return parameters


# --- models ---------------------------------------------------------------------------------------
def find_model(models: Sequence[scoring_pb2.ModelSummary], name: str, version: str = "") -> scoring_pb2.ModelSummary:
    """The served model `name` at `version` ("" or MODEL_VERSION); NOT_FOUND naming those served."""
    for summary in models:
        if summary.name == name and version in ("", MODEL_VERSION):
            return summary
    names = ", ".join(summary.name for summary in models)
    raise ScoringError(Refusal.NOT_FOUND, f"no model {name!r} version {version!r}: this server has "
                       f"{names}, each in version {MODEL_VERSION}")


def model_inputs() -> tuple[TensorSpec, ...]:
    return TensorSpec(IMAGE_INPUT, "BYTES", (1,)), TensorSpec(PIXELS_INPUT, "UINT8", (-1, -1, -1))


def model_outputs(summary: scoring_pb2.ModelSummary) -> tuple[TensorSpec, ...]:
    """The outputs at the model's default scale (other scales are named alike)."""
    scale = summary.default_scale
    return (TensorSpec(TOP_K_INDICES, "INT32", (-1,)), TensorSpec(TOP_K_PROBABILITIES, "FP32", (-1,)),
            TensorSpec(TOP_K_LABELS, "BYTES", (-1,)), TensorSpec(f"{SCORES}{scale}", "FP32", (summary.classes, -1, -1)),
            TensorSpec(f"{CELL_TOP_K_INDICES}{scale}", "INT32", (-1, -1, -1)),
            TensorSpec(f"{CELL_TOP_K_SCORES}{scale}", "FP32", (-1, -1, -1)))


def model_config(summary: scoring_pb2.ModelSummary) -> model_config_pb2.ModelConfig:
    """Triton's model configuration of a served model: either input, the outputs at its default scale."""
    from tritonclient.grpc import model_config_pb2

    config = model_config_pb2.ModelConfig(name=summary.name, platform=PLATFORM, max_batch_size=0)
    config.input.add(name=IMAGE_INPUT, data_type=model_config_pb2.TYPE_STRING, dims=[1], optional=True)
    config.input.add(name=PIXELS_INPUT, data_type=model_config_pb2.TYPE_UINT8, dims=[-1, -1, -1], optional=True)
    config.output.add(name=TOP_K_INDICES, data_type=model_config_pb2.TYPE_INT32, dims=[-1])
    config.output.add(name=TOP_K_PROBABILITIES, data_type=model_config_pb2.TYPE_FP32, dims=[-1])
    config.output.add(name=TOP_K_LABELS, data_type=model_config_pb2.TYPE_STRING, dims=[-1])
    config.output.add(name=f"{SCORES}{summary.default_scale}", data_type=model_config_pb2.TYPE_FP32,
                      dims=[summary.classes, -1, -1])
    return config
