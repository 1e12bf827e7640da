"""The Python heap of a serving process: what start-up made is frozen out of the garbage collector.

A loaded server holds hundreds of thousands of objects that live as long as it does (modules, the model's card and
graph helpers, gRPC's and onnxruntime's bindings). Each request allocates a few hundred short-lived ones, so the
collector runs every few requests, and each of its oldest-generation passes walked the whole start-up heap again:
in the engine process at 16 clients, more than half of its input thread's CPU (perf). `gc.freeze()` once the
process is ready moves those objects to a permanent generation the collector never visits; what requests make is
collected as before. vLLM ends its engine's warm-up the same way (`freeze_gc_heap`).
"""

from __future__ import annotations

import gc
import logging

__all__ = ["freeze_startup_heap"]

LOG = logging.getLogger(__name__)


def freeze_startup_heap() -> None:
    """Collect once, then freeze what is left: call when the process is ready to serve (after warm-up)."""
    gc.collect()
    gc.freeze()
    LOG.debug("start-up heap frozen: %d objects out of the collector's reach", gc.get_freeze_count())
