"""Why a request does not get its answer, below every other server module: the one exception type,
and the reasons the stages share (a refusal, a transient one's retry hint, a queue's lack of room,
a drop before compute).

The core (pipeline, admission, the engine) says *why* with a `Refusal`; only the edges turn it into a
status code: gRPC's (server/edges/grpc/calls.py `status_code`) and HTTP's (server/edges/http/edge.py
`http_status`), so neither this module nor any core module imports grpc or knows HTTP. A refusal whose words more
than one module says (a full queue, a server shutting down) is made here, once.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from protos import RETRY_AFTER_KEY

__all__ = ["Dropped", "NoRoom", "RETRY_AFTER_KEY", "Refusal", "ScoringError", "Transient", "invalid", "retry_after",
           "shutting_down"]


class Refusal(enum.Enum):
    """Why a request did not get its answer; each is named after the gRPC status the edge answers with."""

    INVALID_ARGUMENT = enum.auto()  # the request, or its image, is wrong: fixing it is the caller's part
    NOT_FOUND = enum.auto()  # no such model
    RESOURCE_EXHAUSTED = enum.auto()  # too large for a limit, or (with a retry hint) overloaded for now
    UNAVAILABLE = enum.auto()  # shutting down or warming up
    UNAUTHENTICATED = enum.auto()  # no bearer token, or the wrong one
    DEADLINE_EXCEEDED = enum.auto()
    CANCELLED = enum.auto()
    FAILED_PRECONDITION = enum.auto()  # the server cannot run this (no GPU when one is required)
    INTERNAL = enum.auto()  # the model failed or gave no usable numbers


class Transient(enum.Enum):
    """Why a refusal holds only for now: the rows of the one table of retry hints."""

    QUEUE_FULL = enum.auto()  # --queue-depth: places free as items run
    QUEUE_WAIT = enum.auto()  # the expected wait is beyond --max-queue-ms
    DEADLINE = enum.auto()  # the request would end after its call's deadline
    QUEUE_TIME = enum.auto()  # an admitted item waited past --max-queue-ms, dropped before compute
    HOST_MEMORY = enum.auto()  # the requests in flight hold the host budget
    WARMING_UP = enum.auto()  # the server is not SERVING yet
    CALLS_BUSY = enum.auto()  # the edge's call limits (workers, calls per peer)


# The least a client is told to wait, by reason; where the server estimates when there will be room
# (the queue's pace), the hint is that estimate, never below this. Calls here last about one
# request's compute, so a busy edge and a warming server say a second; the host budget frees as
# requests end, half a second; the queue's floor is how often a waiting caller looks at its call.
RETRY_AFTER_SECONDS = {
    Transient.QUEUE_FULL: 0.05, Transient.QUEUE_WAIT: 0.05, Transient.DEADLINE: 0.05, Transient.QUEUE_TIME: 0.05,
    Transient.HOST_MEMORY: 0.5, Transient.WARMING_UP: 1.0, Transient.CALLS_BUSY: 1.0,
}


def retry_after(why: Transient, estimate: float = 0.0) -> float:
    """The retry hint of a transient refusal: the estimated seconds until there is room, at least the table's."""
    return max(estimate, RETRY_AFTER_SECONDS[why])


class Dropped(enum.Enum):
    """Why an admitted item left the queue without running (the metrics' `reason` label)."""

    QUEUE_TIME = "queue_time"  # it waited past `max_queue`
    DEADLINE = "deadline"  # its call's deadline passed


@dataclass(frozen=True)
class NoRoom:
    """Why a queue holds no places for a request (server/engine/batcher.py `reserve`), with the numbers behind it;
    `why` None when the batcher is closed."""

    why: Transient | None
    waiting: int  # items queued or decoding
    adding: int
    depth: int
    wait: float  # expected seconds before a new item runs
    margin: float
    done: float  # expected seconds until the request's items are all done
    max_queue: float
    seconds_per_item: float  # the queue's, every runner busy

    def refusal(self, *, deadline: float | None) -> ScoringError:
        """The refusal of a request the queue has no room for, with a retry hint from the queue's pace
        (`deadline`: the call's, time.monotonic(), for the words of a DEADLINE refusal)."""
        if self.why is None:
            return shutting_down()
        if self.why is Transient.QUEUE_FULL:
            return ScoringError(
                Refusal.RESOURCE_EXHAUSTED,
                f"queue full: {self.waiting} items waiting or decoding, this request adds {self.adding}, the limit "
                f"is {self.depth} (--queue-depth); retry with backoff",
                retry_after_seconds=retry_after(self.why, self.seconds_per_item * self.adding),
            )
        if self.why is Transient.QUEUE_WAIT:
            kept = f" less {1000 * self.margin:.0f} ms kept as a margin for the estimate" if self.margin else ""
            return ScoringError(
                Refusal.RESOURCE_EXHAUSTED,
                f"overloaded: the expected wait in the queue is {1000 * self.wait:.0f} ms, beyond --max-queue-ms "
                f"({1000 * self.max_queue:.0f} ms){kept}; retry with backoff",
                retry_after_seconds=retry_after(self.why, self.wait + self.margin - self.max_queue),
            )
        left = max(deadline - time.monotonic(), 0) if deadline is not None else 0
        return ScoringError(
            Refusal.RESOURCE_EXHAUSTED,
            f"overloaded: the request would be done in about {1000 * self.done:.0f} ms, after the call's "
            f"deadline ({1000 * left:.0f} ms from now); retry later or with a longer deadline",
            retry_after_seconds=retry_after(self.why, self.wait),
        )


class Retry(enum.Enum):
    """Whether the same request may succeed later (vLLM's allocator answers so): LATER for a transient refusal
    (a full queue, a wait longer than the deadline, a server warming up), NEVER for the rest."""

    LATER = "later"
    NEVER = "never"


class ScoringError(Exception):
    """A request the pipeline refuses or cannot finish; the servicer turns it into `context.abort`.

    `retry_after_seconds` is set only on transient refusals (`retry` is then Retry.LATER): the edges send it
    as `RETRY_AFTER_KEY` trailing metadata or a Retry-After header.
    `decided` is when it was found (time.monotonic()): a refusal says there was no room then, not when
    its edge gets to answer it.
    """

    def __init__(self, refusal: Refusal, message: str, *, retry_after_seconds: float | None = None,
                 decided: float | None = None) -> None:
        super().__init__(message)
        self.refusal = refusal
        self.message = message
        self.retry_after_seconds = retry_after_seconds
        self.decided = time.monotonic() if decided is None else decided

    def detached(self) -> ScoringError:
        """The same refusal with no traceback or cause: safe to keep or raise again, where a raised one's
        frames would keep the request's arrays alive (a reference cycle, freed only by the collector)."""
        return ScoringError(self.refusal, self.message, retry_after_seconds=self.retry_after_seconds,
                            decided=self.decided)

    @property
    def retry(self) -> Retry:
        return Retry.NEVER if self.retry_after_seconds is None else Retry.LATER

    def __str__(self) -> str:
        return f"{self.refusal.name}: {self.message}"


def invalid(message: str) -> ScoringError:
    """The request itself is wrong (INVALID_ARGUMENT): the same request never succeeds."""
    return ScoringError(Refusal.INVALID_ARGUMENT, message)


def shutting_down() -> ScoringError:
    """The server is draining or closed (UNAVAILABLE, no retry hint: this server will not have room again)."""
    return ScoringError(Refusal.UNAVAILABLE, "the server is shutting down; retry on another replica")
