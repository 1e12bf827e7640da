"""The batcher and the pipeline's queue rules, on a real onnxruntime session."""

import dataclasses
import threading
import time

import grpc
import numpy as np
import pytest

from server.batcher import Batcher
from server.engine import Engine
from server.errors import ScoringError
from server.imaging import to_batch
from server.metrics import Metrics
from server.pipeline import Pipeline
from server.settings import Settings
from convert.card import read_card


@pytest.fixture
def heavy_batcher(heavy_model_path):
    card = read_card(heavy_model_path)
    engine = Engine(heavy_model_path, input_name="image", output_name="scores", settings=Settings(intra_op_threads=1))
    batcher = Batcher(lambda images: engine.run(to_batch(images, card.preprocessing)),
                      max_batch=4, max_delay_seconds=0.001, queue_depth=16)
    yield batcher
    batcher.close()


def images(count: int, side: int = 160) -> list[np.ndarray]:
    return [np.zeros((side, side, 3), dtype=np.float32) for _ in range(count)]


def test_same_shapes_share_a_batch_and_other_shapes_wait_their_turn(heavy_batcher):
    first = heavy_batcher.submit(images(4), limits=[4] * 4, deadline=None)
    mixed = heavy_batcher.submit(images(2, 64) + images(1, 96), limits=[4] * 3, deadline=None)
    results = heavy_batcher.wait(first + mixed)
    assert [r.shape for r in results] == [(4, 5, 5)] * 4 + [(4, 2, 2)] * 2 + [(4, 3, 3)]
    assert {w.batch_size for w in first} == {4}
    assert [w.batch_size for w in mixed] == [2, 2, 1]


def test_cancelled_calls_free_their_place(heavy_batcher):
    running = heavy_batcher.submit(images(4), limits=[4] * 4, deadline=None)
    while not running[0].started:
        time.sleep(0.001)
    queued = heavy_batcher.submit(images(12), limits=[4] * 12, deadline=None)
    with pytest.raises(ScoringError, match="queue full") as caught:
        heavy_batcher.submit(images(8), limits=[4] * 8, deadline=None)
    assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    cancelled = threading.Event()
    cancelled.set()
    with pytest.raises(ScoringError) as caught:
        heavy_batcher.wait(queued, cancelled=cancelled)
    assert caught.value.code == grpc.StatusCode.CANCELLED
    assert heavy_batcher.depth() == 0
    assert len(heavy_batcher.submit(images(8), limits=[4] * 8, deadline=None)) == 8  # room again
    heavy_batcher.wait(running)


def test_expired_work_is_dropped_before_compute(heavy_model_path, kit):
    settings = dataclasses.replace(Settings(), warm_up=False, intra_op_threads=1)
    metrics = Metrics()
    pipeline = Pipeline([heavy_model_path], settings=settings, metrics=metrics)
    try:
        model = pipeline._model("")
        request = kit.raw_request(np.zeros((64, 64, 3), dtype=np.uint8), scales=[64])
        with pytest.raises(ScoringError, match="deadline passed") as caught:
            pipeline.score(request, deadline=time.monotonic() - 0.001)
        assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert model.batcher.depth() == 0
        assert metrics.registry.get_sample_value("scoremap_batch_size_count", {"model": "heavy"}) is None  # never ran
        assert pipeline.score(request, deadline=time.monotonic() + 30).maps
    finally:
        pipeline.close()


def test_a_failing_batch_hook_never_stops_the_worker():
    def broken_hook(shape, size):
        raise RuntimeError("metrics broke")

    batcher = Batcher(lambda batch: np.stack(batch), max_batch=2, max_delay_seconds=0.001, queue_depth=8,
                      on_batch=broken_hook)
    try:
        for _ in range(2):
            (work,) = batcher.submit(images(1, 8), limits=[2], deadline=None)
            assert work.done.wait(5), "the worker stopped"
            assert work.result.shape == (8, 8, 3)
    finally:
        batcher.close()


def test_close_waits_for_the_running_batch_at_most_close_seconds(monkeypatch):
    from server import batcher as batcher_module

    monkeypatch.setattr(batcher_module, "CLOSE_SECONDS", 0.2)
    release = threading.Event()
    batcher = Batcher(lambda batch: (release.wait(10), np.stack(batch))[1], max_batch=1, max_delay_seconds=0.001,
                      queue_depth=8)
    (work,) = batcher.submit(images(1, 8), limits=[1], deadline=None)
    while not work.started:
        time.sleep(0.001)
    started = time.monotonic()
    batcher.close()
    assert time.monotonic() - started < 2
    release.set()
    assert work.done.wait(5)
