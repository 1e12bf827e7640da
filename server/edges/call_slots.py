"""Calls running at once, in total and per client address: the count both edges (gRPC, HTTP) keep.

Each edge holds its own `CallSlots` (gRPC's protects its worker threads, HTTP's its scoring
threads) with the same limits and the same words, so a client meets the same rule on either port.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterator

from server.errors import Refusal, ScoringError, Transient, retry_after


class CallSlots:
    """At most `total` calls running at once, and `per_peer` from one client address (0: no such limit)."""

    def __init__(self, *, total: int, per_peer: int) -> None:
        self._total = total
        self._per_peer = per_peer
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

    def take(self, peer: str) -> Callable[[], None]:
        """A slot for a call from `peer`, and the function that gives it back (once, however often called);
        RESOURCE_EXHAUSTED with a retry hint when none is free."""
        with self._lock:
            problem = self._problem(peer)
            if problem is None:
                self._running += 1
                self._by_peer[peer] += 1
        if problem is not None:
            raise ScoringError(Refusal.RESOURCE_EXHAUSTED, problem, retry_after_seconds=retry_after(Transient.CALLS_BUSY))
        given_back = False

        def give_back() -> None:
            nonlocal given_back
            with self._lock:
                if given_back:
                    return
                given_back = True
                self._running -= 1
                self._by_peer[peer] -= 1
                if not self._by_peer[peer]:
                    del self._by_peer[peer]

        return give_back

    @contextlib.contextmanager
    def held(self, peer: str) -> Iterator[None]:
        """A slot for a call from `peer` while the block runs; RESOURCE_EXHAUSTED with a retry hint when none is free."""
        give_back = self.take(peer)
        try:
            yield
        finally:
            give_back()
