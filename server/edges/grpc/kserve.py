"""The Open Inference Protocol (KServe v2, `inference.GRPCInferenceService`) over the same Pipeline.

Fleets that already speak Triton's / KServe's protocol (tritonclient, KServe transformers, load
balancers with its health checks) call scoremap without its own client. The
protocol's messages are the generated ones shipped in `tritonclient.grpc` (the `triton` extra),
not a copy of its .proto files; without the extra the server runs without this service. Inputs,
parameters and outputs are server/edges/open_inference.py's, shared with the HTTP edge; this module
only turns the protocol's gRPC messages into its plain values and back.

ModelStreamInfer works as ScoreStream (server/edges/streams.py: a window of requests scored at once, answers in
order, idle streams ended), except that a refused request answers its error and the stream goes on, as in
Triton. Readiness is the standard health service's (`ServerReady` = health of ""), and the
DenseScoring servicer's accounting (the Front's) applies to every call: draining, in-flight calls,
`scoremap_requests_total{method,code,model}`; the token and call-limit interceptors are the
server's, so auth and limits are the same.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Iterator

import grpc
from grpc_health.v1 import health, health_pb2

from protos import scoring_pb2, version
from server.edges.calls import Call
from server.edges.grpc.service import DenseScoringServicer
from server.edges.streams import windowed
from server.errors import Refusal, ScoringError

try:
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    from server.edges.open_inference import (EXTENSIONS, MODEL_VERSION, PLATFORM, SERVER_NAME, InputTensor, TensorSpec,
                                       datatype, find_model, model_config, model_inputs, model_outputs, raw_bytes,
                                       response_parameters, score_request, wanted_outputs)
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


# --- ModelInferRequest <-> open_inference's plain values ---------------------------------------------
def _parameter(value: service_pb2.InferParameter) -> bool | int | str | float:
    kind = value.WhichOneof("parameter_choice")
    return getattr(value, kind) if kind else ""


def _inputs(request: service_pb2.ModelInferRequest) -> list[InputTensor]:
    """Each input with its raw_input_contents (tritonclient sends those) or its typed contents."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise ScoringError(Refusal.INVALID_ARGUMENT, f"{len(raw)} raw_input_contents for {len(request.inputs)} "
                           "inputs: send one per input, or put every input in `contents`")
    inputs = []
    for index, tensor in enumerate(request.inputs):
        contents = tensor.contents.bytes_contents if tensor.datatype == "BYTES" else tensor.contents.uint_contents
        inputs.append(InputTensor(tensor.name, tensor.datatype, tuple(tensor.shape), raw=raw[index] if raw else None,
                                  elements=list(contents)))
    return inputs


def to_score_request(request: service_pb2.ModelInferRequest) -> scoring_pb2.ScoreRequest:
    return score_request(model=request.model_name, version=request.model_version, request_id=request.id,
                         inputs=_inputs(request), outputs=[output.name for output in request.outputs],
                         parameters={name: _parameter(value) for name, value in request.parameters.items()})


def infer_response(request: service_pb2.ModelInferRequest,
                   response: scoring_pb2.ScoreResponse) -> service_pb2.ModelInferResponse:
    """The response with the outputs asked for (all when none is named), as raw_output_contents."""
    outputs = wanted_outputs([output.name for output in request.outputs], response)
    answer = service_pb2.ModelInferResponse(model_name=response.model, model_version=MODEL_VERSION, id=request.id)
    for name, value in response_parameters(response).items():
        if isinstance(value, int):
            answer.parameters[name].int64_param = value
        else:
            answer.parameters[name].string_param = value
    for name, array in outputs.items():
        answer.outputs.add(name=name, datatype=datatype(array), shape=array.shape)
        answer.raw_output_contents.append(raw_bytes(array))
    return answer


# --- the servicer ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Streamed:
    """A stream's request, its `id` under the name server/edges/streams.py reads."""

    request: service_pb2.ModelInferRequest

    @property
    def request_id(self) -> str:
        return self.request.id


def _tensor(spec: TensorSpec) -> service_pb2.ModelMetadataResponse.TensorMetadata:
    return service_pb2.ModelMetadataResponse.TensorMetadata(name=spec.name, datatype=spec.datatype, shape=spec.shape)


class InferenceServicer(ServicerBase):
    """KServe v2 over the DenseScoring servicer's pipeline, accounting and readiness."""

    def __init__(self, scoring: DenseScoringServicer, health_servicer: health.HealthServicer) -> None:
        self.scoring = scoring
        self.pipeline = scoring.pipeline
        self.health = health_servicer

    def _ready(self, context: grpc.ServicerContext) -> bool:
        status = self.health.Check(health_pb2.HealthCheckRequest(service=""), context).status
        return status == health_pb2.HealthCheckResponse.SERVING and not self.scoring.front.draining.is_set()

    def _known(self, name: str, version: str) -> bool:
        return version in ("", MODEL_VERSION) and name in {summary.name for summary in self.pipeline.models()}

    def ServerLive(self, request, context):
        with self.scoring.accounted("ServerLive", context):
            return service_pb2.ServerLiveResponse(live=not self.scoring.front.draining.is_set())

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

    def ModelMetadata(self, request, context):
        with self.scoring.accounted("ModelMetadata", context):
            summary = find_model(self.pipeline.models(), request.name, request.version)
            return service_pb2.ModelMetadataResponse(
                name=summary.name, versions=[MODEL_VERSION], platform=PLATFORM,
                inputs=[_tensor(spec) for spec in model_inputs()],
                outputs=[_tensor(spec) for spec in model_outputs(summary)],
            )

    def ModelConfig(self, request, context):
        with self.scoring.accounted("ModelConfig", context):
            summary = find_model(self.pipeline.models(), request.name, request.version)
            return service_pb2.ModelConfigResponse(config=model_config(summary))

    def _infer(self, request: service_pb2.ModelInferRequest, call: Call) -> service_pb2.ModelInferResponse:
        response = self.scoring.front.score(to_score_request(request), deadline=call.deadline, cancelled=call.cancelled)
        return infer_response(request, response)

    def ModelInfer(self, request, context):
        with self.scoring.accounted("ModelInfer", context, self.scoring.front.model_label(
                scoring_pb2.ScoreRequest(model=request.model_name))) as call:
            return self._infer(request, call)

    def _stream_answer(self, streamed: Streamed, call: Call) -> service_pb2.ModelStreamInferResponse:
        request = streamed.request
        try:
            return service_pb2.ModelStreamInferResponse(infer_response=self._infer(request, call))
        except ScoringError as error:
            return service_pb2.ModelStreamInferResponse(
                error_message=f"{error.refusal.name}: {error.message}",
                infer_response=service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id))

    def ModelStreamInfer(self, request_iterator, context) -> Iterator[service_pb2.ModelStreamInferResponse]:
        """As ScoreStream: up to `stream_window` requests scored at once, answers in order, idle streams ended.

        A refused request answers its error and the stream goes on, as Triton's does.
        """
        with self.scoring.accounted("ModelStreamInfer", context) as call:
            with windowed(map(Streamed, request_iterator), functools.partial(self._stream_answer, call=call), call,
                          settings=self.scoring.settings, name="kserve-stream") as submitted:
                for _, future in submitted:
                    yield future.result()


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
