"""Waits that Ctrl-C ends at once.

The kernel hands a process's SIGINT to any of its threads that do not block it (gRPC's own among them), and Python
runs the handler (Ctrl-C's KeyboardInterrupt) in the main thread only, once that thread's wait returns. So a main
thread that waits does so in slices of at most SIGNAL_SLICE_S, never in one wait that only the awaited event ends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection
from concurrent.futures import FIRST_COMPLETED, Future, wait

__all__ = ["SIGNAL_SLICE_S", "first_done", "paused"]

SIGNAL_SLICE_S = 0.1


def first_done(futures: Collection[Future]) -> set[Future]:
    """The futures done once any of them is: `concurrent.futures.wait(FIRST_COMPLETED)` in slices."""
    while True:
        done, _ = wait(futures, timeout=SIGNAL_SLICE_S, return_when=FIRST_COMPLETED)
        if done or not futures:
            return done


def paused(seconds: float, stop: threading.Event | None = None) -> bool:
    """Wait `seconds` in slices; True as soon as `stop` is set."""
    ends = time.monotonic() + seconds
    while (left := ends - time.monotonic()) > 0:
        if stop is None:
            time.sleep(min(left, SIGNAL_SLICE_S))
        elif stop.wait(min(left, SIGNAL_SLICE_S)):
            return True
    return False
