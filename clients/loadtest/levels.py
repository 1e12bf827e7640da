"""One load level's measurement: its own warm-up, then a window (or windows until the rate is stable), and
what was read at the window's edges: the server's metrics, the load tester's CPU and a local server's.

Only requests completed inside the window count towards its rate and percentiles, and those still in flight
when it closes are reported apart (perf_analyzer's rule).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, TextIO

from clients.loadtest.latency import LevelReport, stable, summarise
from clients.loadtest.server_metrics import MetricsSnapshot, server_split
from clients.loadtest.settings import LoadLimits
from clients.loadtest.traffic import Counts, clock

__all__ = ["LevelPlan", "Meters", "Own", "Reading", "run_level", "LIVE_POLL_S", "TIMED_POLL_S"]

# How often (seconds) a level checks whether its window has closed: often when its requests are counted (the
# window closes once they are answered), seldom when only its length bounds it (each check wakes this process).
LIVE_POLL_S = 0.02
TIMED_POLL_S = 0.25


@dataclass(frozen=True)
class LevelPlan:
    """How one level is measured: its own warm-up, then one window (or, `until_stable`, windows
    until the last `stable_windows` rates agree within `stable_tolerance`)."""

    # Length of a measurement window (seconds).
    duration_s: float
    # Most requests sent after the warm-up's; the window also ends once they are all answered.
    max_requests: int
    # Deadline of each request (seconds).
    timeout_s: float
    # Requests answered (closed loop) or arrivals (open loop) before the window opens, per level.
    warmup: int = 2
    until_stable: bool = False
    stable_windows: int = 3
    stable_tolerance: float = 0.05


class Own(NamedTuple):
    """The load tester's own meters, read at `at`: its CPU seconds and the seconds it ran or waited to run."""

    at: float = 0.0
    cpu: float | None = None
    busy: float | None = None


@dataclass(frozen=True)
class Reading:
    """The meters at one window edge (None: not measured). The load tester's own are read before and after the
    others (`first`, `last`): a window opening here counts from `last` and one closing here up to `first`, so its
    figures leave out its reading of the others (a local server's CPU walks /proc, a scrape parses /metrics)."""

    first: Own = Own()
    last: Own = Own()
    server_cpu: float | None = None
    metrics: MetricsSnapshot | None = None


@dataclass(frozen=True)
class Meters:
    """What is read at each window edge besides the samples: the load tester's own CPU seconds and the seconds its
    threads ran or waited to run (every process of it, clients.loadtest.usage), the cores it may use for them
    (`capacity_cores`), a local server's CPU seconds, the server's metrics."""

    client_cpu: Callable[[], float] | None = None
    client_busy: Callable[[], float | None] | None = None
    processes: int = 1
    capacity_cores: int = 1
    server_cpu: Callable[[], float] | None = None
    metrics: Callable[[], MetricsSnapshot | None] | None = None

    def _own(self) -> Own:
        return Own(clock(), *(meter() if meter else None for meter in (self.client_cpu, self.client_busy)))

    def read(self) -> Reading:
        first = self._own()
        server_cpu, metrics = (meter() if meter else None for meter in (self.server_cpu, self.metrics))
        return Reading(first, self._own(), server_cpu, metrics)


def _spent(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else max(0.0, after - before)


def _live(traffic: Counts, window: int, start: float, length: float) -> str:
    """The level's live line: how the current window is going."""
    elapsed = clock() - start
    with traffic.lock:
        inside = [s for s in traffic.samples if s.done_s > start]
    ok = sum(s.status == "OK" for s in inside)
    return (f"{traffic.mode} {traffic.level:g}: window {window}  {elapsed:4.1f}/{length:g} s  {ok} ok  "
            f"{len(inside) - ok} errors  {ok / elapsed if elapsed > 0 else 0.0:.1f}/s")


def run_level(traffic: Counts, plan: LevelPlan, *, limits: LoadLimits, meters: Meters = Meters(),
              live: TextIO | None = None) -> LevelReport:
    """Drive `traffic`: its warm-up, then its window(s); the report of the window (with
    `until_stable`, of the last `stable_windows` windows together)."""
    level_end = clock() + limits.max_duration_s
    tty = live is not None and live.isatty()
    rates: list[float] = []
    bounds: list[float] = []  # the windows' edges
    readings: list[Reading] = []  # the meters at each edge
    traffic.send_limit = plan.warmup + plan.max_requests
    poll = LIVE_POLL_S if plan.max_requests < limits.max_requests else TIMED_POLL_S
    traffic.start()
    try:
        bounds.append(traffic.warm_up(plan.warmup, clock() + plan.timeout_s))
        readings.append(meters.read())
        traffic.opened()
        while True:
            start = bounds[-1]
            end = min(start + plan.duration_s, level_end)
            next_line = start + limits.live_every_s
            while (now := clock()) < end and not traffic.window_closed():
                if tty and now >= next_line:
                    live.write("\r" + _live(traffic, len(bounds), start, plan.duration_s))
                    live.flush()
                    next_line += limits.live_every_s
                time.sleep(min(poll, end - now, max(next_line - now, 0.0) if tty else poll))
            if traffic.window_closed():  # every request answered: the window ends with the last answer
                with traffic.lock:
                    bounds.append(max([start, *(s.done_s for s in traffic.samples)]))
            else:
                bounds.append(clock())
            readings.append(meters.read())
            traffic.settle(bounds[-1])
            with traffic.lock:
                ok = sum(1 for s in traffic.samples if start < s.done_s <= bounds[-1] and s.status == "OK")
            rates.append(ok / (bounds[-1] - start) if bounds[-1] > start else 0.0)
            if live is not None:
                live.write(("\r" if tty else "") + _live(traffic, len(rates), start, plan.duration_s) + "\n")
                live.flush()
            if (not plan.until_stable or stable(rates, count=plan.stable_windows, tolerance=plan.stable_tolerance)
                    or traffic.window_closed() or bounds[-1] >= level_end or len(rates) >= limits.max_windows):
                break
    finally:
        traffic.finish()
    # Every send and answer carries its instant, so what was in flight at the window's end is counted once all
    # are in (the processes of a spread level hand theirs over a moment late).
    in_flight = traffic.in_flight_at(bounds[-1] if len(bounds) > 1 else clock())
    span = min(len(rates), plan.stable_windows) if plan.until_stable else 1
    first = len(bounds) - 1 - span
    before, after = readings[first], readings[-1]
    with traffic.lock:
        samples, sent = list(traffic.samples), len(traffic.sent_at)
    return summarise(traffic.mode, traffic.level, samples, sent=sent, start_s=bounds[first], end_s=bounds[-1],
                     in_flight_at_end=in_flight, windows=len(rates),
                     stable=stable(rates, count=plan.stable_windows, tolerance=plan.stable_tolerance)
                     if plan.until_stable else None,
                     server=server_split(before.metrics, after.metrics)
                     if before.metrics is not None and after.metrics is not None else None,
                     metered_s=after.first.at - before.last.at, client_cpu_s=_spent(before.last.cpu, after.first.cpu),
                     client_busy_s=_spent(before.last.busy, after.first.busy),
                     processes=meters.processes, capacity_cores=meters.capacity_cores,
                     busy_warning=limits.client_busy_warning,
                     server_cpu_s=_spent(before.server_cpu, after.server_cpu))
