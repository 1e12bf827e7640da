"""The engine process and its fronts (`--fronts`) against one process, on this machine's CPU.

`scoremap-serve` with the null model (bench/models.py: the device graph's work with next to no net), closed loops
over gRPC on 16 connections (as from 16 clients; one connection would reach one front), spread evenly over the fronts
(`warm_connections`), stride 32, top-5, one intra-op thread (a plan's run then takes its wall time in CPU). Three
photos: samples/cat.jpg enlarged to 384, a 600x512 JPEG shrunk to 384, a 12-megapixel JPEG shrunk to 768, each
server warmed up at its photo's scale (its canvas one of the buckets: one item per request, not tiles). Per level:
throughput and each process's CPU per request from /proc, the means of two levels of each layout, alternated; at one
client, three servers of each layout up at once and answering blocks of calls in turn, each layout's p50 (the mean of
its instances'), the added p50's 95% bootstrap interval over the run's rounds, each instance's p50, and the share of
the machine's CPU time its host took meanwhile (steal, from /proc/stat): servers of one layout differ by more than
that interval, each keeping its luck for its life, so one of each measured that luck as much as the split. The
engine's own work per request is its CPU less its batches' (the plans' runs and the answers of their items:
`scoremap_batch_cpu_seconds`), both read in the same level.
Targets (the engine split's): the engine's own CPU per request <= 0.3 ms; a front's CPU per request (the fronts' CPU
over the requests they shared) no more than the single process's; at one client the split adds <= 0.3 ms p50, and as a
ratio in one run (the added time is CPU on the request's path, which scales with the host's speed: docs/design.md)
its p50 <= 1.10x the single process's; batching on >= 0.95x off at 1 and 4 clients; `--fronts 2` >= 0.85x the single
process's req/s at 16 clients; the idle server with 2 fronts <= 350 MiB PSS + 60 MiB per front, shared memory counted.
"""

from __future__ import annotations

import io
import pathlib
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import NamedTuple

import grpc
import numpy as np
from PIL import Image

from bench.bench_overload import METRICS_TIMEOUT_S, process_cpu_seconds, start_server
from bench.models import null_model
from clients.loadtest.levels import run_level
from clients.loadtest.run import LevelPlan, LoadLimits
from clients.loadtest.server_metrics import scrape
from clients.loadtest.spread import Target
from clients.loadtest.traffic import Closed, Payloads, raw_calls
from protos import scoring_pb2, scoring_pb2_grpc

ROOT = pathlib.Path(__file__).resolve().parents[1]
SECONDS = 6.0
FRONTS = 2
CLIENTS = 16
CONNECTIONS = 16  # as many clients' connections, spread evenly over the fronts
ENGINE_TARGET_MS = 0.3
LATENCY_TARGET_MS = 0.3
LATENCY_RATIO_TARGET = 1.10  # the split's p50 at one client over the single process's, in one run
# At one client ONE_CLIENT_INSTANCES servers of each layout are up at once and answer blocks of calls in turn, a block
# about ONE_CLIENT_BLOCK_SECONDS long, the first call of each not counted (the one after another server's block), for
# ONE_CLIENT_SECONDS and at least ONE_CLIENT_ROUNDS rounds (a block of each server). Between two counted calls a
# server is then idle, as under one client; calls alternated one for one instead ran each after the other server's
# request, which read the split's added p50 0.2-0.4 ms higher in the same run (cat.jpg and the shrunk photo). Several
# instances, as two servers of one layout read p50s up to 0.15 ms apart on the shrunk photo in one run, their decoding
# 0.2 ms apart (docs/design.md): one of each measured that luck as much as the split.
ONE_CLIENT_INSTANCES = 3
ONE_CLIENT_SECONDS = 60.0
ONE_CLIENT_BLOCK_SECONDS = 0.3
ONE_CLIENT_ROUNDS = 10
RESAMPLES = 2000  # bootstrap draws of the rounds behind the added p50's 95% interval
RATE_TARGET = 0.85
BATCHING_TARGET = 0.95
BATCHING = {"on": ("--max-batch", "8"), "off": ("--max-batch", "1")}
# Batching on and off: BATCHING_INSTANCES servers of each up at once, closed loops of BATCHING_SECONDS on each in turn
# (each server a place further every round) for BATCHING_ROUNDS rounds; the median of the rounds' ratios of the two
# modes' mean req/s. Servers started for each level read up to 13% apart at the same setting here, and 3 s levels on
# the same two servers from 250 to 420 req/s within a minute; two servers of the same setting, up at once and taking
# turns, read 0.97-1.01x each other at 4 clients from one start to the next (each keeps its luck, as at one client).
BATCHING_INSTANCES = 3
BATCHING_ROUNDS = 8
BATCHING_SECONDS = 1.25
IDLE_TARGET_MIB = 350
PER_FRONT_MIB = 60


def photos() -> dict[str, tuple[bytes, int]]:
    """The requests' images and scales: enlarged, shrunk, and a phone photo shrunk."""
    def jpeg(image: Image.Image) -> bytes:
        out = io.BytesIO()
        image.save(out, "JPEG", quality=90)
        return out.getvalue()

    coffee = Image.open(ROOT / "samples" / "coffee.jpg").convert("RGB")
    rocket = Image.open(ROOT / "samples" / "rocket.jpg").convert("RGB")
    return {
        "cat.jpg 451x300 enlarged to 384": ((ROOT / "samples" / "cat.jpg").read_bytes(), 384),
        "600x512 JPEG shrunk to 384": (jpeg(coffee.resize((600, 512), Image.Resampling.BICUBIC)), 384),
        "12 Mpx JPEG (4000x3000) shrunk to 768": (jpeg(rocket.resize((4000, 3000), Image.Resampling.BICUBIC)), 768),
    }


def own_cpu_seconds(pid: int) -> float:
    """CPU of process `pid`'s threads, not its children's:
    the scheduler's nanoseconds (/proc/PID/task/TID/schedstat), as clock ticks would read ±0.08 ms per request at
    the 12 Mpx photo's rate; a thread that ended is not counted (a serving process's threads live as long as it)."""
    total = 0
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except OSError:  # ended meanwhile
            continue
    return total / 1e9


def roles(pid: int) -> dict[str, int]:
    """A split server's processes by their title ("engine", "front 0", ...); {} for one process."""
    found = {}
    for path in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(path.read_text().rsplit(")", 1)[1].split()[1])
            title = (path.parent / "cmdline").read_bytes().split(b"\0")[0].decode()
        except (OSError, ValueError):
            continue
        if parent == pid and title.startswith("scoremap-serve: "):
            found[title.removeprefix("scoremap-serve: ")] = int(path.parent.name)
    return found


def pss_mib(pid: int) -> float:
    """Proportional set size (shared pages, shared memory among them, split between their users)."""
    for line in pathlib.Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    return 0.0


def serve(model: str, log: pathlib.Path, *, fronts: int, scale: int,
          flags: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str, str]:
    """`scoremap-serve` as every measurement here runs it: `--fronts fronts`, one intra-op thread, warmed up at the
    photo's scale (start_server's process, address and metrics URL)."""
    return start_server(model, log, ("--fronts", str(fronts), "--intra-op-threads", "1", "--warm-up-scales", str(scale),
                                     *flags))


def warm_connections(address: str, request: scoring_pb2.ScoreRequest, server: int) -> list[grpc.Channel]:
    """CONNECTIONS channels to the server `server` (its process id), each up and its front (or worker) warm: one call
    answered on each. Spread evenly over a split server's fronts: the kernel spreads connections by a hash of their
    ports, 16 of them 11 and 5 over two fronts at one start and 8 and 8 at the next, and the front with more of them
    then carries more of the load for the server's life (a rate measured on it reads that luck). A connection that
    lands on a front holding its share already is closed and another opened."""
    fronts = [pid for role, pid in roles(server).items() if role.startswith("front")]
    share = -(-CONNECTIONS // max(1, len(fronts)))
    kept: list[grpc.Channel] = []
    held = {pid: 0 for pid in fronts}
    seen = {pid: connections_of(pid, address) for pid in fronts}
    for _ in range(8 * CONNECTIONS):  # a hash that keeps choosing full fronts gives up with what it has
        if len(kept) == CONNECTIONS:
            break
        channel = Target(address).open()[0]
        answered(scoring_pb2_grpc.DenseScoringStub(channel), request)
        now = {pid: connections_of(pid, address) for pid in fronts}
        landed = [pid for pid in fronts if now[pid] - seen[pid]]
        seen = now
        if landed and held[landed[0]] >= share:
            channel.close()
            continue
        if landed:
            held[landed[0]] += 1
        kept.append(channel)
    return kept


def connections_of(pid: int, address: str) -> set[int]:
    """The socket inodes of the established TCP connections process `pid` holds on `address`'s port."""
    port = f"{int(address.rsplit(':', 1)[1]):04X}"
    held = set()
    for fd in pathlib.Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().name
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            held.add(int(target[8:-1]))
    established = set()
    for table in ("tcp", "tcp6"):
        for line in pathlib.Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[1].endswith(f":{port}") and fields[3] == "01":  # local port, state ESTABLISHED
                established.add(int(fields[9]))
    return held & established


def level(model: str, folder: pathlib.Path, *, fronts: int, clients: int, image: bytes, scale: int,
          flags: tuple[str, ...] = ()) -> dict[str, float]:
    """One closed loop on a server of its own: req/s, the CPU ms per request of the threads running batches, CPU ms
    per request of the whole server and of each role."""
    server, address, metrics = serve(model, folder / "server.log", fronts=fronts, scale=scale, flags=flags)
    try:
        request = scoring_pb2.ScoreRequest(encoded=image, scales=[scale])
        channels = warm_connections(address, request, server.pid)
        try:
            processes = roles(server.pid)
            counted = scrape(metrics, timeout_s=METRICS_TIMEOUT_S)  # outside the CPU's window: a scrape costs CPU
            before = {role: own_cpu_seconds(pid) for role, pid in processes.items()}
            whole = process_cpu_seconds(server.pid)
            limits = LoadLimits()
            plan = LevelPlan(duration_s=SECONDS, max_requests=limits.max_requests, timeout_s=120.0, warmup=clients)
            traffic = Closed(raw_calls(channels), Payloads.of([request]), callers=clients, timeout_s=plan.timeout_s,
                             limits=limits)
            report = run_level(traffic, plan, limits=limits)
            cpu = {"cpu": process_cpu_seconds(server.pid) - whole}
            for role, pid in processes.items():
                try:
                    cpu[role] = own_cpu_seconds(pid) - before[role]
                except FileNotFoundError:
                    log = (folder / "server.log").read_text()[-3000:]
                    raise RuntimeError(f"the {role} process ended during the level: {log}") from None
            served = scrape(metrics, timeout_s=METRICS_TIMEOUT_S)
            # The threads that ran batches (a runner, or the engine input thread that claimed one): the rest of the
            # engine's CPU is its own work per request.
            cpu["inference"] = served.batch_cpu_s - counted.batch_cpu_s
            answered_calls = served.answered - counted.answered
            # Per request the server answered in the CPU's window: the level's warm-up and the calls in flight at
            # its end included, which its rate leaves out.
            figures = {"rate": report.throughput_rps} | {key: 1000 * seconds / max(answered_calls, 1)
                                                        for key, seconds in cpu.items()}
            if report.errors:
                raise RuntimeError(f"--fronts {fronts}, {clients} clients: requests failed: {report.errors}")
        finally:
            for channel in channels:
                channel.close()
    finally:
        server.terminate()
        server.wait(60)
    return figures


@dataclass(frozen=True)
class Batching:
    """Batching on against off at one number of clients: the median of the rounds' ratios, and each instance's median
    req/s (on, then off)."""

    ratio: float
    on: tuple[float, ...]
    off: tuple[float, ...]


def batching_ratio(model: str, folder: pathlib.Path, *, clients: int, image: bytes, scale: int) -> Batching:
    """`--fronts FRONTS` with batching on against off at `clients`: BATCHING_INSTANCES servers of each mode up at once,
    their closed loops of BATCHING_SECONDS taking turns, each server a place further every round (the machine's drift
    falls on all alike); each round's ratio is the on servers' mean req/s over the off servers'. Several servers of
    each: each keeps its start's luck for its life."""
    request = scoring_pb2.ScoreRequest(encoded=image, scales=[scale])
    plan = LevelPlan(duration_s=BATCHING_SECONDS, max_requests=LoadLimits().max_requests, timeout_s=120.0,
                     warmup=clients)
    modes = list(BATCHING) * BATCHING_INSTANCES  # started alternately: no mode gets the first starts
    servers, links = [], []
    try:
        for index, mode in enumerate(modes):
            server, address, _metrics = serve(model, folder / f"batching-{mode}-{index}.log", fronts=FRONTS,
                                              scale=scale, flags=BATCHING[mode])
            servers.append(server)
            links.append(warm_connections(address, request, server.pid))
        rates = np.zeros((BATCHING_ROUNDS, len(modes)))
        for round_ in range(BATCHING_ROUNDS):
            shift = round_ % len(modes)
            for index in [*range(shift, len(modes)), *range(shift)]:
                limits = LoadLimits()
                traffic = Closed(raw_calls(links[index]), Payloads.of([request]), callers=clients,
                                 timeout_s=plan.timeout_s, limits=limits)
                report = run_level(traffic, plan, limits=limits)
                if report.errors:
                    raise RuntimeError(f"batching {modes[index]}, {clients} clients: requests failed: {report.errors}")
                rates[round_, index] = report.throughput_rps
        on = np.array([mode == "on" for mode in modes])
        ratio = statistics.median(rates[:, on].mean(axis=1) / rates[:, ~on].mean(axis=1))
        each = np.median(rates, axis=0)
        return Batching(float(ratio), tuple(float(r) for r in each[on]), tuple(float(r) for r in each[~on]))
    finally:
        for channels in links:
            for channel in channels:
                channel.close()
        for server in servers:
            server.terminate()
            server.wait(60)


def means(levels: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's mean over `levels`."""
    return {key: statistics.mean(each[key] for each in levels) for key in levels[0]}


class CpuTimes(NamedTuple):
    user: int
    nice: int
    system: int
    idle: int
    iowait: int
    irq: int
    softirq: int
    steal: int


@dataclass(frozen=True)
class OneClient:
    """p50 ms at one client of one process and of the split (each the mean of its instances' p50s), the split's added
    p50 with its 95% interval, each layout's instances' p50s, and what the split adds inside the server outside the
    image's decoding (the responses' own timings), which no decoding luck reaches."""

    single: float
    split: float
    low: float
    high: float
    calls: int  # counted calls per instance
    steal: float  # the share of the machine's CPU time its host took meanwhile
    singles: tuple[float, ...]
    splits: tuple[float, ...]
    served: float  # ms the split adds between the decoding's end and the response

    @property
    def added(self) -> float:
        return self.split - self.single

    @property
    def ratio(self) -> float:
        return self.split / self.single


def added_p50(rounds: np.ndarray, split: np.ndarray) -> float:
    """The mean p50 of the split's instances less that of one process's; `rounds`: round x server x call, `split`:
    which servers are split."""
    p50s = medians(rounds)
    return float(p50s[split].mean() - p50s[~split].mean())


def medians(rounds: np.ndarray) -> np.ndarray:
    """Each server's median over its calls of every round; `rounds`: round x server x call."""
    return np.median(rounds.transpose(1, 0, 2).reshape(rounds.shape[1], -1), axis=1)


def added_interval(rounds: np.ndarray, split: np.ndarray, *, seed: int = 0) -> tuple[float, float]:
    """The 95% bootstrap interval of `added_p50`, resampling whole rounds (a round's blocks, one after the other, saw
    the machine alike; a block's calls are not independent of each other). It holds this run's noise, not the
    instances' luck, which the instances' p50s show."""
    draws = np.random.default_rng(seed).integers(0, len(rounds), size=(RESAMPLES, len(rounds)))
    low, high = np.percentile([added_p50(rounds[draw], split) for draw in draws], [2.5, 97.5])
    return float(low), float(high)


def one_client_p50s(model: str, folder: pathlib.Path, *, image: bytes, scale: int) -> OneClient:
    """p50 ms at one client of ONE_CLIENT_INSTANCES servers of one process and as many of `--fronts FRONTS`, all
    serving at once, each answering a block of calls in turn (each server a place further in every round): the
    machine's drift falls on every server alike. Levels run one after the other on servers of their own differed by
    up to 1 ms here from one start to the next, three times the target."""
    layouts = [0, FRONTS] * ONE_CLIENT_INSTANCES  # alternated: each split server answers after a single one
    servers, stubs = [], []
    try:
        for index, fronts in enumerate(layouts):
            server, address, _metrics = serve(model, folder / f"one-client-{index}.log", fronts=fronts, scale=scale)
            servers.append(server)
            stubs.append(scoring_pb2_grpc.DenseScoringStub(grpc.insecure_channel(address)))
        request = scoring_pb2.ScoreRequest(encoded=image, scales=[scale])
        started = time.perf_counter()
        for stub in stubs:
            answered(stub, request)
        block = 1 + max(2, round(ONE_CLIENT_BLOCK_SECONDS / ((time.perf_counter() - started) / len(stubs))))
        rounds: list[list[list[float]]] = []
        served: list[list[list[float]]] = []  # each call's time in the server outside decoding, as `rounds`
        before = cpu_times()
        ends = time.monotonic() + ONE_CLIENT_SECONDS
        while time.monotonic() < ends or len(rounds) < ONE_CLIENT_ROUNDS:
            shift = len(rounds) % len(stubs)
            blocks: list[list[float]] = [[] for _ in stubs]
            inside: list[list[float]] = [[] for _ in stubs]
            for index in [*range(shift, len(stubs)), *range(shift)]:
                calls, timings = [], []
                for _ in range(block):
                    began = time.perf_counter()
                    timings.append(stubs[index].Score(request, timeout=120).timings)
                    calls.append(1000 * (time.perf_counter() - began))
                blocks[index] = calls[1:]  # the first: just after another server's block
                inside[index] = [each.total_ms - each.preprocess_ms for each in timings[1:]]
            rounds.append(blocks)
            served.append(inside)
        after = cpu_times()
        calls_by_round = np.array(rounds)
        split = np.array([fronts > 0 for fronts in layouts])
        p50s = medians(calls_by_round)
        return OneClient(float(p50s[~split].mean()), float(p50s[split].mean()),
                         *added_interval(calls_by_round, split), calls=len(rounds) * (block - 1),
                         steal=(after.steal - before.steal) / (sum(after) - sum(before)),
                         singles=tuple(float(p) for p in p50s[~split]), splits=tuple(float(p) for p in p50s[split]),
                         served=added_p50(np.array(served), split))
    finally:
        for server in servers:
            server.terminate()
            server.wait(60)


def spread(figures: tuple[float, ...], decimals: int = 2) -> str:
    """The lowest and highest of the instances' figures."""
    return f"{min(figures):.{decimals}f}-{max(figures):.{decimals}f}"


def cpu_times() -> CpuTimes:
    """This machine's CPU time by state, in clock ticks (/proc/stat's first line: user, nice, system, idle, iowait,
    irq, softirq, steal)."""
    return CpuTimes(*(int(field) for field in pathlib.Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]))


def answered(stub: scoring_pb2_grpc.DenseScoringStub, request: scoring_pb2.ScoreRequest, *,
             seconds: float = 120.0) -> None:
    """One call answered, retried while the process behind the connection is still warming up (UNAVAILABLE): a
    server says SERVING when one of its `--workers` is warm."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            stub.Score(request, timeout=seconds)
            return
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def idle_memory(model: str, folder: pathlib.Path) -> tuple[float, dict[str, float]]:
    """The idle split server's PSS, whole and by role, after one request of each photo."""
    server, address, _metrics = start_server(model, folder / "idle.log", ("--fronts", str(FRONTS)))
    try:
        with grpc.insecure_channel(address) as channel:
            stub = scoring_pb2_grpc.DenseScoringStub(channel)
            for image, scale in photos().values():
                stub.Score(scoring_pb2.ScoreRequest(encoded=image, scales=[scale]), timeout=120)
        time.sleep(3)  # the arena's idle release
        each = {role: pss_mib(pid) for role, pid in roles(server.pid).items()}
        return pss_mib(server.pid) + sum(each.values()), each
    finally:
        server.terminate()
        server.wait(60)


def run() -> str:
    rows, verdicts = [], []
    with tempfile.TemporaryDirectory() as scratch:
        folder = pathlib.Path(scratch)
        model = null_model(scratch)
        for name, (image, scale) in photos().items():
            levels: dict[int, list[dict[str, float]]] = {0: [], FRONTS: []}
            for fronts in (0, FRONTS, FRONTS, 0):  # alternated: the machine's drift falls on both alike
                levels[fronts].append(level(model, folder, fronts=fronts, clients=CLIENTS, image=image, scale=scale))
            single, split = (means(levels[fronts]) for fronts in (0, FRONTS))
            one = one_client_p50s(model, folder, image=image, scale=scale)
            engine_own = split["engine"] - split["inference"]
            front_cpu = sum(split[f"front {i}"] for i in range(FRONTS))  # each front serves its connections' share
            rate = split["rate"] / single["rate"]
            rows.append(f"| {name} | {single['rate']:.1f} / {split['rate']:.1f} = {rate:.2f}x | "
                        f"{single['cpu']:.2f} / {split['cpu']:.2f} | {front_cpu:.2f} | {split['engine']:.2f} - "
                        f"{split['inference']:.2f} = {engine_own:.2f} | {one.single:.2f} / "
                        f"{one.split:.2f} = {one.ratio:.3f}x ({one.added:+.2f}, 95% {one.low:+.2f} to {one.high:+.2f}; "
                        f"instances {spread(one.singles)} / {spread(one.splits)}; outside decoding {one.served:+.2f}; "
                        f"{one.calls} calls each; steal {100 * one.steal:.1f}%) |")
            verdicts.append((name, engine_own <= ENGINE_TARGET_MS, front_cpu <= single["cpu"],
                             one.added <= LATENCY_TARGET_MS, one.ratio <= LATENCY_RATIO_TARGET, rate >= RATE_TARGET))
        image, scale = photos()["cat.jpg 451x300 enlarged to 384"]
        alone = level(model, folder, fronts=0, clients=CLIENTS, image=image, scale=scale)
        workers = level(model, folder, fronts=0, clients=CLIENTS, image=image, scale=scale, flags=("--workers", "2"))
        batching = {clients: batching_ratio(model, folder, clients=clients, image=image, scale=scale)
                    for clients in (1, 4)}
        idle, each = idle_memory(model, folder)
    idle_target = IDLE_TARGET_MIB + PER_FRONT_MIB * FRONTS

    def said(ok: bool) -> str:
        return "met" if ok else "missed"

    lines = [
        "## The engine process and its fronts (bench_split)",
        "",
        f"Null model, `--intra-op-threads 1`, stride 32, top-5, closed loops of {SECONDS:.0f} s over gRPC on "
        f"{CONNECTIONS} connections (spread evenly over the fronts), each on a "
        f"server of its own warmed up at the photo's scale (`--warm-up-scales`: its canvas a bucket, one item per "
        f"request): one process (`--fronts 0`) against `--fronts {FRONTS}` (an engine process and {FRONTS} fronts); "
        "CPU from /proc per process over every request the server answered meanwhile (its "
        "`scoremap_requests_total`, the level's warm-up included); the means of two levels of each, alternated "
        f"(one, split, split, one). At one client: {ONE_CLIENT_INSTANCES} servers of each layout up at once, "
        f"answering blocks of calls in turn (about {ONE_CLIENT_BLOCK_SECONDS} s each, each server a place further "
        f"every round, the first call of a block not counted) for {ONE_CLIENT_SECONDS:.0f} s; a layout's p50 is the "
        "mean of its instances'; steal: the share of this machine's CPU time its host took meanwhile.",
        "",
        f"| photo | req/s at {CLIENTS} clients, one / split | server CPU ms per request, one / split | the fronts' CPU "
        "ms | the engine's CPU less its batches', ms | p50 ms at 1 client, one / split = ratio (added, 95% interval "
        "over this run's rounds; the instances' p50s, one / split; what the split adds in the server outside decoding, "
        "from the responses' timings; steal) |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    for name, engine_ok, front_ok, added_ok, ratio_ok, rate_ok in verdicts:
        lines.append(f"- {name}: the engine's own work <= {ENGINE_TARGET_MS} ms {said(engine_ok)}; the fronts' CPU <= "
                     f"the single process's {said(front_ok)}; at one client <= {LATENCY_TARGET_MS} ms added "
                     f"{said(added_ok)}, <= {LATENCY_RATIO_TARGET}x the single process's p50 {said(ratio_ok)}; "
                     f">= {RATE_TARGET}x the single process's req/s {said(rate_ok)}.")
    lines += [
        f"- Batching on / off with `--fronts {FRONTS}` (cat.jpg, {BATCHING_INSTANCES} servers of each up at once, "
        f"closed loops of {BATCHING_SECONDS:g} s on each in turn, each a place further every round; the median of "
        f"{BATCHING_ROUNDS} rounds' ratios of the modes' mean req/s): "
        + ", ".join(f"{each.ratio:.3f}x at {clients} client{'s' * (clients > 1)} (instances' req/s on "
                    f"{spread(each.on, 1)}, off {spread(each.off, 1)})" for clients, each in batching.items())
        + f"; target >= {BATCHING_TARGET}x: {said(min(each.ratio for each in batching.values()) >= BATCHING_TARGET)}.",
        f"- `--workers 2` (two whole servers) at {CLIENTS} clients, cat.jpg: {workers['rate']:.1f} req/s, "
        f"{workers['rate'] / alone['rate']:.2f}x one process's {alone['rate']:.1f} in the same run, "
        f"{workers['cpu']:.2f} against {alone['cpu']:.2f} ms of server CPU per request.",
        f"- Idle with {FRONTS} fronts after one request of each photo: {idle:.0f} MiB PSS in all ("
        + ", ".join(f"{role} {mib:.0f}" for role, mib in sorted(each.items()))
        + f", the supervisor the rest); target <= {idle_target} MiB: {said(idle <= idle_target)}.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(run())
