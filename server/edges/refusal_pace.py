"""The refusal pace and the resend door: how the server slows the callers it refuses, across its edges."""

from __future__ import annotations

import collections
import contextlib
import math
import threading
import time
from collections.abc import Callable, Hashable, Iterator

from server.settings import Settings

__all__ = ["RefusalPacer"]

BURST_SECONDS = 1.0  # a second's worth of refusals at the pace is answered at once: an honest burst is never held
ANSWER_WINDOW_SECONDS = 1.0  # the refusal pace follows the calls answered over this window
ANSWER_MARGIN_SECONDS = 0.05  # a held refusal is answered this long before its call's deadline, to arrive in time
REMEMBERED_REFUSALS = 4096  # refused requests' keys the refusal pacer remembers at most, the oldest forgotten first


class RefusalPacer:
    """How the server slows callers it refuses: one per server, shared by its edges (docs/design.md: the refusal pace and the resend door).

    A client that resends at once on a refusal (a naive retry loop, an HTTP load balancer) ignores the
    retry hint, and each refusal still costs a call's server CPU under the one GIL, which inference
    needs: 64 such clients were refused 1,230 times a second, and goodput fell to 13%. Two measures:

    - Refusals are paced. An open loop refused as fast does not resend, and its refusals must stay fast
      (median < 5 ms at 5x capacity), so the pace follows what the server answers: refusals
      are answered at once up to `per_answer` times the calls answered over the last second, and never
      below `floor` a second (bursts of a second's worth: a generic cell rate algorithm). Beyond that
      pace each refusal is held for its turn, at most `max_hold` seconds and never past its deadline.
    - Resends wait at the door. A request the server refused in the last `resend_memory` seconds that
      comes again, byte for byte (its `key`), while the server is refusing, waits until a call gives back
      its place other than by a transient refusal (the oldest such waiter first; a place freed after the
      last refusal was found, with no one waiting, is taken at once), at most `max_hold` seconds, and only
      then goes on to be admitted or refused. Paced refusals alone still answered 6 a call to clients
      that came straight back (a fifth of a 2-core machine's capacity lost); at the door such clients
      wait for room instead, as in a queue. A call is a resend only when it `started` once the first
      refusal the door remembers of its request was answered and that refusal's retry hint (at most
      `max_hold`) had passed: copies of one request sent together (a burst, the same
      photo from many callers) reach the server over tens of milliseconds, as it reads them, and look
      like resends to it; until the hint, the time its copy in flight is expected to take, they go on
      and are refused at once, with the retry hint, as any first send is (at the door they would wait up
      to `max_hold` for the one place their admitted copy frees).

    At most `max_held` calls are held at once, at the door or for a turn (each holds the edge's thread or
    task); beyond that a call goes on, or is refused, at once. Transport-free: `answered()` is called for each
    call answered OK (`Front.accounted`), `freed()` for each place given back other than by a transient refusal
    (server/edges/calls.py `Place`), and an edge does

        with pacer.door(key, wake=event.set, deadline=deadline, started=arrival) as seconds:  # 0.0: go on now
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
        # The keys of requests refused, oldest first: when the first refusal remembered was answered and its hint
        # passed, when the last refusal was answered.
        self._refused: dict[Hashable, tuple[float, float]] = {}
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
            key, (_first, when) = next(iter(self._refused.items()))
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

    def _take(self, key: Hashable | None, deadline: float | None, decided: float | None, retry_after: float) -> float:
        """This refusal's hold in seconds, counted among the held when above 0; `key` remembered."""
        with self._lock:
            now = time.monotonic()
            self._last_refusal = now
            while self._freed and self._freed[0] <= (now if decided is None else decided):
                self._freed.popleft()  # there was no room when it was refused: those places were taken
            seconds = self._held_for(now, deadline)
            if key is not None and self.resend_memory:
                answered = now + seconds
                first, _last = self._refused.pop(key, (answered + min(retry_after, self.max_hold), answered))
                self._refused[key] = (first, answered)
            return seconds

    def _held_for(self, now: float, deadline: float | None) -> float:
        """The hold of a refusal at `now` at the pace, counted among the held when above 0 (under the lock)."""
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

    def hold(self, key: Hashable | None = None, *, deadline: float | None = None, decided: float | None = None,
             retry_after: float = 0.0) -> contextlib.AbstractContextManager[float]:
        """The seconds to hold this refusal of the request `key` (None: not one to recognise again) before
        answering it (0.0: at once); `deadline` a time.monotonic() instant, `decided` when it was found (by
        default now), `retry_after` its retry hint in seconds. The hold counts among the held until the block
        ends."""
        return self._counted(self._take(key, deadline, decided, retry_after))

    def _enter(self, key: Hashable, wake: Callable[[], None], deadline: float | None, started: float | None) -> float:
        """The seconds a call of request `key` that `started` then waits at the door (0.0: none), `wake` queued when
        above 0."""
        with self._lock:
            now = time.monotonic()
            self._forget(now)
            first, _last = self._refused.get(key, (math.inf, math.inf))
            if (now if started is None else started) < first:
                return 0.0  # not a resend: not refused lately, or come before its first refusal and hint
            if not self._answers or not self._refused_lately(now) or self._held >= self.max_held:
                return 0.0  # no answer to wait for, no refusals now, or no thread to hold it on
            if self._freed:
                self._freed.popleft()
                return 0.0  # an answer freed a place after the last refusal was found: it goes to take it
            seconds = self._bounded(self.max_hold, now, deadline)
            if seconds:
                self._held += 1
                self._door.append(wake)
            return seconds

    def door(self, key: Hashable, *, wake: Callable[[], None], deadline: float | None = None,
             started: float | None = None) -> contextlib.AbstractContextManager[float]:
        """The seconds a call of request `key` waits for room before it goes on (0.0: at once), during which
        `wake` is called (under the pacer's lock: it must only signal) when a place is freed for it; `started`
        when the call reached the server (time.monotonic(); None: now).
        The wait counts among the held until the block ends."""
        return self._counted(self._enter(key, wake, deadline, started), wake)

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
