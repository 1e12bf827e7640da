"""The server's own split of a load level, read from its Prometheus /metrics (as perf_analyzer
reads Triton's): mean queue, preprocess, inference and postprocess time per request, and the
mean inference batch size, over a window (the difference of two scrapes); the images it dropped
before compute, the calls it answered and the CPU its batches took.

Reads `scoremap_stage_seconds{stage=...}`, `scoremap_batch_size`, `scoremap_dropped_total`,
`scoremap_requests_total` and `scoremap_batch_cpu_seconds_total` (server/metrics.py), restricted to one model when
the series carry a `model` label and a model is named.
"""

from __future__ import annotations

import math
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from clients.loadtest.latency import SERVER_STAGES

__all__ = ["MetricsSnapshot", "scrape", "server_split", "STAGE_METRIC", "BATCH_METRIC", "DROPPED_METRIC"]

STAGE_METRIC = "scoremap_stage_seconds"
BATCH_METRIC = "scoremap_batch_size"
DROPPED_METRIC = "scoremap_dropped_total"
ANSWERED_METRIC = "scoremap_requests_total"
BATCH_CPU_METRIC = "scoremap_batch_cpu_seconds_total"


@dataclass(frozen=True)
class MetricsSnapshot:
    """Sums and counts of the two histograms at one instant, keyed by (series, stage or ""); the images
    dropped before compute so far (every reason), the calls answered (every method and code) and the CPU seconds
    of the threads that ran batches."""

    sums: dict[tuple[str, str], float]
    counts: dict[tuple[str, str], float]
    dropped: float = 0.0
    answered: float = 0.0
    batch_cpu_s: float = 0.0


def parse(text: str, *, model: str = "") -> MetricsSnapshot:
    """The snapshot of a /metrics page (`model` filters series that carry a model label)."""
    sums: dict[tuple[str, str], float] = {}
    counts: dict[tuple[str, str], float] = {}
    totals = {DROPPED_METRIC: 0.0, ANSWERED_METRIC: 0.0, BATCH_CPU_METRIC: 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if model and sample.labels.get("model", model) != model:
                continue
            if sample.name in totals:
                totals[sample.name] += sample.value
                continue
            metric, _, part = sample.name.rpartition("_")
            if metric not in (STAGE_METRIC, BATCH_METRIC) or part not in ("sum", "count"):
                continue
            key = (metric, sample.labels.get("stage", ""))
            table = sums if part == "sum" else counts
            table[key] = table.get(key, 0.0) + sample.value
    return MetricsSnapshot(sums, counts, totals[DROPPED_METRIC], totals[ANSWERED_METRIC], totals[BATCH_CPU_METRIC])


def scrape(url: str, *, timeout_s: float, model: str = "") -> MetricsSnapshot:
    """Read the server's /metrics page at `url`."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 (the user's own server)
        return parse(response.read().decode("utf-8", "replace"), model=model)


def _mean(before: MetricsSnapshot, after: MetricsSnapshot, key: tuple[str, str]) -> float:
    count = after.counts.get(key, 0.0) - before.counts.get(key, 0.0)
    if count <= 0:
        return math.nan
    return (after.sums.get(key, 0.0) - before.sums.get(key, 0.0)) / count


def server_split(before: MetricsSnapshot, after: MetricsSnapshot) -> dict[str, float]:
    """Mean ms per request by stage (`<stage>_ms`) and the mean batch size (`batch_size`) between two scrapes."""
    split = {f"{stage}_ms": _mean(before, after, (STAGE_METRIC, stage)) * 1000 for stage in SERVER_STAGES}
    split["batch_size"] = _mean(before, after, (BATCH_METRIC, ""))
    return split
