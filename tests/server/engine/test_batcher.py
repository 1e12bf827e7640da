"""The batcher's queue rules, with a runner held by an event: nothing here depends on how fast a model is."""

import contextlib
import dataclasses
import gc
import threading
import time
import weakref
from collections.abc import Iterator

import numpy as np
import pytest

from server.engine import batcher as batcher_module
from server.engine.batcher import Batcher, Dropped, Work
from server.errors import NoRoom, Refusal, ScoringError, Transient
from server.metrics import Metrics
from server.scoring.pipeline import Pipeline
from server.scoring.request import GroupKey
from server.settings import Settings
from tests.server.test_split import wait_until as wait_for


class GatedRunner:
    """Runs each batch when `gate` is open; records the batches it saw."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.batches: list[list[Work]] = []

    def __call__(self, works: list[Work]) -> list:
        self.batches.append(works)
        assert self.gate.wait(10), "the test never opened the gate"
        return [work.payload * 2 for work in works]


@pytest.fixture
def gated():
    runner = GatedRunner()
    batcher = Batcher(runner, max_batch=4, max_delay_seconds=0.001, queue_depth=8, max_queue_seconds=60)
    yield runner, batcher
    runner.gate.set()
    batcher.close()


def queue_places(batcher: Batcher, items: int, *, deadline: float | None):
    """`items` places in `batcher`'s queue, or admission's refusal saying why there is none."""
    held = batcher.reserve(items, deadline=deadline)
    if isinstance(held, NoRoom):
        raise held.refusal(deadline=deadline)
    return held


def works(count: int, key="a", *, limit: int = 4, deadline: float | None = None) -> list[Work]:
    return [Work(key, index, limit, deadline) for index in range(count)]


def wait_until_running(work: Work) -> None:
    while not work.started:
        time.sleep(0.001)


def test_same_keys_share_a_batch_and_other_keys_wait_their_turn(gated):
    runner, batcher = gated
    first = works(4)
    batcher.submit(first)
    wait_until_running(first[0])
    mixed = works(2, "b") + works(1, "c") + works(1, "b")
    batcher.submit(mixed)
    runner.gate.set()
    assert batcher.wait(first + mixed) == [0, 2, 4, 6, 0, 2, 0, 0]
    assert [len(batch) for batch in runner.batches] == [4, 3, 1]
    assert [w.key for w in runner.batches[1]] == ["b", "b", "b"]


def test_a_batch_takes_what_the_take_hook_says_and_leaves_the_rest_queued():
    runner, asked = GatedRunner(), []

    def take(key, count):
        asked.append((key, count))
        return 2

    batcher = Batcher(runner, max_batch=4, max_delay_seconds=0.0, queue_depth=8, max_queue_seconds=60, take=take)
    try:
        first = works(1)
        batcher.submit(first)
        wait_until_running(first[0])
        rest = works(5)
        batcher.submit(rest)
        runner.gate.set()
        assert batcher.wait(first + rest) == [0, 0, 2, 4, 6, 8]
        assert [len(batch) for batch in runner.batches] == [1, 2, 2, 1]
        assert asked == [("a", 4), ("a", 3)]  # at most max_batch offered; a lone item is not asked about
    finally:
        runner.gate.set()
        batcher.close()


def test_a_failing_take_hook_never_stops_the_worker():
    def broken_take(key, count):
        raise RuntimeError("the plans broke")

    batcher = Batcher(lambda batch: [w.payload for w in batch], max_batch=4, max_delay_seconds=0.0, queue_depth=8,
                      max_queue_seconds=60, take=broken_take)
    try:
        queued = works(3)
        batcher.submit(queued)
        assert batcher.wait(queued) == [0, 1, 2]  # every ready item taken, as with no hook
    finally:
        batcher.close()


def test_a_cpu_batch_takes_the_items_its_first_plan_run_scores(tiny_model_path):
    """On the CPU a batch runs in the exact batch buckets measured cheapest per item (PlanCache._sizes): the
    batcher takes only the first run's items, so the others do not wait for runs after their own."""
    settings = dataclasses.replace(Settings(), max_batch=4, warm_up_scales=(64,), intra_op_threads=1)
    pipeline = Pipeline([tiny_model_path], settings=settings)
    try:
        plans = pipeline.engine.served(pipeline._model("").name).plans
        warmed = next(key for key in plans._plans if key.batch == 4)
        group = GroupKey(warmed.height, warmed.width, warmed.passes)
        # nothing measured: the largest exact bucket first
        assert [plans.first_run(group, count) for count in (1, 3, 4, 7)] == [1, 2, 4, 4]
        for size, pace in ((1, 0.001), (2, 0.003), (4, 0.004)):  # then batch 1 measured cheapest per item
            plans._seconds_per_item[dataclasses.replace(warmed, batch=size)] = pace
        assert plans.first_run(group, 3) == 1
    finally:
        pipeline.close()


def test_a_batch_takes_no_more_than_the_memory_limit_of_its_first_item(gated):
    runner, batcher = gated
    runner.gate.set()
    limited = works(3, limit=2)
    batcher.submit(limited)
    batcher.wait(limited)
    assert [len(batch) for batch in runner.batches] == [2, 1]


def test_a_full_queue_refuses_with_a_retry_hint_and_cancelled_calls_free_their_place(gated):
    runner, batcher = gated
    running = works(4)
    batcher.submit(running)
    wait_until_running(running[0])
    queued = works(8)
    batcher.submit(queued)
    for refuse in (lambda: batcher.submit(works(1)), lambda: queue_places(batcher, 1, deadline=None)):
        with pytest.raises(ScoringError, match="queue full") as caught:
            refuse()
        assert caught.value.refusal is Refusal.RESOURCE_EXHAUSTED and caught.value.retry_after_seconds > 0
    cancelled = threading.Event()
    cancelled.set()
    with pytest.raises(ScoringError) as caught:
        batcher.wait(queued, cancelled=cancelled)
    assert caught.value.refusal is Refusal.CANCELLED
    assert batcher.depth() == 0
    with batcher.reserve(8, deadline=None):  # room again
        pass
    runner.gate.set()
    assert batcher.wait(running) == [0, 2, 4, 6]


@contextlib.contextmanager
def paced_batcher(seconds_per_item: float, *, max_queue_seconds: float, queue_depth: int = 100,
                  runners: int = 1) -> Iterator[Batcher]:
    """A batcher whose recent pace is `seconds_per_item` and whose workers take nothing (they wait a minute
    for a batch to fill): what is queued stays queued. Closed on leaving, without waiting for the batches a test
    says run (`_running_until`), which no runner ends."""
    batcher = Batcher(GatedRunner(), max_batch=100, max_delay_seconds=60, queue_depth=queue_depth,
                      max_queue_seconds=max_queue_seconds, runners=runners)
    batcher._seconds_per_item = seconds_per_item
    try:
        yield batcher
    finally:
        batcher._running_until.clear()
        batcher.close()


def test_expected_wait_beyond_the_deadline_or_the_queue_limit_is_refused_before_queueing():
    with paced_batcher(0.1, max_queue_seconds=0.5) as batcher:
        with batcher.reserve(10, deadline=None):  # nothing ahead: its own run time is no queueing
            pass
        batcher._queue.extend(works(5, "waiting"))  # 0.5 s ahead: within one item's time of the 0.5 s limit
        with pytest.raises(ScoringError, match="--max-queue-ms") as caught:
            queue_places(batcher, 1, deadline=None)
        assert caught.value.refusal is Refusal.RESOURCE_EXHAUSTED and caught.value.retry_after_seconds > 0
        del batcher._queue[:2]  # 0.3 s ahead: admitted
        with batcher.reserve(1, deadline=None):
            pass
        batcher._queue.clear()
        with pytest.raises(ScoringError, match="deadline"):
            queue_places(batcher, 2, deadline=time.monotonic() + 0.1)  # 0.2 s of its own work
    with pytest.raises(ScoringError, match="shutting down") as caught:
        queue_places(batcher, 1, deadline=None)
    assert caught.value.refusal is Refusal.UNAVAILABLE


def test_the_margin_is_kept_only_when_items_wait_ahead():
    with paced_batcher(0.6, max_queue_seconds=1.0) as batcher:  # a slow model: 0.6 s an item
        batcher._running_until[0] = time.monotonic() + 0.55  # only the running batch ahead, 0.55 s from its end
        with batcher.reserve(1, deadline=None):  # admitted: it starts within the limit, nothing to misjudge
            pass
        batcher._queue.extend(works(1, "waiting"))  # 1.15 s ahead
        with pytest.raises(ScoringError, match="--max-queue-ms"):
            queue_places(batcher, 1, deadline=None)


def test_runners_run_batches_side_by_side():
    """--cpu-runners 2: a second batch starts while the first runs (each waits here for the other: with one
    runner the first would wait alone, time out and fail both)."""
    both = threading.Barrier(2, timeout=10)

    def run(batch: list[Work]) -> list:
        both.wait()
        return [work.payload for work in batch]

    batcher = Batcher(run, max_batch=1, max_delay_seconds=0, queue_depth=8, max_queue_seconds=60, runners=2)
    try:
        first, second = works(1, "a"), works(1, "b")
        batcher.submit(first)
        batcher.submit(second)
        assert batcher.wait(first + second) == [0, 0]
        assert first[0].batch_id != second[0].batch_id
    finally:
        batcher.close()


def test_a_request_s_batches_spread_over_the_runners_in_its_expected_end():
    """Eight items at 0.1 s each: one runner ends them in 0.8 s, two in 0.4 s unbatched, but in one batch of eight
    (--max-batch 8) they run on one runner, 0.8 s."""
    for runners, max_batch, done in ((1, 1, 0.8), (2, 1, 0.4), (2, 8, 0.8)):
        batcher = Batcher(GatedRunner(), max_batch=max_batch, max_delay_seconds=60, queue_depth=100,
                          max_queue_seconds=60, runners=runners)
        batcher._seconds_per_item = 0.1
        try:
            refused = batcher.reserve(8, deadline=time.monotonic())
            assert refused.done == pytest.approx(done, abs=0.02), (runners, max_batch)
        finally:
            batcher.close()


def test_the_expected_wait_is_shared_between_the_runners():
    """Four items at 0.1 s ahead and one runner busy for 0.3 s more: one runner starts a new item after 0.7 s, two
    after 0.2 s (the free runner takes the queue at twice one's pace)."""
    for runners, wait in ((1, 0.7), (2, 0.2)):
        with paced_batcher(0.1, max_queue_seconds=60, runners=runners) as batcher:
            batcher._queue.extend(works(4, "waiting"))
            batcher._running_until[0] = time.monotonic() + 0.3
            refused = batcher.reserve(1, deadline=time.monotonic())
            assert refused.wait == pytest.approx(wait, abs=0.02)


def test_an_offer_queues_a_request_s_items_with_room_and_otherwise_says_why_as_reserve_would(gated):
    runner, batcher = gated  # queue depth 8
    running = works(1)
    batcher.submit(running)
    wait_until_running(running[0])
    told = []
    first = works(5)
    for work in first:
        work.on_done = told.append
    assert batcher.offer(first, deadline=None) is None
    assert batcher.depth() == 5
    no_room = batcher.offer(works(4), deadline=None)  # 5 + 4 > 8
    assert isinstance(no_room, NoRoom) and (no_room.why, no_room.waiting) == (Transient.QUEUE_FULL, 5)
    assert batcher.reserve(4, deadline=None).why is Transient.QUEUE_FULL
    assert batcher.depth() == 5  # the refused offer holds nothing
    runner.gate.set()
    assert batcher.wait(running + first) == [0, 0, 2, 4, 6, 8]
    assert sorted(work.result for work in told) == [0, 2, 4, 6, 8]


def test_an_offer_made_to_run_here_claims_what_a_free_runner_would_take_at_once_and_holds_its_place():
    """The claimed batch runs on the offering thread, in the one runner's place: an item offered meanwhile waits
    for it, and is not claimed, as a runner would not have taken it at once either."""
    runner, threads, cpu = GatedRunner(), [], []
    run = runner.__call__
    batcher = Batcher(lambda batch: threads.append(threading.current_thread()) or run(batch), max_batch=4,
                      max_delay_seconds=0.0, queue_depth=8, max_queue_seconds=60, on_cpu=cpu.append)
    try:
        lone = works(2)
        claim = batcher.offer(lone, deadline=None, here=True)
        assert claim is not None and claim.batch == lone and all(work.started for work in lone)
        assert batcher.depth() == 0 and not runner.batches  # no runner took it
        later = works(1, key="b")
        assert batcher.offer(later, deadline=None, here=True) is None  # the one place is the claim's: queued
        time.sleep(0.1)
        assert not later[0].started  # the runner waits for the claimed batch's place
        runner.gate.set()
        claim.run()
        assert [work.result for work in lone] == [0, 2]
        assert batcher.wait(later) == [0]  # a runner took it once the place was free
        assert [len(batch) for batch in runner.batches] == [2, 1]
        assert threads[0] is threading.current_thread() and threads[1] is not threading.current_thread()
        assert wait_for(lambda: len(cpu) == 2) and all(seconds >= 0 for seconds in cpu)  # each batch's, either thread
    finally:
        runner.gate.set()
        batcher.close()


def test_close_waits_for_a_batch_another_thread_claimed():
    runner = GatedRunner()
    batcher = Batcher(runner, max_batch=4, max_delay_seconds=0.0, queue_depth=8, max_queue_seconds=60)
    claim = batcher.offer(works(1), deadline=None, here=True)
    running = threading.Thread(target=claim.run)  # run by a thread other than the one that claimed it
    running.start()
    closing = threading.Thread(target=batcher.close)
    closing.start()
    time.sleep(0.2)
    assert closing.is_alive()  # the claimed batch is still running
    runner.gate.set()
    closing.join(10)
    running.join(10)
    assert not closing.is_alive() and claim.batch[0].result == 0


@pytest.mark.parametrize("why", ["a runner busy", "a wait for companions", "more than a batch", "two keys"])
def test_an_offer_made_to_run_here_queues_what_a_runner_would_not_take_at_once(why):
    runner = GatedRunner()
    batcher = Batcher(runner, max_batch=2, max_delay_seconds=0.5 if why == "a wait for companions" else 0.0,
                      queue_depth=8, max_queue_seconds=60)
    try:
        if why == "a runner busy":
            busy = works(1, key="busy")
            batcher.submit(busy)
            wait_until_running(busy[0])
        offered = {"more than a batch": works(3), "two keys": works(1) + works(1, key="b")}.get(why, works(1))
        assert batcher.offer(offered, deadline=None, here=True) is None  # queued, for a runner
        runner.gate.set()
        assert len(batcher.wait(offered)) == len(offered)
        assert sum(len(batch) for batch in runner.batches) == len(offered) + (why == "a runner busy")
    finally:
        runner.gate.set()
        batcher.close()


def test_places_of_requests_still_decoding_count_until_they_are_queued_or_given_back():
    with paced_batcher(0.1, max_queue_seconds=0.5, queue_depth=6) as batcher:
        decoding = batcher.reserve(3, deadline=None)  # admitted, its image not yet decoded
        assert batcher.state().wait(time.monotonic()) == pytest.approx(0.3)
        with pytest.raises(ScoringError, match="queue full"):
            queue_places(batcher, 4, deadline=None)  # 3 held + 4 > 6 places
        with batcher.reserve(2, deadline=None):  # 0.3 s ahead: admitted, and now 0.5 s are held
            with pytest.raises(ScoringError, match="--max-queue-ms"):
                queue_places(batcher, 1, deadline=None)
        batcher.submit(works(3, "held"), decoding)  # its items take the places it held: counted once
        assert batcher.depth() == 3 and batcher.state().wait(time.monotonic()) == pytest.approx(0.3)
        batcher._queue.clear()
        with batcher.reserve(2, deadline=None) as failing:  # a request whose decode fails gives its places back
            assert batcher.state().wait(time.monotonic()) == pytest.approx(0.2)
        assert failing.items == 0 and batcher.state().wait(time.monotonic()) == 0


def test_items_waiting_longer_than_the_queue_limit_are_dropped_before_compute_but_not_a_started_requests():
    runner, drops = GatedRunner(), []
    batcher = Batcher(runner, max_batch=1, max_delay_seconds=0.0, queue_depth=8, max_queue_seconds=0.05,
                      on_drop=drops.append)
    try:
        running, late = works(3), works(1, "b")
        batcher.submit(running)
        wait_until_running(running[0])
        batcher.submit(late)
        time.sleep(0.1)  # every queued item has now waited beyond the 50 ms limit
        runner.gate.set()
        assert batcher.wait(running) == [0, 2, 4]  # its first item ran in time: the others are its own work
        with pytest.raises(ScoringError, match="max-queue-ms") as caught:
            batcher.wait(late)  # another request's item that never started is dropped
        assert caught.value.refusal is Refusal.RESOURCE_EXHAUSTED
        assert [len(batch) for batch in runner.batches] == [1, 1, 1]  # the late item never ran
        assert drops == [Dropped.QUEUE_TIME]
    finally:
        runner.gate.set()
        batcher.close()


def test_every_drop_is_reported_and_a_failing_drop_hook_never_stops_the_worker():
    runner, drops = GatedRunner(), []

    def broken_hook(reason: Dropped) -> None:
        drops.append(reason)
        raise RuntimeError("a broken metrics hook")

    batcher = Batcher(runner, max_batch=1, max_delay_seconds=0.0, queue_depth=8, max_queue_seconds=0.05,
                      on_drop=broken_hook)
    try:
        running = works(1)
        batcher.submit(running)
        wait_until_running(running[0])
        expiring = works(2, "b", deadline=time.monotonic() + 0.02)
        batcher.submit(expiring)
        with pytest.raises(ScoringError, match="deadline"):  # its caller sees the deadline pass in the queue
            batcher.wait(expiring)
        late = works(1, "c")
        batcher.submit(late)
        time.sleep(0.1)  # past the 50 ms queue limit, behind the held run
        runner.gate.set()
        with pytest.raises(ScoringError, match="max-queue-ms"):  # the worker drops it
            batcher.wait(late)
        assert drops == [Dropped.DEADLINE, Dropped.DEADLINE, Dropped.QUEUE_TIME]
        again = works(1)
        batcher.submit(again)
        assert batcher.wait(again) == [0]  # the worker lives on
    finally:
        runner.gate.set()
        batcher.close()


def test_an_expired_item_is_failed_outside_the_queue_s_lock():
    """Its hook (in the engine process, the front's answer: a socket write) may wait; the queue goes on meanwhile."""
    runner, seen = GatedRunner(), []
    batcher = Batcher(runner, max_batch=1, max_delay_seconds=0.0, queue_depth=8, max_queue_seconds=60)

    def hook(work: Work) -> None:
        other = threading.Thread(target=lambda: seen.append(batcher.depth()))
        other.start()
        other.join(2)
        seen.append(work.error.refusal)

    try:
        running = works(1)
        batcher.submit(running)
        wait_until_running(running[0])
        expiring = Work("b", 0, 1, time.monotonic() + 0.02, on_done=hook)
        batcher.submit([expiring])
        time.sleep(0.05)
        runner.gate.set()
        assert batcher.wait(running) == [0]
        until = time.monotonic() + 5
        while len(seen) < 2 and time.monotonic() < until:
            time.sleep(0.01)
        assert seen == [0, Refusal.DEADLINE_EXCEEDED]  # another thread read the queue while the hook ran
    finally:
        runner.gate.set()
        batcher.close()


def test_an_item_a_runner_took_as_expired_is_counted_once_when_its_caller_sees_its_deadline_first():
    """A runner fails the expired items it took out of the queue one by one, outside the queue's lock: a caller
    that sees its deadline pass meanwhile finds its item already taken, and leaves its drop to the runner."""
    first_told, caller_gone, drops = threading.Event(), threading.Event(), []

    def on_drop(reason: Dropped) -> None:
        drops.append(reason)
        if len(drops) == 1:  # the runner still holds the other expired item, not yet failed
            first_told.set()
            caller_gone.wait(5)

    batcher = Batcher(lambda batch: [w.payload for w in batch], max_batch=4, max_delay_seconds=0.05, queue_depth=8,
                      max_queue_seconds=60, on_drop=on_drop)
    try:
        deadline = time.monotonic() + 0.01  # passed before the first item's 50 ms batching delay ends
        earlier, later = works(1, deadline=deadline), works(1, deadline=deadline)
        batcher.submit(earlier)
        batcher.submit(later)
        assert first_told.wait(5)
        with pytest.raises(ScoringError, match="deadline"):
            batcher.wait(later)
        caller_gone.set()
        assert later[0].done.wait(5)
        assert drops == [Dropped.DEADLINE, Dropped.DEADLINE], "an item dropped once was counted twice"
    finally:
        caller_gone.set()
        batcher.close()


class OutcomeRunner:
    """Runs a batch as `outcome` says; a batch keyed "blocker" waits for `gate`."""

    def __init__(self, outcome: str) -> None:
        self.outcome = outcome
        self.gate = threading.Event()

    def __call__(self, works: list[Work]) -> list:
        if works[0].key == "blocker":
            self.gate.wait(10)
        elif self.outcome == "refused":
            raise ScoringError(Refusal.FAILED_PRECONDITION, "no plan for this shape")
        elif self.outcome == "crashed":
            raise RuntimeError("a kernel failed")
        return [0.0 for _ in works]


def finished_request(batcher: Batcher) -> weakref.ref:
    """Score one request whose payload only the request holds; a weak reference to that payload."""
    payload = np.ones(1024)
    works = [Work("a", payload, 1, None), Work("a", payload, 1, None)]
    batcher.submit(works)
    with contextlib.suppress(ScoringError):
        batcher.wait(works)
    return weakref.ref(payload)


@pytest.mark.parametrize("outcome", ["scored", "refused", "crashed", "dropped"])
def test_a_requests_arrays_are_freed_when_it_ends_without_the_garbage_collector(outcome, monkeypatch):
    monkeypatch.setattr(batcher_module.LOG, "propagate", False)  # pytest's log capture keeps tracebacks
    runner = OutcomeRunner(outcome)
    batcher = Batcher(runner, max_batch=1, max_delay_seconds=0.0, queue_depth=8,
                      max_queue_seconds=0.05 if outcome == "dropped" else 60)
    gc.disable()  # a reference cycle would keep the payload until the collector ran
    try:
        if outcome == "dropped":
            blocker = works(1, "blocker")
            batcher.submit(blocker)
            wait_until_running(blocker[0])
            threading.Timer(0.1, runner.gate.set).start()  # the request waits past the limit meanwhile
        alive = finished_request(batcher)
        patience = time.monotonic() + 5  # the worker may still be leaving the batch
        while alive() is not None and time.monotonic() < patience:
            time.sleep(0.01)
        assert alive() is None, f"{outcome}: the request's payload outlived it"
    finally:
        gc.enable()
        runner.gate.set()
        batcher.close()


def test_expired_work_is_dropped_before_compute(tiny_model_path, kit):
    settings = dataclasses.replace(Settings(), warm_up=False, intra_op_threads=1)
    metrics = Metrics()
    pipeline = Pipeline([tiny_model_path], settings=settings, metrics=metrics)
    try:
        model = pipeline._model("")
        request = kit.raw_request(np.zeros((64, 64, 3), dtype=np.uint8), scales=[64], return_maps=True)
        with pytest.raises(ScoringError, match="deadline") as caught:
            pipeline.score(request, deadline=time.monotonic() - 0.001)
        assert caught.value.refusal in (Refusal.DEADLINE_EXCEEDED, Refusal.RESOURCE_EXHAUSTED)
        assert pipeline.engine.served(model.name).batcher.depth() == 0
        assert metrics.registry.get_sample_value("scoremap_batch_size_count", {"model": "tiny"}) is None  # never ran
        assert pipeline.score(request, deadline=time.monotonic() + 30).maps
    finally:
        pipeline.close()


def test_a_failing_batch_hook_never_stops_the_worker():
    def broken_hook(batch):
        raise RuntimeError("metrics broke")

    batcher = Batcher(lambda batch: [w.payload for w in batch], max_batch=2, max_delay_seconds=0.001, queue_depth=8,
                      max_queue_seconds=60, on_batch=broken_hook)
    try:
        for _ in range(2):
            (work,) = works(1)
            batcher.submit([work])
            assert work.done.wait(5), "the worker stopped"
            assert work.result == 0
    finally:
        batcher.close()


def test_close_waits_for_the_running_batch_at_most_close_seconds(monkeypatch):
    from server.engine import batcher as batcher_module

    monkeypatch.setattr(batcher_module, "CLOSE_SECONDS", 0.2)
    runner = GatedRunner()
    batcher = Batcher(runner, max_batch=1, max_delay_seconds=0.001, queue_depth=8, max_queue_seconds=60)
    (work,) = works(1)
    batcher.submit([work])
    wait_until_running(work)
    started = time.monotonic()
    batcher.close()
    assert time.monotonic() - started < 2
    runner.gate.set()
    assert work.done.wait(5)
