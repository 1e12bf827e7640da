"""Shared memory between a front process and the engine: one region per front, arrays in it by offset.

A front owns its region (it creates, allocates in and unlinks it); the engine maps it by name and reads the
canvases the front wrote and writes the lattices the front will read, so pixels and scores cross without a
copy through a socket, as Triton's shared-memory regions are registered once and then passed as region, offset
and size. Regions are files in /dev/shm opened directly (not `multiprocessing.shared_memory`, whose resource
tracker on Python 3.11-3.12 unlinks segments another process still uses); the supervisor removes any a killed
front left behind (`remove_stale`).
"""

from __future__ import annotations

import bisect
import glob
import math
import mmap
import os
import threading

import numpy as np

__all__ = ["ALIGNMENT", "Allocator", "Region", "free_shm_bytes", "region_name", "region_prefix",
           "remove_stale"]

SHM_DIR = "/dev/shm"
ALIGNMENT = 64  # bytes: a cache line, so no two arrays share one


class Region:
    """A named region of shared memory, mapped into this process: created (and later unlinked) by its owner,
    attached by the other side."""

    def __init__(self, name: str, size: int = 0, *, create: bool) -> None:
        self.name = name
        self.path = os.path.join(SHM_DIR, name)
        self.owner = create
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.size = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)

    def array(self, offset: int, shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
        """A view of the region: no copy. It holds the mapping (through a memoryview: an ndarray made on the map
        itself would not, and `close` would unmap memory a plan is still reading)."""
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        return np.frombuffer(memoryview(self._map)[offset:offset + nbytes], dtype=dtype).reshape(shape)

    def close(self) -> None:
        """Unmap (once no view of it is left; a view still alive keeps the mapping until it goes) and, for its
        owner, unlink it."""
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        try:
            self._map.close()
        except BufferError:  # views still alive: the mapping goes with the last of them
            pass


class Allocator:
    """First fit over a region's bytes, freed blocks merged with their neighbours; thread-safe. `allocate` gives
    None when no free block is large enough (the caller then sends the array inline)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, length), sorted by offset
        self._used: dict[int, int] = {}
        self._lock = threading.Lock()

    def allocate(self, nbytes: int) -> int | None:
        length = max(ALIGNMENT, math.ceil(nbytes / ALIGNMENT) * ALIGNMENT)
        with self._lock:
            for index, (offset, free) in enumerate(self._free):
                if free >= length:
                    if free == length:
                        del self._free[index]
                    else:
                        self._free[index] = (offset + length, free - length)
                    self._used[offset] = length
                    return offset
        return None

    def free(self, offset: int) -> None:
        with self._lock:
            length = self._used.pop(offset)
            index = bisect.bisect(self._free, (offset, 0))
            if index < len(self._free) and offset + length == self._free[index][0]:  # merge with the next
                length += self._free.pop(index)[1]
            if index > 0 and self._free[index - 1][0] + self._free[index - 1][1] == offset:  # with the previous
                offset, length = self._free[index - 1][0], self._free[index - 1][1] + length
                index -= 1
                del self._free[index]
            self._free.insert(index, (offset, length))

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._used.values())


def free_shm_bytes() -> int:
    """Bytes /dev/shm can still take (Docker gives 64 MB unless `--shm-size` says otherwise)."""
    stats = os.statvfs(SHM_DIR)
    return stats.f_bavail * stats.f_frsize


def remove_stale(prefix: str) -> list[str]:
    """Unlink the regions whose names start with `prefix` (a killed front's); their names."""
    removed = []
    for path in glob.glob(os.path.join(SHM_DIR, glob.escape(prefix) + "*")):
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        removed.append(os.path.basename(path))
    return removed


def region_prefix(run: str, front: int) -> str:
    """What the names of front `front`'s regions of server `run` begin with, whichever process made them."""
    return f"{run}-front{front}-"


def region_name(run: str, front: int, pid: int) -> str:
    """The shared-memory region of front `front` of server `run`, made by process `pid`: a front started again
    makes a region of another name, so the engine never reads a dead front's mapping for a live one's."""
    return f"{region_prefix(run, front)}{pid}"
