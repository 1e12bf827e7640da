"""Load-test statistics: per-level counts, throughput, latency percentiles, errors by status.

Pure functions over (latency, status) samples, so the numbers are testable without a server.
"""

from __future__ import annotations

import csv
import io
import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

import numpy as np

__all__ = ["Sample", "LevelReport", "summarise", "format_table", "to_json", "to_csv", "PERCENTILES"]

PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True)
class Sample:
    """One request: its latency in seconds (from its scheduled send time) and its status name."""

    latency_s: float
    status: str


@dataclass(frozen=True)
class LevelReport:
    """One load level (a concurrency or an arrival rate) and what it measured."""

    mode: str            # "closed" (fixed concurrency) or "open" (fixed arrival rate)
    level: float         # concurrency, or requests per second
    sent: int
    completed: int       # answered OK
    duration_s: float
    throughput_rps: float
    p50_ms: float
    p90_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float
    errors: dict[str, int] = field(default_factory=dict)


def summarise(mode: str, level: float, samples: Sequence[Sample], *, sent: int, duration_s: float) -> LevelReport:
    """The report of one level; latency percentiles are over OK requests (NaN when none)."""
    ok = np.array([s.latency_s for s in samples if s.status == "OK"], dtype=np.float64) * 1000
    errors = Counter(s.status for s in samples if s.status != "OK")
    if ok.size:
        p50, p90, p95, p99 = (float(v) for v in np.percentile(ok, PERCENTILES))
        worst = float(ok.max())
    else:
        p50 = p90 = p95 = p99 = worst = float("nan")
    return LevelReport(
        mode=mode, level=level, sent=sent, completed=int(ok.size), duration_s=duration_s,
        throughput_rps=ok.size / duration_s if duration_s > 0 else 0.0,
        p50_ms=p50, p90_ms=p90, p95_ms=p95, p99_ms=p99, max_ms=worst, errors=dict(sorted(errors.items())),
    )


_COLUMNS = ("mode", "level", "sent", "completed", "throughput_rps", "p50_ms", "p90_ms", "p95_ms", "p99_ms",
            "max_ms", "errors")


def _cell(report: LevelReport, column: str) -> str:
    value = getattr(report, column)
    if column == "errors":
        return " ".join(f"{k}={v}" for k, v in value.items()) or "-"
    if isinstance(value, float):
        return f"{value:g}" if column == "level" else f"{value:.1f}"
    return str(value)


def format_table(reports: Iterable[LevelReport]) -> str:
    """A fixed-width table, one row per level."""
    rows = [list(_COLUMNS)] + [[_cell(r, c) for c in _COLUMNS] for r in reports]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    return "\n".join("  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
                     for row in rows)


def to_json(reports: Iterable[LevelReport]) -> str:
    """Reports as a JSON list (NaN latencies become null)."""
    def clean(report: LevelReport) -> dict:
        return {k: (None if isinstance(v, float) and v != v else v) for k, v in asdict(report).items()}
    return json.dumps([clean(r) for r in reports], indent=2)


def to_csv(reports: Iterable[LevelReport]) -> str:
    """Reports as CSV; errors as one `STATUS=count ...` column."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(_COLUMNS)
    for report in reports:
        writer.writerow([_cell(report, c) if c == "errors" else getattr(report, c) for c in _COLUMNS])
    return buffer.getvalue()
