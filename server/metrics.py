"""Prometheus metrics of one server, in their own registry (several servers may share a process).

Every series that belongs to a model carries a `model` label (the served name), so two models on one
server are told apart. Only traffic is recorded: the pipeline does not report its warm-up passes.
"""

from __future__ import annotations

import enum
import pathlib
import urllib.request
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Metric, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from server.errors import Dropped

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
MEMORY_BUCKETS = tuple(2.0**power for power in range(20, 37))  # 1 MiB .. 64 GiB
NO_MODEL = ""  # the `model` label of calls that concern no single model (ListModels, streams, refusals)


class Stage(enum.Enum):
    """The stages of a request, as in the response's timings."""

    QUEUE = "queue"
    PREPROCESS = "preprocess"
    INFERENCE = "inference"
    POSTPROCESS = "postprocess"


class Metrics:
    """Requests by method, status and model; per-model stage latencies, batches and queue depth; in-flight."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "scoremap_requests", "RPCs answered, by method, status code and model", ["method", "code", "model"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "scoremap_stage_seconds", "Time per request in each stage", ["stage", "model"],
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.batch_size = Histogram(
            "scoremap_batch_size", "Images (scales or mirrors) per inference batch, each running its passes", ["model"],
            buckets=BATCH_BUCKETS, registry=self.registry
        )
        self.batch_cpu = Counter(
            "scoremap_batch_cpu_seconds", "CPU time of the threads that ran the model's batches, from each batch's "
            "start until its items were answered (onnxruntime's own pool threads, with more than one intra-op "
            "thread, not included): the engine's other CPU is its own work per request", ["model"],
            registry=self.registry,
        )
        self.batch_memory = Histogram(
            "scoremap_batch_predicted_bytes", "Predicted peak memory of each batch", ["model"],
            buckets=MEMORY_BUCKETS, registry=self.registry,
        )
        self.plan_memory = Gauge(
            "scoremap_plan_bytes", "Memory of each plan: measured after warm-up, and predicted (server/scoring/admission.py)",
            ["model", "plan", "kind"], registry=self.registry,
        )
        self.plans_held = Gauge(
            "scoremap_plans_held_bytes", "Memory every model's plans hold together as admission accounts it: each "
            "model's weights once, each plan's own state, each model's largest running batch once per runner "
            "(server/memory/device.py)",
            registry=self.registry,
        )
        self.plans_made = Counter(
            "scoremap_plans_made", "Plans made for traffic: shapes outside the warm-up's (each costs a session)",
            ["model"], registry=self.registry,
        )
        self.dropped = Counter(
            "scoremap_dropped", "Images admitted, decoded, then dropped before compute: waited past --max-queue-ms "
            "(reason queue_time) or past their call's deadline (reason deadline); work spent on a refusal",
            ["model", "reason"], registry=self.registry,
        )
        self.in_flight = Gauge("scoremap_in_flight", "Calls in the servicer", registry=self.registry)
        self.queue_depth = Gauge("scoremap_queue_depth", "Images (scales or mirrors) waiting for a batch or still decoding (--queue-depth bounds it)", ["model"], registry=self.registry)
        self._http = None

    def count_request(self, method: str, code: str, model: str = NO_MODEL) -> None:
        """One answered RPC; `model` only when it is a loaded model's name (never a caller's free text)."""
        self.requests.labels(method, code, model).inc()

    def count_dropped(self, model: str, reason: Dropped) -> None:
        """One image dropped from the queue before it ran."""
        self.dropped.labels(model, reason.value).inc()

    def record_stages(self, model: str, seconds: Mapping[Stage, float]) -> None:
        """One request's time in each stage it went through."""
        for stage, value in seconds.items():
            self.latency.labels(stage.value, model).observe(value)

    def record_batch(self, model: str, size: int, predicted_bytes: int | None = None) -> None:
        """One batch run: how many images, and the memory admission predicted for it."""
        self.batch_size.labels(model).observe(size)
        if predicted_bytes is not None:
            self.batch_memory.labels(model).observe(predicted_bytes)

    def track_queue(self, model: str, depth: Callable[[], float]) -> None:
        """Read `depth()` (images waiting or decoding for `model`) at each scrape."""
        self.queue_depth.labels(model).set_function(depth)

    def serve(self, *, port: int, address: str) -> int:
        """Expose /metrics over HTTP; returns the bound port (port 0 picks a free one)."""
        self._http, _thread = start_http_server(port, addr=address, registry=self.registry)
        return self._http.server_port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


SCRAPE_SECONDS = 2.0  # how long one scrape waits for one process's metrics


class ProcessesCollector:
    """The metrics of a server's processes in one scrape (`--fronts`): each process serves its own on loopback and
    names its endpoint in a file `metrics-ROLE` of `folder`; every series gets a `process` label (engine, front-0,
    ...). A process that does not answer is left out of that scrape."""

    def __init__(self, folder: str | pathlib.Path) -> None:
        self.folder = pathlib.Path(folder)

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for path in sorted(self.folder.glob("metrics-*")):
            process = path.name.removeprefix("metrics-")
            try:
                text = urllib.request.urlopen(path.read_text().strip(), timeout=SCRAPE_SECONDS).read().decode()
            except (OSError, ValueError):
                continue
            for family in text_string_to_metric_families(text):
                merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                                 family.unit))
                for sample in family.samples:
                    merged.add_sample(sample.name, {**sample.labels, "process": process}, sample.value,
                                      sample.timestamp, sample.exemplar)
        yield from families.values()


def serve_processes(folder: str | pathlib.Path, *, port: int, address: str) -> int:
    """Serve `ProcessesCollector(folder)` as /metrics; the bound port."""
    registry = CollectorRegistry()
    registry.register(ProcessesCollector(folder))
    http, _thread = start_http_server(port, addr=address, registry=registry)
    return http.server_port
