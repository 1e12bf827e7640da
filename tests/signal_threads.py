"""A signal handed to a thread other than the main one, as the kernel may choose when a signal reaches a process."""

from __future__ import annotations

import contextlib
import ctypes
import pathlib
import platform
import signal
import threading
import time
from collections.abc import Iterator

TGKILL = {"x86_64": 234, "aarch64": 131}.get(platform.machine())  # Linux's syscall numbers


def signal_another_thread(pid: int, signum: int) -> None:
    """`signum` to one of `pid`'s threads other than its main one that does not block it."""
    if TGKILL is None:
        raise NotImplementedError(f"tgkill's syscall number on {platform.machine()} is not known here")
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            status = dict(line.split(":\t", 1) for line in (task / "status").read_text().splitlines() if ":\t" in line)
        except OSError:  # the thread ended meanwhile
            continue
        if int(task.name) != pid and not int(status["SigBlk"], 16) & (1 << (signum - 1)):
            if ctypes.CDLL(None, use_errno=True).syscall(TGKILL, pid, int(task.name), signum) == 0:
                return
    raise AssertionError(f"no thread of {pid} but its main one takes signal {signum}")


@contextlib.contextmanager
def ctrl_c_from_another_thread(after_s: float = 0.2) -> Iterator[None]:
    """Within the block, SIGINT delivered after `after_s` to another thread of this process (the block runs in the
    main thread), with Python's own Ctrl-C handler as a CLI has it: a server started earlier in this process may
    have installed its own."""
    assert threading.current_thread() is threading.main_thread()

    def interrupt() -> None:
        time.sleep(after_s)
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # delivered to this thread, not the main one

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt, daemon=True).start()
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
