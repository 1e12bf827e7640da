"""Whether a CUDA device is visible here, its free memory, and how a host thread waits for it: the CUDA runtime
through ctypes.

One probe for `scoremap-inspect --device cuda` (which says when its figures are for a GPU it cannot
see) and for the server's engine and memory measurements (server/memory/runtime.py).

The CUDA runtime and cuDNN may come as wheels (onnxruntime-gpu's [cuda,cudnn] extras, the project's `gpu`
extra: nvidia/cu13/lib, nvidia/cudnn/lib in site-packages), which the loader does not search. Before its first
look, the probe has `onnxruntime.preload_dlls()` load them, once per process; a library once loaded
answers to its name (libcudart.so.13), so neither this probe nor onnxruntime's CUDA provider needs
LD_LIBRARY_PATH.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import io
import os
import threading

_CUDART_NAMES = ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0")
# What the NVIDIA driver leaves on a machine: the kernel module's version file and its user-space library.
_DRIVER_FILE = "/proc/driver/nvidia/version"
_DRIVER_LIBRARY = "libcuda.so.1"
INSTALL_HINT = ("install the CUDA 13 runtime and cuDNN 9 wheels: `pip install -e '.[gpu]'` "
                "(`make setup` does so where a driver is present)")

SCHEDULE_BITS = 0x07  # cudaDeviceScheduleMask: the part of a device's flags that says how a host thread waits


class Schedule(enum.IntEnum):
    """How a host thread waiting for the device waits (cudaSetDeviceFlags' schedule, one per process and device)."""

    AUTO = 0  # CUDA's heuristic: spin while the host has more cores than the process has active contexts
    SPIN = 1  # poll: woken soonest, one core busy for the whole wait
    YIELD = 2  # poll, giving the core to other threads between looks
    BLOCK = 4  # sleep until the device signals: the core free for other work, a wake-up's latency added


_preload_lock = threading.Lock()
_preloaded: str | None = None  # what onnxruntime.preload_dlls said, once it ran


def driver_present() -> bool:
    """Whether the NVIDIA driver is installed here (its kernel module's version file, or libcuda.so.1 loads)."""
    return os.path.exists(_DRIVER_FILE) or _loads(_DRIVER_LIBRARY)


def preload_libraries() -> str:
    """Load the CUDA and cuDNN libraries onnxruntime-gpu needs with `onnxruntime.preload_dlls()`, once per
    process, where a driver is present and onnxruntime has its CUDA provider; '' when all loaded (or there was
    nothing to load), else what failed, as onnxruntime said it (it prints; that is kept off stdout here)."""
    global _preloaded
    with _preload_lock:
        if _preloaded is None:
            _preloaded = _preload()
        return _preloaded


def _preload() -> str:
    try:
        import onnxruntime
    except ImportError:
        return ""
    if ("CUDAExecutionProvider" not in onnxruntime.get_available_providers()
            or not hasattr(onnxruntime, "preload_dlls") or not driver_present()):
        return ""
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        try:
            onnxruntime.preload_dlls()  # cuda=True, cudnn=True: nvidia site-packages first, then the loader's path
        except (OSError, RuntimeError) as error:
            print(f"onnxruntime.preload_dlls failed: {error}")
    return " ".join(line.strip() for line in said.getvalue().splitlines() if line.strip())


def runtime() -> ctypes.CDLL | None:
    """The CUDA runtime library when it loads and sees at least one device, else None."""
    preload_libraries()
    for name in _CUDART_NAMES:
        try:
            library = ctypes.CDLL(name)
        except OSError:
            continue
        count = ctypes.c_int(0)
        if library.cudaGetDeviceCount(ctypes.byref(count)) == 0 and count.value > 0:
            return library
    return None


def cuda_free_bytes() -> int | None:
    """Free memory on the current CUDA device (cudaMemGetInfo), or None without a CUDA runtime and device."""
    cudart = runtime()
    if cudart is None:
        return None
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    return int(free.value) if cudart.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)) == 0 else None


def set_schedule(schedule: Schedule) -> Schedule | None:
    """Have host threads wait for the current device as `schedule` says, its other flags kept; the schedule in
    force afterwards (read back), or None without a CUDA runtime and device. Called before the device's context
    is made, as older CUDA refuses to change a made context's flags."""
    cudart = runtime()
    if cudart is None:
        return None
    flags = ctypes.c_uint(0)
    if cudart.cudaGetDeviceFlags(ctypes.byref(flags)) != 0:
        return None
    if cudart.cudaSetDeviceFlags(ctypes.c_uint((flags.value & ~SCHEDULE_BITS) | schedule)) != 0:
        return None
    cudart.cudaGetDeviceFlags(ctypes.byref(flags))
    return Schedule(flags.value & SCHEDULE_BITS)


def why_no_cuda() -> str:
    """Why the probe finds no CUDA device, in words for a log line: no driver, or the libraries that did not
    load and how to install them, or a runtime that sees no device."""
    if not driver_present():
        return f"no NVIDIA driver ({_DRIVER_FILE} is missing and {_DRIVER_LIBRARY} does not load)"
    failed = preload_libraries()
    if failed or not any(_loads(name) for name in _CUDART_NAMES):
        return f"the NVIDIA driver is present but the CUDA runtime does not load{f' ({failed})' if failed else ''}: {INSTALL_HINT}"
    return "the NVIDIA driver and the CUDA runtime are present but the runtime sees no device (CUDA_VISIBLE_DEVICES?)"


def _loads(name: str) -> bool:
    try:
        ctypes.CDLL(name)
    except OSError:
        return False
    return True
