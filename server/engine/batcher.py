"""Dynamic batching: items of one group (a canvas shape and its passes) from concurrent requests run as one batch.

As in Triton's dynamic batcher: the first waiting item waits at most `max_delay` for others of its
key, up to a batch limit (the smaller of `max_batch` and what fits the memory budget). The queue is
bounded; as Triton's queue policy, an item that waited longer than `max_queue` is dropped before
compute, and `reserve`, asked by admission before the image is even decoded, finds no room for a
request that would overflow the queue, not start within `max_queue` (less a margin for the estimate)
or not end by its deadline: it says why (`NoRoom`), admission refuses. A request holds its places
from then on, while it decodes, so requests admitted meanwhile count it. The limit is on the wait
for a request's first item: once that runs, its other items are its own work, not queueing. A
cancelled request's items leave the queue at once.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from setproctitle import setthreadtitle

from server.engine.client import QueueState
from server.engine.priority import lower_this_thread
from server.errors import Dropped, NoRoom, Refusal, ScoringError, Transient, retry_after, shutting_down

LOG = logging.getLogger(__name__)
POLL_SECONDS = 0.05  # how often a waiting caller looks at its cancellation flag
CLOSE_SECONDS = 10.0  # how long close waits for the batches being computed before leaving the (daemon) workers
SMOOTHING = 0.2  # weight of the newest batch in a moving average of seconds per item


def paced(known: float | None, newest: float) -> float:
    """A moving average of seconds per item with its newest batch's (`known` None: the first)."""
    return newest if known is None else SMOOTHING * newest + (1 - SMOOTHING) * known


class Reservation:
    """One request in the queue: the places it holds from its admission until its items are queued (or it
    fails), counted in the queue's room and the expected wait, so requests admitted while it decodes see it;
    then whether one of its items has started (its later items are then its own work, not queueing). No
    reference to the items: a cycle would keep their canvases alive until the garbage collector runs."""

    def __init__(self, batcher: Batcher, items: int) -> None:
        self._batcher = batcher
        self.items = items
        self.started = False

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._batcher.release(self)


@dataclass(eq=False)
class Work:
    """One item: its group `key` (items of one key can share a batch), what the runner needs, and what it gave back."""

    key: Hashable
    payload: Any
    limit: int
    deadline: float | None
    enqueued: float = field(default_factory=time.monotonic)
    request: Reservation | None = None  # shared by its request's items (`submit`)
    started: float = 0.0
    run_seconds: float = 0.0
    batch_id: int = -1
    batch_size: int = 0
    result: Any = None
    error: ScoringError | None = None
    done: threading.Event | None = field(default_factory=threading.Event)  # set as it ends; None: `on_done` alone hears
    on_done: Callable[[Work], None] | None = None  # told once it ends, on the thread that ended it

    def fail(self, error: ScoringError) -> None:
        self.error = error.detached()
        self.finish()

    def finish(self) -> None:
        """Its result or error is set: wake its caller, tell `on_done`."""
        if self.done is not None:
            self.done.set()
        if self.on_done is not None:
            try:
                self.on_done(self)
            except Exception:  # a failing hook is a bug to log, never a reason to stop a runner
                LOG.exception("an item's done hook failed")


@dataclass(eq=False)
class Claim:
    """A batch `Batcher.offer` gave the offering thread to run, in one of the runners' places."""

    batcher: Batcher
    batch: list[Work]
    place: int

    def run(self) -> None:
        self.batcher._run_in_place(self.batch, self.place)


class Batcher:
    """A bounded queue and `runners` worker threads, each running one batch at a time through `run`.

    `run(works)` returns one result per work, in order; it runs at most `runners` batches at once (the CPU's
    --cpu-runners; one on a GPU), each in a place: a worker thread's, or that of a thread which claimed its batch
    (`offer`'s `here`). A result's `planning_seconds` (one-off set-up inside the run) is left out of the pace the
    waits are estimated from.
    `take(key, n)`, when given, says how many of the n items of `key` ready to run the batch takes (the rest
    stay queued for the next); called under the queue's lock, it must not call back into the batcher.
    """

    def __init__(
        self,
        run: Callable[[list[Work]], Sequence[Any]],
        *,
        max_batch: int,
        max_delay_seconds: float,
        queue_depth: int,
        max_queue_seconds: float,
        on_batch: Callable[[list[Work]], None] | None = None,
        on_drop: Callable[[Dropped], None] | None = None,
        on_cpu: Callable[[float], None] | None = None,
        take: Callable[[Hashable, int], int] | None = None,
        name: str = "model",
        runners: int = 1,
        nice: int = 0,
    ) -> None:
        self._run = run
        self._take = take
        self._max_batch = max(1, max_batch)
        self._max_delay = max_delay_seconds
        self._queue_depth = queue_depth
        self._max_queue = max_queue_seconds
        self._on_batch = on_batch
        self._on_drop = on_drop
        self._on_cpu = on_cpu  # told each batch's CPU seconds on the thread that ran it, its answers included
        self._queue: list[Work] = []
        self._reserved = 0  # places held by admitted requests still decoding
        self._condition = threading.Condition()
        self._closed = False
        self._runners = max(1, runners)
        self._nice = nice  # the runners' scheduling priority (server/engine/priority.py)
        self._running_until: dict[int, float] = {}  # per place taken (a thread running a batch): its expected end
        self._seconds_per_item = 0.0
        self._batch_ids = itertools.count()
        names = [f"batcher-{name}"] if self._runners == 1 else [f"batcher-{name}-{i}" for i in range(self._runners)]
        self._threads = [threading.Thread(target=self._loop, name=thread, daemon=True) for thread in names]
        for thread in self._threads:
            thread.start()

    @property
    def queue_depth(self) -> int:
        """The most items that may wait or decode at once (--queue-depth)."""
        return self._queue_depth

    def depth(self) -> int:
        """Items waiting to run or still decoding (their places held): what `queue_depth` bounds."""
        with self._condition:
            return len(self._queue) + self._reserved

    def state(self) -> QueueState:
        """The queue now, as admission decides on it (a front process is sent it)."""
        with self._condition:
            return self._state()

    def _state(self) -> QueueState:
        """Under the condition's lock: the runners' expected end counts only when every runner is busy."""
        busy = len(self._running_until) >= self._runners
        return QueueState(len(self._queue) + self._reserved, min(self._running_until.values()) if busy else 0.0,
                          self._seconds_per_item, self._runners, self._max_batch, self._queue_depth, self._max_queue,
                          self._closed)

    def _queue_pace(self) -> float:
        """Seconds per item of the queue as a whole, every runner busy."""
        return self._seconds_per_item / self._runners

    def reserve(self, items: int, *, deadline: float | None) -> Reservation | NoRoom:
        """Hold `items` places for a request about to decode, or say why not (`QueueState.room`; admission refuses
        with it)."""
        with self._condition:
            no_room = self._state().room(items, deadline=deadline, now=time.monotonic())
            if no_room is not None:
                return no_room
            self._reserved += items
            return Reservation(self, items)

    def release(self, reservation: Reservation) -> None:
        """Give back what `reservation` still holds (nothing once its items are queued)."""
        with self._condition:
            self._release(reservation)

    def _release(self, reservation: Reservation) -> None:
        self._reserved -= reservation.items
        reservation.items = 0

    def submit(self, works: Sequence[Work], reservation: Reservation | None = None) -> None:
        """Queue all items of one request, or none, in the places `reservation` held for them:
        RESOURCE_EXHAUSTED when they would overflow the queue."""
        if reservation is not None and reservation.items != len(works):
            raise ValueError(f"{len(works)} items submitted in {reservation.items} reserved places")
        shared, now = reservation if reservation is not None else Reservation(self, 0), time.monotonic()
        for work in works:  # one request: its items expire together
            work.request, work.enqueued = shared, now
        with self._condition:
            if reservation is not None:
                self._release(reservation)
            if self._closed:
                raise shutting_down()
            waiting = len(self._queue) + self._reserved
            if waiting + len(works) > self._queue_depth:
                raise self._queue_full(waiting, len(works))
            self._queue.extend(works)
            self._condition.notify_all()

    def offer(self, works: Sequence[Work], *, deadline: float | None, here: bool = False) -> NoRoom | Claim | None:
        """Queue all items of one request now if the queue has room for them (`QueueState.room`, as `reserve`
        asks), else say why not: a reservation and its queueing in one step, for items that come decoded. With
        `here`, items a free runner would take at once as one batch (nothing queued, no wait for companions) are
        instead claimed for the calling thread, which runs them (`Claim.run`): no runner is woken for them."""
        shared, now = Reservation(self, 0), time.monotonic()
        for work in works:
            work.request, work.enqueued = shared, now
        with self._condition:
            no_room = self._state().room(len(works), deadline=deadline, now=now)
            if no_room is not None:
                return no_room
            if here and self._takes_at_once(works):
                return Claim(self, list(works), self._start(works))
            self._queue.extend(works)
            self._condition.notify_all()
        return None

    def _takes_at_once(self, works: Sequence[Work]) -> bool:
        """Under the lock: whether a free runner would take `works` as its next batch, now and whole."""
        first = works[0]
        if self._queue or self._max_delay > 0 or len(self._running_until) >= self._runners or self._closed:
            return False
        if len(works) > max(1, min(self._max_batch, first.limit)) or any(w.key != first.key for w in works):
            return False
        return len(works) == 1 or self._take is None or self._taken(first.key, len(works)) == len(works)

    def _start(self, batch: Sequence[Work]) -> int:
        """Under the lock: `batch` runs on the calling thread from now, in a runner's place; that place."""
        started, batch_id, place = time.monotonic(), next(self._batch_ids), threading.get_ident()
        self._running_until[place] = started + self._seconds_per_item * len(batch)
        for work in batch:  # marked under the lock, so a cancel sees them as started
            work.started, work.batch_id, work.batch_size = started, batch_id, len(batch)
            work.request.started = True
        return place

    def _run_in_place(self, batch: list[Work], place: int) -> None:
        """Run a batch `_start` gave a thread, then give its place back."""
        cpu = time.thread_time()
        try:
            self._run_batch(batch)
        finally:
            with self._condition:
                del self._running_until[place]
                if self._queue or self._closed:  # a runner waits for this place, or `close` for every batch
                    self._condition.notify_all()
            if self._on_cpu is not None:
                try:
                    self._on_cpu(time.thread_time() - cpu)
                except Exception:  # a failing metrics hook is a bug to log, never a reason to stop a runner
                    LOG.exception("the CPU hook failed")

    def process(self, works: Sequence[Work], reservation: Reservation, *,
                cancelled: threading.Event | None = None) -> list[Any]:
        """The run stage for one request: its items queued in the places it held, then their results."""
        self.submit(works, reservation)
        return self.wait(works, cancelled=cancelled)

    def _queue_full(self, waiting: int, adding: int) -> ScoringError:
        return NoRoom(Transient.QUEUE_FULL, waiting=waiting, adding=adding, depth=self._queue_depth, wait=0.0,
                      margin=0.0, done=0.0, max_queue=self._max_queue,
                      seconds_per_item=self._queue_pace()).refusal(deadline=None)

    def cancel(self, works: Sequence[Work], *, dropped: Dropped | None = None) -> None:
        """Take the items that have not started out of the queue; given `dropped`, count each one still in it as
        dropped for that reason (a runner counts those it took out as expired itself: each drop counts once)."""
        with self._condition:
            cancelled = set(works)
            kept = [w for w in self._queue if w not in cancelled]
            taken, self._queue = len(self._queue) - len(kept), kept
            self._condition.notify_all()
        if dropped is not None:
            for _ in range(taken):
                self._report_drop(dropped)

    def wait(self, works: Sequence[Work], *, cancelled: threading.Event | None = None) -> list[Any]:
        """The items' results, in order; raises their error, or CANCELLED / DEADLINE_EXCEEDED while queued."""
        for work in works:
            while not work.done.wait(POLL_SECONDS):
                if cancelled is not None and cancelled.is_set():
                    self.cancel(works)
                    raise ScoringError(Refusal.CANCELLED, "the call was cancelled")
                if work.deadline is not None and time.monotonic() > work.deadline and not work.started:
                    self.cancel(works, dropped=Dropped.DEADLINE)
                    if not work.started:  # still not taken once out of the queue: never computed
                        raise ScoringError(
                            Refusal.DEADLINE_EXCEEDED,
                            f"the deadline passed after {1000 * (time.monotonic() - work.enqueued):.0f} ms "
                            "in the queue, before compute",
                        )
            if work.error is not None:
                self.cancel(works)
                raise work.error.detached()  # a fresh one per caller: a batch's items share their error
        return [work.result for work in works]

    def close(self) -> None:
        """Fail what is still queued with UNAVAILABLE and stop the workers."""
        with self._condition:
            self._closed = True
            queued, self._queue = self._queue, []
            self._condition.notify_all()
        for work in queued:  # outside the lock, as every failure: an item's hook may send on a socket
            work.fail(shutting_down())
        ends = time.monotonic() + CLOSE_SECONDS
        for thread in self._threads:
            thread.join(timeout=max(0.0, ends - time.monotonic()))
        with self._condition:  # and for batches claimed by other threads (`offer`'s `here`)
            self._condition.wait_for(lambda: not self._running_until, timeout=max(0.0, ends - time.monotonic()))

    def _take_batch(self) -> list[Work] | None:
        """The next batch to run, None once closed. Items whose time ran out meanwhile are failed on the way,
        outside the queue's lock: an item's hook (a front's answer) may wait on a socket, and may cancel items."""
        while True:
            with self._condition:
                batch, expired = self._next_batch()
            if not expired:
                return batch
            self._fail_expired(expired)
            del expired  # a worker waiting for the next batch keeps no failed item's arrays alive

    def _fail_expired(self, expired: list[tuple[Work, ScoringError, Dropped]]) -> None:
        for work, error, reason in expired:
            work.fail(error)
            self._report_drop(reason)

    def _next_batch(self) -> tuple[list[Work] | None, list[tuple[Work, ScoringError, Dropped]]]:
        """Under the lock, waiting as long as it takes: a batch, or else the items that expired (taken out of
        the queue), or neither once closed."""
        while True:
            if self._closed:
                return None, []
            expired = self._take_expired()
            if expired:
                return None, expired
            if not self._queue or len(self._running_until) >= self._runners:  # a claimed batch holds a place
                self._condition.wait()
                continue
            first = self._queue[0]
            limit = max(1, min(self._max_batch, first.limit))
            same = [w for w in self._queue if w.key == first.key][:limit]
            remaining = first.enqueued + self._max_delay - time.monotonic()
            if len(same) < limit and remaining > 0:
                self._condition.wait(remaining)
                continue
            if self._take is not None and len(same) > 1:  # a lone item is a batch of one whatever the hook says
                same = same[:self._taken(first.key, len(same))]
            taken = set(same)
            self._queue = [w for w in self._queue if w not in taken]
            self._start(same)
            return same, []

    def _taken(self, key: Hashable, ready: int) -> int:
        """How many of the `ready` items of `key` the batch takes: the take hook's word, or all when it fails (a
        bug to log, never a reason to stop the worker)."""
        try:
            return min(ready, max(1, self._take(key, ready)))
        except Exception:
            LOG.exception("the take hook failed; the batch takes every ready item")
            return ready

    def _take_expired(self) -> list[tuple[Work, ScoringError, Dropped]]:
        """Take the items past their deadline, or that waited beyond `max_queue` with none of their request's
        started, out of the queue: each with its refusal and the reason to report."""
        now = time.monotonic()
        kept, expired = [], []
        for work in self._queue:
            waited = now - work.enqueued
            if work.deadline is not None and now > work.deadline:
                expired.append((work, ScoringError(
                    Refusal.DEADLINE_EXCEEDED,
                    f"the deadline passed after {1000 * waited:.0f} ms in the queue; dropped before compute",
                ), Dropped.DEADLINE))
            elif waited > self._max_queue and not work.request.started:
                expired.append((work, ScoringError(
                    Refusal.RESOURCE_EXHAUSTED,
                    f"overloaded: waited {1000 * waited:.0f} ms in the queue, beyond --max-queue-ms "
                    f"({1000 * self._max_queue:.0f} ms); dropped before compute, retry with backoff",
                    retry_after_seconds=retry_after(Transient.QUEUE_TIME, self._max_queue),
                ), Dropped.QUEUE_TIME))
            else:
                kept.append(work)
        if expired:
            self._queue = kept
        return expired

    def _report_drop(self, reason: Dropped) -> None:
        """Tell the hook (the metrics) of an item dropped before compute; a failing hook is a bug to log, never a
        reason to stop the worker."""
        if self._on_drop is None:
            return
        try:
            self._on_drop(reason)
        except Exception:
            LOG.exception("the drop hook failed")

    def _loop(self) -> None:
        setthreadtitle(threading.current_thread().name[:15])  # what top -H and /proc/PID/task/TID/comm show
        lower_this_thread(self._nice)
        while (batch := self._take_batch()) is not None:
            self._run_in_place(batch, threading.get_ident())
            del batch  # an idle worker must not keep the last batch's arrays alive

    def _run_batch(self, batch: list[Work]) -> None:
        if self._on_batch is not None:
            try:
                self._on_batch(batch)
            except Exception:  # a failing metrics hook is a bug to log, never a reason to stop serving
                LOG.exception("the batch hook failed; the batch runs anyway")
        started = time.monotonic()
        try:
            results = self._run(batch)
        except ScoringError as error:  # a refusal found at run time (a plan that cannot be made)
            for work in batch:
                work.fail(error)
            return
        except Exception as error:  # a failed run fails its batch, never the worker
            LOG.exception("inference failed")
            for work in batch:
                work.fail(ScoringError(Refusal.INTERNAL, f"inference failed: {error}"))
            return
        elapsed = time.monotonic() - started
        setup = sum(getattr(result, "planning_seconds", 0.0) for result in results)
        per_item = max(elapsed - setup, 0.0) / len(batch)
        with self._condition:
            self._seconds_per_item = paced(self._seconds_per_item or None, per_item)
        for work, result in zip(batch, results):
            work.result, work.run_seconds = result, elapsed - setup
            work.finish()
