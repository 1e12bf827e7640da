"""The load tester's own cost: its CPU per request, every process of it, against the null model.

`scoremap-serve` with the null model (bench/models.py) in its own process, on the CPU provider; scoremap-loadtest's
LoadTester (one sending process, and this one merging) in closed loops of 1, 16 and 64 in flight, samples/cat.jpg
at scale 384 (bench_host's request). Its CPU per request answered over each window (/proc: the sending process
and this one) is set against the yardstick of bench_host, the CPU PIL takes to decode and resize that photo
(bench_host.decode_and_resize, median of YARDSTICK_CALLS, measured before and after each level in this run).
Target: the load tester's CPU per request <= 0.1x decode + resize, at every level, so that a load tester on the
server's host takes a small share of what the server's host path needs. Beside it, how busy the load tester was
(ran or waited to run, over its one core) and the server's CPU per request; and gRPC's own floor, one bare blocking
call at a time from one process, for what no arrangement of the load tester's work can go below. About 1 minute.
"""

from __future__ import annotations

import pathlib
import statistics
import tempfile
import time

import grpc

from bench.bench_host import SAMPLE, SCALE, decode_and_resize
from bench.bench_overload import start_server
from bench.models import null_model
from clients.loadtest.latency import LevelReport
from clients.loadtest.run import LevelPlan, LoadLimits, LoadTester, Target
from clients.loadtest.traffic import SCORE_METHOD
from protos import scoring_pb2

IN_FLIGHT = (1, 16, 64)
SECONDS = 5.0
PROCESSES = 1
YARDSTICK_CALLS = 40
TARGET = 0.1
# Room for every caller: a thread each (and the reserved ones), no refusal for a queue the levels fill on purpose.
SERVER_FLAGS = ("--grpc-workers", str(max(IN_FLIGHT) + 8), "--max-concurrent-rpcs", str(2 * max(IN_FLIGHT) + 16),
                "--max-queue-ms", "60000")


def yardstick_ms(data: bytes, *, calls: int = YARDSTICK_CALLS) -> float:
    """Median process CPU ms of one PIL decode + resize of `data` at the scale."""
    decode_and_resize(data)
    times = []
    for _ in range(calls):
        started = time.process_time()
        decode_and_resize(data)
        times.append(time.process_time() - started)
    return 1000 * statistics.median(times)


def bare_grpc_ms(address: str, request: scoring_pb2.ScoreRequest, *, seconds: float) -> tuple[float, float]:
    """gRPC's own floor: (process CPU ms per call, calls/s) of one blocking call at a time from this process, the
    request serialized once, no answer parsed, nothing else done (no deadline, no bookkeeping)."""
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(SCORE_METHOD)
        payload = request.SerializeToString()
        call(payload)
        calls, started, cpu = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - started < seconds:
            call(payload)
            calls += 1
        return 1000 * (time.process_time() - cpu) / calls, calls / (time.perf_counter() - started)


def measure(*, seconds: float = SECONDS, in_flight: tuple[int, ...] = IN_FLIGHT,
            processes: int = PROCESSES) -> tuple[list[tuple[LevelReport, float]], tuple[float, float]]:
    """Each level's report and the yardstick around it (the mean of the one before and the one after); then
    gRPC's own floor at one call at a time (bare_grpc_ms)."""
    data = SAMPLE.read_bytes()
    request = scoring_pb2.ScoreRequest(encoded=data, scales=[SCALE])
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        server, address, _metrics = start_server(null_model(folder), pathlib.Path(folder) / "server.log", SERVER_FLAGS)
        try:
            limits = LoadLimits()
            with LoadTester(Target(address), [request], processes=processes, limits=limits,
                            server_pid=server.pid) as tester:
                before = yardstick_ms(data)
                for level in in_flight:
                    plan = LevelPlan(duration_s=seconds, max_requests=limits.max_requests, timeout_s=60.0,
                                     warmup=2 * level)
                    report = tester.closed(level, plan)
                    if report.errors:
                        raise RuntimeError(f"{level} in flight: requests failed: {report.errors}")
                    after = yardstick_ms(data)
                    rows.append((report, (before + after) / 2))
                    before = after
            floor = bare_grpc_ms(address, request, seconds=seconds)
        finally:
            server.terminate()
            server.wait(30)
    return rows, floor


def run(*, seconds: float = SECONDS) -> str:
    rows, (floor_ms, floor_rate) = measure(seconds=seconds)
    ratios = [report.client_cpu_ms / yardstick for report, yardstick in rows]
    verdict = "met" if max(ratios) <= TARGET else "missed"
    return "\n".join([
        "## The load tester's own CPU per request (bench_loadtest)",
        "",
        f"`scoremap-serve` with the null model (CPU provider) in its own process, samples/cat.jpg at scale {SCALE}; "
        f"scoremap-loadtest's LoadTester, {PROCESSES} sending process and the one merging, closed loops of "
        f"{seconds:g} s; its CPU (/proc, every process of it) per request answered in the window, against the CPU "
        f"PIL takes to decode and resize the same photo (median of {YARDSTICK_CALLS}, before and after each level).",
        "",
        "| in flight | req/s | load tester CPU ms/req | decode + resize CPU ms | ratio | load tester busy | "
        "server CPU ms/req |",
        "|---|---|---|---|---|---|---|",
        *[f"| {report.level:g} | {report.throughput_rps:.1f} | {report.client_cpu_ms:.3f} | {yardstick:.2f} | "
          f"{ratio:.3f}x | {report.client_busy:.0%} | {report.server_cpu_ms:.2f} |"
          for (report, yardstick), ratio in zip(rows, ratios)],
        "",
        f"Target: the load tester's CPU per request <= {TARGET}x decode + resize at every level: worst "
        f"{max(ratios):.3f}x, {verdict}.",
        "",
        f"gRPC's own floor on the same server and request, after the levels: one blocking call at a time from one "
        f"process, serialized once, nothing else done: {floor_ms:.3f} ms of CPU per call at {floor_rate:.1f} calls/s "
        f"({floor_ms / yardstick_ms(SAMPLE.read_bytes()):.3f}x decode + resize); the load tester at 1 in flight, "
        f"every process of it: {rows[0][0].client_cpu_ms / floor_ms:.2f}x that.",
    ])


if __name__ == "__main__":
    print(run())
