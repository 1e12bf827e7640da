"""Host work that moves the process's resident set: what a plan's memory measurement must not count as its own.

Light on purpose (no onnxruntime): the request path marks its work here in every process, while only the
process that makes plans reads it (server.memory.runtime.measure_footprint).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["HOST_ACTIVITY", "HostActivity"]


class HostActivity:
    """Work in this process that grows and shrinks its resident set beside plan building (decoding images,
    assembling responses): a host footprint read while any ran is not the plan's alone (concurrent
    decoding measured a plan at 2.59x its prediction)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._begun = 0

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        with self._lock:
            self._running += 1
            self._begun += 1
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1

    def mark(self) -> tuple[int, int]:
        """(running now, begun so far): equal marks with none running mean none ran in between."""
        with self._lock:
            return self._running, self._begun


HOST_ACTIVITY = HostActivity()  # process-wide, as the resident set it guards is
