"""scoremap-loadtest: how a scoremap server holds up under load, before it meets traffic.

    scoremap-loadtest --server HOST:PORT --concurrency 1,4,16 --duration 10
    scoremap-loadtest --server HOST:PORT --rate 5,20 --requests 200

Closed loop: N callers each send the next request as soon as the last one returns (a concurrency
sweep). Open loop: requests are scheduled at a fixed arrival rate and each latency is measured
from its *scheduled* send time, so a slow server cannot hide its queueing by slowing the sender
(no coordinated omission; Gil Tene, "How NOT to measure latency"). No retries: every failure
counts, by gRPC status. A bearer token is read from $SCOREMAP_TOKEN (sent only over --tls or to
loopback). Every level is bounded in requests and time, and only the target given is contacted;
a non-loopback target needs --allow-remote.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import grpc
import numpy as np

from clients.api import ScoremapClient, is_loopback, open_channel
from clients.errors import ScoremapError
from clients.files import find_images
from clients.latency import LevelReport, Sample, format_table, summarise, to_csv, to_json
from clients.options import SHIFTS, ScoreOptions, build_request
from clients.settings import TOKEN_ENV, ClientSettings
from protos import scoring_pb2, scoring_pb2_grpc

__all__ = ["LoadLimits", "closed_loop", "open_loop", "load_inputs", "synthetic_images", "main", "EXIT_OK",
           "EXIT_USAGE", "EXIT_UNAVAILABLE", "EXIT_REFUSED"]

log = logging.getLogger("scoremap-loadtest")
EXIT_OK = 0
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3
EXIT_REFUSED = 4


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


def synthetic_images(sizes: Sequence[tuple[int, int]], *, seed: int = 0) -> list[np.ndarray]:
    """Random uint8 RGB images of the given (height, width) sizes (reproducible with `seed`)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8) for h, w in sizes]


def load_inputs(folder: str | None, sizes: Sequence[tuple[int, int]], options: ScoreOptions, *,
                limits: LoadLimits) -> list[scoring_pb2.ScoreRequest]:
    """The requests cycled through: the images of `folder` (encoded), else synthetic ones (raw)."""
    if folder:
        files = [image.path for image, _ in zip(find_images([folder]), range(limits.max_inputs))]
        if not files:
            raise ScoremapError(grpc.StatusCode.INVALID_ARGUMENT, f"no images found under {folder!r}")
        return [build_request(path, options) for path in files]
    return [build_request(image, options) for image in synthetic_images(sizes)]


def closed_loop(stub: scoring_pb2_grpc.DenseScoringStub, requests: Sequence[scoring_pb2.ScoreRequest], *,
                concurrency: int, duration_s: float, max_requests: int, timeout_s: float,
                metadata: Sequence[tuple[str, str]] = ()) -> LevelReport:
    """`concurrency` callers back to back until `duration_s` passes or `max_requests` are sent."""
    samples: list[Sample] = []
    lock = threading.Lock()
    sent = 0
    start = time.perf_counter()
    end = start + duration_s

    def caller() -> None:
        nonlocal sent
        while True:
            with lock:
                if sent >= max_requests or time.perf_counter() >= end:
                    return
                request = requests[sent % len(requests)]
                sent += 1
            began = time.perf_counter()
            try:
                stub.Score(request, timeout=timeout_s, metadata=metadata)
                status = "OK"
            except grpc.RpcError as error:
                status = error.code().name
            with lock:
                samples.append(Sample(time.perf_counter() - began, status))

    threads = [threading.Thread(target=caller, name=f"loadtest-caller-{n}") for n in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return summarise("closed", concurrency, samples, sent=sent, duration_s=time.perf_counter() - start)


def open_loop(stub: scoring_pb2_grpc.DenseScoringStub, requests: Sequence[scoring_pb2.ScoreRequest], *,
              rate: float, duration_s: float, max_requests: int, timeout_s: float, limits: LoadLimits,
              metadata: Sequence[tuple[str, str]] = ()) -> LevelReport:
    """Requests at `rate` per second, latency from each one's scheduled send time.

    Sending stops at `duration_s` even when the in-flight bound holds arrivals back (a stalled
    server), and answers are awaited `timeout_s` + `limits.drain_grace_s` longer, no more.
    """
    total = max(1, min(max_requests, int(rate * duration_s)))
    samples: list[Sample] = []
    lock = threading.Lock()
    slots = threading.BoundedSemaphore(limits.max_in_flight)
    outstanding = threading.Semaphore(0)
    futures: list[grpc.Future] = []
    start = time.perf_counter()
    end = start + duration_s

    def record(scheduled: float, status: str) -> None:
        with lock:
            samples.append(Sample(time.perf_counter() - scheduled, status))
        slots.release()
        outstanding.release()

    for n in range(total):
        scheduled = start + n / rate
        pause = scheduled - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
        # At the in-flight bound the send waits (its latency still counts from `scheduled`), but
        # not past the level's end.
        if not slots.acquire(timeout=max(0.0, end - time.perf_counter())):
            log.warning("open loop at %g/s: %d of %d arrivals not sent, %d requests in flight until the end",
                        rate, total - n, total, limits.max_in_flight)
            break
        future = stub.Score.future(requests[n % len(requests)], timeout=timeout_s, metadata=metadata)
        futures.append(future)

        def done(call: grpc.Future, scheduled: float = scheduled) -> None:
            code = call.code()
            record(scheduled, "OK" if code == grpc.StatusCode.OK else code.name)

        future.add_done_callback(done)
    drain_until = time.perf_counter() + timeout_s + limits.drain_grace_s
    answered = 0
    while answered < len(futures) and outstanding.acquire(timeout=max(0.0, drain_until - time.perf_counter())):
        answered += 1
    with lock:
        taken = list(samples)
    for future in futures:
        future.cancel()  # calls the server never answered end with the level
    return summarise("open", rate, taken, sent=len(futures), duration_s=time.perf_counter() - start)


def _size(text: str) -> tuple[int, int]:
    try:
        height, width = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HEIGHTxWIDTH such as 224x224; got {text!r}")
    return height, width


def _list(kind: type):
    def parse(text: str) -> list:
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__}s; got {text!r}")
        if not values or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"expected positive values; got {text!r}")
        return values
    return parse


def build_parser() -> argparse.ArgumentParser:
    limits = LoadLimits()
    parser = argparse.ArgumentParser(prog="scoremap-loadtest", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", required=True, metavar="HOST:PORT", help="the one target contacted")
    parser.add_argument("--allow-remote", action="store_true", help="allow a target that is not loopback")
    parser.add_argument("--tls", action="store_true", help="connect with TLS")
    parser.add_argument("--root-cert", type=Path, help="PEM root certificates for --tls")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=_list(int), help="closed-loop sweep, e.g. 1,4,16 (default 1,4,16)")
    load.add_argument("--rate", type=_list(float), help="open-loop arrival rates per second, e.g. 5,20")
    parser.add_argument("--duration", type=float, help=f"seconds per level (at most {limits.max_duration_s:g}; default 10 unless --requests)")
    parser.add_argument("--requests", type=int, help=f"requests per level (at most {limits.max_requests})")
    parser.add_argument("--images", metavar="DIR", help=f"cycle through these images (first {limits.max_inputs})")
    parser.add_argument("--sizes", type=lambda t: [_size(p) for p in t.split(",")], default=[(224, 224)],
                        help="synthetic image sizes HxW,... when no --images (default 224x224)")
    parser.add_argument("--model", default="")
    parser.add_argument("--scales", type=_list(int), default=[])
    parser.add_argument("--stride", type=int, default=0)
    parser.add_argument("--shift", choices=sorted(SHIFTS), default="auto")
    parser.add_argument("--flip", action="store_true")
    parser.add_argument("--maps", action="store_true", help="ask for full maps (measures their transfer too)")
    parser.add_argument("--timeout", type=float, default=ClientSettings.timeout_s,
                        help=f"deadline per request, seconds (default {ClientSettings.timeout_s:g})")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured requests before the first level")
    parser.add_argument("--json", metavar="PATH", help="write the reports as JSON ('-' for stdout)")
    parser.add_argument("--csv", metavar="PATH", help="write the reports as CSV ('-' for stdout)")
    return parser


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
    if not 0 < duration <= limits.max_duration_s:
        parser.error(f"--duration {duration:g} must be in (0, {limits.max_duration_s:g}] seconds")
    requests_cap = args.requests if args.requests is not None else limits.max_requests
    if not 0 < requests_cap <= limits.max_requests:
        parser.error(f"--requests {requests_cap} must be in 1..{limits.max_requests}")
    levels = args.concurrency or ([] if args.rate else [1, 4, 16])
    if any(c > limits.max_in_flight for c in levels):
        parser.error(f"--concurrency {levels} exceeds the bound of {limits.max_in_flight} callers")
    if args.rate and any(r > limits.max_rate for r in args.rate):
        parser.error(f"--rate {args.rate} exceeds the bound of {limits.max_rate:g} per second")
    try:
        options = ScoreOptions(model=args.model, scales=tuple(args.scales), stride=args.stride, shift=args.shift,
                               flip=args.flip, return_maps=args.maps)
        inputs = load_inputs(args.images, args.sizes, options, limits=limits)
    except ScoremapError as error:
        parser.error(error.message)
    settings = ClientSettings(timeout_s=args.timeout)
    token = os.environ.get(TOKEN_ENV) or None
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
    channel = open_channel(args.server, tls=args.tls, root_certificates=root, settings=settings)
    try:
        stub = scoring_pb2_grpc.DenseScoringStub(channel)
        for n in range(args.warmup):
            try:
                stub.Score(inputs[n % len(inputs)], timeout=args.timeout, metadata=metadata)
            except grpc.RpcError as error:
                log.warning("warm-up request failed: %s", error.code().name)
        reports: list[LevelReport] = []
        for concurrency in levels:
            reports.append(closed_loop(stub, inputs, concurrency=concurrency, duration_s=duration,
                                       max_requests=requests_cap, timeout_s=args.timeout, metadata=metadata))
        for rate in args.rate or []:
            reports.append(open_loop(stub, inputs, rate=rate, duration_s=duration, max_requests=requests_cap,
                                     timeout_s=args.timeout, limits=limits, metadata=metadata))
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
