"""The host's cost per request, with a null model: what the server adds to decoding and resizing.

A request's host path is decode, resize, stack onto a canvas, queue and assemble the response: its
wall time less the plan's run (`timings.inference_ms`, the device's share; on the CPU provider
the plan's own pre- and post-processing run there too). With a model that does next to
nothing (bench/models.py: a converted stride-32 classifier reading one pixel per cell), compared with PIL alone
decoding and resizing the same image, alternated call by call so the shared machine's load hits
both alike, each side's fastest call taken as its undisturbed cost (medians shown too); target:
host path <= 1.5x decode + resize.

Served: `scoremap-serve` with the null model in its own process, closed loops over gRPC; the
server's CPU time per request (every server process counted, /proc), at 16 clients, stride 32 top-5 at 384
(target <= 3 ms; the mean of CPU_PER_REQUEST_LEVELS levels), and batching on against off at 1 and 4 clients
(target >= 0.95x; levels in BATCHING_ORDER, so that a drift in the machine's load hits both alike).

Huge pages: the server as it runs (glibc's mappings on transparent huge pages, server/memory/huge_pages.py) against
the same server told to keep 4 KiB pages (GLIBC_TUNABLES=glibc.malloc.hugetlb=0), both up at once answering blocks of
one client's calls in turn, on cat.jpg and on a 12-megapixel photo shrunk to 768: each one's p50, its decoding
stage's median (the responses' timings) and its resident set after. About 5 minutes on 2 cores in all.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pathlib
import statistics
import tempfile
import time

import numpy as np
from PIL import Image, ImageOps

from bench.bench_memory import rss_bytes
from bench.bench_overload import process_cpu_seconds, start_server
from bench.models import null_model
from clients.loadtest.run import LevelPlan, LoadLimits, closed_loop
from protos import scoring_pb2
from server.geometry.dense import resized_size
from server.scoring.pipeline import Pipeline
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


def decode_and_resize(data: bytes, scale: int = SCALE) -> Image.Image:
    """What any server of this image must do: decode (upright, RGB) and resize to the scale."""
    image = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
    height, width = resized_size(image.height, image.width, scale=scale, multiple=32)
    return image.resize((width, height), Image.Resampling.BILINEAR)


SERVED_SECONDS = 8.0  # each closed-loop level's window
SERVED_CLIENTS = 16
CPU_TARGET_MS = 3.0
BATCHING_CLIENTS = (1, 4)
BATCHING_TARGET = 0.95
BATCHING = {"on": ("--max-batch", "8"), "off": ("--max-batch", "1")}
# A drift in the shared machine's load hits both alike; at 1 client, where both run the same batches of one, a
# single pair of levels read 0.89-1.01x: four levels each.
BATCHING_ORDER = ("on", "off", "off", "on") * 2
CPU_PER_REQUEST_LEVELS = 2
HUGE_PAGES_SECONDS = 30.0  # each photo's blocks of calls, on the two servers in turn
HUGE_PAGES_BLOCK = 5  # calls a server answers in a row (the first, after the other server's, not counted)
STAGES = ("preprocess_ms", "queue_ms", "inference_ms", "postprocess_ms")


def measure(model: str, *, calls: int = CALLS) -> tuple[list[float], dict[str, list[float]], dict[str, list], float]:
    """Seconds per call, alternated: (decode + resize, {case: pipeline.score}, {case: the responses' timings}); then
    the process's CPU seconds per call (every thread counted) of the first case's request, called back to back."""
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
        first = next(iter(requests.values()))
        started = time.process_time()
        for _ in range(calls):
            pipeline.score(first)
        alone = (time.process_time() - started) / calls
    finally:
        pipeline.close()
    return baseline, host, stages, alone


def run() -> str:
    enlarged, as_sent = direct_ratio(SAMPLE.read_bytes()), direct_ratio(as_sent_jpeg())
    with tempfile.TemporaryDirectory() as folder:
        baseline, host, stages, alone = measure(null_model(folder))
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
        f"Null model (a converted stride-32 classifier reading one pixel per cell, 1000 classes), samples/cat.jpg at scale {SCALE}, "
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
        "",
        "A JPEG's decode stage's CPU on the direct path (libjpeg-turbo straight into numpy, OpenCV's bilinear onto "
        "the canvas) against PIL's: cat.jpg enlarged to 384x576 {:.2f} against {:.2f} ms ({:.2f}x); sent "
        "at the size asked for (re-encoded at 384x576) {:.2f} against {:.2f} ms ({:.2f}x).".format(
            *enlarged, enlarged[0] / enlarged[1], *as_sent, as_sent[0] / as_sent[1]),
        "",
        served(alone_ms=1000 * alone),
        "",
        huge_pages(),
    ])


def as_sent_jpeg() -> bytes:
    """cat.jpg re-encoded at the size the scale asks for (384x576): a client that resizes before sending."""
    image = Image.open(SAMPLE).convert("RGB")
    height, width = resized_size(image.height, image.width, scale=SCALE, multiple=32)
    buffer = io.BytesIO()
    image.resize((width, height), Image.Resampling.BILINEAR).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def direct_ratio(data: bytes, *, rounds: int = 200) -> tuple[float, float]:
    """CPU ms of the decode stage (imaging.canvases) for a JPEG at the scale: the direct path (imaging.direct_path)
    and PIL's, alternated round by round."""
    from server.scoring import imaging
    from server.scoring.request import ScaleJob

    opened = imaging.open_image(data, max_pixels=1 << 30)
    height, width = resized_size(opened.height, opened.width, scale=SCALE, multiple=32)
    job = ScaleJob(SCALE, (height, width), (height + 32, width + 32), (1, 1), 1)
    fill = np.full(3, 127, np.uint8)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for direct in (True, False):
            opened = imaging.open_image(data, max_pixels=1 << 30)
            if not direct:
                opened.encoded = None  # PIL's path
            started = time.process_time()
            imaging.canvases(opened, [job], (False,), fill=fill, resize_filter="bilinear")
            times[direct].append(time.process_time() - started)
    return 1000 * statistics.median(times[True]), 1000 * statistics.median(times[False])


def served_level(model: str, flags: tuple[str, ...], clients: int, *, seconds: float,
                 folder: pathlib.Path) -> tuple[float, float]:
    """(req/s, server CPU ms per request) of a closed loop of `clients` over gRPC on its own server, after one
    request (a plan made on first use is not the level's); a failed request fails the level."""
    import grpc

    from protos import scoring_pb2_grpc

    server, address, _metrics = start_server(model, folder / "server.log", flags)
    try:
        request = scoring_pb2.ScoreRequest(encoded=SAMPLE.read_bytes(), scales=[SCALE])
        limits = LoadLimits()
        plan = LevelPlan(duration_s=seconds, max_requests=limits.max_requests, timeout_s=120.0, warmup=clients)
        with grpc.insecure_channel(address) as channel:
            stub = scoring_pb2_grpc.DenseScoringStub(channel)
            stub.Score(request, timeout=120)
            before = process_cpu_seconds(server.pid)
            report = closed_loop(channel, [request], concurrency=clients, plan=plan, limits=limits)
            cpu = process_cpu_seconds(server.pid) - before
    finally:
        server.terminate()
        server.wait(30)
    if report.errors:
        raise RuntimeError(f"{clients} clients, flags {' '.join(flags)}: requests failed: {report.errors}")
    # The CPU window holds the warm-up and the requests in flight at its end too: every request sent counts.
    return report.throughput_rps, 1000 * cpu / max(report.sent, 1)


def served(*, alone_ms: float, seconds: float = SERVED_SECONDS) -> str:
    """The served levels; `alone_ms`, the same request's process CPU in-process, one caller, back to back (no gRPC,
    no other request), is one request's own work: no arrangement of threads or processes lowers it."""
    with tempfile.TemporaryDirectory() as folder:
        model = null_model(folder)
        cpu_levels = [served_level(model, BATCHING["off"], SERVED_CLIENTS, seconds=seconds,
                                   folder=pathlib.Path(folder)) for _ in range(CPU_PER_REQUEST_LEVELS)]
        rate, cpu_ms = (statistics.mean(values) for values in zip(*cpu_levels))
        rows = [f"| CPU per request, {SERVED_CLIENTS} clients, batching off (mean of {CPU_PER_REQUEST_LEVELS} levels: "
                f"{', '.join(f'{level_ms:.2f}' for _, level_ms in cpu_levels)} ms) | {rate:.1f} req/s | "
                f"{cpu_ms:.2f} ms |"]
        ratios = {}
        for clients in BATCHING_CLIENTS:
            levels: dict[str, list[tuple[float, float]]] = {mode: [] for mode in BATCHING}
            for mode in BATCHING_ORDER:
                levels[mode].append(served_level(model, BATCHING[mode], clients, seconds=seconds,
                                                 folder=pathlib.Path(folder)))
            rates = {mode: tuple(statistics.mean(values) for values in zip(*runs)) for mode, runs in levels.items()}
            ratios[clients] = rates["on"][0] / rates["off"][0]
            rows.append(f"| batching on / off, {clients} client{'s' * (clients > 1)} "
                        f"({BATCHING_ORDER.count('on')} levels each) | "
                        f"{rates['on'][0]:.1f} / {rates['off'][0]:.1f} req/s = {ratios[clients]:.3f}x | "
                        f"{rates['on'][1]:.2f} / {rates['off'][1]:.2f} ms |")
    cpu_verdict = "met" if cpu_ms <= CPU_TARGET_MS else "missed"
    batching_verdict = "met" if min(ratios.values()) >= BATCHING_TARGET else "missed"
    return "\n".join([
        "### Served over gRPC",
        "",
        f"`scoremap-serve` with the null model in its own process (CPU provider), samples/cat.jpg at scale {SCALE}, "
        f"stride 32, top-5; closed loops of {seconds:.0f} s from this process, each on a server of its own; server "
        "CPU from /proc (every server process) over every request sent in the level; batching on and off in the "
        f"order {', '.join(BATCHING_ORDER)}, the means of each compared.",
        "",
        "| level | throughput | server CPU per request |",
        "|---|---|---|",
        *rows,
        "",
        f"Targets: server CPU per request <= {CPU_TARGET_MS} ms at {SERVED_CLIENTS} clients: {cpu_ms:.2f} ms, "
        f"{cpu_verdict} (the same request in-process, one caller back to back, no gRPC: {alone_ms:.2f} ms of "
        f"process CPU); batching on >= {BATCHING_TARGET}x off at {' and '.join(map(str, BATCHING_CLIENTS))} "
        f"clients: {', '.join(f'{r:.3f}x' for r in ratios.values())}, {batching_verdict}.",
    ])


def huge_pages() -> str:
    """The server on huge pages (as it runs) against 4 KiB pages, per photo: p50 ms at one client, the decoding
    stage's median ms and the resident set after, MiB; both servers up at once, blocks of calls in turn."""
    import grpc

    from bench.bench_split import photos
    from protos import scoring_pb2_grpc
    from server.memory.huge_pages import TUNABLE

    chosen = {name: each for name, each in photos().items() if not name.startswith("600x512")}
    bare = {key: value for key, value in os.environ.items() if key != "GLIBC_TUNABLES"}
    layouts = {"huge pages": bare, "4 KiB pages": dict(bare, GLIBC_TUNABLES=f"{TUNABLE}=0")}
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        model = null_model(folder)
        for name, (image, scale) in chosen.items():
            servers, stubs = {}, {}
            try:
                for label, environment in layouts.items():
                    server, address, _metrics = start_server(model, pathlib.Path(folder) / f"server-{len(servers)}.log",
                                                             ("--warm-up-scales", str(scale)), environment=environment)
                    servers[label] = server
                    stubs[label] = scoring_pb2_grpc.DenseScoringStub(grpc.insecure_channel(address))
                request = scoring_pb2.ScoreRequest(encoded=image, scales=[scale])
                calls: dict[str, list[tuple[float, float]]] = {label: [] for label in layouts}
                ends = time.monotonic() + HUGE_PAGES_SECONDS
                while time.monotonic() < ends:
                    for label, stub in stubs.items():
                        for call in range(HUGE_PAGES_BLOCK):
                            began = time.perf_counter()
                            decoded = stub.Score(request, timeout=120).timings.preprocess_ms
                            if call:
                                calls[label].append((1000 * (time.perf_counter() - began), decoded))
                resident = {label: rss_bytes(server.pid) / 2**20 for label, server in servers.items()}
            finally:
                for server in servers.values():
                    server.terminate()
                    server.wait(60)
            p50 = {label: statistics.median(wall for wall, _ in each) for label, each in calls.items()}
            decode = {label: statistics.median(stage for _, stage in each) for label, each in calls.items()}
            huge, small = layouts
            rows.append(f"| {name} | {p50[huge]:.2f} / {p50[small]:.2f} ({p50[huge] / p50[small]:.3f}x) | "
                        f"{decode[huge]:.2f} / {decode[small]:.2f} | {resident[huge]:.0f} / {resident[small]:.0f} | "
                        f"{len(calls[huge])} |")
    return "\n".join([
        "### Huge pages for glibc's mappings",
        "",
        "The null model's server as it runs (huge pages) against the same told to keep 4 KiB pages "
        f"(`GLIBC_TUNABLES={TUNABLE}=0`), both up at once, one client's calls in blocks of {HUGE_PAGES_BLOCK} on "
        f"each in turn for {HUGE_PAGES_SECONDS:.0f} s, the first of each block not counted.",
        "",
        "| photo | p50 ms at 1 client, huge / 4 KiB | decoding stage, median ms | resident set after, MiB | calls each |",
        "|---|---|---|---|---|",
        *rows,
    ])


if __name__ == "__main__":
    print(run())
