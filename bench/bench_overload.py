"""Load shedding: what an overloaded server still delivers, and how fast it says no.

`scoremap-serve` in its own process (so the load generator's Python does not share the server's
GIL), default model, samples/cat.jpg, scale 384, stride 32 (one pass), CPU, batching off (the CPU
default) and the default `--max-queue-ms`. Capacity: closed loop, enough callers to keep the
model busy. Then open-loop arrivals at multiples of it, latency counted from each request's
scheduled send time (no coordinated omission), no retries. Targets at 5x: goodput >= 90% of
capacity (measured before the levels and after them, averaged), median rejection < 5 ms, admitted requests' time in the queue (as the server reports it)
within `--max-queue-ms` at p99, their latency p99 within `--max-queue-ms` plus their own time at that
load (their median latency outside the queue: contention slows the work itself, which no queue limit
bounds), and at most 1% of them dropped after their decode (admitted, then found to have waited past
the limit: work wasted on a refusal).
Each open-loop arrival is new work (its own request_id), as independent users' photos are.
Then clients that resend at once on any answer, refusals included (a naive retry loop, an HTTP load
balancer: a closed loop that ignores the retry hint), 16 and 64 of them, sending the same request again,
against the same server (by default its refusals are paced by the calls it answers, and a resent request
waits at the door for room) and against one that does neither (`UNPACED`: every refusal answered at once):
goodput must stay >= 90% of capacity, with the refusals answered per second and the
server CPU each costs.
Then refusals in a burst: BURST_CALLS callers send one two-scale request of a photo (BURST_JPEG_BYTES or so) at
once to a server with --queue-depth 2, and as many send the same bytes naming a model the server does not have;
the queue-full refusal must cost at most BURST_RATIO_TARGET times the unknown-model one (median latency), which
costs what reading the request costs.
The server runs without a per-peer call limit: one loopback address stands here for many clients.
"""

from __future__ import annotations

import functools
import io
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from PIL import Image

from bench.models import converted
from clients.api.options import ScoreOptions, as_new_work, build_request
from clients.api.settings import ClientSettings
from clients.loadtest.latency import LevelReport, Sample, summarise
from clients.loadtest.run import LevelPlan, LoadLimits, closed_loop
from clients.loadtest.server_metrics import scrape
from protos import RETRY_AFTER_KEY, scoring_pb2, scoring_pb2_grpc
from server.settings import Settings

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCALE = 384
STRIDE = 32
SINGLE_CALLS = 5  # unloaded calls, one at a time: a request's own time (median)
CAPACITY_CLIENTS = 4
CAPACITY_SECONDS = 20.0
OVERLOAD_FACTORS = (5, 5, 2)  # offered load, in multiples of the measured capacity; 5x twice, as one run varies by a few %
OVERLOAD_SECONDS = 30.0  # sending time per level
SETTLE_SECONDS = 3.0  # the first seconds of a level (queue filling up) are left out of its figures
TIMEOUT_S = ClientSettings.timeout_s  # every call's deadline: an ordinary client's
SERVER_START_SECONDS = 300.0
METRICS_TIMEOUT_S = 10.0
GOODPUT_TARGET = 0.90  # of capacity, at 5x
REJECTION_MEDIAN_TARGET_MS = 5.0
REJECTED = grpc.StatusCode.RESOURCE_EXHAUSTED.name
DROPPED_TARGET = 0.01  # of admitted requests
RESEND_CLIENTS = (16, 64)  # closed loops that resend at once on a refusal
RESEND_SECONDS = 20.0  # window per closed-loop level, after SETTLE_SECONDS
REFERENCE_CLIENTS = CAPACITY_CLIENTS  # the closed loop with no refusals: the server CPU an answer costs
UNPACED = ("--refusals-per-second", "0", "--refusals-per-answer", "0",  # every refusal answered at once,
           "--resend-memory-seconds", "0")  # and no door
BURST_CALLS = 40  # callers sending at once
BURST_SCALES = (SCALE, 512)
BURST_DEPTH = 2  # --queue-depth: one request's two scales fill it, so the rest of a burst is refused
BURST_JPEG_BYTES = 276_000  # about what a phone photo weighs
BURST_ROUNDS = 6  # bursts of each kind, alternated
BURST_PAUSE_SECONDS = 0.5  # between bursts: the last burst's answer still within the refusal pace's window
BURST_RATIO_TARGET = 1.5
UNKNOWN_MODEL = "no-such-model"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
ESTIMATE_MIN_RATE = 100  # refusals/s below which a level's own CPU per refusal is lost in the answers' noise


@dataclass(frozen=True)
class Level:
    """One open-loop level: the window's figures (`report`: OK answers only) and its rejections."""

    factor: float
    report: LevelReport
    queue_ms: np.ndarray  # each OK answer's time in the queue, as the server reports it
    outside_ms: np.ndarray  # each OK answer's latency less that: its own time at this load
    rejected_ms: np.ndarray  # latency of each RESOURCE_EXHAUSTED answered inside the window (drops included)
    hinted: int  # of those, how many carried the retry hint
    dropped: int  # images admitted, decoded, then dropped before compute inside the window (the server's count)
    admitted: int  # requests admitted and answered inside the window: OK, or dropped


@dataclass(frozen=True)
class Answer:
    """One call's outcome, as the load generator saw it."""

    sample: Sample
    queue_ms: float  # the server's figure, OK answers only (else NaN)
    hinted: bool  # RESOURCE_EXHAUSTED with the retry hint


@dataclass(frozen=True)
class Resent:
    """One closed-loop level whose clients resend at once on any answer: what its window saw."""

    clients: int
    paced: bool  # the server holds refusals beyond its pace (the default), or answers every one at once
    seconds: float
    ok_ms: np.ndarray  # latency of each OK answer inside the window
    refused_ms: np.ndarray  # latency of each RESOURCE_EXHAUSTED inside the window
    hinted: int  # of those, how many carried the retry hint
    others: dict[str, int]  # other statuses
    dropped: int  # images admitted, decoded, then dropped before compute inside the window (the server's count)
    server_cpu_s: float  # the server process's CPU time over the window (user + system)
    client_cpu_s: float  # this process's: the load generator shares the machine

    @property
    def goodput(self) -> float:
        return self.ok_ms.size / self.seconds

    def cpu_per_refusal_ms(self, cpu_per_answer_s: float) -> float:
        """The server CPU one refusal costs: the window's, less what its OK answers cost at the reference
        level (no refusals there), per refusal."""
        if not self.refused_ms.size:
            return float("nan")
        return 1000 * (self.server_cpu_s - self.ok_ms.size * cpu_per_answer_s) / self.refused_ms.size


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` and its live descendants (a server's worker processes), all their
    threads (/proc/PID/stat: ppid field 4, utime and stime fields 14 and 15)."""
    stats = {}
    for path in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = path.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        stats[int(path.parent.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS)
    children: dict[int, list[int]] = {}
    for child, (parent, _cpu) in stats.items():
        children.setdefault(parent, []).append(child)
    tree = [pid]
    for member in tree:  # grows as it goes: breadth first
        tree.extend(children.get(member, ()))
    return sum(stats[member][1] for member in tree if member in stats)


def resend_at_once(*, stub: scoring_pb2_grpc.DenseScoringStub, job: scoring_pb2.ScoreRequest, clients: int,
                   paced: bool, seconds: float, server_pid: int, metrics_url: str) -> Resent:
    """`clients` callers, each sending again as soon as it is answered, whatever the answer; figures over the
    window from SETTLE_SECONDS on, counting the answers completed inside it, and the CPU spent meanwhile."""
    answers: list[tuple[float, float, str, bool]] = []  # (done, latency s, status, hinted)
    stop = threading.Event()
    lock = threading.Lock()

    def caller() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            try:
                stub.Score(job, timeout=TIMEOUT_S)
                status, hinted = grpc.StatusCode.OK.name, False
            except grpc.RpcError as error:
                status = error.code().name
                hinted = any(key == RETRY_AFTER_KEY for key, _ in error.trailing_metadata() or ())
            done = time.perf_counter()
            with lock:
                answers.append((done, done - started, status, hinted))

    threads = [threading.Thread(target=caller, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    time.sleep(SETTLE_SECONDS)
    dropped = dropped_images(metrics_url)
    opened, server_cpu, client_cpu = time.perf_counter(), process_cpu_seconds(server_pid), time.process_time()
    time.sleep(seconds)
    closed = time.perf_counter()
    server_cpu, client_cpu = process_cpu_seconds(server_pid) - server_cpu, time.process_time() - client_cpu
    dropped = round(dropped_images(metrics_url) - dropped)
    stop.set()
    for thread in threads:
        thread.join(TIMEOUT_S)
    with lock:
        inside = [answer for answer in answers if opened < answer[0] <= closed]
    statuses = Counter(status for _, _, status, _ in inside)
    return Resent(
        clients, paced, closed - opened,
        ok_ms=np.array([1000 * latency for _, latency, status, _ in inside if status == grpc.StatusCode.OK.name]),
        refused_ms=np.array([1000 * latency for _, latency, status, _ in inside if status == REJECTED]),
        hinted=sum(hinted for *_, hinted in inside),
        others={code: n for code, n in statuses.items() if code not in (grpc.StatusCode.OK.name, REJECTED)},
        dropped=dropped, server_cpu_s=server_cpu, client_cpu_s=client_cpu,
    )


@dataclass(frozen=True)
class Burst:
    """Alternated bursts of one photo's request: the queue-full refusals' latencies and the unknown-model ones'."""

    jpeg_bytes: int
    full_ms: np.ndarray  # RESOURCE_EXHAUSTED answers to the bursts naming the served model
    unknown_ms: np.ndarray  # NOT_FOUND answers to the bursts naming no served model
    rounds: list[float]  # each round's ratio of medians, queue-full to unknown-model
    others: dict[str, int]  # other statuses (the admitted requests: OK)
    mixed_full_ms: np.ndarray  # the same two refusals in bursts of both kinds of call, sent together
    mixed_unknown_ms: np.ndarray

    @property
    def ratio(self) -> float:
        return percentile(self.full_ms, 50) / percentile(self.unknown_ms, 50)

    @property
    def mixed_ratio(self) -> float:
        return percentile(self.mixed_full_ms, 50) / percentile(self.mixed_unknown_ms, 50)


def burst_photo() -> bytes:
    """A photo of about BURST_JPEG_BYTES: samples/astronaut.jpg at 1400 px with sensor-like noise, as a camera
    writes it (the sample alone compresses to a fifth of that)."""
    image = Image.open(ROOT / "samples" / "astronaut.jpg").convert("RGB").resize((1400, 1400))
    noise = np.random.default_rng(0).integers(-12, 12, (1400, 1400, 3))
    pixels = (np.asarray(image).astype(np.int16) + noise).clip(0, 255).astype(np.uint8)
    encoded = io.BytesIO()
    Image.fromarray(pixels).save(encoded, format="JPEG", quality=77)
    return encoded.getvalue()


def at_once(stub: scoring_pb2_grpc.DenseScoringStub, jobs: Sequence[scoring_pb2.ScoreRequest],
            calls: int) -> list[tuple[float, str]]:
    """`calls` callers sending `jobs` in turn together (one channel, as one client's threads): each answer's latency
    in ms and status."""
    together, answers, lock = threading.Barrier(calls), [], threading.Lock()

    def call(job: scoring_pb2.ScoreRequest) -> None:
        together.wait()
        started = time.perf_counter()
        try:
            stub.Score(job, timeout=TIMEOUT_S)
            status = grpc.StatusCode.OK.name
        except grpc.RpcError as error:
            status = error.code().name
        with lock:
            answers.append((1000 * (time.perf_counter() - started), status))

    threads = [threading.Thread(target=call, args=(jobs[n % len(jobs)],)) for n in range(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


def refusal_bursts(stub: scoring_pb2_grpc.DenseScoringStub, model: str, *, rounds: int = BURST_ROUNDS) -> Burst:
    """Bursts of BURST_CALLS calls of one two-scale photo request, alternately naming the served `model` (one is
    admitted, the rest refused: queue full) and a model the server lacks (all refused: not found); then bursts of
    both kinds of call together, where the two refusals meet the same contention."""
    photo = burst_photo()
    full = scoring_pb2.ScoreRequest(encoded=photo, scales=BURST_SCALES, model=model)
    unknown = scoring_pb2.ScoreRequest(encoded=photo, scales=BURST_SCALES, model=UNKNOWN_MODEL)
    stub.Score(full, timeout=TIMEOUT_S)  # its plans made: the bursts measure refusals, not planning
    full_ms, unknown_ms, ratios, others, mixed = [], [], [], Counter(), []
    for _ in range(rounds):
        answers = {}
        for name, job in (("full", full), ("unknown", unknown)):
            time.sleep(BURST_PAUSE_SECONDS)
            answers[name] = at_once(stub, [job], BURST_CALLS)
        refused = [ms for ms, status in answers["full"] if status == REJECTED]
        missing = [ms for ms, status in answers["unknown"] if status == grpc.StatusCode.NOT_FOUND.name]
        others.update(status for ms, status in answers["full"] + answers["unknown"]
                      if status not in (REJECTED, grpc.StatusCode.NOT_FOUND.name))
        full_ms += refused
        unknown_ms += missing
        if refused and missing:
            ratios.append(statistics.median(refused) / statistics.median(missing))
    for _ in range(rounds):
        time.sleep(BURST_PAUSE_SECONDS)
        mixed += at_once(stub, [full, unknown], BURST_CALLS)
    return Burst(len(photo), np.array(full_ms), np.array(unknown_ms), ratios, dict(others),
                 mixed_full_ms=np.array([ms for ms, status in mixed if status == REJECTED]),
                 mixed_unknown_ms=np.array([ms for ms, status in mixed if status == grpc.StatusCode.NOT_FOUND.name]))


def burst_lines(burst: Burst) -> list[str]:
    said = "met" if burst.ratio <= BURST_RATIO_TARGET else "missed"
    return [
        "### Refusals in a burst",
        "",
        f"{BURST_CALLS} callers at once (one channel, each its own thread) send one request of a {burst.jpeg_bytes:,} "
        f"byte JPEG at scales {' and '.join(map(str, BURST_SCALES))} to a server with --queue-depth {BURST_DEPTH} "
        f"(the defaults otherwise): one is admitted, the rest refused for a full queue. Then as many send the same "
        f"bytes naming a model the server does not have: each is refused once read. {len(burst.rounds)} bursts of "
        f"each, alternated, {BURST_PAUSE_SECONDS:g} s apart (the admitted call's answer still counted by the refusal "
        "pace and the resend door).",
        "",
        "| refusal | count | p50 ms | p90 ms |",
        "|---|---|---|---|",
        f"| queue full (RESOURCE_EXHAUSTED) | {burst.full_ms.size} | {percentile(burst.full_ms, 50):.0f} | "
        f"{percentile(burst.full_ms, 90):.0f} |",
        f"| unknown model (NOT_FOUND) | {burst.unknown_ms.size} | {percentile(burst.unknown_ms, 50):.0f} | "
        f"{percentile(burst.unknown_ms, 90):.0f} |",
        "",
        f"- A queue-full refusal costs {burst.ratio:.2f}x an unknown-model refusal of the same bytes (medians; target "
        f"<= {BURST_RATIO_TARGET:g}x: {said}); burst by burst {', '.join(f'{r:.2f}' for r in burst.rounds)}x. Other "
        f"answers: {by_status(burst.others)}. The queue-full bursts also carry the admitted call's decode and run, on "
        "the same cores, which the unknown-model bursts do not.",
        f"- In {len(burst.rounds)} bursts of both kinds of call together (same contention for both): queue full p50 "
        f"{percentile(burst.mixed_full_ms, 50):.0f} ms ({burst.mixed_full_ms.size}), unknown model p50 "
        f"{percentile(burst.mixed_unknown_ms, 50):.0f} ms ({burst.mixed_unknown_ms.size}): {burst.mixed_ratio:.2f}x.",
    ]


def request() -> scoring_pb2.ScoreRequest:
    return build_request(ROOT / "samples" / "cat.jpg", ScoreOptions(scales=(SCALE,), stride=STRIDE))


def start_server(model: str, log: pathlib.Path, flags: Sequence[str] = (), *, provider: str = "cpu",
                 environment: Mapping[str, str] | None = None) -> tuple[subprocess.Popen, str, str]:
    """`scoremap-serve` on a free port, on `provider`, no per-peer limit, with `flags` (and `environment` in place
    of this process's); (process, address, metrics URL) once SERVING."""
    command = [sys.executable, "-m", "server.main", model, "--port", "0", "--provider", provider, "--metrics-port", "0",
               "--max-calls-per-peer", "0", "--warm-up-scales", str(SCALE), "--log-level", "WARNING", *flags]
    with log.open("w") as errors:
        server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True, env=environment)
    lines = [server.stdout.readline(), server.stdout.readline()]  # where it listens, then its metrics
    if "listening on" not in lines[0] or "metrics on" not in lines[1]:
        server.kill()
        raise RuntimeError(f"scoremap-serve did not start (exit status {server.wait()}): {log.read_text()[-2000:]}")
    address, metrics_url = (line.rsplit(" ", 1)[1].strip() for line in lines)
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        until = time.monotonic() + SERVER_START_SECONDS
        while health.Check(health_pb2.HealthCheckRequest(), timeout=SERVER_START_SECONDS,
                           wait_for_ready=True).status != health_pb2.HealthCheckResponse.SERVING:
            if time.monotonic() > until or server.poll() is not None:
                server.kill()
                raise RuntimeError(f"scoremap-serve never reported SERVING: {log.read_text()[-2000:]}")
            time.sleep(0.2)
    return server, address, metrics_url


def dropped_images(metrics_url: str) -> float:
    """The server's count of images admitted, decoded, then dropped before compute."""
    return scrape(metrics_url, timeout_s=METRICS_TIMEOUT_S).dropped


def own_time_ms(stub: scoring_pb2_grpc.DenseScoringStub, job: scoring_pb2.ScoreRequest) -> float:
    """A request's time through an idle server (median of SINGLE_CALLS)."""
    times = []
    for _ in range(SINGLE_CALLS):
        started = time.perf_counter()
        stub.Score(job, timeout=TIMEOUT_S)
        times.append(1000 * (time.perf_counter() - started))
    return statistics.median(times)


def capacity(channel: grpc.Channel, job: scoring_pb2.ScoreRequest, *, seconds: float) -> LevelReport:
    """Closed loop of CAPACITY_CLIENTS callers: the requests per second the server completes."""
    limits = LoadLimits()
    plan = LevelPlan(duration_s=seconds, max_requests=limits.max_requests, timeout_s=TIMEOUT_S,
                     warmup=CAPACITY_CLIENTS)
    return closed_loop(channel, [job], concurrency=CAPACITY_CLIENTS, plan=plan, limits=limits)


def open_loop(stub: scoring_pb2_grpc.DenseScoringStub, job: scoring_pb2.ScoreRequest, metrics_url: str, *,
              factor: float, rate: float, seconds: float) -> Level:
    """Arrivals at `rate`/s for `seconds`, every one sent however the server fares; figures over the
    window from SETTLE_SECONDS to the end of sending, counting what completed inside it.

    clients.loadtest.run's open loop reports latency percentiles of OK answers only; rejections need theirs.
    """
    answers: list[Answer] = []
    answered = threading.Condition()

    def done(scheduled: float, call: grpc.Future) -> None:
        now = time.perf_counter()
        code = grpc.StatusCode.CANCELLED if call.cancelled() else call.code()
        refused = code == grpc.StatusCode.RESOURCE_EXHAUSTED
        answer = Answer(
            Sample(now, now - scheduled, code.name),
            queue_ms=call.result().timings.queue_ms if code == grpc.StatusCode.OK else float("nan"),
            hinted=refused and any(key == RETRY_AFTER_KEY for key, _ in call.trailing_metadata() or ()),
        )
        with answered:
            answers.append(answer)
            answered.notify_all()

    total = int(rate * seconds)
    dropped_before = None  # the server's count as the window opens
    started = time.perf_counter()
    for n in range(total):
        scheduled = started + n / rate
        if dropped_before is None and scheduled >= started + SETTLE_SECONDS:
            dropped_before = dropped_images(metrics_url)
        time.sleep(max(0.0, scheduled - time.perf_counter()))
        call = stub.Score.future(as_new_work(job, n), timeout=TIMEOUT_S)  # independent users' requests
        call.add_done_callback(functools.partial(done, scheduled))
    sent_until = time.perf_counter()
    if dropped_before is None:  # a level no longer than its settling time: an empty window
        dropped_before = dropped_images(metrics_url)
    dropped = round(dropped_images(metrics_url) - dropped_before)  # inside the window; one image per request
    window = (started + SETTLE_SECONDS, sent_until)
    with answered:  # every call has a deadline, so every one is answered within it
        answered.wait_for(lambda: len(answers) == total, timeout=TIMEOUT_S + SETTLE_SECONDS)
        inside = [answer for answer in answers if window[0] < answer.sample.done_s <= window[1]]
    report = summarise("open", rate, [a.sample for a in inside], sent=total, start_s=window[0], end_s=window[1])
    scored = [a for a in inside if a.sample.status == grpc.StatusCode.OK.name]
    queue_ms = np.array([a.queue_ms for a in scored])
    return Level(
        factor, report, queue_ms=queue_ms,
        outside_ms=np.array([1000 * a.sample.latency_s for a in scored]) - queue_ms,
        rejected_ms=np.array([1000 * a.sample.latency_s for a in inside if a.sample.status == REJECTED]),
        hinted=sum(a.hinted for a in inside), dropped=dropped, admitted=report.completed + dropped,
    )


def by_status(errors: dict[str, int]) -> str:
    return ", ".join(f"{code} {count}" for code, count in errors.items()) or "none"


def percentile(values: np.ndarray, q: float) -> float:
    """NaN for no values (a level where nothing was answered OK, or nothing refused)."""
    return float(np.percentile(values, q)) if values.size else float("nan")


def row(level: Level, capacity: tuple[float, float]) -> str:
    report, rejected = level.report, level.rejected_ms
    cells = [f"{level.factor:g}x", f"{report.level:.1f}", f"{report.throughput_rps:.2f}",
             " / ".join(f"{100 * report.throughput_rps / rps:.0f}%" for rps in capacity),
             f"{report.p50_ms:.0f} / {report.p99_ms:.0f}",
             f"{percentile(level.queue_ms, 99):.0f}", f"{percentile(level.outside_ms, 50):.0f}", f"{level.dropped}",
             f"{rejected.size}", f"{percentile(rejected, 50):.1f} / {percentile(rejected, 99):.1f}",
             f"{level.hinted}/{rejected.size}", by_status(report.errors)]
    return "| " + " | ".join(cells) + " |"


def verdicts(level: Level, capacity_rps: float, max_queue_ms: float) -> str:
    report, rejected = level.report, level.rejected_ms
    goodput = report.throughput_rps / capacity_rps
    median = percentile(rejected, 50)
    queue_p99 = percentile(level.queue_ms, 99)
    bound_ms = max_queue_ms + percentile(level.outside_ms, 50)

    def said(ok: bool) -> str:
        return "met" if ok else "missed"

    return (f"- At {level.factor:g}x: goodput {100 * goodput:.0f}% of capacity (target >= {100 * GOODPUT_TARGET:.0f}%: "
            f"{said(goodput >= GOODPUT_TARGET)}); median rejection {median:.1f} ms (target < "
            f"{REJECTION_MEDIAN_TARGET_MS:g} ms: {said(median < REJECTION_MEDIAN_TARGET_MS)}); admitted requests' "
            f"queue time p99 {queue_p99:.0f} ms (limit {max_queue_ms:g} ms, which the server enforces: "
            f"{said(queue_p99 <= max_queue_ms)}), "
            f"latency p99 {report.p99_ms:.0f} ms (bound {bound_ms:.0f} ms: {said(report.p99_ms <= bound_ms)}); dropped "
            f"after their decode {level.dropped} of {level.admitted} (target <= {DROPPED_TARGET:.0%}: "
            f"{said(level.dropped <= DROPPED_TARGET * level.admitted)}).")


def resent_row(level: Resent, capacity_rps: float, cpu_per_answer_s: float) -> str:
    refused = level.refused_ms
    cells = [f"{level.clients}", "the defaults" if level.paced else "unpaced, no door",
             f"{level.goodput:.2f}", f"{capacity_rps:.2f}", f"{100 * level.goodput / capacity_rps:.0f}%",
             f"{percentile(level.ok_ms, 50):.0f} / {percentile(level.ok_ms, 99):.0f}",
             f"{refused.size / level.seconds:.0f}", f"{percentile(refused, 50):.1f} / {percentile(refused, 99):.1f}",
             f"{level.hinted}/{refused.size}", f"{level.dropped}", f"{level.server_cpu_s / level.seconds:.2f}",
             f"{level.cpu_per_refusal_ms(cpu_per_answer_s):.2f}" if refused.size / level.seconds >= ESTIMATE_MIN_RATE
             else "too few to tell", f"{level.client_cpu_s / level.seconds:.2f}",
             by_status(level.others)]
    return "| " + " | ".join(cells) + " |"


def resent_verdict(level: Resent, capacity_rps: float, refusal_cpu_ms: float) -> str:
    goodput = level.goodput / capacity_rps
    said = "met" if goodput >= GOODPUT_TARGET else "missed"
    server = "the defaults (paced refusals, resends at the door)" if level.paced else \
        "every refusal answered at once, no door"
    rate = level.refused_ms.size / level.seconds
    return (f"- {level.clients} clients resending at once, {server}: goodput {100 * goodput:.0f}% of capacity "
            f"(target >= {100 * GOODPUT_TARGET:.0f}%: {said}); {rate:.0f} refusals/s, at {refusal_cpu_ms:.2f} ms "
            f"each about {rate * refusal_cpu_ms / 1000:.2f} s of server CPU a second.")


def run(*, capacity_seconds: float = CAPACITY_SECONDS, overload_seconds: float = OVERLOAD_SECONDS,
        resend_seconds: float = RESEND_SECONDS, burst_rounds: int = BURST_ROUNDS) -> str:
    """The section; shorter durations prove the module works (timings then mean little)."""
    load_before = os.getloadavg()[0]
    defaults = Settings()
    max_queue_ms = defaults.max_queue_ms
    job = request()
    with tempfile.TemporaryDirectory() as folder:
        model = converted(folder, output_stride=STRIDE)
        server, address, metrics_url = start_server(model, pathlib.Path(folder) / "server.log")
        unpaced, unpaced_address, unpaced_metrics = start_server(model, pathlib.Path(folder) / "unpaced.log", UNPACED)
        try:
            with grpc.insecure_channel(address) as channel, grpc.insecure_channel(unpaced_address) as unpaced_channel:
                stub = scoring_pb2_grpc.DenseScoringStub(channel)
                own_ms = own_time_ms(stub, job)
                before = capacity(channel, job, seconds=capacity_seconds)
                levels = [open_loop(stub, job, metrics_url, factor=factor, rate=factor * before.throughput_rps,
                                    seconds=overload_seconds) for factor in OVERLOAD_FACTORS]
                after = capacity(channel, job, seconds=capacity_seconds)  # the machine's pace drifts by a few %
                servers = {True: dict(stub=stub, server_pid=server.pid, metrics_url=metrics_url),
                           False: dict(stub=scoring_pb2_grpc.DenseScoringStub(unpaced_channel),
                                       server_pid=unpaced.pid, metrics_url=unpaced_metrics)}
                reference = resend_at_once(job=job, clients=REFERENCE_CLIENTS, paced=True, seconds=resend_seconds,
                                           **servers[True])
                resent, local = [], []  # each level, and the capacity measured on its server before and after it
                for clients in RESEND_CLIENTS:
                    for paced in (True, False, False, True):  # ABBA: drift cancels
                        level_channel = channel if paced else unpaced_channel
                        before_level = capacity(level_channel, job, seconds=capacity_seconds / 2).throughput_rps
                        resent.append(resend_at_once(job=job, clients=clients, paced=paced, seconds=resend_seconds,
                                                     **servers[paced]))
                        after_level = capacity(level_channel, job, seconds=capacity_seconds / 2).throughput_rps
                        local.append((before_level, after_level))
        finally:
            for process in (server, unpaced):
                process.terminate()
                process.wait(30)
        bursting, burst_address, _ = start_server(model, pathlib.Path(folder) / "burst.log",
                                                  ("--queue-depth", str(BURST_DEPTH)))
        try:
            with grpc.insecure_channel(burst_address) as channel:
                burst = refusal_bursts(scoring_pb2_grpc.DenseScoringStub(channel), pathlib.Path(model).stem,
                                       rounds=burst_rounds)
        finally:
            bursting.terminate()
            bursting.wait(30)
    capacity_rps = (before.throughput_rps + after.throughput_rps) / 2
    cpu_per_answer_s = reference.server_cpu_s / max(reference.ok_ms.size, 1)
    # What a refusal costs, from the unpaced levels: there refusals are most of the server's work, so the
    # estimate is not lost in the answers' own cost, as it is with tens of refusals a second.
    refusal_cpu_ms = statistics.mean([level.cpu_per_refusal_ms(cpu_per_answer_s) for level in resent
                                      if not level.paced and level.refused_ms.size] or [float("nan")])
    return "\n".join([
        "## Overload (bench_overload)",
        "",
        f"`scoremap-serve` in its own process: EfficientNet-Lite0, samples/cat.jpg, scale {SCALE}, stride {STRIDE} "
        f"(one pass), CPU, batching off, --max-queue-ms {max_queue_ms:g}, --refusals-per-answer "
        f"{defaults.refusals_per_answer:g}, --refusals-per-second {defaults.refusals_per_second:g}, no per-peer limit; every call's deadline {TIMEOUT_S:g} s, no retries.",
        "",
        f"One request alone: {own_ms:.0f} ms (median of {SINGLE_CALLS}). Capacity, closed loop, {CAPACITY_CLIENTS} "
        f"clients, {before.duration_s:.0f} s before the levels and again after them: {before.throughput_rps:.2f} and "
        f"{after.throughput_rps:.2f} requests/s (p50 {before.p50_ms:.0f} and {after.p50_ms:.0f} ms, errors: "
        f"{by_status(before.errors)} and {by_status(after.errors)}); their mean, {capacity_rps:.2f}, is the "
        "capacity below (the levels' rates are multiples of the first).",
        "",
        f"Open loop, {overload_seconds:g} s of arrivals per level, latency from the scheduled send time; figures "
        f"over the window after the first {SETTLE_SECONDS:g} s (answers completed inside it):",
        "",
        "| offered | req/s | goodput req/s | of capacity: mean / before | admitted p50 / p99 ms | queue p99 ms | own time p50 ms "
        "| dropped after decode | rejected | rejection p50 / p99 ms | retry hint | errors by status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(row(level, (capacity_rps, before.throughput_rps)) for level in levels),
        "",
        *(verdicts(level, capacity_rps, max_queue_ms) for level in levels),
        "",
        "Queue p99: the admitted requests' time in the queue, as the server reports it (`timings.queue_ms`). "
        "Dropped after decode: the server's `scoremap_dropped_total` over the window; those refusals count among "
        "the rejected too. Own "
        "time: their latency outside the queue (decode, run, answer), median; the latency bound is --max-queue-ms "
        f"plus it, as contention slows the work itself (alone: {own_ms:.0f} ms). Load average "
        f"{load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} cores.",
        "",
        "### Clients that resend at once",
        "",
        f"Closed loops whose callers send again as soon as they are answered, refusals included (the retry hint "
        f"ignored), each call's deadline {TIMEOUT_S:g} s, from one process on the same machine; {resend_seconds:g} s "
        f"windows after {SETTLE_SECONDS:g} s, two per setting, in the order defaults, unpaced, unpaced, defaults. "
        f"The defaults: --refusals-per-answer {defaults.refusals_per_answer:g}, --refusals-per-second "
        f"{defaults.refusals_per_second:g}, --resend-memory-seconds {defaults.resend_memory_seconds:g}, "
        f"--max-refusal-hold-ms {defaults.max_refusal_hold_ms:g}, --max-held-refusals {defaults.max_held_refusals}, "
        f"--grpc-workers {defaults.grpc_workers}; unpaced: the same with {' '.join(UNPACED)}, every refusal "
        "answered at once and no door. Capacity: each level's own, the mean of "
        f"{REFERENCE_CLIENTS} clients' closed loop on its server for {capacity_seconds / 2:g} s just before it and "
        f"just after it (the machine's pace drifts by 10% within minutes; before / after: "
        f"{', '.join(f'{b:.1f} / {a:.1f}' for b, a in local)} requests/s). "
        f"Reference: {REFERENCE_CLIENTS} such clients on the "
        f"paced server, {reference.goodput:.2f} requests/s, {reference.refused_ms.size} refused, the server's CPU "
        f"{1000 * cpu_per_answer_s:.0f} ms per answer.",
        "",
        "| clients | server | goodput req/s | capacity around it | of capacity | OK p50 / p99 ms | refusals/s | refusal p50 / p99 ms "
        "| retry hint | dropped after decode | server CPU s/s | server CPU per refusal ms | load generator CPU s/s "
        "| other errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(resent_row(level, statistics.mean(rps), cpu_per_answer_s) for level, rps in zip(resent, local)),
        "",
        *(resent_verdict(level, statistics.mean(rps), refusal_cpu_ms) for level, rps in zip(resent, local)),
        "",
        "Server CPU: the server process's user + system time over the window (/proc/PID/stat). Per refusal: that, "
        "less the OK answers' cost at the reference level (its CPU per answer, no refusals there), divided by the "
        "refusals: an estimate, as contention changes what an answer costs; with tens of refusals a second it is "
        f"within that noise, so the lines above use the unpaced levels' mean, {refusal_cpu_ms:.2f} ms. Refusal "
        "latency includes the hold, and for a request dropped after its decode its time in the queue too; OK "
        "latency includes the wait at the door. "
        f"Load generator CPU: this process's, sharing the server's {os.cpu_count()} cores.",
        "",
        *burst_lines(burst),
    ])


if __name__ == "__main__":
    print(run())
