"""The engine in the calling process: onnxruntime's provider, every model's plans and batcher, one memory budget.

`EngineCore` is the `EngineClient` a single-process server (and `scoremap-score --local`) calls directly, and
what the engine process (server/engine/process.py) serves to its front processes. It holds what opens a
session; the front side never imports it.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from convert.int8_kernels import pair_sums_saturate
from convert.memory_model import Device
from protos import model_card_pb2
from server.engine.batcher import Batcher, Claim, Reservation, Work
from server.engine.client import CanvasStore, EngineClient, EngineFacts, PlanKey, QueueState, Ran, Submission
from server.engine.device_graph import LATTICE
from server.engine.plans import PlanCache
from server.engine.providers import Engine, EngineError
from server.errors import Dropped, NoRoom, Refusal, ScoringError
from server.geometry.buckets import Buckets
from server.memory.arena import CPU_ARENA
from server.memory.device import MemoryBudget, PlanMemory
from server.memory.runtime import configure_allocator
from server.metrics import Metrics
from server.scoring.request import GroupKey, ItemKey
from server.settings import Settings

__all__ = ["EngineCore", "one_line"]

LOG = logging.getLogger(__name__)


@dataclass(eq=False)
class Served:
    """One model as the engine runs it: its plans and the batcher feeding them."""

    name: str
    plans: PlanCache
    plan_memory: PlanMemory
    buckets: Buckets
    batcher: Batcher


class EngineCore(EngineClient):
    """Every model's plans and batcher in this process, under one memory budget (this process's share of it with
    `--workers`)."""

    def __init__(self, settings: Settings, *, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        try:
            self.engine = Engine(settings)
        except EngineError as error:
            raise ScoringError(Refusal.FAILED_PRECONDITION, str(error)) from error
        configure_allocator()
        self.budget = MemoryBudget.sized(settings.memory_budget_bytes, device=self.engine.device,
                                         free_gpu_bytes=self.engine.free_gpu_bytes(),
                                         fraction=settings.cpu_memory_fraction, share=settings.budget_share)
        if metrics is not None:
            metrics.plans_held.set_function(self.budget.used_bytes)
        on_gpu = self.engine.on_gpu
        self.facts = EngineFacts(provider=self.engine.provider, device=self.engine.device,
                                 memory_budget_bytes=self.budget.total_bytes, runners=settings.runners_for(on_gpu=on_gpu),
                                 max_batch=settings.max_batch_for(on_gpu=on_gpu),
                                 int8_sums_saturate=self.engine.device is Device.CPU and pair_sums_saturate())
        self._served: dict[str, Served] = {}
        self._lock = threading.Lock()

    def add(self, name: str, net: onnx.ModelProto, card: model_card_pb2.ModelCard, *, plan_memory: PlanMemory,
            buckets: Buckets, fill: np.ndarray) -> None:
        """Serve a loaded model: its plan cache and batcher (runners per `EngineFacts.runners`)."""
        settings, metrics = self.settings, self.metrics
        plans = PlanCache(net, card, self.engine, plan_memory, max_plans=settings.max_plans, buckets=buckets,
                          fill=fill, metrics=metrics, name=name)
        served = Served(name, plans, plan_memory, buckets, batcher=None)  # type: ignore[arg-type]
        served.batcher = Batcher(
            plans.run, max_batch=self.facts.max_batch, max_delay_seconds=settings.max_queue_delay_ms / 1000,
            max_queue_seconds=settings.max_queue_ms / 1000, queue_depth=settings.queue_depth,
            on_batch=None if metrics is None else functools.partial(record_batch, served, metrics),
            on_drop=None if metrics is None else functools.partial(metrics.count_dropped, name),
            on_cpu=None if metrics is None else metrics.batch_cpu.labels(name).inc,
            take=plans.first_run, name=name, runners=self.facts.runners,
            nice=settings.compute_nice_for(on_gpu=self.facts.on_gpu),
        )
        if metrics is not None:
            metrics.track_queue(name, served.batcher.depth)
        with self._lock:
            self._served[name] = served

    def served(self, model: str) -> Served:
        try:
            return self._served[model]
        except KeyError:
            raise ScoringError(Refusal.NOT_FOUND, f"the engine serves no model named {model!r}") from None

    # --- the EngineClient verbs ---------------------------------------------------------------
    def reserve(self, model: str, items: int, *, deadline: float | None) -> Reservation | NoRoom:
        return self.served(model).batcher.reserve(items, deadline=deadline)

    def release(self, model: str, places: Reservation) -> None:
        self.served(model).batcher.release(places)

    def queue_state(self, model: str) -> QueueState:
        return self.served(model).batcher.state()

    def run(self, model: str, places: Reservation, submissions: Sequence[Submission], *, canvases: CanvasStore,
            cancelled: threading.Event | None) -> dict[ItemKey, Ran]:
        works = self.submit(model, places, submissions)
        self.served(model).batcher.wait(works, cancelled=cancelled)
        return {submission.key: ran(work) for submission, work in zip(submissions, works)}

    def submit(self, model: str, places: Reservation, submissions: Sequence[Submission]) -> list[Work]:
        """Queue a request's items in the places it held; their `Work`s, whose `done` is set as each ends."""
        works = [Work(s.group, s.item, s.limit, s.deadline) for s in submissions]
        self.served(model).batcher.submit(works, places)
        return works

    def offer(self, model: str, submissions: Sequence[Submission], *, deadline: float | None,
              on_done: Callable[[int, Work], None], here: bool = False) -> tuple[list[Work], Claim | None] | NoRoom:
        """Queue a request's items now if the queue has room for them, else why not (a front process's items,
        which come decoded); as each ends, `on_done` is told with its index. With `here`, items a free runner would
        take at once come back claimed, for the calling thread to run (`Batcher.offer`). No event: no one waits on
        one here, and it would cost more to make than the rest of the `Work`."""
        works = [Work(s.group, s.item, s.limit, s.deadline, done=None, on_done=functools.partial(on_done, index))
                 for index, s in enumerate(submissions)]
        offered = self.served(model).batcher.offer(works, deadline=deadline, here=here)
        return offered if isinstance(offered, NoRoom) else (works, offered)

    def cancel(self, model: str, works: Sequence[Work], *, dropped: Dropped | None = None) -> None:
        """Take the items that have not started out of the queue (none left once the engine closed); given
        `dropped`, each counts as dropped for that reason."""
        served = self._served.get(model)
        if served is not None:
            served.batcher.cancel(works, dropped=dropped)

    def warm(self, model: str, keys: Sequence[PlanKey], *, background: bool = False) -> list[str]:
        plans, failures = self.served(model).plans, []
        for key in keys:
            try:
                plans.run_plan(key, [], lattice=LATTICE, background=background)
            except Exception as error:  # any failure is named: warm-up keeps health NOT_SERVING with it
                failures.append(f"{model} plan {key}: {one_line(error)}")
        # Warm-up runs hold no host budget, whose idle moment would otherwise shrink the CPU arena: a warmed tile
        # canvas's block (600 MiB for the default model) would stay until a first request ended.
        CPU_ARENA.went_idle(release=False)
        return failures

    @staticmethod
    def went_idle(release: bool) -> None:
        """No request is in flight: the CPU plans' arena may give back what it keeps (`release`: requests held much
        memory since the last time)."""
        CPU_ARENA.went_idle(release=release)

    def close(self) -> None:
        """Runs under way end at once (Engine.stop_runs), then every batcher closes (queued work: UNAVAILABLE)."""
        self.engine.stop_runs()
        with self._lock:
            served = list(self._served.values())
        for each in served:  # before they are forgotten: a closing batcher's failed items may ask to cancel theirs
            each.batcher.close()
        with self._lock:
            self._served = {}


def ran(work: Work) -> Ran:
    """A finished item's result and timings."""
    return Ran(work.result, enqueued=work.enqueued, started=work.started, run_seconds=work.run_seconds,
               batch_id=work.batch_id)


def record_batch(served: Served, metrics: Metrics, works: list[Work]) -> None:
    """The batch's size and predicted peak in the metrics (traffic only, not the warm-up)."""
    if any(work.payload.traffic for work in works):
        group: GroupKey = works[0].key
        passes = served.buckets.batch_for(len(works)) * len(group.passes.offsets)  # the padded batch runs
        metrics.record_batch(served.name, len(works),
                             served.plan_memory.predicted_bytes(group.height, group.width, passes))


def one_line(error: Exception, limit: int = 300) -> str:
    """An error's message on one line, cut to `limit` characters (onnxruntime's span several)."""
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"
