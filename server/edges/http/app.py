"""The HTTP face's app: scoremap's REST routes, KServe v2 REST, the viewer's static files, the OpenAPI document.

Swagger UI (/docs) and ReDoc are off: FastAPI loads them from a CDN, which a server without
internet access cannot reach; /openapi.json is served, for any OpenAPI tool to read.
"""

from __future__ import annotations

import importlib.util
import pathlib

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException
from starlette.middleware.gzip import GZipMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import Refusal
from server.edges.http import v1
from server.edges.http.edge import Edge

STATIC = pathlib.Path(__file__).with_name("static")
HEADERS_TOO_LARGE = 431  # Request Header Fields Too Large (RFC 6585)
GZIP_MIN_BYTES = 1024  # smaller answers are sent as they are: compressing them saves less than it costs


def _invalid_query(_request: Request, error: RequestValidationError) -> JSONResponse:
    """FastAPI's own check of the query (a stride that is not a number...) as 400 in our error shape."""
    problems = "; ".join(f"{'.'.join(str(part) for part in problem['loc'])}: {problem['msg']}"
                         for problem in error.errors())
    return JSONResponse({"error": f"{problems} (see /openapi.json)", "code": Refusal.INVALID_ARGUMENT.name},
                        status_code=400)


def _no_route(request: Request, error: HTTPException) -> JSONResponse:
    """Starlette's own refusals (an unknown path, a method a route does not take) in our error shape."""
    if error.status_code == 404:
        message = f"no route {request.method} {request.url.path}: the routes are listed in /openapi.json"
        code = Refusal.NOT_FOUND
    else:
        message = f"{request.method} {request.url.path}: {error.detail}"
        code = Refusal.INVALID_ARGUMENT
    return JSONResponse({"error": message, "code": code.name}, status_code=error.status_code, headers=error.headers)


class HeaderLimit:
    """Requests whose line and headers together pass `--http-max-header-bytes` answered 431, before any route.

    h11 holds an incomplete request head to the same bound (server/edges/http/serve.py); a head that came
    whole in one read is measured here, so the bound is the same however the bytes arrived."""

    def __init__(self, app: ASGIApp, *, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + sum(
                len(name) + len(value) + 4 for name, value in scope["headers"])  # "name: value\r\n"
            if size > self.limit:
                response = JSONResponse({"error": f"the request line and headers are {size} bytes, over this "
                                         f"server's limit of {self.limit} bytes (--http-max-header-bytes): send "
                                         "fewer or shorter headers", "code": Refusal.INVALID_ARGUMENT.name},
                                        status_code=HEADERS_TOO_LARGE, headers={"Connection": "close"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _without_422(app: FastAPI) -> None:
    """The OpenAPI document without FastAPI's 422 answers: a query it cannot read is 400 here (above)."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            for operations in generate()["paths"].values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
        return app.openapi_schema

    app.openapi = openapi


def create_app(edge: Edge) -> FastAPI:
    """Routes first, then the static files at / (index.html is the viewer)."""
    app = FastAPI(title="scoremap", version=edge.version, docs_url=None, redoc_url=None,
                  description="Dense score maps over HTTP: scoremap's REST routes (/v1), KServe v2 REST (/v2, "
                              "with the `triton` extra) and a score-map viewer (/).")
    app.add_exception_handler(RequestValidationError, _invalid_query)
    app.add_exception_handler(HTTPException, _no_route)
    _without_422(app)
    app.add_middleware(GZipMiddleware, minimum_size=GZIP_MIN_BYTES)  # for clients that Accept-Encoding gzip
    app.add_middleware(HeaderLimit, limit=edge.settings.http_max_header_bytes)  # outermost: first to look
    app.include_router(v1.router(edge))
    if importlib.util.find_spec("tritonclient") is not None:  # KServe v2's encodings are tritonclient's
        from server.edges.http import kserve_rest

        app.include_router(kserve_rest.router(edge))
    app.mount("/", StaticFiles(directory=STATIC, html=True), name="viewer")
    return app
