"""Whether a CUDA device is visible here, and its free memory: the CUDA runtime probed through ctypes.

One probe for `scoremap-inspect --device cuda` (which says when its figures are for a GPU it cannot
see) and for the server's engine and memory measurements (server/memory/runtime.py).
"""

from __future__ import annotations

import ctypes

_CUDART_NAMES = ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0")


def runtime() -> ctypes.CDLL | None:
    """The CUDA runtime library when it loads and sees at least one device, else None."""
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
