"""The engine reached through `RemoteClient` and `EngineLoop`: a real Unix socket and shared memory in one process,
so each test can look into the engine (its queue) while a front's pipeline calls it."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest

from server.engine import messages as messages_module
from server.engine.channel import connect
from server.engine.messages import Abort, Ask, Done, Submit, decode_from_engine
from server.engine.remote import RemoteClient
from server.errors import NoRoom, Refusal, ScoringError, Transient
from server.scoring.pipeline import Pipeline
from server.settings import Settings
from tests.server.conftest import engine_process_in_this_one, raw_request
from tests.server.engine.test_channel import reading
from tests.server.test_split import wait_until as wait_for

PIXELS = np.random.default_rng(5).integers(0, 256, (96, 128, 3), dtype=np.uint8)
MiB = 2**20


def settings(**changed) -> Settings:
    return dataclasses.replace(Settings(), intra_op_threads=1, warm_up=False, **changed)


@pytest.fixture
def front(tiny_model_path):
    """A front's pipeline over an engine loop, and the engine's batcher of the tiny model."""
    chosen = settings(queue_depth=4)
    with engine_process_in_this_one([tiny_model_path], chosen) as client:
        pipeline = Pipeline([tiny_model_path], settings=chosen, engine=client)
        batcher = client.engine_loop.core.served("tiny").batcher
        try:
            yield pipeline, client, batcher
        finally:
            pipeline.close()


def held(batcher) -> tuple[threading.Event, threading.Event]:
    """Make the engine's batches wait for the first event; the second is set once one has started."""
    gate, entered, run = threading.Event(), threading.Event(), batcher._run

    def waiting(works):
        entered.set()
        gate.wait(30)
        return run(works)

    batcher._run = waiting
    return gate, entered


def calls_refused_into(pipeline, refusals: list, *scales: list[int]) -> list[threading.Thread]:
    """A thread per request (of these scales) through `pipeline`, each adding its refusal, if any, to `refusals`."""
    def call(scales: list[int]) -> None:
        try:
            pipeline.score(raw_request(PIXELS, scales=scales))
        except ScoringError as error:
            refusals.append(error.refusal)

    return [threading.Thread(target=call, args=(each,), daemon=True) for each in scales]


def one_running(pipeline, batcher) -> tuple[threading.Event, threading.Thread, list]:
    """A request whose item runs in the engine, held until the gate is set; its thread, and where its refusal
    goes."""
    gate, entered = held(batcher)
    refusals = []
    (call,) = calls_refused_into(pipeline, refusals, [96])
    call.start()
    assert entered.wait(30)
    return gate, call, refusals


def one_running_one_queued(pipeline, batcher) -> tuple[threading.Event, list[threading.Thread], list]:
    """Two requests: the first's item running in the engine (held until the gate is set), the second's two items
    queued behind it; their threads, and where their refusals go."""
    gate, first, refusals = one_running(pipeline, batcher)
    (second,) = calls_refused_into(pipeline, refusals, [96, 128])
    second.start()
    assert wait_for(lambda: batcher.depth() == 2)
    return gate, [first, second], refusals


def test_answers_cross_as_in_one_process(tiny_model_path, front):
    pipeline, _client, _batcher = front
    alone = Pipeline([tiny_model_path], settings=settings())
    try:
        for fields in (dict(scales=[96, 128], flip=True, return_maps=True), dict(scales=[2560], return_maps=True,
                                                                                 classes=[3])):
            here, there = alone.score(raw_request(PIXELS, **fields)), pipeline.score(raw_request(PIXELS, **fields))
            assert [p.index for p in there.top_k] == [p.index for p in here.top_k]
            for one, other in zip(here.maps, there.maps):
                assert one.scores.data == other.scores.data
    finally:
        alone.close()


def test_a_region_too_small_sends_the_canvas_inline_with_the_same_answer(tiny_model_path):
    """A front whose shared memory holds no canvas sends each through the socket: slower, never wrong."""
    chosen = settings(front_shm_bytes=4096)
    with engine_process_in_this_one([tiny_model_path], chosen) as client:
        pipeline = Pipeline([tiny_model_path], settings=chosen, engine=client)
        alone = Pipeline([tiny_model_path], settings=settings())
        try:
            request = raw_request(PIXELS, scales=[128], return_maps=True)
            assert pipeline.score(request).maps[0].scores.data == alone.score(request).maps[0].scores.data
            assert client.allocator.used_bytes == 0  # given back
        finally:
            pipeline.close()
            alone.close()


def test_a_front_counts_the_places_it_holds_and_refuses_with_the_queue_s_numbers(front):
    """Admission in a front needs no round trip: its own requests still decoding count against the queue."""
    pipeline, client, batcher = front
    places = client.reserve("tiny", 3, deadline=None)
    assert places.items == 3 and batcher.depth() == 0  # held here, not in the engine
    refused = client.reserve("tiny", 2, deadline=None)
    assert isinstance(refused, NoRoom) and refused.why is Transient.QUEUE_FULL
    assert (refused.waiting, refused.adding, refused.depth) == (3, 2, 4)
    with pytest.raises(ScoringError, match=r"queue full: 3 items waiting or decoding, this request adds 2, the limit "
                                           r"is 4 \(--queue-depth\)") as caught:
        pipeline.score(raw_request(PIXELS, scales=[96, 128]))
    assert caught.value.refusal is Refusal.RESOURCE_EXHAUSTED and caught.value.retry_after_seconds
    client.release("tiny", places)
    assert pipeline.score(raw_request(PIXELS, scales=[96, 128])).top_k


def test_a_lone_call_runs_on_the_input_thread_that_read_it_while_the_other_reads_on(front):
    """No runner is woken for a batch a free runner would take at once; the front's next calls are read and
    queued meanwhile, and run on a runner once the place is free."""
    pipeline, client, batcher = front
    threads, run = [], batcher._run
    batcher._run = lambda works: threads.append(threading.current_thread().name) or run(works)
    gate, first, refusals = one_running(pipeline, batcher)  # its batch is held where it runs
    (second,) = calls_refused_into(pipeline, refusals, [96, 128])
    second.start()
    assert wait_for(lambda: batcher.depth() == 2)  # read, and queued, while the first call runs
    client._ask("tiny", deadline=time.monotonic() + 10)  # and the front's ask is answered meanwhile
    gate.set()
    for thread in (first, second):
        thread.join(30)
    assert refusals == [] and threads == ["engine-input", "batcher-tiny", "batcher-tiny"]


def test_a_front_claims_one_batch_at_a_time_so_one_of_its_input_threads_is_always_free(tiny_model_path):
    """With two runners a second call would find a place free too: it goes to a runner, not the other input
    thread, which stays free to read the front's messages."""
    chosen = settings(queue_depth=4, cpu_runners=2)
    with engine_process_in_this_one([tiny_model_path], chosen) as client:
        pipeline = Pipeline([tiny_model_path], settings=chosen, engine=client)
        batcher = client.engine_loop.core.served("tiny").batcher
        gate, threads, run = threading.Event(), [], batcher._run

        def held_run(works):
            threads.append(threading.current_thread().name)
            gate.wait(30)
            return run(works)

        batcher._run = held_run
        try:
            refusals = []
            first, second = calls_refused_into(pipeline, refusals, [96], [128])
            first.start()
            assert wait_for(lambda: len(threads) == 1)
            second.start()
            assert wait_for(lambda: len(threads) == 2)
            assert threads[0] == "engine-input" and threads[1].startswith("batcher-tiny")
            client._ask("tiny", deadline=time.monotonic() + 10)  # answered while both batches run
            gate.set()
            for call in (first, second):
                call.join(30)
            assert refusals == []
        finally:
            gate.set()
            pipeline.close()


def test_the_engine_refuses_items_it_has_no_room_for_when_they_arrive(front):
    """Another front may fill the queue after this one heard its state: the engine's own check refuses the items,
    with the queue's numbers, and the front then refuses on what it heard, until that is old and asked again."""
    pipeline, client, batcher = front
    others = batcher.reserve(4, deadline=None)  # as another front's items would
    with pytest.raises(ScoringError, match=r"queue full: 4 items waiting or decoding, this request adds 1, the limit "
                                           r"is 4 \(--queue-depth\)") as caught:
        pipeline.score(raw_request(PIXELS, scales=[96]))
    assert caught.value.refusal is Refusal.RESOURCE_EXHAUSTED and caught.value.retry_after_seconds
    refused = client.reserve("tiny", 1, deadline=None)
    assert isinstance(refused, NoRoom) and refused.waiting == 4  # the state its refusal brought
    batcher.release(others)
    time.sleep(0.2)  # the refusing state grows old: the front asks the engine again
    places = client.reserve("tiny", 1, deadline=None)
    assert not isinstance(places, NoRoom)
    client.release("tiny", places)
    assert pipeline.score(raw_request(PIXELS, scales=[96])).top_k


def test_a_state_the_engine_read_before_this_front_s_items_came_still_counts_them(front, monkeypatch):
    """An answer's queue state is read when its item ends, and may come after this front sent more items: those
    the engine had not acted on when it read the state stay counted, so the front refuses what the engine would."""
    pipeline, client, batcher = front
    handle, done_came, go_on = client._handle, threading.Event(), threading.Event()

    def first_done_held(message) -> None:
        if isinstance(message, Done) and not done_came.is_set():
            done_came.set()
            go_on.wait(30)
        handle(message)

    monkeypatch.setattr(client, "_handle", first_done_held)
    first_gate, first_entered = held(batcher)
    first = threading.Thread(target=pipeline.score, args=(raw_request(PIXELS, scales=[96]),))
    first.start()
    assert first_entered.wait(30)
    second_gate, second_entered = held(batcher)
    first_gate.set()
    assert done_came.wait(30)  # its Done says the queue was empty; this front has not heard it yet
    second = threading.Thread(target=pipeline.score, args=(raw_request(PIXELS, scales=[96, 128]),))
    second.start()
    try:
        assert second_entered.wait(30) and wait_for(lambda: batcher.depth() == 1)  # one item runs, one waits
        go_on.set()
        assert wait_for(lambda: not first.is_alive())  # the old state heard
        refused = client.reserve("tiny", 4, deadline=None)  # 1 waiting + 4 > 4 in the engine
        assert isinstance(refused, NoRoom) and refused.why is Transient.QUEUE_FULL
    finally:
        go_on.set()
        second_gate.set()
        second.join(30)


def test_a_submit_the_engine_could_not_read_counts_against_the_queue_only_while_its_call_waits(front, monkeypatch):
    """A front counts the items it sent that no state holds yet; one the engine dropped unread (a bug's doing) is
    counted no longer than its call waits, so it never keeps the front refusing."""
    pipeline, client, batcher = front
    readable, dropped = messages_module._TO_ENGINE, []

    class FirstSubmitUnread:
        @staticmethod
        def decode(data):
            message = readable.decode(data)
            if isinstance(message, Submit) and not dropped:
                dropped.append(message.call)
                raise ValueError("unreadable")
            return message

    monkeypatch.setattr(messages_module, "_TO_ENGINE", FirstSubmitUnread)  # read at each decode, by either thread
    with pytest.raises(ScoringError) as caught:
        pipeline.score(raw_request(PIXELS, scales=[96]), deadline=time.monotonic() + 0.5)
    assert dropped and caught.value.refusal is Refusal.DEADLINE_EXCEEDED
    places = client.reserve("tiny", 4, deadline=None)  # the queue is empty: a full request has room
    assert not isinstance(places, NoRoom), places
    client.release("tiny", places)


def test_a_cancelled_call_frees_its_items_in_the_engine(front):
    pipeline, client, batcher = front
    gate, entered = held(batcher)
    first = threading.Thread(target=pipeline.score, args=(raw_request(PIXELS, scales=[96]),))
    first.start()
    assert entered.wait(30)  # the engine's runner is busy with it
    cancelled, outcome = threading.Event(), {}

    def call() -> None:
        try:
            pipeline.score(raw_request(PIXELS, scales=[96, 128]), cancelled=cancelled)
        except ScoringError as error:
            outcome["error"] = error

    second = threading.Thread(target=call)
    second.start()
    assert wait_for(lambda: batcher.depth() == 2)  # both its items queued in the engine
    cancelled.set()
    second.join(30)
    assert outcome["error"].refusal is Refusal.CANCELLED
    assert wait_for(lambda: batcher.depth() == 0)  # the engine dropped them before running them
    assert client.allocator.used_bytes > 0  # the first call's canvas, still running
    gate.set()
    first.join(30)
    assert wait_for(lambda: client.allocator.used_bytes == 0)  # the engine acknowledged the end: nothing kept


@pytest.mark.parametrize("ended_by", ["cancelling it", "its front going"])
def test_the_engine_tells_its_arena_it_is_idle_however_its_last_call_ended(front, ended_by):
    """The CPU arena gives back what a burst took only once told the engine holds no call: an aborted last call, or
    one whose front went, tells it as an answered one does, and so does the end of a run still going for it."""
    pipeline, client, batcher = front
    told = threading.Event()
    client.engine_loop._on_idle = told.set
    gate, entered = held(batcher)
    cancelled = threading.Event()
    calling = threading.Thread(target=lambda: pytest.raises(ScoringError, pipeline.score,
                                                            raw_request(PIXELS, scales=[96]), cancelled=cancelled))
    calling.start()
    assert entered.wait(30)  # its item runs in the engine, held
    if ended_by == "cancelling it":
        cancelled.set()
    else:
        client.close()  # as a killed front's socket closes
    calling.join(30)
    assert told.wait(10), f"the engine did not say it was idle after {ended_by}"
    told.clear()
    gate.set()
    assert told.wait(10), "the engine did not say it was idle after the ended call's run"


def test_an_expired_item_is_dropped_by_the_engine_before_it_runs(front):
    pipeline, _client, batcher = front
    gate, entered = held(batcher)
    first = threading.Thread(target=pipeline.score, args=(raw_request(PIXELS, scales=[96]),))
    first.start()
    assert entered.wait(30)
    with pytest.raises(ScoringError) as caught:
        pipeline.score(raw_request(PIXELS, scales=[128]), deadline=time.monotonic() + 0.5)
    assert caught.value.refusal in (Refusal.DEADLINE_EXCEEDED, Refusal.RESOURCE_EXHAUSTED)
    gate.set()
    first.join(30)
    assert wait_for(lambda: batcher.depth() == 0)
    ran = []
    run = batcher._run
    batcher._run = lambda works: ran.append(len(works)) or run(works)
    assert pipeline.score(raw_request(PIXELS, scales=[96])).top_k
    assert ran == [1]  # the expired item never ran


def test_an_item_whose_deadline_passes_in_the_queue_counts_as_dropped_once_as_in_one_process(front):
    """The front sees the deadline pass and ends the call; the engine counts the item it takes out of the queue."""
    pipeline, client, batcher = front
    gate, first, _refusals = one_running(pipeline, batcher)
    with pytest.raises(ScoringError) as caught:
        pipeline.score(raw_request(PIXELS, scales=[128]), deadline=time.monotonic() + 0.5)
    assert caught.value.refusal is Refusal.DEADLINE_EXCEEDED
    assert wait_for(lambda: batcher.depth() == 0)
    gate.set()
    first.join(30)
    dropped = client.engine_metrics.registry.get_sample_value("scoremap_dropped_total",
                                                              {"model": "tiny", "reason": "deadline"})
    assert dropped == 1


def test_a_front_that_goes_away_frees_what_it_held(front):
    pipeline, client, batcher = front
    gate, calls, refusals = one_running_one_queued(pipeline, batcher)
    client.close()  # as a killed front's socket closes
    # Its queued items go at once, while the batch an input thread claimed for it still runs (held for 30 s).
    assert wait_for(lambda: batcher.depth() == 0, seconds=10)
    gate.set()
    for thread in calls:
        thread.join(30)
    assert refusals == [Refusal.UNAVAILABLE] * 2  # this front's calls end with it


def test_a_connection_that_does_not_say_which_front_it_is_is_closed(front):
    _pipeline, client, _batcher = front
    stranger = connect(client.engine_loop.address)
    assert stranger.send(Abort(1))  # not a Hello
    assert reading(stranger, decode_from_engine).wait(10), \
        "the engine kept a connection that never said which front it is"


def test_a_front_started_again_keeps_its_calls_when_the_old_connection_ends(tiny_model_path, front):
    _pipeline, client, batcher = front
    gate, entered = held(batcher)
    chosen = settings(queue_depth=4)
    again = RemoteClient(front=client.front, engine_address=client.engine_loop.address,
                         region_name=f"{client.region.name}-again", region_bytes=chosen.front_shm_bytes)
    answers = []
    try:
        assert again.wait_for_engine(30)
        second = Pipeline([tiny_model_path], settings=chosen, engine=again)
        calling = threading.Thread(target=lambda: answers.append(second.score(raw_request(PIXELS, scales=[96]))))
        calling.start()
        assert entered.wait(30)  # its item runs in the engine
        client.close()  # the old front's connection ends, as when the front it was is replaced
        time.sleep(0.2)  # the engine has heard it go
        gate.set()
        calling.join(30)
        assert len(answers) == 1 and answers[0].top_k
        second.close()
    finally:
        gate.set()
        again.close()


def test_a_call_opened_before_the_engine_went_is_never_sent_to_the_next(front):
    """A call failed when its connection ended is not sent on the next one: the engine would write its lattice into
    memory the front has given to another request."""
    _pipeline, client, _batcher = front
    call, pending = client._open("tiny")
    old = client._channel
    old.close()  # as the engine going: the front connects again (to the same engine loop here)
    assert wait_for(lambda: client._channel not in (None, old) and client.ready)
    with pytest.raises(ScoringError) as refused:
        client._send(Ask(call, "tiny"), call, pending)
    assert refused.value.refusal is Refusal.UNAVAILABLE


def test_a_front_the_engine_cuts_has_its_calls_forgotten_first(front):
    """What the engine does on cutting a front (its answers unread): its calls dropped, nothing more written."""
    pipeline, client, batcher = front
    gate, calls, refusals = one_running_one_queued(pipeline, batcher)
    (engine_side,) = client.engine_loop._fronts
    engine_side.channel.on_cut()  # what a send that timed out runs, before the connection is shut
    assert batcher.depth() == 0 and not client.engine_loop._calls  # forgotten at once, under the loop's lock
    engine_side.channel.close()
    gate.set()
    for thread in calls:
        thread.join(30)
    assert refusals == [Refusal.UNAVAILABLE] * 2


def test_a_stop_ends_every_connection_even_one_that_never_said_hello(front):
    _pipeline, client, _batcher = front
    stranger = connect(client.engine_loop.address)  # connected, silent
    assert wait_for(lambda: len(client.engine_loop._channels) == 2)
    started = time.monotonic()
    client.engine_loop.stop()
    assert time.monotonic() - started < 2, "a stop waited for a connection's input thread to time out"
    assert not [thread for thread in client.engine_loop._threads if thread.is_alive()]
    stranger.close()


@pytest.mark.parametrize("cut_here", [True, False])
def test_arrays_of_calls_in_flight_are_reused_only_when_the_engine_ended_the_connection(front, cut_here):
    """A connection the engine ended (its process gone, or it cut the front after forgetting its calls) writes
    nothing more; one this front cut (a write the engine took nothing of) may still be written by a live engine."""
    pipeline, client, batcher = front
    gate, calling, refusals = one_running(pipeline, batcher)
    assert client.allocator.used_bytes > 0  # its canvas in the region
    channel = client._channel
    channel.cut = cut_here  # as a send that timed out leaves it, or not
    channel.close()
    calling.join(30)
    gate.set()
    assert refusals == [Refusal.UNAVAILABLE]
    assert (client.allocator.used_bytes > 0) is cut_here


def test_the_engine_drains_until_its_fronts_have_gone(front):
    """A stop that reaches every process at once (the supervisor died): a front still decoding may yet send items."""
    _pipeline, client, _batcher = front
    assert not client.engine_loop.drain(0.3)  # no call held, but a front is still there
    client.close()
    started = time.monotonic()
    assert client.engine_loop.drain(10)
    assert time.monotonic() - started < 2


def test_a_front_cut_while_its_call_is_being_queued_has_that_call_s_items_dropped(front):
    """A runner's send may cut a front (running `on_cut`) between the moment the front's input thread holds a new
    call and the moment it knows that call's queued items: those items are dropped too, not run for no one."""
    pipeline, client, batcher = front
    gate, entered = held(batcher)
    refusals = []
    first, second = calls_refused_into(pipeline, refusals, [96], [96, 128])
    first.start()
    assert entered.wait(30)  # the engine's runner is busy: the next call's items stay queued
    loop = client.engine_loop
    (engine_side,) = loop._fronts
    offer = loop.core.offer

    def offer_then_cut(*args, **kwargs):
        works = offer(*args, **kwargs)
        engine_side.channel.on_cut()  # as a runner's timed-out send to this front runs it, on its own thread
        return works

    loop.core.offer = offer_then_cut
    second.start()
    try:
        assert wait_for(lambda: not loop._calls and batcher.depth() == 0, 5), \
            f"{batcher.depth()} items of a call its cut front forgot stay queued"
    finally:
        engine_side.channel.close()
        gate.set()
        second.join(30)
        first.join(30)


class CancelledAsTheEngineGoes:
    """A call's cancellation that comes as the engine goes: once the call's items are queued in the engine, the next
    look at it ends the connection at the engine's end and, once the front has failed its calls, says cancelled."""

    def __init__(self, client, batcher) -> None:
        self.client, self.batcher = client, batcher

    def is_set(self) -> bool:
        if self.batcher.depth() == 0:
            return False
        (engine_side,) = self.client.engine_loop._fronts
        engine_side.channel.close()
        assert wait_for(lambda: not self.client._pending, 10)
        return True


def test_a_call_cancelled_as_the_engine_goes_waits_for_no_acknowledgement_and_keeps_no_arrays(front):
    """The engine ended the connection, so it writes nothing more for the call: its arrays are reused, and the call
    does not wait for an acknowledgement that cannot come."""
    pipeline, client, batcher = front
    gate, first, _refusals = one_running(pipeline, batcher)
    started = time.monotonic()
    with pytest.raises(ScoringError):
        pipeline.score(raw_request(PIXELS, scales=[128]), cancelled=CancelledAsTheEngineGoes(client, batcher))
    ended = time.monotonic() - started
    gate.set()
    first.join(30)
    assert client.allocator.used_bytes == 0, "arrays of a call the engine can no longer write were kept"
    assert ended < 0.9, f"the call waited {ended:.1f} s for an acknowledgement from a connection already ended"


def test_a_front_that_cannot_connect_for_a_moment_tries_again(tiny_model_path, monkeypatch):
    """A connection refused for another reason than a missing engine (its backlog full: EAGAIN) is tried again, as a
    missing engine is: the front is not left refusing every call for good."""
    from server.engine import remote

    failures = [BlockingIOError(11, "Resource temporarily unavailable")] * 3
    real = remote.connect

    def connect(path: str):
        if failures:
            raise failures.pop()
        return real(path)

    monkeypatch.setattr(remote, "connect", connect)
    with engine_process_in_this_one([tiny_model_path], settings()) as client:
        assert not failures and client.ready


def test_a_call_whose_answers_all_came_is_not_failed_by_the_connection_ending_just_after(front, monkeypatch):
    """The engine answers a call's last item, then its connection ends (its process gone) before the call's thread
    wakes: the call has every answer, and the engine writes nothing more for it, so it returns them."""
    from server.engine import remote

    pipeline, client, _batcher = front
    loop, failed_all = client.engine_loop, threading.Event()
    finished, fail_all, real_ended = loop._finished, client._fail_all, remote.ended

    def finished_then_gone(key, index, work) -> None:
        finished(key, index, work)
        key[0].channel.close()

    def failing_all(*args, **kwargs) -> None:
        fail_all(*args, **kwargs)
        failed_all.set()

    def ended_once_the_connection_ended(done, deadline) -> bool:  # the call's thread wakes late
        if not real_ended(done, deadline):
            return False
        assert failed_all.wait(10), "the connection never ended"
        return True

    loop._finished, client._fail_all = finished_then_gone, failing_all
    monkeypatch.setattr(remote, "ended", ended_once_the_connection_ended)
    answer = pipeline.score(raw_request(PIXELS, scales=[96], return_maps=True))
    assert answer.maps and client.allocator.used_bytes == 0


def test_a_call_whose_answer_the_engine_fails_to_make_is_refused_not_left_waiting(front, monkeypatch):
    """A bug in making one item's answer (here: its lattice cannot be written) ends the call with INTERNAL; a call
    with no deadline would otherwise wait for good."""
    pipeline, client, _batcher = front
    loop = client.engine_loop

    def failing(*args):
        raise ValueError("a lattice that cannot be written")

    monkeypatch.setattr(loop, "_done", failing)
    refusals = []
    (calling,) = calls_refused_into(pipeline, refusals, [96])
    calling.start()
    calling.join(10)
    assert not calling.is_alive(), "the call still waits for an answer the engine failed to make"
    assert refusals == [Refusal.INTERNAL]
    assert wait_for(lambda: not loop._calls, 5)
    monkeypatch.undo()
    assert pipeline.score(raw_request(PIXELS, scales=[96])).top_k  # the engine answers the next call
