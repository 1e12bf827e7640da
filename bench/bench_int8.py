"""int8 against fp32 on the CPU: the plans' speed and the agreement on held-out photos (convert.quantize).

The default model converted, then quantized by `to_int8` (MinMax calibration, the default photo set, the fallback's
layers kept in float where the calibration photos fall short, written whatever its check says, so the numbers can
be read); the plan graph of each in sessions made as the server makes
them, runs alternated in one process, the fastest of each (bench_cpu_plans.int8_speed_rows); the check's numbers
from the int8 card, with the layers it kept in float.
Targets: the int8 plan >= 1.8x the fp32 plan's speed at 1x384x576 and 4x384x384.
"""

from __future__ import annotations

import tempfile

import onnx


def run() -> str:
    from bench.bench_cpu_plans import INT8_SPEED_TARGET, cpu_int8_instructions, int8_speed_rows
    from bench.models import converted
    from convert.calibration import default_set
    from convert.card import read_card
    from convert.quantize import float_ops, to_int8

    with tempfile.TemporaryDirectory() as folder:
        fp32_path = converted(folder)
        int8 = to_int8(onnx.load(fp32_path), default_set(), methods=("minmax",), allow_precision_loss=True)
        int8_path = f"{folder}/default-int8.onnx"
        onnx.save(int8, int8_path)
        rows = int8_speed_rows(fp32_path, int8_path)
    record = read_card(int8).quantization
    ratios = [fp32 / quantized for _, fp32, quantized, _, _ in rows]
    verdict = "met" if min(ratios) >= INT8_SPEED_TARGET else "NOT met"
    checks = [(name, getattr(record, name)) for name in ("calibration", "held_out")]
    return "\n".join([
        f"## int8 against fp32 on the CPU (bench_int8; target >= {INT8_SPEED_TARGET:g}x, {verdict})",
        "",
        f"CPU integer extensions: {cpu_int8_instructions()} (onnxruntime's MLAS runs uint8 x int8 on AVX2 with "
        "VPMADDUBSW when no VNNI is offered; the weights are pair-bounded so its 16-bit sums cannot saturate). Ops left "
        "in float: "
        f"{', '.join(float_ops(int8)) or 'none'}.",
        "",
        "| plan (batch x canvas, 1 pass) | fp32 ms (fastest) | int8 ms (fastest) | speed-up | median / fastest: fp32, int8 |",
        "|---|---|---|---|---|",
        *[f"| {shape} | {fp32:.1f} | {quantized:.1f} | {fp32 / quantized:.2f}x | {fp32_spread:.2f}, {int8_spread:.2f} |"
          for shape, fp32, quantized, fp32_spread, int8_spread in rows],
        "",
        f"Agreement with fp32 ({record.method} calibration on {len(record.calibration_images)} photos; held out: "
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
        f"Worst layer: {record.worst_layer}. {record.warning}",
    ])
