"""Memory admission: what a batch or a plan will need, against a budget, before it runs.

Predictions are `convert.profile`'s for the device the model runs on (the terms `scoremap-inspect
--device` prints), so what users are shown is what the server enforces. Two ways to use it:

* Per batch: `admit(height, width, scale=, largest_scale=)` returns the largest batch of that
  input size within the model's `budget_bytes`, or refuses with RESOURCE_EXHAUSTED and the
  numbers; `batch_limit` and `predicted_bytes(height, width, batch)` answer the questions behind it.
* Per plan (one session per fixed shape, server/plans.py): every model's plans draw on one
  `MemoryBudget` per server. The plan cache asks, before making a plan,

      evict = admission.make_room(key, height=, width=, batch=, scale=, largest_scale=)

  which reserves the plan's bytes (its measured footprint when this key was made before, else the
  prediction) and returns this model's plans to drop, least recently used first; plans of other
  models chosen for eviction are handed to their Admission's `on_evict(key)` (called outside any
  lock). It raises ScoringError(RESOURCE_EXHAUSTED) with the bytes, the budget and the largest
  scale that fits when the plan cannot fit even with every other plan evicted. Then, once the plan
  is made and warmed up (`convert.runtime_memory.measure_footprint`):

      admission.plan_created(key, measured_bytes)   # replaces the reservation, exports the gauge,
                                                     # logs when the prediction is off by > 25%
      admission.plan_used(key)                       # on every run: recency for LRU
      admission.plan_evicted(key)                    # when it is dropped (or its making failed)

  `key` is the plan cache's own hashable key; `height`, `width` are the net's input size and
  `batch` the images one run of the net sees (batch x passes when passes are made on the device).
  A plan is accounted at its measurement plus, on the CPU, the run memory it takes back while it
  runs (activations are freed after each run there; CUDA's arena keeps them, so they are measured).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import threading
from collections.abc import Callable, Hashable, Iterator

import onnx

from convert.memory_model import Device, MemoryTerms
from convert.profile import ProfileError, Skeleton, largest_batch, load_skeleton, profile_model
from server.errors import Refusal, ScoringError
from server.host_memory import HostEstimate
from server.metrics import Metrics
from server.settings import Settings

LOG = logging.getLogger(__name__)
PROFILE_CACHE_SIZE = 1024  # input sizes (and batch sizes) whose predictions each model remembers
PREDICTION_TOLERANCE = 0.25  # a plan measured further than this from its prediction is logged ...
MEASUREMENT_RESOLUTION_BYTES = 4 * 2**20  # ... and by more than this: RSS moves by a few MiB on its own

__all__ = ["Admission", "MemoryBudget", "PlanRecord", "HostBudget", "admit_host", "available_memory_bytes",
           "format_bytes"]
# A request refused because the requests in flight hold the host budget is told to retry after this.
HOST_RETRY_SECONDS = 0.5


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), or None."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1024
    return f"{count:.1f} GiB"


def admit_host(estimate: HostEstimate, *, limit_bytes: int) -> None:
    """RESOURCE_EXHAUSTED with every term when one request would hold more host memory than the limit."""
    if estimate.total > limit_bytes:
        raise ScoringError(
            Refusal.RESOURCE_EXHAUSTED,
            f"this request needs an estimated {estimate.total} bytes of host memory, {estimate.describe()}, "
            f"but one request may hold {limit_bytes} bytes ({format_bytes(limit_bytes)}, --max-request-host-bytes); "
            "ask for fewer or smaller scales, no flip or a coarser stride",
        )


class HostBudget:
    """Host memory the requests in flight may hold together (their estimates): one per server.

    `with budget.hold(estimate): ...` around a request's decode-to-response; a request that finds
    the others holding the room is refused with RESOURCE_EXHAUSTED and a retry hint (transient),
    one larger than the whole budget without (it never fits: `admit_host` says so first when the
    budget is at least `--max-request-host-bytes`)."""

    def __init__(self, total_bytes: int | None) -> None:
        self.total_bytes = total_bytes
        self._held = 0
        self._lock = threading.Lock()

    @classmethod
    def for_settings(cls, settings: Settings) -> HostBudget:
        """`--host-memory-budget`, else `host_memory_fraction` of MemAvailable, at least one largest request."""
        total = settings.host_memory_budget_bytes
        if total is None:
            available = available_memory_bytes()
            total = max(int(available * settings.host_memory_fraction), settings.max_request_host_bytes) if available else None
        return cls(total)

    def in_flight_bytes(self) -> int:
        with self._lock:
            return self._held

    @contextlib.contextmanager
    def hold(self, estimate: HostEstimate) -> Iterator[None]:
        needed = estimate.total
        with self._lock:
            if self.total_bytes is not None and self._held + needed > self.total_bytes:
                alone = needed > self.total_bytes
                raise ScoringError(
                    Refusal.RESOURCE_EXHAUSTED,
                    f"this request needs an estimated {needed} bytes of host memory ({format_bytes(needed)}); "
                    f"requests in flight hold {self._held} of the server's {self.total_bytes} bytes "
                    f"({format_bytes(self.total_bytes)}, --host-memory-budget)"
                    + ("; it does not fit even alone" if alone else "; retry with backoff"),
                    retry_after_seconds=None if alone else HOST_RETRY_SECONDS,
                )
            self._held += needed
        try:
            yield
        finally:
            with self._lock:
                self._held -= needed


@dataclasses.dataclass
class PlanRecord:
    """One plan in the budget: its prediction, its measurement once made, and when it was last used."""

    owner: Admission
    key: Hashable
    predicted: MemoryTerms
    measured_bytes: int | None
    last_used: int

    @property
    def accounted_bytes(self) -> int:
        """What the plan holds (measured, else predicted) plus what its runs take back on the CPU."""
        if self.measured_bytes is None:
            return self.predicted.total
        return self.measured_bytes + self.predicted.transient


class MemoryBudget:
    """The bytes every loaded model's plans may hold together on one device: one per server."""

    def __init__(self, total_bytes: int | None, *, device: Device) -> None:
        self.total_bytes = total_bytes
        self.device = device
        self._plans: dict[tuple[int, Hashable], PlanRecord] = {}
        self._lock = threading.Lock()
        self._clock = itertools.count()

    def used_bytes(self) -> int:
        with self._lock:
            return sum(record.accounted_bytes for record in self._plans.values())

    def plans(self) -> list[PlanRecord]:
        """Every plan accounted, least recently used first."""
        with self._lock:
            return sorted(self._plans.values(), key=lambda record: record.last_used)

    def _reserve(self, record: PlanRecord) -> list[PlanRecord] | None:
        """Account `record`, evicting least recently used plans to fit; the evicted, or None when it
        cannot fit even alone (nothing changed then)."""
        slot = (id(record.owner), record.key)
        with self._lock:
            others = sorted((r for s, r in self._plans.items() if s != slot), key=lambda r: r.last_used)
            if self.total_bytes is not None and record.accounted_bytes > self.total_bytes:
                return None
            used = sum(r.accounted_bytes for r in others) + record.accounted_bytes
            victims = []
            for victim in others:
                if self.total_bytes is None or used <= self.total_bytes:
                    break
                victims.append(victim)
                used -= victim.accounted_bytes
            for victim in victims:
                del self._plans[(id(victim.owner), victim.key)]
            self._plans[slot] = record
            return victims

    def _measured(self, owner: Admission, key: Hashable, measured_bytes: int) -> PlanRecord | None:
        with self._lock:
            record = self._plans.get((id(owner), key))
            if record is not None:
                record.measured_bytes = measured_bytes
                record.last_used = next(self._clock)
            return record

    def _touch(self, owner: Admission, key: Hashable) -> None:
        with self._lock:
            record = self._plans.get((id(owner), key))
            if record is not None:
                record.last_used = next(self._clock)

    def _drop(self, owner: Admission, key: Hashable) -> None:
        with self._lock:
            self._plans.pop((id(owner), key), None)


class Admission:
    """The memory check for one model, on the device it runs on, cached per input shape.

    It profiles the graph it was given at load time, never the file again: a model file replaced
    or removed while serving must not change (or break) what the server enforces. It keeps only
    the graph's skeleton, not a second copy of the weights the session already holds.
    """

    def __init__(self, model: onnx.ModelProto | Skeleton, *, budget_bytes: int | None = None,
                 device: Device = Device.CPU, name: str = "", shared: MemoryBudget | None = None,
                 metrics: Metrics | None = None) -> None:
        self.model = load_skeleton(model)
        self.device = device
        self.name = name
        self.shared = shared
        self.budget_bytes = budget_bytes if budget_bytes is not None else (shared.total_bytes if shared else None)
        self.metrics = metrics
        self.on_evict: Callable[[Hashable], None] | None = None
        self._lock = threading.Lock()
        self._measured: dict[Hashable, int] = {}  # kept after eviction: a plan made again costs the same
        # Per instance, not functools.lru_cache on the methods: that cache is shared by every
        # Admission and keeps each one (and its graph) alive.
        self.terms = functools.lru_cache(maxsize=PROFILE_CACHE_SIZE)(self._terms)
        self.batch_limit = functools.lru_cache(maxsize=PROFILE_CACHE_SIZE)(self._batch_limit)

    # --- per batch ----------------------------------------------------------------------------
    def _terms(self, height: int, width: int, batch: int = 1) -> MemoryTerms:
        return profile_model(self.model, height=height, width=width, batch=batch, device=self.device).terms

    def predicted_bytes(self, height: int, width: int, batch: int = 1) -> int:
        """Predicted peak bytes of one session running `batch` inputs of [height, width] on this device."""
        return self.terms(height, width, batch).total

    def _batch_limit(self, height: int, width: int) -> int:
        """The largest batch of this input size within the budget (0: not even one); no budget: unbounded."""
        if self.budget_bytes is None:
            return 1 << 30
        with self._lock:
            return largest_batch(self.model, height=height, width=width, budget_bytes=self.budget_bytes,
                                 device=self.device)

    def admit(self, height: int, width: int, *, scale: int, largest_scale: Callable[[], int]) -> int:
        """The batch limit for this size; RESOURCE_EXHAUSTED with the numbers when one pass cannot fit."""
        try:
            limit = self.batch_limit(height, width)
        except ProfileError as error:
            raise ScoringError(
                Refusal.INVALID_ARGUMENT,
                f"scale {scale} gives an input of {height}x{width} the model cannot take: {error}",
            ) from error
        if limit > 0:
            return limit
        raise self._too_large(f"scale {scale} ({height}x{width} input)", self.predicted_bytes(height, width),
                              "predicted", self.budget_bytes, largest_scale)

    def _too_large(self, what: str, needed: int, how: str, budget: int, largest_scale: Callable[[], int] | None) -> ScoringError:
        fits = largest_scale() if largest_scale is not None else None
        hint = ("" if fits is None else
                f"; the largest scale that fits is {fits}" if fits else "; no scale of this image fits")
        return ScoringError(
            Refusal.RESOURCE_EXHAUSTED,
            f"{what} needs a {how} {needed} bytes ({format_bytes(needed)}) on {self.device.value} "
            f"but the memory budget is {budget} bytes ({format_bytes(budget)}){hint}",
        )

    # --- per plan -----------------------------------------------------------------------------
    def make_room(self, key: Hashable, *, height: int, width: int, batch: int, scale: int | None = None,
                  largest_scale: Callable[[], int] | None = None) -> list[Hashable]:
        """Reserve a new plan's bytes in the shared budget; this model's plans to evict (LRU first)."""
        if self.shared is None:
            raise RuntimeError("plan accounting needs a MemoryBudget: Admission(..., shared=budget)")
        try:
            predicted = self.terms(height, width, batch)
        except ProfileError as error:
            raise ScoringError(Refusal.INVALID_ARGUMENT,
                               f"plan {key} ({batch}x{height}x{width}) cannot be profiled: {error}") from error
        measured = self._measured.get(key)
        record = PlanRecord(self, key, predicted, measured, next(self.shared._clock))
        victims = self.shared._reserve(record)
        if victims is None:
            what = f"plan {key}" + (f" for scale {scale}" if scale is not None else "")
            how = "measured" if measured is not None else "predicted"
            raise self._too_large(what, record.accounted_bytes, how, self.shared.total_bytes, largest_scale)
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

    def plan_created(self, key: Hashable, measured_bytes: int) -> None:
        """Record a made and warmed-up plan's measured footprint (device bytes on CUDA, RSS on the CPU)."""
        self._measured[key] = measured_bytes
        record = self.shared._measured(self, key, measured_bytes) if self.shared is not None else None
        if record is None:
            return
        expected = record.predicted.resident
        ratio = measured_bytes / expected if expected else float("inf")
        if abs(ratio - 1) > PREDICTION_TOLERANCE and abs(measured_bytes - expected) > MEASUREMENT_RESOLUTION_BYTES:
            LOG.warning("%s: plan %s measured %s on %s, predicted %s (%.2fx): the memory model is off for this "
                        "model; admission uses the measurement", self.name, key, format_bytes(measured_bytes),
                        self.device.value, format_bytes(expected), ratio)
        if self.metrics is not None:
            gauge = self.metrics.plan_memory
            gauge.labels(self.name, str(key), "measured").set(measured_bytes)
            gauge.labels(self.name, str(key), "predicted").set(expected)

    def plan_used(self, key: Hashable) -> None:
        """The plan ran: most recently used now."""
        if self.shared is not None:
            self.shared._touch(self, key)

    def plan_evicted(self, key: Hashable) -> None:
        """The plan was dropped (or could not be made): its bytes go back to the budget."""
        if self.shared is not None:
            self.shared._drop(self, key)
        self._forget_gauge(key)

    def _forget_gauge(self, key: Hashable) -> None:
        if self.metrics is None:
            return
        for kind in ("measured", "predicted"):
            try:
                self.metrics.plan_memory.remove(self.name, str(key), kind)
            except KeyError:
                pass
