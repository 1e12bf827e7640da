"""Served throughput against server processes (issue 29): `scoremap-serve --workers N`, batching on and off.

The default model at its native stride (grid, 4 shifted passes for stride 16) and à trous, samples/cat.jpg at
scale 384, stride 16, top-5, closed loops over gRPC at 1, 16 and 64 clients, each server in its own
process(es) on the provider `auto` picks. The clients are `scoremap-loadtest` processes (LOAD_PROCESSES of
them, the clients split among them, their windows run together): one Python process driving 64 client threads
was itself the ceiling on an H200 (bench/RESULTS.md). Each row is printed as soon as it is measured (a time
limit keeps what was measured). Meant for a GPU; on the CPU it runs too, where a second process only shares
the same cores.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.bench_overload import process_cpu_seconds, start_server
from bench.models import converted

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCALE = 384
STRIDE = 16
CLIENTS = (1, 16, 64)
SECONDS = 3.0
CONFIGS = (  # (workers, max batch)
    (1, 1), (1, 8), (4, 8),
)
SERVING_PROBES = 20  # fresh connections that must all find a SERVING process (the kernel spreads them)
LOAD_PROCESSES = 4  # load generator processes at 16 clients and more


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


def load(address: str, *, clients: int, shift: str, seconds: float) -> dict:
    """A closed loop of `clients` over LOAD_PROCESSES `scoremap-loadtest` processes at once (one below
    LOAD_PROCESSES clients): req/s summed, p50 the processes' median, p99 and max their largest, errors summed."""
    processes = min(LOAD_PROCESSES, clients)
    shares = [clients // processes + (n < clients % processes) for n in range(processes)]
    command = [sys.executable, "-m", "clients.loadtest.run", "--server", address, "--images", str(ROOT / "samples"),
               "--scales", str(SCALE), "--stride", str(STRIDE), "--shift", shift, "--duration", str(seconds),
               "--json", "-", "--quiet"]
    runs = [subprocess.Popen(command + ["--concurrency", str(share), "--warmup", str(2 * share)],
                             stdout=subprocess.PIPE, text=True) for share in shares]
    reports = [json.loads(run.communicate(timeout=seconds + 300)[0])[0] for run in runs]
    errors: dict[str, int] = {}
    for report in reports:
        for code, count in report["errors"].items():
            errors[code] = errors.get(code, 0) + count
    return {"throughput_rps": sum(r["throughput_rps"] for r in reports),
            "p50_ms": statistics.median(r["p50_ms"] for r in reports), "p99_ms": max(r["p99_ms"] for r in reports),
            "max_ms": max(r["max_ms"] for r in reports), "sent": sum(r["sent"] for r in reports), "errors": errors}


def measure(model: str, scheme: str, *, provider: str, seconds: float, folder: pathlib.Path, out,
            configs: tuple[tuple[int, int], ...] = CONFIGS) -> list[str]:
    shift = "atrous" if scheme == "à trous" else "grid"
    rows = []
    for workers, max_batch in configs:
        flags = ["--workers", str(workers), "--max-batch", str(max_batch), "--max-queue-ms", "10000"]
        server, address, _metrics = start_server(model, folder / "server.log", flags, provider=provider)
        try:
            all_serving(address)
            for clients in CLIENTS:
                cpu = process_cpu_seconds(server.pid)
                level = load(address, clients=clients, shift=shift, seconds=seconds)
                cpu = process_cpu_seconds(server.pid) - cpu
                errors = ", ".join(f"{code} {n}" for code, n in level["errors"].items()) or "-"
                row = (f"| {scheme} | {workers} | {max_batch} | {clients} | {level['throughput_rps']:.1f} | "
                       f"{level['p50_ms']:.1f} | {level['p99_ms']:.1f} | {level['max_ms']:.1f} | "
                       f"{1000 * cpu / max(level['sent'], 1):.2f} | {errors} |")
                rows.append(row)
                print(row, file=out, flush=True)
        finally:
            server.terminate()
            server.wait(60)
    return rows


def run(*, seconds: float = SECONDS, provider: str = "auto", out=sys.stdout,
        configs: tuple[tuple[int, int], ...] = CONFIGS) -> str:
    header = ["## Served by server processes (bench_workers, issue 29)", "",
              f"The default model, samples/cat.jpg at scale {SCALE}, stride {STRIDE}, top-5; `scoremap-serve --workers N "
              f"--max-batch B` on provider {provider}, closed loops of {seconds:.0f} s over gRPC from up to {LOAD_PROCESSES} "
              "`scoremap-loadtest` processes; server CPU per request over every server process (warm-ups included).", "",
              "| scheme | workers | max batch | clients | req/s | p50 ms | p99 ms | max ms | server CPU ms/req | errors |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(header), file=out, flush=True)
    with tempfile.TemporaryDirectory() as folder:
        rows = []
        for scheme, output_stride in (("grid", 32), ("à trous", 16)):
            model = converted(folder, output_stride=output_stride)
            rows += measure(model, scheme, provider=provider, seconds=seconds, folder=pathlib.Path(folder), out=out,
                            configs=configs)
    return "\n".join(header + rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=SECONDS)
    parser.add_argument("--provider", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--out", type=pathlib.Path, help="also write the table here, row by row")
    parser.add_argument("--workers", type=lambda text: tuple(int(n) for n in text.split(",")),
                        help="only these --workers counts, at --max-batch 8 (default: the table's configurations)")
    args = parser.parse_args()
    configs = CONFIGS if args.workers is None else tuple((workers, 8) for workers in args.workers)
    if args.out is not None:
        with args.out.open("w") as out:
            run(seconds=args.seconds, provider=args.provider, out=out, configs=configs)
    else:
        run(seconds=args.seconds, provider=args.provider, configs=configs)


if __name__ == "__main__":
    main()
