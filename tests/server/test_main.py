"""`scoremap-serve` as users run it: a subprocess, --port 0, SIGTERM drains."""

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest

from protos import scoring_pb2, scoring_pb2_grpc
from server.main import parse_args, settings_from


def serve_command() -> list[str]:
    script = shutil.which("scoremap-serve", path=os.path.dirname(sys.executable))
    return [script] if script else [sys.executable, "-m", "server.main"]


def in_flight_calls(metrics_url: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith("scoremap_in_flight "))


def test_flags_become_settings():
    settings = settings_from(parse_args(["m.onnx", "--memory-budget", "2GiB", "--max-batch", "1", "--no-warm-up",
                                         "--warm-up-scales", "224", "384", "--max-image-pixels", "1000"]))
    assert settings.memory_budget_bytes == 2 * 2**30 and settings.max_batch == 1 and not settings.warm_up
    assert settings.warm_up_scales == (224, 384) and settings.max_image_pixels == 1000
    assert parse_args(["m.onnx"]).host == "127.0.0.1"


def test_sigterm_drains_in_flight_calls_refuses_new_ones_and_exits_zero(kit, tiny_model_path, heavy_model_path, tmp_path):
    log = tmp_path / "serve.log"
    process = subprocess.Popen(
        serve_command() + [tiny_model_path, heavy_model_path, "--port", "0", "--grace-seconds", "30",
                           "--intra-op-threads", "1", "--warm-up-scales", "32", "--metrics-port", "0"],
        stdout=subprocess.PIPE, stderr=log.open("w"), text=True,
    )
    try:
        line = process.stdout.readline()
        assert line.startswith("scoremap-serve listening on 127.0.0.1:"), (line, log.read_text())
        port = int(line.rsplit(":", 1)[1])
        metrics_url = process.stdout.readline().split()[-1]
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = scoring_pb2_grpc.DenseScoringStub(channel)
        assert len(stub.ListModels(scoring_pb2.ListModelsRequest()).models) == 2

        pixels = np.zeros((256, 256, 3), dtype=np.uint8)
        slow = kit.raw_request(pixels, model="heavy", scales=[256], output_stride=16, flip=True)
        outcome = {}

        def in_flight():
            try:
                outcome["response"] = stub.Score(slow, timeout=60)
            except grpc.RpcError as error:
                outcome["error"] = error
            outcome["finished"] = time.monotonic()

        thread = threading.Thread(target=in_flight)
        thread.start()
        while in_flight_calls(metrics_url) < 1:  # until the slow call is in the servicer
            time.sleep(0.02)
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        refused = None
        for _ in range(100):
            try:
                stub.ListModels(scoring_pb2.ListModelsRequest(), timeout=2)
            except grpc.RpcError as error:
                refused = error
                break
            time.sleep(0.05)
        assert refused is not None and refused.code() == grpc.StatusCode.UNAVAILABLE
        thread.join(60)
        assert "response" in outcome, (outcome.get("error"), log.read_text())  # the in-flight call finished
        assert outcome["finished"] > signalled and "draining" in log.read_text()
        assert outcome["response"].maps[0].height == 16
        assert process.wait(60) == 0
        channel.close()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_missing_model_file_fails_to_start_with_a_clear_message(tmp_path):
    result = subprocess.run(serve_command() + [str(tmp_path / "absent.onnx"), "--port", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "absent.onnx" in result.stderr


def test_a_port_in_use_is_refused(tiny_model_path):
    from server.errors import ScoringError
    from server.main import create_server
    from server.settings import Settings

    settings = Settings(warm_up=False, intra_op_threads=1)
    first, port = create_server([tiny_model_path], settings=settings)
    try:
        with pytest.raises(ScoringError, match=f"could not bind 127.0.0.1:{port}"):
            create_server([tiny_model_path], address=f"127.0.0.1:{port}", settings=settings)
    finally:
        first.stop(0).wait(10)


def test_health_says_not_serving_until_warm_up_is_done(heavy_model_path):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from server.main import create_server
    from server.settings import Settings

    settings = Settings(intra_op_threads=1, warm_up_scales=(256,))
    server, port = create_server([heavy_model_path], settings=settings, wait_until_ready=False)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            check = health_pb2.HealthCheckRequest(service="scoremap.v1.DenseScoring")
            assert health.Check(check).status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch = health.Watch(check, timeout=60)
            statuses = [next(watch).status, next(watch).status]
            watch.cancel()
            assert statuses == [health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING]
    finally:
        server.stop(0).wait(10)
