"""Plans made for requests and in the background: a request's plan never waits behind a background one."""

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx

from protos import scoring_pb2
from server.memory.runtime import HostActivity
from server.engine.client import PlanKey
from server.engine.plans import PlanCache
from server.scoring import loading
from server.scoring.pipeline import Pipeline
from server.settings import Settings
from tests.tiny_models import patch_net

HELD_SECONDS = 120.0  # a guard against a test that would hang, never a measure of speed


def raw(pixels: np.ndarray, **fields) -> scoring_pb2.ScoreRequest:
    height, width, channels = pixels.shape
    image = scoring_pb2.RawImage(data=pixels.tobytes(), height=height, width=width, channels=channels)
    return scoring_pb2.ScoreRequest(raw=image, **fields)


@contextlib.contextmanager
def tile_plan_held(tmp_path) -> Iterator[tuple[Pipeline, PlanCache, PlanKey, threading.Event]]:
    """A pipeline whose background tile canvas plan is being made and held inside its making until the block
    ends or the event it yields is set: (pipeline, its plans, the tile plan's key, the release)."""
    path = tmp_path / "tiny.onnx"
    onnx.save(patch_net(classes=3), path)
    pipeline = Pipeline([str(path)], settings=Settings(warm_up=False, intra_op_threads=1, tile_canvas=(256, 256)))
    try:
        model = pipeline._model("")
        plans = pipeline.engine.served(model.name).plans
        [tile_key] = loading.tiled_plans(model)
        making, release = threading.Event(), threading.Event()
        graph = plans._graph

        def held_graph(key):
            if key == tile_key:
                making.set()
                release.wait(HELD_SECONDS)
            return graph(key)

        plans._graph = held_graph
        background = threading.Thread(target=pipeline.warm_up_tiles)
        background.start()
        try:
            assert making.wait(HELD_SECONDS)
            yield pipeline, plans, tile_key, release
        finally:
            release.set()
            background.join(HELD_SECONDS)
    finally:
        pipeline.close()


def test_a_request_plan_is_made_beside_the_background_tile_canvas_plan_not_behind_it(tmp_path):
    """The tile canvas plan, made in the background once SERVING, is held inside its making until the request is
    answered: a photo whose canvas was not warmed gets its plan made and its answer meanwhile (a request's plan made
    behind it would wait for the release, which comes only after the answer). Made beside each other, neither plan's
    footprint reading is used: the budget keeps their predictions."""
    with tile_plan_held(tmp_path) as (pipeline, _plans, tile_key, release):
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(pipeline.score, raw(np.zeros((64, 160, 3), np.uint8), scales=[64]))
            response = answer.result(HELD_SECONDS)
        assert not release.is_set() and response.timings.planning_ms > 0  # its own plan, made meanwhile
        release.set()
        budget = pipeline.engine.budget
    records = {record.key: record for record in budget.plans()}
    assert tile_key in records and len(records) == 2
    assert all(record.measured_bytes is None for record in records.values())


def test_a_background_plan_a_request_needs_is_waited_for_not_made_twice(tmp_path):
    """A photo tiled onto the tile canvas while the background makes that very plan waits for it, and takes it."""
    with tile_plan_held(tmp_path) as (pipeline, plans, tile_key, release):
        waiting = threading.Event()
        made = plans._beside[tile_key]  # set by the background once the plan is made
        wait = made.wait

        def waited(timeout=None):
            waiting.set()
            return wait(timeout)

        made.wait = waited
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(pipeline.score, raw(np.zeros((600, 600, 3), np.uint8), scales=[600]))
            assert waiting.wait(HELD_SECONDS)  # the request waits for the background's plan
            release.set()
            response = answer.result(HELD_SECONDS)
        assert response.maps[0].tiling.tiles > 1 and plans.made == 1


def test_alone_since_tells_work_that_ran_beside_a_block():
    activity = HostActivity()
    with activity.busy() as began:
        assert activity.alone_since(began)
        with activity.busy():
            pass
        assert not activity.alone_since(began)  # one began and ended meanwhile
    with activity.busy() as first:
        with activity.busy() as second:
            assert not activity.alone_since(second)  # another ran as it began
        assert not activity.alone_since(first)
