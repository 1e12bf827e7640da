"""CPU runners (`--cpu-runners N`): a model's batches side by side, each on one onnxruntime thread, against one
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

from bench.bench_host import SCALE, served_level
from convert import convert_classifier

SECONDS = 10.0  # each level's window
CLIENTS = (1, 16)
ORDER = ("one", "cores", "cores", "one")


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
                flags = ("--cpu-runners", str(runners[setting]), "--max-queue-ms", "600000")  # every request answered
                levels[setting].append(served_level(model, flags, clients, seconds=seconds,
                                                    folder=pathlib.Path(folder)))
            (one_rate, one_cpu), (cores_rate, cores_cpu) = (
                tuple(statistics.mean(values) for values in zip(*levels[setting])) for setting in ("one", "cores"))
            rows.append(f"| {clients} client{'s' * (clients > 1)} | {cores_rate:.1f} / {one_rate:.1f} req/s = "
                        f"{cores_rate / one_rate:.2f}x | {cores_cpu:.1f} / {one_cpu:.1f} ms = "
                        f"{cores_cpu / one_cpu:.2f}x |")
    return "\n".join([
        "## CPU runners: batches side by side (bench_runners)",
        "",
        f"`scoremap-serve --cpu-runners {cores}` ({cores} batches at once, each on one onnxruntime thread) against "
        f"`--cpu-runners 1` (one batch at a time on every core): the default model, samples/cat.jpg at scale {SCALE}, "
        f"stride 32, top-5, closed loops of {seconds:.0f} s over gRPC, each level "
        f"on a server of its own, in the order {', '.join(ORDER)} (one: --cpu-runners 1), the means compared.",
        "",
        f"| clients | throughput, {cores} runners / 1 | server CPU per request, {cores} runners / 1 |",
        "|---|---|---|",
        *rows,
    ])


if __name__ == "__main__":
    print(run())
