"""int8 against fp32 on the CPU: the plans' speed and the agreement on held-out photos (convert.quantize).

The default model converted, then quantized by `to_int8` as `scoremap-convert --precision int8` quantizes it (every
calibration method tried, the weights `--int8-weights auto` gives on this CPU, the default photo set, the fallback's
layers kept in float where the calibration photos fall short, written whatever its check says, so the numbers can
be read); the plan graph of each in sessions made as the server makes
them, runs alternated in one process, read as the median of each round's fp32 run over its int8 run
(bench_cpu_plans.Int8Speed says why); each model served as
bench_server serves it (its request, 16 clients in a closed loop, servers alternated); the check's numbers from the
int8 card, with the layers it kept in float; the int8 plans' memory in a server of their own, as bench_cpu_plans
measures the fp32 ones.
Targets: the int8 plan >= 1.8x the fp32 plan's speed at 1x384x576 and 4x384x384; served req/s at 16 clients >= 1.7x.
"""

from __future__ import annotations

import tempfile

import onnx

SERVED_CLIENTS = 16
SERVED_PER_CLIENT = 4
SERVED_ROUNDS = 2
SERVED_TARGET = 1.7


def served_rates(paths: dict[str, str], *, rounds: int = SERVED_ROUNDS) -> dict[str, list[float]]:
    """Each model's req/s at SERVED_CLIENTS clients, on a server of its own started as bench_server starts one (warmed
    up at its scale, no shedding), the models alternated round by round."""
    from bench.bench_server import QUEUE_MS, SCALE, closed_loop, request, stub_for
    from server.main import create_server
    from server.settings import Settings

    settings, job = Settings(warm_up_scales=(SCALE,), max_queue_ms=QUEUE_MS), request()
    rates: dict[str, list[float]] = {name: [] for name in paths}
    order = list(paths.items())
    for round_ in range(rounds):
        for name, path in order if round_ % 2 == 0 else order[::-1]:
            server, port = create_server([path], settings=settings)
            channel, stub = stub_for(port)
            try:
                stub.Score(job)
                rates[name].append(closed_loop(SERVED_CLIENTS, lambda _client: stub.Score(job),
                                               per_client=SERVED_PER_CLIENT))
            finally:
                channel.close()
                server.stop(0).wait(30)
    return rates


def run() -> str:
    from bench.bench_cpu_plans import (INT8_ROUNDS, INT8_SPEED_TARGET, MEMORY_BOUND, int8_speed_rows, memory_table,
                                       server_plan_memory, worst_deviations)
    from bench.models import converted
    from convert import int8_kernels
    from convert.calibration import default_set
    from convert.card import read_card
    from convert.int8_forms import on_gemm
    from convert.quantize import float_ops, to_int8

    with tempfile.TemporaryDirectory() as folder:
        fp32_path = converted(folder)
        int8 = to_int8(onnx.load(fp32_path), default_set(), allow_precision_loss=True,
                       weights=int8_kernels.weights_for("auto"))
        int8_path = f"{folder}/default-int8.onnx"
        onnx.save(int8, int8_path)
        rows = int8_speed_rows(fp32_path, int8_path)
        served = served_rates({"fp32": fp32_path, "int8": int8_path})
        plans, warnings = server_plan_memory(int8_path)
    memory = [("efficientnet-lite0 int8", plan) for plan in plans]
    worst = max(worst_deviations(memory))
    memory_verdict = "met" if worst <= MEMORY_BOUND else "NOT met"
    served_ratio = max(served["int8"]) / max(served["fp32"])
    record = read_card(int8).quantization
    verdict = "met" if min(row.speed_up for row in rows) >= INT8_SPEED_TARGET else "NOT met"
    served_verdict = "met" if served_ratio >= SERVED_TARGET else "NOT met"
    kernels = ("onnxruntime's uint8 x int8 kernels sum each two neighbouring products in 16 bits here (no VNNI or AMX): "
               "the weights are pair-bounded, so they cannot saturate" if int8_kernels.pair_sums_saturate() else
               "onnxruntime's uint8 x int8 kernels sum in 32 bits here (VNNI or AMX; measured by convert.int8_kernels' "
               f"probe): the weights are full 8-bit; {on_gemm(int8)} 1x1 convolutions run on the int8 GEMM"
               f"{' (AMX tiles)' if int8_kernels.gemm_on_amx() else ''}, the others on the symmetric convolution")
    checks = [(name, getattr(record, name)) for name in ("calibration", "held_out")]
    return "\n".join([
        f"## int8 against fp32 on the CPU (bench_int8; target >= {INT8_SPEED_TARGET:g}x, {verdict})",
        "",
        f"CPU integer extensions: {int8_kernels.instructions()} ({kernels}). Ops left in float: "
        f"{', '.join(float_ops(int8)) or 'none'}.",
        "",
        f"| plan (batch x canvas, 1 pass) | speed-up: median of {INT8_ROUNDS} pairs (quartiles) | fp32 ms (fastest) | "
        "int8 ms (fastest) | fastest over fastest |",
        "|---|---|---|---|---|",
        *[f"| {row.shape} | {row.speed_up:.2f}x ({row.quartiles[0]:.2f}-{row.quartiles[1]:.2f}) | "
          f"{1000 * min(row.fp32_seconds):.1f} | {1000 * min(row.int8_seconds):.1f} | "
          f"{min(row.fp32_seconds) / min(row.int8_seconds):.2f}x |" for row in rows],
        "",
        f"Served (bench_server's request: samples/cat.jpg at 384, stride 16 grid, float32 maps; {SERVED_CLIENTS} clients, "
        f"{SERVED_PER_CLIENT} requests each, {SERVED_ROUNDS} rounds alternated, the best of each): fp32 "
        f"{max(served['fp32']):.2f} req/s, int8 {max(served['int8']):.2f} req/s: {served_ratio:.2f}x "
        f"(each round: fp32 {', '.join(f'{rate:.2f}' for rate in served['fp32'])}; int8 "
        f"{', '.join(f'{rate:.2f}' for rate in served['int8'])}); target >= {SERVED_TARGET:g}x: {served_verdict}.",
        "",
        f"Agreement with fp32 ({int8_kernels.describe(record.weights)} weights, {record.method} calibration (the best of "
        f"{', '.join(trial.method for trial in record.trials)}) on {len(record.calibration_images)} photos; held out: "
        f"{', '.join(record.held_out_images)}; each at sides {list(record.held_out.sides)}):",
        "",
        "| photos | cells' top-1 agreement | images' top-1 | map correlation min / mean | probability diff max / mean |",
        "|---|---|---|---|---|",
        *[f"| {name.replace('_', ' ')} ({check.images}) | {check.top1_agreement:.1%} | {check.image_top1_agreement:.0%} | "
          f"{check.map_correlation:.3f} / {check.mean_map_correlation:.3f} | {check.max_probability_diff:.3f} / "
          f"{check.mean_probability_diff:.2g} |" for name, check in checks],
        "",
        "Kept in float: " + ("; ".join(record.float_layers) or "nothing") + ".",
        "",
        f"Memory of the int8 plans, admission's account against the server process as bench_cpu_plans measures the fp32 "
        f"ones (target +-{MEMORY_BOUND:.0%}, {memory_verdict}: worst {worst:.1%}); server warnings: {len(warnings)}"
        + (f" (first: `{warnings[0]}`)" if warnings else "") + ":",
        "",
        *memory_table(memory),
        "",
        f"Worst layer: {record.worst_layer}. {record.warning}",
    ])
