"""The engine as the request path sees it: one small interface, two ways to reach it.

The front side (admission, decoding, assembly) asks the engine for room, runs a request's items, cancels them and
gives room back only through an `EngineClient`; nothing else of the engine crosses. `server/engine/core.py`'s
`EngineCore` is the engine in the calling process; `server/engine/remote.py`'s `RemoteClient` reaches an engine
process (`server/engine/process.py`) over a Unix socket with the canvases and lattices in shared memory, as vLLM V1's
`InprocClient` and `MPClient` do. This module imports nothing that opens a session.
"""

from __future__ import annotations

import abc
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import msgspec
import numpy as np

from convert import int8_kernels
from convert.memory_model import Device
from server.errors import NoRoom, Transient
from server.geometry.dense import Passes
from server.scoring.request import GroupKey, Item, ItemKey, Scored

__all__ = ["CanvasStore", "EngineClient", "EngineFacts", "HeapCanvases", "Places", "PlanKey", "QueueState", "Ran",
           "Submission"]


@dataclass(frozen=True)
class PlanKey:
    """The one shape a plan runs: canvas, batch size and passes."""

    height: int
    width: int
    batch: int
    passes: Passes

    def __str__(self) -> str:
        return f"{self.batch}x{self.height}x{self.width}x{len(self.passes.offsets)} passes"


@dataclass(frozen=True)
class EngineFacts:
    """What the front side needs to know of the engine before it admits anything: where plans run and what
    memory they may hold (the front predicts a request's plans against it; the engine accounts them)."""

    provider: str
    device: Device
    memory_budget_bytes: int | None
    runners: int
    max_batch: int
    # The CPU's int8 kernels sum neighbouring products in 16 bits (convert.int8_kernels.pair_sums_saturate): measured
    # where the plans run, so that full 8-bit int8 weights are refused there.
    int8_sums_saturate: bool = False

    @property
    def on_gpu(self) -> bool:
        return self.device is Device.CUDA

    def int8_refusal(self, weights: int) -> str | None:
        """Why an int8 graph with these weights (the card's Int8Weights) is not served here, or None where it runs on
        integer kernels that compute it right (the CPU's; full 8-bit weights only where they sum in 32 bits)."""
        if self.device is Device.CPU:
            return int8_kernels.refusal(weights, sums_saturate=self.int8_sums_saturate)
        return (f"an int8 graph does not run on {self.provider}: onnxruntime's {self.provider} has no int8 convolution "
                "kernels (it would compute in float32 between quantize/dequantize nodes: slower than the fp32 graph, "
                "with int8's loss); serve the fp16 or fp32 model on a GPU, or this one with --provider cpu")


class QueueState(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A model's queue at one moment: enough to say whether a request has room in it (`room`). The batcher decides
    on its live state; a front process on the state the engine last sent it (server/engine/remote.py)."""

    waiting: int  # items queued, or holding places while their request decodes
    free_at: float  # time.monotonic() when the first busy runner is expected to end, every runner busy; else 0
    seconds_per_item: float  # one runner's recent pace
    runners: int
    max_batch: int
    depth: int  # --queue-depth
    max_queue: float  # --max-queue-ms, in seconds
    closed: bool = False

    def wait(self, now: float, *, ahead: int = 0) -> float:
        """Seconds a new item would wait before it runs: until a runner is free (the first busy one to end, when
        every runner is busy), then the items ahead, shared between the runners, at the recent pace."""
        return max(0.0, self.free_at - now) + (self.waiting + ahead) * self.seconds_per_item / self.runners

    def room(self, items: int, *, deadline: float | None, now: float, ahead: int = 0) -> NoRoom | None:
        """None when a request of `items` has room behind `ahead` more items than the state counts, else why not:
        closed, the queue would overflow, its items would not start within `max_queue` less a margin, or would end
        after `deadline`. The margin, one item's time (at most half the limit) when items wait ahead: the wait is
        an estimate, and a request admitted just under the limit would often pass it and be dropped after its
        decode, having cost work and its caller's time for a refusal."""
        waiting, pace = self.waiting + ahead, self.seconds_per_item / self.runners
        wait = self.wait(now, ahead=ahead)
        margin = min(self.seconds_per_item, self.max_queue / 2) if waiting else 0.0
        side_by_side = min(self.runners, math.ceil(items / self.max_batch))  # its batches on the runners
        done = wait + math.ceil(items / side_by_side) * self.seconds_per_item
        if self.closed:
            why: Transient | None = None
        elif waiting + items > self.depth:
            why = Transient.QUEUE_FULL
        elif wait > self.max_queue - margin:
            why = Transient.QUEUE_WAIT
        elif deadline is not None and now + done > deadline:
            why = Transient.DEADLINE
        else:
            return None
        return NoRoom(why, waiting=waiting, adding=items, depth=self.depth, wait=wait, margin=margin, done=done,
                      max_queue=self.max_queue, seconds_per_item=pace)


class Places(Protocol):
    """A request's places in a model's queue, held from admission until its items are queued."""

    items: int


@dataclass(frozen=True)
class Submission:
    """One item of a request to run: which it is, the batch group it may share, and its limits."""

    key: ItemKey
    group: GroupKey
    item: Item
    limit: int  # items of its canvas one batch may hold
    deadline: float | None


@dataclass
class Ran:
    """One item's result and where its time went (the response's timings)."""

    scored: Scored
    enqueued: float
    started: float
    run_seconds: float
    batch_id: int


class CanvasStore(Protocol):
    """Where one request's arrays are made (its canvases, and the lattices the engine gives back): `allocate`
    gives an array to write, `release` frees them all, `abandon` never frees them (the engine may still write
    into them)."""

    def allocate(self, shape: tuple[int, ...], dtype: type = np.uint8) -> np.ndarray: ...

    def release(self) -> None: ...

    def abandon(self) -> None: ...


class HeapCanvases:
    """Canvases on the process's heap (the engine runs in this process)."""

    @staticmethod
    def allocate(shape: tuple[int, ...], dtype: type = np.uint8) -> np.ndarray:
        return np.empty(shape, dtype=dtype)

    def release(self) -> None:
        pass

    def abandon(self) -> None:
        pass


class EngineClient(abc.ABC):
    """The engine's five verbs: reserve, release, run (submit and wait, cancelled with the call), warm and close.

    Refusals come back as `ScoringError`s with the same words and retry hints however the engine is reached;
    `on_ready`, when set, hears True when the engine can run requests and False when it cannot (health)."""

    facts: EngineFacts
    on_ready: Callable[[bool], None] | None = None

    @abc.abstractmethod
    def reserve(self, model: str, items: int, *, deadline: float | None) -> Places | NoRoom:
        """Hold `items` places in `model`'s queue for a request about to decode, or say why there is none."""

    @abc.abstractmethod
    def release(self, model: str, places: Places) -> None:
        """Give back what `places` still holds (nothing once its items are queued)."""

    @abc.abstractmethod
    def run(self, model: str, places: Places, submissions: Sequence[Submission], *, canvases: CanvasStore,
            cancelled: threading.Event | None) -> dict[ItemKey, Ran]:
        """Queue a request's items in the places it held and wait for their results (arrays made in `canvases`,
        where its canvases are); raises the first item's refusal, CANCELLED when `cancelled` is set,
        DEADLINE_EXCEEDED when its deadline passes in the queue."""

    @abc.abstractmethod
    def warm(self, model: str, keys: Sequence[PlanKey], *, background: bool = False) -> list[str]:
        """Make and run the plans of `keys` (each once: a plan made already is kept); the failures, one line each.
        `background`: made beside requests' own plans, never before them (the tile canvas, once SERVING)."""

    @property
    def ready(self) -> bool:
        """Whether the engine can run requests now (an engine process may be gone, or starting again)."""
        return True

    def canvases(self) -> CanvasStore:
        """Where a request's canvases go: the heap, unless the engine reads them from shared memory."""
        return HeapCanvases()

    @abc.abstractmethod
    def close(self) -> None:
        """Stop: queued work fails with UNAVAILABLE."""
