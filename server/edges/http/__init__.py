"""The HTTP face of the scoring server: one port beside gRPC, the same Pipeline and rules.

    serve(front, host=..., port=..., tls=..., token=..., version=...) -> HttpServer

edge.py does per call, over the server's Front, what the gRPC servicer and interceptors do (token, call limits, readiness,
metrics, statuses); v1.py is scoremap's REST routes, kserve_rest.py KServe v2 over REST, app.py
puts them and the viewer's static files (static/) together, serve.py runs uvicorn in a thread.
"""

from __future__ import annotations

from server.edges.front import Front
from server.edges.http.app import create_app
from server.edges.http.edge import Edge
from server.edges.http.serve import HttpServer

__all__ = ["HttpServer", "serve"]


def serve(front: Front, *, host: str, port: int, tls: tuple[bytes, bytes] | None,
          token: str | None, version: str, reuse_port: bool = False) -> HttpServer:
    """Serve the HTTP face of `front`'s pipeline on host:port (0: a free one), with its TLS and token."""
    return HttpServer(create_app(Edge(front, token=token, version=version)), host=host, port=port, tls=tls,
                      max_header_bytes=front.settings.http_max_header_bytes, reuse_port=reuse_port)
