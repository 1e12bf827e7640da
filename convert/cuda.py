"""Whether a CUDA device is visible here, and its free memory: the CUDA runtime probed through ctypes.

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
import io
import os
import threading

_CUDART_NAMES = ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0")
# What the NVIDIA driver leaves on a machine: the kernel module's version file and its user-space library.
_DRIVER_FILE = "/proc/driver/nvidia/version"
_DRIVER_LIBRARY = "libcuda.so.1"
INSTALL_HINT = ("install the CUDA 13 runtime and cuDNN 9 wheels: `pip install -e '.[gpu]'` "
                "(`make setup` does so where a driver is present)")

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
