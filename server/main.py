"""`scoremap-serve [NAME=]MODEL.onnx ...`: the dense scoring server's command line.

The flags are made from the settings' declarations (server/settings.py); the exposure rules (TLS,
token, bind address, ports) are server/edges/exposure.py's, checked before any model loads; the server
itself is `server.serving.create_server` (port 0 picks a free port). SIGTERM drains: health goes
NOT_SERVING, new calls get UNAVAILABLE, in-flight calls get `--grace-seconds` to finish, then the
process exits 0; a SIGTERM while the models load, warm up or make their background plans does the same
once the plan being made is done. Nothing heavy (grpc, onnxruntime, numpy) is imported before the command line is
parsed, so `--help` and usage errors answer at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from protos import is_loopback, version
from server import settings as declared
from server.edges.exposure import StartRefused, check_exposure, check_port_free, read_tls, read_token
from server.memory.huge_pages import restart_with_huge_pages
from server.settings import Settings
from server.stop_signal import SignalledStop
from server.supervision import follow_supervisor

if TYPE_CHECKING:
    from server.serving import ScoringServer

__all__ = ["StartRefused", "create_server", "main", "model_sources", "parse_args", "read_token", "settings_from"]

LOG = logging.getLogger("scoremap.serve")
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # either drains the server, then it exits 0
DESCRIPTION = """\
Serve converted models (scoremap-convert) over gRPC: scoremap.v1.DenseScoring, the standard
health service and reflection. Give each model as a path, or as NAME=PATH to serve it under another
name than its card's (two versions of one model side by side). Binds 127.0.0.1 unless --host says
otherwise; beyond loopback it wants TLS or a token (or --insecure).

exit status: 0 stopped by SIGTERM/SIGINT after draining, at any moment (while the models load or warm
up too); 2 refused to start (bad command line, unreadable or empty token, port in use, unloadable
model); 3 a warm-up pass failed, so the server could never report SERVING. With --workers or
--fronts, a process that crashed gives the server its status: 128 + N for one signal N ended."""


def __getattr__(name: str) -> Any:
    """`server.main.create_server` and `ScoringServer`, imported only when asked for (they import grpc)."""
    if name in ("create_server", "ScoringServer"):
        from server import serving

        return getattr(serving, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Each default printed once: not for flags whose help already gives it, switches, nor empty ones."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        empty = action.default is None or isinstance(action.default, bool) or action.default in ([], ())
        if empty or "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scoremap-serve", description=DESCRIPTION, formatter_class=HelpFormatter)
    parser.add_argument("models", nargs="+", metavar="[NAME=]MODEL.onnx",
                        help="converted .onnx files; NAME=PATH serves one under NAME instead of its card's name "
                             "(name every model or none)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    declared.add_flags(parser)
    return parser


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
    """The flags as Settings; StartRefused naming the flags when they do not go together."""
    try:
        return declared.from_flags(args)
    except ValueError as error:
        raise StartRefused(str(error)) from error


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:  # the server's own command (not a test calling it in its process): glibc's huge pages first
        restart_with_huge_pages()
    stop = SignalledStop()
    # Caught before anything else runs: a SIGTERM while the models load or warm up is a stop like any other (the
    # server drains once it can), never a death by signal. Put back when no server started (a refused start, or a
    # test calling main in its own process); a started server's process exits with them still caught.
    put_back = stop.catch(STOP_SIGNALS)
    try:
        started = start(argv, stop)
    except BaseException:
        put_back()
        raise
    if isinstance(started, int):
        put_back()
        return started
    return serve(*started, stop=stop)


def start(argv: Sequence[str] | None, stop: threading.Event) -> tuple[ScoringServer, int, argparse.Namespace] | int:
    """The command line checked and the server started: (server, port, args), or the exit status of a refused
    start (2) or of --workers' supervisor, which `stop` stops too."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        settings = settings_from(args)
        token = read_token(args.token_file, os.environ)
        check_exposure(args.host, tls=bool(args.tls_cert), token=token is not None, insecure=args.insecure)
        if settings.metrics_port is not None and not is_loopback(settings.metrics_address, resolve=True):
            LOG.warning("metrics on %s are open to anyone who reaches it (no TLS, no token): model names, traffic "
                        "and latencies; bind them to loopback or keep the network private", settings.metrics_address)
        tls = read_tls(args.tls_cert, args.tls_key)
        if settings.http_port == args.port != 0:  # else the HTTP face dies on a port gRPC already holds
            raise StartRefused(f"--http-port {args.port} is the same as --port: give HTTP a port of its own "
                               "(0 picks a free one)")
        if not settings.reuse_port:  # one of --workers' processes: its supervisor checked, and holds, the ports
            check_port_free(args.host, args.port, "--port")
            if settings.metrics_port is not None:
                check_port_free(settings.metrics_address, settings.metrics_port, "--metrics-port")
            if settings.http_port is not None:
                check_port_free(args.host, settings.http_port, "--http-port")
    except StartRefused as refused:
        sys.stderr.write(f"scoremap-serve: {refused}\n")
        return 2
    if settings.supervisor is not None and not follow_supervisor(settings.supervisor, stop=stop,
                                                                    grace=settings.grace_seconds):
        return 1  # started for a server whose supervisor is gone
    if settings.fronts > 0:
        from server.split import supervise as supervise_split

        return supervise_split(sys.argv[1:] if argv is None else argv, host=args.host, port=args.port,
                               settings=settings, stopping=stop)
    if settings.workers > 1:
        from server.workers import supervise

        return supervise(sys.argv[1:] if argv is None else argv, host=args.host, port=args.port, settings=settings,
                         stopping=stop)
    role, _, number = (settings.split_role or "").partition(":")
    if role == "engine":
        from server.split import run_engine

        return run_engine(args.models, settings=settings, stop=stop)

    from server.errors import ScoringError
    from server.memory.runtime import configure_allocator
    from server.serving import create_server

    configure_allocator()  # before any thread allocates: glibc keeps to one heap only if told before it has several
    LOG.info("starting: loading %s", ", ".join(args.models.values() if isinstance(args.models, dict) else args.models))
    engine = None
    if role == "front":
        from server.split import front_client

        engine = front_client(settings, int(number), stop=stop)
        if engine is None:  # stopped before the engine was ready
            return 0
    try:
        # A front warms its own path (the engine is warm already, so it takes a moment) before it says it listens:
        # its supervisor says the server listens once every front does, so no call meets one still warming.
        server, port = create_server(args.models, address=f"{args.host}:{args.port}", settings=settings, token=token,
                                     tls=tls, wait_until_ready=engine is not None, engine=engine)
    except ScoringError as error:
        sys.stderr.write(f"scoremap-serve: cannot start: {error.message}\n")
        return 2
    return server, port, args


def serve(server: ScoringServer, port: int, args: argparse.Namespace, *, stop: threading.Event) -> int:
    """Say where `server` listens, then wait for `stop` (SIGTERM, SIGINT) and drain: 0, or 3 when a warm-up pass
    failed first. A stop asked for while the models loaded drains at once."""
    settings = server.front.settings
    role, _, number = (settings.split_role or "").partition(":")
    sys.stdout.write(f"scoremap-serve listening on {args.host}:{port}\n")
    if server.http is not None:
        sys.stdout.write(f"scoremap-serve HTTP on {server.http.scheme}://{args.host}:{server.http.port}/\n")
    if server.metrics_port is not None and role == "front":  # the supervisor serves every process's together
        from server.split import publish_metrics

        publish_metrics(settings.split_run, f"front-{number}", server.metrics_port, address=settings.metrics_address)
    elif server.metrics_port is not None:
        sys.stdout.write(f"scoremap-serve metrics on http://{settings.metrics_address}:{server.metrics_port}/metrics\n")
    sys.stdout.flush()
    names = [summary.name for summary in server.pipeline.models()]
    LOG.info("serving %s on %s:%d (%s)", ", ".join(names), args.host, port, server.pipeline.provider(names[0]))
    # A failed warm-up is looked for until the warm-up has ended; then `stop` alone: an idle server never wakes here.
    while not server.front.ready.is_set() and not stop.wait(0.1):
        if server.warm_up_error is not None:
            sys.stderr.write(f"scoremap-serve: warm-up failed, the server could never be SERVING: "
                             f"{server.warm_up_error.message}\n")
            server.stop(0).wait()
            return 3
    stop.wait()
    LOG.info("draining: new calls get UNAVAILABLE, %d in-flight calls have %.1f s",
             server.front.active, settings.grace_seconds)
    server.stop(settings.grace_seconds).wait()
    LOG.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
