"""The Open Inference Protocol (KServe v2, `inference.GRPCInferenceService`) over the same Pipeline.

Fleets that already speak Triton's / KServe's protocol (tritonclient, KServe transformers, load
balancers with its health checks) call scoremap without its own client (issue 11, item 1). The
protocol's messages are the generated ones shipped in `tritonclient.grpc` (the `triton` extra),
not a copy of its .proto files; without the extra the server runs without this service.

One inference request is one image:

    inputs      IMAGE   BYTES [1]        encoded JPEG/PNG/WebP/BMP/TIFF
            or  PIXELS  UINT8 [H, W, C]  decoded pixels
    parameters  scales ("384,512" or an int), stride, shift (none|grid|diagonal|atrous), flip,
                top_k, cell_top_k, classes ("3,7"), map_dtype (float32|float16)
    outputs     TOP_K_INDICES INT32 [k], TOP_K_PROBABILITIES FP32 [k], TOP_K_LABELS BYTES [k];
                per scale s: SCORES_s [K, h, w] (FP32 or FP16), CELL_TOP_K_INDICES_s INT32 [k, h, w],
                CELL_TOP_K_SCORES_s FP32 [k, h, w]; the response parameter `maps` is a JSON list of
                each scale's cells and geometry (scoring.proto's ScaleMap without its tensors).

Maps are computed only when no output is named or a SCORES_s output is. ModelStreamInfer works as
ScoreStream (a window of requests scored at once, answers in order, idle streams ended), except
that a refused request answers its error and the stream goes on, as in Triton. Readiness is the
standard health service's (`ServerReady` = health of ""), and the DenseScoring servicer's
accounting applies to every call: draining, in-flight calls, `scoremap_requests_total{method,code,
model}`; the token and call-limit interceptors are the server's, so auth and limits are the same.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
from google.protobuf import json_format
from grpc_health.v1 import health, health_pb2

from protos import scoring_pb2, version
from server.errors import Refusal, ScoringError
from server.service import Call, DenseScoringServicer, StreamReader, check_size

try:
    from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc
    from tritonclient.utils import deserialize_bytes_tensor, np_to_triton_dtype, serialize_byte_tensor
except ModuleNotFoundError as missing:  # the `triton` extra is not installed
    if not (missing.name or "").startswith("tritonclient"):
        raise
    MISSING_EXTRA: ModuleNotFoundError | None = missing
    ServicerBase: type = object
else:
    MISSING_EXTRA = None
    ServicerBase = service_pb2_grpc.GRPCInferenceServiceServicer

LOG = logging.getLogger(__name__)
SERVICE_NAME = "inference.GRPCInferenceService"
SERVER_NAME = "scoremap"
PLATFORM = "scoremap_dense"
MODEL_VERSION = "1"  # one version per served name: two versions are served as two names (NAME=PATH)
EXTENSIONS = ("parameters", "model_configuration")
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


def invalid(message: str) -> ScoringError:
    return ScoringError(Refusal.INVALID_ARGUMENT, message)


# --- request -> ScoreRequest ------------------------------------------------------------------------
def _parameter(value: service_pb2.InferParameter) -> bool | int | str | float:
    kind = value.WhichOneof("parameter_choice")
    return getattr(value, kind) if kind else ""


def _int_list(name: str, value: bool | int | str | float) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    try:
        return [int(item) for item in str(value).split(",") if item.strip()]
    except ValueError:
        raise invalid(f"parameter {name}={value!r}: expected an integer or integers separated by commas, "
                      "e.g. \"384,512\"") from None


def _int(name: str, value: bool | int | str | float) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"parameter {name}={value!r}: expected an int64 parameter")
    return value


def _choice(name: str, value: bool | int | str | float, choices: dict[str, int]) -> int:
    if value not in choices:
        raise invalid(f"parameter {name}={value!r}: expected one of {', '.join(choices)}")
    return choices[value]


def apply_parameters(request: scoring_pb2.ScoreRequest, parameters: Mapping[str, bool | int | str | float]) -> None:
    """Set the ScoreRequest's options from request parameters as plain values (unknown names refused)."""
    for name, value in parameters.items():
        if name == "scales":
            request.scales[:] = _int_list(name, value)
        elif name == "classes":
            request.classes[:] = _int_list(name, value)
        elif name == "stride":
            request.output_stride = _int(name, value)
        elif name in ("top_k", "cell_top_k"):
            setattr(request, name, _int(name, value))
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


def _input_bytes(request: service_pb2.ModelInferRequest, index: int) -> bytes | None:
    """The raw bytes of input `index` when the client sent raw_input_contents (tritonclient does)."""
    if not request.raw_input_contents:
        return None
    if len(request.raw_input_contents) != len(request.inputs):
        raise invalid(f"{len(request.raw_input_contents)} raw_input_contents for {len(request.inputs)} inputs: "
                      "send one per input, or put every input in `contents`")
    return request.raw_input_contents[index]


def _image(request: service_pb2.ModelInferRequest, score: scoring_pb2.ScoreRequest) -> None:
    names = [tensor.name for tensor in request.inputs]
    if len(names) != 1 or names[0] not in (IMAGE_INPUT, PIXELS_INPUT):
        raise invalid(f"inputs {names}: expected exactly one, {IMAGE_INPUT} (BYTES [1], an encoded image) "
                      f"or {PIXELS_INPUT} (UINT8 [H, W, C])")
    tensor = request.inputs[0]
    shape = list(tensor.shape)
    raw = _input_bytes(request, 0)
    if tensor.name == IMAGE_INPUT:
        if tensor.datatype != "BYTES" or int(np.prod(shape)) != 1:
            raise invalid(f"{IMAGE_INPUT} is {tensor.datatype} {shape}: expected BYTES [1] holding one encoded "
                          f"image (send several images as several requests, or stream them)")
        if raw is not None:
            try:
                (score.encoded,) = deserialize_bytes_tensor(raw)
            except (ValueError, IndexError) as error:
                raise invalid(f"{IMAGE_INPUT}: its raw contents are not one length-prefixed BYTES element "
                              f"({len(raw)} bytes): {error}") from error
        elif len(tensor.contents.bytes_contents) == 1:
            score.encoded = tensor.contents.bytes_contents[0]
        else:
            raise invalid(f"{IMAGE_INPUT} has {len(tensor.contents.bytes_contents)} bytes_contents: expected one")
        return
    if tensor.datatype != "UINT8" or len(shape) != 3 or min(shape) < 1:
        raise invalid(f"{PIXELS_INPUT} is {tensor.datatype} {shape}: expected UINT8 [H, W, C] with C 1, 3 or 4")
    try:
        data = raw if raw is not None else bytes(bytearray(tensor.contents.uint_contents))
    except ValueError as error:  # a uint_contents value above 255
        raise invalid(f"{PIXELS_INPUT}: uint_contents hold values above 255 ({error}): "
                      "UINT8 pixels are 0..255") from None
    height, width, channels = shape
    score.raw.CopyFrom(scoring_pb2.RawImage(data=data, height=height, width=width, channels=channels))


def score_request(request: service_pb2.ModelInferRequest) -> scoring_pb2.ScoreRequest:
    """The ScoreRequest an inference request asks for (maps only when wanted, see the module docstring)."""
    if request.model_version not in ("", MODEL_VERSION):
        raise ScoringError(Refusal.NOT_FOUND, f"model {request.model_name!r} has no version "
                           f"{request.model_version!r}: it has version {MODEL_VERSION} (or leave the version empty)")
    score = scoring_pb2.ScoreRequest(model=request.model_name, request_id=request.id)
    _image(request, score)
    apply_parameters(score, {name: _parameter(value) for name, value in request.parameters.items()})
    wanted = [output.name for output in request.outputs]
    for name in wanted:
        fixed = name in (TOP_K_INDICES, TOP_K_PROBABILITIES, TOP_K_LABELS)
        if not fixed and not any(name.startswith(prefix) and name[len(prefix):].isdigit() for prefix in PER_SCALE):
            raise invalid(f"unknown output {name!r}: outputs are {TOP_K_INDICES}, {TOP_K_PROBABILITIES}, "
                          f"{TOP_K_LABELS} and, per scale s, {SCORES}s, {CELL_TOP_K_INDICES}s, {CELL_TOP_K_SCORES}s")
    score.return_maps = not wanted or any(name.startswith(SCORES) for name in wanted)
    return score


# --- ScoreResponse -> response ------------------------------------------------------------------------
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


def _raw(array: np.ndarray) -> bytes:
    """The protocol's raw encoding: little-endian elements, BYTES as 4-byte length + content each."""
    if array.dtype == np.object_:
        return serialize_byte_tensor(array).item() if array.size else b""
    return array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()


def _maps_parameter(response: scoring_pb2.ScoreResponse) -> str:
    maps = []
    for scale_map in response.maps:
        described = scoring_pb2.ScaleMap(scale=scale_map.scale, classes=scale_map.classes, height=scale_map.height,
                                         width=scale_map.width, geometry=scale_map.geometry)
        maps.append(json_format.MessageToDict(described, preserving_proto_field_name=True))
    return json.dumps(maps)


def infer_response(request: service_pb2.ModelInferRequest,
                   response: scoring_pb2.ScoreResponse) -> service_pb2.ModelInferResponse:
    """The response with the outputs asked for (all when none is named), as raw_output_contents."""
    outputs = output_arrays(response)
    wanted = [output.name for output in request.outputs] or list(outputs)
    absent = [name for name in wanted if name not in outputs]
    if absent:
        scales = [scale_map.scale for scale_map in response.maps]
        raise invalid(f"outputs {absent} are not in this answer (scales {scales}; cell top-k only with the "
                      f"cell_top_k parameter): ask for outputs of the scales requested")
    answer = service_pb2.ModelInferResponse(model_name=response.model, model_version=MODEL_VERSION, id=request.id)
    answer.parameters["maps"].string_param = _maps_parameter(response)
    answer.parameters["execution_provider"].string_param = response.execution_provider
    answer.parameters["output_stride"].int64_param = response.output_stride
    if response.warnings:
        answer.parameters["warnings"].string_param = json.dumps(list(response.warnings))
    for name in wanted:
        array = outputs[name]
        answer.outputs.add(name=name, datatype=np_to_triton_dtype(array.dtype), shape=array.shape)
        answer.raw_output_contents.append(_raw(array))
    return answer


# --- the servicer ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Streamed:
    """A stream's request, its `id` under the name the DenseScoring StreamReader reads."""

    request: service_pb2.ModelInferRequest

    @property
    def request_id(self) -> str:
        return self.request.id


def _tensor(name: str, datatype: str, shape: list[int]) -> service_pb2.ModelMetadataResponse.TensorMetadata:
    return service_pb2.ModelMetadataResponse.TensorMetadata(name=name, datatype=datatype, shape=shape)


class InferenceServicer(ServicerBase):
    """KServe v2 over the DenseScoring servicer's pipeline, accounting and readiness."""

    def __init__(self, scoring: DenseScoringServicer, health_servicer: health.HealthServicer) -> None:
        self.scoring = scoring
        self.pipeline = scoring.pipeline
        self.health = health_servicer

    def _ready(self, context: grpc.ServicerContext) -> bool:
        status = self.health.Check(health_pb2.HealthCheckRequest(service=""), context).status
        return status == health_pb2.HealthCheckResponse.SERVING and not self.scoring.draining.is_set()

    def _known(self, name: str, version: str) -> bool:
        return version in ("", MODEL_VERSION) and name in {summary.name for summary in self.pipeline.models()}

    def ServerLive(self, request, context):
        with self.scoring.accounted("ServerLive", context):
            return service_pb2.ServerLiveResponse(live=not self.scoring.draining.is_set())

    def ServerReady(self, request, context):
        with self.scoring.accounted("ServerReady", context):
            return service_pb2.ServerReadyResponse(ready=self._ready(context))

    def ModelReady(self, request, context):
        with self.scoring.accounted("ModelReady", context):
            return service_pb2.ModelReadyResponse(ready=self._known(request.name, request.version)
                                                  and self._ready(context))

    def ServerMetadata(self, request, context):
        with self.scoring.accounted("ServerMetadata", context):
            return service_pb2.ServerMetadataResponse(name=SERVER_NAME, version=version(),
                                                      extensions=EXTENSIONS)

    def _summary(self, name: str, version: str) -> scoring_pb2.ModelSummary:
        for summary in self.pipeline.models():
            if summary.name == name and version in ("", MODEL_VERSION):
                return summary
        names = ", ".join(summary.name for summary in self.pipeline.models())
        raise ScoringError(Refusal.NOT_FOUND, f"no model {name!r} version {version!r}: this server has "
                           f"{names}, each in version {MODEL_VERSION}")

    def ModelMetadata(self, request, context):
        with self.scoring.accounted("ModelMetadata", context):
            summary = self._summary(request.name, request.version)
            scale = summary.default_scale
            return service_pb2.ModelMetadataResponse(
                name=summary.name, versions=[MODEL_VERSION], platform=PLATFORM,
                inputs=[_tensor(IMAGE_INPUT, "BYTES", [1]), _tensor(PIXELS_INPUT, "UINT8", [-1, -1, -1])],
                outputs=[_tensor(TOP_K_INDICES, "INT32", [-1]), _tensor(TOP_K_PROBABILITIES, "FP32", [-1]),
                         _tensor(TOP_K_LABELS, "BYTES", [-1]),
                         _tensor(f"{SCORES}{scale}", "FP32", [summary.classes, -1, -1]),
                         _tensor(f"{CELL_TOP_K_INDICES}{scale}", "INT32", [-1, -1, -1]),
                         _tensor(f"{CELL_TOP_K_SCORES}{scale}", "FP32", [-1, -1, -1])],
            )

    def ModelConfig(self, request, context):
        with self.scoring.accounted("ModelConfig", context):
            summary = self._summary(request.name, request.version)
            config = model_config_pb2.ModelConfig(name=summary.name, platform=PLATFORM, max_batch_size=0)
            config.input.add(name=IMAGE_INPUT, data_type=model_config_pb2.TYPE_STRING, dims=[1], optional=True)
            config.input.add(name=PIXELS_INPUT, data_type=model_config_pb2.TYPE_UINT8, dims=[-1, -1, -1], optional=True)
            config.output.add(name=TOP_K_INDICES, data_type=model_config_pb2.TYPE_INT32, dims=[-1])
            config.output.add(name=TOP_K_PROBABILITIES, data_type=model_config_pb2.TYPE_FP32, dims=[-1])
            config.output.add(name=TOP_K_LABELS, data_type=model_config_pb2.TYPE_STRING, dims=[-1])
            config.output.add(name=f"{SCORES}{summary.default_scale}", data_type=model_config_pb2.TYPE_FP32,
                              dims=[summary.classes, -1, -1])
            return service_pb2.ModelConfigResponse(config=config)

    def _infer(self, request: service_pb2.ModelInferRequest, call: Call) -> service_pb2.ModelInferResponse:
        self.scoring.require_ready()
        score = score_request(request)
        check_size(score, self.scoring.settings.max_message_bytes)
        response = self.pipeline.score(score, deadline=call.deadline, cancelled=call.cancelled)
        return infer_response(request, response)

    def ModelInfer(self, request, context):
        with self.scoring.accounted("ModelInfer", context, self.scoring.model_label(
                scoring_pb2.ScoreRequest(model=request.model_name))) as call:
            return self._infer(request, call)

    def _stream_answer(self, streamed: Streamed, call: Call) -> service_pb2.ModelStreamInferResponse:
        request = streamed.request
        try:
            return service_pb2.ModelStreamInferResponse(infer_response=self._infer(request, call))
        except ScoringError as error:
            return service_pb2.ModelStreamInferResponse(
                error_message=f"{error.code.name}: {error.message}",
                infer_response=service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id))

    def ModelStreamInfer(self, request_iterator, context) -> Iterator[service_pb2.ModelStreamInferResponse]:
        """As ScoreStream: up to `stream_window` requests scored at once, answers in order, idle streams ended.

        A refused request answers its error and the stream goes on, as Triton's does.
        """
        with self.scoring.accounted("ModelStreamInfer", context) as call:
            settings = self.scoring.settings
            window = max(1, settings.stream_window)
            with ThreadPoolExecutor(window, thread_name_prefix="kserve-stream") as pool:
                reader = StreamReader(map(Streamed, request_iterator), pool,
                                      functools.partial(self._stream_answer, call=call), call, window=window,
                                      idle_seconds=settings.stream_idle_seconds)
                try:
                    for _, future in reader.submitted():
                        yield future.result()
                finally:
                    call.cancelled.set()  # an abandoned stream stops its other requests
                    pool.shutdown(wait=True, cancel_futures=True)


def add_to_server(grpc_server: grpc.Server, scoring: DenseScoringServicer,
                  health_servicer: health.HealthServicer) -> bool:
    """Serve KServe v2 next to DenseScoring when the `triton` extra is installed; says once when it is not."""
    if MISSING_EXTRA is not None:
        LOG.info("Open Inference Protocol (KServe v2) off: %s; pip install 'scoremap[triton]' turns it on",
                 MISSING_EXTRA)
        return False
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(scoring, health_servicer),
                                                                grpc_server)
    return True
