"""The host's cost per request, with a null model: what the server adds to decoding and resizing.

A request's host path is decode, resize, stack onto a canvas, queue and assemble the response: its
wall time less the plan's run (`timings.inference_ms`, the device's share; on the CPU provider
even the null model's 224-px average pool takes a few ms there). With a model that does next to
nothing (bench/models.py: a converted stride-32 average-pool head), compared with PIL alone
decoding and resizing the same image, alternated call by call so the shared machine's load hits
both alike, each side's fastest call taken as its undisturbed cost (medians shown too); target
(issue 9, item 5): host path <= 1.5x decode + resize.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pathlib
import statistics
import tempfile
import time

from PIL import Image, ImageOps

from bench.models import null_model
from protos import scoring_pb2
from server.dense import resized_size
from server.pipeline import Pipeline
from server.settings import Settings

ROOT = pathlib.Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "samples" / "cat.jpg"
SCALE = 384
CALLS = 60
TARGET = 1.5
HOST_COLUMN = "host path, fastest ms (wall - run)"  # one request's host work, on one core: bench.sizing reads it
CASES = {  # what each timed request asks for
    "stride 32, top-5": dict(output_stride=0),
    "stride 16 grid, float32 maps": dict(output_stride=16, shift=scoring_pb2.SHIFT_GRID, return_maps=True),
}


def decode_and_resize(data: bytes) -> Image.Image:
    """What any server of this image must do: decode (upright, RGB) and resize to the scale."""
    image = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
    height, width = resized_size(image.height, image.width, scale=SCALE, multiple=32)
    return image.resize((width, height), Image.Resampling.BILINEAR)


STAGES = ("preprocess_ms", "queue_ms", "inference_ms", "postprocess_ms")


def measure(model: str, *, calls: int = CALLS) -> tuple[list[float], dict[str, list[float]], dict[str, list]]:
    """Seconds per call, alternated: (decode + resize, {case: pipeline.score}, {case: the responses' timings})."""
    data = SAMPLE.read_bytes()
    requests = {case: scoring_pb2.ScoreRequest(encoded=data, scales=[SCALE], **fields) for case, fields in CASES.items()}
    pipeline = Pipeline([model], settings=dataclasses.replace(Settings(), warm_up_scales=(SCALE,)))
    baseline: list[float] = []
    host: dict[str, list[float]] = {case: [] for case in CASES}
    stages: dict[str, list] = {case: [] for case in CASES}
    try:
        for request in requests.values():
            pipeline.score(request)  # every plan made before timing
        for _ in range(calls):
            started = time.perf_counter()
            decode_and_resize(data)
            baseline.append(time.perf_counter() - started)
            for case, request in requests.items():
                started = time.perf_counter()
                stages[case].append(pipeline.score(request).timings)
                host[case].append(time.perf_counter() - started)
    finally:
        pipeline.close()
    return baseline, host, stages


def run() -> str:
    with tempfile.TemporaryDirectory() as folder:
        baseline, host, stages = measure(null_model(folder))
    reference = min(baseline)
    rows, ratios = [], {}
    for case, times in host.items():
        path = [wall - timings.inference_ms / 1000 for wall, timings in zip(times, stages[case])]
        ratios[case] = min(path) / reference
        split = " | ".join(f"{statistics.median(getattr(t, stage) for t in stages[case]):.2f}" for stage in STAGES)
        rows.append(f"| {case} | {1000 * statistics.median(times):.2f} | {1000 * min(path):.2f} | "
                    f"{ratios[case]:.2f}x | {split} |")
    first = ratios[next(iter(CASES))]
    verdict = "met" if first <= TARGET else "missed"
    return "\n".join([
        "## Host cost per request (bench_host)",
        "",
        f"Null model (a converted stride-32 average-pool head, 1000 classes), samples/cat.jpg at scale {SCALE}, "
        f"in-process Pipeline.score, one client, {CALLS} calls alternated with PIL decode + resize of the same "
        f"image: fastest {1000 * reference:.2f} ms (median {1000 * statistics.median(baseline):.2f} ms). "
        f"Load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores.",
        "",
        f"| request | median ms (wall) | {HOST_COLUMN} | host path / decode+resize | "
        + " | ".join(stage.replace("_ms", "") for stage in STAGES) + " (median ms, the response's timings) |",
        "|---|---|---|---|" + "---|" * len(STAGES),
        *rows,
        "",
        f"Target: host path <= {TARGET}x decode + resize (stride 32, top-5): {first:.2f}x, {verdict}.",
    ])


if __name__ == "__main__":
    print(run())
