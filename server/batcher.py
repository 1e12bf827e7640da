"""Dynamic batching: passes of the same shape from concurrent requests run as one batch.

As in Triton's dynamic batcher: the first waiting pass waits at most `max_delay` for others of its
shape, up to a batch limit (the smaller of `max_batch` and what fits the memory budget). The queue
is bounded (RESOURCE_EXHAUSTED when full); passes whose deadline passed are dropped before compute
(DEADLINE_EXCEEDED) and a cancelled request's passes leave the queue at once.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np

from server.errors import ScoringError

LOG = logging.getLogger(__name__)
POLL_SECONDS = 0.05  # how often a waiting caller looks at its cancellation flag
CLOSE_SECONDS = 10.0  # how long close waits for the batch being computed before leaving the (daemon) worker


@dataclass(eq=False)
class Work:
    """One pass: an [H, W, C] image in, its [K, h, w] scores out."""

    image: np.ndarray
    limit: int
    deadline: float | None
    enqueued: float = field(default_factory=time.monotonic)
    started: float = 0.0
    run_seconds: float = 0.0
    batch_id: int = -1
    batch_size: int = 0
    result: np.ndarray | None = None
    error: ScoringError | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.image.shape

    def fail(self, error: ScoringError) -> None:
        self.error = error
        self.done.set()


class Batcher:
    """A bounded queue and one worker thread running batches through `run`."""

    def __init__(
        self,
        run: Callable[[list[np.ndarray]], np.ndarray],
        *,
        max_batch: int,
        max_delay_seconds: float,
        queue_depth: int,
        on_batch: Callable[[tuple[int, ...], int], None] | None = None,
        name: str = "model",
    ) -> None:
        self._run = run
        self._max_batch = max(1, max_batch)
        self._max_delay = max_delay_seconds
        self._queue_depth = queue_depth
        self._on_batch = on_batch
        self._queue: list[Work] = []
        self._condition = threading.Condition()
        self._closed = False
        self._batch_ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name=f"batcher-{name}", daemon=True)
        self._thread.start()

    def depth(self) -> int:
        """Passes waiting (not yet running)."""
        with self._condition:
            return len(self._queue)

    def submit(self, images: Sequence[np.ndarray], *, limits: Sequence[int], deadline: float | None) -> list[Work]:
        """Queue all passes of one request, or none: RESOURCE_EXHAUSTED when they would overflow the queue."""
        works = [Work(image, limit, deadline) for image, limit in zip(images, limits)]
        with self._condition:
            if self._closed:
                raise ScoringError(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
            if len(self._queue) + len(works) > self._queue_depth:
                raise ScoringError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"queue full: {len(self._queue)} passes waiting, this request adds {len(works)}, the limit "
                    f"is {self._queue_depth} (--queue-depth); retry with backoff",
                )
            self._queue.extend(works)
            self._condition.notify_all()
        return works

    def cancel(self, works: Sequence[Work]) -> None:
        """Take the passes that have not started out of the queue."""
        with self._condition:
            dropped = set(works)
            self._queue = [w for w in self._queue if w not in dropped]
            self._condition.notify_all()

    def wait(self, works: Sequence[Work], *, cancelled: threading.Event | None = None) -> list[np.ndarray]:
        """The passes' scores, in order; raises their error, or CANCELLED / DEADLINE_EXCEEDED while queued."""
        for work in works:
            while not work.done.wait(POLL_SECONDS):
                if cancelled is not None and cancelled.is_set():
                    self.cancel(works)
                    raise ScoringError(grpc.StatusCode.CANCELLED, "the call was cancelled")
                if work.deadline is not None and time.monotonic() > work.deadline and not work.started:
                    self.cancel(works)
                    if not work.started:  # still not taken once out of the queue: never computed
                        raise ScoringError(
                            grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"the deadline passed after {1000 * (time.monotonic() - work.enqueued):.0f} ms "
                            "in the queue, before compute",
                        )
            if work.error is not None:
                self.cancel(works)
                raise work.error
        return [work.result for work in works]

    def close(self) -> None:
        """Fail what is still queued with UNAVAILABLE and stop the worker."""
        with self._condition:
            self._closed = True
            for work in self._queue:
                work.fail(ScoringError(grpc.StatusCode.UNAVAILABLE, "the server is shutting down"))
            self._queue.clear()
            self._condition.notify_all()
        self._thread.join(timeout=CLOSE_SECONDS)

    def _take_batch(self) -> list[Work] | None:
        with self._condition:
            while True:
                if self._closed:
                    return None
                self._drop_expired()
                if not self._queue:
                    self._condition.wait()
                    continue
                first = self._queue[0]
                limit = max(1, min(self._max_batch, first.limit))
                same = [w for w in self._queue if w.shape == first.shape][:limit]
                remaining = first.enqueued + self._max_delay - time.monotonic()
                if len(same) < limit and remaining > 0:
                    self._condition.wait(remaining)
                    continue
                taken = set(same)
                self._queue = [w for w in self._queue if w not in taken]
                started, batch_id = time.monotonic(), next(self._batch_ids)
                for work in same:  # marked under the lock, so a cancel sees them as started
                    work.started, work.batch_id, work.batch_size = started, batch_id, len(same)
                return same

    def _drop_expired(self) -> None:
        now = time.monotonic()
        kept = []
        for work in self._queue:
            if work.deadline is not None and now > work.deadline:
                work.fail(ScoringError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"the deadline passed after {1000 * (now - work.enqueued):.0f} ms in the queue; dropped before compute",
                ))
            else:
                kept.append(work)
        self._queue = kept

    def _loop(self) -> None:
        while (batch := self._take_batch()) is not None:
            if self._on_batch is not None:
                try:
                    self._on_batch(batch[0].shape, len(batch))
                except Exception:  # a failing metrics hook is a bug to log, never a reason to stop serving
                    LOG.exception("the batch hook failed; the batch runs anyway")
            started = time.monotonic()
            try:
                scores = self._run([work.image for work in batch])
            except Exception as error:  # a failed run fails its batch, never the worker
                failure = ScoringError(grpc.StatusCode.INTERNAL, f"inference failed: {error}")
                for work in batch:
                    work.fail(failure)
                continue
            elapsed = time.monotonic() - started
            for work, result in zip(batch, scores):
                work.result, work.run_seconds = result, elapsed
                work.done.set()
