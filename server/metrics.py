"""Prometheus metrics of one server, in their own registry (several servers may share a process)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
MEMORY_BUCKETS = tuple(2.0**power for power in range(20, 37))  # 1 MiB .. 64 GiB
STAGES = ("queue", "preprocess", "inference", "postprocess")


class Metrics:
    """Requests by method and status, stage latencies, batch sizes, queue depth, in-flight, memory."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "scoremap_requests", "RPCs answered, by method and status code", ["method", "code"], registry=self.registry
        )
        self.latency = Histogram(
            "scoremap_stage_seconds", "Time per request in each stage", ["stage"],
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.batch_size = Histogram(
            "scoremap_batch_size", "Passes per inference batch", ["model"], buckets=BATCH_BUCKETS, registry=self.registry
        )
        self.batch_memory = Histogram(
            "scoremap_batch_predicted_bytes", "Predicted peak memory of each batch", ["model"],
            buckets=MEMORY_BUCKETS, registry=self.registry,
        )
        self.in_flight = Gauge("scoremap_in_flight", "Requests being scored", registry=self.registry)
        self.queue_depth = Gauge("scoremap_queue_depth", "Passes waiting for a batch", registry=self.registry)
        self._http = None

    def track_queue_depth(self, depth: Callable[[], float]) -> None:
        self.queue_depth.set_function(depth)

    def observe_stages(self, seconds: dict[str, float]) -> None:
        for stage in STAGES:
            if stage in seconds:
                self.latency.labels(stage).observe(seconds[stage])

    def serve(self, *, port: int, address: str) -> int:
        """Expose /metrics over HTTP; returns the bound port (port 0 picks a free one)."""
        self._http, _thread = start_http_server(port, addr=address, registry=self.registry)
        return self._http.server_port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
