"""`scoremap-serve --workers N` (issue 29): N processes on one port, each answering, draining and sharing the budgets."""

from __future__ import annotations

import signal
import subprocess
import time
import urllib.request

import grpc
import numpy as np
import pytest

from protos import scoring_pb2_grpc
from server.workers import worker_argv
from server.settings import Settings
from tests.server.test_main import serve_command

PIXELS = np.random.default_rng(7).integers(0, 256, (64, 64, 3), dtype=np.uint8)
WORKERS = 2
CALLS_TO_REACH_BOTH = 60  # new connections, spread by the kernel: all on one process has odds 2**-59


def scored_ok(metrics_url: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return sum(float(line.split()[1]) for line in text.splitlines()
               if line.startswith("scoremap_requests_total{") and 'code="OK"' in line and 'method="Score"' in line)


def children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(child) for child in found]


def score_once_warm(stub: scoring_pb2_grpc.DenseScoringStub, request) -> object:
    """The answer, asking again while the process this connection reached is still warming up (UNAVAILABLE)."""
    until = time.monotonic() + 120
    while True:
        try:
            return stub.Score(request, timeout=60, wait_for_ready=True)
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > until:
                raise
            time.sleep(0.1)


def test_workers_share_one_port_each_answers_and_sigterm_stops_them_all(kit, tiny_model_path, tmp_path):
    log = tmp_path / "serve.log"
    process = subprocess.Popen(
        serve_command() + [tiny_model_path, "--port", "0", "--workers", str(WORKERS), "--intra-op-threads", "1",
                           "--metrics-port", "0", "--host-memory-budget", "64MiB"],
        stdout=subprocess.PIPE, stderr=log.open("w"), text=True,
    )
    try:
        line = process.stdout.readline()
        assert line.startswith("scoremap-serve listening on 127.0.0.1:"), (line, log.read_text())
        port = int(line.rsplit(":", 1)[1])
        metrics = [process.stdout.readline().split()[-1] for _ in range(WORKERS)]
        assert len(set(metrics)) == WORKERS  # one metrics endpoint per process
        workers = children(process.pid)
        assert len(workers) == WORKERS
        request = kit.raw_request(PIXELS, scales=[64])
        for _ in range(CALLS_TO_REACH_BOTH):
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # a new connection: the kernel picks a process
                assert score_once_warm(scoring_pb2_grpc.DenseScoringStub(channel), request)
        answered = [scored_ok(url) for url in metrics]
        assert sum(answered) == CALLS_TO_REACH_BOTH and min(answered) > 0, answered
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
        assert all(subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode != 0 for pid in workers)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for pid in children(process.pid):
            subprocess.run(["kill", "-9", str(pid)])


@pytest.mark.parametrize("metrics_port, expected", [(None, None), (0, "0"), (9100, "9101")])
def test_each_worker_gets_the_shares_and_ports_of_one_of_n(metrics_port, expected):
    settings = Settings(workers=3, metrics_port=metrics_port)
    argv = worker_argv(["m.onnx", "--workers", "3"], settings=settings, port=5000, http_port=None, index=1)
    assert argv[argv.index("--budget-share") + 1] == "3" and "--reuse-port" in argv
    last = len(argv) - 1 - argv[::-1].index("--workers")  # argparse takes a flag's last value
    assert argv[argv.index("--port") + 1] == "5000" and argv[last + 1] == "1"
    assert (argv[argv.index("--metrics-port") + 1] if "--metrics-port" in argv else None) == expected


def test_a_process_s_share_divides_the_host_and_device_budgets(tiny_model_path):
    from server.scoring.pipeline import Pipeline

    whole = Settings(memory_budget_bytes=600 * 2**20, host_memory_budget_bytes=300 * 2**20, warm_up=False)
    for share in (1, 3):
        import dataclasses

        pipeline = Pipeline([tiny_model_path], settings=dataclasses.replace(whole, budget_share=share))
        try:
            assert pipeline.budget.total_bytes == 600 * 2**20 // share
            assert pipeline.host_budget.total_bytes == 300 * 2**20 // share
        finally:
            pipeline.close()
