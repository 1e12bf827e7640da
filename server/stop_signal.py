"""The stop a serving process's main thread waits for: SIGTERM or SIGINT, heard whichever thread the kernel hands
it to.

Python runs a signal's handler only in the main thread, once that thread's wait returns, and the kernel may hand a
process's signal to any of its threads that do not block it (gRPC's, the batcher's). A main thread blocked on a
lock (`threading.Event.wait`) would then not run the handler, and the server would not stop. Python's C-level
handler also writes each caught signal to the wakeup fd (`signal.set_wakeup_fd`), on whatever thread it runs, so
the main thread waits on that fd: no polling, and an idle server still wakes no thread.
"""

from __future__ import annotations

import select
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable

__all__ = ["SignalledStop"]


class SignalledStop(threading.Event):
    """An Event that `signals` set once `catch` is called; its `wait` in the main thread wakes for them."""

    def __init__(self) -> None:
        super().__init__()
        self._reader, self._writer = socket.socketpair()
        self._reader.setblocking(False)
        self._writer.setblocking(False)

    def catch(self, signals: Iterable[int]) -> Callable[[], None]:
        """Set this stop on each of `signals` (from the main thread); a function that puts the previous handlers and
        wakeup fd back."""
        previous = {signum: signal.signal(signum, lambda *_: self.set()) for signum in signals}
        previous_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)

        def put_back() -> None:
            signal.set_wakeup_fd(previous_fd)
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return put_back

    def set(self) -> None:
        super().set()
        try:
            self._writer.send(b"\0")  # wakes the main thread's wait when another thread stops
        except (BlockingIOError, OSError):  # already woken, or closed at exit
            pass

    def wait(self, timeout: float | None = None) -> bool:
        if threading.current_thread() is not threading.main_thread():
            return super().wait(timeout)
        ends = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            left = None if ends is None else ends - time.monotonic()
            if left is not None and left <= 0:
                return False
            select.select([self._reader], [], [], left)  # a signal's byte or `set`'s; the handler runs on return
            try:
                while self._reader.recv(4096):
                    pass
            except BlockingIOError:
                pass
        return True
