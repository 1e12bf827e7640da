"""Memory: predicted vs measured, and a server's host memory under load (issues 3 and 14).

* `run()` (`make bench`): for the default model and a VGG16-style dense model at 224/384/512 px,
  batch 1 and 4, convert.profile's CPU prediction against the peak onnxruntime really used
  (convert.runtime_memory: a clean child with the server's session options and allocator
  configuration), fp16 against fp32 bytes, what the predictable options and the allocator
  configuration cost in speed, and the host-memory soak: a real server's RSS before, at the peak
  of and after a burst of large requests from 8 clients (`soak`, SOAK_SECONDS long).
* `gpu_section()` (`make bench-gpu`, bench/bench_gpu.py): the same models on the CUDA provider,
  every term of convert.memory_model predicted and measured.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import pathlib
import statistics
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
from convert.runtime_memory import cuda_used_bytes, measure_peak, predictable_session_options

SIZES = (224, 384, 512)
BATCHES = (1, 4)
# The acceptance bound on predicted / measured.
BOUND = 0.25
# Timed runs per configuration in the speed comparison (median reported).
SPEED_RUNS = 5
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
SERVER_START_SECONDS = 300
# The CUDA measurements of issue 14: (side, batch) per model, as in convert.memory_model.CUDA_MEASUREMENTS.
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


def _median_run_seconds(path: str, options: onnxruntime.SessionOptions, image: np.ndarray) -> float:
    session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    feed = {session.get_inputs()[0].name: image}
    session.run(None, feed)
    times = []
    for _ in range(SPEED_RUNS):
        start = time.perf_counter()
        session.run(None, feed)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# --- host memory of a real server ------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Soak:
    """A server's resident set around a burst of large requests, in bytes."""

    before_bytes: int
    peak_bytes: int
    after_bytes: int
    requests: int
    errors: dict[str, int]
    seconds: float


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


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
         scales=SOAK_SCALES, idle_seconds: float = SOAK_IDLE_SECONDS, server_args: tuple[str, ...] = ()) -> Soak:
    """Start `scoremap-serve` on `model_path` (its defaults, but requests may wait in its queue as
    long as the burst lasts: the soak measures memory, not load shedding), send each image once,
    then `clients` callers sending them in turn for `seconds`; the server's RSS when idle before,
    its peak during, and when idle after."""
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

        def request(data: bytes) -> scoring_pb2.ScoreRequest:
            return scoring_pb2.ScoreRequest(encoded=data, scales=list(scales), output_stride=16, flip=True)

        for data in images:  # every plan made and every path warm before "before"
            stub.Score(request(data), timeout=SERVER_START_SECONDS, wait_for_ready=True)
        time.sleep(idle_seconds)
        before = _rss(server.pid)
        peak = [before]
        done = threading.Event()
        counts: dict[str, int] = {}
        lock = threading.Lock()

        def sample() -> None:
            while not done.wait(SOAK_SAMPLE_SECONDS):
                peak[0] = max(peak[0], _rss(server.pid))

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
        after = _rss(server.pid)
    finally:
        server.terminate()
        server.wait(30)
    errors = {code: count for code, count in counts.items() if code != "OK"}
    return Soak(before, max(peak[0], after), after, sum(counts.values()), errors, elapsed)


def soak_section(model_path: str, *, seconds: float = SOAK_SECONDS) -> str:
    result = soak(model_path, seconds=seconds)
    sizes = ", ".join(f"{h}x{w}" for h, w in SOAK_SHAPES)
    return "\n".join([
        "### Host memory under load (soak)",
        "",
        f"`scoremap-serve` (default model, its default settings), {SOAK_CLIENTS} clients for {result.seconds:.0f} s, "
        f"each sending JPEGs of {sizes} in turn at scales {list(SOAK_SCALES)}, stride 16, flip; "
        f"{result.requests} requests, errors {result.errors or 'none'}. Resident set of the server process, "
        f"idle {SOAK_IDLE_SECONDS:g} s before and after:",
        "",
        "| before | peak | after idle | after / before |",
        "|---|---|---|---|",
        f"| {_mib(result.before_bytes)} MiB | {_mib(result.peak_bytes)} MiB | {_mib(result.after_bytes)} MiB | "
        f"{result.after_bytes / result.before_bytes:.2f} |",
    ])


def _allocator_run_ms(path: str, *, configured: bool) -> float:
    """Median run time of the default model at 384x384 in a fresh process, glibc configured as the server
    does or left at its defaults."""
    script = (
        "import statistics, sys, time, numpy as np, onnxruntime\n"
        "from convert.runtime_memory import configure_allocator, predictable_session_options\n"
        f"{'configure_allocator()' if configured else ''}\n"
        "session = onnxruntime.InferenceSession(sys.argv[1], predictable_session_options(), providers=['CPUExecutionProvider'])\n"
        "feed = {session.get_inputs()[0].name: np.random.default_rng(0).standard_normal((1, 3, 384, 384), dtype=np.float32)}\n"
        "session.run(None, feed)\n"
        "times = []\n"
        f"for _ in range({SPEED_RUNS}):\n"
        "    start = time.perf_counter(); session.run(None, feed); times.append(time.perf_counter() - start)\n"
        "print(1000 * statistics.median(times))\n"
    )
    done = subprocess.run([sys.executable, "-c", script, path], capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


# --- the CUDA provider ------------------------------------------------------------------------

def gpu_section() -> str:
    """Every term of the CUDA memory model, predicted and measured, for the issue-14 shapes; a line
    saying why not where CUDA does not load (for `make bench-gpu`, bench/bench_gpu.py)."""
    if cuda_used_bytes() is None or "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        return ("### Memory on the CUDA provider\n\nNot measured: the CUDA provider or the CUDA runtime does not "
                "load on this machine (convert.runtime_memory.cuda_used_bytes).")
    rows, ratios = [], []
    with tempfile.TemporaryDirectory() as folder:
        paths = {"default": str(pathlib.Path(folder) / "default.onnx"), "vgg16": str(pathlib.Path(folder) / "vgg16.onnx")}
        onnx.save(convert_classifier("default"), paths["default"])
        onnx.save(vgg16_dense(), paths["vgg16"])
        for name, cases in GPU_CASES.items():
            for side, batch in cases:
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
        f"convert.runtime_memory.measure_peak); worst deviation {worst:.1%} "
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

        rows, ratios = [], []
        for label, path in paths.items():
            for size in SIZES:
                for batch in BATCHES:
                    profile = profile_model(path, height=size, width=size, batch=batch)
                    measured = measure_peak(path, height=size, width=size, batch=batch, device="cpu")
                    ratio = profile.predicted_peak_bytes / measured.peak_bytes
                    ratios.append(ratio)
                    saving = 1 - profile.peak_activation_bytes / profile.naive_activation_bytes
                    rows.append(
                        f"| {label} | {size}x{size} | {batch} | {_mib(profile.weights_bytes)} | "
                        f"{_mib(profile.naive_activation_bytes)} | {_mib(profile.peak_activation_bytes)} ({saving:.0%} saved) | "
                        f"{_mib(profile.allowance_bytes)} | {_mib(profile.predicted_peak_bytes)} | "
                        f"{_mib(measured.peak_bytes)} ({measured.device}) | {ratio:.3f} | {_mib(measured.load_peak_bytes)} |"
                    )

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

        image = np.random.default_rng(0).standard_normal((1, 3, 384, 384), dtype=np.float32)
        default_seconds = _median_run_seconds(default_path, onnxruntime.SessionOptions(), image)
        predictable_seconds = _median_run_seconds(default_path, predictable_session_options(), image)
        glibc_ms = _allocator_run_ms(default_path, configured=False)
        configured_ms = _allocator_run_ms(default_path, configured=True)
        soak = soak_section(default_path)

    worst = max(abs(ratio - 1) for ratio in ratios)
    verdict = "met" if worst <= BOUND else "NOT met"
    return "\n".join([
        "## Memory: predicted vs measured peak (issues 3 and 14)",
        "",
        f"Target: predicted / measured within 1 ± {BOUND:g} in every case. Worst deviation: {worst:.1%} ({verdict}); "
        f"ratios {min(ratios):.3f} to {max(ratios):.3f}.",
        "Predicted = weights + live activation peak + allowance (convert.profile with convert.memory_model's CPU terms: "
        "8 MiB run workspace + 0.05 x live peak). Measured (convert.runtime_memory): peak RSS of a clean child "
        "process over its baseline before session creation, in the server's configuration (onnxruntime's memory "
        "pattern for the one shape, no CPU arena, glibc's allocator set by configure_allocator as the server sets it at start), the high-water mark "
        "reset after session creation, whose own transient peak is the last column. MiB throughout.",
        "",
        "| model | input | batch | weights | activations, naive sum | activations, live peak | allowance | predicted | measured | predicted/measured | session-creation peak |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
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
        "### Cost of the predictable session options",
        "",
        f"efficientnet-lite0 dense, 384x384, batch 1, median of {SPEED_RUNS} runs: onnxruntime defaults "
        f"{default_seconds * 1000:.0f} ms, no CPU arena {predictable_seconds * 1000:.0f} ms "
        f"(ratio {predictable_seconds / default_seconds:.2f}). With the arena its fragmentation measured 1.7-2x the "
        "live activations on a VGG-style graph.",
        "",
        f"The allocator configuration (convert.runtime_memory.configure_allocator: a fixed 128 KiB mmap threshold, "
        f"heap top trimmed at once), same model and size, fresh processes: glibc defaults {glibc_ms:.0f} ms, "
        f"configured {configured_ms:.0f} ms (ratio {configured_ms / glibc_ms:.2f}). Under glibc's defaults the "
        "measurement above peaked at 110 MB for 512x512, batch 1 (53 MB configured; issue 14): freed activations "
        "stay in the heap and the next run's come on top.",
        "",
        soak,
    ])
