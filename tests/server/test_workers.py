"""`scoremap-serve --workers N`: N processes on one port, each answering (gRPC, HTTP, KServe), draining
and holding its share of the budgets."""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import subprocess
import time
import urllib.request
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import grpc
import numpy as np
import pytest
from PIL import Image

from protos import scoring_pb2_grpc
from server.workers import worker_argv
from server.settings import Settings
from tests.server.test_main import serve_command

PIXELS = np.random.default_rng(7).integers(0, 256, (64, 64, 3), dtype=np.uint8)
WORKERS = 2
CALLS_TO_REACH_BOTH = 60  # new connections, spread by the kernel: all on one process has odds 2**-59
T = TypeVar("T")
MiB = 2**20


def answered(metrics_url: str, method: str = "Score", code: str = "OK") -> float:
    """The calls of `method` this process answered with `code`, by its own metrics."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return sum(float(line.split()[1]) for line in text.splitlines()
               if line.startswith("scoremap_requests_total{") and f'code="{code}"' in line
               and f'method="{method}"' in line)


def children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(child) for child in found]


def once_warm(call: Callable[[], T], *, warming: Callable[[Exception], bool]) -> T:
    """`call`'s answer, calling again while the process its new connection reached is still warming up."""
    until = time.monotonic() + 120
    while True:
        try:
            return call()
        except Exception as error:
            if not warming(error) or time.monotonic() > until:
                raise
            time.sleep(0.1)


def score_once_warm(stub: scoring_pb2_grpc.DenseScoringStub, request) -> object:
    return once_warm(lambda: stub.Score(request, timeout=60, wait_for_ready=True),
                     warming=lambda error: isinstance(error, grpc.RpcError)
                     and error.code() == grpc.StatusCode.UNAVAILABLE)


@contextlib.contextmanager
def supervised(log: Path, arguments: list[str]) -> Iterator[tuple[subprocess.Popen, int]]:
    """`scoremap-serve` with `arguments`, a supervisor of several processes: it and its gRPC port once it listens;
    every process of it killed at the end if still running."""
    process = subprocess.Popen(serve_command() + arguments, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    pids: list[int] = []
    try:
        line = process.stdout.readline()
        assert line.startswith("scoremap-serve listening on 127.0.0.1:"), (line, log.read_text())
        pids = children(process.pid)
        yield process, int(line.rsplit(":", 1)[1])
    finally:
        pids = pids or children(process.pid)  # before the supervisor goes: then they are no longer its children
        if process.poll() is None:
            process.kill()
            process.wait()
        for pid in filter(alive, pids):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def workers(tmp_path, model_path: str, *flags: str) -> Iterator[tuple[subprocess.Popen, int, list[str]]]:
    """`scoremap-serve --workers 2` with its metrics: the supervisor, the gRPC port, each worker's other lines
    (HTTP, metrics); every process killed at the end if still running."""
    arguments = [model_path, "--port", "0", "--workers", str(WORKERS), "--intra-op-threads", "1", "--metrics-port",
                 "0", *flags]
    with supervised(tmp_path / "serve.log", arguments) as (process, port):
        lines_each = 1 + ("--http-port" in flags)
        yield process, port, [process.stdout.readline() for _ in range(WORKERS * lines_each)]


def alive(pid: int) -> bool:
    """Running: not ended, nor a zombie no one has reaped (an orphan's reaper may be slow, or absent)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def metrics_urls(lines: list[str]) -> list[str]:
    urls = [line.split()[-1] for line in lines if " metrics on " in line]
    assert len(set(urls)) == WORKERS, lines  # one metrics endpoint per process
    return urls


def test_workers_share_one_port_each_answers_and_sigterm_stops_them_all(kit, tiny_model_path, tmp_path):
    with workers(tmp_path, tiny_model_path, "--host-memory-budget", "64MiB") as (process, port, lines):
        metrics = metrics_urls(lines)
        pids = children(process.pid)
        assert len(pids) == WORKERS
        request = kit.raw_request(PIXELS, scales=[64])
        for _ in range(CALLS_TO_REACH_BOTH):
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # a new connection: the kernel picks a process
                assert score_once_warm(scoring_pb2_grpc.DenseScoringStub(channel), request)
        each = [answered(url) for url in metrics]
        assert sum(each) == CALLS_TO_REACH_BOTH and min(each) > 0, each
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
        assert not any(map(alive, pids))


def test_workers_drain_and_end_when_their_supervisor_is_killed(tiny_model_path, tmp_path):
    """SIGKILL leaves the supervisor no time to pass anything on: the kernel sends each worker SIGTERM."""
    with workers(tmp_path, tiny_model_path, "--grace-seconds", "1") as (process, _port, _lines):
        pids = children(process.pid)
        assert len(pids) == WORKERS
        process.kill()
        process.wait()
        until = time.monotonic() + 60
        while any(map(alive, pids)) and time.monotonic() < until:
            time.sleep(0.1)
        log = (tmp_path / "serve.log").read_text()
        assert not any(map(alive, pids)), ([pid for pid in pids if alive(pid)], log[-5000:])
        if "Timeout (" in log:  # gone, but by its own deadline (server.supervision.end_with): why its drain hung
            warnings.warn(f"a worker's drain hung; its threads:\n{log[log.index('Timeout ('):][:8000]}")


def test_a_sigterm_while_the_workers_start_stops_them_at_once(tiny_model_path, tmp_path):
    """SIGTERM before every worker listens is passed on at once, as after: the supervisor does not wait for a worker
    still starting (held here by SIGSTOP) to say it listens, and exits 0 once each has stopped."""
    process = subprocess.Popen(serve_command() + [tiny_model_path, "--port", "0", "--workers", str(WORKERS),
                                                  "--intra-op-threads", "1"],
                               stdout=subprocess.PIPE, stderr=(tmp_path / "serve.log").open("w"), text=True)
    pids: list[int] = []
    try:
        until = time.monotonic() + 30
        while len(pids) < WORKERS and time.monotonic() < until:
            pids = children(process.pid)
            time.sleep(0.05)
        assert len(pids) == WORKERS
        held, other = pids
        os.kill(held, signal.SIGSTOP)
        process.send_signal(signal.SIGTERM)
        until = time.monotonic() + 20
        while alive(other) and time.monotonic() < until:
            time.sleep(0.05)
        assert not alive(other), (tmp_path / "serve.log").read_text()
        os.kill(held, signal.SIGCONT)
        assert process.wait(30) == 0
        assert process.stdout.read() == ""  # it never said it listens
    finally:
        process.kill()
        for pid in filter(alive, pids):
            os.kill(pid, signal.SIGKILL)


def test_a_process_started_for_a_supervisor_that_is_gone_exits_at_once(tiny_model_path):
    """A worker or front follows its supervisor's end (`--supervisor`): one whose supervisor ended before it could
    ask the kernel to be told (its parent is another process by then) exits at once instead of serving alone."""
    gone = subprocess.Popen(["true"])
    gone.wait()  # a supervisor that ended: never the child's parent, as pid 1 is where pytest is a container's first
    finished = subprocess.run(serve_command() + [tiny_model_path, "--port", "0", "--supervisor", str(gone.pid)],
                              capture_output=True, text=True, timeout=60)
    assert finished.returncode == 1, finished.stderr
    assert "listening on" not in finished.stdout


def test_a_worker_killed_by_a_signal_ends_the_server_with_the_shell_s_status_for_it(tiny_model_path, tmp_path):
    """A worker that dies (SIGKILL, as the OOM killer's) stops the others, and the server exits 128 + the signal's
    number, as a shell reports such a death (137), never Python's exit of a negative number (247)."""
    with workers(tmp_path, tiny_model_path, "--grace-seconds", "1") as (process, _port, _lines):
        pids = children(process.pid)
        os.kill(pids[0], signal.SIGKILL)
        assert process.wait(60) == 128 + signal.SIGKILL
        assert not any(map(alive, pids))


def test_a_worker_crash_the_stop_overtakes_still_ends_the_server_with_its_status(tiny_model_path, tmp_path):
    """SIGTERM just after a worker was killed, before the supervisor saw that worker end: the server still exits
    with the crash's status (128 + 9), as when it sees the end first, not 0 as for a clean drain."""
    with workers(tmp_path, tiny_model_path, "--grace-seconds", "1") as (process, _port, _lines):
        pids = children(process.pid)
        os.kill(pids[0], signal.SIGKILL)
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 128 + signal.SIGKILL
        assert not any(map(alive, pids))


def test_http_kserve_and_the_memory_budget_keep_their_meaning_in_every_worker(kit, tiny_model_path, tmp_path):
    """Score over HTTP and KServe's ModelInfer reach both processes on the shared ports; a request over one
    process's half of --host-memory-budget (36 MiB of its 32; the whole budget, 64, would hold it) is refused by
    whichever process gets it, saying whose budget, with the numbers, and both go on answering."""
    import httpx

    grpcclient = pytest.importorskip("tritonclient.grpc", reason="KServe v2 needs the `triton` extra")
    from tritonclient.utils import InferenceServerException

    with workers(tmp_path, tiny_model_path, "--http-port", "0", "--host-memory-budget", "64MiB") as (process, port,
                                                                                                  lines):
        metrics = metrics_urls(lines)
        (http,) = {line.split()[-1] for line in lines if " HTTP on " in line}  # one port, shared
        image = io.BytesIO()
        Image.fromarray(PIXELS).save(image, format="PNG")
        for _ in range(CALLS_TO_REACH_BOTH // 2):
            response = once_warm(  # httpx.post: a new connection each call
                lambda: httpx.post(f"{http}v1/models/tiny/score?scales=64", content=image.getvalue(),
                                   headers={"content-type": "image/png"}, timeout=60).raise_for_status(),
                warming=lambda error: isinstance(error, httpx.HTTPStatusError) and error.response.status_code == 503)
            assert len(response.json()["top_k"]) == 5
            pixels = grpcclient.InferInput("PIXELS", list(PIXELS.shape), "UINT8")
            pixels.set_data_from_numpy(PIXELS)
            with grpcclient.InferenceServerClient(f"127.0.0.1:{port}") as client:
                result = once_warm(lambda: client.infer("tiny", [pixels], parameters={"scales": "64"}),
                                   warming=lambda error: isinstance(error, InferenceServerException)
                                   and error.status() == "StatusCode.UNAVAILABLE")
            assert result.as_numpy("TOP_K_INDICES").shape == (5,)
        for method in ("http/Score", "ModelInfer"):
            each = [answered(url, method) for url in metrics]
            assert sum(each) == CALLS_TO_REACH_BOTH // 2 and min(each) > 0, (method, each)
        large = kit.raw_request(PIXELS, scales=[2048])
        for _ in range(CALLS_TO_REACH_BOTH // 2):
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                with pytest.raises(grpc.RpcError) as refused:
                    scoring_pb2_grpc.DenseScoringStub(channel).Score(large, timeout=60)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            details = refused.value.details()
            assert 32 * MiB < int(re.search(r"needs an estimated (\d+) bytes", details)[1]) <= 64 * MiB, details
            assert "of this process's 33554432 bytes (32.0 MiB, 1/2 of the server's --host-memory-budget: one of " \
                   "--workers 2); it does not fit even alone" in details
        each = [answered(url, "Score", "RESOURCE_EXHAUSTED") for url in metrics]
        assert sum(each) == CALLS_TO_REACH_BOTH // 2 and min(each) > 0, each
        for _ in range(CALLS_TO_REACH_BOTH // 2):
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                assert scoring_pb2_grpc.DenseScoringStub(channel).Score(kit.raw_request(PIXELS, scales=[64]),
                                                                        timeout=60)
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0


@pytest.mark.parametrize("metrics_port, expected", [(None, None), (0, "0"), (9100, "9101")])
def test_each_worker_gets_the_shares_and_ports_of_one_of_n(metrics_port, expected):
    settings = Settings(workers=3, metrics_port=metrics_port)
    argv = worker_argv(["m.onnx", "--workers", "3"], settings=settings, port=5000, http_port=None, index=1)
    assert argv[argv.index("--budget-share") + 1] == "3" and "--reuse-port" in argv
    last = len(argv) - 1 - argv[::-1].index("--workers")  # argparse takes a flag's last value
    assert argv[argv.index("--port") + 1] == "5000" and argv[last + 1] == "1"
    assert (argv[argv.index("--metrics-port") + 1] if "--metrics-port" in argv else None) == expected


def test_a_process_s_share_divides_the_host_and_device_budgets_and_its_refusals_say_so(kit, tiny_model_path):
    """A plan too large for the process's share of --memory-budget (55 MiB at scale 2048 against 600 / 20 / 3) is
    refused naming the share; one process alone says nothing of workers."""
    import dataclasses

    from server.errors import ScoringError
    from server.scoring.pipeline import Pipeline

    whole = Settings(memory_budget_bytes=600 * MiB, host_memory_budget_bytes=300 * MiB, warm_up=False)
    for share in (1, 3):
        pipeline = Pipeline([tiny_model_path], settings=dataclasses.replace(whole, budget_share=share))
        small = Pipeline([tiny_model_path], settings=dataclasses.replace(whole, budget_share=share,
                                                                         memory_budget_bytes=600 * MiB // 20))
        try:
            assert pipeline.engine.budget.total_bytes == 600 * MiB // share
            assert pipeline.host_budget.total_bytes == 300 * MiB // share
            with pytest.raises(ScoringError, match="the memory budget is") as refused:
                small.score(kit.raw_request(PIXELS, scales=[2048]))
            said = f"{600 * MiB // 20 // share} bytes"
            assert (f"{said} (10.0 MiB) in this process, one of --workers 3, each with 1/3 of --memory-budget"
                    if share == 3 else f"{said} (30.0 MiB); the largest") in refused.value.message
        finally:
            pipeline.close()
            small.close()
