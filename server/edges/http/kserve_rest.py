"""KServe v2 (the Open Inference Protocol) over HTTP/REST, as tritonclient.http speaks it.

The JSON request and its binary-data extension (`Inference-Header-Content-Length`: that many bytes
of JSON, then each input's `binary_data_size` bytes in order) become server/edges/open_inference.py's
plain values, the same the gRPC edge makes of its protos; outputs go back as binary data when the
request asks (`binary_data_output`, or an output's `binary_data`), else as JSON. Triton's `timeout`
request parameter (microseconds) is the call's deadline.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from google.protobuf import json_format

from protos import scoring_pb2
from server.edges.open_inference import (EXTENSIONS, MODEL_VERSION, PLATFORM, SERVER_NAME, InputTensor, TensorSpec, datatype,
                                   find_model, invalid, model_config, model_inputs, model_outputs, raw_bytes,
                                   response_parameters, score_request, wanted_outputs)
from server.edges.http.edge import Edge, HttpCall, deadline_after

HEADER_LENGTH = "Inference-Header-Content-Length"
BINARY_SIZE = "binary_data_size"
BINARY_OUTPUT = "binary_data_output"  # request parameter: every output as binary data
TIMEOUT = "timeout"  # request parameter, microseconds
HTTP_EXTENSIONS = (*EXTENSIONS, "binary_tensor_data")
JSON_TYPE = "application/json"
BINARY_TYPE = "application/octet-stream"


def _spec(spec: TensorSpec) -> dict:
    return {"name": spec.name, "datatype": spec.datatype, "shape": list(spec.shape)}


def _utf8(text: str) -> bool:
    """Whether UTF-8 holds `text`: JSON's escapes can spell a lone surrogate ("\\ud800"), which no protobuf
    string takes."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _object(value, what: str) -> dict:
    if not isinstance(value, dict):
        raise invalid(f"{what} is {type(value).__name__}: expected a JSON object")
    return value


# A JSON string, escapes included: what `json_depth` leaves out, so brackets inside names or text do not count.
JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
NOT_BRACKETS = bytes(code for code in range(256) if code not in b"[]{}")
BRACKET_STEPS = bytes.maketrans(b"[{]}", bytes([1, 1, 255, 255]))  # as int8: +1 opening, -1 closing


def json_depth(text: bytes) -> int:
    """The deepest nesting of arrays and objects in JSON `text`, counted from its brackets outside strings
    without parsing it (the parser recurses once per level: a body nested thousands deep would exhaust it)."""
    steps = np.frombuffer(JSON_STRING.sub(b"", text).translate(BRACKET_STEPS, NOT_BRACKETS), np.int8)
    return int(steps.astype(np.int32).cumsum().max()) if steps.size else 0


def split_body(body: bytes, header_length: str | None, *, max_depth: int) -> tuple[dict, memoryview]:
    """The request's JSON, nested at most `max_depth` deep (--http-max-json-depth), and the binary data after it."""
    size = len(body)
    if header_length is not None:
        if not (header_length.isascii() and header_length.isdigit()) or int(header_length) > size:
            raise invalid(f"{HEADER_LENGTH}: {header_length!r} for a body of {size} bytes: give the JSON part's "
                          "length in bytes, at most the body's")
        size = int(header_length)
    text = bytes(body[:size])
    depth = json_depth(text)
    if depth > max_depth:
        raise invalid(f"the inference request's JSON is nested {depth} deep, beyond this server's limit of "
                      f"{max_depth} (--http-max-json-depth): an inference request needs 6 at most")
    try:
        document = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        raise invalid(f"the inference request is not JSON ({error}); with binary tensors, set {HEADER_LENGTH} "
                      "to the length of the JSON before them") from None
    return _object(document, "the inference request"), memoryview(body)[size:]


def _inputs(document: dict, binary: memoryview) -> list[InputTensor]:
    """Each input with its binary data (taken in order) or its JSON data (flattened)."""
    tensors = document.get("inputs")
    if not isinstance(tensors, list):
        raise invalid("the inference request has no `inputs` list: send {\"inputs\": [{\"name\": \"IMAGE\", "
                      "\"datatype\": \"BYTES\", \"shape\": [1], ...}]}")
    inputs, offset = [], 0
    for tensor in tensors:
        tensor = _object(tensor, "an input")
        name, kind, shape = tensor.get("name"), tensor.get("datatype"), tensor.get("shape")
        if not isinstance(name, str) or not isinstance(kind, str) or not isinstance(shape, list) \
                or not all(isinstance(side, int) and not isinstance(side, bool) for side in shape):
            raise invalid(f"input {tensor.get('name')!r}: expected a name, a datatype and a shape of integers")
        size = _object(tensor.get("parameters", {}), f"input {name}'s parameters").get(BINARY_SIZE)
        if size is not None:
            if not isinstance(size, int) or size < 0 or offset + size > len(binary):
                raise invalid(f"input {name}: {BINARY_SIZE} {size!r} with {len(binary) - offset} binary bytes "
                              "left in the body: give each input's size, in the order of the inputs")
            inputs.append(InputTensor(name, kind, tuple(shape), raw=bytes(binary[offset:offset + size])))
            offset += size
            continue
        try:
            data = np.asarray(tensor.get("data", [])).reshape(-1).tolist()
        except ValueError as error:  # ragged nesting
            raise invalid(f"input {name}: its data is not a flat or evenly nested list ({error})") from None
        if kind == "BYTES":
            if not all(isinstance(item, str) for item in data):
                raise invalid(f"input {name}: BYTES data in JSON are strings; send an encoded image as binary "
                              f"data (tritonclient's default), with {BINARY_SIZE} in the input's parameters")
            try:
                data = [item.encode() for item in data]
            except UnicodeEncodeError as error:  # a lone surrogate escape, "\ud800": no UTF-8 holds it
                raise invalid(f"input {name}: its BYTES data are not text UTF-8 can hold ({error})") from None
        inputs.append(InputTensor(name, kind, tuple(shape), elements=data))
    if offset != len(binary):
        raise invalid(f"{len(binary) - offset} bytes of binary data follow the inputs: {BINARY_SIZE} of each input "
                      "should add up to the body after the JSON")
    return inputs


def _outputs(document: dict) -> dict[str, bool]:
    """The outputs asked for, each with whether it goes back as binary data."""
    asked = document.get("outputs", [])
    if not isinstance(asked, list):
        raise invalid("`outputs` is not a list: send [{\"name\": \"TOP_K_LABELS\"}, ...] or leave it out")
    outputs = {}
    for output in asked:
        output = _object(output, "an output")
        if not isinstance(output.get("name"), str):
            raise invalid(f"output {output!r} has no name")
        parameters = _object(output.get("parameters", {}), f"output {output['name']}'s parameters")
        outputs[output["name"]] = bool(parameters.get("binary_data", False))
    return outputs


def _json_data(array: np.ndarray) -> list:
    if array.dtype == np.object_:
        return [item.decode("utf-8", "replace") for item in array.reshape(-1)]
    return array.reshape(-1).tolist()


@dataclass(frozen=True)
class InferOptions:
    """What an inference request asks beside its inputs."""

    parameters: dict  # for the pipeline (server/edges/open_inference.py's PARAMETERS)
    outputs: dict[str, bool]  # the outputs asked for (none: all), each with whether it goes back as binary
    binary_all: bool  # outputs not named go back as binary data
    deadline: float | None


def infer_options(document: dict) -> InferOptions:
    parameters = dict(_object(document.get("parameters", {}), "the request's parameters"))
    binary_all = parameters.pop(BINARY_OUTPUT, False) is True
    timeout = parameters.pop(TIMEOUT, None)
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int)):
        raise invalid(f"parameter {TIMEOUT}={timeout!r}: expected microseconds as an integer")
    return InferOptions(parameters, _outputs(document), binary_all,
                        deadline_after(timeout, name=TIMEOUT, field="timeout_us", per_second=1_000_000))


def router(edge: Edge) -> APIRouter:
    routes = APIRouter(prefix="/v2", tags=["KServe v2"])

    def ready_response(ready: bool) -> Response:
        return Response(status_code=200 if ready else 503)

    async def about_server(method: str, request: Request, respond: Callable[[], Response], *, probe: bool):
        async def work(_call: HttpCall) -> Response:
            return respond()

        return await edge.answer(method, request, work, probe=probe)

    async def about_model(method: str, request: Request, name: str, version: str,
                          respond: Callable[[scoring_pb2.ModelSummary], Response]):
        async def work(_call: HttpCall) -> Response:
            return respond(find_model(edge.pipeline.models(), name, version))

        return await edge.answer(method, request, work, model=name)

    @routes.get("", summary="Server metadata")
    async def server_metadata(request: Request):
        return await about_server("ServerMetadata", request, lambda: JSONResponse(
            {"name": SERVER_NAME, "version": edge.version, "extensions": list(HTTP_EXTENSIONS)}), probe=False)

    @routes.get("/health/live", summary="200 while the server runs and is not draining")
    async def server_live(request: Request):
        return await about_server("ServerLive", request, lambda: ready_response(not edge.front.draining.is_set()),
                                  probe=True)

    @routes.get("/health/ready", summary="200 while health says SERVING; 503 warming up, draining, or the engine gone")
    async def server_ready(request: Request):
        return await about_server("ServerReady", request, lambda: ready_response(edge.ready), probe=True)

    @routes.get("/models/{name}", summary="Model metadata")
    @routes.get("/models/{name}/versions/{version}", summary="Model metadata")
    async def model_metadata(request: Request, name: str, version: str = ""):
        return await about_model("ModelMetadata", request, name, version, lambda summary: JSONResponse(
            {"name": summary.name, "versions": [MODEL_VERSION], "platform": PLATFORM,
             "inputs": [_spec(spec) for spec in model_inputs()],
             "outputs": [_spec(spec) for spec in model_outputs(summary)]}))

    @routes.get("/models/{name}/ready", summary="200 when the model is served and the server ready")
    @routes.get("/models/{name}/versions/{version}/ready", summary="200 when the model is served and the server ready")
    async def model_ready(request: Request, name: str, version: str = ""):
        return await about_model("ModelReady", request, name, version, lambda _summary: ready_response(edge.ready))

    @routes.get("/models/{name}/config", summary="Triton's model configuration")
    @routes.get("/models/{name}/versions/{version}/config", summary="Triton's model configuration")
    async def config(request: Request, name: str, version: str = ""):
        return await about_model("ModelConfig", request, name, version, lambda summary: JSONResponse(
            json_format.MessageToDict(model_config(summary), preserving_proto_field_name=True)))

    @routes.post("/models/{name}/infer", summary="Score one image (inputs and outputs: docs/scale-out.md)")
    @routes.post("/models/{name}/versions/{version}/infer", summary="Score one image")
    async def infer(request: Request, name: str, version: str = ""):
        async def work(call: HttpCall):
            document, binary = split_body(await edge.body(request), request.headers.get(HEADER_LENGTH),
                                          max_depth=edge.settings.http_max_json_depth)
            options = infer_options(document)
            call.deadline = options.deadline
            request_id = document.get("id", "")
            if not isinstance(request_id, str) or not _utf8(request_id):
                raise invalid(f"id {request_id!r}: expected a string of text UTF-8 can hold (no lone surrogate)")
            wanted = score_request(model=name, version=version, request_id=request_id,
                                   inputs=_inputs(document, binary), parameters=options.parameters,
                                   outputs=list(options.outputs))
            return _infer_response(await edge.score(call, wanted), request_id, options)

        return await edge.answer("ModelInfer", request, work, model=name)

    return routes


def _infer_response(response: scoring_pb2.ScoreResponse, request_id: str, options: InferOptions) -> Response:
    """The JSON answer, then the binary outputs after it (with `Inference-Header-Content-Length`)."""
    tensors, chunks = [], []
    for name, array in wanted_outputs(list(options.outputs), response).items():
        tensor = {"name": name, "datatype": datatype(array), "shape": list(array.shape)}
        if options.outputs.get(name, options.binary_all):
            chunk = raw_bytes(array)
            tensor["parameters"] = {BINARY_SIZE: len(chunk)}
            chunks.append(chunk)
        else:
            tensor["data"] = _json_data(array)
        tensors.append(tensor)
    answer = {"model_name": response.model, "model_version": MODEL_VERSION, "outputs": tensors,
              "parameters": response_parameters(response)}
    if request_id:
        answer["id"] = request_id
    header = json.dumps(answer).encode()  # NaN (a diagonal shift's holes) as JSON's NaN, as Python reads it
    if not chunks:
        return Response(header, media_type=JSON_TYPE)
    return Response(b"".join([header, *chunks]), media_type=BINARY_TYPE, headers={HEADER_LENGTH: str(len(header))})

