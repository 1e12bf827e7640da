"""uvicorn serving the HTTP app in a thread of the scoring server's process, on a socket bound here.

The socket is bound before uvicorn starts, so port 0 works and a port in use is refused at once;
TLS is the gRPC port's certificate and key (PEM bytes), loaded into one `ssl.SSLContext`.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import tempfile
import threading
import time

import uvicorn
from fastapi import FastAPI

from server.errors import Refusal, ScoringError

LOG = logging.getLogger(__name__)
START_SECONDS = 30.0  # uvicorn starts in well under a second; a slow machine gets this long
JOIN_MARGIN_SECONDS = 5.0  # past the grace period, for uvicorn to close its connections
# uvicorn closes idle keep-alive connections as it stops, yet with no time at all to see them go it
# logs an error for them: even a stop without grace waits this long.
MIN_GRACE_SECONDS = 0.5


def tls_context(certificate: bytes, key: bytes) -> ssl.SSLContext:
    """A server context from PEM bytes (the ssl module reads them from files only: private ones, removed at once)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    with tempfile.TemporaryDirectory(prefix="scoremap-tls-") as folder:
        paths = []
        for name, data in (("cert.pem", certificate), ("key.pem", key)):
            path = os.path.join(folder, name)
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as handle:
                handle.write(data)
            paths.append(path)
        context.load_cert_chain(*paths)
    return context


def bind(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A listening socket on host:port (port 0: a free one), shared with other processes when `reuse_port`;
    UNAVAILABLE naming --http-port when it cannot.

    Its protocol is IPPROTO_TCP by name: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on accepted
    sockets whose `proto` says TCP, and an accepted socket takes the listening one's. With `proto` 0, as
    `socket.create_server` makes it, an answer's body (h11 sends the headers, then the body) waited for the
    client's delayed ACK, about 40 ms an answer."""
    host = host.strip("[]")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        made = socket.create_server((host, port), family=family, reuse_port=reuse_port)
        return socket.socket(made.family, made.type, socket.IPPROTO_TCP, fileno=made.detach())
    except OSError as error:
        raise ScoringError(Refusal.UNAVAILABLE, f"could not serve HTTP on {host}:{port} (--http-port): "
                           f"{error.strerror or error}") from error


class HttpServer:
    """The app served by uvicorn in a daemon thread; `stop` lets calls in flight finish within a grace period."""

    def __init__(self, app: FastAPI, *, host: str, port: int, tls: tuple[bytes, bytes] | None,
                 max_header_bytes: int, reuse_port: bool = False) -> None:
        sock = bind(host, port, reuse_port=reuse_port)
        self.port: int = sock.getsockname()[1]
        self.scheme = "https" if tls else "http"
        context = tls_context(*tls) if tls else None
        config = uvicorn.Config(
            app, lifespan="off", log_config=None, access_log=False, server_header=False,
            # h11 by name, whose bound on the request line and headers (--http-max-header-bytes) is configurable.
            http="h11", h11_max_incomplete_event_size=max_header_bytes,
            proxy_headers=False,  # the peer is the socket's address, as gRPC's: no X-Forwarded-For from anyone
            ssl_context_factory=(lambda _config, _default: context) if context else None,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, name="scoremap-http",
                                        daemon=True)
        self._thread.start()
        give_up = time.monotonic() + START_SECONDS
        while not self._server.started and self._thread.is_alive() and time.monotonic() < give_up:
            time.sleep(0.01)
        if not self._server.started:
            self._server.should_exit = True
            sock.close()
            raise ScoringError(Refusal.UNAVAILABLE, f"the HTTP server on {host}:{self.port} did not start; "
                               "the log says why")

    def stop(self, grace: float) -> None:
        """Refuse new connections, give calls in flight `grace` seconds, then close them."""
        self._server.config.timeout_graceful_shutdown = max(grace, MIN_GRACE_SECONDS)
        self._server.should_exit = True
        self._thread.join(max(grace, MIN_GRACE_SECONDS) + JOIN_MARGIN_SECONDS)
