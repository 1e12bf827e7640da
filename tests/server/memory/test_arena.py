"""One CPU arena for every plan of the process: a plan that does not run holds no activations, and the
arena keeps the largest block a run took, not one block per plan nor a pile of them."""

import numpy as np
import onnx
import pytest

from server.memory.arena import SharedArena
from server.memory.runtime import configure_allocator, release_free_memory, resident_bytes
from tests.server.conftest import raw_request
from tests.tiny_models import heavy_net

MiB = 2**20


@pytest.fixture(scope="module", autouse=True)
def allocator():
    assert configure_allocator()  # glibc: the configuration the server runs under


def ran(arena: SharedArena, block_bytes: int) -> None:
    """A run that took a block of `block_bytes` and ended."""
    with arena.running(block_bytes):
        pass


def test_the_arena_shrinks_before_a_run_only_when_a_larger_block_comes(monkeypatch):
    arena = SharedArena()
    shrinks = []
    monkeypatch.setattr(arena, "_shrink_locked", lambda: (shrinks.append(arena.held_bytes), setattr(arena, "held_bytes", 0)))
    ran(arena, 10)
    assert shrinks == [] and arena.held_bytes == 10  # nothing held yet: nothing to give back
    ran(arena, 5)
    ran(arena, 10)
    assert shrinks == []  # they fit in what the arena holds
    ran(arena, 30)
    assert shrinks == [10] and arena.held_bytes == 30  # the 10 goes, so the 30 does not join it
    arena.took(40)
    assert arena.held_bytes == 40
    arena.shrink()
    assert shrinks == [10, 40] and arena.held_bytes == 0


def test_an_idle_arena_gives_back_a_large_block_and_keeps_a_small_one(monkeypatch):
    import time

    from server.memory.arena import IDLE_HELD_BYTES

    arena = SharedArena()
    arena.idle_release_seconds = 0.05
    shrinks = []
    monkeypatch.setattr(arena, "_shrink_locked", lambda: (shrinks.append(arena.held_bytes), setattr(arena, "held_bytes", 0)))

    def idle(*, release: bool) -> None:
        arena.went_idle(release=release)
        time.sleep(0.2)

    ran(arena, IDLE_HELD_BYTES)
    idle(release=False)
    assert shrinks == []  # the block most requests reuse stays
    idle(release=True)
    assert shrinks == [IDLE_HELD_BYTES]  # requests held much memory since the last release: all of it goes back
    ran(arena, IDLE_HELD_BYTES + 1)
    idle(release=False)
    assert shrinks == [IDLE_HELD_BYTES, IDLE_HELD_BYTES + 1]
    # a run that begins before the delay is out keeps the block: the next request would fault it in again
    ran(arena, IDLE_HELD_BYTES + 1)
    arena.went_idle(release=True)
    ran(arena, IDLE_HELD_BYTES + 1)
    time.sleep(0.2)
    assert shrinks == [IDLE_HELD_BYTES, IDLE_HELD_BYTES + 1]
    idle(release=False)  # the release asked for before still holds
    assert shrinks == [IDLE_HELD_BYTES, IDLE_HELD_BYTES + 1, IDLE_HELD_BYTES + 1]


def test_blocks_of_runs_side_by_side_count_together_when_the_arena_goes_idle(monkeypatch):
    """--cpu-runners: two runs at once hold two blocks; each under the idle limit, together over it, they go back."""
    import time

    from server.memory.arena import IDLE_HELD_BYTES

    arena = SharedArena()
    arena.idle_release_seconds = 0.05
    shrinks = []
    monkeypatch.setattr(arena, "_shrink_locked", lambda: (shrinks.append(arena._held_together),
                                                          setattr(arena, "held_bytes", 0),
                                                          setattr(arena, "_held_together", arena._running_bytes)))
    block = IDLE_HELD_BYTES // 2 + 1
    ran(arena, block)
    ran(arena, block)  # one after the other: one block
    arena.went_idle(release=False)
    time.sleep(0.2)
    assert shrinks == []
    with arena.running(block), arena.running(block):  # side by side: two
        pass
    arena.went_idle(release=False)
    time.sleep(0.2)
    assert shrinks == [2 * block]


def test_a_shorter_idle_release_time_applies_to_a_release_already_pending(monkeypatch):
    import time

    arena = SharedArena()
    arena.idle_release_seconds = 30.0
    shrinks = []
    monkeypatch.setattr(arena, "_shrink_locked", lambda: (shrinks.append(arena.held_bytes), setattr(arena, "held_bytes", 0)))
    ran(arena, 10)
    arena.went_idle(release=True)  # due in 30 s
    time.sleep(0.2)  # the waiter sleeps until then
    arena.idle_release_seconds = 0.05
    arena.went_idle(release=True)  # due in 50 ms: the waiter must not sleep on until the first
    deadline = time.monotonic() + 5
    while not shrinks and time.monotonic() < deadline:
        time.sleep(0.02)
    assert shrinks == [10]


@pytest.fixture()
def heavy_pipeline(tmp_path):
    from server.scoring.pipeline import Pipeline
    from server.settings import Settings

    path = tmp_path / "heavy.onnx"
    onnx.save(heavy_net(), path)
    buckets = ((64, 64), (320, 320), (320, 352), (352, 320), (352, 352))
    pipeline = Pipeline([str(path)], settings=Settings(warm_up=False, provider="cpu", intra_op_threads=1,
                                                       shape_buckets=buckets))
    yield pipeline
    pipeline.close()


def score(pipeline, height: int, width: int) -> None:
    pixels = np.random.default_rng(height * width).integers(0, 256, (height, width, 3), dtype=np.uint8)
    assert pipeline.score(raw_request(pixels, scales=[max(height, width)])).top_k


def settled() -> int:
    release_free_memory()
    return resident_bytes()


def test_each_further_plan_adds_less_than_one_plan_s_activations(heavy_pipeline):
    """Four plans of about the same size (activations of 40-50 MiB each): the first takes its block from the arena,
    each further one adds its own state, not a block of its own (with an arena each, each would keep ~1.1x its live peak)."""
    score(heavy_pipeline, 64, 64)  # the model's first plan: its weights and the process's first-use state
    before = settled()
    score(heavy_pipeline, 320, 320)
    first = settled() - before
    grown = []
    for height, width in ((320, 352), (352, 320), (352, 352)):
        start = settled()
        score(heavy_pipeline, height, width)
        grown.append(settled() - start)
    records = {str(record.key): record for record in heavy_pipeline.engine.budget.plans()}
    activations = records["1x320x320x1 passes"].predicted.activations
    assert first > 0.5 * activations, (first, activations)  # the arena grew by a block: the measure can see one
    for growth in grown:
        # each grows the arena by the difference of blocks (352x352 is 1.2x 320x320) and its own state
        assert growth < 0.35 * activations, (grown, activations)
    # and every plan is accounted that way: each one's own state, the largest running batch
    largest = records["1x352x352x1 passes"]
    assert largest.measured_run_bytes is not None and largest.measured_run_bytes > 0.8 * largest.predicted.per_run
    assert all(record.own_bytes < 4 * MiB for record in records.values()), records


def test_the_arena_keeps_the_largest_block_not_a_pile_of_them(heavy_pipeline):
    """A smaller plan made after a larger one leaves the arena holding the smaller block; the larger plan's next
    run must not add its block beside it, but take the arena's place (server.memory.arena.SharedArena.running)."""
    score(heavy_pipeline, 64, 64)  # as above
    before = settled()
    score(heavy_pipeline, 352, 352)
    score(heavy_pipeline, 320, 320)  # made last: the arena shrank for it, and holds its block now
    for _ in range(2):
        score(heavy_pipeline, 352, 352)
        score(heavy_pipeline, 320, 320)
    held = settled() - before
    records = {str(record.key): record for record in heavy_pipeline.engine.budget.plans()}
    large, small = records["1x352x352x1 passes"], records["1x320x320x1 passes"]
    assert held < large.run_bytes + small.run_bytes // 2, (held, large.run_bytes, small.run_bytes)
    assert held > 0.8 * large.run_bytes, (held, large.run_bytes)
