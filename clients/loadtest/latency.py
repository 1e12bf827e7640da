"""Load-test statistics: per-level counts, throughput, latency percentiles, errors by status.

Pure functions over (completion time, latency, status) samples, so the numbers are testable
without a server. A level's figures cover one measurement window: only requests *completed*
inside it count towards its rate and percentiles (perf_analyzer's rule), and those still in
flight when it closes are reported apart. The samples of every sending process are merged before any
figure is taken: a percentile of all their latencies, never an average of each process's.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

import numpy as np

from clients.loadtest.settings import LoadLimits

__all__ = ["Sample", "LevelReport", "summarise", "stable", "format_table", "to_json", "to_csv", "PERCENTILES",
           "SERVER_STAGES", "client_bound_warning"]

PERCENTILES = (50, 90, 95, 99)
# The server's split of a request (the stage label of scoremap_stage_seconds), in report order.
SERVER_STAGES = ("queue", "preprocess", "inference", "postprocess")


@dataclass(frozen=True)
class Sample:
    """One request: when it completed (perf_counter seconds), its latency in seconds (from its
    scheduled send time) and its status name."""

    done_s: float
    latency_s: float
    status: str


@dataclass(frozen=True)
class LevelReport:
    """One load level (a concurrency or an arrival rate) and what its measurement window saw."""

    mode: str            # "closed" (fixed concurrency) or "open" (fixed arrival rate)
    level: float         # concurrency, or requests per second
    sent: int            # sent during the level, warm-up included
    completed: int       # answered OK inside the window
    duration_s: float    # the window's length
    throughput_rps: float
    p50_ms: float
    p90_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float
    errors: dict[str, int] = field(default_factory=dict)
    in_flight_at_end: int = 0   # sent but not answered when the window closed: not in the figures
    windows: int = 1            # windows run (more than one with --until-stable)
    stable: bool | None = None  # --until-stable: whether the last windows agreed
    # Server-side mean per request over the window (ms) by stage, and mean batch size; NaN
    # without --metrics-url.
    server_queue_ms: float = math.nan
    server_preprocess_ms: float = math.nan
    server_inference_ms: float = math.nan
    server_postprocess_ms: float = math.nan
    server_batch_size: float = math.nan
    # The load tester over the window: cores of CPU used and CPU ms per request answered, every process of it;
    # busy, the time its sending processes' threads ran or waited to run as a share of its capacity (one core per
    # sending process, no more than its cores); `client_bound` when busy passed the warning (the figures may be
    # the load tester's limit, not the server's). NaN unmeasured.
    client_processes: int = 1
    client_cpu_cores: float = math.nan
    client_busy: float = math.nan
    client_cpu_ms: float = math.nan
    client_bound: bool = False
    # A local server's CPU over the window (--server-pid: the process and its descendants): cores used, ms per
    # request answered; NaN unmeasured.
    server_cpu_cores: float = math.nan
    server_cpu_ms: float = math.nan


def summarise(mode: str, level: float, samples: Sequence[Sample], *, sent: int, start_s: float, end_s: float,
              in_flight_at_end: int = 0, windows: int = 1, stable: bool | None = None,
              server: dict[str, float] | None = None, metered_s: float | None = None, client_cpu_s: float | None = None,
              client_busy_s: float | None = None, processes: int = 1,
              capacity_cores: int = 1, busy_warning: float = LoadLimits.client_busy_warning,
              server_cpu_s: float | None = None) -> LevelReport:
    """The report of the window (start_s, end_s]: samples completed outside it are left out;
    latency percentiles are over OK requests (NaN when none). `client_cpu_s` and `server_cpu_s`: CPU seconds
    spent over the window by the load tester (its `processes`, on `capacity_cores`) and by a local server;
    `client_busy_s`, the seconds the load tester's threads ran or waited to run (its CPU when None); all three
    over `metered_s` seconds (the window's length when None), the time between the readings."""
    inside = [s for s in samples if start_s < s.done_s <= end_s]
    ok = np.array([s.latency_s for s in inside if s.status == "OK"], dtype=np.float64) * 1000
    errors = Counter(s.status for s in inside if s.status != "OK")
    if ok.size:
        p50, p90, p95, p99 = (float(v) for v in np.percentile(ok, PERCENTILES))
        worst = float(ok.max())
    else:
        p50 = p90 = p95 = p99 = worst = math.nan
    duration = end_s - start_s
    split = {f"server_{name}": value for name, value in (server or {}).items()}
    usage: dict[str, float | bool] = {}
    metered = duration if metered_s is None else metered_s
    if metered > 0 and client_cpu_s is not None:
        busy = (client_cpu_s if client_busy_s is None else client_busy_s) / metered / capacity_cores
        usage.update(client_cpu_cores=client_cpu_s / metered, client_busy=busy,
                     client_cpu_ms=1000 * client_cpu_s / len(inside) if inside else math.nan,
                     client_bound=busy > busy_warning)
    if metered > 0 and server_cpu_s is not None:
        usage.update(server_cpu_cores=server_cpu_s / metered,
                     server_cpu_ms=1000 * server_cpu_s / len(inside) if inside else math.nan)
    return LevelReport(
        mode=mode, level=level, sent=sent, completed=int(ok.size), duration_s=duration,
        throughput_rps=ok.size / duration if duration > 0 else 0.0,
        p50_ms=p50, p90_ms=p90, p95_ms=p95, p99_ms=p99, max_ms=worst, errors=dict(sorted(errors.items())),
        in_flight_at_end=in_flight_at_end, windows=windows, stable=stable, **split, client_processes=processes,
        **usage,
    )


def stable(rates: Sequence[float], *, count: int, tolerance: float) -> bool:
    """Whether the last `count` window rates all lie within `tolerance` (a fraction) of their mean."""
    if len(rates) < count:
        return False
    last = rates[-count:]
    mean = sum(last) / count
    return mean > 0 and all(abs(rate - mean) <= tolerance * mean for rate in last)


_COLUMNS = ("mode", "level", "sent", "completed", "in_flight_at_end", "throughput_rps", "p50_ms", "p90_ms",
            "p95_ms", "p99_ms", "max_ms", "errors")
_SERVER_COLUMNS = tuple(f"server_{stage}_ms" for stage in SERVER_STAGES) + ("server_batch_size",)
_STABLE_COLUMNS = ("windows", "stable")
_CLIENT_COLUMNS = ("client_processes", "client_cpu_cores", "client_busy")
_SERVER_CPU_COLUMNS = ("server_cpu_cores",)
_HEADINGS = {"in_flight_at_end": "in_flight", "throughput_rps": "rps", **{f"server_{s}_ms": f"srv_{s}_ms" for s in SERVER_STAGES},
             "server_batch_size": "srv_batch", "client_processes": "procs", "client_cpu_cores": "cli_cpu",
             "client_busy": "cli_busy", "server_cpu_cores": "srv_cpu"}


def _columns(reports: Sequence[LevelReport]) -> tuple[str, ...]:
    columns = _COLUMNS
    if any(r.stable is not None for r in reports):
        columns += _STABLE_COLUMNS
    if any(not math.isnan(r.server_batch_size) or not math.isnan(r.server_inference_ms) for r in reports):
        columns += _SERVER_COLUMNS
    if any(not math.isnan(r.client_cpu_cores) for r in reports):
        columns += _CLIENT_COLUMNS
    if any(not math.isnan(r.server_cpu_cores) for r in reports):
        columns += _SERVER_CPU_COLUMNS
    return columns


def _cell(report: LevelReport, column: str) -> str:
    value = getattr(report, column)
    if column == "errors":
        return " ".join(f"{k}={v}" for k, v in value.items()) or "-"
    if isinstance(value, bool) or value is None:
        return {True: "yes", False: "no", None: "-"}[value]
    if column == "client_busy":  # a share of the load tester's capacity; * where it may be the limit
        return "-" if math.isnan(value) else f"{value:.0%}" + ("*" if report.client_bound else "")
    if isinstance(value, float):
        return f"{value:g}" if column == "level" else f"{value:.1f}"
    return str(value)


def client_bound_warning(report: LevelReport, *, busy_warning: float) -> str | None:
    """What to tell the user when the load tester itself was busy enough to be the level's limit, else None."""
    if not report.client_bound:
        return None
    processes = f"{report.client_processes} process{'es' * (report.client_processes > 1)}"
    return (f"{report.mode} {report.level:g}: the load tester was {report.client_busy:.0%} busy (running or waiting "
            f"to run, over {busy_warning:.0%} of the one core per process its {processes} can use; it used "
            f"{report.client_cpu_cores:.2f} cores): these figures may be its own limit, not the server's; give it "
            "more processes (--processes) or cores, or run it on another machine")


def format_table(reports: Iterable[LevelReport]) -> str:
    """A fixed-width table, one row per level (server columns when the server's metrics were read, the load
    tester's CPU when measured: a * marks a level where it may have been the limit, explained below the table)."""
    reports = list(reports)
    columns = _columns(reports)
    rows = [[_HEADINGS.get(c, c) for c in columns]] + [[_cell(r, c) for c in columns] for r in reports]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    table = "\n".join("  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
                      for row in rows)
    if any(r.client_bound for r in reports):
        table += ("\n* the load tester was busy enough that this level's figures may be its own limit, "
                  "not the server's")
    return table


def to_json(reports: Iterable[LevelReport]) -> str:
    """Reports as a JSON list (NaN becomes null)."""
    def clean(report: LevelReport) -> dict:
        return {k: (None if isinstance(v, float) and v != v else v) for k, v in asdict(report).items()}
    return json.dumps([clean(r) for r in reports], indent=2)


def to_csv(reports: Iterable[LevelReport]) -> str:
    """Reports as CSV, every field a column (errors as one `STATUS=count ...` column; NaN empty)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    columns = [f for f in LevelReport.__dataclass_fields__]
    writer.writerow(columns)
    for report in reports:
        row = []
        for column in columns:
            value = getattr(report, column)
            row.append(_cell(report, column) if column == "errors" else
                       "" if (isinstance(value, float) and value != value) or value is None else value)
        writer.writerow(row)
    return buffer.getvalue()
