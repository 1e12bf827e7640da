"""One process's share of a load level: its sends, its answers, and when it sends.

What a sending process spends per request is the load tester's own cost, so the path is kept short: each
request is serialized once (`Payloads`: arrival n appends only its own request_id), calls go through a raw-bytes
method (nothing serialized per call, no answer parsed: only its status counts), and a closed loop's caller is
a chain of callbacks, each answer sending the next request from gRPC's own thread, with no thread per caller.
Closed loop: each caller sends its next request as soon as its last is answered. Open loop: arrivals at a
fixed rate, each latency counted from its *scheduled* send time, so a slow server cannot hide its queueing by
slowing the sender (no coordinated omission; Gil Tene, "How NOT to measure latency"). No retries: every failure
counts, by gRPC status.

A process may send one share of a level spread over several (`first`, `step`): arrivals first, first + step,
...; an open loop's share keeps the level's schedule, so the shares interleave into the rate asked.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import grpc

from clients.loadtest.latency import Sample
from clients.loadtest.settings import LoadLimits
from protos import scoring_pb2

__all__ = ["SCORE_METHOD", "Payloads", "Counts", "Closed", "Open", "clock", "raw_calls"]

SCORE_METHOD = f"/{scoring_pb2.DESCRIPTOR.services_by_name['DenseScoring'].full_name}/Score"


def clock() -> float:
    """Seconds on the monotonic clock: CLOCK_MONOTONIC on Linux, one clock for every process of the machine,
    so the samples of a load tester's processes merge."""
    return time.monotonic()


def raw_calls(channels: Sequence[grpc.Channel]) -> list[grpc.UnaryUnaryMultiCallable]:
    """Score on each channel, bytes in and bytes out: nothing serialized per call, no answer parsed."""
    return [channel.unary_unary(SCORE_METHOD) for channel in channels]


class Payloads:
    """The requests a load test cycles through, each serialized once. Arrival n is request n % len as new work:
    its own request_id (`<its own>#n`, as clients.api.options.as_new_work names it), appended as a second
    request_id field, which a parser takes over the first (protobuf's last-one-wins), so the image's bytes
    are never copied into a new message."""

    def __init__(self, encoded: Sequence[bytes]) -> None:
        if not encoded:
            raise ValueError("a load test needs at least one request to send")
        self.encoded = list(encoded)
        self._ids = [scoring_pb2.ScoreRequest.FromString(data).request_id for data in self.encoded]

    @classmethod
    def of(cls, requests: Sequence[scoring_pb2.ScoreRequest]) -> Payloads:
        return cls([request.SerializeToString() for request in requests])

    def __len__(self) -> int:
        return len(self.encoded)

    def __call__(self, n: int) -> bytes:
        index = n % len(self.encoded)
        return self.encoded[index] + scoring_pb2.ScoreRequest(request_id=f"{self._ids[index]}#{n}").SerializeToString()


class Counts:
    """A level's sends and answers so far: one process's, or every process's merged (clients.loadtest.spread).
    `mode` and `level` name the level; the window's logic (clients.loadtest.levels) reads only these."""

    def __init__(self, mode: str, level: float, *, timeout_s: float, limits: LoadLimits) -> None:
        self.mode, self.level, self.timeout_s, self.limits = mode, level, timeout_s, limits
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.samples: list[Sample] = []
        self.sent_at: list[float] = []
        self.send_limit = limits.max_requests  # the level's warm-up + its measured requests
        self.stop = threading.Event()
        self.started = clock()

    def start(self) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """Stop sending; return once every answer is in, or given up."""
        raise NotImplementedError

    def answered(self) -> int:
        with self.lock:
            return len(self.samples)

    def window_closed(self) -> bool:
        """Whether every request the window may send was sent and answered."""
        with self.lock:
            return len(self.sent_at) >= self.send_limit and len(self.samples) >= len(self.sent_at)

    def opened(self) -> None:
        """The window has opened (its edge read): the warm-up's prompt accounting may relax."""

    def settle(self, instant: float) -> None:
        """Return once every send and answer up to `instant` is counted here (at once in the process sending)."""

    def in_flight_at(self, instant: float) -> int:
        with self.lock:
            return (sum(1 for t in self.sent_at if t <= instant)
                    - sum(1 for s in self.samples if s.done_s <= instant))

    def warm_up(self, count: int, until: float) -> float:
        """The instant the window opens. Closed loop: once `count` answers came (until `until` at most), the
        count-th answer's. Open loop: the first `count` arrivals pass; the next one's schedule."""
        if self.mode == "open":
            opens = self.started + count / self.level
            self.stop.wait(max(0.0, min(until, opens) - clock()))
            return min(opens, clock())
        with self.changed:
            while len(self.samples) < count and self.changed.wait(max(0.0, until - clock())):
                pass
            if count == 0:
                return self.started
            if len(self.samples) < count:
                return clock()
            return sorted(s.done_s for s in self.samples)[count - 1]  # merged samples come in no one order


class _Sending(Counts):
    """One process's calls: what it sent, what was answered; subclasses decide when to send."""

    def __init__(self, mode: str, level: float, calls: Sequence[grpc.UnaryUnaryMultiCallable], payloads: Payloads, *,
                 timeout_s: float, limits: LoadLimits, metadata: Sequence[tuple[str, str]] = (), first: int = 0,
                 step: int = 1) -> None:
        super().__init__(mode, level, timeout_s=timeout_s, limits=limits)
        self.calls, self.payloads, self.metadata = list(calls), payloads, tuple(metadata)
        self.first, self.step = first, step
        self.pending: set[grpc.Future] = set()
        self.threads: list[threading.Thread] = []

    def _claim(self) -> int | None:
        """This process's next request (its own count), or None when sending has ended."""
        with self.lock:
            if self.stop.is_set() or len(self.sent_at) >= self.send_limit:
                return None
            self.sent_at.append(clock())
            return len(self.sent_at) - 1

    def _send(self, index: int, scheduled: float, on_done: Callable[[], None] | None = None) -> None:
        number = self.first + index * self.step
        call = self.calls[index % len(self.calls)].future(self.payloads(number), timeout=self.timeout_s,
                                                          metadata=self.metadata)
        with self.lock:
            self.pending.add(call)

        def done(finished: grpc.Future) -> None:
            code = grpc.StatusCode.CANCELLED if finished.cancelled() else finished.code()
            with self.changed:
                now = clock()  # read under the lock: a hand-over's instant covers every answer before it
                self.pending.discard(finished)
                self.samples.append(Sample(now, now - scheduled, "OK" if code == grpc.StatusCode.OK else code.name))
                self.changed.notify_all()
            if on_done:
                on_done()

        call.add_done_callback(done)

    def start(self, *, at: float | None = None) -> None:
        """Start sending at `at` (clock(); now when None)."""
        self.started = clock() if at is None else at
        self.stop.wait(max(0.0, self.started - clock()))
        for thread in self.threads:
            thread.start()

    def finish(self) -> None:
        """Stop sending; wait `timeout_s` + the drain grace for answers, then cancel what is left."""
        self.stop.set()
        until = clock() + self.timeout_s + self.limits.drain_grace_s
        with self.changed:
            while self.pending and self.changed.wait(max(0.0, until - clock())):
                pass
            left = list(self.pending)
        for call in left:
            call.cancel()  # calls the server never answered end with the level
        for thread in self.threads:
            thread.join(max(0.0, until - clock()) + 1.0)


class Closed(_Sending):
    """`callers` callers, each sending its next request when its last one is answered."""

    def __init__(self, *args, callers: int, level: float | None = None, **kwargs) -> None:
        super().__init__("closed", callers if level is None else level, *args, **kwargs)
        self.callers = callers
        self._local = threading.local()

    def _next(self) -> None:
        """Send a caller's next request. An answer that comes at once (a refused call) runs its callback inside
        `_send`, on this thread: it is counted here and sent by this loop, so a run of them never nests."""
        local = self._local
        if getattr(local, "sending", False):
            local.due += 1
            return
        local.sending, local.due = True, 1
        try:
            while local.due:
                local.due -= 1
                if (index := self._claim()) is not None:
                    self._send(index, clock(), self._next)
        finally:
            local.sending = False

    def start(self, *, at: float | None = None) -> None:
        super().start(at=at)
        for _ in range(self.callers):
            self._next()


class Open(_Sending):
    """Arrivals at `rate` per second over the whole level, this process sending every `step`th from `first`, each
    latency counted from its scheduled send time; at most `in_flight` of this process's at once."""

    def __init__(self, *args, rate: float, in_flight: int | None = None, **kwargs) -> None:
        super().__init__("open", rate, *args, **kwargs)
        self.slots = threading.BoundedSemaphore(in_flight or self.limits.max_in_flight)
        self.threads = [threading.Thread(target=self._sender, name="loadtest-sender", daemon=True)]

    def scheduled(self, index: int) -> float:
        """When this process's `index`th arrival is due: the level's arrival first + index * step."""
        return self.started + (self.first + index * self.step) / self.level

    def _sender(self) -> None:
        index = 0
        while True:
            scheduled = self.scheduled(index)
            if self.stop.wait(max(0.0, scheduled - clock())):
                return
            # At the in-flight bound the send waits (its latency still counts from `scheduled`),
            # until the level stops.
            while not self.slots.acquire(timeout=0.05):
                if self.stop.is_set():
                    return
            claimed = self._claim()
            if claimed is None:
                self.slots.release()
                return
            self._send(claimed, scheduled, self.slots.release)
            index += 1
