"""The process's one CPU arena: every CPU plan's runs draw on it, and it keeps the largest block, not one per plan.

Left to itself, each CPU plan keeps its own onnxruntime arena holding its memory pattern's block (one block of
its planned activations): ten plans of the default model would hold ten blocks, 1.1 GiB idle (docs/design.md: one
CPU arena and one copy of the weights). The arena is registered once in onnxruntime's environment (`onnxruntime.create_and_register_allocator`) and
sessions made with `session.use_env_allocators=1` take from it instead. A plan's run takes its block from
it and hands it back when the run returns, so a plan that does not run holds no activations.

onnxruntime's arena grows by regions that are never merged and gives back only whole free regions, and
only when a run asks it to (`memory.enable_memory_arena_shrinkage`). Two rules keep it at the largest
block rather than a sum of them:

* `shrink()`: the free regions go back to the system, through a run of a one-element graph with that
  option (onnxruntime shrinks only at the end of a run). A plan's first run records its memory pattern
  allocating buffer by buffer; what it left goes back before its second run takes the block (without
  it, the default warm-up's ten plans keep 391 MiB of arena instead of 147).
* `running(block)`: a run whose block is larger than any the arena took since it last shrank shrinks
  it first, so that the new block's region replaces the smaller ones instead of joining them. The arena
  extends by what is asked (kSameAsRequested): regions of onnxruntime's default power-of-two growth
  stayed partly touched after a shrink (302 MiB for a 143 MiB block, against 158 MiB asked-for).

And when no request has been in flight for `idle_release_seconds`, `went_idle` gives a large block back
(`idle_held_bytes`), or any after requests held much memory (server.memory.host_budget): what is idle
holds the memory of what exists (the model's weights, each plan's state), not of what ran.

Runs side by side (several models, or one model's --cpu-runners) each hold their block at once: admission counts
them (server/memory/device.py), and so does the idle rule here.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import numpy as np
import onnxruntime
from onnx import TensorProto, helper

__all__ = ["ARENA_CONFIG", "IDLE_HELD_BYTES", "IDLE_RELEASE_SECONDS", "USE_ENV_ALLOCATORS", "SharedArena", "CPU_ARENA"]

# The arena's configuration: regions the size asked for (kSameAsRequested), no limit of its own (the memory
# budget admits the plans); onnxruntime's defaults otherwise.
ARENA_CONFIG = {"arena_extend_strategy": 1}
# The session option that makes a session take from the registered arena instead of its own.
USE_ENV_ALLOCATORS = "session.use_env_allocators"
# When nothing runs, a block larger than this goes back to the system (--max-idle-arena-bytes sets it): it belongs
# to a plan whose run takes seconds, for which taking its pages again is little, and it would stay resident long
# after (a 2944x800 canvas's four passes hold 1.3 GiB after a soak). A smaller one stays: the next run of
# the plans most requests use reuses it.
IDLE_HELD_BYTES = 256 * 2**20
# How long no run must begin, once no request is in flight, before the arena gives back: a client sending large
# requests one after another leaves the server idle between them, and giving the blocks back at each of those moments
# makes every such request fault its blocks in again (1.3-1.7 GiB each, 25% slower).
IDLE_RELEASE_SECONDS = 2.0


def _shrink_options() -> onnxruntime.RunOptions:
    options = onnxruntime.RunOptions()
    options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    return options


class SharedArena:
    """The one CPU arena of this process: registered on first use, shrunk on demand, grown by the largest block."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._registered = False
        self._janitor: onnxruntime.InferenceSession | None = None
        self._shrink = _shrink_options()
        self.held_bytes = 0  # the largest block a run took since the arena last shrank (0: none)
        self._running_bytes = 0  # the blocks of the runs under way
        self._held_together = 0  # the most the runs' blocks held at once since the arena last shrank
        self.idle_held_bytes = IDLE_HELD_BYTES  # the largest kept while nothing runs
        self.idle_release_seconds = IDLE_RELEASE_SECONDS
        self._runs = 0  # runs begun, so that a release due finds whether any began meanwhile
        self._release_wanted = False
        self._due: tuple[float, int] | None = None  # (when, runs begun by then) of the release due
        self._idle = threading.Condition(self._lock)
        self._waiter: threading.Thread | None = None  # waits for the release due, started on first use

    def register(self) -> None:
        """Register the arena in onnxruntime's environment, once per process."""
        with self._lock:
            if self._registered:
                return
            info = onnxruntime.OrtMemoryInfo("Cpu", onnxruntime.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                                             onnxruntime.OrtMemType.DEFAULT)
            onnxruntime.create_and_register_allocator(info, onnxruntime.OrtArenaCfg(ARENA_CONFIG))
            self._registered = True

    def use_in(self, options: onnxruntime.SessionOptions) -> onnxruntime.SessionOptions:
        """`options` taking from this arena (registered first if need be)."""
        self.register()
        options.enable_cpu_mem_arena = True
        options.add_session_config_entry(USE_ENV_ALLOCATORS, "1")
        return options

    def shrink(self) -> None:
        """Hand the arena's free regions back to the system; regions a running batch holds stay."""
        with self._lock:
            self._shrink_locked()

    @contextlib.contextmanager
    def running(self, block_bytes: int) -> Iterator[None]:
        """Around a run that takes a block of `block_bytes` from the arena: shrinks it first when the block is
        larger than any it took since it last shrank, so that the larger block's region replaces the others; the
        blocks of runs side by side count together in what the idle rule sees."""
        with self._lock:
            self._runs += 1
            if block_bytes > self.held_bytes:
                if self.held_bytes:
                    self._shrink_locked()
                self.held_bytes = block_bytes
            self._running_bytes += block_bytes
            self._held_together = max(self._held_together, self._running_bytes)
        try:
            yield
        finally:
            with self._lock:
                self._running_bytes -= block_bytes

    def went_idle(self, *, release: bool) -> None:
        """No request is in flight. If no run begins for `idle_release_seconds`, shrink when `release` (requests held
        enough memory since the last release that giving it back is worth it, server.memory.host_budget) or when the
        arena holds more than `idle_held_bytes`. One waiting thread for the process: a thread started per call
        cost a request at one client 0.3 ms of CPU."""
        with self._lock:
            self._release_wanted |= release
            waited_for = self._due
            self._due = (time.monotonic() + self.idle_release_seconds, self._runs)
            if self._waiter is None:
                self._waiter = threading.Thread(target=self._release_when_idle, name="arena-idle-release", daemon=True)
                self._waiter.start()
            # Woken only when this due comes before the one it waits for (none, or a longer idle_release_seconds):
            # else it wakes at that one and finds this. Waking it at every idle moment cost a request at 16 clients
            # 0.45 ms of CPU.
            if waited_for is None or self._due[0] < waited_for[0]:
                self._idle.notify()

    def _release_when_idle(self) -> None:
        with self._lock:
            while True:
                if self._due is None:
                    self._idle.wait()
                    continue
                when, runs = self._due
                if time.monotonic() < when:
                    self._idle.wait(when - time.monotonic())
                    continue
                self._due = None
                if self._runs != runs:  # a run began since: not idle
                    continue
                if self._release_wanted or max(self.held_bytes, self._held_together) > self.idle_held_bytes:
                    self._shrink_locked()
                self._release_wanted = False

    def took(self, block_bytes: int) -> None:
        """A run just took a block of `block_bytes` (measured): the arena holds at least that much."""
        with self._lock:
            self.held_bytes = max(self.held_bytes, block_bytes)

    def _shrink_locked(self) -> None:
        if not self._registered:
            return
        if self._janitor is None:
            graph = helper.make_graph(
                [helper.make_node("Relu", ["x"], ["y"])], "shrink",
                [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
            model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])
            options = onnxruntime.SessionOptions()
            options.add_session_config_entry(USE_ENV_ALLOCATORS, "1")
            options.log_severity_level = 3
            self._janitor = onnxruntime.InferenceSession(model.SerializeToString(), options,
                                                         providers=["CPUExecutionProvider"])
        self._janitor.run(None, {"x": np.zeros(1, np.float32)}, self._shrink)
        self.held_bytes = 0
        self._held_together = self._running_bytes


CPU_ARENA = SharedArena()  # process-wide, as onnxruntime's environment is
