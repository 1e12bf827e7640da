"""A stream of requests scored a window at a time, answers in request order, whatever the transport: ScoreStream
and KServe v2's ModelStreamInfer both run `windowed`.

Requests are read in a thread of their own, so each answer is sent as soon as it and those before it are done: a
client that waits for answer 1 before sending request 2 is served. A stream with every answer sent and no request
for `--stream-idle-seconds` is ended, giving its worker back.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from server.edges.calls import Call
from server.errors import Refusal, ScoringError
from server.settings import Settings

__all__ = ["StreamReader", "windowed"]

POLL_SECONDS = 0.05  # how often a stream's reader, held back by the window, looks whether the call ended


@contextlib.contextmanager
def windowed(requests: Iterable[Any], score: Callable[[Any], Any], call: Call, *, settings: Settings,
             name: str) -> Iterator[Iterator[tuple[str, Future]]]:
    """(request_id, future of `score(request)`) in request order, up to `--stream-window` requests scored at once
    (so they batch together) in threads named `name`. When the block ends, however it ends, the call's other
    requests stop (`call.cancelled`) and their threads are done."""
    window = max(1, settings.stream_window)
    with ThreadPoolExecutor(window, thread_name_prefix=name) as pool:
        reader = StreamReader(requests, pool, score, call, window=window, idle_seconds=settings.stream_idle_seconds)
        try:
            yield reader.submitted()
        finally:
            call.cancelled.set()  # a failed or abandoned stream stops its other requests
            pool.shutdown(wait=True, cancel_futures=True)


class StreamReader:
    """A stream's requests (each with a `request_id`), read in a thread of their own and submitted to `pool` as
    they arrive.

    Reading on while answers are pending is what lets a lockstep client (answer 1 before request 2)
    be served; at most `window` submitted requests wait to be answered, which holds reading back.
    """

    def __init__(self, requests: Iterable[Any], pool: ThreadPoolExecutor, score: Callable[[Any], Any], call: Call, *,
                 window: int, idle_seconds: float) -> None:
        self._pending: queue.Queue[tuple[str, Future]] = queue.Queue(maxsize=window)
        self._finished = threading.Event()
        self._error: Exception | None = None
        self._call = call
        self._idle_seconds = idle_seconds
        self._active_at = time.monotonic()  # the last request read or answer handed over
        thread = threading.Thread(target=self._read, args=(requests, pool, score), name="stream-reader", daemon=True)
        thread.start()

    def submitted(self) -> Iterator[tuple[str, Future]]:
        """(request_id, future) in request order; raises what reading raised (cancelled, deadline), or
        DEADLINE_EXCEEDED once the stream has been idle for `idle_seconds`."""
        while True:
            try:
                yield self._pending.get(timeout=POLL_SECONDS)
                self._active_at = time.monotonic()
            except queue.Empty:
                if self._finished.is_set() and self._pending.empty():  # put happens before finished is set
                    if self._error is not None:
                        raise self._error from None
                    return
                idle = time.monotonic() - self._active_at
                if idle > self._idle_seconds:
                    raise ScoringError(
                        Refusal.DEADLINE_EXCEEDED,
                        f"no request for {idle:.0f} s on this stream, whose answers were all sent: the server "
                        f"ends streams idle for {self._idle_seconds:g} s (--stream-idle-seconds); open a new "
                        "stream when you have more to send",
                    )

    def _read(self, requests: Iterable[Any], pool: ThreadPoolExecutor, score: Callable[[Any], Any]) -> None:
        call = self._call
        try:
            for request in requests:
                self._active_at = time.monotonic()
                if call.cancelled.is_set():
                    return
                future = pool.submit(score, request)
                while not call.cancelled.is_set():
                    with contextlib.suppress(queue.Full):
                        self._pending.put((request.request_id, future), timeout=POLL_SECONDS)
                        break
        except Exception as error:  # the client cancelled or the deadline passed: the handler answers for it
            self._error = error
        finally:
            self._finished.set()
