"""What onnxruntime really uses, measured, and the process configuration the prediction holds under.

* `configure_allocator()`: glibc's malloc as the server runs it (one heap, a fixed 2 MiB mmap threshold,
  the heap's top trimmed down to 2 MiB at once), so image-sized buffers and the arena's regions are returned to the
  system when freed, and a request's smaller buffers come from the heap (docs/design.md: the allocator). Under
  glibc's defaults the mmap threshold grows to 32 MiB after the first large free, activations then
  come from the heap, fragment it and stay: the default model peaks at 110 MB for 512x512 (the
  prediction, 63 MB, 0.57x of it) and a server's idle RSS ratchets from 1.0 to 6.3 GB. With every buffer
  over 128 KiB mapped and unmapped (glibc's default threshold), a 576x384 photo's request faults in 1,100 fresh
  pages: a third of its CPU. `release_free_memory()` (malloc_trim) gives back what the heaps hold free after a
  large request.
* `measure_footprint()`: what creating and warming up a plan (a session) really costs, in the
  running process: device memory (cudaMemGetInfo) on CUDA, resident set (current, not peak) on both.
* `measure_peak()`: the peak of a bare net's runs, in a clean child configured like the server, the
  check on convert.profile's CUDA terms (`make bench-gpu`); the CPU terms are checked on plans, in
  the server's own process (bench/bench_cpu_plans.py). Nothing the parent allocated or cached is counted:

* CPU: peak resident set (VmHWM in /proc/self/status) during the runs minus the resident set
  before the session was created. The high-water mark is reset after session creation (writing
  5 to /proc/self/clear_refs), so the transient copy of the weights made while loading does not
  count, and the figure is what a served request costs: weights + activations + runtime.
* CUDA (when the provider loads): device memory in use (cudaMemGetInfo through the CUDA runtime
  library) after the runs minus before the session; the CUDA arena keeps what it grew to, and
  grows by what is requested (`arena_extend_strategy=kSameAsRequested`), so that is the peak.

A tiny graph is run before the baseline is read, so that code pages and thread pools the
runtime touches on its first run are part of the baseline, not of the measurement.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import dataclasses
import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from server.memory.activity import HOST_ACTIVITY, HostActivity

if TYPE_CHECKING:  # imported where a session is made: a front process never loads it
    import onnxruntime

__all__ = [
    "MeasurementError",
    "Measurement",
    "select_device",
    "predictable_session_options",
    "first_cpu_run",
    "warm_up_runtime",
    "PREDICTABLE_CUDA_OPTIONS",
    "measure_peak",
    "Footprint",
    "HostActivity",
    "HOST_ACTIVITY",
    "measure_footprint",
    "resident_bytes",
    "cuda_used_bytes",
    "configure_allocator",
    "release_free_memory",
    "MMAP_THRESHOLD_BYTES",
    "RUNS",
    "TIMEOUT_SECONDS",
]

T = TypeVar("T")

# Runs per measurement: the first plans the memory pattern, the second reuses it.
RUNS = 2
# A measurement child that takes longer than this is stopped.
TIMEOUT_SECONDS = 600
# Allocations from this size up get their own mapping, unmapped when freed (setting it also stops
# glibc raising it after large frees): the regions of the onnxruntime arena go back to the system
# when it shrinks (server.memory.arena), and a large image's buffers when its request ends. Smaller
# buffers (a 576x384 photo's decoded, resized and canvas arrays: 0.5-0.9 MiB each) come from the
# heap: 300 page faults per request instead of 1,100 at glibc's default 128 KiB, and 8.3
# against 12 ms of server CPU per request (bench_host served). At 4 MiB a plan of the net in
# tests/server/memory/test_arena.py kept 9 MiB more than at 1-3 MiB.
MMAP_THRESHOLD_BYTES = 2 * 2**20
# Free memory at the heap's top is returned at once, down to TOP_PAD_BYTES (a larger trim threshold left what
# malloc_trim then did not give back in threads' heaps, and plan footprints read wrong: 16 MiB saved 0.7 ms per
# request, tests/server/memory/test_plan_memory.py).
TRIM_THRESHOLD_BYTES = 0
# What the heap keeps at its top when trimmed: as much as its largest block (larger ones are mapped). Without it
# the decoding thread's heap goes back to the system at every request, whose decoded photo and canvas then fault
# in 240 fresh pages (1 MiB): 0.5 ms of its 1.5 ms of CPU, and 3.40 against 2.78 ms per request in-process.
TOP_PAD_BYTES = MMAP_THRESHOLD_BYTES
# One heap for every thread. malloc_trim gives back the top of the main heap only: with glibc's per-thread heaps
# each keeps its 2 MiB top through it, a plan's build finds resident memory to reuse and its footprint reads low
# (1.1 MiB below the weights it added: tests/server/memory/test_plan_memory.py). The same server CPU per request
# with one heap as with glibc's several (bench_host served: 4.21-4.23 against 4.12-4.27 ms, alternated).
ARENAS = 1
# mallopt(3) parameter numbers (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


class MeasurementError(RuntimeError):
    """The child process could not measure (model failed to load or run, no /proc, timeout)."""


@dataclasses.dataclass(frozen=True)
class Measurement:
    device: str
    height: int
    width: int
    batch: int
    peak_bytes: int          # weights + activations + runtime during the runs, over the baseline
    session_bytes: int       # retained after session creation, over the baseline
    load_peak_bytes: int     # transient peak while creating the session (CPU only, else 0)


# CUDA provider options for the same reason: the default arena grows by powers of two.
PREDICTABLE_CUDA_OPTIONS = {"arena_extend_strategy": "kSameAsRequested"}


def predictable_session_options(*, on_gpu: bool = False) -> onnxruntime.SessionOptions:
    """Session options under which convert.profile's prediction holds.

    On the CPU, onnxruntime's own defaults, its memory pattern on, but one arena for the whole process
    (server.memory.arena) instead of one per session. A plan's session only ever sees one shape
    (server/engine/plans.py), so its pattern is one block of the planned activations, taken from the
    shared arena at each run and handed back after it: runs at onnxruntime's default speed
    (bench_cpu_plans), and a plan that does not run holds no activations. Without an arena
    each run maps and faults its activations afresh: 1.1-3.2x slower (docs/design.md). On CUDA both stay
    off: the CUDA terms of convert.memory_model were fitted on H100 runs made without them.
    """
    from server.memory.arena import CPU_ARENA
    import onnxruntime
    options = onnxruntime.SessionOptions()
    options.enable_cpu_mem_arena = not on_gpu
    options.enable_mem_pattern = not on_gpu
    if not on_gpu:
        CPU_ARENA.use_in(options)
    return options


def first_cpu_run(session: onnxruntime.InferenceSession, feeds: dict[str, np.ndarray],
                  runs: onnxruntime.RunOptions | None = None) -> None:
    """A CPU session's first run, after which the shared arena gives back what the run left free.

    onnxruntime records the memory pattern during a session's first run, which allocates buffer by
    buffer; the second run takes the pattern's one block from the arena. The arena extends by regions
    that are never merged, so without handing the first run's regions back it would keep both: a further
    1.4x the live activations on top of the block (server.memory.arena). `runs`: the options
    it runs under (server.engine.providers.Engine.runs)."""
    from server.memory.arena import CPU_ARENA
    session.run(None, feeds, runs)
    CPU_ARENA.shrink()


def select_device(available_providers: list[str], *, cuda_loadable: bool) -> str:
    """'cuda' when the CUDA provider is built in and its libraries load, else 'cpu'."""
    return "cuda" if "CUDAExecutionProvider" in available_providers and cuda_loadable else "cpu"


def _cuda_used_bytes(cudart: ctypes.CDLL) -> int:
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    status = cudart.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total))
    if status != 0:
        raise MeasurementError(f"cudaMemGetInfo failed with CUDA error {status}")
    return total.value - free.value


def cuda_used_bytes() -> int | None:
    """Device memory in use on the current CUDA device (every process's), or None without CUDA."""
    from convert.cuda import runtime
    cudart = runtime()
    return _cuda_used_bytes(cudart) if cudart is not None else None


def resident_bytes() -> int:
    """This process's resident set now (/proc/self/statm), not its peak."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, when this process runs on it (mallopt and malloc_trim are glibc's)."""
    name = ctypes.util.find_library("c")
    try:
        library = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return library if library is not None and hasattr(library, "malloc_trim") else None


def configure_allocator() -> bool:
    """Set glibc's malloc as the memory prediction was validated under; call once at process start, before threads
    allocate (glibc fixes its limit on heaps once more than eight exist).

    False where the C library is not glibc (nothing changed) or refused a setting."""
    libc = _libc()
    if libc is None:
        return False
    accepted = [libc.mallopt(parameter, value) for parameter, value in (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
        (_M_TOP_PAD, TOP_PAD_BYTES), (_M_ARENA_MAX, ARENAS))]
    return all(accepted)


def release_free_memory() -> None:
    """Return the free memory glibc still holds inside its heaps to the system (malloc_trim(0));
    worth it after a large request, a few milliseconds on a large heap."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)




@dataclasses.dataclass(frozen=True)
class Footprint:
    """What building something (a plan: session + warm-up run) left in use, in bytes."""

    host_bytes: int            # resident set after minus before
    device_bytes: int | None   # CUDA memory in use after minus before; None without CUDA
    host_shared: bool = False  # other work (HOST_ACTIVITY) ran meanwhile: host_bytes is not the build's alone

    @property
    def bytes(self) -> int:
        """The figure to account against the budget of the device the plan runs on."""
        return self.device_bytes if self.device_bytes is not None else self.host_bytes


def measure_footprint(build: Callable[[], T], *, on_gpu: bool) -> tuple[T, Footprint]:
    """Run `build` (create a plan and warm it up) and measure what it left in use.

    Both readings are process- (RSS) or device-wide (cudaMemGetInfo): whatever other threads
    allocate meanwhile is counted too, so build plans before serving or one at a time; `host_shared`
    says when work declared in HOST_ACTIVITY ran meanwhile. On the
    CPU the shared arena is shrunk first (server.memory.arena): the reading starts from an arena that
    holds only what running batches hold, so what `build` runs grows it by its own block."""
    from server.memory.arena import CPU_ARENA
    from convert.cuda import runtime
    cudart = runtime() if on_gpu else None
    if on_gpu and cudart is None:
        raise MeasurementError("a GPU footprint was asked but the CUDA runtime library does not load")
    activity_before = HOST_ACTIVITY.mark()  # before the shrink: a run ending after it would leave its block free
    if not on_gpu:
        CPU_ARENA.shrink()  # what other plans' runs left free in the shared arena is not the build's
    release_free_memory()
    host_before = resident_bytes()
    device_before = _cuda_used_bytes(cudart) if cudart is not None else None
    built = build()
    device_after = _cuda_used_bytes(cudart) if cudart is not None else None
    release_free_memory()
    host = max(0, resident_bytes() - host_before)
    activity_after = HOST_ACTIVITY.mark()
    shared = activity_before[0] > 0 or activity_after != activity_before
    device = None if cudart is None else max(0, device_after - device_before)
    return built, Footprint(host_bytes=host, device_bytes=device, host_shared=shared)


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise MeasurementError(f"/proc/self/status has no {field} line; peak RSS needs Linux")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def warm_up_runtime(providers: list) -> None:
    """Run a tiny conv+gemm graph so the runtime's first-run costs (code pages, thread pools, kernel
    registries) land in the baseline, not in the first measured session."""
    import onnxruntime
    weight = numpy_helper.from_array(np.ones((8, 3, 3, 3), np.float32), "w")
    matrix = numpy_helper.from_array(np.ones((8 * 8 * 8, 4), np.float32), "m")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c"], ["r"]),
         helper.make_node("Flatten", ["r"], ["f"]),
         helper.make_node("Gemm", ["f", "m"], ["y"])],
        "warm_up", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [weight, matrix])
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=providers)
    session.run(None, {"x": np.ones((1, 3, 8, 8), np.float32)})


def _measure_here(model_path: str, height: int, width: int, batch: int, device: str, channels_last: bool) -> Measurement:
    import onnxruntime
    from convert.cuda import runtime
    cudart = runtime() if device == "cuda" else None
    if device == "cuda" and cudart is None:
        raise MeasurementError("device 'cuda' requested but the CUDA runtime library does not load")
    providers: list = (["CPUExecutionProvider"] if device == "cpu" else
                       [("CUDAExecutionProvider", dict(PREDICTABLE_CUDA_OPTIONS))])
    configure_allocator()  # as the server does at start
    warm_up_runtime(providers)

    def used() -> int:
        return _cuda_used_bytes(cudart) if cudart is not None else _status_bytes("VmRSS")

    if cudart is None:
        _reset_peak()  # so VmHWM below is the session-creation peak
    baseline = used()
    session = onnxruntime.InferenceSession(model_path, predictable_session_options(on_gpu=cudart is not None),
                                           providers=providers)
    load_peak = _status_bytes("VmHWM") - baseline if cudart is None else 0
    session_bytes = used() - baseline
    image = session.get_inputs()[0]
    dtype = {"tensor(float16)": np.float16, "tensor(uint8)": np.uint8}.get(image.type, np.float32)
    on_cpu = cudart is None
    if on_cpu:
        _reset_peak()
    channels = image.shape[3 if channels_last else 1]
    shape = (batch, height, width, channels) if channels_last else (batch, channels, height, width)
    pixels = np.random.default_rng(0).uniform(0, 255, shape).astype(dtype)
    feed = {image.name: pixels}
    if on_cpu:
        first_cpu_run(session, feed)  # as server/engine/providers.py makes a plan
    for _ in range(RUNS - on_cpu):
        session.run(None, feed)
    peak = (_status_bytes("VmHWM") if on_cpu else used()) - baseline
    return Measurement(device, height, width, batch, peak, session_bytes, load_peak)


def measure_peak(model_path: str, *, height: int, width: int, batch: int = 1, device: str = "auto") -> Measurement:
    """Peak memory of `RUNS` runs of the model at batch x C x height x width, in a clean child."""
    import onnxruntime
    from convert.cuda import runtime
    if device == "auto":
        device = select_device(onnxruntime.get_available_providers(), cuda_loadable=runtime() is not None)
    if device not in ("cpu", "cuda"):
        raise MeasurementError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if not os.path.isfile(model_path):
        raise MeasurementError(f"no model file at {model_path!r}")
    from convert.card import Layout
    from convert.profile import ProfileError, load_skeleton

    try:
        channels_last = load_skeleton(model_path).layout == Layout.LAYOUT_NHWC
    except ProfileError as error:
        raise MeasurementError(f"measuring {model_path} failed: {error}") from error
    arguments = [model_path, "--height", str(height), "--width", str(width), "--batch", str(batch), "--device", device,
                 *(["--channels-last"] if channels_last else [])]
    # Run this file, not `-m server.memory.runtime`: importing the packages (convert pulls in torch) costs
    # seconds of start-up that measure nothing.
    command = [sys.executable, "-c", "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')",
               __file__, *arguments]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_SECONDS, check=False)
    except subprocess.TimeoutExpired as error:
        raise MeasurementError(f"measuring {model_path} took over {TIMEOUT_SECONDS} s") from error
    if done.returncode != 0:
        raise MeasurementError(f"measuring {model_path} at {batch}x{height}x{width} failed: "
                               f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
    return Measurement(**json.loads(done.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Measure one model's peak memory under onnxruntime (child side).")
    parser.add_argument("model")
    parser.add_argument("--height", type=int, required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--channels-last", action="store_true", help="the image input is NHWC")
    args = parser.parse_args(argv)
    measurement = _measure_here(args.model, args.height, args.width, args.batch, args.device, args.channels_last)
    sys.stdout.write(json.dumps(dataclasses.asdict(measurement)) + "\n")


if __name__ == "__main__":
    main()
