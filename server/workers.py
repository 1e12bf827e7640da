"""`--workers N`: N server processes on one port, so the per-request Python work scales past one GIL.

Measured on an H200: one process answers 200-290 requests a second at most while its plans run 383-1753 images
a second, its request path holding the GIL 3-4 ms a request (docs/design.md: server processes). As LitServe's
`workers_per_device` and gunicorn do, this process only supervises: it reserves the ports, starts N
`scoremap-serve` processes that bind them with SO_REUSEPORT (the kernel spreads connections over them),
each with its own interpreter, batcher and plans and 1/N of the memory budgets (`--budget-share`), prints
where they listen once every one is listening, passes SIGTERM on (each drains as one server does), and
stops them all when one ends; a worker whose supervisor dies, even by SIGKILL, gets SIGTERM from the kernel
(prctl's PDEATHSIG) and drains, so none outlives it holding the port. A call's deadline, cancellation,
admission and refusal pace are its own process's, as in one server; each process serves its own metrics port
(from --metrics-port on, one each).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence

from server.settings import Settings

__all__ = ["supervise"]

LOG = logging.getLogger("scoremap.serve")
STOP_MARGIN_SECONDS = 15.0  # past the grace period, how long a worker gets to exit before it is killed
PR_SET_PDEATHSIG = 1  # linux/prctl.h


@contextlib.contextmanager
def reserved(host: str, port: int) -> Iterator[int]:
    """Hold host:port (0: a free one) bound, not listening, with SO_REUSEPORT while the workers bind it: a free
    port chosen here stays ours, and a bound socket that does not listen is never given a connection."""
    family = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family, socket.SOCK_STREAM) as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind((host.strip("[]"), port))
        yield holder.getsockname()[1]


def worker_argv(argv: Sequence[str], *, settings: Settings, port: int, http_port: int | None, index: int) -> list[str]:
    """The command line of worker `index`: the server's own flags, then what makes it one of the workers
    (argparse takes the last value of a flag given twice)."""
    command = [sys.executable, "-m", "server.main", *argv, "--workers", "1", "--reuse-port",
               "--budget-share", str(settings.workers), "--port", str(port)]
    if http_port is not None:
        command += ["--http-port", str(http_port)]
    if settings.metrics_port is not None:
        command += ["--metrics-port", str(settings.metrics_port + index if settings.metrics_port else 0)]
    return command


def supervise(argv: Sequence[str], *, host: str, port: int, settings: Settings,
              stopping: threading.Event | None = None) -> int:
    """Run `settings.workers` server processes on host:port until SIGTERM or SIGINT (passed on to each) or until
    one of them ends (the others are then stopped); the exit status of the first to end (`shell_status`), or 0. `stopping`: the
    event the caller's own handlers of those signals set (a signal that came before this was called stops it)."""
    with contextlib.ExitStack() as ports:
        port = ports.enter_context(reserved(host, port))
        http_port = None if settings.http_port is None else ports.enter_context(reserved(host, settings.http_port))
        workers = [subprocess.Popen(worker_argv(argv, settings=settings, port=port, http_port=http_port, index=index),
                                    stdout=subprocess.PIPE, text=True, preexec_fn=drained_with(os.getpid()))
                   for index in range(settings.workers)]
        lines = [worker.stdout.readline() for worker in workers]  # each says where it listens once it does
    if not all("listening on" in line for line in lines):
        stop(workers, grace=0.0)
        return max((worker.returncode or 0 for worker in workers), default=0) or 2
    announce(workers, lines)
    stopping = threading.Event() if stopping is None else stopping
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    ended = None
    while not stopping.wait(0.1):
        ended = next((worker for worker in workers if worker.poll() is not None), None)
        if ended is not None:
            LOG.error("worker process %d ended with status %d: stopping the others", ended.pid, ended.returncode)
            break
    stop(workers, grace=settings.grace_seconds)
    return 0 if ended is None else shell_status(ended.returncode)


def shell_status(returncode: int) -> int:
    """A process's end as a shell reports it: its exit status, or 128 + the signal's number for one a signal ended
    (Popen's negative number, which `sys.exit` would turn into 256 less it)."""
    return 128 - returncode if returncode < 0 else returncode


def drained_with(supervisor: int) -> Callable[[], None]:
    """What a worker runs before its server starts: SIGTERM (drain, then exit) when the supervisor dies, even
    by SIGKILL, so no worker outlives it holding the port; a supervisor already gone ends it at once."""

    def arrange() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != supervisor:  # it died before the request above took effect
            os._exit(1)

    return arrange


def announce(workers: list[subprocess.Popen], first_lines: list[str]) -> None:
    """The first worker's address line once (they share it), then every worker's other lines (HTTP, metrics)
    as each prints them, on this process's stdout."""
    sys.stdout.write(first_lines[0])
    sys.stdout.flush()

    def relay(worker: subprocess.Popen) -> None:
        for line in worker.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()

    for worker in workers:
        threading.Thread(target=relay, args=(worker,), name=f"worker-{worker.pid}-stdout", daemon=True).start()


def stop(workers: list[subprocess.Popen], *, grace: float) -> None:
    """SIGTERM to each worker still running (each drains for `grace` seconds), SIGKILL to any that outlives it."""
    for worker in workers:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
    for worker in workers:
        try:
            worker.wait(grace + STOP_MARGIN_SECONDS)
        except subprocess.TimeoutExpired:
            LOG.error("worker process %d did not stop within %.0f s: killed", worker.pid, grace + STOP_MARGIN_SECONDS)
            worker.kill()
            worker.wait()
