"""A signal sent to one thread of another process, as the kernel may choose when a signal reaches the process."""

from __future__ import annotations

import ctypes
import pathlib
import platform

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
