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
    def busy(self) -> Iterator[tuple[int, int]]:
        """Counted as running until the block ends; yields the `mark` as it began, itself counted: equal to a
        mark taken later in the block when no other work ran meanwhile, and (1, ...) when none ran as it began."""
        with self._lock:
            self._running += 1
            self._begun += 1
            entered = self._running, self._begun
        try:
            yield entered
        finally:
            with self._lock:
                self._running -= 1

    def mark(self) -> tuple[int, int]:
        """(running now, begun so far): equal marks with none running mean none ran in between."""
        with self._lock:
            return self._running, self._begun

    def alone_since(self, began: tuple[int, int]) -> bool:
        """Inside the `busy` block that yielded `began`: no other work ran as it began, nor has since."""
        return began[0] == 1 and self.mark() == began


HOST_ACTIVITY = HostActivity()  # process-wide, as the resident set it guards is
