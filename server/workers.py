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
import logging
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence

from server.settings import Settings
from server.supervision import announce, first_lines, reserved, shell_status, stop, supervised_flags

__all__ = ["supervise"]

LOG = logging.getLogger("scoremap.serve")


def worker_argv(argv: Sequence[str], *, settings: Settings, port: int, http_port: int | None, index: int) -> list[str]:
    """The command line of worker `index`: the server's own flags, then what makes it one of the workers
    (argparse takes the last value of a flag given twice)."""
    command = [sys.executable, "-m", "server.main", *argv, "--workers", "1", "--reuse-port",
               "--budget-share", str(settings.workers), "--port", str(port), *supervised_flags()]
    if http_port is not None:
        command += ["--http-port", str(http_port)]
    if settings.metrics_port is not None:
        command += ["--metrics-port", str(settings.metrics_port + index if settings.metrics_port else 0)]
    return command


def supervise(argv: Sequence[str], *, host: str, port: int, settings: Settings,
              stopping: threading.Event | None = None) -> int:
    """Run `settings.workers` server processes on host:port until SIGTERM or SIGINT (passed on to each) or until
    one of them ends (the others are then stopped); the exit status of the first to end (`shell_status`), or after a
    signal 0, or the status of one that ended otherwise than by the stop (`stop`: a crash, or a kill past the grace
    period). `stopping`: the event the caller's own handlers of those signals set (a signal that came before this
    was called stops it)."""
    stopping = threading.Event() if stopping is None else stopping
    with contextlib.ExitStack() as ports:
        port = ports.enter_context(reserved(host, port))
        http_port = None if settings.http_port is None else ports.enter_context(reserved(host, settings.http_port))
        workers = [subprocess.Popen(worker_argv(argv, settings=settings, port=port, http_port=http_port, index=index),
                                    stdout=subprocess.PIPE, text=True)
                   for index in range(settings.workers)]
        lines = first_lines(workers, stopping, watched=workers)
    if stopping.is_set():  # before every worker listened: each stops where it is
        return stop(workers, grace=settings.grace_seconds)
    if not all("listening on" in line for line in lines):
        stop(workers, grace=0.0)
        return max((worker.returncode or 0 for worker in workers), default=0) or 2
    announce(workers, lines)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    ended = None
    while not stopping.wait(0.1):
        ended = next((worker for worker in workers if worker.poll() is not None), None)
        if ended is not None:
            LOG.error("worker process %d ended with status %d: stopping the others", ended.pid, ended.returncode)
            break
    stopped = stop(workers, grace=settings.grace_seconds)
    return stopped if ended is None else shell_status(ended.returncode)
