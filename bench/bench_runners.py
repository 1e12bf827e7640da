"""CPU runners (`--cpu-runners N`): a model's batches side by side, each on its share of the cores, against one
batch at a time spread over every core (the default).

The default model (converted here), samples/cat.jpg at scale 384, stride 32, top-5, over gRPC from this process;
closed loops at 1 and 16 clients, each level on a server of its own, the two settings alternated (ORDER) so that
a drift in the shared machine's load hits both alike. Reported as ratios within the run: throughput, and the
server's CPU per request. About 4 minutes on 2 cores.
"""

from __future__ import annotations

import os
import pathlib
import statistics
import tempfile

import onnx

import grpc

from bench.bench_host import SAMPLE, SCALE
from bench.bench_overload import process_cpu_seconds, start_server
from clients.loadtest.run import LevelPlan, LoadLimits, closed_loop
from convert import convert_classifier
from protos import scoring_pb2, scoring_pb2_grpc

SECONDS = 10.0  # each level's window
CLIENTS = (1, 16)
ORDER = ("one", "cores", "cores", "one")


def served_level(model: str, runners: int, clients: int, *, seconds: float,
                 folder: pathlib.Path) -> tuple[float, float]:
    """(req/s, server CPU ms per request) of a closed loop of `clients` on a server of its own, after one request
    (plans made on first use are not the level's); no queue-time limit, so every request is answered."""
    flags = ("--cpu-runners", str(runners), "--max-queue-ms", "600000")
    server, address, _metrics = start_server(model, folder / "server.log", flags)
    try:
        request = scoring_pb2.ScoreRequest(encoded=SAMPLE.read_bytes(), scales=[SCALE])
        limits = LoadLimits()
        plan = LevelPlan(duration_s=seconds, max_requests=limits.max_requests, timeout_s=120.0, warmup=clients)
        with grpc.insecure_channel(address) as channel:
            stub = scoring_pb2_grpc.DenseScoringStub(channel)
            stub.Score(request, timeout=120)
            before = process_cpu_seconds(server.pid)
            report = closed_loop(stub, [request], concurrency=clients, plan=plan, limits=limits)
            cpu = process_cpu_seconds(server.pid) - before
    finally:
        server.terminate()
        server.wait(30)
    if report.errors:
        raise RuntimeError(f"{runners} runner(s), {clients} clients: requests failed: {report.errors}")
    # The CPU window holds the warm-up and the requests in flight at its end too: every request sent counts.
    return report.throughput_rps, 1000 * cpu / max(report.sent, 1)


def run(*, seconds: float = SECONDS) -> str:
    cores = len(os.sched_getaffinity(0))
    runners = {"one": 1, "cores": cores}
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        model = str(pathlib.Path(folder) / "default.onnx")
        onnx.save(convert_classifier("default"), model)
        for clients in CLIENTS:
            levels: dict[str, list[tuple[float, float]]] = {setting: [] for setting in runners}
            for setting in ORDER:
                levels[setting].append(served_level(model, runners[setting], clients, seconds=seconds,
                                                    folder=pathlib.Path(folder)))
            (one_rate, one_cpu), (cores_rate, cores_cpu) = (
                tuple(statistics.mean(values) for values in zip(*levels[setting])) for setting in ("one", "cores"))
            rows.append(f"| {clients} client{'s' * (clients > 1)} | {cores_rate:.1f} / {one_rate:.1f} req/s = "
                        f"{cores_rate / one_rate:.2f}x | {cores_cpu:.1f} / {one_cpu:.1f} ms = "
                        f"{cores_cpu / one_cpu:.2f}x |")
    return "\n".join([
        "## CPU runners: batches side by side (bench_runners, issue 29)",
        "",
        f"`scoremap-serve --cpu-runners {cores}` ({cores} batches at once, each on one onnxruntime thread) against `--cpu-runners 1` (one batch at a time on every core): the default model, "
        f"samples/cat.jpg at scale {SCALE}, stride 32, top-5, closed loops of {seconds:.0f} s over gRPC, each level "
        f"on a server of its own, in the order {', '.join(ORDER)} (one: --cpu-runners 1), the means compared.",
        "",
        f"| clients | throughput, {cores} runners / 1 | server CPU per request, {cores} runners / 1 |",
        "|---|---|---|",
        *rows,
    ])


if __name__ == "__main__":
    print(run())
