"""A model's plans' device memory: predicted before a plan is made, measured after, budgeted server-wide.

Predictions are `convert.profile`'s for the device the model runs on (the terms `scoremap-inspect --device`
prints), so what users are shown is what the server enforces. Two ways to use it:

* Per batch: `PlanMemory.require_batch(height, width, scale=, largest_scale=)` returns the largest batch of
  that input size within the model's `budget_bytes`, or refuses with RESOURCE_EXHAUSTED and the numbers;
  `fitting_batch` and `predicted_bytes(height, width, batch)` answer the questions behind it.
* Per plan (one session per fixed shape, server/engine/plans.py): every model's plans draw on one
  `MemoryBudget` per server. The plan cache asks, before making a plan,

      evict = plan_memory.make_room(key, height=, width=, batch=, scale=, largest_scale=)

  which reserves the plan's bytes (its measured footprint when this key was made before, else the
  prediction) and returns this model's plans to drop, least recently used first; plans of other
  models chosen for eviction are handed to their PlanMemory's `on_evict(key)` (called outside any
  lock). It raises ScoringError(RESOURCE_EXHAUSTED) with the bytes, the budget and the largest
  scale that fits when the plan cannot fit even with every other plan evicted. Then, once the plan
  is made and warmed up (`server.memory.runtime.measure_footprint`):

      plan_memory.plan_created(key, measured_bytes, run_bytes=)  # replaces the reservation, exports the
                                                      # gauge, logs when the prediction is off by > 25%
      plan_memory.plan_used(key)                      # on every run: recency for LRU
      plan_memory.plan_evicted(key)                   # when it is dropped (or its making failed)

  `key` is the plan cache's own hashable key; `height`, `width` are the net's input size and
  `batch` the images one run of the net sees (batch x passes when passes are made on the device).

What the plans hold together (`held_bytes`) is counted as it is held: on the CPU a model's
weights once (its plans share them, server.engine.shared_weights), each plan's own state, and per model
the largest of its plans' running batches, once per batch run at once (--cpu-runners; their runs take
activations from one arena and hand them back, server.memory.arena); on CUDA each plan keeps all of its own. A
plan's measurement replaces its own and its running batch's predictions; the model's weights stay predicted.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

import onnx

from convert.arguments import format_bytes
from convert.memory_model import Device, MemoryTerms
from convert.profile import ProfileError, Skeleton, largest_batch, load_skeleton, profile_model
from server.errors import Refusal, ScoringError
from server.memory.host_budget import share_of_available
from server.metrics import Metrics

__all__ = ["MemoryBudget", "PlanMemory", "PlanRecord", "held_bytes"]

LOG = logging.getLogger(__name__)
PROFILE_CACHE_SIZE = 1024  # input sizes (and batch sizes) whose predictions each model remembers
PREDICTION_TOLERANCE = 0.25  # a plan measured further than this from its prediction is logged ...
MEASUREMENT_RESOLUTION_BYTES = 4 * 2**20  # ... and by more than this: RSS moves by a few MiB on its own


@dataclass
class PlanRecord:
    """One plan in the budget: its prediction, its measurement once made, and when it was last used.

    What it holds splits three ways (convert.memory_model): its model's (weights shared by the model's
    plans), its own (session state, kept between runs) and its running batch's (activations the shared arena
    holds while it runs). On CUDA a plan keeps all of it itself."""

    owner: PlanMemory
    key: Hashable
    predicted: MemoryTerms
    measured_bytes: int | None      # what the plan holds alone, its model's weights and its batch included
    last_used: int
    measured_run_bytes: int | None = None  # of which its running batch (CPU: what its run took from the arena)

    @property
    def model_bytes(self) -> int:
        """Its model's share (held once whatever the number of plans): the shared weights as held, once known."""
        if not self.predicted.per_model or self.owner.weights_held is None:
            return self.predicted.per_model
        return self.owner.weights_held

    @property
    def run_bytes(self) -> int:
        return self.measured_run_bytes if self.measured_run_bytes is not None else self.predicted.per_run

    @property
    def own_bytes(self) -> int:
        """What the plan itself keeps between runs."""
        if self.measured_bytes is None:
            return self.predicted.per_plan
        return max(0, self.measured_bytes + self.predicted.transient - self.model_bytes - self.run_bytes)

    @property
    def accounted_bytes(self) -> int:
        """What the plan holds alone (measured, else predicted) plus what its runs take back on the CPU."""
        if self.measured_bytes is None:
            return self.predicted.total
        return self.measured_bytes + self.predicted.transient

    @property
    def alone_bytes(self) -> int:
        """What the plan holds with no other plan made: its account, with each of its model's runners running it."""
        return self.accounted_bytes + (self.owner.runners - 1) * self.run_bytes


def held_bytes(records: Iterable[PlanRecord]) -> int:
    """What these plans hold together: each model's weights once, each plan's own state, and of each model's
    running batches the largest, once per batch its batcher runs at once (its `runners`: they may all run that
    plan)."""
    models: dict[int, list[PlanRecord]] = {}
    for record in records:
        models.setdefault(id(record.owner), []).append(record)
    return sum(max(r.model_bytes for r in mine) + sum(r.own_bytes for r in mine)
               + mine[0].owner.runners * max(r.run_bytes for r in mine)
               for mine in models.values())


class MemoryBudget:
    """Every loaded model's plans, one per server: the one order of their use, server-wide, that evictions
    and each model's --max-plans follow, and the one account of the bytes they may hold together on one
    device (`held_bytes`). Each model's `PlanMemory` predicts and refuses; this only accounts."""

    def __init__(self, total_bytes: int | None, *, device: Device, share: int = 1) -> None:
        self.total_bytes = total_bytes
        self.device = device
        self.share = share  # this process holds 1/share of the server's budget (--workers)
        self._plans: dict[tuple[int, Hashable], PlanRecord] = {}
        self._lock = threading.Lock()
        self._clock = itertools.count()

    @classmethod
    def sized(cls, total_bytes: int | None, *, device: Device, free_gpu_bytes: int | None, fraction: float,
              share: int = 1) -> MemoryBudget:
        """1/`share` (one of --workers' processes) of `total_bytes` (--memory-budget), else of the GPU's free
        memory, else of `fraction` (--cpu-memory-fraction) of MemAvailable; unbounded where none is known."""
        if total_bytes is None:
            total_bytes = free_gpu_bytes if free_gpu_bytes is not None else share_of_available(fraction)
        return cls(None if total_bytes is None else total_bytes // share, device=device, share=share)

    def used_bytes(self) -> int:
        with self._lock:
            return held_bytes(self._plans.values())

    def plans(self) -> list[PlanRecord]:
        """Every plan accounted, least recently used first."""
        with self._lock:
            return sorted(self._plans.values(), key=lambda record: record.last_used)

    def oldest(self, owner: PlanMemory) -> Hashable | None:
        """`owner`'s least recently used plan, or None when it has none."""
        mine = [record for record in self.plans() if record.owner is owner]
        return mine[0].key if mine else None

    def reserve(self, owner: PlanMemory, key: Hashable, predicted: MemoryTerms,
                measured_bytes: int | None, measured_run_bytes: int | None = None,
                ) -> tuple[PlanRecord, list[PlanRecord] | None]:
        """Account a plan about to be made as the most recently used, evicting least recently used plans to
        fit: its record, and the evicted, or None when it cannot fit even alone (nothing changed then)."""
        slot = (id(owner), key)
        with self._lock:
            record = PlanRecord(owner, key, predicted, measured_bytes, next(self._clock), measured_run_bytes)
            others = sorted((r for s, r in self._plans.items() if s != slot), key=lambda r: r.last_used)
            if self.total_bytes is not None and record.alone_bytes > self.total_bytes:
                return record, None
            victims = []
            while others and self.total_bytes is not None and held_bytes([*others, record]) > self.total_bytes:
                victims.append(others.pop(0))
            for victim in victims:
                del self._plans[(id(victim.owner), victim.key)]
            self._plans[slot] = record
            return record, victims

    def record(self, owner: PlanMemory, key: Hashable) -> PlanRecord | None:
        """`owner`'s plan `key` as accounted now, or None when it is not."""
        with self._lock:
            return self._plans.get((id(owner), key))

    def measured(self, owner: PlanMemory, key: Hashable, measured_bytes: int,
                 measured_run_bytes: int | None = None) -> PlanRecord | None:
        with self._lock:
            record = self._plans.get((id(owner), key))
            if record is not None:
                record.measured_bytes = measured_bytes
                record.measured_run_bytes = measured_run_bytes
                record.last_used = next(self._clock)
            return record

    def touch(self, owner: PlanMemory, key: Hashable) -> None:
        with self._lock:
            record = self._plans.get((id(owner), key))
            if record is not None:
                record.last_used = next(self._clock)

    def drop(self, owner: PlanMemory, key: Hashable) -> None:
        with self._lock:
            self._plans.pop((id(owner), key), None)


class PlanMemory:
    """The memory check for one model, on the device it runs on, cached per input shape.

    It profiles the graph it was given at load time, never the file again: a model file replaced
    or removed while serving must not change (or break) what the server enforces. It keeps only
    the graph's skeleton, not a second copy of the weights the session already holds.
    """

    def __init__(self, model: onnx.ModelProto | Skeleton, *, budget_bytes: int | None = None,
                 device: Device = Device.CPU, name: str = "", shared: MemoryBudget | None = None,
                 metrics: Metrics | None = None, runners: int = 1) -> None:
        self.model = load_skeleton(model)
        self.runners = runners  # batches this model runs at once (--cpu-runners): each holds its own running batch
        self.device = device
        self.name = name
        self.shared = shared
        self.budget_bytes = budget_bytes if budget_bytes is not None else (shared.total_bytes if shared else None)
        self.metrics = metrics
        self.on_evict: Callable[[Hashable], None] | None = None
        # What the model's plans hold once between them (its shared weights, as optimized), once known; else the
        # prediction's weights
        self.weights_held: int | None = None
        self._lock = threading.Lock()
        # (alone, of which its running batch) per plan, kept after eviction: a plan made again costs the same
        self._measured: dict[Hashable, tuple[int, int | None]] = {}
        # Per instance, not functools.lru_cache on the methods: that cache is shared by every
        # PlanMemory and keeps each one (and its graph) alive.
        self.terms = functools.lru_cache(maxsize=PROFILE_CACHE_SIZE)(self._terms)
        self.fitting_batch = functools.lru_cache(maxsize=PROFILE_CACHE_SIZE)(self._fitting_batch)

    # --- per batch ----------------------------------------------------------------------------
    def _terms(self, height: int, width: int, batch: int = 1) -> MemoryTerms:
        return profile_model(self.model, height=height, width=width, batch=batch, device=self.device).terms

    def predicted_bytes(self, height: int, width: int, batch: int = 1) -> int:
        """Predicted peak bytes of one session running `batch` inputs of [height, width] on this device."""
        return self.terms(height, width, batch).total

    def running_bytes(self, height: int, width: int, batch: int = 1) -> int:
        """What one plan of this shape needs with each of the model's runners running a batch of it."""
        return self.terms(height, width, batch).running(self.runners)

    @property
    def runners_said(self) -> str:
        """What a refusal adds when the model runs several batches at once."""
        return f" with {self.runners} batches of it running at once (--cpu-runners)" if self.runners > 1 else ""

    def _fitting_batch(self, height: int, width: int) -> int:
        """The largest batch of this input size within the budget (0: not even one); no budget: unbounded."""
        if self.budget_bytes is None:
            return 1 << 30
        with self._lock:
            return largest_batch(self.model, height=height, width=width, budget_bytes=self.budget_bytes,
                                 device=self.device, runs=self.runners)

    def require_batch(self, height: int, width: int, *, scale: int, largest_scale: Callable[[], int]) -> int:
        """The batch limit for this size; RESOURCE_EXHAUSTED with the numbers when one pass cannot fit."""
        try:
            limit = self.fitting_batch(height, width)
        except ProfileError as error:
            raise ScoringError(
                Refusal.INVALID_ARGUMENT,
                f"scale {scale} gives an input of {height}x{width} the model cannot take: {error}",
            ) from error
        if limit > 0:
            return limit
        raise self._too_large(f"scale {scale} ({height}x{width} input{self.runners_said})",
                              self.running_bytes(height, width),
                              "predicted", self.budget_bytes, largest_scale)

    def _too_large(self, what: str, needed: int, how: str, budget: int, largest_scale: Callable[[], int] | None) -> ScoringError:
        fits = largest_scale() if largest_scale is not None else None
        hint = ("" if fits is None else
                f"; the largest scale that fits is {fits}" if fits else "; no scale of this image fits")
        return ScoringError(
            Refusal.RESOURCE_EXHAUSTED,
            f"{what} needs a {how} {needed} bytes ({format_bytes(needed)}) on {self.device.value} "
            f"but the memory budget is {budget} bytes ({format_bytes(budget)}){self._of_workers()}{hint}",
        )

    def _of_workers(self) -> str:
        """Under --workers, that the budget a refusal names is within this process's share."""
        share = self.shared.share if self.shared is not None else 1
        return f" in this process, one of --workers {share}, each with 1/{share} of --memory-budget" * (share > 1)

    # --- per plan -----------------------------------------------------------------------------
    def make_room(self, key: Hashable, *, height: int, width: int, batch: int, scale: int | None = None,
                  largest_scale: Callable[[], int] | None = None) -> list[Hashable]:
        """Reserve a new plan's bytes in the shared budget; this model's plans to evict (LRU first)."""
        if self.shared is None:
            raise RuntimeError("plan accounting needs a MemoryBudget: PlanMemory(..., shared=budget)")
        try:
            predicted = self.terms(height, width, batch)
        except ProfileError as error:
            raise ScoringError(Refusal.INVALID_ARGUMENT,
                               f"plan {key} ({batch}x{height}x{width}) cannot be profiled: {error}") from error
        measured, measured_run = self._measured.get(key, (None, None))
        record, victims = self.shared.reserve(self, key, predicted, measured, measured_run)
        if victims is None:
            what = f"plan {key}" + (f" for scale {scale}" if scale is not None else "")
            how = "measured" if measured is not None else "predicted"
            raise self._too_large(what, record.alone_bytes, how, self.shared.total_bytes, largest_scale)
        mine = []
        for victim in victims:
            LOG.info("%s: plan %s evicted (least recently used) to make room for %s plan %s",
                     victim.owner.name, victim.key, self.name, key)
            victim.owner._forget_gauge(victim.key)
            if victim.owner is self:
                mine.append(victim.key)
            elif victim.owner.on_evict is not None:
                victim.owner.on_evict(victim.key)
        return mine

    def plan_created(self, key: Hashable, measured_bytes: int, *, run_bytes: int | None = None) -> None:
        """Record a made and warmed-up plan's measured footprint (device bytes on CUDA, RSS on the CPU): what it
        holds alone, its model's weights included, and on the CPU `run_bytes`, what of it its run took from the
        shared arena. A reading below the weights every session holds means memory was freed elsewhere
        meanwhile (bench_server read 0 B for a 115 MiB plan): admission keeps the prediction."""
        reserved = self.shared.record(self, key) if self.shared is not None else None
        if reserved is not None and measured_bytes < reserved.predicted.weights:
            LOG.debug("%s: plan %s measured %d bytes, below its %d bytes of weights: not used", self.name, key,
                      measured_bytes, reserved.predicted.weights)
            return
        self._measured[key] = (measured_bytes, run_bytes)
        record = self.shared.measured(self, key, measured_bytes, run_bytes) if self.shared is not None else None
        if record is None:
            return
        expected = record.predicted.resident
        self._check(key, "", measured_bytes, expected)
        if run_bytes is not None:
            self._check(key, "'s running batch", run_bytes, record.predicted.per_run)
        if self.metrics is not None:
            gauge = self.metrics.plan_memory
            gauge.labels(self.name, str(key), "measured").set(measured_bytes)
            gauge.labels(self.name, str(key), "predicted").set(expected)

    def _check(self, key: Hashable, what: str, measured: int, expected: int) -> None:
        """Log a measurement off its prediction by more than the tolerance and the measurement's resolution."""
        ratio = measured / expected if expected else float("inf")
        if abs(ratio - 1) > PREDICTION_TOLERANCE and abs(measured - expected) > MEASUREMENT_RESOLUTION_BYTES:
            LOG.warning("%s: plan %s%s measured %s on %s, predicted %s (%.2fx): the memory model is off for this "
                        "model; admission uses the measurement", self.name, key, what, format_bytes(measured),
                        self.device.value, format_bytes(expected), ratio)

    def plan_used(self, key: Hashable) -> None:
        """The plan ran: most recently used now."""
        if self.shared is not None:
            self.shared.touch(self, key)

    def oldest_plan(self) -> Hashable | None:
        """This model's least recently used plan in the shared budget's order (None: none, or no budget)."""
        return self.shared.oldest(self) if self.shared is not None else None

    def plan_evicted(self, key: Hashable) -> None:
        """The plan was dropped (or could not be made): its bytes go back to the budget."""
        if self.shared is not None:
            self.shared.drop(self, key)
        self._forget_gauge(key)

    def _forget_gauge(self, key: Hashable) -> None:
        if self.metrics is None:
            return
        for kind in ("measured", "predicted"):
            try:
                self.metrics.plan_memory.remove(self.name, str(key), kind)
            except KeyError:
                pass

