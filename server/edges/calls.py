"""One call as every edge runs it, whatever its transport: its plain values and outcome, its place among the calls
running, the bearer token it must carry and the key a resend of it is recognised by.

The gRPC servicer and interceptors and the HTTP edge each turn their transport's call into a `Call` and leave the
rules to this module and to `Front.accounted` (server/edges/front.py), as tritonclient's gRPC and HTTP clients share
one call model over two thin transports: a rule, or a third transport, is written once.
"""

from __future__ import annotations

import collections
import hmac
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from server.edges.refusal_pace import RefusalPacer
from server.errors import Refusal, ScoringError, Transient, retry_after
from server.metrics import NO_MODEL

__all__ = ["CANCELLED", "Call", "CallSlots", "OK", "Place", "Token", "UNKNOWN", "resend_key"]

# A call's outcome as the metrics count it: a Refusal's name, or one of these.
OK = "OK"
UNKNOWN = "UNKNOWN"  # a bug: the client gets no traceback, the log keeps it
CANCELLED = Refusal.CANCELLED.name  # the call ended before its answer: the client went away


@dataclass(eq=False)
class Call:
    """One call as plain values: its method (as the metrics name it), the loaded model it concerns once known (a
    stream: its first request's), its deadline (time.monotonic(); None: none), a flag set when it ends or is
    cancelled, and how it ended (`code`: None until it is known)."""

    method: str
    model: str = NO_MODEL
    deadline: float | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    code: str | None = None

    def refused(self, error: ScoringError) -> None:
        self.code = error.refusal.name


class Token:
    """The bearer token every call but a probe carries: `authorization: Bearer <token>`, as gRPC metadata or an
    HTTP header, compared in constant time."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def check(self, received: str | bytes | None) -> None:
        """UNAUTHENTICATED unless `received` (the call's `authorization` value) is the bearer token."""
        if isinstance(received, str):
            received = received.encode()
        if not hmac.compare_digest(received or b"", self._expected):
            raise ScoringError(Refusal.UNAUTHENTICATED, "missing or wrong bearer token: send `authorization: "
                               "Bearer <token>` (gRPC metadata, or the HTTP header Authorization)")


def resend_key(method: str, *request: str | bytes) -> Hashable:
    """What a request sent again is recognised by at the resend door (server.edges.refusal_pace): its method and
    the bytes that make it (gRPC: the message; HTTP: the path, query and body)."""
    return hash((method, *request))


class Place:
    """A call's place among the calls running, given back once: to a resend waiting at the door, unless the call
    was refused for want of room (its hold at the refusal pace then waits out of any place)."""

    def __init__(self, give_back: Callable[[], None], pacer: RefusalPacer) -> None:
        self._give_back = give_back
        self._pacer = pacer
        self._lock = threading.Lock()
        self._held = True

    def leave(self, *, refused: bool = False) -> None:
        with self._lock:
            held, self._held = self._held, False
        if held:
            self._give_back()
            if not refused:
                self._pacer.freed()


class CallSlots:
    """At most `total` calls running at once, and `per_peer` from one client address (0: no such limit).

    Each edge holds its own (gRPC's protects its worker threads, HTTP's its scoring threads) with the same limits
    and the same words, so a client meets the same rule on either port.
    """

    def __init__(self, *, total: int, per_peer: int, pacer: RefusalPacer) -> None:
        self._total = total
        self._per_peer = per_peer
        self._pacer = pacer
        self._lock = threading.Lock()
        self._running = 0
        self._by_peer: collections.Counter[str] = collections.Counter()

    def _problem(self, peer: str) -> str | None:
        if self._running >= self._total:
            return (f"the server is running {self._running} calls, as many as it takes at once "
                    "(--grpc-workers less --reserved-workers); retry with backoff")
        if self._per_peer and self._by_peer[peer] >= self._per_peer:
            return (f"{peer} already has {self._by_peer[peer]} calls running, the limit for one client "
                    "address (--max-calls-per-peer); retry with backoff, or close idle streams")
        return None

    def take(self, peer: str) -> Place:
        """A place for a call from `peer`; RESOURCE_EXHAUSTED with a retry hint when none is free."""
        with self._lock:
            problem = self._problem(peer)
            if problem is None:
                self._running += 1
                self._by_peer[peer] += 1
        if problem is not None:
            raise ScoringError(Refusal.RESOURCE_EXHAUSTED, problem, retry_after_seconds=retry_after(Transient.CALLS_BUSY))

        def give_back() -> None:
            with self._lock:
                self._running -= 1
                self._by_peer[peer] -= 1
                if not self._by_peer[peer]:
                    del self._by_peer[peer]

        return Place(give_back, self._pacer)
