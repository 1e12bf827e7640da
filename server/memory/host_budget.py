"""The host memory requests hold: one request against its limit, the requests in flight against the server's
budget, and idle memory given back to the system."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from convert.arguments import format_bytes
from server.errors import Refusal, ScoringError, Transient, retry_after
from server.memory.host import HostEstimate
from server.memory.runtime import release_free_memory

__all__ = ["HostBudget", "admit_host", "available_memory_bytes", "share_of_available"]


TRIM_AFTER_BYTES = 256 * 2**20  # host memory held by requests since the last trim that makes going idle trim


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


def share_of_available(fraction: float) -> int | None:
    """`fraction` of MemAvailable, or None where it cannot be read: each budget's default."""
    available = available_memory_bytes()
    return int(available * fraction) if available else None


def admit_host(estimate: HostEstimate, *, limit_bytes: int, instead: str = "") -> None:
    """RESOURCE_EXHAUSTED with every term when one request would hold more host memory than the limit; `instead`
    says what the request could ask for that would fit (admission finds it: server/scoring/footprint.py)."""
    if estimate.total > limit_bytes:
        raise ScoringError(
            Refusal.RESOURCE_EXHAUSTED,
            f"this request needs an estimated {estimate.total} bytes of host memory, {estimate.describe()}, "
            f"but one request may hold {limit_bytes} bytes ({format_bytes(limit_bytes)}, --max-request-host-bytes); "
            f"{instead or 'ask for fewer or smaller scales, no flip or a coarser stride'}; or restart the server "
            f"with a --max-request-host-bytes of at least {-(-estimate.total // 2**20)}MiB",
        )


class HostBudget:
    """Host memory the requests in flight may hold together (their estimates): one per server.

    `with budget.hold(estimate): ...` around a request's decode-to-response; a request that finds
    the others holding the room is refused with RESOURCE_EXHAUSTED and a retry hint (transient),
    one larger than the whole budget without (it never fits: `admit_host` says so first when the
    budget is at least `--max-request-host-bytes`)."""

    def __init__(self, total_bytes: int | None, *, share: int = 1, shared_by: str = "--workers") -> None:
        self.total_bytes = total_bytes
        self.share = share  # this process holds 1/share of the server's budget
        self.shared_by = shared_by  # the flag that made the processes sharing it (--workers or --fronts)
        self._held = 0
        self._requests = 0  # in flight
        self._since_trim = 0  # bytes held by the requests ended since the last trim
        self._lock = threading.Lock()
        # Told when no request is in flight (True: requests held much memory since the last time), by the engine
        # in this process: its CPU arena gives back what it keeps (server.memory.arena.went_idle).
        self.on_idle: Callable[[bool], None] | None = None

    @classmethod
    def sized(cls, total_bytes: int | None, *, fraction: float, at_least: int, share: int = 1,
              shared_by: str = "--workers") -> HostBudget:
        """1/`share` (one of --workers' processes) of `total_bytes` (--host-memory-budget), else of `fraction` of
        MemAvailable, but at least `at_least` (one largest request); unbounded where MemAvailable cannot be read."""
        if total_bytes is not None:
            return cls(total_bytes // share, share=share, shared_by=shared_by)
        available = share_of_available(fraction)
        return cls(None if available is None else max(available // share, at_least), share=share, shared_by=shared_by)

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
                    f"requests in flight hold {self._held} of {self._budget_said()}"
                    + ("; it does not fit even alone" if alone else "; retry with backoff"),
                    retry_after_seconds=None if alone else retry_after(Transient.HOST_MEMORY),
                )
            self._held += needed
            self._requests += 1

    def _budget_said(self) -> str:
        """The budget a refusal names: the server's, or under --workers or --fronts this process's share of it."""
        said = f"{self.total_bytes} bytes ({format_bytes(self.total_bytes)}, "
        if self.share == 1:
            return f"the server's {said}--host-memory-budget)"
        return (f"this process's {said}1/{self.share} of the server's --host-memory-budget: "
                f"one of {self.shared_by} {self.share})")

    def give_back(self, held_bytes: int) -> None:
        """A request ended. When it was the last in flight and requests have held `TRIM_AFTER_BYTES` since the
        last time, glibc's freed memory goes back to the system (malloc_trim): it would keep it, and idle RSS
        ratcheted up after large requests; so does the CPU plans' shared arena (`on_idle`), which would keep the
        largest block any run took (a 2944x800 canvas's 4 passes: 1.3 GiB) while nothing runs; it also
        gives back a block over --max-idle-arena-bytes, both once no run began for a while after the last request
        ended (server.memory.arena.went_idle). Not after each request: memory given back is faulted in again."""
        with self._lock:
            self._held -= held_bytes
            self._requests -= 1
            self._since_trim += held_bytes
            idle = self._requests == 0
            trim = idle and self._since_trim > TRIM_AFTER_BYTES
            if trim:
                self._since_trim = 0
        if idle and self.on_idle is not None:
            self.on_idle(trim)
        if trim:
            release_free_memory()

    @contextlib.contextmanager
    def hold(self, estimate: HostEstimate) -> Iterator[None]:
        self.take(estimate)
        try:
            yield
        finally:
            self.give_back(estimate.total)

