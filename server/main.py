"""`scoremap-serve MODEL.onnx [MODEL2.onnx ...]`: the dense scoring server.

`create_server` is the factory tests and demos use (port 0 picks a free port); `main` adds flags,
TLS, the bearer token, the metrics endpoint and SIGTERM draining: health goes NOT_SERVING, new
calls get UNAVAILABLE, in-flight calls get `--grace-seconds` to finish, then the process exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from convert.profile import ProfileError, parse_bytes
from protos import scoring_pb2_grpc
from server.errors import ScoringError
from server.metrics import Metrics
from server.pipeline import Pipeline
from server.service import SERVICE_NAME, DenseScoringServicer, TokenInterceptor
from server.settings import Settings

LOG = logging.getLogger("scoremap.serve")
DEFAULT_PORT = 50051
TOKEN_ENV = "SCOREMAP_TOKEN"


class ScoringServer:
    """A started gRPC server with its pipeline, health, metrics; `stop` drains and releases them all."""

    def __init__(self, grpc_server: grpc.Server, *, pipeline: Pipeline, servicer: DenseScoringServicer,
                 health_servicer: health.HealthServicer, metrics: Metrics, metrics_port: int | None) -> None:
        self.grpc_server = grpc_server
        self.pipeline = pipeline
        self.servicer = servicer
        self.health = health_servicer
        self.metrics = metrics
        self.metrics_port = metrics_port

    def stop(self, grace: float | None = None) -> threading.Event:
        """New calls UNAVAILABLE, in-flight ones get `grace` seconds; returns an event set when all is closed.

        The servicer refuses new calls itself (gRPC's own stop would answer them CANCELLED), and
        the gRPC server stops once the last in-flight call is answered or the grace period ends.
        """
        self.servicer.draining.set()
        self.health.enter_graceful_shutdown()
        done = threading.Event()

        def release() -> None:
            started = time.monotonic()
            if grace:
                self.servicer.wait_idle(grace)
            # Calls accepted but not yet dispatched get what is left of the grace period.
            remaining = max(0.0, grace - (time.monotonic() - started)) if grace else 0
            self.grpc_server.stop(remaining).wait()
            self.pipeline.close()
            self.metrics.close()
            done.set()

        threading.Thread(target=release, name="scoremap-release", daemon=True).start()
        return done

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self.grpc_server.wait_for_termination(timeout)


def create_server(
    model_paths: Sequence[str],
    *,
    address: str = "127.0.0.1:0",
    settings: Settings | None = None,
    token: str | None = None,
    tls: tuple[bytes, bytes] | None = None,
    wait_until_ready: bool = True,
) -> tuple[ScoringServer, int]:
    """Load the models and serve on `address` (port 0: a free one); returns (server, port).

    `tls` is (certificate chain PEM, private key PEM); `token` turns on the bearer-token check.
    Health reports NOT_SERVING until every model has run its warm-up passes, then SERVING; with
    `wait_until_ready=False` the warm-up runs in the background after the port is open, so probes
    can watch it.
    """
    settings = settings or Settings()
    metrics = Metrics()
    pipeline = Pipeline(model_paths, settings=dataclasses.replace(settings, warm_up=False), metrics=metrics)
    try:
        options = [
            ("grpc.max_receive_message_length", settings.max_message_bytes),
            ("grpc.max_send_message_length", settings.max_message_bytes),
            ("grpc.so_reuseport", 0),  # a port already in use is an error, not silently shared
        ]
        interceptors = [TokenInterceptor(token)] if token else []
        grpc_server = grpc.server(
            ThreadPoolExecutor(max_workers=settings.grpc_workers, thread_name_prefix="rpc"),
            options=options, interceptors=interceptors, maximum_concurrent_rpcs=settings.max_concurrent_rpcs,
        )
        servicer = DenseScoringServicer(pipeline, settings=settings, metrics=metrics)
        scoring_pb2_grpc.add_DenseScoringServicer_to_server(servicer, grpc_server)
        health_servicer = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
        for service in ("", SERVICE_NAME):
            health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), grpc_server)
        try:
            if tls is not None:
                port = grpc_server.add_secure_port(address, grpc.ssl_server_credentials([(tls[1], tls[0])]))
            else:
                port = grpc_server.add_insecure_port(address)
        except RuntimeError as error:
            raise ScoringError(grpc.StatusCode.UNAVAILABLE, f"could not bind {address} (in use?): {error}") from error
        metrics_port = None
        if settings.metrics_port is not None:
            metrics_port = metrics.serve(port=settings.metrics_port, address=settings.metrics_address)
        grpc_server.start()
    except BaseException:
        pipeline.close()
        metrics.close()
        raise
    server = ScoringServer(grpc_server, pipeline=pipeline, servicer=servicer, health_servicer=health_servicer,
                           metrics=metrics, metrics_port=metrics_port)

    def become_ready() -> None:
        if settings.warm_up:
            pipeline.warm_up()
        if not servicer.draining.is_set():
            for service in ("", SERVICE_NAME):
                health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
            LOG.info("ready: health SERVING")

    if wait_until_ready:
        become_ready()
    else:
        threading.Thread(target=become_ready, name="scoremap-warm-up", daemon=True).start()
    return server, port


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    defaults = Settings()
    parser = argparse.ArgumentParser(prog="scoremap-serve", description=__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("models", nargs="+", help="converted .onnx files (scoremap-convert)")
    net = parser.add_argument_group("network and security")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes the server)")
    net.add_argument("--port", type=int, default=DEFAULT_PORT, help="port; 0 picks a free one and prints it")
    net.add_argument("--tls-cert", help="PEM certificate chain; with --tls-key serves TLS")
    net.add_argument("--tls-key", help="PEM private key")
    net.add_argument("--token-file", help=f"file holding the bearer token callers must send (or set ${TOKEN_ENV})")
    net.add_argument("--max-message-bytes", type=int, default=defaults.max_message_bytes)
    net.add_argument("--grpc-workers", type=int, default=defaults.grpc_workers)
    net.add_argument("--max-concurrent-rpcs", type=int, default=defaults.max_concurrent_rpcs,
                     help="calls running or waiting for a worker thread; beyond it RESOURCE_EXHAUSTED")
    net.add_argument("--grace-seconds", type=float, default=defaults.grace_seconds,
                     help="on SIGTERM, how long in-flight calls get to finish")
    net.add_argument("--metrics-port", type=int, default=defaults.metrics_port,
                     help="Prometheus /metrics port (0: a free one); off when not given")
    net.add_argument("--metrics-address", default=defaults.metrics_address)
    requests = parser.add_argument_group("request limits")
    requests.add_argument("--max-image-pixels", type=int, default=defaults.max_image_pixels,
                          help="decoded images above this many pixels are refused (decompression bombs)")
    requests.add_argument("--max-resized-pixels", type=int, default=defaults.max_resized_pixels)
    requests.add_argument("--max-scales", type=int, default=defaults.max_scales)
    requests.add_argument("--min-scale", type=int, default=defaults.min_scale)
    requests.add_argument("--max-scale", type=int, default=defaults.max_scale)
    batching = parser.add_argument_group("batching and memory")
    batching.add_argument("--max-batch", type=int, default=defaults.max_batch,
                          help="1 turns batching off (default: 8 on a GPU, 1 on the CPU)")
    batching.add_argument("--max-queue-delay-ms", type=float, default=defaults.max_queue_delay_ms)
    batching.add_argument("--queue-depth", type=int, default=defaults.queue_depth,
                          help="passes waiting per model before RESOURCE_EXHAUSTED")
    batching.add_argument("--stream-window", type=int, default=defaults.stream_window)
    batching.add_argument("--memory-budget", help="predicted peak memory allowed per batch, e.g. 2GiB "
                          "(default: the GPU's free memory, or half the available RAM on the CPU)")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--provider", choices=("auto", "cuda", "cpu"), default=defaults.provider)
    engine.add_argument("--require-gpu", action="store_true", help="refuse to start unless CUDA really loads")
    engine.add_argument("--cudnn-conv-algo-search", choices=("HEURISTIC", "EXHAUSTIVE", "DEFAULT"),
                        default=defaults.cudnn_conv_algo_search)
    engine.add_argument("--intra-op-threads", type=int, default=defaults.intra_op_threads)
    engine.add_argument("--inter-op-threads", type=int, default=defaults.inter_op_threads)
    engine.add_argument("--no-warm-up", action="store_true", help="report SERVING without warm-up passes")
    engine.add_argument("--warm-up-scales", type=int, nargs="*", default=list(defaults.warm_up_scales))
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    budget = None
    if args.memory_budget:
        try:
            budget = parse_bytes(args.memory_budget)
        except (ProfileError, ValueError) as error:
            raise SystemExit(f"scoremap-serve: --memory-budget: {error}") from error
    return dataclasses.replace(
        Settings(),
        max_image_pixels=args.max_image_pixels, max_message_bytes=args.max_message_bytes,
        max_scales=args.max_scales, min_scale=args.min_scale, max_scale=args.max_scale,
        max_resized_pixels=args.max_resized_pixels, max_batch=args.max_batch,
        max_queue_delay_ms=args.max_queue_delay_ms, queue_depth=args.queue_depth, stream_window=args.stream_window,
        memory_budget_bytes=budget, provider=args.provider, require_gpu=args.require_gpu,
        cudnn_conv_algo_search=args.cudnn_conv_algo_search, intra_op_threads=args.intra_op_threads,
        inter_op_threads=args.inter_op_threads, warm_up=not args.no_warm_up,
        warm_up_scales=tuple(args.warm_up_scales), grpc_workers=args.grpc_workers,
        max_concurrent_rpcs=args.max_concurrent_rpcs,
        grace_seconds=args.grace_seconds, metrics_port=args.metrics_port, metrics_address=args.metrics_address,
    )


def read_token(args: argparse.Namespace) -> str | None:
    if args.token_file:
        with open(args.token_file) as handle:
            return handle.read().strip() or None
    return os.environ.get(TOKEN_ENV) or None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    settings = settings_from(args)
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("scoremap-serve: --tls-cert and --tls-key go together")
    tls = None
    if args.tls_cert:
        with open(args.tls_cert, "rb") as cert, open(args.tls_key, "rb") as key:
            tls = (cert.read(), key.read())
    try:
        server, port = create_server(
            args.models, address=f"{args.host}:{args.port}", settings=settings, token=read_token(args), tls=tls,
            wait_until_ready=False,
        )
    except ScoringError as error:
        LOG.error("cannot start: %s", error.message)
        return 2
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    sys.stdout.write(f"scoremap-serve listening on {args.host}:{port}\n")
    if server.metrics_port is not None:
        sys.stdout.write(f"scoremap-serve metrics on http://{settings.metrics_address}:{server.metrics_port}/metrics\n")
    sys.stdout.flush()
    LOG.info("serving %s on %s:%d (%s)", ", ".join(m.name for m in server.pipeline.models()), args.host, port,
             server.pipeline.provider(server.pipeline.models()[0].name))
    while not stop.wait(0.1):
        pass
    LOG.info("draining: new calls get UNAVAILABLE, %d in-flight calls have %.1f s",
             server.servicer.active, settings.grace_seconds)
    server.stop(settings.grace_seconds).wait()
    LOG.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
