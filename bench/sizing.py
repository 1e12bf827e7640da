"""`python -m bench.sizing --images 10M --hours 8`: how many cores, GPUs, Triton instances or Ray actors a job needs.

The rates are the ones measured in bench/RESULTS.md (one definition: this reads them, it never
restates them), divided by the cores (CPU routes) of the machine line under each section, or
taken per GPU; the memory per plan is `convert.profile`'s prediction for the model asked, the
same numbers `scoremap-inspect` prints and `scoremap-export triton` sizes `max_batch_size` with.
A route not measured yet (the GPU one before `make bench-gpu` has run on a GPU) says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import re
import sys
from collections.abc import Sequence

import onnx

from bench.__main__ import HERE, read_sections
from bench.bench_host import HOST_COLUMN
from convert.arguments import memory_size, number_in
from convert.card import read_card
from convert.memory_model import Device
from convert.profile import profile_model
from convert.triton_export import DEFAULT_GPU_MEMORY, canvas, plan

DEFAULT_MODEL = HERE.parent / "models" / "default.onnx"
GRID_PASSES = 4  # stride 16 from a stride-32 model: the 4 shifted passes of SHIFT_GRID
COUNT_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9}
MIN_HOURS = 0.001  # the shortest deadline --hours takes (3.6 s): 0 or less has no answer


@dataclasses.dataclass(frozen=True)
class Rate:
    """A measured route: requests (images) per second of one unit (a CPU core or a GPU)."""

    route: str
    per_unit: float
    unit: str
    source: str


def tables(section: str) -> list[list[dict[str, str]]]:
    """The Markdown tables of a section, each as rows of {column: cell}."""
    found, header = [], None
    for line in section.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            found.append([])
        elif not set("".join(cells)) <= set("-: "):
            found[-1].append(dict(zip(header, cells)))
    return found


def cores(section: str) -> int:
    match = re.search(r"Machine: [^,]*, (\d+) cores", section)
    if not match:
        raise ValueError("the section has no 'Machine: DATE, N cores' line; run its benchmark again (make bench)")
    return int(match.group(1))


def rates(sections: dict[str, str]) -> list[Rate]:
    """Every route bench/RESULTS.md has numbers for."""
    found = []
    if "bench_host" in sections:
        section = sections["bench_host"]
        for row in tables(section)[0]:
            found.append(Rate(f"host path, the most a core feeds a GPU (null model): {row['request']}",
                              1000 / float(row[HOST_COLUMN]), "core", "bench_host fastest host path"))
    if "bench_server" in sections:
        section = sections["bench_server"]
        best = max(float(value) for row in tables(section)[0] for column, value in row.items() if "req/s" in column)
        found.append(Rate("CPU gRPC, EfficientNet-Lite0 at 384: stride 16 grid, float32 maps", best / cores(section),
                          "core",
                          "bench_server best level"))
    if "bench_gpu" in sections:  # a closed-loop table per scheme and batching mode: the best gRPC level of each scheme
        best: dict[str, float] = {}
        for table in tables(sections["bench_gpu"]):
            for row in table:
                if "req/s" in row and row.get("path") == "gRPC":
                    best[row["scheme"]] = max(best.get(row["scheme"], 0.0), float(row["req/s"]))
        found += [Rate(f"GPU gRPC: {scheme}", rate, "GPU", "bench_gpu best level") for scheme, rate in best.items()]
    return found


def units_needed(images: int, hours: float, per_unit: float) -> int:
    """Units (cores, GPUs) that score `images` within `hours` at `per_unit` images/s each."""
    return math.ceil(images / (hours * 3600 * per_unit))


def parse_count(text: str) -> int:
    """ "10M" -> 10_000_000; K, M, B suffixes."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMB]?)", text.strip().upper())
    count = int(float(match.group(1)) * COUNT_SUFFIXES[match.group(2)]) if match else 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected a count of at least 1, such as 250000, 500K, 10M "
                                         "or 1.5B")
    return count


def memory_rows(model_path: str, *, scale: int, gpu_memory_bytes: int) -> list[str]:
    """Predicted peak per plan (canvas, passes x batch) on each device, and the batch a GPU's memory fits."""
    model = onnx.load(model_path)
    settings = plan(model, gpu_memory_bytes=gpu_memory_bytes, scales=[scale])
    height, width = canvas(scale, read_card(model).size_multiple)
    rows = []
    for label, batch in (("stride 32, batch 1", 1), (f"stride 16 grid ({GRID_PASSES} passes), batch 1", GRID_PASSES),
                         (f"stride 32, batch {settings.max_batch_size} (Triton max_batch_size)",
                          settings.max_batch_size)):
        cpu = profile_model(model, height=height, width=width, batch=batch, device=Device.CPU)
        gpu = profile_model(model, height=height, width=width, batch=batch, device=Device.CUDA)
        rows.append(f"| {height}x{width} | {label} | {cpu.predicted_peak_bytes / 2**20:,.0f} | "
                    f"{gpu.predicted_peak_bytes / 2**20:,.0f} |")
    return rows


def report(sections: dict[str, str], *, images: int, hours: float, model: str | None, scale: int,
           gpu_memory_bytes: int) -> str:
    lines = [f"Throughput per unit (bench/RESULTS.md) and units for {images:,} images in {hours:g} h:", "",
             "| route | images/s per unit | unit | units needed (Ray actors / Triton instances) | from |",
             "|---|---|---|---|---|"]
    found = rates(sections)
    for rate in found:
        lines.append(f"| {rate.route} | {rate.per_unit:.2f} | {rate.unit} | "
                     f"{units_needed(images, hours, rate.per_unit):,} | {rate.source} |")
    if not any(rate.unit == "GPU" for rate in found):
        lines.append("| GPU | not measured yet | GPU | - | run `make bench-gpu` on a GPU |")
    if model:
        lines += ["", f"Predicted peak memory per plan, {pathlib.Path(model).name} at scale {scale} "
                      f"(landscape canvas; batch sized for {gpu_memory_bytes / 2**30:g} GiB of GPU memory):", "",
                  "| canvas | plan | CPU MiB | GPU MiB |", "|---|---|---|---|",
                  *memory_rows(model, scale=scale, gpu_memory_bytes=gpu_memory_bytes)]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sizing", description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=parse_count, required=True, help="images in the job, e.g. 10M")
    parser.add_argument("--hours", type=number_in(float, MIN_HOURS), required=True, help="the deadline")
    parser.add_argument("--model", default=str(DEFAULT_MODEL) if DEFAULT_MODEL.exists() else None,
                        help="a converted model, for the memory per plan (default: models/default.onnx if present)")
    parser.add_argument("--scale", type=number_in(int, 1), default=384,
                        help="the scale (shorter side) of the memory rows")
    parser.add_argument("--gpu-memory", type=memory_size, default=DEFAULT_GPU_MEMORY,
                        help="the GPU the batch is sized for")
    parser.add_argument("--results", type=pathlib.Path, default=HERE / "RESULTS.md")
    args = parser.parse_args(argv)
    sys.stdout.write(report(read_sections(args.results), images=args.images, hours=args.hours, model=args.model,
                            scale=args.scale, gpu_memory_bytes=args.gpu_memory) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
