"""CPU plans: their speed against onnxruntime's defaults, and their memory in the server's own process.

* Speed: the default model's plan graph (server/engine/device_graph.py) at several plan shapes, run by a
  session made as the server makes it (server/engine/providers.py: `predictable_session_options` with the
  process's shared arena, the graph optimized once and loaded on the model's shared weights, its first run,
  no spinning) and by a session with onnxruntime's default options (no spinning either), the two alternated
  run by run in one process; medians and their ratio. Target: <= 1.05.
* Memory: a real `scoremap-serve` process per model (the default model, a VGG-width net, the same
  net taking NHWC input), batch 1 and 4 at three sizes each, made in the order of their running batch's
  size (each then grows the shared arena; a smaller one's run fits in what the arena holds and adds only its
  own state, which the totals count). Around the first request(s) at a new shape (the plan is made) and
  around the same requests again (steady state), the server's VmRSS and VmHWM (/proc/PID/status, the
  high-water mark reset by writing 5 to /proc/PID/clear_refs): the RSS growth against what admission's
  account of the plans grew by (`scoremap_plans_held_bytes`: model weights once, each plan's own, the
  largest running batch); the whole account against VmRSS and against the steady VmHWM, both over the
  server's VmRSS before its first plan. Target: within +-25%.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np
import onnx
import onnxruntime

MiB = 2**20
SPEED_SHAPES = ((1, 384, 384, 1), (1, 448, 576, 1), (4, 384, 384, 1), (1, 384, 384, 4))  # batch, h, w, passes
SPEED_ROUNDS = 15
SPEED_TARGET = 1.05
MEMORY_SIZES = (224, 384, 512)
MEMORY_BATCHES = (1, 4)
MEMORY_BOUND = 0.25
# The arena keeps every block while no request is in flight (the server gives back one over 256 MiB by default), so
# that what the plans hold can be read between requests.
IDLE_ARENA = "64GiB"
# A first plan, not reported: the server's first request warms its own paths. At the model's smallest input
# (its training size), so that it leaves the least in the shared arena.
BATCH_WAIT_MS = 1000.0  # how long the first of a batch's requests waits for the others
SERVER_START_SECONDS = 300


# --- speed ------------------------------------------------------------------------------------

def _plan_graph(net: onnx.ModelProto, batch: int, height: int, width: int, passes: int) -> bytes:
    from convert.card import read_card
    from server.engine.device_graph import build_plan_graph

    card = read_card(net)
    half = card.output_stride // 2
    offsets = ((0, 0),) if passes == 1 else ((0, 0), (0, half), (half, 0), (half, half))
    return build_plan_graph(net, card, batch=batch, height=height, width=width, offsets=offsets,
                            factor=1 if passes == 1 else 2, stride=card.output_stride if passes == 1 else half,
                            on_gpu=False).SerializeToString()  # as the server's CPU plans


def speed_rows(model_path: str) -> list[tuple[str, float, float]]:
    """(plan shape, server's session ms, onnxruntime defaults ms), medians of runs alternated, each round in the other
    order (the first of a round runs after the last of the round before, which left the caches its own)."""
    from server.memory.runtime import configure_allocator
    from server.engine.device_graph import PIXELS, VALID
    from server.engine.providers import Engine
    from server.engine.shared_weights import SharedWeights
    from server.settings import Settings

    configure_allocator()  # as the server does at start; process-wide, so both sessions run under it
    engine = Engine(Settings(provider="cpu"))
    net = onnx.load(model_path)
    weights = SharedWeights()  # the model's, as a server's plan cache holds them
    rows = []
    for batch, height, width, passes in SPEED_SHAPES:
        graph = _plan_graph(net, batch, height, width, passes)
        server = engine.session(graph, weights=weights)
        defaults = onnxruntime.SessionOptions()
        defaults.add_session_config_entry("session.intra_op.allow_spinning", "0")
        reference = onnxruntime.InferenceSession(graph, defaults, providers=["CPUExecutionProvider"])
        valid_shape = next(value.shape for value in server.get_inputs() if value.name == VALID)
        feeds = {PIXELS: np.random.default_rng(0).integers(0, 256, (batch, height, width, 3), dtype=np.uint8),
                 VALID: np.ones(valid_shape, np.float32)}
        times: dict[str, list[float]] = {"server": [], "defaults": []}
        for session in (server, reference, server, reference):  # both past their first runs
            session.run(None, feeds)
        pair = (("server", server), ("defaults", reference))
        for round_ in range(SPEED_ROUNDS):
            for name, session in pair if round_ % 2 == 0 else pair[::-1]:
                start = time.perf_counter()
                session.run(None, feeds)
                times[name].append(time.perf_counter() - start)
        rows.append((f"{batch}x{height}x{width}, {passes} pass{'es' if passes > 1 else ''}",
                     1000 * statistics.median(times["server"]), 1000 * statistics.median(times["defaults"])))
        del server, reference
    return rows


# --- memory in the server's own process -------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PlanMemory:
    """One plan made by a real server: what admission accounted and what the process's memory did, bytes."""

    plan: str
    predicted: int          # what admission's account of the plans grew by (scoremap_plans_held_bytes)
    measured_by_server: int  # the footprint the server measured itself, the plan alone (scoremap_plan_bytes)
    creation_growth: int    # VmRSS after the first request(s) at the shape minus before
    creation_peak: int      # VmHWM during them minus VmRSS before
    steady_peak: int        # VmHWM during the same requests again minus VmRSS before the plan existed
    held_predicted: int = 0  # the account of every plan, after this one's requests
    held: int = 0           # VmRSS then, over the server's before its first plan
    steady_held: int = 0    # VmHWM during the steady-state requests, over the server's VmRSS before its first plan

    @property
    def ratio(self) -> float:
        """Predicted over the memory the plan added in the server (RSS growth at its making)."""
        return self.predicted / max(self.creation_growth, 1)

    @property
    def steady_ratio(self) -> float:
        """The account of every plan over the server's high-water mark while they run, beyond its plan-less self
        (the requests' own memory included: a few MiB, against the whole rather than one plan's growth)."""
        return self.held_predicted / max(self.steady_held, 1)

    @property
    def held_ratio(self) -> float:
        """The account of every plan over what the server's process holds beyond its plan-less self."""
        return self.held_predicted / max(self.held, 1)


def _status(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def _reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _jpeg(side: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(side)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def _gauges(metrics_url: str) -> tuple[dict[str, dict[str, float]], float]:
    """Each plan's `scoremap_plan_bytes` by kind, and `scoremap_plans_held_bytes`."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=30) as response:  # noqa: S310 (our own server)
        text = response.read().decode()
    plans: dict[str, dict[str, float]] = {}
    held = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "scoremap_plan_bytes":
                plans.setdefault(sample.labels["plan"], {})[sample.labels["kind"]] = sample.value
            elif sample.name == "scoremap_plans_held_bytes":
                held = sample.value
    return plans, held


def server_plan_memory(model_path: str, *, sizes=MEMORY_SIZES, batches=MEMORY_BATCHES,
                       settle_seconds: float = 1.0) -> tuple[list[PlanMemory], list[str]]:
    """Start `scoremap-serve` on the model (native stride, one pass, canvases exactly `sizes`) and measure
    every (batch, size) plan as described in the module's docstring; also the server's warnings."""
    import grpc

    from convert.card import read_card
    from protos import scoring_pb2, scoring_pb2_grpc

    card = read_card(onnx.load(model_path, load_external_data=False))
    primer = max(card.training_height, card.training_width)
    metrics_port = _free_port()
    buckets = ",".join(f"{side}x{side}" for side in (*sizes, primer))
    command = [sys.executable, "-m", "server.main", model_path, "--port", "0", "--provider", "cpu", "--no-warm-up",
               "--max-batch", str(max(batches)), "--max-queue-delay-ms", str(BATCH_WAIT_MS),
               "--max-queue-ms", "600000", "--shape-buckets", buckets, "--metrics-port", str(metrics_port),
               "--max-idle-arena-bytes", IDLE_ARENA]
    log = tempfile.TemporaryFile(mode="w+")
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True)
    results = []
    try:
        line = server.stdout.readline()
        if "listening on" not in line:
            log.seek(0)
            raise RuntimeError(f"scoremap-serve did not start: {line!r} {log.read()[-2000:]}")
        channel = grpc.insecure_channel(line.rsplit(" ", 1)[1].strip())
        stub = scoring_pb2_grpc.DenseScoringStub(channel)
        grpc.channel_ready_future(channel).result(timeout=SERVER_START_SECONDS)
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        pool = concurrent.futures.ThreadPoolExecutor(max(batches))

        def send(side: int, count: int) -> None:
            job = scoring_pb2.ScoreRequest(encoded=_jpeg(side), scales=[side], output_stride=32, top_k=5)
            calls = [pool.submit(stub.Score, job, timeout=SERVER_START_SECONDS, wait_for_ready=True)
                     for _ in range(count)]
            for call in calls:
                call.result()

        time.sleep(settle_seconds)
        plan_less = _status(server.pid, "VmRSS")
        send(primer, 1)
        for batch, side in sorted(((b, s) for b in batches for s in sizes), key=lambda plan: plan[0] * plan[1] ** 2):
            time.sleep(settle_seconds)
            known, held_before = _gauges(metrics_url)
            before = _status(server.pid, "VmRSS")
            _reset_peak(server.pid)
            send(side, batch)
            creation_peak = _status(server.pid, "VmHWM") - before
            time.sleep(settle_seconds)
            after = _status(server.pid, "VmRSS")
            _reset_peak(server.pid)
            send(side, batch)
            send(side, batch)
            steady_high = _status(server.pid, "VmHWM")
            steady_peak = steady_high - before
            gauges, held_after = _gauges(metrics_url)
            made = {key: value for key, value in gauges.items() if key not in known}
            for plan, values in made.items():  # one, unless the requests did not all meet in one batch
                results.append(PlanMemory(plan, int(held_after - held_before), int(values["measured"]),
                                          after - before if len(made) == 1 else 0, creation_peak, steady_peak,
                                          int(held_after), after - plan_less, steady_high - plan_less))
        pool.shutdown()
        channel.close()
    finally:
        server.terminate()
        server.wait(30)
    log.seek(0)
    warnings = [line.strip() for line in log if "WARNING" in line or "memory model is off" in line]
    return results, warnings


def worst_deviations(memory: list[tuple[str, PlanMemory]]) -> tuple[float, float, float]:
    """The largest |ratio - 1| of the plans' growth, of the whole account against what the server holds, and against
    its steady peak."""
    return (max(abs(plan.ratio - 1) for _, plan in memory), max(abs(plan.held_ratio - 1) for _, plan in memory),
            max(abs(plan.steady_ratio - 1) for _, plan in memory))


def memory_table(memory: list[tuple[str, PlanMemory]]) -> list[str]:
    """The Markdown table of (model, plan) measurements, MiB."""
    return [
        "| model | plan | predicted | server's own footprint | RSS growth | predicted/growth | creation peak | "
        "account / held | ratio | account / steady peak | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *[f"| {label} | {plan.plan} | {_mib(plan.predicted)} | {_mib(plan.measured_by_server)} | "
          f"{_mib(plan.creation_growth)} | {plan.ratio:.3f} | {_mib(plan.creation_peak)} | "
          f"{_mib(plan.held_predicted)} / {_mib(plan.held)} | {plan.held_ratio:.3f} | "
          f"{_mib(plan.held_predicted)} / {_mib(plan.steady_held)} | {plan.steady_ratio:.3f} |"
          for label, plan in memory],
    ]


# --- the section ------------------------------------------------------------------------------

def _mib(value: float) -> str:
    return f"{value / MiB:,.1f}"


def run() -> str:
    from bench.cpu_models import converted as converted_net
    from bench.models import converted
    from convert.memory_model import PROVIDER_TERMS, Device

    cpu = PROVIDER_TERMS[Device.CPU]
    with tempfile.TemporaryDirectory() as folder:
        default_path = converted(folder)
        speed = speed_rows(default_path)
        models = {"efficientnet-lite0 (default)": default_path, "VGG-width (quarter VGG16)": converted_net(folder, "vgg"),
                  "VGG-width, NHWC input": converted_net(folder, "nhwc")}
        memory, warnings = [], []
        for label, path in models.items():
            plans, said = server_plan_memory(path)
            memory += [(label, plan) for plan in plans]
            warnings += said
    ratios = [server / defaults for _, server, defaults in speed]
    speed_verdict = "met" if max(ratios) <= SPEED_TARGET else "NOT met"
    worst, worst_held, worst_steady = worst_deviations(memory)
    memory_verdict = "met" if max(worst, worst_steady, worst_held) <= MEMORY_BOUND else "NOT met"
    return "\n".join([
        "## CPU plans: speed against onnxruntime's defaults, memory in the server's own process",
        "",
        "The CPU configuration: onnxruntime's default session options (its memory pattern on), one CPU arena for "
        "the whole process (server.memory.arena: each run takes its plan's block and hands it back), each plan's "
        "graph optimized once and loaded on its model's one copy of the optimized weights "
        "(server.engine.shared_weights), idle threads not spinning, glibc's allocator as the server sets it "
        "(server.memory.runtime.configure_allocator).",
        "",
        f"### Speed: a plan's run against onnxruntime's defaults (target <= {SPEED_TARGET:g}, {speed_verdict})",
        "",
        f"Default model's plan graph, the server's session against one with onnxruntime's default options, neither "
        f"spinning, in one process, runs alternated (each round in the other order), median of {SPEED_ROUNDS} each "
        "after two warm-up runs.",
        "",
        "| plan (batch x canvas, passes) | server's session ms | onnxruntime defaults ms | ratio |",
        "|---|---|---|---|",
        *[f"| {shape} | {server:.1f} | {defaults:.1f} | {server / defaults:.3f} |" for shape, server, defaults in speed],
        "",
        f"### Memory: admission's account against the server process (target +-{MEMORY_BOUND:.0%}, {memory_verdict})",
        "",
        f"A real `scoremap-serve` per model (`--no-warm-up`, `--max-idle-arena-bytes {IDLE_ARENA}`: the arena keeps "
        "its block between requests, to be read; canvases exactly the sizes, native stride: one pass; "
        "batch 4 from 4 concurrent requests meeting in one batch; a first plan at the model's training size, not "
        "reported; then the plans in the order of their running batch's size). Worst deviation "
        f"{worst:.1%} against the plan's RSS growth; for every plan together {worst_held:.1%} against what the server "
        f"holds idle, {worst_steady:.1%} against its steady-state peak. Predicted: what admission's account of the plans "
        "(`scoremap_plans_held_bytes`) grew by: the model's weights once, each plan's own state "
        f"({cpu.session_bytes / MiB:g} MiB), the largest running batch ({cpu.activation_factor:g} x live peak + "
        f"{cpu.workspace_bytes / MiB:g} MiB), measured once a plan is made (convert.memory_model). "
        "Growth: VmRSS after the first request(s) at the shape minus before; creation peak: VmHWM during them "
        "(reset through /proc/PID/clear_refs) minus VmRSS before, which includes building the plan graph and "
        "loading its session (transient, one plan at a time server-wide); held: VmRSS after the plan's requests "
        "minus before the server's first plan, against the whole account; steady: VmHWM during the same requests "
        "twice more minus VmRSS before the server's first plan (the requests' own memory included), against the "
        "whole account. The server's own footprint: what it measured the plan to hold alone. MiB.",
        "",
        *memory_table(memory),
        "",
        f"Server warnings during these runs: {len(warnings)}" + (f" (first: `{warnings[0]}`)" if warnings else ""),
    ])


# --- int8 against fp32 ------------------------------------------------------------------------

INT8_SHAPES = ((1, 384, 576, 1), (4, 384, 384, 1))  # batch, h, w, passes
INT8_SPEED_TARGET = 1.8
INT8_ROUNDS = 30


@dataclasses.dataclass(frozen=True)
class Int8Speed:
    """One plan shape's fp32 and int8 runs, alternated in one process. `ratios` are each round's fp32 run over its
    int8 run, the two back to back: a pair is what the host's drift from one second to the next touches least
    (docs/design.md), so the target is read on their median. The fastest run of each is shown beside it."""

    shape: str
    fp32_seconds: tuple[float, ...]
    int8_seconds: tuple[float, ...]

    @property
    def ratios(self) -> list[float]:
        return [fp32 / int8 for fp32, int8 in zip(self.fp32_seconds, self.int8_seconds)]

    @property
    def speed_up(self) -> float:
        return statistics.median(self.ratios)

    @property
    def quartiles(self) -> tuple[float, float]:
        first, _, third = statistics.quantiles(self.ratios, n=4)
        return first, third


def int8_speed_rows(fp32_path: str, int8_path: str, *, rounds: int = INT8_ROUNDS) -> list[Int8Speed]:
    """Each model's plan graph in a session made as the server makes it, in one process, runs alternated (each round
    in the other order), at each of INT8_SHAPES."""
    from server.memory.runtime import configure_allocator
    from server.engine.device_graph import PIXELS, VALID
    from server.engine.providers import Engine
    from server.engine.shared_weights import SharedWeights
    from server.settings import Settings

    configure_allocator()
    engine = Engine(Settings(provider="cpu"))
    nets = {"fp32": onnx.load(fp32_path), "int8": onnx.load(int8_path)}
    weights = {name: SharedWeights() for name in nets}
    rows = []
    for batch, height, width, passes in INT8_SHAPES:
        sessions = {name: engine.session(_plan_graph(net, batch, height, width, passes), weights=weights[name])
                    for name, net in nets.items()}
        valid_shape = next(value.shape for value in sessions["fp32"].get_inputs() if value.name == VALID)
        feeds = {PIXELS: np.random.default_rng(0).integers(0, 256, (batch, height, width, 3), dtype=np.uint8),
                 VALID: np.ones(valid_shape, np.float32)}
        times: dict[str, list[float]] = {name: [] for name in sessions}
        pair = list(sessions.items())
        for round_ in range(rounds):
            for name, session in pair if round_ % 2 == 0 else pair[::-1]:
                start = time.perf_counter()
                session.run(None, feeds)
                times[name].append(time.perf_counter() - start)
        rows.append(Int8Speed(f"{batch}x{height}x{width}", tuple(times["fp32"]), tuple(times["int8"])))
        del sessions
    return rows

