"""Compute runs behind the edges: CPU-bound threads (image decoding; on the CPU also batcher runners and
onnxruntime's own pools) at a lower scheduling priority than the threads that read, admit, refuse and answer calls.

On a few cores a refusal that costs a millisecond waited behind another call's decode or plan run of tens: in a
burst, a queue-full refusal took 1.75-1.90x what an unknown-model refusal of the same bytes took at one priority,
1.32-1.44x with compute at nice 19 (bench_overload's bursts, alternated). The kernel runs the edges' threads first
whenever both are ready, and compute still takes every cycle they leave. Linux's nice is per thread and a thread
inherits its creator's: onnxruntime's pool threads, started when a session is made, are made from a thread already
lowered (`made_lowered`). A thread cannot raise its priority back without privileges, so lowering is one way. A
GPU's runner is not lowered: the host feeding the device must not wait behind request work.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["lower_this_thread", "made_lowered"]

T = TypeVar("T")


def lower_this_thread(nice: int) -> None:
    """Run the calling thread at nice `nice` (no change at 0, or when it already runs at that or lower)."""
    if nice <= 0:
        return
    thread = threading.get_native_id()
    if os.getpriority(os.PRIO_PROCESS, thread) < nice:
        os.setpriority(os.PRIO_PROCESS, thread, nice)


def made_lowered(make: Callable[[], T], nice: int) -> T:
    """`make()` run on a thread of its own at nice `nice`, so the threads it starts inherit it; its result, or its
    exception raised here."""
    if nice <= 0:
        return make()
    outcome: dict[str, object] = {}

    def run() -> None:
        lower_this_thread(nice)
        try:
            outcome["value"] = make()
        except BaseException as error:  # handed to the caller, whatever it is
            outcome["error"] = error

    thread = threading.Thread(target=run, name="lowered-maker", daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]
