"""The one retry policy of every scoremap client (the API, the batch CLI, the load tester's start).

Which failures are worth another try is decided by status code and the server's trailing
metadata, never by the words of its message; how long to keep trying is bounded by time (the
call's budget), never by a count of attempts, so a budget of 30 s means 30 s however short the
pauses are. Pauses are jittered exponential backoff (gRPC's connection-backoff spec), lengthened
to the server's retry hint when it sends one, and end at once when the caller is interrupted.
"""

from __future__ import annotations

import enum
import logging
import math
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

import grpc

from clients.api.errors import ScoremapError
from clients.api.interrupts import paused

__all__ = ["Verdict", "classify", "Backoff", "Interrupted", "Retrying", "WaitNotice", "call_with_retries"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class Verdict(enum.Enum):
    """What a failed call means for the next attempt."""

    FINAL = "final"            # the answer stands: sending the same request again gives the same
    RECONNECT = "reconnect"    # UNAVAILABLE: the server was not reached, nothing happened
    LATER = "later"            # a transient refusal: the same request may well succeed shortly


def classify(error: ScoremapError) -> Verdict:
    """The verdict on `error`, from its status code and the server's retry hint.

    RESOURCE_EXHAUSTED is transient only with the hint (a full queue, an expected wait beyond the
    deadline); without it (memory admission, message size) it is final. UNAVAILABLE with the hint
    comes from a server still warming up: reached, so not held to the shorter connect budget. CANCELLED comes from a
    server dropping calls while it stops: a client cancels its own calls only when interrupted,
    which raises Interrupted before any verdict.
    """
    if error.code == grpc.StatusCode.UNAVAILABLE:  # with a hint the server answered: it is warming up
        return Verdict.LATER if error.retry_after_s is not None else Verdict.RECONNECT
    if error.code == grpc.StatusCode.CANCELLED:
        return Verdict.LATER
    if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and error.retry_after_s is not None:
        return Verdict.LATER
    return Verdict.FINAL


class Interrupted(ScoremapError):
    """The caller stopped the call (Ctrl-C, close): nothing is known about the request's outcome."""

    def __init__(self, message: str = "interrupted") -> None:
        super().__init__(grpc.StatusCode.CANCELLED, message)


@dataclass(frozen=True)
class Backoff:
    """Jittered exponential pauses between attempts (seconds)."""

    initial_s: float = 0.1
    max_s: float = 2.0
    multiplier: float = 2.0

    def pauses(self):
        """Endless pauses: uniform in [d/2, d], d doubling up to max_s."""
        delay = self.initial_s
        while True:
            yield random.uniform(delay / 2, delay)
            delay = min(delay * self.multiplier, self.max_s)


class WaitNotice:
    """Tells the user, at most every `every_s` seconds, that calls are waiting for `target`."""

    def __init__(self, target: str, *, every_s: float) -> None:
        self.target = target
        self.every_s = every_s
        self._lock = threading.Lock()
        self._last = float("-inf")

    def __call__(self, error: ScoremapError, verdict: Verdict, remaining_s: float) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.every_s:
                return
            self._last = now
        if verdict is Verdict.RECONNECT:
            log.warning("waiting for %s, retrying for %d s more (%s)", self.target, math.ceil(remaining_s), error.message)
        else:
            log.info("%s refused for now (%s), retrying for %d s more", self.target, error, math.ceil(remaining_s))


class Retrying:
    """One retried call's clock: `after(error)` either pauses for the next attempt or raises.

    The budget is `budget_s` seconds from the start (or from the last `progressed()`, for a
    stream that answered in between); `budget_for(verdict)` may shorten it per verdict (a server
    never reached gets less time than one that went away). Setting `stop` ends a pause at once
    with Interrupted.
    """

    def __init__(self, *, budget_s: float, backoff: Backoff, stop: threading.Event | None = None,
                 budget_for: Callable[[Verdict], float] | None = None,
                 on_wait: Callable[[ScoremapError, Verdict, float], None] | None = None) -> None:
        self.budget_s = budget_s
        self.backoff = backoff
        self.stop = stop
        self.budget_for = budget_for
        self.on_wait = on_wait
        self.progressed()

    def progressed(self) -> None:
        """The call got somewhere (a stream answered): the budget and the backoff start again."""
        self._started = time.monotonic()
        self._pauses = self.backoff.pauses()

    def check(self) -> None:
        """Raise Interrupted if the caller has stopped."""
        if self.stop is not None and self.stop.is_set():
            raise Interrupted()

    def after(self, error: ScoremapError) -> None:
        """Pause before the next attempt, or raise `error` (final, or out of time) or Interrupted."""
        if isinstance(error, Interrupted):
            raise error
        if self.stop is not None and self.stop.is_set():
            raise Interrupted() from error
        verdict = classify(error)
        if verdict is Verdict.FINAL:
            raise error
        limit = min(self.budget_s, self.budget_for(verdict)) if self.budget_for else self.budget_s
        remaining = self._started + limit - time.monotonic()
        if remaining <= 0:
            raise error
        pause = min(max(next(self._pauses), error.retry_after_s or 0.0), remaining)  # the last try at the deadline
        if self.on_wait:
            self.on_wait(error, verdict, remaining)
        if paused(pause, self.stop):  # in slices, so that Ctrl-C ends it at once (clients/api/interrupts.py)
            raise Interrupted() from error


def call_with_retries(attempt: Callable[[], T], retrying: Retrying) -> T:
    """`attempt()` until it succeeds, fails for good, its budget runs out or the caller stops."""
    while True:
        retrying.check()
        try:
            return attempt()
        except ScoremapError as error:
            retrying.after(error)
