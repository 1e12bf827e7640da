"""Memory: predicted vs measured, and a server's host memory idle and under load.

* `run()` (`make bench`): fp16 against fp32 bytes for the default model and a VGG16-style dense
  model; a default server idle after its warm-up and at the peak of 16 clients sending photos at its
  default scale (`soak` with LOAD_*); and the host-memory soak: a real server's RSS and PSS before
  (every path warmed), at the peak of and after a burst of large requests from 8 clients (`soak`,
  SOAK_SECONDS long). The CPU prediction against the server's own process is bench_cpu_plans'.
* `gpu_section()` (`make bench-gpu`, bench/bench_gpu.py): the same models on the CUDA provider,
  every term of convert.memory_model predicted and measured.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import onnx
import onnxruntime
from onnx import TensorProto, helper, numpy_helper

from convert import convert_classifier
from convert.memory_model import Device
from convert.precision import fp16_graph
from convert.profile import profile_model
from server.memory.runtime import cuda_used_bytes, measure_peak

# The acceptance bound on predicted / measured.
BOUND = 0.25
# The soak: how long the burst lasts (`make bench`; tests pass a few seconds), how many clients,
# the image sizes (height, width) they send in turn, as JPEG, and the scales each request asks for
# (at stride 16 with flip: 8 passes per scale).
SOAK_SECONDS = 300
SOAK_CLIENTS = 8
SOAK_SHAPES = ((2432, 640), (1536, 2048), (3000, 4000), (480, 640))
SOAK_SCALES = (384, 768)
# Idle time before reading the resident set before and after the burst; the RSS sampling period.
SOAK_IDLE_SECONDS = 5.0
SOAK_SAMPLE_SECONDS = 0.1
# PSS is read once in this many samples: the kernel walks the server's page tables for it (smaps_rollup), and at
# every sample that took a fifth of the 8-client soak's requests (58 against 72-77 in 133 s, the same server).
PSS_SAMPLE_EVERY = 10
SERVER_START_SECONDS = 300
# Idle after the default warm-up, and under load: 16 clients sending a 640x480 photo at the default model's default
# scale (stride and everything else the request's defaults) for LOAD_SECONDS (the targets: idle PSS <= 350 MiB,
# the load's peak <= 1.5x idle).
LOAD_CLIENTS = 16
LOAD_SHAPES = ((480, 640),)
LOAD_SECONDS = 60
IDLE_TARGET_MIB = 350
LOAD_PEAK_TARGET = 1.5
SOAK_IDLE_TARGET_MIB = 700
# The CUDA measurements the memory model was fitted on: (side, batch) per model, as in convert.memory_model.CUDA_MEASUREMENTS.
GPU_CASES = {"default": ((224, 1), (384, 1), (384, 8), (1024, 1), (1024, 4)),
             "vgg16": ((224, 1), (384, 1), (384, 4), (768, 1))}
VGG16_LAYOUT = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


def vgg16_dense() -> onnx.ModelProto:
    """VGG16 (config D) with its FC head as 7x7 and 1x1 convolutions, He-initialised random weights."""
    rng = np.random.default_rng(0)
    nodes, weights = [], []

    def conv(name: str, source: str, shape: tuple[int, ...], pads: int) -> str:
        scale = np.float32(math.sqrt(2 / math.prod(shape[1:])))
        weights.append(numpy_helper.from_array(rng.standard_normal(shape, dtype=np.float32) * scale, f"{name}_w"))
        weights.append(numpy_helper.from_array(np.zeros(shape[0], np.float32), f"{name}_b"))
        nodes.append(helper.make_node("Conv", [source, f"{name}_w", f"{name}_b"], [name], pads=[pads] * 4, name=name))
        return name

    x, channels = "image", 3
    for index, width in enumerate(VGG16_LAYOUT):
        if width == "M":
            nodes.append(helper.make_node("MaxPool", [x], [f"pool{index}"], kernel_shape=[2, 2], strides=[2, 2], name=f"pool{index}"))
            x = f"pool{index}"
            continue
        x = conv(f"conv{index}", x, (width, channels, 3, 3), 1)
        nodes.append(helper.make_node("Relu", [x], [f"{x}_relu"], name=f"{x}_relu"))
        x, channels = f"{x}_relu", width
    for name, shape in (("fc6", (4096, 512, 7, 7)), ("fc7", (4096, 4096, 1, 1))):
        x = conv(name, x, shape, 0)
        nodes.append(helper.make_node("Relu", [x], [f"{x}_relu"], name=f"{x}_relu"))
        x = f"{x}_relu"
    conv("fc8", x, (1000, 4096, 1, 1), 0)
    nodes[-1].output[0] = "scores"
    graph = helper.make_graph(nodes, "vgg16_dense", [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, "H", "W"])],
                              [helper.make_tensor_value_info("scores", TensorProto.FLOAT, None)], weights)
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])


def _mib(value: float) -> str:
    return f"{value / 2**20:,.1f}"


# --- host memory of a real server ------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Soak:
    """A server's resident set (and proportional set: PSS, /proc/PID/smaps_rollup) around a burst of requests, bytes.

    `serving_*`: idle once SERVING (after its warm-up), before any request; `before_*`: idle after each image was
    sent once (every path the burst takes warmed); then the burst's peak, and idle after it."""

    before_bytes: int
    peak_bytes: int
    after_bytes: int
    requests: int
    errors: dict[str, int]
    seconds: float
    serving_bytes: int = 0
    serving_pss: int = 0
    before_pss: int = 0
    peak_pss: int = 0
    after_pss: int = 0


def rss_bytes(pid: int) -> int:
    """The process's resident set, bytes."""
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _pss(pid: int) -> int:
    """The process's proportional set size: its own pages, and its share of those it maps with others."""
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        return next(int(line.split()[1]) * 1024 for line in rollup if line.startswith("Pss:"))


def soak_images(shapes=SOAK_SHAPES) -> list[bytes]:
    """JPEG photos-to-be of each size: smooth gradients with noise, so they compress like photos."""
    from PIL import Image

    rng = np.random.default_rng(0)
    images = []
    for height, width in shapes:
        rows = np.linspace(0, 255, height, dtype=np.float32)[:, None, None]
        cols = np.linspace(0, 255, width, dtype=np.float32)[None, :, None]
        pixels = (rows * [1, 0.5, 0] + cols * [0, 0.5, 1] + rng.normal(0, 8, (height, width, 3))) / 1.5
        buffer = io.BytesIO()
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buffer, format="JPEG", quality=90)
        images.append(buffer.getvalue())
    return images


def _wait_serving(channel, server: subprocess.Popen) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + SERVER_START_SECONDS
    while time.monotonic() < deadline and server.poll() is None:
        try:
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=5, wait_for_ready=True).status
        except Exception:  # noqa: BLE001 - not up yet; the deadline ends the wait
            status = None
        if status == health_pb2.HealthCheckResponse.SERVING:
            return
        time.sleep(0.2)
    raise RuntimeError(f"scoremap-serve did not report SERVING within {SERVER_START_SECONDS} s")


def soak(model_path: str, *, seconds: float = SOAK_SECONDS, clients: int = SOAK_CLIENTS, shapes=SOAK_SHAPES,
         scales=SOAK_SCALES, idle_seconds: float = SOAK_IDLE_SECONDS, server_args: tuple[str, ...] = (),
         stride: int | None = 16, flip: bool = True) -> Soak:
    """Start `scoremap-serve` on `model_path` (its defaults, but requests may wait in its queue as
    long as the burst lasts: the soak measures memory, not load shedding), send each image once,
    then `clients` callers sending them in turn for `seconds`; the server's RSS and PSS when idle once
    serving, idle before, its peak during, and when idle after. `stride` None: requests at their
    defaults but for `scales`."""
    import grpc

    from protos import scoring_pb2, scoring_pb2_grpc

    images = soak_images(shapes)
    patience_ms = str(int(1000 * max(60.0, 2 * seconds)))
    command = [sys.executable, "-m", "server.main", model_path, "--port", "0", "--max-queue-ms", patience_ms,
               *server_args]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = server.stdout.readline()
        if "listening on" not in line:
            raise RuntimeError(f"scoremap-serve did not start: {line!r} (exit status {server.poll()})")
        address = line.rsplit(" ", 1)[1].strip()
        channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 256 << 20),
                                                          ("grpc.max_send_message_length", 256 << 20)])
        stub = scoring_pb2_grpc.DenseScoringStub(channel)
        _wait_serving(channel, server)
        time.sleep(idle_seconds)
        serving, serving_pss = rss_bytes(server.pid), _pss(server.pid)

        def request(data: bytes) -> scoring_pb2.ScoreRequest:
            if stride is None:
                return scoring_pb2.ScoreRequest(encoded=data, scales=list(scales))
            return scoring_pb2.ScoreRequest(encoded=data, scales=list(scales), output_stride=stride, flip=flip)

        for data in images:  # every plan made and every path warm before "before"
            stub.Score(request(data), timeout=SERVER_START_SECONDS, wait_for_ready=True)
        time.sleep(idle_seconds)
        before, before_pss = rss_bytes(server.pid), _pss(server.pid)
        peak = [before, before_pss]
        done = threading.Event()
        counts: dict[str, int] = {}
        lock = threading.Lock()

        def sample() -> None:
            rounds = 0
            while not done.wait(SOAK_SAMPLE_SECONDS):
                peak[0] = max(peak[0], rss_bytes(server.pid))
                rounds += 1
                if rounds % PSS_SAMPLE_EVERY == 0:
                    peak[1] = max(peak[1], _pss(server.pid))

        def client(offset: int) -> None:
            index = offset
            while not done.is_set():
                try:
                    stub.Score(request(images[index % len(images)]), timeout=max(60.0, seconds))
                    code = "OK"
                except grpc.RpcError as error:
                    code = error.code().name
                with lock:
                    counts[code] = counts.get(code, 0) + 1
                index += 1

        threads = [threading.Thread(target=sample)] + [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        time.sleep(seconds)
        done.set()
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - started
        channel.close()
        time.sleep(idle_seconds)
        after, after_pss = rss_bytes(server.pid), _pss(server.pid)
    finally:
        server.terminate()
        server.wait(30)
    errors = {code: count for code, count in counts.items() if code != "OK"}
    return Soak(before, max(peak[0], after), after, sum(counts.values()), errors, elapsed, serving, serving_pss,
                before_pss, max(peak[1], after_pss), after_pss)


def load_section(model_path: str, *, seconds: float = LOAD_SECONDS) -> str:
    result = soak(model_path, seconds=seconds, clients=LOAD_CLIENTS, shapes=LOAD_SHAPES, scales=(), stride=None)
    idle, peak = result.serving_pss, result.peak_pss
    ratio = peak / idle
    verdicts = (f"idle PSS {'met' if idle <= IDLE_TARGET_MIB * 2**20 else 'NOT met'} (target <= {IDLE_TARGET_MIB} MiB), "
                f"peak {'met' if ratio <= LOAD_PEAK_TARGET else 'NOT met'} (target <= {LOAD_PEAK_TARGET:g}x idle)")
    sizes = ", ".join(f"{w}x{h}" for h, w in LOAD_SHAPES)
    return "\n".join([
        "### Idle after the default warm-up, and under load",
        "",
        f"`scoremap-serve` (default model, its default settings: on the CPU --max-batch 1, the default canvas buckets, "
        f"the warm-up's 10 plans), idle {SOAK_IDLE_SECONDS:g} s once SERVING; then {LOAD_CLIENTS} clients sending a "
        f"{sizes} JPEG with every request field at its default for {result.seconds:.0f} s ({result.requests} "
        f"requests, errors {result.errors or 'none'}). Process memory, MiB: {verdicts}.",
        "",
        "| | idle once serving | peak under load | after idle | peak / idle |",
        "|---|---|---|---|---|",
        f"| PSS | {_mib(idle)} | {_mib(peak)} | {_mib(result.after_pss)} | {ratio:.2f} |",
        f"| RSS | {_mib(result.serving_bytes)} | {_mib(result.peak_bytes)} | {_mib(result.after_bytes)} | "
        f"{result.peak_bytes / result.serving_bytes:.2f} |",
    ])


def soak_section(model_path: str, *, seconds: float = SOAK_SECONDS) -> str:
    result = soak(model_path, seconds=seconds)
    sizes = ", ".join(f"{h}x{w}" for h, w in SOAK_SHAPES)
    verdict = "met" if result.before_pss <= SOAK_IDLE_TARGET_MIB * 2**20 else "NOT met"
    return "\n".join([
        "### Host memory under load (soak)",
        "",
        f"`scoremap-serve` (default model, its default settings), {SOAK_CLIENTS} clients for {result.seconds:.0f} s, "
        f"each sending JPEGs of {sizes} in turn at scales {list(SOAK_SCALES)}, stride 16, flip; "
        f"{result.requests} requests, errors {result.errors or 'none'}. Resident set (and PSS) of the server process, "
        f"idle {SOAK_IDLE_SECONDS:g} s before (every path warmed: idle PSS {verdict}, target <= {SOAK_IDLE_TARGET_MIB} "
        "MiB) and after:",
        "",
        "| | before | peak | after idle | after / before |",
        "|---|---|---|---|---|",
        f"| RSS | {_mib(result.before_bytes)} MiB | {_mib(result.peak_bytes)} MiB | {_mib(result.after_bytes)} MiB | "
        f"{result.after_bytes / result.before_bytes:.2f} |",
        f"| PSS | {_mib(result.before_pss)} MiB | {_mib(result.peak_pss)} MiB | {_mib(result.after_pss)} MiB | "
        f"{result.after_pss / result.before_pss:.2f} |",
    ])


# --- the CUDA provider ------------------------------------------------------------------------

def gpu_section(cases: dict[str, tuple[tuple[int, int], ...]] = GPU_CASES, *, default_model: str | None = None) -> str:
    """Every term of the CUDA memory model, predicted and measured, for the shapes it was fitted on (`cases`: (side,
    batch) per model, `bench_gpu --quick` measures three); a line saying why not where CUDA does not load (for
    `make bench-gpu`, bench/bench_gpu.py). `default_model`: the default model already converted, if at hand."""
    if cuda_used_bytes() is None or "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        return ("### Memory on the CUDA provider\n\nNot measured: the CUDA provider or the CUDA runtime does not "
                "load on this machine (server.memory.runtime.cuda_used_bytes).")
    rows, ratios = [], []
    with tempfile.TemporaryDirectory() as folder:
        paths = {"default": default_model or str(pathlib.Path(folder) / "default.onnx"),
                 "vgg16": str(pathlib.Path(folder) / "vgg16.onnx")}
        if "default" in cases and default_model is None:
            onnx.save(convert_classifier("default"), paths["default"])
        if "vgg16" in cases:
            onnx.save(vgg16_dense(), paths["vgg16"])
        for name, shapes in cases.items():
            for side, batch in shapes:
                terms = profile_model(paths[name], height=side, width=side, batch=batch, device=Device.CUDA).terms
                measured = measure_peak(paths[name], height=side, width=side, batch=batch, device="cuda")
                session_predicted = terms.weights + terms.session_state
                run_predicted = terms.weight_copies + terms.run_workspace + terms.activations
                run_measured = measured.peak_bytes - measured.session_bytes
                ratio = terms.total / measured.peak_bytes
                ratios.append(ratio)
                rows.append(
                    f"| {name} | {side}x{side} | {batch} | {_mib(session_predicted)} / {_mib(measured.session_bytes)} "
                    f"({session_predicted / max(measured.session_bytes, 1):.2f}) | {_mib(run_predicted)} / {_mib(run_measured)} "
                    f"({run_predicted / max(run_measured, 1):.2f}) | {_mib(terms.total)} / {_mib(measured.peak_bytes)} | "
                    f"{ratio:.3f} |")
    worst = max(abs(ratio - 1) for ratio in ratios)
    return "\n".join([
        "### Memory on the CUDA provider (convert.memory_model)",
        "",
        f"Predicted / measured device memory (cudaMemGetInfo over the process's baseline, "
        f"server.memory.runtime.measure_peak); worst deviation {worst:.1%} "
        f"({'met' if worst <= BOUND else 'NOT met'}, target {BOUND:.0%}). Session = weights + per-session state "
        "(measured after creating the session); runs = weight copies + workspace + activation factor x live peak "
        "(measured after the runs, minus the session). MiB, predicted / measured (ratio).",
        "",
        "| model | input | batch | session | runs | total | predicted/measured |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ])


def run() -> str:
    with tempfile.TemporaryDirectory() as folder:
        paths = {
            "efficientnet-lite0 (default, dense)": str(pathlib.Path(folder) / "default.onnx"),
            "VGG16 dense (FC head as convs)": str(pathlib.Path(folder) / "vgg16.onnx"),
        }
        default_path, vgg_path = paths.values()
        onnx.save(convert_classifier("default"), default_path)
        onnx.save(vgg16_dense(), vgg_path)

        precision_rows = []
        for label, path in paths.items():
            half = fp16_graph(onnx.load(path))
            for size in (224, 512):
                full_profile = profile_model(path, height=size, width=size)
                half_profile = profile_model(half, height=size, width=size)
                precision_rows.append(
                    f"| {label} | {size}x{size} | {_mib(full_profile.weights_bytes)} | {_mib(half_profile.weights_bytes)} | "
                    f"{half_profile.weights_bytes / full_profile.weights_bytes:.3f} | "
                    f"{_mib(full_profile.peak_activation_bytes)} | {_mib(half_profile.peak_activation_bytes)} | "
                    f"{half_profile.peak_activation_bytes / full_profile.peak_activation_bytes:.3f} |"
                )
        load = load_section(default_path)
        soak = soak_section(default_path)

    return "\n".join([
        "## Memory: fp16 bytes and a server's host memory idle and under load",
        "",
        "The CPU prediction against the server's own process, and the CPU configuration's speed, are in "
        "bench_cpu_plans; the CUDA terms in bench_gpu.",
        "",
        "### fp16 vs fp32 (batch 1, predicted)",
        "",
        "| model | input | fp32 weights | fp16 weights | ratio | fp32 live peak | fp16 live peak | ratio |",
        "|---|---|---|---|---|---|---|---|",
        *precision_rows,
        "",
        "fp16 activations keep the float32 input and its fp16 copy at the graph's edge, hence a ratio a little above 0.5. "
        "On the CPU provider fp16 graphs run through float32 kernels (inserted casts); fp16 is for GPUs.",
        "",
        load,
        "",
        soak,
    ])
