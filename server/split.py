"""`--fronts N`: one engine process and N front processes, supervised (vLLM V1's split of engine and API servers).

    clients ──► front 0 ─┐  (gRPC and HTTP on the same ports, SO_REUSEPORT; admission, decode, assembly)
            ──► front 1 ─┼─ a Unix socket each: typed messages ─► engine (plans, batcher, memory budget; one CUDA context)
                 ...     ┘  shared memory: each front's canvases and lattices

The supervisor (this module's `supervise`) reserves the ports, checks /dev/shm, starts the engine and then the
fronts, passes SIGTERM on (fronts drain first, then the engine), and starts again whichever process ends
unexpectedly (after a pause that grows while it keeps ending soon after its start): a new engine warms up and tells
every front (health SERVING again), a new front takes the dead one's place while the engine frees what it held. An
engine that cannot load or warm up, at the first start or a later one, ends the server with its status, as one
process does. Each process gets SIGTERM when the supervisor dies, even by SIGKILL (server/supervision.py), and
fronts unlink their shared memory as they exit. `ps` shows each one's role."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

from convert.arguments import format_bytes
from server.memory.python_heap import freeze_startup_heap
from server.settings import Settings
from server.supervision import STOP_MARGIN_SECONDS, announce, first_lines, reserved, stop, supervised_flags

__all__ = ["engine_address", "front_client", "run_engine", "supervise"]

LOG = logging.getLogger("scoremap.serve")
RESTART_PAUSE_SECONDS = 0.5  # between a process's unexpected end and its new start, doubled for each quick end
MAX_RESTART_PAUSE_SECONDS = 30.0
STEADY_SECONDS = 10.0  # a process that ran this long before it ended starts again after RESTART_PAUSE_SECONDS
UNIX_PATH_BYTES = 107  # the longest path a Unix socket's address holds (108 with its terminating NUL)
CANNOT_LOAD = 2  # the engine's exit statuses for a start that failed, as one process's: starting it again fails alike
WARM_UP_FAILED = 3
ROLE_ENGINE = "engine"
ROLE_FRONT = "front"


def engine_address(run: str) -> str:
    """Where the engine listens for its fronts: a Unix socket in the server's run folder."""
    return os.path.join(run, "engine.sock")


def run_name(run: str) -> str:
    """The prefix of the server's shared-memory regions: its run folder's name, unique per server."""
    return os.path.basename(run.rstrip("/"))


def set_title(title: str) -> None:
    """The process's name in `ps` and top, as PostgreSQL and nginx name theirs."""
    import setproctitle

    setproctitle.setproctitle(f"scoremap-serve: {title}")


# --- the supervisor -------------------------------------------------------------------------------------------
def shm_problem(settings: Settings) -> str | None:
    """Why /dev/shm cannot hold every front's region, with how to give it more; None when it can."""
    from server.engine.shm import free_shm_bytes

    needed, free = settings.fronts * settings.front_shm_bytes, free_shm_bytes()
    if needed <= free:
        return None
    return (f"--fronts {settings.fronts} need {format_bytes(needed)} of shared memory (--front-shm-bytes "
            f"{format_bytes(settings.front_shm_bytes)} each) but /dev/shm has {format_bytes(free)} free: give the "
            f"container more (docker run --shm-size={-(-needed // 2**20) + 64}m, or Kubernetes an emptyDir of "
            "medium Memory at /dev/shm), or lower --front-shm-bytes or --fronts")


def child_argv(argv: Sequence[str], *, role: str, run: str, extra: Sequence[str] = ()) -> list[str]:
    """A process's command line: the server's own flags, then its part (argparse takes a flag's last value)."""
    return [sys.executable, "-m", "server.main", *argv, "--fronts", "0", "--workers", "1", "--split-role", role,
            "--split-run", run, *supervised_flags(), *extra]


@dataclasses.dataclass
class Child:
    """One supervised process, how to start it again, and when (a process that keeps ending soon after each start
    waits longer each time, as Kubernetes' crash-loop back-off does)."""

    role: str
    command: list[str]
    env: dict[str, str]
    process: subprocess.Popen | None = None
    started: float = 0.0
    ends: int = 0  # unexpected ends in a row, each soon after the start before it
    due: float | None = None  # when it starts again, after an unexpected end

    def start(self) -> None:
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, text=True, env=self.env)
        self.started, self.due = time.monotonic(), None

    def ended(self, now: float) -> float:
        """It ended unexpectedly at `now`: schedule its next start; the pause before it."""
        soon = self.ends > 0 and now - self.started < STEADY_SECONDS  # it ended again soon after being started again
        self.ends = self.ends + 1 if soon else 1
        pause = min(RESTART_PAUSE_SECONDS * 2 ** (self.ends - 1), MAX_RESTART_PAUSE_SECONDS)
        self.due = now + pause
        return pause


def supervise(argv: Sequence[str], *, host: str, port: int, settings: Settings, stopping: threading.Event) -> int:
    """Run the engine and `settings.fronts` fronts on host:port until `stopping` is set (the caller's handlers of
    SIGTERM and SIGINT set it, from before the children start); 0 once all drained, or the status of a process that
    crashed and was not yet started again when the stop came, or crashed during the drain (`drain`); the engine's
    status when it could not load or warm up, 2 when they could not start otherwise."""
    problem = shm_problem(settings)
    if problem is not None:
        sys.stderr.write(f"scoremap-serve: {problem}\n")
        return 2
    run = tempfile.mkdtemp(prefix=f"scoremap-{os.getpid()}-")
    try:
        if len(os.fsencode(engine_address(run))) > UNIX_PATH_BYTES:
            sys.stderr.write(f"scoremap-serve: the engine's socket would be {engine_address(run)}, longer than the "
                             f"{UNIX_PATH_BYTES} bytes a Unix socket's path may have: set TMPDIR to a shorter "
                             "folder\n")
            return 2
        # Held until the server ends, not only while it starts: a port every front left at once (each being started
        # again) stays the server's, and its new fronts bind it.
        with contextlib.ExitStack() as ports:
            port = ports.enter_context(reserved(host, port))
            http_port = None if settings.http_port is None else ports.enter_context(reserved(host, settings.http_port))
            return _supervise(argv, port=port, http_port=http_port, settings=settings, run=run, stopping=stopping)
    finally:
        from server.engine.shm import remove_stale

        remove_stale(run_name(run))
        shutil.rmtree(run, ignore_errors=True)


def _supervise(argv: Sequence[str], *, port: int, http_port: int | None, settings: Settings, run: str,
               stopping: threading.Event) -> int:
    engine_flags = ["--port", "0", "--reuse-port"]
    if settings.metrics_port is not None:
        engine_flags += ["--metrics-port", "0", "--metrics-address", "127.0.0.1"]
    engine = Child(ROLE_ENGINE, child_argv(argv, role=ROLE_ENGINE, run=run,
                                           extra=engine_flags), dict(os.environ))
    front_env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # a front never makes a CUDA context
    fronts = []
    for index in range(settings.fronts):
        extra = ["--reuse-port", "--budget-share", str(settings.fronts), "--port", str(port)]
        if http_port is not None:
            extra += ["--http-port", str(http_port)]
        if settings.metrics_port is not None:  # its own, on loopback: the supervisor's scrape shows them all
            extra += ["--metrics-port", "0", "--metrics-address", "127.0.0.1"]
        fronts.append(Child(f"{ROLE_FRONT}:{index}",
                            child_argv(argv, role=f"{ROLE_FRONT}:{index}", run=run, extra=extra), front_env))
    engine.start()
    for front in fronts:
        front.start()
    children = [engine, *fronts]
    lines = first_lines(processes(fronts), stopping, watched=processes(children))
    if stopping.is_set():  # before every front listened: each stops where it is (a warm-up at its next plan)
        return drain(engine, fronts, grace=settings.grace_seconds)
    if not all("listening on" in line for line in lines):
        stop(processes(children), grace=0.0)
        return failed_start_status(children)
    threading.Thread(target=drain_output, args=(engine,), name="engine-stdout", daemon=True).start()
    announce([front.process for front in fronts], lines)
    if settings.metrics_port is not None:
        from server.metrics import serve_processes

        served = serve_processes(run, port=settings.metrics_port, address=settings.metrics_address)
        sys.stdout.write(f"scoremap-serve metrics on http://{settings.metrics_address}:{served}/metrics\n")
        sys.stdout.flush()
    while not stopping.wait(0.1):
        now = time.monotonic()
        for child in children:
            if child.due is not None:
                if now >= child.due:
                    child.start()
                    relay = drain_output if child is engine else relay_output
                    threading.Thread(target=relay, args=(child,), name=f"{child.role}-stdout", daemon=True).start()
                continue
            if child.process.poll() is None:
                continue
            if child is engine and child.process.returncode in (CANNOT_LOAD, WARM_UP_FAILED):
                LOG.error("the engine process %d could not start again (status %d): stopping the server",
                          child.process.pid, child.process.returncode)
                drain(engine, fronts, grace=settings.grace_seconds)
                return child.process.returncode
            pause = child.ended(now)
            LOG.error("the %s process %d ended with status %d: starting it again in %.1f s", child.role,
                      child.process.pid, child.process.returncode, pause)
            if child is not engine:  # a killed front cannot unlink its region
                from server.engine.shm import region_prefix, remove_stale

                remove_stale(region_prefix(run_name(run), int(child.role.partition(":")[2])))
    return drain(engine, fronts, grace=settings.grace_seconds)


def processes(children: Sequence[Child]) -> list[subprocess.Popen]:
    """The children's processes, those started."""
    return [child.process for child in children if child.process is not None]


def failed_start_status(children: Sequence[Child]) -> int:
    """The server's exit status when it could not start: the first child's own (the engine's comes first: 2 cannot
    load, 3 warm-up failed), or 2 when each ended by a signal (a crash, or the stop), which gives no status."""
    return next((code for child in children if (code := child.process.returncode) is not None and code > 0), 2)


def drain(engine: Child, fronts: Sequence[Child], *, grace: float) -> int:
    """Stop the server: the fronts drain first (their calls in flight need the engine), then the engine. 0, or the
    status of a process (the engine's first) that ended otherwise than by the stop (`stop`): a crash not yet
    recovered from when the stop came, or during the drain, or one killed past the grace period."""
    fronts_status = stop(processes(fronts), grace=grace)
    return stop(processes([engine]), grace=grace) or fronts_status


def drain_output(child: Child) -> None:
    """Read what the engine prints (its listening line is for no one)."""
    for _line in child.process.stdout:
        pass


def relay_output(child: Child) -> None:
    """A front started again: its lines after the listening one, as the first fronts' are relayed."""
    for line in child.process.stdout:
        if "listening on" not in line:
            sys.stdout.write(line)
            sys.stdout.flush()


# --- the engine process ---------------------------------------------------------------------------------------
def run_engine(models, *, settings: Settings, stop: threading.Event) -> int:
    """The engine process: load and warm every model in-process, then serve the fronts until `stop` (SIGTERM),
    finishing what it holds first. CANNOT_LOAD, WARM_UP_FAILED, or 0 when stopped, at any moment. The server's run
    folder goes with it when the supervisor was killed (the engine waits for the fronts to go: it ends last)."""
    supervisor = os.getppid()
    try:
        return serve_fronts(models, settings=settings, stop=stop)
    finally:
        if os.getppid() != supervisor:
            shutil.rmtree(settings.split_run, ignore_errors=True)


def serve_fronts(models, *, settings: Settings, stop: threading.Event) -> int:
    """`run_engine`'s work: its exit status."""
    from server.engine.process import EngineLoop
    from server.errors import ScoringError
    from server.metrics import Metrics
    from server.scoring.pipeline import Pipeline

    set_title(ROLE_ENGINE)
    run = settings.split_run
    metrics = Metrics()
    try:
        pipeline = Pipeline(models, settings=dataclasses.replace(settings, warm_up=False), metrics=metrics)
    except ScoringError as error:
        sys.stderr.write(f"scoremap-serve: the engine cannot start: {error.message}\n")
        return CANNOT_LOAD
    try:
        if settings.warm_up:
            pipeline.check_warm_up()
            warming = threading.Event()
            warming.set()

            def close_if_warming() -> None:  # a stop while warming up ends the warm-up at its next plan
                stop.wait()
                if warming.is_set():
                    pipeline.close()

            threading.Thread(target=close_if_warming, name="engine-stop-warm-up", daemon=True).start()
            pipeline.warm_up()
            warming.clear()
    except ScoringError as error:
        pipeline.close()
        if stop.is_set():
            return 0
        sys.stderr.write(f"scoremap-serve: the engine's warm-up failed: {error.message}\n")
        return WARM_UP_FAILED
    if stop.is_set():
        pipeline.close()
        return 0
    freeze_startup_heap()
    core = pipeline.engine
    classes = {summary.name: summary.classes for summary in pipeline.models()}
    loop = EngineLoop(core, address=engine_address(run), classes=classes, on_idle=lambda: core.went_idle(False))
    loop.start()
    if settings.metrics_port is not None:
        publish_metrics(run, ROLE_ENGINE, metrics.serve(port=0, address=settings.metrics_address),
                        address=settings.metrics_address)
    sys.stdout.write("scoremap-serve engine listening on " + engine_address(run) + "\n")
    sys.stdout.flush()
    LOG.info("engine ready: %s on %s", ", ".join(classes), core.facts.provider)
    if settings.warm_up:
        threading.Thread(target=pipeline.warm_up_tiles, name="engine-tiles", daemon=True).start()
    stop.wait()
    loop.drain(settings.grace_seconds + STOP_MARGIN_SECONDS)
    pipeline.close()  # its runs end first: the loop then forgets every front's calls and closes the connections
    loop.stop()
    metrics.close()
    return 0


def publish_metrics(run: str, role: str, port: int, *, address: str) -> None:
    """Name this process's metrics endpoint for the supervisor's scrape (server.metrics.ProcessesCollector)."""
    path = pathlib.Path(run) / f"metrics-{role.replace(':', '-').replace(' ', '-')}"
    path.write_text(f"http://{address}:{port}/metrics")


# --- a front process ------------------------------------------------------------------------------------------
def front_client(settings: Settings, index: int, *, stop: threading.Event):
    """This front's client of the engine, once the engine has said it is warm; None when `stop` was set first."""
    from server.engine.shm import region_name
    from server.engine.remote import RemoteClient

    set_title(f"front {index}")
    run = settings.split_run
    client = RemoteClient(front=index, engine_address=engine_address(run),
                          region_name=region_name(run_name(run), index, os.getpid()),
                          region_bytes=settings.front_shm_bytes)
    while not client.wait_for_engine(0.1):
        if stop.is_set():
            client.close()
            return None
    return client
