"""`scoremap-serve [NAME=]MODEL.onnx ...`: the dense scoring server.

`create_server` is the factory tests and demos use (port 0 picks a free port); `main` adds flags,
TLS, the bearer token, the metrics endpoint and SIGTERM draining: health goes NOT_SERVING, new
calls get UNAVAILABLE, in-flight calls get `--grace-seconds` to finish, then the process exits 0.
Nothing heavy (grpc, onnxruntime, numpy) is imported before the command line is parsed, so
`--help` and usage errors answer at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import ipaddress
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from importlib import metadata
from typing import TYPE_CHECKING

from server.settings import Settings

if TYPE_CHECKING:
    import grpc
    from grpc_health.v1 import health

    from server.errors import ScoringError
    from server.metrics import Metrics
    from server.pipeline import Pipeline
    from server.service import DenseScoringServicer
    from server.web import HttpServer

LOG = logging.getLogger("scoremap.serve")
DEFAULT_PORT = 50051
TOKEN_ENV = "SCOREMAP_TOKEN"
# gRPC cuts off requests above its receive limit with its own words, before any code of ours runs;
# set this many times above --max-message-bytes, the servicer refuses the requests in between with
# a message that names the flag (issue 10, item 8). Larger ones still get gRPC's message.
RECEIVE_LIMIT_FACTOR = 2
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
DESCRIPTION = """\
Serve converted models (scoremap-convert) over gRPC: scoremap.v1.DenseScoring, the standard
health service and reflection. Give each model as a path, or as NAME=PATH to serve it under another
name than its card's (two versions of one model side by side). Binds 127.0.0.1 unless --host says
otherwise; beyond loopback it wants TLS or a token (or --insecure).

exit status: 0 stopped by SIGTERM/SIGINT after draining; 2 refused to start (bad command line,
unreadable or empty token, port in use, unloadable model); 3 a warm-up pass failed, so the server
could never report SERVING."""


class StartRefused(Exception):
    """Why the server will not start, in one line for the user (exit status 2)."""


class ScoringServer:
    """A started gRPC server with its pipeline, health, metrics; `stop` drains and releases them all.

    `warm_up_error` is set when a warm-up pass failed: health then stays NOT_SERVING for good.
    """

    def __init__(self, grpc_server: grpc.Server, *, pipeline: Pipeline, servicer: DenseScoringServicer,
                 health_servicer: health.HealthServicer, metrics: Metrics, metrics_port: int | None,
                 http: HttpServer | None = None) -> None:
        self.grpc_server = grpc_server
        self.pipeline = pipeline
        self.servicer = servicer
        self.health = health_servicer
        self.metrics = metrics
        self.metrics_port = metrics_port
        self.http = http  # the HTTP face (--http-port), stopped with the gRPC server
        self.warm_up_error: ScoringError | None = None

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

            def remaining() -> float:
                return max(0.0, grace - (time.monotonic() - started)) if grace else 0

            if grace:
                self.servicer.wait_idle(grace)
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
        ("grpc.so_reuseport", 0),  # a port already in use is an error, not silently shared
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
    address: str = "127.0.0.1:0",
    settings: Settings | None = None,
    token: str | None = None,
    tls: tuple[bytes, bytes] | None = None,
    wait_until_ready: bool = True,
) -> tuple[ScoringServer, int]:
    """Load the models (paths, or {name: path}) and serve on `address` (port 0: a free one); returns (server, port).

    `tls` is (certificate chain PEM, private key PEM); `token` turns on the bearer-token check.
    Health reports NOT_SERVING until every model has run its warm-up passes, then SERVING; if a
    warm-up pass fails it stays NOT_SERVING, the log says why and `server.warm_up_error` holds the
    error. With `wait_until_ready=False` the warm-up runs in the background after the port is
    open, so probes can watch it.
    """
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    from protos import scoring_pb2_grpc
    from server.errors import Refusal, ScoringError
    from server.metrics import Metrics
    from server.pipeline import Pipeline
    from server import kserve
    from server.service import SERVICE_NAME, CallLimits, DenseScoringServicer, TokenInterceptor

    if token is not None and (problem := token_problem(token)):
        raise ValueError(f"the token {problem}; pass token=None to serve without one")
    settings = settings or Settings()
    settings.check_call_limits()
    metrics = Metrics()
    pipeline = Pipeline(models, settings=dataclasses.replace(settings, warm_up=False), metrics=metrics)
    grpc_server = None
    try:
        limits = CallLimits(total=settings.scoring_workers, per_peer=settings.max_calls_per_peer, metrics=metrics)
        interceptors = [TokenInterceptor(token), limits] if token is not None else [limits]
        grpc_server = grpc.server(
            ThreadPoolExecutor(max_workers=settings.grpc_workers, thread_name_prefix="rpc"),
            options=server_options(settings), interceptors=interceptors,
            maximum_concurrent_rpcs=settings.max_concurrent_rpcs,
        )
        servicer = DenseScoringServicer(pipeline, settings=settings, metrics=metrics)
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
        if settings.http_port is not None:  # the HTTP face (issue 21): the same host, TLS and token
            from server import web

            http = web.serve(servicer, host=address.rpartition(":")[0], port=settings.http_port, tls=tls, token=token,
                             version=version())
    except BaseException:
        if grpc_server is not None:
            grpc_server.stop(None)  # releases a port already bound
        pipeline.close()
        metrics.close()
        raise
    server = ScoringServer(grpc_server, pipeline=pipeline, servicer=servicer, health_servicer=health_servicer,
                           metrics=metrics, metrics_port=metrics_port, http=http)

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
        servicer.ready.set()
        if not servicer.draining.is_set():
            for service in ("", SERVICE_NAME):
                health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
            LOG.info("ready: health SERVING")

    if wait_until_ready:
        become_ready()
    else:
        threading.Thread(target=become_ready, name="scoremap-warm-up", daemon=True).start()
    return server, port


# --- command line ---------------------------------------------------------------------------------
class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Each default printed once: not for flags whose help already speaks of it, nor empty ones."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        empty = action.default is None or action.default is False or action.default in ([], ())
        if empty or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def version() -> str:
    try:
        return metadata.version("scoremap")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    defaults = Settings()
    parser = argparse.ArgumentParser(prog="scoremap-serve", description=DESCRIPTION, formatter_class=HelpFormatter)
    parser.add_argument("models", nargs="+", metavar="[NAME=]MODEL.onnx",
                        help="converted .onnx files; NAME=PATH serves one under NAME instead of its card's name "
                             "(name every model or none)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    net = parser.add_argument_group("network and security")
    net.add_argument("--host", metavar="ADDRESS", default="127.0.0.1",
                     help="address to bind; beyond loopback (e.g. 0.0.0.0) it needs TLS or a token, or --insecure")
    net.add_argument("--port", metavar="PORT",
                     type=int, default=DEFAULT_PORT, help="port; 0 picks a free one and prints it")
    net.add_argument("--tls-cert", metavar="PATH", help="PEM certificate chain; with --tls-key serves TLS")
    net.add_argument("--tls-key", metavar="PATH", help="PEM private key")
    net.add_argument("--token-file", metavar="PATH",
                     help=f"file holding the bearer token callers must send (or set ${TOKEN_ENV}); "
                          "an empty or unreadable one refuses to start")
    net.add_argument("--insecure", action="store_true",
                     help="allow a --host beyond loopback with neither TLS nor a token (your own network only)")
    net.add_argument("--expose-paths", action="store_true", help="ListModels tells callers each model's file path")
    net.add_argument("--max-message-bytes", metavar="BYTES", type=int, default=defaults.max_message_bytes,
                     help="largest request or response; larger requests are refused naming this flag")
    net.add_argument("--grpc-workers", metavar="N", type=int, default=defaults.grpc_workers,
                     help="threads answering calls (each waits on its batch, so more than cores)")
    net.add_argument("--reserved-workers", metavar="N", type=int, default=defaults.reserved_workers,
                     help="workers kept from scoring calls so health probes are always answered")
    net.add_argument("--max-concurrent-rpcs", metavar="N", type=int, default=defaults.max_concurrent_rpcs,
                     help="calls running or waiting for a worker thread; beyond it RESOURCE_EXHAUSTED")
    net.add_argument("--max-calls-per-peer", metavar="N", type=int, default=defaults.max_calls_per_peer,
                     help="calls one client address may have running at once (0: no limit)")
    net.add_argument("--stream-idle-seconds", metavar="SECONDS", type=float, default=defaults.stream_idle_seconds,
                     help="a ScoreStream with no request (and every answer sent) for this long is ended")
    net.add_argument("--connection-idle-seconds", metavar="SECONDS",
                     type=float, default=defaults.connection_idle_seconds,
                     help="a connection with no call for this long is closed (clients reconnect)")
    net.add_argument("--connection-age-seconds", metavar="SECONDS", type=float, default=defaults.connection_age_seconds,
                     help="connections are closed after this long, so clients spread over replicas")
    net.add_argument("--connection-age-grace-seconds", metavar="SECONDS",
                     type=float, default=defaults.connection_age_grace_seconds,
                     help="calls still running when their connection reaches its age get this long")
    net.add_argument("--keepalive-seconds", metavar="SECONDS", type=float, default=defaults.keepalive_seconds,
                     help="the server pings each connection this often, so vanished clients' calls end")
    net.add_argument("--keepalive-timeout-seconds", metavar="SECONDS",
                     type=float, default=defaults.keepalive_timeout_seconds,
                     help="an unanswered ping closes its connection after this long")
    net.add_argument("--min-client-ping-seconds", metavar="SECONDS",
                     type=float, default=defaults.min_client_ping_seconds,
                     help="clients pinging more often (while no data flows) are told to go away")
    net.add_argument("--grace-seconds", metavar="SECONDS", type=float, default=defaults.grace_seconds,
                     help="on SIGTERM, how long in-flight calls get to finish")
    net.add_argument("--http-port", metavar="PORT", type=int, default=defaults.http_port,
                     help="also serve HTTP on this port of --host, with the same TLS, token and limits: KServe v2 "
                          "REST, /v1 scoring for curl, the score-map viewer at / (0 picks a free one; default: off)")
    net.add_argument("--http-body-idle-seconds", metavar="SECONDS", type=float,
                     default=defaults.http_body_idle_seconds,
                     help="an HTTP call whose body stops arriving for this long gets 408 and is closed")
    net.add_argument("--metrics-port", metavar="PORT", type=int, default=defaults.metrics_port,
                     help="Prometheus /metrics port (0: a free one); off when not given")
    net.add_argument("--metrics-address", metavar="ADDRESS", default=defaults.metrics_address,
                     help="address the metrics endpoint binds")
    requests = parser.add_argument_group("request limits")
    requests.add_argument("--max-image-pixels", metavar="N", type=int, default=defaults.max_image_pixels,
                          help="decoded images above this many pixels are refused (decompression bombs)")
    requests.add_argument("--max-resized-pixels", metavar="N", type=int, default=defaults.max_resized_pixels,
                          help="resized images above this many pixels are refused (a huge scale on a panorama)")
    requests.add_argument("--host-memory-budget", metavar="SIZE",
                          help="host memory the requests in flight may hold together (their estimates), e.g. 8GiB "
                               "(default: a quarter of the available RAM, at least one largest request)")
    requests.add_argument("--max-request-host-bytes", metavar="SIZE",
                          help="host memory one request may hold, estimated from the image header before decoding, "
                               f"e.g. 4GiB (default: {defaults.max_request_host_bytes // 2**30} GiB)")
    requests.add_argument("--max-scales", metavar="N",
                          type=int, default=defaults.max_scales, help="scales one request may ask for")
    requests.add_argument("--min-scale", metavar="N", type=int, default=defaults.min_scale,
                          help="smallest target shorter side, in pixels (default: each model's training size, "
                               "the least it can take)")
    requests.add_argument("--max-scale", metavar="N", type=int, default=defaults.max_scale,
                          help="largest target shorter side, in pixels")
    batching = parser.add_argument_group("batching and memory")
    batching.add_argument("--max-batch", metavar="N", type=int, default=defaults.max_batch,
                          help="images of one canvas run together, up to this many; 1 turns batching off "
                               "(default: 8 on a GPU, 1 on the CPU)")
    batching.add_argument("--max-queue-delay-ms", metavar="MS", type=float, default=defaults.max_queue_delay_ms,
                          help="how long the first image of a batch waits for others of its canvas")
    batching.add_argument("--queue-depth", metavar="N", type=int, default=defaults.queue_depth,
                          help="images (a scale or its mirror) waiting per model before RESOURCE_EXHAUSTED")
    batching.add_argument("--max-queue-ms", metavar="MS", type=float, default=defaults.max_queue_ms,
                          help="longest a request may wait before its first image runs; one not expected to "
                               "start within it (less one item's time, at most half, when items wait "
                               "ahead) is refused before decoding")
    batching.add_argument("--stream-window", metavar="N", type=int, default=defaults.stream_window,
                          help="requests of one ScoreStream scored at once (answers stay in order)")
    batching.add_argument("--memory-budget", metavar="SIZE", help="predicted peak memory allowed per batch, e.g. 2GiB "
                          "(default: the GPU's free memory, or half the available RAM on the CPU)")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--provider", choices=("auto", "cuda", "cpu"), default=defaults.provider,
                        help="auto: CUDA when it really loads, else the CPU")
    engine.add_argument("--require-gpu", action="store_true", help="refuse to start unless CUDA really loads")
    engine.add_argument("--cudnn-conv-algo-search", choices=("HEURISTIC", "EXHAUSTIVE", "DEFAULT"),
                        default=defaults.cudnn_conv_algo_search,
                        help="CUDA convolution algorithm search (EXHAUSTIVE re-tunes per shape)")
    engine.add_argument("--intra-op-threads", metavar="N", type=int, default=defaults.intra_op_threads,
                        help="onnxruntime threads inside one op (0: onnxruntime chooses)")
    engine.add_argument("--inter-op-threads", metavar="N", type=int, default=defaults.inter_op_threads,
                        help="onnxruntime threads across ops (0: onnxruntime chooses)")
    engine.add_argument("--shape-buckets", type=shape_buckets, default=defaults.shape_buckets, metavar="HxW,...",
                        help="canvas sizes images are padded to, e.g. 384x512,512x384 "
                             "(default: the warm-up scales at common aspect ratios)")
    engine.add_argument("--strict-shapes", action="store_true",
                        help="refuse an image no bucket holds instead of planning its shape on demand")
    engine.add_argument("--max-plans", metavar="N", type=int, default=defaults.max_plans,
                        help="plans (sessions of one shape) each model keeps; the least recently used goes")
    engine.add_argument("--decode-threads", metavar="N", type=int, default=defaults.decode_threads,
                        help="threads decoding and resizing images (0: one per CPU core)")
    engine.add_argument("--no-warm-up", action="store_true", help="report SERVING without warm-up passes")
    engine.add_argument("--warm-up-scales", metavar="SCALE", type=int, nargs="*", default=list(defaults.warm_up_scales),
                        help="scales to warm up before SERVING (default: each model's default scale)")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                        help="how much the log on stderr says")
    return parser


def shape_buckets(text: str) -> tuple[tuple[int, int], ...]:
    """ "384x512,512x384" -> ((384, 512), (512, 384))."""
    try:
        sizes = tuple(tuple(int(side) for side in item.lower().split("x")) for item in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or any(len(size) != 2 or min(size) <= 0 for size in sizes):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected sizes HEIGHTxWIDTH separated by commas, e.g. 384x512,512x384"
        )
    return sizes


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.models = model_sources(args.models)
    except ValueError as error:
        parser.error(str(error))
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    return args


def model_sources(values: Sequence[str]) -> list[str] | dict[str, str]:
    """The model arguments: paths, or {name: path} when each is NAME=PATH (an existing file is always a path)."""
    named: dict[str, str] = {}
    for value in values:
        name, equals, path = value.partition("=")
        if equals and MODEL_NAME.fullmatch(name) and path and not os.path.exists(value):
            if name in named:
                raise ValueError(f"two models are named {name!r} ({named[name]} and {path}): give each its own NAME")
            named[name] = path
    if not named:
        return list(values)
    if len(named) != len(values):
        unnamed = [value for value in values if value.partition("=")[0] not in named]
        raise ValueError(f"name every model or none: {', '.join(unnamed)} has no NAME= while others do")
    return named


def settings_from(args: argparse.Namespace) -> Settings:
    """The flags as Settings: every flag named after a field sets it; the others are converted here."""
    fields = {field.name for field in dataclasses.fields(Settings)}
    values = {name: value for name, value in vars(args).items() if name in fields and value is not None}
    for flag, field in (("memory_budget", "memory_budget_bytes"), ("max_request_host_bytes", "max_request_host_bytes"),
                        ("host_memory_budget", "host_memory_budget_bytes")):
        if getattr(args, flag):
            from convert.profile import ProfileError, parse_bytes  # imports onnx: only once the flags are read

            try:
                values[field] = parse_bytes(getattr(args, flag))
            except (ProfileError, ValueError) as error:
                raise StartRefused(f"--{flag.replace('_', '-')}: {error}") from error
    values.update(warm_up=not args.no_warm_up, warm_up_scales=tuple(args.warm_up_scales))
    if args.max_queue_ms <= 0:
        raise StartRefused(f"--max-queue-ms must be above 0 (received {args.max_queue_ms:g}): every pass would be "
                           "dropped; give the longest wait to allow, e.g. 1000")
    settings = dataclasses.replace(Settings(), **values)
    try:
        settings.check_call_limits()
    except ValueError as error:
        raise StartRefused(str(error)) from error
    return settings


def read_token(token_file: str | None, environ: Mapping[str, str]) -> str | None:
    """The bearer token from `--token-file` or `$SCOREMAP_TOKEN`; None when neither is given.

    An empty, blank or unreadable source refuses to start rather than turning authentication off.
    """
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as handle:
                token = handle.read().strip()
        except (OSError, UnicodeDecodeError) as error:
            reason = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
            raise StartRefused(f"--token-file {token_file}: cannot read it ({reason}); give a readable file "
                               "holding the token, or leave the flag out to serve without one") from error
        source = f"--token-file {token_file}"
    elif TOKEN_ENV in environ:
        token = environ[TOKEN_ENV].strip()
        source = f"${TOKEN_ENV}"
    else:
        return None
    if problem := token_problem(token):
        raise StartRefused(f"{source}: the token {problem}; put one word of printable ASCII in it, or remove it "
                           f"({'the flag' if token_file else 'unset the variable'}) to serve without one")
    return token


def token_problem(token: str) -> str | None:
    """Why `token` cannot be the bearer token (None: it can): an empty one would turn authentication off."""
    if not token:
        return "is empty: that would turn authentication off"
    if not token.isascii() or any(char.isspace() or not char.isprintable() for char in token):
        return (f"holds {len(token)} characters with spaces, line breaks or non-ASCII ones: a token is one word "
                "of printable ASCII (it travels in an HTTP/2 header)")
    return None


def is_loopback(host: str) -> bool:
    """True when every address `host` names is on this machine only."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def check_exposure(host: str, *, tls: bool, token: bool, insecure: bool) -> None:
    """Beyond loopback, refuse what fails open unless --insecure says the network is yours alone (issue 10,
    item 3): no TLS and no token (anyone may call), or a token without TLS (it travels in clear text,
    to be read and replayed; the clients refuse to send one that way). TLS without a token only warns:
    it hides the traffic but lets any client in."""
    if is_loopback(host):
        return
    if not tls:
        problem = ("the bearer token would travel in clear text, to be read and replayed" if token else
                   "with neither TLS nor a token anyone who can reach it may use it")
        if not insecure:
            raise StartRefused(
                f"--host {host} reaches beyond this machine, and {problem}: give --tls-cert/--tls-key "
                f"(and --token-file or ${TOKEN_ENV}), or --insecure if the network is yours alone"
            )
        LOG.warning("INSECURE: serving on %s without TLS (--insecure): %s", host, problem)
    elif not token:
        LOG.warning("serving on %s with TLS but no token: any client that reaches it may call (add --token-file)", host)


def check_port_free(host: str, port: int, flag: str) -> None:
    """Refuse at once (before models load) when `port` is taken; port 0 always has a free one."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise StartRefused(f"--host {host}: cannot resolve it ({error.strerror})") from error
    for family, kind, protocol, _name, address in infos:
        with socket.socket(family, kind, protocol) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: TIME_WAIT is no obstacle
            try:
                probe.bind(address)
            except OSError as error:
                if error.errno != errno.EADDRINUSE:
                    continue  # e.g. no IPv6 here: gRPC binds what it can, and says so if nothing
                raise StartRefused(f"{flag} {port}: {host}:{port} is in use; stop what holds it or choose another "
                                   f"({flag} 0 picks a free one)") from error


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        settings = settings_from(args)
        token = read_token(args.token_file, os.environ)
        check_exposure(args.host, tls=bool(args.tls_cert), token=token is not None, insecure=args.insecure)
        if settings.metrics_port is not None and not is_loopback(settings.metrics_address):
            LOG.warning("metrics on %s are open to anyone who reaches it (no TLS, no token): model names, traffic "
                        "and latencies; bind them to loopback or keep the network private", settings.metrics_address)
        tls = None
        if args.tls_cert:
            try:
                with open(args.tls_cert, "rb") as cert, open(args.tls_key, "rb") as key:
                    tls = (cert.read(), key.read())
            except OSError as error:
                raise StartRefused(f"--tls-cert/--tls-key: cannot read {error.filename} ({error.strerror})") from error
        check_port_free(args.host, args.port, "--port")
        if settings.metrics_port is not None:
            check_port_free(settings.metrics_address, settings.metrics_port, "--metrics-port")
        if settings.http_port is not None:
            check_port_free(args.host, settings.http_port, "--http-port")
    except StartRefused as refused:
        sys.stderr.write(f"scoremap-serve: {refused}\n")
        return 2

    from server.errors import ScoringError

    try:
        server, port = create_server(args.models, address=f"{args.host}:{args.port}", settings=settings, token=token,
                                     tls=tls, wait_until_ready=False)
    except ScoringError as error:
        sys.stderr.write(f"scoremap-serve: cannot start: {error.message}\n")
        return 2
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    sys.stdout.write(f"scoremap-serve listening on {args.host}:{port}\n")
    if server.http is not None:
        sys.stdout.write(f"scoremap-serve HTTP on {server.http.scheme}://{args.host}:{server.http.port}/\n")
    if server.metrics_port is not None:
        sys.stdout.write(f"scoremap-serve metrics on http://{settings.metrics_address}:{server.metrics_port}/metrics\n")
    sys.stdout.flush()
    names = [summary.name for summary in server.pipeline.models()]
    LOG.info("serving %s on %s:%d (%s)", ", ".join(names), args.host, port, server.pipeline.provider(names[0]))
    while not stop.wait(0.1):
        if server.warm_up_error is not None:
            sys.stderr.write(f"scoremap-serve: warm-up failed, the server could never be SERVING: "
                             f"{server.warm_up_error.message}\n")
            server.stop(0).wait()
            return 3
    LOG.info("draining: new calls get UNAVAILABLE, %d in-flight calls have %.1f s",
             server.servicer.active, settings.grace_seconds)
    server.stop(settings.grace_seconds).wait()
    LOG.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
