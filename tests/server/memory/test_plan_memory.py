"""A plan's memory in the server's own process against admission's prediction, and a default start that holds
its plans' activations once and does not call the memory model off."""

import dataclasses
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import onnx
import pytest

from bench.bench_cpu_plans import MEMORY_BOUND, server_plan_memory
from bench.bench_memory import _wait_serving
from server.memory.arena import IDLE_RELEASE_SECONDS
from tests.server.conftest import raw_request
from tests.tiny_models import heavy_net, int8_net

MiB = 2**20


def test_admission_predicts_what_each_plan_holds_in_the_server_process(tmp_path):
    """Full-resolution convs in front (live peaks of 30-200 MiB), batch 1 and 4, made in the order of their running
    batch's size: VmRSS growth at each plan's first request within the bound of what admission's account of the plans
    grew by; the whole account within the bound of what the server holds for them idle and at its steady-state peak."""
    path = tmp_path / "heavy.onnx"
    onnx.save(heavy_net(), path)
    plans, warnings = server_plan_memory(str(path), sizes=(320, 448), batches=(1, 4), settle_seconds=0.5)
    assert [plan.plan for plan in plans] == ["1x320x320x1 passes", "1x448x448x1 passes", "4x320x320x1 passes",
                                             "4x448x448x1 passes"]
    for plan in plans:
        assert plan.creation_growth > 20 * MiB, plan  # the plan really holds its activations
        assert abs(plan.ratio - 1) <= MEMORY_BOUND, plan
        assert abs(plan.steady_ratio - 1) <= MEMORY_BOUND, plan
        assert abs(plan.held_ratio - 1) <= MEMORY_BOUND, plan
    assert not warnings


def test_admission_predicts_what_each_int8_plan_holds_in_the_server_process(tmp_path):
    """The same plans of the same net quantized to int8 (uint8 activations, int32 accumulators): within the bound,
    and the server never calls the memory model off."""
    path = tmp_path / "heavy-int8.onnx"
    onnx.save(int8_net(heavy_net()), path)
    plans, warnings = server_plan_memory(str(path), sizes=(320, 448), batches=(1, 4), settle_seconds=0.5)
    assert len(plans) == 4
    for plan in plans:
        assert plan.creation_growth > 20 * MiB, plan
        assert abs(plan.ratio - 1) <= MEMORY_BOUND, plan
        assert abs(plan.steady_ratio - 1) <= MEMORY_BOUND, plan
        assert abs(plan.held_ratio - 1) <= MEMORY_BOUND, plan
    assert not warnings


@pytest.mark.parametrize("below_weights, used", [(21_000, True), (5 * MiB, False)])
def test_a_session_read_a_little_below_its_new_weights_is_measured_and_further_below_is_not(
        default_model_path, monkeypatch, below_weights, used):
    """CI read a session on shared weights 21 kB below the weights new to it (they filled free pages already
    resident) and threw the reading away: within what the resident set resolves, the session holds nothing of its
    own; megabytes below, memory was freed elsewhere and admission keeps the prediction."""
    from server.engine import plans as plans_module
    from server.scoring.pipeline import Pipeline
    from server.settings import Settings

    pipeline = Pipeline([default_model_path], settings=Settings(warm_up=False, provider="cpu"))
    weights = pipeline.engine.served(next(iter(pipeline._models))).plans._weights
    measure, runs = plans_module.measure_footprint, []

    def session_read_below_its_weights(build, *, on_gpu):
        before = weights.bytes
        built, reading = measure(build, on_gpu=on_gpu)
        if before == weights.bytes:  # the warm-up run: measured as it is
            runs.append(reading.host_bytes)
            return built, reading
        return built, dataclasses.replace(reading, host_bytes=weights.bytes - before - below_weights)

    monkeypatch.setattr(plans_module, "measure_footprint", session_read_below_its_weights)
    try:
        assert pipeline.score(raw_request(np.zeros((384, 384, 3), np.uint8), scales=[384])).top_k
        [record] = pipeline.engine.budget.plans()
    finally:
        pipeline.close()
    if used:
        assert record.measured_bytes == weights.bytes + runs[0]  # the session's own counted as 0, not -21 kB
    else:
        assert record.measured_bytes is None


def test_decoding_beside_a_plan_s_creation_does_not_count_as_its_memory(default_model_path, caplog):
    """Large images decoded on other threads while a plan is made grow the process's resident set, which would
    read as the plan's (`measured 446.8 MiB, predicted 172.8 MiB (2.59x)`): that reading is not used, admission keeps the prediction, and nothing is called off. A plan made alone is still measured."""
    import io
    import logging

    from PIL import Image

    from protos import scoring_pb2
    from server.scoring.pipeline import Pipeline
    from server.settings import Settings

    pixels = np.random.default_rng(5).integers(0, 256, (3000, 4000, 3), dtype=np.uint8)  # 36 MB decoded
    encoded = io.BytesIO()
    Image.fromarray(pixels).save(encoded, format="PNG", compress_level=0)
    large = scoring_pb2.ScoreRequest(encoded=encoded.getvalue(), scales=[384])
    pipeline = Pipeline([default_model_path], settings=Settings(warm_up=False, provider="cpu",
                                                                intra_op_threads=1))
    caplog.set_level(logging.DEBUG, logger="server.engine.plans")  # why a reading was not used, if it was not
    try:
        alone = pipeline.score(scoring_pb2.ScoreRequest(encoded=encoded.getvalue(), scales=[384]))
        assert alone.top_k
        [quiet] = pipeline.engine.budget.plans()
        assert quiet.measured_bytes is not None, caplog.text  # nothing else ran: measured
        stop, decoded = threading.Event(), []

        def decode_in_a_loop() -> None:
            while not stop.is_set():
                decoded.append(pipeline.score(large))

        threads = [threading.Thread(target=decode_in_a_loop) for _ in range(2)]
        caplog.set_level(logging.WARNING)
        for thread in threads:
            thread.start()
        try:
            while not decoded:  # the decoding threads are under way
                stop.wait(0.05)
            pipeline.score(scoring_pb2.ScoreRequest(encoded=encoded.getvalue(), scales=[512]))  # a new plan
        finally:
            stop.set()
            for thread in threads:
                thread.join()
        [made] = [record for record in pipeline.engine.budget.plans() if record.key != quiet.key]
    finally:
        pipeline.close()
    assert made.measured_bytes is None and made.accounted_bytes == made.predicted.total
    assert not [record for record in caplog.records if "memory model is off" in record.getMessage()]


def test_a_warmed_up_default_server_holds_its_plans_activations_once(default_model_path):
    """The default warm-up's ten plans (384-608 px, four of them 4-pass): the server holds the model's weights
    once, each plan's own state and the largest plan's running batch, not a block per plan (1124 MiB idle,
    970 of them the plans', with an arena and a copy of the weights per plan: docs/design.md). Warm-up measures
    each plan against its prediction, the tile canvas's too, and never calls the memory model off."""
    from convert.profile import profile_model

    def idle_rss(*flags: str) -> int:
        server = subprocess.Popen([sys.executable, "-m", "server.main", default_model_path, "--port", "0",
                                   "--provider", "cpu", *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
        try:
            line = server.stdout.readline()
            assert "listening on" in line, line
            with grpc.insecure_channel(line.rsplit(" ", 1)[1].strip()) as channel:
                _wait_serving(channel, server)
            if not flags:  # then the tile canvas is made (server.scoring.loading.warm_up_tiles), within a minute
                watchdog = threading.Timer(60.0, server.kill)  # a server that never says so ends its stderr
                watchdog.start()
                said = []
                try:
                    for line in server.stderr:
                        said.append(line)
                        if "tile canvas plan" in line and "ready" in line:
                            break
                finally:
                    watchdog.cancel()
                assert "tile canvas plan" in said[-1], "".join(said)
                assert not [line for line in said if "memory model is off" in line], "".join(said)
            time.sleep(IDLE_RELEASE_SECONDS + 1.0)  # the tile canvas's block goes back once idle
            with open(f"/proc/{server.pid}/status") as status:
                return next(int(row.split()[1]) * 1024 for row in status if row.startswith("VmRSS:"))
        finally:
            server.terminate()
            server.wait(30)

    plans = idle_rss() - idle_rss("--no-warm-up")
    largest = profile_model(default_model_path, height=608, width=416, batch=4).terms  # 1x608x416, 4 passes
    assert largest.per_model > 17 * MiB and largest.per_run > 120 * MiB
    assert plans < largest.per_model + largest.per_run + 10 * 4 * MiB + 32 * MiB, plans / MiB
