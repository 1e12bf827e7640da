"""Served throughput against server processes (issue 29): `scoremap-serve --workers N`, batching on and off.

The default model at its native stride (grid, 4 shifted passes for stride 16) and à trous, samples/cat.jpg at
scale 384, stride 16, top-5, closed loops over gRPC from this process at 1, 16 and 64 clients, each server in
its own process(es) on the provider `auto` picks. Each row is printed as soon as it is measured (a time limit
keeps what was measured). Meant for a GPU (`make bench-gpu` names it); on the CPU it runs too, where a
second process only shares the same cores.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.bench_overload import process_cpu_seconds, start_server
from bench.models import converted
from clients.api.options import ScoreOptions, build_request
from clients.loadtest.run import LevelPlan, LoadLimits, closed_loop
from protos import scoring_pb2_grpc

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCALE = 384
STRIDE = 16
CLIENTS = (1, 16, 64)
SECONDS = 3.0
CONFIGS = (  # (workers, max batch)
    (1, 1), (1, 8), (4, 8),
)
SERVING_PROBES = 20  # fresh connections that must all find a SERVING process (the kernel spreads them)


def all_serving(address: str, *, seconds: float = 300.0) -> None:
    """Until SERVING_PROBES fresh connections in a row reach a SERVING process (each worker warms up alone)."""
    until, in_a_row = time.monotonic() + seconds, 0
    while in_a_row < SERVING_PROBES:
        with grpc.insecure_channel(address) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=60,
                                                               wait_for_ready=True).status
        in_a_row = in_a_row + 1 if status == health_pb2.HealthCheckResponse.SERVING else 0
        if time.monotonic() > until:
            raise RuntimeError("the workers never all said SERVING")
        time.sleep(0.05 if in_a_row else 0.5)


def measure(model: str, scheme: str, *, provider: str, seconds: float, folder: pathlib.Path, out) -> list[str]:
    shift = "atrous" if scheme == "à trous" else "grid"
    request = build_request(ROOT / "samples" / "cat.jpg", ScoreOptions(scales=(SCALE,), stride=STRIDE, shift=shift))
    rows = []
    for workers, max_batch in CONFIGS:
        flags = ["--workers", str(workers), "--max-batch", str(max_batch), "--max-queue-ms", "10000"]
        server, address, _metrics = start_server(model, folder / "server.log", flags, provider=provider)
        try:
            all_serving(address)
            with grpc.insecure_channel(address) as channel:
                stub = scoring_pb2_grpc.DenseScoringStub(channel)
                for clients in CLIENTS:
                    limits = LoadLimits()
                    plan = LevelPlan(duration_s=seconds, max_requests=limits.max_requests, timeout_s=30.0,
                                     warmup=clients)
                    cpu = process_cpu_seconds(server.pid)
                    report = closed_loop(stub, [request], concurrency=clients, plan=plan, limits=limits)
                    cpu = process_cpu_seconds(server.pid) - cpu
                    errors = ", ".join(f"{code} {n}" for code, n in report.errors.items()) or "-"
                    row = (f"| {scheme} | {workers} | {max_batch} | {clients} | {report.throughput_rps:.1f} | "
                           f"{report.p50_ms:.1f} | {report.p99_ms:.1f} | {report.max_ms:.1f} | "
                           f"{1000 * cpu / max(report.sent, 1):.2f} | {errors} |")
                    rows.append(row)
                    print(row, file=out, flush=True)
        finally:
            server.terminate()
            server.wait(60)
    return rows


def run(*, seconds: float = SECONDS, provider: str = "auto", out=sys.stdout) -> str:
    header = ["## Served by server processes (bench_workers, issue 29)", "",
              f"The default model, samples/cat.jpg at scale {SCALE}, stride {STRIDE}, top-5; `scoremap-serve --workers N "
              f"--max-batch B` on provider {provider}, closed loops of {seconds:.0f} s over gRPC from one client process; "
              "server CPU per request over every server process.", "",
              "| scheme | workers | max batch | clients | req/s | p50 ms | p99 ms | max ms | server CPU ms/req | errors |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(header), file=out, flush=True)
    with tempfile.TemporaryDirectory() as folder:
        rows = []
        for scheme, output_stride in (("grid", 32), ("à trous", 16)):
            model = converted(folder, output_stride=output_stride)
            rows += measure(model, scheme, provider=provider, seconds=seconds, folder=pathlib.Path(folder), out=out)
    return "\n".join(header + rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=SECONDS)
    parser.add_argument("--provider", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--out", type=pathlib.Path, help="also write the table here, row by row")
    args = parser.parse_args()
    if args.out is not None:
        with args.out.open("w") as out:
            run(seconds=args.seconds, provider=args.provider, out=out)
    else:
        run(seconds=args.seconds, provider=args.provider)


if __name__ == "__main__":
    main()
