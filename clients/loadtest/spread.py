"""A load level spread over several sending processes, merged into one report.

One Python process sending gRPC calls is itself a ceiling: a fast (GPU) server answers faster than one
interpreter can send. `LoadTester` starts sending processes (spawned, each with its own channels: gRPC does not
survive a fork), keeps them for every level, and gives each level's processes a share of it: a closed loop's
callers and requests divided among them, an open loop's arrivals dealt round (process k of N sends arrivals
k, k + N, ...: each keeps the level's schedule, so together they send at the rate asked). Each process hands
its sends and answers (instants on the machine's monotonic clock, shared by every process) to this one every
`LoadLimits.stream_every_s`; the window's logic and every figure work on the merged samples, so a percentile is
one over every process's latencies.

The load tester's CPU is read at each window's edges over every process of it (this one included); its
capacity is one core per sending process, no more than its cores. A sending process starts with
`LoadLimits.grpc_experiments` in its environment: gRPC reads it once, as it is imported, so it is set for the
process, never changed in this one.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TextIO

import grpc

from clients.api.client import channel_options
from clients.api.settings import ClientSettings
from clients.loadtest.latency import LevelReport, Sample
from clients.loadtest.levels import LevelPlan, Meters, run_level
from clients.loadtest.server_metrics import MetricsSnapshot
from clients.loadtest.settings import LoadLimits
from clients.loadtest.traffic import Closed, Counts, Open, Payloads, clock, raw_calls
from clients.loadtest.usage import busy_seconds, capacity_cores, cpu_seconds, tree_cpu_seconds

__all__ = ["Target", "LoadTester", "LoadTesterError", "split"]

log = logging.getLogger("scoremap-loadtest")


class LoadTesterError(RuntimeError):
    """A sending process failed to start or stopped answering."""


@dataclass(frozen=True)
class Target:
    """The server and how to reach it; every sending process opens its own `connections` channels to it, each
    with a subchannel of its own (one TCP connection each: a server of several processes behind one port gets
    its connections spread by the kernel)."""

    address: str
    tls: bool = False
    root_certificates: bytes | None = None
    metadata: tuple[tuple[str, str], ...] = ()
    settings: ClientSettings = field(default_factory=ClientSettings)
    connections: int = 1

    def open(self) -> list[grpc.Channel]:
        options = [*channel_options(self.settings), ("grpc.use_local_subchannel_pool", 1)]
        if self.tls:
            credentials = grpc.ssl_channel_credentials(root_certificates=self.root_certificates)
            return [grpc.secure_channel(self.address, credentials, options=options) for _ in range(self.connections)]
        return [grpc.insecure_channel(self.address, options=options) for _ in range(self.connections)]


def split(total: int, weights: Sequence[int]) -> list[int]:
    """`total` divided in proportion to `weights`, in whole parts that add up to it (largest remainders first)."""
    whole = sum(weights)
    parts = [total * weight // whole for weight in weights]
    order = sorted(range(len(weights)), key=lambda k: (-(total * weights[k] % whole), k))
    for k in order[:total - sum(parts)]:
        parts[k] += 1
    return parts


# --- a sending process --------------------------------------------------------------------------
_START = threading.Lock()  # one process started at a time: the environment it inherits is set for it alone


@contextmanager
def _sender_environment(limits: LoadLimits) -> Iterator[None]:
    """The environment a sending process is started with: GRPC_EXPERIMENTS from `limits` unless it is set already.
    A spawned process inherits this process's environment as it starts; it is put back right after."""
    with _START:
        if "GRPC_EXPERIMENTS" in os.environ or not limits.grpc_experiments:
            yield
            return
        os.environ["GRPC_EXPERIMENTS"] = limits.grpc_experiments
        try:
            yield
        finally:
            del os.environ["GRPC_EXPERIMENTS"]


def _hand_over(connection, traffic: Counts, sent: int, answered: int) -> tuple[int, int]:
    """Send what `traffic` sent and had answered since the last hand-over, and the instant up to which that is
    all (sends and answers are stamped under the same lock); the new marks."""
    with traffic.lock:
        as_of, new_sent, new_answers = clock(), traffic.sent_at[sent:], traffic.samples[answered:]
    connection.send(("data", as_of, new_sent, [(s.done_s, s.latency_s, s.status) for s in new_answers]))
    return sent + len(new_sent), answered + len(new_answers)


def _sending_process(connection, target: Target, encoded: list[bytes], limits: LoadLimits) -> None:
    """A sending process: opens its channels, then runs each level share it is given until told to stop."""
    channels = target.open()
    try:
        calls, payloads = raw_calls(channels), Payloads(encoded)
        connection.send(("ready", os.getpid()))
        while (command := connection.recv())[0] == "level":
            _, mode, share, options = command
            common = dict(timeout_s=options["timeout_s"], limits=limits, metadata=target.metadata,
                          first=options["first"], step=options["step"])
            traffic = (Closed(calls, payloads, callers=share, **common) if mode == "closed" else
                       Open(calls, payloads, rate=options["rate"], in_flight=share, **common))
            traffic.send_limit = options["send_limit"]
            traffic.start(at=options["at"])
            sent = answered = 0
            every = limits.warm_up_every_s  # until the window opens, its edge waits on these hand-overs
            while (word := connection.recv()[0] if connection.poll(every) else "") in ("", "opened"):
                if word == "opened":
                    every = limits.stream_every_s
                sent, answered = _hand_over(connection, traffic, sent, answered)
            traffic.finish()  # "stop", or "close": the load tester is ending
            _hand_over(connection, traffic, sent, answered)
            connection.send(("finished", None))
            if word == "close":
                break
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the load tester went away, or the user stopped it: nothing left to send to
    finally:
        for channel in channels:
            channel.close()


# --- the merging side -----------------------------------------------------------------------------
class _Spread(Counts):
    """One level sent by several processes: their shares started at one instant, their samples merged here."""

    def __init__(self, tester: LoadTester, mode: str, level: float, shares: list[int], *, timeout_s: float,
                 limits: LoadLimits) -> None:
        super().__init__(mode, level, timeout_s=timeout_s, limits=limits)
        self.tester, self.shares = tester, shares
        self.finished = 0
        self.active: list[int] = []
        self.as_of: dict[int, float] = {}  # each process's hand-overs are complete up to this instant

    def start(self) -> None:
        self.started = clock() + self.limits.start_lead_s
        workers = [k for k, share in enumerate(self.shares) if share]
        if self.mode == "closed":
            limits = split(self.send_limit, [self.shares[k] for k in workers])
        else:  # arrival n goes to the process n % len(workers)
            limits = [len(range(position, self.send_limit, len(workers))) for position in range(len(workers))]
        self.active = workers
        for position, (k, limit) in enumerate(zip(workers, limits)):
            self.as_of[k] = -math.inf
            self.tester._tell(k, ("level", self.mode, self.shares[k], {
                "timeout_s": self.timeout_s, "first": position, "step": len(workers), "send_limit": limit,
                "at": self.started, "rate": self.level}))

    def opened(self) -> None:
        for k in self.active:
            self.tester._tell(k, ("opened",))

    def take(self, k: int, message: tuple) -> None:
        """Process k's hand-over (its sends and answers since the last) or its word that it finished."""
        with self.changed:
            if message[0] == "data":
                self.as_of[k] = message[1]
                self.sent_at.extend(message[2])
                self.samples.extend(Sample(*answer) for answer in message[3])
            else:
                self.as_of[k] = math.inf
                self.finished += 1
            self.changed.notify_all()

    def _complete_until(self) -> float:
        """Every process's sends and answers up to this instant are here (the lock held)."""
        return min((self.as_of.get(k, -math.inf) for k in self.active), default=-math.inf)

    def settle(self, instant: float) -> None:
        until = clock() + self.limits.process_start_s
        with self.changed:
            while self._complete_until() < instant and not self.tester.failure:
                if not self.changed.wait(max(0.0, until - clock())):
                    raise LoadTesterError("a sending process stopped handing over its answers")

    def warm_up(self, count: int, until: float) -> float:
        if self.mode == "open":
            return super().warm_up(count, until)
        if count == 0:
            return self.started
        with self.changed:  # the count-th answer of all: once every process's answers before it are in
            while True:
                complete = self._complete_until()
                done = sorted(s.done_s for s in self.samples if s.done_s <= complete)
                if len(done) >= count:
                    return done[count - 1]
                if self.tester.failure or not self.changed.wait(max(0.0, until - clock())):
                    return clock()

    def finish(self) -> None:
        """Tell every process to stop; wait for their last answers (each bounded by the deadline and the drain
        grace, as one process's are)."""
        self.stop.set()
        for k in self.active:
            self.tester._tell(k, ("stop",))
        until = clock() + self.timeout_s + self.limits.drain_grace_s + self.limits.process_start_s
        with self.changed:
            while self.finished < len(self.active) and self.changed.wait(max(0.0, until - clock())):
                if self.tester.failure:
                    break
        if self.finished < len(self.active):
            raise LoadTesterError(self.tester.failure or "a sending process did not finish its level in time")


class LoadTester:
    """The load tester's sending processes, kept for every level: `closed(concurrency, plan)` and
    `open(rate, plan)` each report one level, merged over them. `grow(processes)` adds processes (the auto rule
    of scoremap-loadtest grows them between calibration windows). Close it (or use it as a context manager)
    to end the processes."""

    def __init__(self, target: Target, requests: Sequence, *, processes: int = 1, limits: LoadLimits = LoadLimits(),
                 server_pid: int | None = None, count_this_process: bool = True) -> None:
        self.target, self.limits, self.server_pid = target, limits, server_pid
        self.count_this_process = count_this_process  # False where this process does other work (hosts a server)
        self.encoded = [r if isinstance(r, bytes) else r.SerializeToString() for r in requests]
        Payloads(self.encoded)  # refuses an empty list here, before any process starts
        self.context = multiprocessing.get_context("spawn")
        self.processes: list = []
        self.connections: list = []
        self.pids: list[int] = []
        self.failure: str | None = None
        self.gone: set = set()  # connections of processes that went away
        self.level: _Spread | None = None
        self.lock = threading.Lock()
        self.reader: threading.Thread | None = None
        self.closing = threading.Event()
        try:
            self.grow(processes)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> LoadTester:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()

    @property
    def count(self) -> int:
        return len(self.processes)

    def grow(self, processes: int) -> None:
        """Start sending processes until there are `processes` of them (each ready to send)."""
        started = []
        while len(self.processes) + len(started) < processes:
            ours, theirs = self.context.Pipe()
            process = self.context.Process(target=_sending_process, name="scoremap-loadtest-sender", daemon=True,
                                           args=(theirs, self.target, self.encoded, self.limits))
            with _sender_environment(self.limits):
                process.start()
            theirs.close()
            started.append((process, ours))
        for process, ours in started:
            if not ours.poll(self.limits.process_start_s):
                process.kill()
                raise LoadTesterError(f"a sending process did not start within {self.limits.process_start_s:g} s")
            try:
                word, pid = ours.recv()
            except EOFError:
                raise LoadTesterError(f"a sending process ended as it started (exit status {process.exitcode}); "
                                      "its error is above") from None
            with self.lock:
                self.processes.append(process)
                self.connections.append(ours)
                self.pids.append(pid)
        if self.reader is None and self.processes:
            self.reader = threading.Thread(target=self._read, name="loadtest-merge", daemon=True)
            self.reader.start()

    def _tell(self, k: int, message: tuple) -> None:
        try:
            self.connections[k].send(message)
        except (OSError, ValueError) as error:
            raise LoadTesterError(f"sending process {k} is gone ({error})") from None

    def _read(self) -> None:
        """Route every process's hand-overs to the level running; note a process that went away."""
        while not self.closing.is_set():
            with self.lock:
                connections = [c for c in self.connections if c not in self.gone]
            for ready in multiprocessing.connection.wait(connections, timeout=1.0):
                try:
                    message = ready.recv()
                except (EOFError, OSError):
                    if not self.closing.is_set():
                        self.failure = "a sending process ended in the middle of a level"
                        with self.lock:
                            self.gone.add(ready)
                        if self.level is not None:
                            with self.level.changed:
                                self.level.changed.notify_all()
                    continue
                if self.level is not None:
                    self.level.take(self.connections.index(ready), message)

    def meters(self, active: int, *, metrics: Callable[[], MetricsSnapshot | None] | None = None) -> Meters:
        """What each window's edges read: the CPU of every process of the load tester (this one too, with
        count_this_process); the time its sending processes ran or waited to run, whose capacity is one core per
        sending process at work; a local server's CPU (`server_pid`)."""
        pids = [os.getpid(), *self.pids] if self.count_this_process else list(self.pids)
        senders = list(self.pids)  # busy: the processes whose capacity it is a share of
        return Meters(client_cpu=lambda: cpu_seconds(pids), client_busy=lambda: busy_seconds(senders),
                      processes=active, capacity_cores=capacity_cores(active),
                      server_cpu=(lambda: tree_cpu_seconds(self.server_pid)) if self.server_pid else None,
                      metrics=metrics)

    def _run(self, mode: str, level: float, shares: list[int], plan: LevelPlan,
             metrics: Callable[[], MetricsSnapshot | None] | None, live: TextIO | None) -> LevelReport:
        if self.failure:
            raise LoadTesterError(self.failure)
        self.level = _Spread(self, mode, level, shares, timeout_s=plan.timeout_s, limits=self.limits)
        try:
            return run_level(self.level, plan, limits=self.limits, live=live,
                             meters=self.meters(sum(1 for share in shares if share), metrics=metrics))
        finally:
            self.level = None

    def closed(self, concurrency: int, plan: LevelPlan, *, metrics: Callable[[], MetricsSnapshot | None] | None = None,
               live: TextIO | None = None) -> LevelReport:
        """A closed loop of `concurrency` callers, divided among the processes (one process per caller at most)."""
        return self._run("closed", concurrency, split(concurrency, [1] * self.count), plan, metrics, live)

    def open(self, rate: float, plan: LevelPlan, *, metrics: Callable[[], MetricsSnapshot | None] | None = None,
             live: TextIO | None = None) -> LevelReport:
        """Arrivals at `rate` per second, dealt round the processes; each holds its share of the in-flight bound."""
        bound = split(self.limits.max_in_flight, [1] * self.count)
        return self._run("open", rate, [max(1, share) for share in bound], plan, metrics, live)

    def close(self) -> None:
        """End the sending processes."""
        self.closing.set()
        for connection in self.connections:
            try:
                connection.send(("close",))
            except (OSError, ValueError):
                pass
        for process in self.processes:
            process.join(self.limits.drain_grace_s)
            if process.is_alive():
                process.kill()
                process.join()
        if self.reader is not None:
            self.reader.join()
        for connection in self.connections:
            connection.close()
