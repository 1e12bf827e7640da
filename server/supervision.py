"""What `--workers` and `--fronts` share as supervisors of server processes: the ports held while children bind
them, a child that follows its supervisor's end, the stop, and exit statuses as a shell reports them.

A child is started with `--supervisor PID` and, once its own stop handlers are in place, asks the kernel for
SIGTERM when that process ends, even by SIGKILL (prctl's PDEATHSIG), so no child outlives its supervisor holding
a port. The child asks, not a `preexec_fn` between fork and exec: the supervisor has threads (output relays,
metrics), and code run in a forked child of a threaded process can deadlock on a lock another thread held. A child
whose supervisor ended also bounds its own drain, as the supervisor's `stop` would have: a thread waiting on the
supervisor's pidfd (woken only by its end) stops the child and, should its drain not end in time, has faulthandler
write every thread's stack to the log and exit 1, so no hang leaves a process holding a port.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence

__all__ = ["STOP_MARGIN_SECONDS", "announce", "first_lines", "follow_supervisor", "reserved", "shell_status", "stop",
           "supervised_flags"]

LOG = logging.getLogger("scoremap.serve")
STOP_MARGIN_SECONDS = 15.0  # past the grace period, how long a child gets to exit before it is killed
# An orphan's time to end past the grace period: twice the supervisor's margin, as the engine waits that margin for
# the fronts to go before it closes.
ORPHAN_MARGIN_SECONDS = 2 * STOP_MARGIN_SECONDS
PR_SET_PDEATHSIG = 1  # linux/prctl.h


@contextlib.contextmanager
def reserved(host: str, port: int) -> Iterator[int]:
    """Hold host:port (0: a free one) bound, not listening, with SO_REUSEPORT while the children bind it: a free
    port chosen here stays ours, and a bound socket that does not listen is never given a connection."""
    family = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family, socket.SOCK_STREAM) as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind((host.strip("[]"), port))
        yield holder.getsockname()[1]


def supervised_flags() -> list[str]:
    """The flags that make a child follow this process's end (`follow_supervisor`)."""
    return ["--supervisor", str(os.getpid())]


def follow_supervisor(supervisor: int, *, stop: threading.Event, grace: float) -> bool:
    """In a child: SIGTERM from the kernel when `supervisor` ends, and this process gone at most `grace` +
    ORPHAN_MARGIN_SECONDS later; False when it has ended already (the child then exits: it was started for a server
    that is gone)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    try:
        supervisor_end = os.pidfd_open(supervisor)
    except OSError:  # gone already (seen below), or a kernel without pidfds: the signal alone
        supervisor_end = None
    if os.getppid() != supervisor:  # checked after both: an end before they took effect is seen here
        if supervisor_end is not None:
            os.close(supervisor_end)
        return False
    if supervisor_end is not None:
        threading.Thread(target=end_with, args=(supervisor_end, stop, grace + ORPHAN_MARGIN_SECONDS),
                         name="supervisor-end", daemon=True).start()
    return True


def end_with(supervisor_end: int, stop: threading.Event, seconds: float) -> None:
    """Once the supervisor's pidfd says it ended: stop this process (as the kernel's SIGTERM does), and exit after
    `seconds` with every thread's stack in the log if it is still running then."""
    ended = select.poll()
    ended.register(supervisor_end, select.POLLIN)
    ended.poll()
    os.close(supervisor_end)
    LOG.warning("the supervisor ended: stopping, at the latest in %.0f s", seconds)
    faulthandler.dump_traceback_later(seconds, exit=True)
    stop.set()


def first_lines(readers: Sequence[subprocess.Popen], stopping: threading.Event, *,
                watched: Sequence[subprocess.Popen]) -> list[str]:
    """Each of `readers`' first line, which says where it listens once it does; "" for one that has not said it when
    `stopping` is set or one of `watched` ends (the start has failed: the others would wait in vain)."""
    lines = [""] * len(readers)

    def read(index: int) -> None:
        lines[index] = readers[index].stdout.readline()

    threads = [threading.Thread(target=read, args=(index,), name=f"child-{child.pid}-first-line", daemon=True)
               for index, child in enumerate(readers)]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads) and all(child.poll() is None for child in watched):
        if stopping.wait(0.1):
            break
    return list(lines)


def announce(children: Sequence[subprocess.Popen], first_lines: list[str]) -> None:
    """The first child's address line once (they share it), then every child's other lines (HTTP, metrics) as
    each prints them, on this process's stdout."""
    sys.stdout.write(first_lines[0])
    sys.stdout.flush()

    def relay(child: subprocess.Popen) -> None:
        for line in child.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()

    for child in children:
        threading.Thread(target=relay, args=(child,), name=f"child-{child.pid}-stdout", daemon=True).start()


def stop(children: Sequence[subprocess.Popen], *, grace: float) -> int:
    """SIGTERM to each child still running (each drains for `grace` seconds), SIGKILL to any that outlives it. 0, or
    the status (`shell_status`) of the first child that ended otherwise than by the stop (drained, or ended by SIGTERM
    before it could drain): one that had crashed already, crashed while draining, or was killed past the grace."""
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    for child in children:
        try:
            child.wait(grace + STOP_MARGIN_SECONDS)
        except subprocess.TimeoutExpired:
            LOG.error("process %d did not stop within %.0f s: killed", child.pid, grace + STOP_MARGIN_SECONDS)
            child.kill()
            child.wait()
    return next((shell_status(code) for child in children if (code := child.returncode) not in (0, -signal.SIGTERM)),
                0)


def shell_status(returncode: int) -> int:
    """A process's end as a shell reports it: its exit status, or 128 + the signal's number for one a signal ended
    (Popen's negative number, which `sys.exit` would turn into 256 less it)."""
    return 128 - returncode if returncode < 0 else returncode
