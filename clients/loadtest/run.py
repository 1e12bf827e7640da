"""scoremap-loadtest: how a scoremap server holds up under load, before it meets traffic.

    scoremap-loadtest --server HOST:PORT --concurrency 1,4,16 --duration 10
    scoremap-loadtest --server HOST:PORT --rate 5,20 --requests 200
    scoremap-loadtest --server HOST:PORT --concurrency 64 --processes 4 --server-pid PID

Closed loop: N callers each send the next request as soon as the last one returns (a concurrency
sweep). Open loop: requests are scheduled at a fixed arrival rate and each latency is measured
from its *scheduled* send time, so a slow server cannot hide its queueing by slowing the sender
(no coordinated omission; Gil Tene, "How NOT to measure latency"). No retries: every failure
counts, by gRPC status.

Each level has its own warm-up (--warmup requests), then a measurement window (--duration s, or
windows until the rate is stable with --until-stable): its rate and percentiles count only
requests completed inside the window, and those still in flight when it closes are reported
apart (perf_analyzer's rule). With --metrics-url (the server's /metrics) the server's own split
(queue, preprocess, inference, postprocess, batch size) is read over the same window and shown
beside the client's figures. A bearer token is read from $SCOREMAP_TOKEN (sent only over --tls or to
loopback). Every level is bounded in requests and time, and only the target given is contacted;
a non-loopback target needs --allow-remote.

The requests go from sending processes of their own (--processes), the levels divided among them and their
latencies merged into one report. Each level shows the load tester's own CPU (every process of it: cores
used, and busy as a share of its capacity, one core per sending process) beside a local server's
(--server-pid), and warns, as perf_analyzer does, when the load tester was busy enough that the figures
may be its own limit, not the server's. --processes auto (the default) finds how many it needs: short
calibration windows at the sweep's heaviest level, more processes (at least twice as many) while the load
tester is busier than it should be, up to the cores it may run on and, closed loop, one process per caller.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import sys
import threading
import urllib.parse
from pathlib import Path
from typing import Callable, NamedTuple, Sequence, TextIO

import grpc
import numpy as np

from clients.api.client import ScoremapClient, is_loopback
from clients.api.errors import ScoremapError
from clients.api.images import open_photo
from clients.api.options import SHIFTS, ScoreOptions, build_request
from clients.api.settings import MIN_TIMEOUT_S, ClientSettings, env_token
from clients.batch.files import find_images
from clients.loadtest.latency import LevelReport, client_bound_warning, format_table, to_csv, to_json
from clients.loadtest.levels import LevelPlan, Meters, run_level
from clients.loadtest.server_metrics import MetricsSnapshot, scrape
from clients.loadtest.settings import MIN_RATE, MIN_STABLE_PERCENT, LoadLimits
from clients.loadtest.spread import LoadTester, LoadTesterError, Target
from clients.loadtest.traffic import Closed, Open, Payloads, raw_calls
from clients.loadtest.usage import busy_seconds, cpu_seconds, usable_cores
from convert.arguments import host_port, number_in, number_list, size_pair
from protos import scoring_pb2, version

__all__ = ["Inputs", "LoadLimits", "LevelPlan", "LoadTester", "Target", "closed_loop", "open_loop", "run_level",
           "calibrate", "load_inputs", "synthetic_images", "main", "EXIT_OK", "EXIT_USAGE", "EXIT_UNAVAILABLE",
           "EXIT_REFUSED", "EXIT_LOAD_TESTER"]

log = logging.getLogger("scoremap-loadtest")
EXIT_OK = 0
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3
EXIT_REFUSED = 4
EXIT_LOAD_TESTER = 5  # a sending process failed to start or went away


def synthetic_images(sizes: Sequence[tuple[int, int]], *, seed: int = 0) -> list[np.ndarray]:
    """Random uint8 RGB images of the given (height, width) sizes (reproducible with `seed`)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8) for h, w in sizes]


class Inputs(NamedTuple):
    """The requests a load test cycles through, and the files of --images skipped as unusable (path, why)."""

    requests: list[scoring_pb2.ScoreRequest]
    skipped: list[tuple[str, str]]


def load_inputs(folder: str | None, sizes: Sequence[tuple[int, int]], options: ScoreOptions, *,
                limits: LoadLimits) -> Inputs:
    """The requests cycled through: the first `limits.max_inputs` usable images of `folder` (encoded),
    else synthetic ones (raw). A file that does not decode as the server would decode it is skipped and
    named, not sent: a real photo folder with one bad file stays usable, and no request
    of the measurement is an error of the input's making."""
    if not folder:
        return Inputs([build_request(image, options) for image in synthetic_images(sizes)], [])
    requests, skipped = [], []
    for image in find_images([folder]):
        if len(requests) == limits.max_inputs:
            break
        try:
            open_photo(image.path)
            requests.append(build_request(image.path, options))
        except (ScoremapError, OSError) as error:
            skipped.append((str(image.path), error.message if isinstance(error, ScoremapError) else str(error)))
    if not requests:
        raise ScoremapError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"no usable images under {folder!r}" + (f" ({len(skipped)} skipped: {_listed(skipped)})"
                                                                     if skipped else ""))
    return Inputs(requests, skipped)


def _listed(skipped: Sequence[tuple[str, str]], *, shown: int = 5) -> str:
    text = "; ".join(f"{path}: {why}" for path, why in skipped[:shown])
    return text + (f"; and {len(skipped) - shown} more" if len(skipped) > shown else "")


def closed_loop(channel: grpc.Channel, requests: Sequence[scoring_pb2.ScoreRequest], *, concurrency: int,
                plan: LevelPlan, limits: LoadLimits, metadata: Sequence[tuple[str, str]] = (),
                metrics: Callable[[], MetricsSnapshot | None] | None = None, live: TextIO | None = None) -> LevelReport:
    """`concurrency` callers back to back from this process, on `channel`: warm-up, then the window(s). The
    load tester's CPU is this process's, all of it (LoadTester sends from processes of their own)."""
    traffic = Closed(raw_calls([channel]), Payloads.of(requests), callers=concurrency, timeout_s=plan.timeout_s,
                     limits=limits, metadata=metadata)
    return run_level(traffic, plan, limits=limits, meters=_this_process(metrics), live=live)


def open_loop(channel: grpc.Channel, requests: Sequence[scoring_pb2.ScoreRequest], *, rate: float, plan: LevelPlan,
              limits: LoadLimits, metadata: Sequence[tuple[str, str]] = (),
              metrics: Callable[[], MetricsSnapshot | None] | None = None, live: TextIO | None = None) -> LevelReport:
    """Requests at `rate` per second from this process, on `channel`, latency from each one's scheduled send time.

    Sending stops when the window closes even when the in-flight bound holds arrivals back (a
    stalled server), and answers are awaited `timeout_s` + `limits.drain_grace_s` longer, no more.
    """
    traffic = Open(raw_calls([channel]), Payloads.of(requests), rate=rate, timeout_s=plan.timeout_s, limits=limits,
                   metadata=metadata)
    return run_level(traffic, plan, limits=limits, meters=_this_process(metrics), live=live)


def _this_process(metrics: Callable[[], MetricsSnapshot | None] | None) -> Meters:
    return Meters(client_cpu=lambda: cpu_seconds([os.getpid()]), client_busy=lambda: busy_seconds([os.getpid()]),
                  metrics=metrics)


def calibrate(tester: LoadTester, mode: str, level: float, plan: LevelPlan, *, limits: LoadLimits,
              live: TextIO | None = None) -> int:
    """--processes auto: the fewest sending processes that keep the load tester at most `limits.auto_busy` of its
    capacity at `level` (the sweep's heaviest), found with short windows (`limits.calibration_s`), from the
    processes `tester` has, at least doubling each time, up to the cores it may use (and, closed loop, one
    process per caller). Grows `tester`; its process count."""
    most = min(usable_cores(), limits.max_processes, int(level) if mode == "closed" else limits.max_processes)
    probe = dataclasses.replace(plan, duration_s=limits.calibration_s, max_requests=limits.max_requests,
                                until_stable=False)
    while True:
        report = tester.closed(int(level), probe) if mode == "closed" else tester.open(level, probe)
        if live is not None:
            live.write(f"calibrating --processes: {tester.count} at {mode} {level:g}: "
                       f"{report.client_busy:.0%} of their capacity busy\n")
            live.flush()
        if not report.client_busy > limits.auto_busy or tester.count >= most:  # NaN: nothing answered to judge by
            return tester.count
        tester.grow(min(most, max(2 * tester.count, math.ceil(tester.count * report.client_busy / limits.auto_busy))))


def build_parser() -> argparse.ArgumentParser:
    limits = LoadLimits()
    parser = argparse.ArgumentParser(
        prog="scoremap-loadtest", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"The load tester warns when it was over {limits.client_busy_warning:.0%} busy (its CPU over one core "
               f"per sending process, no more than its cores); --processes auto adds processes while it is over "
               f"{limits.auto_busy:.0%} busy in {limits.calibration_s:g}-s calibration windows.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    parser.add_argument("--server", required=True, metavar="HOST:PORT", type=host_port, help="the one target contacted")
    parser.add_argument("--allow-remote", action="store_true", help="allow a target that is not loopback")
    parser.add_argument("--tls", action="store_true", help="connect with TLS")
    parser.add_argument("--root-cert", type=Path, help="PEM root certificates for --tls")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=number_list(int, 1, limits.max_in_flight), help="closed-loop sweep, e.g. 1,4,16 (default 1,4,16)")
    load.add_argument("--rate", type=number_list(float, MIN_RATE, limits.max_rate), help="open-loop arrival rates per second, e.g. 5,20")
    parser.add_argument("--duration", type=number_in(float, MIN_TIMEOUT_S, limits.max_duration_s),
                        help=f"seconds of each level's measurement window (at most {limits.max_duration_s:g}; "
                             "default 10 unless --requests)")
    parser.add_argument("--requests", type=number_in(int, 1, limits.max_requests),
                        help=f"requests per level after its warm-up; the window closes once they are answered "
                             f"(at most {limits.max_requests})")
    parser.add_argument("--until-stable", action="store_true",
                        help="repeat each level's window until the last 3 rates agree within --stable-within "
                             f"(at most {limits.max_windows} windows, {limits.max_duration_s:g} s)")
    parser.add_argument("--stable-within", type=number_in(float, MIN_STABLE_PERCENT, 100), default=5.0, metavar="PERCENT",
                        help="how close the last 3 window rates must be, in percent of their mean (default 5)")
    parser.add_argument("--images", metavar="DIR", help=f"cycle through these images (first {limits.max_inputs})")
    parser.add_argument("--sizes", type=lambda t: [size_pair(p) for p in t.split(",")], default=[(224, 224)],
                        help="synthetic image sizes HxW,... when no --images (default 224x224)")
    parser.add_argument("--model", default="")
    parser.add_argument("--scales", type=number_list(int, 1), default=[])
    parser.add_argument("--stride", type=number_in(int, 0), default=0)
    parser.add_argument("--shift", choices=sorted(SHIFTS), default="auto")
    parser.add_argument("--flip", action="store_true")
    parser.add_argument("--maps", action="store_true", help="ask for full maps (measures their transfer too)")
    parser.add_argument("--timeout", type=number_in(float, MIN_TIMEOUT_S), default=ClientSettings.timeout_s,
                        help=f"deadline per request, seconds (default {ClientSettings.timeout_s:g})")
    parser.add_argument("--warmup", type=number_in(int, 0, limits.max_requests), default=2,
                        help="unmeasured requests before each level's window (default 2)")
    parser.add_argument("--metrics-url", metavar="URL",
                        help="the server's Prometheus /metrics (scoremap-serve --metrics-port), e.g. "
                             "http://127.0.0.1:9100/metrics: adds the server's per-stage times and batch size")
    parser.add_argument("--json", metavar="PATH", help="write the reports as JSON ('-' for stdout)")
    parser.add_argument("--csv", metavar="PATH", help="write the reports as CSV ('-' for stdout)")
    parser.add_argument("--processes", type=_processes(limits), default=None, metavar="N|auto",
                        help="sending processes, each with its own connections (default auto: as many as short "
                             "calibration windows at the heaviest level find it needs, up to the cores it may use; "
                             f"at most {limits.max_processes})")
    parser.add_argument("--connections", type=number_in(int, 1, limits.max_connections), default=1,
                        help="connections per sending process, each its own TCP connection (default 1; more spread "
                             "the load over a server of several processes behind one port)")
    parser.add_argument("--server-pid", type=number_in(int, 1), metavar="PID",
                        help="a server on this machine: its CPU (the process and its descendants) is shown beside "
                             "the load tester's")
    parser.add_argument("--quiet", action="store_true", help="no live line per level on stderr")
    return parser


def _processes(limits: LoadLimits):
    """An argparse type: `auto` (None) or a count of sending processes."""
    count = number_in(int, 1, limits.max_processes)

    def parse(text: str) -> int | None:
        return None if text == "auto" else count(text)

    parse.__name__ = "processes"
    return parse


def _metrics_reader(url: str, *, model: str, limits: LoadLimits) -> Callable[[], MetricsSnapshot | None]:
    """Reads the server's metrics; a failed read is reported once and leaves the split empty."""
    failed = threading.Event()

    def read() -> MetricsSnapshot | None:
        try:
            return scrape(url, timeout_s=limits.metrics_timeout_s, model=model)
        except (OSError, ValueError) as error:
            if not failed.is_set():
                failed.set()
                log.warning("cannot read the server's metrics at %s (%s); the server-side split is left out", url, error)
            return None
    return read


def _write(path: str, text: str) -> None:
    if path == "-":
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    else:
        Path(path).write_text(text)


def main(argv: Sequence[str] | None = None) -> int:
    """Exit EXIT_OK when every level ran (errors are reported, not fatal), EXIT_USAGE on a bad
    command line, EXIT_UNAVAILABLE when the server is not SERVING, EXIT_REFUSED when the client
    will not start (a token in clear text off this machine, an unreadable --root-cert),
    EXIT_LOAD_TESTER when a sending process failed to start or went away."""
    limits = LoadLimits()
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="scoremap-loadtest: %(message)s")
    if not is_loopback(args.server) and not args.allow_remote:
        parser.error(f"refusing to load-test {args.server!r}, which is not a loopback address; "
                     "pass --allow-remote if you own that server")
    duration = args.duration if args.duration is not None else (limits.max_duration_s if args.requests else 10.0)
    requests_cap = args.requests if args.requests is not None else limits.max_requests
    levels = args.concurrency or ([] if args.rate else [1, 4, 16])
    if args.server_pid is not None and not Path(f"/proc/{args.server_pid}").exists():
        parser.error(f"--server-pid {args.server_pid}: no such process on this machine; give the pid of a local "
                     "server (scoremap-serve prints nothing else to find it: `pgrep -f scoremap-serve`)")
    if args.metrics_url:
        parts = urllib.parse.urlsplit(args.metrics_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            parser.error(f"--metrics-url {args.metrics_url!r} is not an http(s) URL such as http://127.0.0.1:9100/metrics")
        if not is_loopback(parts.netloc) and not args.allow_remote:
            parser.error(f"refusing to read metrics from {parts.netloc!r}, which is not a loopback address; "
                         "pass --allow-remote if you own that server")
    try:
        options = ScoreOptions(model=args.model, scales=tuple(args.scales), stride=args.stride, shift=args.shift,
                               flip=args.flip, return_maps=args.maps)
        inputs, skipped = load_inputs(args.images, args.sizes, options, limits=limits)
    except ScoremapError as error:
        parser.error(error.message)
    if skipped:
        log.warning("skipped %d of the files under %s, not usable images: %s", len(skipped), args.images, _listed(skipped))
    settings = ClientSettings(timeout_s=args.timeout)
    token = env_token()
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    try:
        root = args.root_cert.read_bytes() if args.root_cert else None
        client = ScoremapClient(args.server, settings=settings, token=token, tls=args.tls, root_certificates=root)
    except (ScoremapError, OSError) as error:
        log.error("%s", error)
        return EXIT_REFUSED
    with client:
        try:
            status = client.health(timeout=args.timeout)
        except ScoremapError as error:
            log.error("%s is not reachable: %s", args.server, error)
            return EXIT_UNAVAILABLE
        if status != "SERVING":
            log.error("%s reports %s, not SERVING", args.server, status)
            return EXIT_UNAVAILABLE
    plan = LevelPlan(duration_s=duration, max_requests=requests_cap, timeout_s=args.timeout, warmup=args.warmup,
                     until_stable=args.until_stable, stable_tolerance=args.stable_within / 100)
    metrics = _metrics_reader(args.metrics_url, model=args.model, limits=limits) if args.metrics_url else None
    live = None if args.quiet else sys.stderr
    target = Target(args.server, tls=args.tls, root_certificates=root, metadata=metadata, settings=settings,
                    connections=args.connections)
    reports: list[LevelReport] = []
    try:
        with LoadTester(target, inputs, processes=args.processes or 1, limits=limits,
                        server_pid=args.server_pid) as tester:
            if args.processes is None:
                heaviest = ("closed", max(levels)) if levels else ("open", max(args.rate))
                calibrate(tester, *heaviest, plan, limits=limits, live=live)
            for mode, level in [("closed", c) for c in levels] + [("open", r) for r in args.rate or []]:
                report = (tester.closed(level, plan, metrics=metrics, live=live) if mode == "closed" else
                          tester.open(level, plan, metrics=metrics, live=live))
                reports.append(report)
                if warning := client_bound_warning(report, busy_warning=limits.client_busy_warning):
                    log.warning("%s", warning)
    except LoadTesterError as error:
        log.error("%s", error)
        return EXIT_LOAD_TESTER
    if args.json:
        _write(args.json, to_json(reports))
    if args.csv:
        _write(args.csv, to_csv(reports))
    if "-" not in (args.json, args.csv):
        sys.stdout.write(format_table(reports) + "\n")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
