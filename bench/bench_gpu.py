"""`make bench-gpu`: the GPU engine against its targets (`TARGETS`), on the machine it runs on.

Runs only where onnxruntime's CUDAExecutionProvider really loads (a session is made and its
providers read back); elsewhere it says why and exits 0 without touching bench/RESULTS.md.
`--dry-run` runs every measurement on the CPU with null models and short levels, so the
benchmark is known to work on a machine without a GPU; it prints the section and updates no results file.

Each table is printed the moment it is measured, and appended to OUT_DIR/bench_gpu.md (`--out-dir`,
else $OUT when set), so a run stopped by a time limit or killed keeps every table it finished.
`--time-limit S` starts no table after S seconds and says which it left out. `--quick` measures fewer
levels (1, 16 and 64 clients), shorter windows and three memory cases, under a 200-s limit, so it fits one
10-minute call on a lent GPU machine together with the test suite; it updates bench/RESULTS.md only when
`--out` names a file. The full run updates `--out` (bench/RESULTS.md) with what it measured.

Measured (default model, samples/cat.jpg, scale 384):
- device-bound images/s per plan: the server's Plan (server/engine/plans.py: uint8 canvases copied in,
  probabilities copied back, IO binding) in a tight loop, against a bare onnxruntime loop on the
  same graph whose inputs and outputs stay on the device; target >= 80%.
- requests/s, p50, p99 and the longest request at 1/4/16/64 clients, 4-pass grid and à trous,
  batching on (the GPU default) and off (max batch 1), through gRPC (create_server, and scoremap-loadtest's
  LoadTester: sending processes of their own, their latencies merged) and in-process (Pipeline.score from as
  many threads).
- the same gRPC levels on `scoremap-serve --fronts N` (an engine process and N fronts, batching on), the engine's
  thread waiting for the GPU by spinning and by blocking (`--cuda-sync`), with the engine's and the whole server's CPU
  per request from /proc: which wait to keep, and N's default on a GPU.
Targets (`verdicts`): gRPC req/s at 16 clients >= 80% of the batch-8 plan's device-bound img/s, grid
and à trous; 64 clients no slower than 16; p50 at 1 client <= the batch-1 plan's run + 3 ms; no request over
100 ms at 16 clients; batching on never slower than off; the first four again for each `--fronts` layout. A target
whose level or plan the run left out is said to be not measured.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import onnx
import onnxruntime
from onnx import TensorProto, helper
from PIL import Image

from bench.__main__ import record
from bench.bench_overload import process_cpu_seconds, start_server
from bench.bench_split import LATENCY_TARGET_MS, own_cpu_seconds, roles
from bench.bench_memory import GPU_CASES, gpu_section
from bench.models import converted, null_model
from clients.loadtest.latency import LevelReport, Sample, summarise
from clients.api.settings import ClientSettings
from clients.loadtest.run import LevelPlan, LoadTester, Target, calibrate
from convert.card import ImageInput, read_card
from convert.preprocessing import to_input
from protos import scoring_pb2
from server.geometry import buckets, dense
from server.geometry.dense import resized_size
from server.engine.device_graph import LATTICE, PIXELS, PROBABILITIES, VALID, build_plan_graph, lattice_cells
from server.engine.providers import Engine, cuda_device_present
from server.errors import ScoringError
from server.main import create_server
from server.scoring.pipeline import Pipeline
from server.engine.plans import Plan, PlanKey
from server.settings import Settings

ROOT = pathlib.Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "samples" / "cat.jpg"
CUDA = "CUDAExecutionProvider"
SCALE = 384
RESIZED = resized_size(*reversed(Image.open(SAMPLE).size), scale=SCALE, multiple=32)  # (384, 576)
TIMEOUT_S = 30.0
SERVED_BATCH = 8  # the targets judge 16 clients against this batch's device-bound plan: every config measures it


@dataclasses.dataclass(frozen=True)
class Split:
    """A `--fronts` layout measured beside one process: its fronts, and how the engine's thread waits for the GPU
    (`--cuda-sync`)."""

    fronts: int
    sync: str

    @property
    def label(self) -> str:
        return f"--fronts {self.fronts}, --cuda-sync {self.sync}"


def starting_fronts() -> int:
    """Where the fronts' default on a GPU is sought from: the cores less one for the engine and one for the rest
    (the supervisor, the load tester here), at most 8."""
    return max(1, min(8, (os.cpu_count() or 2) - 2))


GPU_SPLITS = (Split(starting_fronts(), "spin"), Split(starting_fronts(), "block"))


@dataclasses.dataclass(frozen=True)
class Config:
    """How long and how hard to measure; `--dry-run` shrinks it to seconds on the CPU."""

    clients: tuple[int, ...] = (1, 4, 16, 64)
    level_seconds: float = 3.0
    batches: tuple[int, ...] = (1, SERVED_BATCH, 32)
    device_seconds: float = 2.0
    max_requests: int = 100_000
    shape_rounds: int = 6
    warm_up: bool = True  # False only to check the benchmark itself quickly: plans are then made on first use
    # bench_memory's (side, batch) cases per model for the memory table; None: every one (GPU_CASES).
    memory_cases: dict[str, tuple[tuple[int, int], ...]] | None = None
    note: str = ""  # said under the section's title
    # scoremap-loadtest's sending processes for the gRPC levels; None: as many as its calibration finds it needs.
    load_processes: int | None = None
    splits: tuple[Split, ...] = GPU_SPLITS  # the `--fronts` layouts measured, batching on


DRY_RUN = Config(clients=(1, 16), level_seconds=0.3, batches=(1, SERVED_BATCH), device_seconds=0.2, max_requests=200,
                 shape_rounds=3, load_processes=2, splits=(Split(2, "auto"),))
# `--quick`: three levels, 1-s windows, two batch sizes, three memory cases (about 3 minutes on an H200, estimated
# from the 2026-11-27 run's parts; the time limit holds it under 4 whatever the machine does).
QUICK = Config(clients=(1, 16, 64), level_seconds=1.0, batches=(1, SERVED_BATCH), device_seconds=0.5, shape_rounds=3,
               memory_cases={"default": ((384, 1), (384, 8)), "vgg16": ((224, 1),)},
               note="A --quick run: clients 1, 16 and 64, 1-s levels, batches 1 and 8, three memory cases.")
QUICK_TIME_LIMIT_S = 300.0
REPORT_FILE = "bench_gpu.md"
# The served engine's targets, and the plan's against a bare loop (docs/design.md: one session per shape).
TARGETS = {"device_ratio": 0.8, "served_share": 0.8, "p50_1_over_run_ms": 3.0, "max_16_ms": 100.0}


@dataclasses.dataclass(frozen=True)
class DeviceRate:
    """One plan's device-bound images/s: through the server's Plan, and a bare onnxruntime loop on its graph."""

    scheme: str
    batch: int
    label: str
    plan: float
    bare: float

    @property
    def run_ms(self) -> float:
        """One run of the plan through the server's Plan."""
        return 1000 * self.batch / self.plan


@dataclasses.dataclass(frozen=True)
class Scheme:
    """One way to a stride-16 map: the model file and what a request asks of it."""

    name: str
    model: str
    shift: int


class Report:
    """The section's parts in order, each printed and appended to OUT_DIR/bench_gpu.md (flushed to the disk)
    the moment it is measured: a run stopped by a time limit, or killed, keeps every table it finished."""

    def __init__(self, out_dir: str | os.PathLike | None = None, *, echo: bool = True) -> None:
        self.parts: list[str] = []
        self.echo = echo
        self.path = pathlib.Path(out_dir) / REPORT_FILE if out_dir else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def add(self, part: str) -> None:
        self.parts.append(part)
        if self.echo:
            print(part + "\n", flush=True)
        if self.path is not None:
            with self.path.open("a") as file:
                file.write(part + "\n\n")
                file.flush()
                os.fsync(file.fileno())

    def text(self) -> str:
        return "\n\n".join(self.parts)


class Clock:
    """`--time-limit`: whether another table may start."""

    def __init__(self, limit_s: float | None) -> None:
        self.limit_s = limit_s
        self.started = time.monotonic()

    def out(self) -> bool:
        return self.limit_s is not None and time.monotonic() - self.started >= self.limit_s


def cuda_unavailable() -> str | None:
    """Why this machine cannot run the GPU benchmark, or None when a CUDA session really runs."""
    available = onnxruntime.get_available_providers()
    if CUDA not in available:
        return (f"onnxruntime {onnxruntime.__version__} has no {CUDA} (available: {', '.join(available)}); "
                "install onnxruntime-gpu on a machine with an NVIDIA GPU")
    if not cuda_device_present():  # asking for CUDA without one logs a loud error before falling back
        return f"no CUDA device or CUDA runtime library on this machine ({CUDA} is compiled in)"
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "probe",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 4
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=[CUDA])
    if session.get_providers()[0] != CUDA:
        return (f"{CUDA} is compiled in but a session runs on {session.get_providers()[0]}: no CUDA device, or a "
                "CUDA/cuDNN library failed to load (`python -c 'import onnxruntime; onnxruntime.print_debug_info()'`)")
    return None


def machine() -> str:
    """The GPU, its driver and onnxruntime, in one line."""
    try:
        query = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30, check=True)
        gpu = "; ".join(line.strip() for line in query.stdout.splitlines() if line.strip())
    except (OSError, subprocess.SubprocessError) as error:
        gpu = f"no nvidia-smi ({error.__class__.__name__})"
    return f"GPU: {gpu} (name, driver); onnxruntime {onnxruntime.__version__} from {onnxruntime.__file__}"


# --- device-bound images/s per plan ------------------------------------------------------------
def loop_rate(step: Callable[[], None], *, seconds: float) -> float:
    """Calls per second of `step` in a tight loop for about `seconds`, after one untimed call."""
    step()
    calls, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds or calls < 3:
        step()
        calls += 1
    return calls / elapsed


def bare_step(graph: onnx.ModelProto, feeds: dict[str, np.ndarray], *, on_gpu: bool) -> Callable[[], None]:
    """A plain onnxruntime session of `graph`: on the GPU inputs and outputs stay on the device."""
    providers = [CUDA] if on_gpu else ["CPUExecutionProvider"]
    session = onnxruntime.InferenceSession(graph.SerializeToString(), providers=providers)
    if not on_gpu:
        return lambda: session.run([PROBABILITIES], feeds)
    binding = session.io_binding()
    for name, value in feeds.items():
        binding.bind_ortvalue_input(name, onnxruntime.OrtValue.ortvalue_from_numpy(value, "cuda", 0))
    for name in (LATTICE, PROBABILITIES):
        binding.bind_output(name, "cuda")
    return lambda: session.run_with_iobinding(binding)


def device_bound(scheme: Scheme, *, batch: int, engine: Engine, seconds: float) -> DeviceRate:
    """Images/s through the server's Plan and of the bare loop, for one plan shape."""
    net = onnx.load(scheme.model)
    card = read_card(net)
    passes = dense.passes_for(native_stride=card.output_stride, output_stride=16, shift=scheme.shift)
    height, width = buckets.on_demand_canvas(*RESIZED, slack=passes.slack, multiple=card.size_multiple)
    graph = build_plan_graph(net, card, batch=batch, height=height, width=width, offsets=passes.offsets,
                             factor=passes.factor, stride=passes.stride)
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (batch, height, width, 3), dtype=np.uint8)
    valid = np.ones((batch, *lattice_cells(graph)), dtype=np.float32)
    plan = Plan(PlanKey(height, width, batch, passes), engine.session(graph.SerializeToString()), on_gpu=engine.on_gpu)
    served = loop_rate(lambda: plan.run(pixels, valid, lattice=None), seconds=seconds)
    bare = loop_rate(bare_step(graph, {PIXELS: pixels, VALID: valid}, on_gpu=engine.on_gpu), seconds=seconds)
    label = f"{scheme.name}: batch {batch} x {height}x{width} x {len(passes.offsets)} passes"
    return DeviceRate(scheme.name, batch, label, plan=batch * served, bare=batch * bare)


# --- what a change of input shape costs a session ----------------------------------------------
def shape_change_cost(model: str, *, engine: Engine, rounds: int) -> tuple[float, float]:
    """(median ms of a run at the shape the session ran last, median ms of a run at the other shape):
    the plain converted net (symbolic N, H, W) alternating batch 1 and 2 at one canvas (the fact
    fixed-shape plans rest on: 0.35-0.8 s per change on a CUDA session, none on the CPU)."""
    card = read_card(model)
    image = ImageInput.of(card)
    session = engine.session(onnx.load(model).SerializeToString())
    inputs = [to_input(np.zeros((batch, *RESIZED, 3), dtype=np.uint8), image) for batch in (1, 2)]
    same, changed = [], []
    for _ in range(rounds):
        for batch_input in inputs:
            for times in (changed, same):  # the first run follows the other shape, the second repeats it
                started = time.perf_counter()
                session.run([card.scores_name], {image.name: batch_input})
                times.append(1000 * (time.perf_counter() - started))
    return float(np.median(same[2:])), float(np.median(changed[2:]))  # the first round sets the session up


# --- requests/s under concurrency -----------------------------------------------------------
def in_process_loop(pipeline: Pipeline, request: scoring_pb2.ScoreRequest, *, concurrency: int,
                    seconds: float, max_requests: int) -> LevelReport:
    """clients.loadtest.run's closed loop, with Pipeline.score in place of the gRPC stub."""
    samples: list[Sample] = []
    lock = threading.Lock()
    sent = 0
    started = time.perf_counter()

    def caller() -> None:
        nonlocal sent
        while True:
            with lock:
                if sent >= max_requests or time.perf_counter() - started >= seconds:
                    return
                sent += 1
            began = time.perf_counter()
            try:
                pipeline.score(request, deadline=time.monotonic() + TIMEOUT_S)
                status = "OK"
            except ScoringError as error:
                status = error.refusal.name
            done = time.perf_counter()
            with lock:
                samples.append(Sample(done, done - began, status))

    threads = [threading.Thread(target=caller) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return summarise("in-process", concurrency, samples, sent=sent, start_s=started, end_s=time.perf_counter())


def score_request(scheme: Scheme) -> scoring_pb2.ScoreRequest:
    """cat.jpg at scale 384, stride 16 by the scheme's passes, image-level top-5 only."""
    return scoring_pb2.ScoreRequest(encoded=SAMPLE.read_bytes(), scales=[SCALE], output_stride=16, shift=scheme.shift)


def served(scheme: Scheme, settings: Settings, config: Config) -> list[LevelReport]:
    """Every concurrency level through gRPC, then in-process, on one warmed-up server. The gRPC levels come from
    scoremap-loadtest's sending processes (as many as its calibration at the most clients finds it needs, so that
    neither they nor this process's interpreter lock are the ceiling), their samples merged."""
    request = score_request(scheme)
    server, port = create_server([scheme.model], settings=settings)
    try:
        with load_tester(f"127.0.0.1:{port}", request, config) as (tester, level):
            reports = [tester.closed(clients, level) for clients in config.clients]
        reports += [in_process_loop(server.pipeline, request, concurrency=clients, seconds=config.level_seconds,
                                    max_requests=config.max_requests) for clients in config.clients]
    finally:
        server.stop(0).wait(30)
    return reports


@contextlib.contextmanager
def load_tester(address: str, request: scoring_pb2.ScoreRequest,
                config: Config) -> Iterator[tuple[LoadTester, LevelPlan]]:
    """scoremap-loadtest's sending processes on `address`, calibrated at the most clients unless the config names
    them, and the plan of each level. Their CPU alone is the load tester's (this process serves, or waits)."""
    target = Target(address, settings=ClientSettings(timeout_s=TIMEOUT_S, max_message_bytes=64 << 20))
    level = LevelPlan(duration_s=config.level_seconds, max_requests=config.max_requests, timeout_s=TIMEOUT_S)
    with LoadTester(target, [request], processes=config.load_processes or 1, count_this_process=False) as tester:
        if config.load_processes is None:
            calibrate(tester, "closed", max(config.clients), level, limits=tester.limits)
        yield tester, level


@dataclasses.dataclass(frozen=True)
class SplitLevel:
    """One gRPC level on a `--fronts` server, and its CPU per request sent from /proc."""

    report: LevelReport
    engine_cpu_ms: float
    server_cpu_ms: float


def served_split(scheme: Scheme, split: Split, config: Config, *, folder: str, provider: str) -> list[SplitLevel]:
    """Every concurrency level through gRPC on `scoremap-serve --fronts N` started for it, warmed up, batching on."""
    flags = ["--fronts", str(split.fronts), "--cuda-sync", split.sync, "--warm-up-scales", str(SCALE),
             *(["--require-gpu"] if provider == "cuda" else [])]
    log = pathlib.Path(folder) / f"split-{scheme.shift}-{split.fronts}-{split.sync}.log"
    server, address, _metrics = start_server(scheme.model, log, flags, provider=provider)
    try:
        engine = roles(server.pid)["engine"]
        levels = []
        with load_tester(address, score_request(scheme), config) as (tester, level):
            for clients in config.clients:
                engine_before, server_before = own_cpu_seconds(engine), process_cpu_seconds(server.pid)
                report = tester.closed(clients, level)
                sent = max(1, report.sent)
                levels.append(SplitLevel(report, 1000 * (own_cpu_seconds(engine) - engine_before) / sent,
                                         1000 * (process_cpu_seconds(server.pid) - server_before) / sent))
    finally:
        server.terminate()
        server.wait(60)
    return levels


def sync_comparison(splits: dict[tuple[str, Split], list[SplitLevel]]) -> list[str]:
    """Blocking against spinning, per scheme and fronts where both ran: p50 at the fewest clients, req/s and the
    engine's CPU per request at the most."""
    lines = []
    for (scheme, split), levels in splits.items():
        if split.sync != "spin" or (scheme, Split(split.fronts, "block")) not in splits:
            continue
        spin, block = levels, splits[(scheme, Split(split.fronts, "block"))]
        few, most = (min(range(len(spin)), key=lambda i: spin[i].report.level),
                     max(range(len(spin)), key=lambda i: spin[i].report.level))
        lines.append(
            f"- {scheme}, --fronts {split.fronts}, block against spin: p50 at {spin[few].report.level:g} client(s) "
            f"{block[few].report.p50_ms:.2f} against {spin[few].report.p50_ms:.2f} ms; at {spin[most].report.level:g} "
            f"clients {block[most].report.throughput_rps:.0f} against {spin[most].report.throughput_rps:.0f} req/s, "
            f"the engine's CPU {block[most].engine_cpu_ms:.2f} against {spin[most].engine_cpu_ms:.2f} ms per request")
    return lines


# --- the section ----------------------------------------------------------------------------
PATHS = {"closed": "gRPC", "in-process": "in-process"}  # a LevelReport's mode -> the path it measured


def report_rows(scheme: str, batching: str, reports: Sequence[LevelReport]) -> list[str]:
    rows = []
    for r in reports:
        busy = "-" if r.client_busy != r.client_busy else f"{r.client_busy:.0%}" + "*" * r.client_bound
        rows.append(f"| {scheme} | {batching} | {PATHS[r.mode]} | {r.level:g} | {r.throughput_rps:.1f} | {r.p50_ms:.1f} | "
                    f"{r.p99_ms:.1f} | {r.max_ms:.1f} | {errors_cell(r)} | {busy} |")
    return rows


def errors_cell(report: LevelReport) -> str:
    return ", ".join(f"{code} {count}" for code, count in report.errors.items()) or "-"


def grpc_level(reports: Sequence[LevelReport], clients: int) -> LevelReport | None:
    """The closed-loop gRPC level of `clients` among `reports`, if it ran."""
    return next((r for r in reports if r.mode == "closed" and r.level == clients), None)


def verdicts(device: list[DeviceRate], results: dict[tuple[str, str], list[LevelReport]],
             splits: dict[tuple[str, Split], list[SplitLevel]] | None = None) -> list[str]:
    """One line per target (`TARGETS`, the plan against the bare loop included), for one process and for each
    `--fronts` layout: the measured values and met or missed, or not measured (a level, a batching mode or a plan
    the run left out, as a time limit may)."""
    def plan_rate(scheme: str, batch: int) -> DeviceRate | None:
        return next((rate for rate in device if rate.scheme == scheme and rate.batch == batch), None)

    lines = []
    if device:
        worst = min(rate.plan / rate.bare for rate in device)
        lines.append(judged(f"device-bound plan >= {TARGETS['device_ratio']:.0%} of the bare loop", f"worst {worst:.0%}",
                            worst >= TARGETS["device_ratio"]))
    for scheme in sorted({rate.scheme for rate in device} | {s for s, _ in results}):
        on, off = results.get((scheme, "on"), []), results.get((scheme, "off"), [])
        lines += served_verdicts(scheme, on, plan_rate(scheme, SERVED_BATCH), plan_rate(scheme, 1),
                                 longest=[grpc_level(on, 16), grpc_level(off, 16)], at16="batching on and off")
        target = f"{scheme}: batching on never slower than off"
        pairs = [(a, b) for c in sorted({r.level for r in on}) if (a := grpc_level(on, c)) and (b := grpc_level(off, c))]
        slower = [int(a.level) for a, b in pairs if a.throughput_rps < b.throughput_rps]
        lines.append(judged(target, f"{len(pairs)} levels; slower at clients: {slower or 'none'}", not slower)
                     if pairs else unmeasured(target))
    for (scheme, split), levels in (splits or {}).items():
        reports = [level.report for level in levels]
        lines += served_verdicts(f"{scheme}, {split.label}", reports, plan_rate(scheme, SERVED_BATCH),
                                 plan_rate(scheme, 1), longest=[grpc_level(reports, 16)], at16="batching on")
        # bench_split's target, on a host with cores to spare; the two levels ran one after the other here
        target = f"{scheme}, {split.label}: p50 at 1 client <= one process's + {LATENCY_TARGET_MS:g} ms"
        alone, split_alone = grpc_level(results.get((scheme, "on"), []), 1), grpc_level(reports, 1)
        lines.append(judged(target, f"{split_alone.p50_ms:.2f} against {alone.p50_ms:.2f} ms",
                            split_alone.p50_ms <= alone.p50_ms + LATENCY_TARGET_MS)
                     if alone and split_alone else unmeasured(target))
    return lines


def served_verdicts(name: str, reports: Sequence[LevelReport], batched: DeviceRate | None, single: DeviceRate | None,
                    *, longest: list[LevelReport | None], at16: str) -> list[str]:
    """The served targets of one layout's batching-on gRPC levels against its scheme's plans: req/s at 16 clients
    against the batch-8 plan, 64 clients against 16, p50 at one client against the batch-1 run, and the longest
    request at 16 clients among `longest`."""
    on16, on64, one = (grpc_level(reports, clients) for clients in (16, 64, 1))
    share, margin = TARGETS["served_share"], TARGETS["p50_1_over_run_ms"]
    lines = []
    target = f"{name}: gRPC at 16 clients >= {share:.0%} of the batch-{SERVED_BATCH} plan's device-bound img/s"
    lines.append(judged(target, f"{on16.throughput_rps:.0f} req/s against {batched.plan:.0f} img/s",
                        on16.throughput_rps >= share * batched.plan) if on16 and batched else unmeasured(target))
    target = f"{name}: 64 clients no slower than 16"
    lines.append(judged(target, f"{on64.throughput_rps:.0f} against {on16.throughput_rps:.0f} req/s",
                        on64.throughput_rps >= on16.throughput_rps) if on64 and on16 else unmeasured(target))
    target = f"{name}: p50 at 1 client <= the batch-1 plan's run + {margin:g} ms"
    lines.append(judged(target, f"{one.p50_ms:.1f} against {single.run_ms + margin:.1f} ms",
                        one.p50_ms <= single.run_ms + margin) if one and single else unmeasured(target))
    target = f"{name}: no request over {TARGETS['max_16_ms']:.0f} ms at 16 clients, {at16}"
    worst = max(r.max_ms for r in longest) if all(longest) else None
    lines.append(judged(target, f"longest {worst:.1f} ms", worst <= TARGETS["max_16_ms"])
                 if worst is not None else unmeasured(target))
    return lines


def judged(target: str, figures: str, ok: bool) -> str:
    return f"- {target} ({figures}): {'met' if ok else 'missed'}"


def unmeasured(target: str) -> str:
    return f"- {target}: not measured"


def measure(folder: str, config: Config, *, dry_run: bool, report: Report, clock: Clock) -> None:
    """Every table in turn, each handed to `report` as soon as it is measured; none started past `clock`."""
    title = "## GPU engine (bench_gpu)" + (" — DRY RUN on the CPU with null models, not a measurement" if dry_run else "")
    report.add("\n".join([
        title,
        "",
        machine(),
        "",
        f"{'Null models' if dry_run else 'EfficientNet-Lite0 (stride 32 for the grid, --output-stride 16 for à trous)'}, "
        f"samples/cat.jpg at scale {SCALE} ({RESIZED[0]}x{RESIZED[1]}), stride 16, top-5 only. {config.note}".strip(),
    ]))
    if dry_run:
        schemes = [Scheme("grid", null_model(folder), scoring_pb2.SHIFT_GRID),
                   Scheme("à trous", null_model(folder, output_stride=16), scoring_pb2.SHIFT_ATROUS)]
    else:
        schemes = [Scheme("grid", converted(folder, output_stride=32), scoring_pb2.SHIFT_GRID),
                   Scheme("à trous", converted(folder, output_stride=16), scoring_pb2.SHIFT_ATROUS)]
    # Every caller comes from 127.0.0.1 here: the per-peer limit would refuse what stands for many clients.
    most = max(config.clients)
    base = Settings(warm_up=config.warm_up, warm_up_scales=(SCALE,), provider="cpu" if dry_run else "cuda",
                    require_gpu=not dry_run, max_calls_per_peer=0, grpc_workers=most + Settings.reserved_workers,
                    max_concurrent_rpcs=2 * (most + Settings.reserved_workers))
    engine = Engine(base)
    modes = {"on": base, "off": dataclasses.replace(base, max_batch=1)}
    device: list[DeviceRate] = []
    results: dict[tuple[str, str], list[LevelReport]] = {}

    def shape_change() -> str:
        same_ms, changed_ms = shape_change_cost(schemes[0].model, engine=engine, rounds=config.shape_rounds)
        return (f"A change of input shape: the plain {schemes[0].name} net (symbolic dims) on one session, batch 1 "
                f"and 2 alternated at {RESIZED[0]}x{RESIZED[1]}: {same_ms:.1f} ms per run at the shape it ran last, "
                f"{changed_ms:.1f} ms after a change (median of {config.shape_rounds - 1} rounds) — what plans "
                "pinned to one shape avoid.")

    def device_table() -> str:
        device.extend(device_bound(s, batch=b, engine=engine, seconds=config.device_seconds)
                      for s in schemes for b in config.batches)
        return "\n".join([
            "Device-bound images/s per plan (the server's Plan with uint8 in and probabilities back, vs a bare "
            "onnxruntime loop on the same graph with inputs and outputs on the device):",
            "",
            "| plan | Plan img/s | bare img/s | Plan / bare |",
            "|---|---|---|---|",
            *[f"| {rate.label} | {rate.plan:.0f} | {rate.bare:.0f} | {rate.plan / rate.bare:.0%} |" for rate in device],
        ])

    def closed_loop_table(scheme: Scheme, mode: str) -> Callable[[], str]:
        def table() -> str:
            results[(scheme.name, mode)] = served(scheme, modes[mode], config)
            return "\n".join([
                f"Closed loop, {scheme.name}, batching {mode}: {config.level_seconds:g} s per level, after the server "
                "reported SERVING (its warm-up done); gRPC on localhost (scoremap-loadtest's sending processes, their "
                "latencies merged, its own warm-up requests first) and in-process (Pipeline.score from as many "
                "threads); max = the longest request; load tester busy = the time its processes ran or waited to "
                "run over one core each (* over 80%: the level may be the load tester's limit):",
                "",
                "| scheme | batching | path | clients | req/s | p50 ms | p99 ms | max ms | errors | load tester busy |",
                "|---|---|---|---|---|---|---|---|---|---|",
                *report_rows(scheme.name, mode, results[(scheme.name, mode)]),
            ])
        return table

    splits: dict[tuple[str, Split], list[SplitLevel]] = {}

    def split_table(scheme: Scheme, split: Split) -> Callable[[], str]:
        def table() -> str:
            levels = splits[(scheme.name, split)] = served_split(scheme, split, config, folder=folder,
                                                                  provider="cpu" if dry_run else "cuda")
            rows = [f"| {scheme.name} | {split.label} | {level.report.level:g} | {level.report.throughput_rps:.1f} | "
                    f"{level.report.p50_ms:.1f} | {level.report.p99_ms:.1f} | {level.report.max_ms:.1f} | "
                    f"{errors_cell(level.report)} | "
                    f"{level.engine_cpu_ms:.2f} | {level.server_cpu_ms:.2f} |" for level in levels]
            return "\n".join([
                f"Closed loop on `scoremap-serve {split.label}`, {scheme.name}, batching on: the same levels over gRPC, "
                "from a server process started for it (warmed up); CPU per request sent, from /proc: the engine "
                "process's, and the whole server's (engine, fronts, supervisor):",
                "",
                "| scheme | layout | clients | req/s | p50 ms | p99 ms | max ms | errors | engine CPU ms | server CPU ms |",
                "|---|---|---|---|---|---|---|---|---|---|",
                *rows,
            ])
        return table

    def memory() -> str:
        if dry_run:
            return "(The memory table, bench_memory.gpu_section, runs with a GPU only.)"
        return gpu_section(cases=config.memory_cases or GPU_CASES, default_model=schemes[0].model)

    steps: list[tuple[str, Callable[[], str]]] = [("the cost of a change of shape", shape_change),
                                                  ("device-bound images/s", device_table)]
    steps += [(f"closed loop {s.name} batching {mode}", closed_loop_table(s, mode)) for mode in modes for s in schemes]
    steps += [(f"{split.label} {s.name}", split_table(s, split)) for split in config.splits for s in schemes]
    steps.append(("memory on the CUDA provider", memory))
    for index, (_name, step) in enumerate(steps):
        if clock.out():
            left = ", ".join(name for name, _ in steps[index:])
            report.add(f"Not measured, the time limit of {clock.limit_s:g} s having passed: {left}.")
            break
        report.add(step())
    report.add("\n".join(["Targets, on what was measured:", "", *verdicts(device, results, splits),
                           *(["", "How the engine's thread waits for the GPU:", "", *compared]
                             if (compared := sync_comparison(splits)) else [])]))


def run(*, dry_run: bool = False, config: Config | None = None, out_dir: str | os.PathLike | None = None,
        time_limit_s: float | None = None, echo: bool = False) -> str:
    """The section (GPU, or dry run on the CPU), each table printed (`echo`) and written to OUT_DIR/bench_gpu.md as
    it is measured; raises RuntimeError when no GPU run is possible."""
    if not dry_run and (reason := cuda_unavailable()):
        raise RuntimeError(reason)
    report = Report(out_dir, echo=echo)
    with tempfile.TemporaryDirectory() as folder:
        measure(folder, config or (DRY_RUN if dry_run else Config()), dry_run=dry_run, report=report,
                clock=Clock(time_limit_s))
    return report.text()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true",
                        help="run every step on the CPU with null models and short levels; update no results file")
    parser.add_argument("--quick", action="store_true",
                        help=f"fewer levels and shorter windows, at most {QUICK_TIME_LIMIT_S:g} s unless --time-limit "
                             "says otherwise: fits one 10-minute call on a lent GPU machine with the test suite")
    parser.add_argument("--level-seconds", type=float, default=None, help="seconds per load level")
    parser.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                        help="start no table after this many seconds; what was measured is kept and recorded")
    parser.add_argument("--out-dir", default=os.environ.get("OUT") or None,
                        help=f"folder to write each table to ({REPORT_FILE}) as soon as it is measured "
                             "(default: $OUT when set)")
    parser.add_argument("--out", default=None,
                        help="results file to update (default: bench/RESULTS.md for a full run; --quick and "
                             "--dry-run update none unless given)")
    args = parser.parse_args(argv)
    if not args.dry_run and (reason := cuda_unavailable()):
        print(f"bench-gpu: not run: {reason}")
        return 0
    config = DRY_RUN if args.dry_run else QUICK if args.quick else Config()
    if args.level_seconds is not None:
        config = dataclasses.replace(config, level_seconds=args.level_seconds)
    limit = args.time_limit if args.time_limit is not None else QUICK_TIME_LIMIT_S if args.quick else None
    section = run(dry_run=args.dry_run, config=config, out_dir=args.out_dir, time_limit_s=limit, echo=True)
    out = args.out or (None if args.quick or args.dry_run else str(ROOT / "bench" / "RESULTS.md"))
    if out is not None and not args.dry_run:
        record({"bench_gpu": section}, pathlib.Path(out))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
