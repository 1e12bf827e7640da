"""Served throughput against server processes: `scoremap-serve --workers N`, batching on and off.

The default model at its native stride (grid, 4 shifted passes for stride 16) and à trous, samples/cat.jpg at
scale 384, stride 16, top-5, closed loops over gRPC at 1, 16 and 64 clients, each server in its own
process(es) on the provider `auto` picks. Each level is one `scoremap-loadtest` command: it starts as many
sending processes as it finds it needs (one Python process driving 64 clients was itself the ceiling on an H200,
bench/RESULTS.md), merges their latencies, and says how busy it was beside the server's CPU. Each row is printed
as soon as it is measured (a time limit keeps what was measured). Meant for a GPU; on the CPU it runs too, where a
second process only shares the same cores.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.bench_overload import start_server
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
CONNECTIONS = 4  # per sending process of the load tester: the kernel spreads connections over the server's processes


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


def load(address: str, *, clients: int, shift: str, seconds: float, server_pid: int) -> dict:
    """One `scoremap-loadtest` command: a closed loop of `clients` from as many sending processes as it finds it
    needs (its --processes auto), CONNECTIONS each, its latencies merged; its report of the level (JSON)."""
    command = [sys.executable, "-m", "clients.loadtest.run", "--server", address, "--images", str(ROOT / "samples"),
               "--scales", str(SCALE), "--stride", str(STRIDE), "--shift", shift, "--duration", str(seconds),
               "--concurrency", str(clients), "--warmup", str(2 * clients), "--connections", str(CONNECTIONS),
               "--server-pid", str(server_pid), "--json", "-", "--quiet"]
    ran = subprocess.run(command, stdout=subprocess.PIPE, text=True, timeout=seconds + 600, check=True)
    return json.loads(ran.stdout)[0]


def figure(value: float | None, form: str = ".1f") -> str:
    """A report's figure, or '-' where the level had none (JSON null: no request answered in its window)."""
    return "-" if value is None else format(value, form)


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
                level = load(address, clients=clients, shift=shift, seconds=seconds, server_pid=server.pid)
                errors = ", ".join(f"{code} {n}" for code, n in level["errors"].items()) or "-"
                busy = figure(level["client_busy"], ".0%") + ("*" if level["client_bound"] else "")
                row = (f"| {scheme} | {workers} | {max_batch} | {clients} | {level['throughput_rps']:.1f} | "
                       f"{figure(level['p50_ms'])} | {figure(level['p99_ms'])} | {figure(level['max_ms'])} | "
                       f"{figure(level['server_cpu_ms'], '.2f')} | {level['client_processes']} | {busy} | {errors} |")
                rows.append(row)
                print(row, file=out, flush=True)
        finally:
            server.terminate()
            server.wait(60)
    return rows


def run(*, seconds: float = SECONDS, provider: str = "auto", out=sys.stdout,
        configs: tuple[tuple[int, int], ...] = CONFIGS) -> str:
    header = ["## Served by server processes (bench_workers)", "",
              f"The default model, samples/cat.jpg at scale {SCALE}, stride {STRIDE}, top-5; `scoremap-serve --workers N "
              f"--max-batch B` on provider {provider}, closed loops of {seconds:g} s over gRPC from one "
              f"`scoremap-loadtest` command per level (its sending processes as many as it finds it needs, {CONNECTIONS} connections each, "
              "latencies merged); server CPU per request answered in the window, every server process "
              "(--server-pid); load tester busy: the time its processes ran or waited to run, over one core each "
              "(* over 80%: the level may be the load tester's limit).", "",
              "| scheme | workers | max batch | clients | req/s | p50 ms | p99 ms | max ms | server CPU ms/req | "
              "load tester processes | load tester busy | errors |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
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
