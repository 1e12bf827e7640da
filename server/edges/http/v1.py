"""scoremap's own REST routes: the model list and cards, and `curl`-able scoring.

    curl -F image=@samples/cat.jpg 'http://HOST:PORT/v1/models/NAME/score?scales=384&stride=16&top_k=5'

The answer is the ScoreResponse in protobuf's JSON mapping (field names as in scoring.proto), so it
has the same fields as `Score`: tensors are {dtype, shape, data} with the data base64, and maps come
only with `maps=true`, as float16 unless `map_dtype=float32`. The query's options are those of
KServe v2's parameters (server/edges/open_inference.py), read by the same function.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from google.protobuf import json_format
from starlette.datastructures import UploadFile

from protos import scoring_pb2
from server.errors import Refusal, ScoringError
from protos import image_formats
from server.edges.open_inference import MAP_DTYPES, PARAMETERS, SHIFTS, apply_parameters
from server.edges.http.edge import Edge, HttpCall, deadline_after

IMAGE_FIELD = "image"
QUERY = (*PARAMETERS, "maps", "timeout_ms")  # the score route's query options, as its signature declares them
UPLOAD = {"requestBody": {"required": True, "content": {
    "multipart/form-data": {"schema": {"type": "object", "required": [IMAGE_FIELD], "properties": {
        IMAGE_FIELD: {"type": "string", "format": "binary",
                      "description": f"the encoded image: {image_formats.NAMES}"}}}},
    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}
ERRORS = {status: {"description": meaning, "content": {"application/json": {"example": {"error": "why, and what to do",
                                                                                          "code": code}}}}
          for status, meaning, code in ((400, "the request or its image is wrong", "INVALID_ARGUMENT"),
                                        (401, "missing or wrong bearer token", "UNAUTHENTICATED"),
                                        (404, "no such model", "NOT_FOUND"),
                                        (413, "over a size limit (--max-message-bytes, pixels, memory)",
                                         "RESOURCE_EXHAUSTED"),
                                        (429, "busy: retry after Retry-After seconds", "RESOURCE_EXHAUSTED"),
                                        (503, "warming up or shutting down", "UNAVAILABLE"),
                                        (504, "the timeout passed", "DEADLINE_EXCEEDED"))}


def as_json(message) -> dict:
    """A protobuf message in its JSON mapping with proto field names and every field present."""
    return json_format.MessageToDict(message, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)


def router(edge: Edge) -> APIRouter:
    routes = APIRouter(prefix="/v1", tags=["scoremap"], responses=ERRORS)

    @routes.get("/models", summary="The served models, each with its card (labels, preprocessing, geometry)")
    async def list_models(request: Request):
        async def work(_call: HttpCall):
            models = [{**as_json(summary), "card": as_json(edge.pipeline.card(summary.name))}
                      for summary in edge.pipeline.models()]
            return JSONResponse({"models": models})

        return await edge.answer("ListModels", request, work)

    @routes.get("/models/{name}", summary="One model's card")
    async def get_model(request: Request, name: str):
        async def work(_call: HttpCall):
            return JSONResponse(as_json(edge.pipeline.card(name)))

        return await edge.answer("GetModel", request, work, model=name)

    @routes.post("/models/{name}/score", summary="Score one image (multipart field `image`, or the body itself)",
                 openapi_extra=UPLOAD)
    async def score(
        request: Request,
        name: str,
        scales: Annotated[str | None, Query(description="target shorter sides, e.g. 384 or 384,512 "
                                                        "(default: the model's)")] = None,
        stride: Annotated[int | None, Query(description="output stride; 0: the model's own")] = None,
        shift: Annotated[Literal[tuple(SHIFTS)] | None, Query(description="how a finer stride is made")] = None,
        flip: Annotated[bool | None, Query(description="average with the mirrored image")] = None,
        top_k: Annotated[int | None, Query(description="image-level top-k (0: the server's default)")] = None,
        cell_top_k: Annotated[int | None, Query(description="per-cell top-k indices and scores")] = None,
        classes: Annotated[str | None, Query(description="maps for these classes only, e.g. 281,282")] = None,
        maps: Annotated[bool, Query(description="return the score maps (base64 tensors)")] = False,
        map_dtype: Annotated[Literal[tuple(MAP_DTYPES)], Query(description="the maps' element type")] = "float16",
        timeout_ms: Annotated[float | None, Query(description="answer DEADLINE_EXCEEDED (504) after this long")] = None,
    ):
        options = {key: value for key, value in (("scales", scales), ("stride", stride), ("shift", shift),
                                                 ("flip", flip), ("top_k", top_k), ("cell_top_k", cell_top_k),
                                                 ("classes", classes), ("map_dtype", map_dtype)) if value is not None}

        async def work(call: HttpCall):
            unknown = [key for key in request.query_params if key not in QUERY]
            if unknown:  # FastAPI ignores names its signature lacks: `?scale=512` would score at the default
                raise ScoringError(Refusal.INVALID_ARGUMENT, f"unknown query option {unknown[0]!r}: this route "
                                   f"takes {', '.join(QUERY)}")
            call.deadline = deadline_after(timeout_ms, name="timeout_ms", field="timeout_ms", per_second=1000)
            wanted = scoring_pb2.ScoreRequest(model=name, return_maps=maps, encoded=await _image(edge, request))
            apply_parameters(wanted, options)
            return JSONResponse(as_json(await edge.score(call, wanted)))

        return await edge.answer("Score", request, work, model=name)

    return routes


async def _image(edge: Edge, request: Request) -> bytes:
    """The image from the multipart field `image`, or the whole body when it is not a form."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        return await edge.body(request)
    form = await edge.form(request)
    upload = form.get(IMAGE_FIELD)
    if not isinstance(upload, UploadFile):
        fields = ", ".join(form.keys()) or "none"
        raise ScoringError(Refusal.INVALID_ARGUMENT, f"no file in the multipart field {IMAGE_FIELD!r} (fields: "
                           f"{fields}): send it as `curl -F {IMAGE_FIELD}=@photo.jpg URL`")
    try:
        return await upload.read()
    finally:
        await upload.close()
