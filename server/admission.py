"""Admission, the one module that refuses a request before compute, and the memory it accounts.

`admit(request, model, deadline=) -> Ticket` runs `CHECKS`, one ordered list of small checks each
returning its refusal (or None): the request's fields (the image's first bytes included), then the
queue's room and expected wait, then the image's header, then what the header tells (every scale's
canvas, or its tiles on one, and batch limit in memory, the tiles' queue places, the response's size,
the host memory). The ticket holds the queue places and the host bytes together and gives both back
in `release`, the one way out.

Memory: what a batch or a plan will need, against a budget, before it runs. Predictions are
`convert.profile`'s for the device the model runs on (the terms `scoremap-inspect --device` prints),
so what users are shown is what the server enforces. Two ways to use it:

* Per batch: `Admission.admit(height, width, scale=, largest_scale=)` returns the largest batch of that
  input size within the model's `budget_bytes`, or refuses with RESOURCE_EXHAUSTED and the
  numbers; `batch_limit` and `predicted_bytes(height, width, batch)` answer the questions behind it.
* Per plan (one session per fixed shape, server/plans.py): every model's plans draw on one
  `MemoryBudget` per server (server/plans.py). The plan cache asks, before making a plan,

      evict = admission.make_room(key, height=, width=, batch=, scale=, largest_scale=)

  which reserves the plan's bytes (its measured footprint when this key was made before, else the
  prediction) and returns this model's plans to drop, least recently used first; plans of other
  models chosen for eviction are handed to their Admission's `on_evict(key)` (called outside any
  lock). It raises ScoringError(RESOURCE_EXHAUSTED) with the bytes, the budget and the largest
  scale that fits when the plan cannot fit even with every other plan evicted. Then, once the plan
  is made and warmed up (`server.runtime_memory.measure_footprint`):

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

import collections
import contextlib
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import onnx

from convert.memory_model import Device, MemoryTerms
from convert.profile import ProfileError, Skeleton, largest_batch, load_skeleton, profile_model
from server.runtime_memory import release_free_memory
from protos import scoring_pb2
from server import dense, imaging, tiling
from server.device_graph import DeviceGraphError
from server.errors import NoRoom, Refusal, ScoringError, Transient, retry_after
from server.host_memory import DEVICE_PASSES, HostEstimate, TiledScale, estimate_request
from server.metrics import Metrics
from server.request import ScaleJob, TileJob, top_k
from server.settings import Settings

if TYPE_CHECKING:
    from server.batcher import Batcher, Reservation
    from server.plans import MemoryBudget
    from server.loading import Model

LOG = logging.getLogger(__name__)
PROFILE_CACHE_SIZE = 1024  # input sizes (and batch sizes) whose predictions each model remembers
PREDICTION_TOLERANCE = 0.25  # a plan measured further than this from its prediction is logged ...
MEASUREMENT_RESOLUTION_BYTES = 4 * 2**20  # ... and by more than this: RSS moves by a few MiB on its own

__all__ = ["Admission", "HostBudget", "RefusalPacer", "admit_host", "available_memory_bytes",
           "format_bytes"]
TRIM_AFTER_BYTES = 256 * 2**20  # host memory held by requests since the last trim that makes going idle trim
BURST_SECONDS = 1.0  # a second's worth of refusals at the pace is answered at once: an honest burst is never held
ANSWER_WINDOW_SECONDS = 1.0  # the refusal pace follows the calls answered over this window
ANSWER_MARGIN_SECONDS = 0.05  # a held refusal is answered this long before its call's deadline, to arrive in time
REMEMBERED_REFUSALS = 4096  # refused requests' keys the refusal pacer remembers at most, the oldest forgotten first


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
        self._requests = 0  # in flight
        self._since_trim = 0  # bytes held by the requests ended since the last trim
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

    def take(self, estimate: HostEstimate) -> None:
        """Hold a request's estimated bytes; RESOURCE_EXHAUSTED when the requests in flight leave too little."""
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
                    retry_after_seconds=None if alone else retry_after(Transient.HOST_MEMORY),
                )
            self._held += needed
            self._requests += 1

    def give_back(self, held_bytes: int) -> None:
        """A request ended. When it was the last in flight and requests have held `TRIM_AFTER_BYTES` since the
        last time, glibc's freed memory goes back to the system (malloc_trim): it would keep it, and idle RSS
        ratcheted up after large requests (issue 14). Not after each request: memory given back is faulted in
        again."""
        with self._lock:
            self._held -= held_bytes
            self._requests -= 1
            self._since_trim += held_bytes
            trim = self._requests == 0 and self._since_trim > TRIM_AFTER_BYTES
            if trim:
                self._since_trim = 0
        if trim:
            release_free_memory()

    @contextlib.contextmanager
    def hold(self, estimate: HostEstimate) -> Iterator[None]:
        self.take(estimate)
        try:
            yield
        finally:
            self.give_back(estimate.total)


class RefusalPacer:
    """How the server slows callers it refuses: one per server, shared by its edges (issue 22, item 4).

    A client that resends at once on a refusal (a naive retry loop, an HTTP load balancer) ignores the
    retry hint, and each refusal still costs a call's server CPU under the one GIL, which inference
    needs: 64 such clients were refused 1,230 times a second, and goodput fell to 13%. Two measures:

    - Refusals are paced. An open loop refused as fast does not resend, and its refusals must stay fast
      (issue 10: median < 5 ms at 5x capacity), so the pace follows what the server answers: refusals
      are answered at once up to `per_answer` times the calls answered over the last second, and never
      below `floor` a second (bursts of a second's worth: a generic cell rate algorithm). Beyond that
      pace each refusal is held for its turn, at most `max_hold` seconds and never past its deadline.
    - Resends wait at the door. A request the server refused in the last `resend_memory` seconds that
      comes again, byte for byte (its `key`), while the server is refusing, waits until a call gives back
      its place other than by a transient refusal (the oldest such waiter first; a place freed after the
      last refusal was found, with no one waiting, is taken at once), at most `max_hold` seconds, and only
      then goes on to be admitted or refused. Paced refusals alone still answered 6 a call to clients
      that came straight back (a fifth of a 2-core machine's capacity lost); at the door such clients
      wait for room instead, as in a queue.

    At most `max_held` calls are held at once, at the door or for a turn (each holds the edge's thread or
    task); beyond that a call goes on, or is refused, at once. Transport-free; an edge calls `answered()`
    for each call answered OK, `freed()` for each place given back other than by a transient refusal, and
    does

        with pacer.door(key, wake=event.set, deadline=deadline) as seconds:  # 0.0: go on now
            wait up to `seconds` for the event, set by `wake` or when the call is cancelled
        ... and for a transient refusal:
        with pacer.hold(key, deadline=deadline) as seconds:  # 0.0: answer now
            wait up to `seconds`, waking early when the call is cancelled
        answer the refusal, with its retry hint
    """

    def __init__(self, *, per_answer: float, floor: float, max_hold: float, max_held: int,
                 resend_memory: float = 0.0) -> None:
        self.per_answer = per_answer
        self.floor = floor  # per_answer and floor both 0: never held
        self.max_hold = max_hold
        self.max_held = max_held
        self.resend_memory = resend_memory  # 0: no door
        self._next = 0.0  # when the next refusal at the pace is due (the algorithm's theoretical arrival time)
        self._held = 0
        self._answers: collections.deque[float] = collections.deque()  # when calls were answered, the last second
        self._refused: dict[Hashable, float] = {}  # the keys of requests refused, when, oldest first
        self._last_refusal = -math.inf
        self._door: collections.deque[Callable[[], None]] = collections.deque()  # waiting resends, oldest first
        self._freed: collections.deque[float] = collections.deque()  # when calls freed places no resend took
        self._lock = threading.Lock()

    @classmethod
    def for_settings(cls, settings: Settings) -> RefusalPacer:
        return cls(per_answer=settings.refusals_per_answer, floor=settings.refusals_per_second,
                   max_hold=settings.max_refusal_hold_ms / 1000, max_held=settings.max_held_refusals,
                   resend_memory=settings.resend_memory_seconds)

    def answered(self) -> None:
        """A call was answered OK: the pace follows these."""
        with self._lock:
            now = time.monotonic()
            self._answers.append(now)
            self._forget(now)

    def freed(self) -> None:
        """A call gave back its place other than by a transient refusal (answered, failed, cancelled): the
        oldest resend waiting at the door goes on to take it, or the next to come does."""
        with self._lock:
            now = time.monotonic()
            self._forget(now)
            if self._door:
                with contextlib.suppress(RuntimeError):  # an HTTP waiter whose event loop has closed
                    self._door.popleft()()
            else:
                self._freed.append(now)

    def pace(self, now: float) -> float:
        """Refusals a second answered at once at `now` (0: never held); call under the lock."""
        self._forget(now)
        return max(self.floor, self.per_answer * len(self._answers) / ANSWER_WINDOW_SECONDS)

    def _forget(self, now: float) -> None:
        """Drop the answers older than their window, and the refused keys older than `resend_memory` or
        beyond REMEMBERED_REFUSALS (under the lock): a server that never refuses keeps a window's answers."""
        while self._answers and self._answers[0] <= now - ANSWER_WINDOW_SECONDS:
            self._answers.popleft()
        while self._freed and self._freed[0] <= now - ANSWER_WINDOW_SECONDS:
            self._freed.popleft()
        while self._refused:
            key, when = next(iter(self._refused.items()))
            if when > now - self.resend_memory and len(self._refused) <= REMEMBERED_REFUSALS:
                break
            del self._refused[key]

    @property
    def held(self) -> int:
        """Calls being held now, at the door or for their turn."""
        with self._lock:
            return self._held

    @property
    def refusing(self) -> bool:
        """The door is on and a request was refused in the last second: only then may a call wait at the
        door (so an edge need not work out a call's key before)."""
        return bool(self.resend_memory) and self._refused_lately(time.monotonic())

    def _refused_lately(self, now: float) -> bool:
        return self._last_refusal > now - ANSWER_WINDOW_SECONDS

    def _bounded(self, seconds: float, now: float, deadline: float | None) -> float:
        seconds = min(seconds, self.max_hold)
        if deadline is not None:
            seconds = min(seconds, max(deadline - now - ANSWER_MARGIN_SECONDS, 0.0))
        return seconds

    def _take(self, key: Hashable | None, deadline: float | None, decided: float | None) -> float:
        """This refusal's hold in seconds, counted among the held when above 0; `key` remembered."""
        with self._lock:
            now = time.monotonic()
            self._last_refusal = now
            while self._freed and self._freed[0] <= (now if decided is None else decided):
                self._freed.popleft()  # there was no room when it was refused: those places were taken
            if key is not None and self.resend_memory:
                self._refused.pop(key, None)
                self._refused[key] = now
            pace = self.pace(now)  # which forgets what is too old
            if not pace:
                return 0.0
            wait = max(self._next - BURST_SECONDS - now, 0.0)
            if wait and self._held >= self.max_held:
                return 0.0  # no thread to hold it on: answered at once, outside the pace
            if wait <= self.max_hold:  # its turn is within the bound: it takes that turn
                self._next = max(self._next, now) + 1 / pace
            seconds = self._bounded(wait, now, deadline)
            if seconds:
                self._held += 1
            return seconds

    def hold(self, key: Hashable | None = None, *, deadline: float | None = None,
             decided: float | None = None) -> contextlib.AbstractContextManager[float]:
        """The seconds to hold this refusal of the request `key` (None: not one to recognise again) before
        answering it (0.0: at once); `deadline` a time.monotonic() instant, `decided` when it was found (by
        default now). The hold counts among the held until the block ends."""
        return self._counted(self._take(key, deadline, decided))

    def _enter(self, key: Hashable, wake: Callable[[], None], deadline: float | None) -> float:
        """The seconds a call of request `key` waits at the door (0.0: none), `wake` queued when above 0."""
        with self._lock:
            now = time.monotonic()
            self._forget(now)
            when = self._refused.get(key)
            if when is None or not self._answers or not self._refused_lately(now) or self._held >= self.max_held:
                return 0.0  # not a resend, no answer to wait for, no refusals now, or no thread to hold it on
            if self._freed:
                self._freed.popleft()
                return 0.0  # an answer freed a place after the last refusal was found: it goes to take it
            seconds = self._bounded(self.max_hold, now, deadline)
            if seconds:
                self._held += 1
                self._door.append(wake)
            return seconds

    def door(self, key: Hashable, *, wake: Callable[[], None],
             deadline: float | None = None) -> contextlib.AbstractContextManager[float]:
        """The seconds a call of request `key` waits for room before it goes on (0.0: at once), during which
        `wake` is called (under the pacer's lock: it must only signal) when a place is freed for it.
        The wait counts among the held until the block ends."""
        return self._counted(self._enter(key, wake, deadline), wake)

    @contextlib.contextmanager
    def _counted(self, seconds: float, wake: Callable[[], None] | None = None) -> Iterator[float]:
        """`seconds` of holding, counted among the held (when above 0) until the block ends; then `wake`
        leaves the door, if no answer took it first."""
        try:
            yield seconds
        finally:
            if seconds:
                with self._lock:
                    self._held -= 1
                    if wake is not None:
                        with contextlib.suppress(ValueError):
                            self._door.remove(wake)


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
        record, victims = self.shared.reserve(self, key, predicted, measured)
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
        """Record a made and warmed-up plan's measured footprint (device bytes on CUDA, RSS on the CPU). A
        reading below the weights every session holds means memory was freed elsewhere meanwhile (bench_server
        read 0 B for a 115 MiB plan): admission keeps the prediction."""
        reserved = self.shared.record(self, key) if self.shared is not None else None
        if reserved is not None and measured_bytes < reserved.predicted.weights:
            LOG.debug("%s: plan %s measured %d bytes, below its %d bytes of weights: not used", self.name, key,
                      measured_bytes, reserved.predicted.weights)
            return
        self._measured[key] = measured_bytes
        record = self.shared.measured(self, key, measured_bytes) if self.shared is not None else None
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


# --- the request: every check before compute, in one ordered list ---------------------------------

@dataclass(eq=False)
class Ticket:
    """A request being admitted, then admitted: what it will run, and what it holds until `release`
    (its places in the model's queue, until its items are queued; its host bytes, until it ends)."""

    request: scoring_pb2.ScoreRequest
    model: Model
    deadline: float | None
    scales: list[int] = field(default_factory=list)
    passes: dense.Passes | None = None
    flips: tuple[bool, ...] = (False,)
    places: Reservation | None = None
    opened: imaging.OpenedImage | None = None
    jobs: list[ScaleJob] = field(default_factory=list)
    host: HostEstimate | None = None
    held_bytes: int = 0

    @property
    def original(self) -> tuple[int, int]:
        return self.opened.height, self.opened.width

    def release(self) -> None:
        """Give back the queue places (nothing once queued) and the host bytes; once, the one way out."""
        if self.places is not None:
            self.model.batcher.release(self.places)
        held, self.held_bytes = self.held_bytes, 0
        if held:
            self.model.host_budget.give_back(held)

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def invalid(message: str) -> ScoringError:
    return ScoringError(Refusal.INVALID_ARGUMENT, message)


def check_scales(ticket: Ticket) -> ScoringError | None:
    model, limits = ticket.model, ticket.model.limits
    scales = ticket.scales = list(ticket.request.scales) or [model.default_scale]
    if len(scales) > limits.max_scales:
        return invalid(f"{len(scales)} scales requested; at most {limits.max_scales} are allowed (--max-scales)")
    for scale in scales:
        if not model.min_scale <= scale <= limits.max_scale:
            return invalid(
                f"scale {scale} is outside [{model.min_scale}, {limits.max_scale}] (the target shorter side in "
                f"pixels; model {model.name} needs at least its training size {model.training_size})"
            )
    if len(set(scales)) != len(scales):
        return invalid(f"scales {scales} repeat a value; give each scale once")
    return None


def check_fields(ticket: Ticket) -> ScoringError | None:
    request, model = ticket.request, ticket.model
    if request.top_k < 0 or request.cell_top_k < 0:
        return invalid(f"top_k and cell_top_k must be >= 0; received {request.top_k} and {request.cell_top_k}")
    bad = [c for c in request.classes if not 0 <= c < model.classes]
    if bad:
        return invalid(f"classes {bad} are out of range: model {model.name} has classes 0..{model.classes - 1}")
    if request.map_dtype not in scoring_pb2.MapDtype.values():
        return invalid(f"map_dtype {request.map_dtype} is not a MapDtype; use one of "
                       f"{', '.join(scoring_pb2.MapDtype.keys())}")
    if request.output_stride < 0:
        return invalid(f"output_stride must be 0 (native) or positive; received {request.output_stride}")
    return None


def choose_passes(ticket: Ticket) -> ScoringError | None:
    request, model = ticket.request, ticket.model
    try:
        ticket.passes = dense.passes_for(native_stride=model.card.output_stride, output_stride=request.output_stride,
                                         shift=request.shift)
    except dense.PassesError as error:
        return invalid(f"model {model.name}: {error}")
    ticket.flips = (False, True) if request.flip else (False,)
    return None


def check_image_field(ticket: Ticket) -> ScoringError | None:
    """The image is there, and its first bytes are an image's: a permanent refusal stays one under load."""
    kind = ticket.request.WhichOneof("image")
    if kind is None:
        return invalid("the request has no image: set `encoded` (JPEG, PNG, WebP, BMP, TIFF bytes) or `raw` pixels")
    if kind == "encoded":
        try:
            imaging.check_encoded(ticket.request.encoded)
        except imaging.ImageError as error:
            return invalid(str(error))
    return None


def hold_places(ticket: Ticket) -> ScoringError | None:
    """Places in the model's queue, before the header is read: under overload most requests are refused,
    and each refusal then costs no header parsing or planning (26% of its server CPU, measured). A broken
    header is found once there is room, so under overload it is first refused as transient."""
    try:
        ticket.places = queue_places(ticket.model.batcher, len(ticket.scales) * len(ticket.flips),
                                     deadline=ticket.deadline)
    except ScoringError as error:
        return error
    return None


def queue_places(batcher: Batcher, items: int, *, deadline: float | None) -> Reservation:
    """`items` places in `batcher`'s queue, or the refusal saying why there is no room."""
    held = batcher.reserve(items, deadline=deadline)
    if isinstance(held, NoRoom):
        raise no_room(held, deadline=deadline)
    return held


def no_room(busy: NoRoom, *, deadline: float | None) -> ScoringError:
    """The refusal of a queue with no room for a request, with a retry hint from the queue's pace."""
    if busy.why is None:
        return ScoringError(Refusal.UNAVAILABLE, "the server is shutting down")
    if busy.why is Transient.QUEUE_FULL:
        return ScoringError(
            Refusal.RESOURCE_EXHAUSTED,
            f"queue full: {busy.waiting} items waiting or decoding, this request adds {busy.adding}, the limit is "
            f"{busy.depth} (--queue-depth); retry with backoff",
            retry_after_seconds=retry_after(busy.why, busy.seconds_per_item * busy.adding),
        )
    if busy.why is Transient.QUEUE_WAIT:
        kept = f" less {1000 * busy.margin:.0f} ms kept as a margin for the estimate" if busy.margin else ""
        return ScoringError(
            Refusal.RESOURCE_EXHAUSTED,
            f"overloaded: the expected wait in the queue is {1000 * busy.wait:.0f} ms, beyond --max-queue-ms "
            f"({1000 * busy.max_queue:.0f} ms){kept}; retry with backoff",
            retry_after_seconds=retry_after(busy.why, busy.wait + busy.margin - busy.max_queue),
        )
    left = max(deadline - time.monotonic(), 0) if deadline is not None else 0
    return ScoringError(
        Refusal.RESOURCE_EXHAUSTED,
        f"overloaded: the request would be done in about {1000 * busy.done:.0f} ms, after the call's "
        f"deadline ({1000 * left:.0f} ms from now); retry later or with a longer deadline",
        retry_after_seconds=retry_after(busy.why, busy.wait),
    )


def read_header(ticket: Ticket) -> ScoringError | None:
    """The image's header: its size, and nothing decoded yet."""
    request, limit = ticket.request, ticket.model.limits.max_image_pixels
    try:
        if request.WhichOneof("image") == "encoded":
            ticket.opened = imaging.open_image(request.encoded, max_pixels=limit)
        else:
            ticket.opened = imaging.from_raw(request.raw, max_pixels=limit)
    except imaging.ImageError as error:
        return invalid(str(error))
    return None


def fit_scales(ticket: Ticket) -> ScoringError | None:
    """Each scale's resized size, canvas bucket (or the tiles on one), kept cells and batch limit; refused when
    the image cannot take it."""
    try:
        ticket.jobs = [scale_job(ticket.model, ticket.original, scale, ticket.passes, flip=len(ticket.flips) > 1)
                       for scale in ticket.scales]
    except ScoringError as error:
        return error
    return None


def scale_job(model: Model, original: tuple[int, int], scale: int, passes: dense.Passes, *,
              flip: bool) -> ScaleJob:
    """How one scale runs: on the smallest canvas bucket that holds it; else tiled onto a bucket that holds
    the halo; else, when it fits --tile-canvas, on a canvas planned on demand (the tile canvas under
    --strict-shapes); else tiled onto the tile canvas (issue 20: no plan grows with the image)."""
    limit = model.limits.max_resized_pixels
    size = dense.resized_size(*original, scale=scale, multiple=model.card.size_multiple)
    if size[0] * size[1] > limit:
        raise invalid(
            f"scale {scale} resizes the {original[0]}x{original[1]} image to {size[0]}x{size[1]} = "
            f"{size[0] * size[1]} pixels, above the limit of {limit} (--max-resized-pixels, which follows from "
            "--max-request-host-bytes); use a smaller scale"
        )
    cells = job_cells(model, size, scale, passes)
    if 0 in cells:
        raise invalid(
            f"scale {scale} resizes the {original[0]}x{original[1]} image to {size[0]}x{size[1]}, smaller than "
            f"model {model.name}'s training size {model.card.training_height}x{model.card.training_width}; "
            "use a larger scale"
        )

    def on(canvas: tuple[int, int], tiles: tiling.TilePlan | None = None) -> ScaleJob:
        return ScaleJob(scale, size, canvas, cells, batch_limit(model, canvas, scale, passes, original), tiling=tiles,
                        tiles=() if tiles is None else tile_jobs(model, tiles, scale, passes))

    canvas = model.buckets.canvas_for(*size, slack=passes.slack)
    if canvas is not None:
        return on(canvas)
    tiles = tile_plan(model, size, passes, flip=flip)
    if isinstance(tiles, tiling.TilePlan):
        return on(tiles.canvas, tiles)
    canvas = model.canvas_for(size, passes)  # planned on demand, up to the tile canvas
    if canvas is not None:
        return on(canvas)
    tiles = tile_plan(model, size, passes, flip=flip, canvases=(model.tiling_canvas(size, passes),))
    if isinstance(tiles, tiling.TilePlan):
        return on(tiles.canvas, tiles)
    raise invalid(
        f"scale {scale} gives a {size[0]}x{size[1]} image (+{passes.slack} px for shifted passes) that no "
        f"canvas bucket holds ({model.buckets.describe()}), nor can it be tiled onto one or onto --tile-canvas "
        f"{model.tile_canvas[0]}x{model.tile_canvas[1]}: {tiles}; use a smaller scale, or restart the server with a "
        "larger --shape-buckets or --tile-canvas, or a smaller --halo"
    )


def job_cells(model: Model, size: tuple[int, int], scale: int, passes: dense.Passes) -> tuple[int, int]:
    """The lattice cells one pass over an image of `size` keeps (the passes' factor times the net's cells)."""
    try:
        return tuple(passes.factor * side for side in model.net_cells(*size))
    except DeviceGraphError as error:
        raise invalid(f"scale {scale} gives a {size[0]}x{size[1]} input model {model.name} cannot take: "
                      f"{error}") from error


def tile_plan(model: Model, size: tuple[int, int], passes: dense.Passes, *, flip: bool,
              canvases: Sequence[tuple[int, int]] | None = None) -> tiling.TilePlan | tiling.TilingError:
    """The tiles of a resized image on the canvas (of `canvases`, default the buckets) that computes the fewest
    pixels for it, with the server's --halo (None: exact); the largest canvas's TilingError when none holds the halo."""
    field = model.card.receptive_field
    plans, refusal = [], None
    for canvas in sorted(model.buckets.canvases if canvases is None else canvases, key=lambda c: c[0] * c[1]):
        try:
            plans.append(tiling.plan(
                size, canvas, field_size=field.size, field_center=(field.center_y, field.center_x),
                training=(model.card.training_height, model.card.training_width), passes=passes,
                halo=model.halo, multiple=model.multiple, flip=flip))
        except tiling.TilingError as error:
            refusal = error
    if not plans:
        return refusal
    return min(plans, key=lambda plan: (len(plan) * plan.canvas[0] * plan.canvas[1], plan.canvas))


def tile_jobs(model: Model, plan: tiling.TilePlan, scale: int, passes: dense.Passes) -> tuple[TileJob, ...]:
    """Each tile's own map cells and the cells of its lattice the image-level mean counts, as the one pass's:
    every map cell once (the cells it owns), and every cell of the mirrored lattice once (those whose
    unmirrored cell it owns; an edge tile also those landing beyond the image's edge)."""
    first_x = model.card.receptive_field.center_x - passes.slack
    last = len(plan.columns) - 1
    jobs = []
    for tile in plan:
        cells = job_cells(model, (tile.y.length, tile.x.length), scale, passes)
        rows, columns = tile.owned(cells)
        # Mirrored column m lands on unmirrored column anchor - m (dense.mirror_back).
        anchor = int(round((tile.x.length - 1 - 2 * first_x) / passes.stride))
        lowest = anchor - columns.stop + 1 if tile.column < last else 0
        highest = anchor - columns.start + 1 if tile.column > 0 else cells[1]
        mirrored = slice(max(lowest, 0), min(highest, cells[1]))
        jobs.append(TileJob(tile, cells, (rows, columns), (rows, mirrored)))
    return tuple(jobs)


def hold_tile_places(ticket: Ticket) -> ScoringError | None:
    """A tiled scale is one item per tile and orientation: the places held before the header was read
    (one per scale and orientation) become the request's whole count."""
    items = sum(job.parts for job in ticket.jobs) * len(ticket.flips)
    if ticket.places is None or items == ticket.places.items:
        return None
    batcher = ticket.model.batcher
    batcher.release(ticket.places)
    ticket.places = None
    held = batcher.reserve(items, deadline=ticket.deadline)
    if not isinstance(held, NoRoom):
        ticket.places = held
        return None
    if held.why is Transient.QUEUE_FULL and items > held.depth:  # no retry makes room for it
        return ScoringError(
            Refusal.RESOURCE_EXHAUSTED,
            f"this request is {items} items (scales x orientations x tiles), more than the queue holds "
            f"({held.depth}, --queue-depth): it never fits; ask fewer or smaller scales, or restart the server with "
            "a larger --queue-depth or larger --shape-buckets (fewer tiles)",
        )
    return no_room(held, deadline=ticket.deadline)


def batch_limit(model: Model, canvas: tuple[int, int], scale: int, passes: dense.Passes,
                original: tuple[int, int]) -> int:
    """How many items of this canvas one batch may hold in memory (each runs all its passes), as a batch
    bucket: a batch is padded up to its bucket, so the limit is rounded down to one."""
    limit = model.admission.admit(*canvas, scale=scale, largest_scale=lambda: largest_scale(model, original, passes))
    items = limit // len(passes.offsets)
    if items == 0:
        raise ScoringError(
            Refusal.RESOURCE_EXHAUSTED,
            f"scale {scale} needs {len(passes.offsets)} passes of {canvas[0]}x{canvas[1]} at once but "
            f"only {limit} fit the memory budget; the largest scale that fits is "
            f"{largest_scale(model, original, passes)}",
        )
    if items >= model.buckets.batches[-1]:
        return items
    return max(bucket for bucket in model.buckets.batches if bucket <= items)


def largest_scale(model: Model, original: tuple[int, int], passes: dense.Passes) -> int:
    """The largest scale of this image whose passes fit the memory budget (0: none)."""
    step = model.multiple
    low, high = max(model.min_scale // step - 1, 0), model.limits.max_scale // step + 1  # low fits or is 0
    while high - low > 1:
        middle = (low + high) // 2
        # A scale beyond the tile canvas runs on it, tile by tile.
        canvas = model.canvas_for(dense.resized_size(*original, scale=middle * step, multiple=step),
                                  passes) or model.tile_canvas
        try:
            fits = model.admission.batch_limit(*canvas) >= len(passes.offsets)
        except ProfileError:  # a size the net cannot take
            fits = False
        if fits:
            low = middle
        else:
            high = middle
    return low * step


def check_response_size(ticket: Ticket) -> ScoringError | None:
    request, model, limit = ticket.request, ticket.model, ticket.model.limits.max_message_bytes
    expected = response_bytes(request, ticket.jobs, classes=model.classes, top_k=top_k(request, model.limits),
                              label_bytes=model.label_bytes)
    if expected > limit:
        return ScoringError(
            Refusal.RESOURCE_EXHAUSTED,
            f"the response would be about {expected} bytes, above the server's --max-message-bytes {limit}; ask "
            "for fewer `classes`, a smaller `cell_top_k`, `map_dtype` FLOAT16, fewer or smaller scales, or no maps",
        )
    return None


def check_host_memory(ticket: Ticket) -> ScoringError | None:
    """What the request will hold on the host, estimated from the header: within one request's limit, then
    held from the budget the requests in flight share."""
    request, model, passes = ticket.request, ticket.model, ticket.passes
    ticket.host = estimate_request(
        encoded_bytes=ticket.opened.encoded_bytes, image_size=ticket.original,
        resized_sizes=[job.canvas for job in ticket.jobs if job.tiling is None], passes=len(passes.offsets),
        flip=request.flip, classes=model.classes, native_stride=model.card.output_stride, output_stride=passes.stride,
        path=DEVICE_PASSES,
        tiled=[TiledScale(job.resized, job.canvas, len(job.tiles), max(t.cells[0] * t.cells[1] for t in job.tiles))
               for job in ticket.jobs if job.tiling is not None],
    )
    try:
        admit_host(ticket.host, limit_bytes=model.limits.max_request_host_bytes)
        model.host_budget.take(ticket.host)
    except ScoringError as error:
        return error
    ticket.held_bytes = ticket.host.total
    return None


# The measured order: the cheap checks of the fields first, then the queue's room and expected wait,
# then the header, then what the header tells (the canvas of every scale, the response's size, memory).
CHECKS: tuple[Callable[[Ticket], ScoringError | None], ...] = (
    check_scales, check_fields, choose_passes, check_image_field, hold_places, read_header, fit_scales,
    hold_tile_places, check_response_size, check_host_memory,
)


def admit(request: scoring_pb2.ScoreRequest, model: Model, *, deadline: float | None) -> Ticket:
    """The request checked whole before any pixel is decoded, or the first check's refusal; the ticket
    holds its queue places and host bytes until released (`with admit(...) as ticket:`)."""
    ticket = Ticket(request, model, deadline)
    try:
        for check in CHECKS:
            refused = check(ticket)
            if refused is not None:
                raise refused
    except BaseException:
        ticket.release()
        raise
    return ticket


FLOAT16_BYTES, FLOAT32_BYTES, INT32_BYTES = 2, 4, 4
OVERHEAD_BYTES = 4096  # geometry, timings, model name, warnings and framing of a response, generously
ENTRY_FRAMING_BYTES = 8  # an image-level top-k entry's tags and lengths


def response_bytes(request: scoring_pb2.ScoreRequest, jobs: list[ScaleJob], *, classes: int, top_k: int,
                   label_bytes: int) -> int:
    """An upper estimate of the response's size, known before any compute: the maps, the cells' top-k,
    the image's `top_k` entries, each with a label of up to `label_bytes`, and the echoed request id."""
    total = OVERHEAD_BYTES + len(request.request_id.encode()) + min(top_k, classes) * (
        INT32_BYTES + FLOAT32_BYTES + label_bytes + ENTRY_FRAMING_BYTES)
    for job in jobs:
        cells = job.cells[0] * job.cells[1]
        if request.return_maps:
            width = FLOAT16_BYTES if request.map_dtype == scoring_pb2.FLOAT16 else FLOAT32_BYTES
            total += cells * (len(request.classes) or classes) * width
        total += cells * min(request.cell_top_k, classes) * (INT32_BYTES + FLOAT32_BYTES)
    return total
