"""The load tester's own cost: its CPU per request, every process of it, against the null model.

`scoremap-serve` with the null model (bench/models.py) in its own process, on the CPU provider; scoremap-loadtest's
LoadTester (one sending process, and this one merging) in closed loops of 1, 16 and 64 in flight, samples/cat.jpg
at scale 384 (bench_host's request). Its CPU per request answered over each window (/proc: the sending process
and this one) is set against the yardstick of bench_host, the CPU PIL takes to decode and resize that photo
(bench_host.decode_and_resize, median of YARDSTICK_CALLS, measured before and after each level in this run).
Target: the load tester's CPU per request <= 0.1x decode + resize, at every level, so that a load tester on the
server's host takes a small share of what the server's host path needs. Beside it, how busy the load tester was
(ran or waited to run, over its one core) and the server's CPU per request; and gRPC's own floor, one bare blocking
call at a time from one process, for what no arrangement of the load tester's work can go below. The levels are
run again with each photo requests commonly carry (bench_split's: cat.jpg enlarged, a photo shrunk to 384, a
12-megapixel phone photo shrunk to 768), each against its own decode + resize.

Then the ways of issuing the calls, alternated round by round in the same run (the machine's load drifts; a
comparison of runs far apart would measure that): the sending process's CPU per request (the merging process
left out) with gRPC's own client I/O (the load tester's choice, LoadLimits.grpc_experiments), with gRPC's
EventEngine client (its default), and a grpc.aio closed loop of as many tasks (one event loop, the same
pre-serialized requests). Last, one `scoremap-loadtest --processes auto` against four `--processes 1` commands
started together at a quarter of the callers each (what bench_workers did by hand): the one command's req/s over
the four's sum, alternated. About 6 minutes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import multiprocessing
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import grpc

from bench.bench_host import SAMPLE, SCALE, decode_and_resize
from bench.bench_overload import start_server
from bench.models import null_model
from clients.loadtest.latency import LevelReport
from clients.loadtest.run import LevelPlan, LoadLimits, LoadTester, Target
from clients.loadtest.traffic import SCORE_METHOD, Payloads
from protos import scoring_pb2

IN_FLIGHT = (1, 16, 64)
# The common photos' levels: 64 decodes of a 12-megapixel photo at once exceed the host budget (refused, rightly).
PHOTO_IN_FLIGHT = (1, 16)
SECONDS = 5.0
PROCESSES = 1
YARDSTICK_CALLS = 40
TARGET = 0.1
# The ways of issuing compared: these levels, this many rounds (each way once a round, the order reversed every
# other round), windows this long after a warm-up of ALTERNATIVE_WARMUP_S.
ALTERNATIVE_LEVELS = (16, 64)
ALTERNATIVE_ROUNDS = 3
ALTERNATIVE_SECONDS = 3.0
ALTERNATIVE_WARMUP_S = 1.0
OURS = "gRPC's own client I/O (the load tester)"
# One command against four: callers in all, window length, rounds (alternated).
DRIVE_CALLERS = 64
DRIVE_COMMANDS = 4
DRIVE_SECONDS = 5.0
DRIVE_ROUNDS = 2
# Room for every caller: a thread each (and the reserved ones), no refusal for a queue the levels fill on purpose.
SERVER_FLAGS = ("--grpc-workers", str(max(IN_FLIGHT) + 8), "--max-concurrent-rpcs", str(2 * max(IN_FLIGHT) + 16),
                "--max-queue-ms", "60000")


def yardstick_ms(data: bytes, *, scale: int = SCALE, calls: int = YARDSTICK_CALLS) -> float:
    """Median process CPU ms of one PIL decode + resize of `data` at `scale`."""
    decode_and_resize(data, scale)
    times = []
    for _ in range(calls):
        started = time.process_time()
        decode_and_resize(data, scale)
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


def _aio_closed_loop(address: str, encoded: bytes, callers: int, seconds: float, results) -> None:
    """A grpc.aio closed loop in this (spawned) process: `callers` tasks on one event loop, each awaiting its call
    and sending the next, the requests from the load tester's Payloads; puts (answers, CPU s) over the window."""
    payloads = Payloads([encoded])

    async def main() -> tuple[int, float]:
        answers, sent, stop = [0], [0], [False]
        async with grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            call = channel.unary_unary(SCORE_METHOD)

            async def caller() -> None:
                while not stop[0]:
                    number, sent[0] = sent[0], sent[0] + 1
                    await call(payloads(number), timeout=60.0)
                    answers[0] += 1

            tasks = [asyncio.create_task(caller()) for _ in range(callers)]
            await asyncio.sleep(ALTERNATIVE_WARMUP_S)
            first, cpu = answers[0], time.process_time()
            await asyncio.sleep(seconds)
            counted, spent = answers[0] - first, time.process_time() - cpu
            stop[0] = True
            await asyncio.gather(*tasks)
        return counted, spent

    results.put(asyncio.run(main()))


def _aio_ms(address: str, encoded: bytes, callers: int, seconds: float) -> float:
    """CPU ms per request of a grpc.aio closed loop in a process of its own (its start left out)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=_aio_closed_loop, args=(address, encoded, callers, seconds, results))
    process.start()
    answers, spent = results.get(timeout=seconds + 120)
    process.join(30)
    return 1000 * spent / answers


def alternatives(address: str, request: scoring_pb2.ScoreRequest, *, rounds: int = ALTERNATIVE_ROUNDS,
                 seconds: float = ALTERNATIVE_SECONDS) -> dict[str, dict[int, list[float]]]:
    """Each way of issuing's CPU ms per request of its sending process, per level, one figure a round; the ways
    alternated in each round, the order reversed every other round."""
    ours = LoadLimits()
    ways = {OURS: ours,
            "gRPC's EventEngine client": dataclasses.replace(ours, grpc_experiments="")}
    found: dict[str, dict[int, list[float]]] = {name: {} for name in [*ways, "grpc.aio, one event loop"]}
    testers = {name: LoadTester(Target(address), [request], limits=limits, count_this_process=False)
               for name, limits in ways.items()}
    try:
        for round_ in range(rounds):
            for level in ALTERNATIVE_LEVELS:
                for name in (list(found) if round_ % 2 == 0 else list(found)[::-1]):
                    if name in testers:
                        plan = LevelPlan(duration_s=seconds, max_requests=ours.max_requests, timeout_s=60.0,
                                         warmup=2 * level)
                        report = testers[name].closed(level, plan)
                        if report.errors:
                            raise RuntimeError(f"{name}, {level} in flight: requests failed: {report.errors}")
                        found[name].setdefault(level, []).append(report.client_cpu_ms)
                    else:
                        found[name].setdefault(level, []).append(
                            _aio_ms(address, request.SerializeToString(), level, seconds))
    finally:
        for tester in testers.values():
            tester.close()
    return found


def _loadtest_command(address: str, photos: pathlib.Path, callers: int, processes: str, seconds: float) -> list[str]:
    return [sys.executable, "-m", "clients.loadtest.run", "--server", address, "--concurrency", str(callers),
            "--duration", f"{seconds:g}", "--warmup", str(2 * callers), "--processes", processes, "--images",
            str(photos), "--scales", str(SCALE), "--timeout", "60", "--json", "-", "--quiet"]


def _run_commands(commands: list[list[str]], *, seconds: float) -> list[dict]:
    """Start the commands together; every level each reports (its JSON on stdout)."""
    environment = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parent.parent)}
    running = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment)
               for command in commands]
    levels = []
    for process in running:
        out, err = process.communicate(timeout=seconds + 300)
        if process.returncode != 0:
            raise RuntimeError(f"scoremap-loadtest exited {process.returncode}: {err[-2000:]}")
        levels.extend(json.loads(out))
    return levels


def drive(address: str, photos: pathlib.Path, *, rounds: int = DRIVE_ROUNDS,
          seconds: float = DRIVE_SECONDS) -> list[tuple[float, float, int]]:
    """Per round: (req/s of one `--processes auto` command at DRIVE_CALLERS, req/s summed over DRIVE_COMMANDS
    `--processes 1` commands at a share each, started together; the processes auto chose), alternated; every
    command sends the photos of the folder `photos`."""
    one = _loadtest_command(address, photos, DRIVE_CALLERS, "auto", seconds)
    four = [_loadtest_command(address, photos, DRIVE_CALLERS // DRIVE_COMMANDS, "1", seconds)] * DRIVE_COMMANDS
    rows = []
    for round_ in range(rounds):
        figures = {}
        for name in (("one", "four") if round_ % 2 == 0 else ("four", "one")):
            figures[name] = _run_commands([one] if name == "one" else four, seconds=seconds)
        [single] = figures["one"]
        rows.append((single["throughput_rps"], sum(level["throughput_rps"] for level in figures["four"]),
                     single["client_processes"]))
    return rows


def measure(*, seconds: float = SECONDS, in_flight: tuple[int, ...] = IN_FLIGHT,
            processes: int = PROCESSES) -> tuple[list[tuple[LevelReport, float]], tuple[float, float],
                                                 dict[str, dict[int, list[float]]], list[tuple[float, float, int]], float,
                                                 list[tuple[str, LevelReport, float]]]:
    """Each level's report and the yardstick around it (the mean of the one before and the one after); then
    gRPC's own floor at one call at a time (bare_grpc_ms); the ways of issuing (alternatives); one command
    against four (drive); the yardstick after them; the levels again for each of the common photos (photo_rows)."""
    data = SAMPLE.read_bytes()
    request = scoring_pb2.ScoreRequest(encoded=data, scales=[SCALE])
    with tempfile.TemporaryDirectory() as folder:
        server, address, _metrics = start_server(null_model(folder), pathlib.Path(folder) / "server.log", SERVER_FLAGS)
        try:
            limits = LoadLimits()
            with LoadTester(Target(address), [request], processes=processes, limits=limits,
                            server_pid=server.pid) as tester:
                rows = closed_levels(tester, data, scale=SCALE, in_flight=in_flight, seconds=seconds, limits=limits)
            floor = bare_grpc_ms(address, request, seconds=seconds)
            ways = alternatives(address, request, rounds=ALTERNATIVE_ROUNDS, seconds=ALTERNATIVE_SECONDS)
            photos = pathlib.Path(folder) / "photos"
            photos.mkdir()
            (photos / SAMPLE.name).write_bytes(data)
            driven = drive(address, photos, rounds=DRIVE_ROUNDS, seconds=DRIVE_SECONDS)
            last = yardstick_ms(data)
            by_photo = photo_rows(address, server.pid, seconds=seconds)
        finally:
            server.terminate()
            server.wait(30)
    return rows, floor, ways, driven, last, by_photo


def photo_rows(address: str, server_pid: int, *, seconds: float,
               in_flight: tuple[int, ...] = PHOTO_IN_FLIGHT) -> list[tuple[str, LevelReport, float]]:
    """(photo, level report, yardstick) for the photos requests most often carry (bench_split's: cat.jpg enlarged,
    a photo shrunk, a 12-megapixel phone photo shrunk), each at its scale, the yardstick that photo's decode + resize
    to it (the mean of the one before and the one after the level)."""
    from bench.bench_split import photos

    rows, limits = [], LoadLimits()
    for name, (data, scale) in photos().items():
        request = scoring_pb2.ScoreRequest(encoded=data, scales=[scale])
        with LoadTester(Target(address), [request], processes=PROCESSES, limits=limits, server_pid=server_pid) as tester:
            rows += [(name, report, yardstick) for report, yardstick in
                     closed_levels(tester, data, scale=scale, in_flight=in_flight, seconds=seconds, limits=limits)]
    return rows


def closed_levels(tester: LoadTester, data: bytes, *, scale: int, in_flight: tuple[int, ...], seconds: float,
                  limits: LoadLimits) -> list[tuple[LevelReport, float]]:
    """Each closed level's report and the yardstick around it: `data`'s decode + resize to `scale`, the mean of the
    one before and the one after the level."""
    rows, before = [], yardstick_ms(data, scale=scale)
    for level in in_flight:
        plan = LevelPlan(duration_s=seconds, max_requests=limits.max_requests, timeout_s=120.0, warmup=2 * level)
        report = tester.closed(level, plan)
        if report.errors:
            raise RuntimeError(f"{level} in flight, scale {scale}: requests failed: {report.errors}")
        after = yardstick_ms(data, scale=scale)
        rows.append((report, (before + after) / 2))
        before = after
    return rows


def _median_ratio(these: list[float], ours: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(these, ours))


def run(*, seconds: float = SECONDS) -> str:
    load_before = os.getloadavg()[0]
    rows, (floor_ms, floor_rate), ways, driven, last, by_photo = measure(seconds=seconds)
    load_after = os.getloadavg()[0]
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
        "",
        f"Ways of issuing the calls, alternated in this run ({ALTERNATIVE_ROUNDS} rounds of {ALTERNATIVE_SECONDS:g}-s "
        f"windows, each way once a round): the sending process's CPU ms per request (median; each round's in "
        f"brackets), and its ratio to decode + resize measured after them ({last:.2f} ms):",
        "",
        "| way | " + " | ".join(f"{level} in flight" for level in ALTERNATIVE_LEVELS) + " |",
        "|---|" + "---|" * len(ALTERNATIVE_LEVELS),
        *[f"| {name} | " + " | ".join(
            f"{statistics.median(found[level]):.3f} ({statistics.median(found[level]) / last:.3f}x; "
            f"{', '.join(f'{v:.3f}' for v in found[level])})" for level in ALTERNATIVE_LEVELS) + " |"
          for name, found in ways.items()],
        "",
        "Each way's CPU per request over the load tester's, the median of the rounds' ratios: " + "; ".join(
            f"{name} " + ", ".join(f"{_median_ratio(found[level], ways[OURS][level]):.2f}x at {level}"
                                   for level in ALTERNATIVE_LEVELS)
            for name, found in ways.items() if name != OURS) + ".",
        "",
        "The same levels with each photo requests commonly carry, on the same server, against that photo's own "
        "decode + resize to its scale:",
        "",
        "| photo | in flight | req/s | load tester CPU ms/req | decode + resize CPU ms | ratio | load tester busy |",
        "|---|---|---|---|---|---|---|",
        *[f"| {name} | {report.level:g} | {report.throughput_rps:.1f} | {report.client_cpu_ms:.3f} | {yardstick:.2f} | "
          f"{report.client_cpu_ms / yardstick:.3f}x | {report.client_busy:.0%} |" for name, report, yardstick in by_photo],
        "",
        f"One command against {DRIVE_COMMANDS}: `scoremap-loadtest --processes auto --concurrency {DRIVE_CALLERS}` "
        f"against {DRIVE_COMMANDS} `--processes 1 --concurrency {DRIVE_CALLERS // DRIVE_COMMANDS}` commands started "
        f"together, windows of {DRIVE_SECONDS:g} s, alternated: req/s of the one over the sum of the {DRIVE_COMMANDS}: "
        + ", ".join(f"{single / summed:.2f} ({single:.1f} / {summed:.1f}, auto chose {chosen})"
                    for single, summed, chosen in driven)
        + f"; median {statistics.median(single / summed for single, summed, _ in driven):.2f}.",
        "",
        f"The machine's load (1-minute average) as the run began and ended: {load_before:.1f} and {load_after:.1f}, "
        f"on {os.cpu_count()} cores; on a machine shared with other work every figure moves, the ratios of runs "
        "alternated within it less.",
    ])


if __name__ == "__main__":
    print(run())
