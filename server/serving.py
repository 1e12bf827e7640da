"""The composition root: `create_server` builds one server's pipeline, front, gRPC edge (with KServe v2)
and HTTP edge, and `ScoringServer.stop` drains and releases them all (gRPC's route_guide factory shape:
port 0 picks a free port, health SERVING only once the models are warm)."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos import LOOPBACK, scoring_pb2_grpc, version
from server.edges.exposure import token_problem
from server.engine.client import EngineClient
from server.edges.front import Front
from server.edges.grpc import kserve
from server.edges.grpc.interceptors import CallLimits, TokenInterceptor
from server.edges.grpc.service import SERVICE_NAME, DenseScoringServicer
from server.edges.refusal_pace import RefusalPacer
from server.errors import Refusal, ScoringError
from server.memory.python_heap import freeze_startup_heap
from server.metrics import Metrics
from server.scoring.pipeline import Pipeline
from server.settings import Settings

if TYPE_CHECKING:
    from server.edges.http import HttpServer

__all__ = ["ScoringServer", "create_server"]

LOG = logging.getLogger(__name__)
# gRPC cuts off requests above its receive limit with its own words, before any code of ours runs;
# set this many times above --max-message-bytes, the servicer refuses the requests in between with
# a message that names the flag. Larger ones still get gRPC's message.
RECEIVE_LIMIT_FACTOR = 2


class ScoringServer:
    """A started gRPC server with its pipeline, health, metrics; `stop` drains and releases them all.

    `warm_up_error` is set when a warm-up pass failed: health then stays NOT_SERVING for good.
    """

    def __init__(self, grpc_server: grpc.Server, *, front: Front, servicer: DenseScoringServicer,
                 health_servicer: health.HealthServicer, metrics_port: int | None,
                 http: HttpServer | None = None) -> None:
        self.grpc_server = grpc_server
        self.front = front
        self.pacer = front.pacer  # the refusal pace, which every edge of this server shares
        self.pipeline = front.pipeline
        self.servicer = servicer
        self.health = health_servicer
        self.metrics = front.metrics
        self.metrics_port = metrics_port
        self.http = http  # the HTTP face (--http-port), stopped with the gRPC server
        self.warm_up_error: ScoringError | None = None

    def stop(self, grace: float | None = None) -> threading.Event:
        """New calls UNAVAILABLE, in-flight ones get `grace` seconds; returns an event set when all is closed.

        The servicer refuses new calls itself (gRPC's own stop would answer them CANCELLED), and
        the gRPC server stops once the last in-flight call is answered or the grace period ends.
        """
        self.front.draining.set()
        self.health.enter_graceful_shutdown()
        done = threading.Event()

        def release() -> None:
            started = time.monotonic()

            def remaining() -> float:
                return max(0.0, grace - (time.monotonic() - started)) if grace else 0

            if grace:
                self.front.wait_idle(grace)
            # Calls accepted but not yet dispatched get what is left of the grace period; HTTP calls too.
            self.grpc_server.stop(remaining()).wait()
            if self.http is not None:
                self.http.stop(remaining())
            self.pipeline.close()
            self.metrics.close()
            done.set()

        threading.Thread(target=release, name="scoremap-release", daemon=True).start()
        return done

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self.grpc_server.wait_for_termination(timeout)


def server_options(settings: Settings) -> list[tuple[str, int]]:
    """gRPC channel arguments: message limits, connection lifetimes, keep-alive and its enforcement."""

    def ms(seconds: float) -> int:
        return int(1000 * seconds)

    return [
        ("grpc.max_receive_message_length", RECEIVE_LIMIT_FACTOR * settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        # A port already in use is an error, not silently shared, unless this is one of --workers' processes.
        ("grpc.so_reuseport", int(settings.reuse_port)),
        ("grpc.max_connection_idle_ms", ms(settings.connection_idle_seconds)),
        ("grpc.max_connection_age_ms", ms(settings.connection_age_seconds)),
        ("grpc.max_connection_age_grace_ms", ms(settings.connection_age_grace_seconds)),
        ("grpc.keepalive_time_ms", ms(settings.keepalive_seconds)),
        ("grpc.keepalive_timeout_ms", ms(settings.keepalive_timeout_seconds)),
        ("grpc.http2.min_ping_interval_without_data_ms", ms(settings.min_client_ping_seconds)),
    ]


def create_server(
    models: Sequence[str] | Mapping[str, str],
    *,
    address: str = f"{LOOPBACK}:0",
    settings: Settings | None = None,
    token: str | None = None,
    tls: tuple[bytes, bytes] | None = None,
    wait_until_ready: bool = True,
    engine: EngineClient | None = None,
) -> tuple[ScoringServer, int]:
    """Load the models (paths, or {name: path}) and serve on `address` (port 0: a free one); returns (server, port).

    `tls` is (certificate chain PEM, private key PEM); `token` turns on the bearer-token check.
    Health reports NOT_SERVING until every model has run its warm-up passes, then SERVING; if a
    warm-up pass fails it stays NOT_SERVING, the log says why and `server.warm_up_error` holds the
    error. With `wait_until_ready=False` the warm-up runs in the background after the port is
    open, so probes can watch it. `engine`: an engine process's client (a front process); health then
    follows the engine too: NOT_SERVING while it is gone, SERVING again once it is back and warm.
    """
    if token is not None and (problem := token_problem(token)):
        raise ValueError(f"the token {problem}; pass token=None to serve without one")
    settings = settings or Settings()
    settings.check()
    metrics = Metrics()
    pipeline = Pipeline(models, settings=dataclasses.replace(settings, warm_up=False), metrics=metrics, engine=engine)
    grpc_server = None
    try:
        if settings.warm_up:
            pipeline.check_warm_up()
        limits = CallLimits(total=settings.scoring_workers, per_peer=settings.max_calls_per_peer, metrics=metrics,
                            pacer=RefusalPacer.for_settings(settings))
        interceptors = [TokenInterceptor(token), limits] if token is not None else [limits]
        grpc_server = grpc.server(  # held refusals wait on threads of their own, counted beyond the call limit
            ThreadPoolExecutor(max_workers=settings.grpc_workers + settings.max_held_refusals, thread_name_prefix="rpc"),
            options=server_options(settings), interceptors=interceptors,
            maximum_concurrent_rpcs=settings.max_concurrent_rpcs + settings.max_held_refusals,
        )
        front = Front(pipeline, settings=settings, metrics=metrics, pacer=limits.pacer)
        servicer = DenseScoringServicer(front, limits=limits)
        scoring_pb2_grpc.add_DenseScoringServicer_to_server(servicer, grpc_server)
        health_servicer = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
        served = [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME]
        if kserve.add_to_server(grpc_server, servicer, health_servicer):  # KServe v2, with the `triton` extra
            served.append(kserve.SERVICE_NAME)
        for service in ("", SERVICE_NAME):
            health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        reflection.enable_server_reflection(served, grpc_server)
        try:
            if tls is not None:
                port = grpc_server.add_secure_port(address, grpc.ssl_server_credentials([(tls[1], tls[0])]))
            else:
                port = grpc_server.add_insecure_port(address)
        except RuntimeError as error:
            raise ScoringError(Refusal.UNAVAILABLE, f"could not bind {address} (in use?): {error}") from error
        metrics_port = None
        if settings.metrics_port is not None:
            try:
                metrics_port = metrics.serve(port=settings.metrics_port, address=settings.metrics_address)
            except OSError as error:
                where = f"{settings.metrics_address}:{settings.metrics_port}"
                raise ScoringError(Refusal.UNAVAILABLE,
                                   f"could not serve metrics on {where} (--metrics-port): {error.strerror}") from error
        grpc_server.start()
        http = None
        if settings.http_port is not None:  # the HTTP face: the same host, TLS and token
            from server.edges.http import serve as serve_http  # FastAPI is imported only when HTTP is on

            http = serve_http(front, host=address.rpartition(":")[0], port=settings.http_port, tls=tls, token=token,
                              reuse_port=settings.reuse_port,
                             version=version())
    except BaseException:
        if grpc_server is not None:
            grpc_server.stop(None)  # releases a port already bound
        pipeline.close()
        metrics.close()
        raise
    server = ScoringServer(grpc_server, front=front, servicer=servicer, health_servicer=health_servicer,
                           metrics_port=metrics_port, http=http)

    def engine_ready(_up: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if front.serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", SERVICE_NAME):
            health_servicer.set(service, status)

    pipeline.engine.on_ready = engine_ready

    def become_ready() -> None:
        if settings.warm_up:
            try:
                pipeline.warm_up()
            except ScoringError as error:
                server.warm_up_error = error
                LOG.error("warm-up failed, health stays NOT_SERVING: %s", error.message)
                return
            except Exception as error:  # a bug, but never a silent thread death with health stuck at NOT_SERVING
                server.warm_up_error = ScoringError(Refusal.INTERNAL, f"warm-up failed: {error}")
                LOG.exception("warm-up failed, health stays NOT_SERVING")
                return
        freeze_startup_heap()
        front.ready.set()
        if front.serving:
            for service in ("", SERVICE_NAME):
                health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
            LOG.info("ready: health SERVING")
        if settings.warm_up and engine is None and not front.draining.is_set():  # an engine process warms its own
            pipeline.warm_up_tiles()  # in the background: only images larger than every bucket use it

    if wait_until_ready:
        become_ready()
    else:
        threading.Thread(target=become_ready, name="scoremap-warm-up", daemon=True).start()
    return server, port
