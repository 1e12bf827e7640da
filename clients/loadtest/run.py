"""scoremap-loadtest: how a scoremap server holds up under load, before it meets traffic.

    scoremap-loadtest --server HOST:PORT --concurrency 1,4,16 --duration 10
    scoremap-loadtest --server HOST:PORT --rate 5,20 --requests 200

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
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple, Sequence, TextIO

import grpc
import numpy as np

from clients.api.client import ScoremapClient, is_loopback, open_channel
from clients.api.errors import ScoremapError
from clients.api.images import open_photo
from clients.api.options import SHIFTS, ScoreOptions, as_new_work, build_request
from clients.api.settings import MIN_TIMEOUT_S, ClientSettings, env_token
from clients.batch.files import find_images
from clients.loadtest.latency import LevelReport, Sample, format_table, stable, summarise, to_csv, to_json
from clients.loadtest.server_metrics import MetricsSnapshot, scrape, server_split
from convert.arguments import host_port, number_in, number_list, size_pair
from protos import version
from protos import scoring_pb2, scoring_pb2_grpc

__all__ = ["Inputs", "LoadLimits", "LevelPlan", "closed_loop", "open_loop", "run_level", "load_inputs", "synthetic_images",
           "main", "EXIT_OK", "EXIT_USAGE", "EXIT_UNAVAILABLE", "EXIT_REFUSED"]

log = logging.getLogger("scoremap-loadtest")
EXIT_OK = 0
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3
EXIT_REFUSED = 4
# The slowest open-loop rate (--rate, per second): one arrival per 100 s, some within a 600 s level.
MIN_RATE = 0.01
# The tightest --stable-within (percent): below it, window rates of a real server never agree.
MIN_STABLE_PERCENT = 0.1


@dataclass(frozen=True)
class LoadLimits:
    """Hard bounds of a load test, whatever the command line asks."""

    # Longest a level may run (seconds).
    max_duration_s: float = 600.0
    # Most requests one level may send.
    max_requests: int = 100_000
    # Most concurrent callers (closed loop) or requests in flight (open loop).
    max_in_flight: int = 256
    # Most arrivals per second (open loop).
    max_rate: float = 2_000.0
    # Most input images held in memory.
    max_inputs: int = 64
    # After a level's sending stops, how long (seconds) its last answers are awaited beyond the deadline.
    drain_grace_s: float = 5.0
    # Most measurement windows of one level with --until-stable (and max_duration_s in all).
    max_windows: int = 20
    # How often (seconds) a level's live line is redrawn on a terminal.
    live_every_s: float = 1.0
    # How long (seconds) reading the server's /metrics may take.
    metrics_timeout_s: float = 5.0


# How often (seconds) a level checks whether its window has closed.
LIVE_POLL_S = 0.02


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
    named, not sent: a real photo folder with one bad file stays usable (issue 24), and no request
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


@dataclass(frozen=True)
class LevelPlan:
    """How one level is measured: its own warm-up, then one window (or, `until_stable`, windows
    until the last `stable_windows` rates agree within `stable_tolerance`)."""

    # Length of a measurement window (seconds).
    duration_s: float
    # Most requests sent after the warm-up's; the window also ends once they are all answered.
    max_requests: int
    # Deadline of each request (seconds).
    timeout_s: float
    # Requests answered (closed loop) or arrivals (open loop) before the window opens, per level.
    warmup: int = 2
    until_stable: bool = False
    stable_windows: int = 3
    stable_tolerance: float = 0.05


class _Traffic:
    """One level's requests in flight and their completions; subclasses decide when to send."""

    mode = ""

    def __init__(self, stub: scoring_pb2_grpc.DenseScoringStub, requests: Sequence[scoring_pb2.ScoreRequest], *,
                 timeout_s: float, limits: LoadLimits, metadata: Sequence[tuple[str, str]]) -> None:
        self.stub, self.requests, self.timeout_s, self.limits, self.metadata = stub, requests, timeout_s, limits, metadata
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.samples: list[Sample] = []
        self.sent_at: list[float] = []
        self.send_limit = limits.max_requests  # the level's warm-up + its measured requests
        self.stop = threading.Event()
        self.calls: set[grpc.Future] = set()
        self.threads: list[threading.Thread] = []
        self.started = time.perf_counter()

    def _claim(self) -> int | None:
        """The next request's number, or None when sending has ended."""
        with self.lock:
            if self.stop.is_set() or len(self.sent_at) >= self.send_limit:
                return None
            self.sent_at.append(time.perf_counter())
            return len(self.sent_at) - 1

    def _send(self, n: int, scheduled: float, on_done=None) -> grpc.Future:
        call = self.stub.Score.future(as_new_work(self.requests[n % len(self.requests)], n), timeout=self.timeout_s,
                                      metadata=self.metadata)
        with self.lock:
            self.calls.add(call)

        def done(finished: grpc.Future) -> None:
            now = time.perf_counter()
            code = finished.code() if not finished.cancelled() else grpc.StatusCode.CANCELLED
            with self.changed:
                self.calls.discard(finished)
                self.samples.append(Sample(now, now - scheduled, "OK" if code == grpc.StatusCode.OK else code.name))
                self.changed.notify_all()
            if on_done:
                on_done()

        call.add_done_callback(done)
        return call

    def start(self) -> None:
        self.started = time.perf_counter()
        for thread in self.threads:
            thread.start()

    def finish(self) -> None:
        """Stop sending; wait `timeout_s` + the drain grace for answers, then cancel what is left."""
        self.stop.set()
        until = time.perf_counter() + self.timeout_s + self.limits.drain_grace_s
        with self.changed:
            while self.calls and self.changed.wait(max(0.0, until - time.perf_counter())):
                pass
            left = list(self.calls)
        for call in left:
            call.cancel()  # calls the server never answered end with the level
        for thread in self.threads:
            thread.join(max(0.0, until - time.perf_counter()) + 1.0)

    def answered(self) -> int:
        with self.lock:
            return len(self.samples)

    def window_closed(self) -> bool:
        """Whether every request the window may send was sent and answered."""
        with self.lock:
            return len(self.sent_at) >= self.send_limit and len(self.samples) >= len(self.sent_at)

    def in_flight_at(self, instant: float) -> int:
        with self.lock:
            return (sum(1 for t in self.sent_at if t <= instant)
                    - sum(1 for s in self.samples if s.done_s <= instant))


class _Closed(_Traffic):
    """`concurrency` callers, each sending its next request when its last one is answered."""

    mode = "closed"

    def __init__(self, *args, concurrency: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.level = concurrency
        self.threads = [threading.Thread(target=self._caller, name=f"loadtest-caller-{n}", daemon=True)
                        for n in range(concurrency)]

    def _caller(self) -> None:
        while (n := self._claim()) is not None:
            answered = threading.Event()
            self._send(n, time.perf_counter(), answered.set)
            answered.wait()

    def warm_up(self, count: int, until: float) -> float:
        """Wait for `count` answers (until `until` at most); the instant the window opens."""
        with self.changed:
            while len(self.samples) < count and self.changed.wait(max(0.0, until - time.perf_counter())):
                pass
            if count == 0:
                return self.started
            return self.samples[count - 1].done_s if len(self.samples) >= count else time.perf_counter()


class _Open(_Traffic):
    """Arrivals at `rate` per second, each latency counted from its scheduled send time."""

    mode = "open"

    def __init__(self, *args, rate: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.level = rate
        self.slots = threading.BoundedSemaphore(self.limits.max_in_flight)
        self.threads = [threading.Thread(target=self._sender, name="loadtest-sender", daemon=True)]

    def _sender(self) -> None:
        for n in itertools.count():
            scheduled = self.started + n / self.level
            if self.stop.wait(max(0.0, scheduled - time.perf_counter())):
                return
            # At the in-flight bound the send waits (its latency still counts from `scheduled`),
            # until the level stops.
            while not self.slots.acquire(timeout=0.05):
                if self.stop.is_set():
                    return
            claimed = self._claim()
            if claimed is None:
                self.slots.release()
                return
            self._send(claimed, scheduled, self.slots.release)

    def warm_up(self, count: int, until: float) -> float:
        """Let the first `count` arrivals pass; the instant the window opens (the next one's schedule)."""
        opens = self.started + count / self.level
        self.stop.wait(max(0.0, min(until, opens) - time.perf_counter()))
        return min(opens, time.perf_counter())


def _live(traffic: _Traffic, window: int, start: float, length: float) -> str:
    """The level's live line: how the current window is going."""
    elapsed = time.perf_counter() - start
    with traffic.lock:
        inside = [s for s in traffic.samples if s.done_s > start]
    ok = sum(s.status == "OK" for s in inside)
    return (f"{traffic.mode} {traffic.level:g}: window {window}  {elapsed:4.1f}/{length:g} s  {ok} ok  "
            f"{len(inside) - ok} errors  {ok / elapsed if elapsed > 0 else 0.0:.1f}/s")


def run_level(traffic: _Traffic, plan: LevelPlan, *, limits: LoadLimits,
              metrics: Callable[[], MetricsSnapshot | None] | None = None, live: TextIO | None = None) -> LevelReport:
    """Drive `traffic`: its warm-up, then its window(s); the report of the window (with
    `until_stable`, of the last `stable_windows` windows together)."""
    level_end = time.perf_counter() + limits.max_duration_s
    tty = live is not None and live.isatty()
    rates: list[float] = []
    bounds: list[float] = []  # the windows' edges
    snapshots: list[MetricsSnapshot | None] = []  # the server's metrics at each edge
    traffic.send_limit = plan.warmup + plan.max_requests
    traffic.start()
    try:
        bounds.append(traffic.warm_up(plan.warmup, time.perf_counter() + plan.timeout_s))
        snapshots.append(metrics() if metrics else None)
        while True:
            start = bounds[-1]
            end = min(start + plan.duration_s, level_end)
            next_line = start + limits.live_every_s
            while (now := time.perf_counter()) < end and not traffic.window_closed():
                if tty and now >= next_line:
                    live.write("\r" + _live(traffic, len(bounds), start, plan.duration_s))
                    live.flush()
                    next_line += limits.live_every_s
                time.sleep(min(LIVE_POLL_S, end - now))
            bounds.append(time.perf_counter())
            snapshots.append(metrics() if metrics else None)
            with traffic.lock:
                ok = sum(1 for s in traffic.samples if start < s.done_s <= bounds[-1] and s.status == "OK")
            rates.append(ok / (bounds[-1] - start))
            if live is not None:
                live.write(("\r" if tty else "") + _live(traffic, len(rates), start, plan.duration_s) + "\n")
                live.flush()
            if (not plan.until_stable or stable(rates, count=plan.stable_windows, tolerance=plan.stable_tolerance)
                    or traffic.window_closed() or bounds[-1] >= level_end or len(rates) >= limits.max_windows):
                break
    finally:
        in_flight = traffic.in_flight_at(bounds[-1] if len(bounds) > 1 else time.perf_counter())
        traffic.finish()
    span = min(len(rates), plan.stable_windows) if plan.until_stable else 1
    first = len(bounds) - 1 - span
    before, after = snapshots[first], snapshots[-1]
    with traffic.lock:
        samples, sent = list(traffic.samples), len(traffic.sent_at)
    return summarise(traffic.mode, traffic.level, samples, sent=sent, start_s=bounds[first], end_s=bounds[-1],
                     in_flight_at_end=in_flight, windows=len(rates),
                     stable=stable(rates, count=plan.stable_windows, tolerance=plan.stable_tolerance)
                     if plan.until_stable else None,
                     server=server_split(before, after) if before is not None and after is not None else None)


def closed_loop(stub: scoring_pb2_grpc.DenseScoringStub, requests: Sequence[scoring_pb2.ScoreRequest], *,
                concurrency: int, plan: LevelPlan, limits: LoadLimits, metadata: Sequence[tuple[str, str]] = (),
                metrics: Callable[[], MetricsSnapshot | None] | None = None, live: TextIO | None = None) -> LevelReport:
    """`concurrency` callers back to back: warm-up, then the window(s)."""
    traffic = _Closed(stub, requests, timeout_s=plan.timeout_s, limits=limits, metadata=metadata,
                      concurrency=concurrency)
    return run_level(traffic, plan, limits=limits, metrics=metrics, live=live)


def open_loop(stub: scoring_pb2_grpc.DenseScoringStub, requests: Sequence[scoring_pb2.ScoreRequest], *,
              rate: float, plan: LevelPlan, limits: LoadLimits, metadata: Sequence[tuple[str, str]] = (),
              metrics: Callable[[], MetricsSnapshot | None] | None = None, live: TextIO | None = None) -> LevelReport:
    """Requests at `rate` per second, latency from each one's scheduled send time.

    Sending stops when the window closes even when the in-flight bound holds arrivals back (a
    stalled server), and answers are awaited `timeout_s` + `limits.drain_grace_s` longer, no more.
    """
    traffic = _Open(stub, requests, timeout_s=plan.timeout_s, limits=limits, metadata=metadata, rate=rate)
    return run_level(traffic, plan, limits=limits, metrics=metrics, live=live)


def build_parser() -> argparse.ArgumentParser:
    limits = LoadLimits()
    parser = argparse.ArgumentParser(prog="scoremap-loadtest", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
    parser.add_argument("--quiet", action="store_true", help="no live line per level on stderr")
    return parser


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
    will not start (a token in clear text off this machine, an unreadable --root-cert)."""
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
    channel = open_channel(args.server, tls=args.tls, root_certificates=root, settings=settings)
    try:
        stub = scoring_pb2_grpc.DenseScoringStub(channel)
        reports: list[LevelReport] = []
        for concurrency in levels:
            reports.append(closed_loop(stub, inputs, concurrency=concurrency, plan=plan, limits=limits,
                                       metadata=metadata, metrics=metrics, live=live))
        for rate in args.rate or []:
            reports.append(open_loop(stub, inputs, rate=rate, plan=plan, limits=limits, metadata=metadata,
                                     metrics=metrics, live=live))
    finally:
        channel.close()
    if args.json:
        _write(args.json, to_json(reports))
    if args.csv:
        _write(args.csv, to_csv(reports))
    if "-" not in (args.json, args.csv):
        sys.stdout.write(format_table(reports) + "\n")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
