"""Refusals answered at a pace the server can afford (docs/design.md: the refusal pace and the resend door): the pacer's schedule, then a real
server on a loopback port, where clients resending at once are held (never beyond the bound or the deadline,
the retry hint kept) and clients that honour the hints are not.

A server that refuses every call is made without waiting on a model: a ScoreStream holds the one call a
client address may run (--max-calls-per-peer 1), or the server is put back to warming up.
"""

import collections
import contextlib
import functools
import queue
import threading
import time
from collections.abc import Callable

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from server.edges.refusal_pace import ANSWER_MARGIN_SECONDS, BURST_SECONDS, REMEMBERED_REFUSALS, RefusalPacer
from clients.api.options import as_new_work
from server.errors import RETRY_AFTER_KEY

PIXELS = np.random.default_rng(5).integers(0, 256, (64, 64, 3), dtype=np.uint8)
SLACK = 0.5  # seconds a loaded 2-core test machine may add to a call's round trip
# The door's tests score PIXELS at this size: long enough in a scoring place (several ms) that clients resending
# at once overrun two places however fast the machine. HTTP's clients take longer between their calls (httpx in
# Python threads): 16 of them make the overload 8 gRPC clients make (at 8: 1 refusal in 6 to 1 in 20, too few).
BUSY_SCALE = 384
SETTLE_SECONDS = 1.0  # clients resending at once: their first second is left out of the counts


def holds(pacer: RefusalPacer, count: int, *, deadline: float | None = None) -> list[float]:
    """The holds of `count` refusals arriving together, all held at once."""
    with contextlib.ExitStack() as stack:
        return [stack.enter_context(pacer.hold(deadline=deadline)) for _ in range(count)]


def test_a_burst_within_the_pace_is_answered_at_once_then_each_waits_its_turn_up_to_the_bound():
    pacer = RefusalPacer(per_answer=0, floor=10, max_hold=0.5, max_held=100)
    seconds = holds(pacer, 20)
    at_once = round(BURST_SECONDS * 10) + 1
    assert seconds[:at_once] == [0.0] * at_once
    turns = [0.1 * n for n in range(1, 6)] + [0.5] * (20 - at_once - 5)
    assert seconds[at_once:] == pytest.approx(turns, abs=0.02)
    assert pacer.held == 0  # every hold ended with its block


def test_beyond_max_held_a_refusal_is_answered_at_once_and_a_hold_never_outlasts_its_deadline():
    pacer = RefusalPacer(per_answer=0, floor=1, max_hold=5, max_held=2)
    with contextlib.ExitStack() as stack:
        seconds = [stack.enter_context(pacer.hold()) for _ in range(5)]
        assert pacer.held == 2
    assert seconds[:2] == [0.0, 0.0] and seconds[2] > 0 and seconds[3] > 0 and seconds[4] == 0.0
    deadline = time.monotonic() + 0.3
    (held,) = holds(pacer, 1, deadline=deadline)
    assert 0 < held <= 0.3 - ANSWER_MARGIN_SECONDS
    assert holds(RefusalPacer(per_answer=0, floor=0, max_hold=5, max_held=2), 50) == [0.0] * 50  # no pace: never held


def test_the_pace_follows_the_calls_answered_over_the_last_second_never_below_its_floor():
    """8 refusals per answer: 5 answers in the last second allow 40 refusals at once (an open loop up to
    9x capacity is never held), then each waits its turn; answers older than a second no longer count."""
    pacer = RefusalPacer(per_answer=8, floor=10, max_hold=5, max_held=1000)
    for _ in range(5):
        pacer.answered()
    seconds = holds(pacer, 50)
    at_once = round(BURST_SECONDS * 40) + 1
    assert seconds[:at_once] == [0.0] * at_once and all(s > 0 for s in seconds[at_once:])
    assert seconds[at_once:at_once + 3] == pytest.approx([1 / 40, 2 / 40, 3 / 40], abs=0.01)
    idle = RefusalPacer(per_answer=8, floor=10, max_hold=5, max_held=1000)
    idle.answered()
    time.sleep(1.05)  # that answer leaves the window: the floor, 10 a second, is the pace
    idle.answered()  # a server that never refuses keeps only the window's answers, not every answer since it started
    assert len(idle._answers) == 1
    assert holds(idle, 20).count(0.0) == round(BURST_SECONDS * 10) + 1  # 10 a second: the floor, over 8 x 1


class HeldStream:
    """A ScoreStream that sends nothing: while open it holds a call place of its client address."""

    def __init__(self, stub):
        self._outbox: queue.Queue = queue.Queue()
        self.answers = stub.ScoreStream(iter(self._outbox.get, None), timeout=60)

    def close(self):
        self._outbox.put(None)
        with contextlib.suppress(grpc.RpcError):
            list(self.answers)


@contextlib.contextmanager
def refusing(kit, model_path, **settings):
    """A real server whose every Score call from this client is refused RESOURCE_EXHAUSTED with a retry hint
    (calls busy: a stream holds the one place of 127.0.0.1)."""
    with kit.serving([model_path], max_calls_per_peer=1, **settings) as (server, port, stub):
        stream = HeldStream(stub)
        while server.front.active < 1:
            time.sleep(0.01)
        try:
            yield server, port, stub
        finally:
            stream.close()


def refused(stub, request, *, timeout: float = 30) -> tuple[float, grpc.RpcError]:
    """One call's latency in seconds and its error (the call must fail)."""
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        stub.Score(request, timeout=timeout)
    return time.monotonic() - started, caught.value


def hint_ms(error: grpc.RpcError) -> int:
    return int(dict(error.trailing_metadata())[RETRY_AFTER_KEY])


def test_a_client_resending_at_once_is_held_for_its_turn_never_beyond_the_bound(kit, tiny_model_path):
    bound = 0.6
    request = kit.raw_request(PIXELS, scales=[64])
    with refusing(kit, tiny_model_path, refusals_per_second=2, refusals_per_answer=0,
                  max_refusal_hold_ms=1000 * bound) as (server, _, stub):
        answers = [refused(stub, request) for _ in range(10)]
        for _latency, error in answers:
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-calls-per-peer" in error.details()
            assert hint_ms(error) > 0  # the hint is still there
        latencies = [latency for latency, _ in answers]
        assert max(latencies) < bound + SLACK
        assert sum(latency >= bound / 2 for latency in latencies) >= 5  # past the burst, each waited its turn
        assert server.pacer.held == 0


def test_a_client_that_honours_the_hints_is_never_held(kit, tiny_model_path):
    bound = 2.0
    request = kit.raw_request(PIXELS, scales=[64])
    with refusing(kit, tiny_model_path, refusals_per_second=2, refusals_per_answer=0,
                  max_refusal_hold_ms=1000 * bound) as (_s, _p, stub):
        for _ in range(4):
            latency, error = refused(stub, request)
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert latency < bound / 4
            time.sleep(hint_ms(error) / 1000)  # one refusal a second at most: below the pace


def test_a_held_refusal_is_answered_before_its_deadline_and_a_warming_server_paces_its_refusals(kit, tiny_model_path):
    request = kit.raw_request(PIXELS, scales=[64])
    with kit.serving([tiny_model_path], refusals_per_second=0.5, refusals_per_answer=0,
                     max_refusal_hold_ms=5000) as (server, _p, stub):
        server.front.ready.clear()  # warming up again: every Score is refused UNAVAILABLE, with a hint
        refused(stub, request)  # the pace's burst
        latency, error = refused(stub, request, timeout=0.6)  # its turn is a second away
        assert error.code() == grpc.StatusCode.UNAVAILABLE and "warming up" in error.details()
        assert hint_ms(error) > 0
        assert 0.3 < latency < 0.6  # held as long as its deadline let it, then answered in time
        server.front.ready.set()
        assert stub.Score(request, timeout=30).maps  # admitted calls are never held


def test_held_refusals_wait_on_threads_of_their_own_and_probes_are_answered(kit, tiny_model_path):
    request = kit.raw_request(PIXELS, scales=[64])
    settings = dict(refusals_per_second=0.2, refusals_per_answer=0,
                    max_refusal_hold_ms=5000, max_held_refusals=2, grpc_workers=4,
                    reserved_workers=1, max_concurrent_rpcs=2)  # the stream and the probe; the held, beyond
    with refusing(kit, tiny_model_path, **settings) as (server, port, stub):
        refused(stub, request)  # the pace's burst: the next turns are 4 s away and more
        calls = [stub.Score.future(request, timeout=30) for _ in range(4)]
        until = time.monotonic() + SLACK + 1
        while sum(call.done() for call in calls) < 2 and time.monotonic() < until:
            time.sleep(0.01)
        assert sum(call.done() for call in calls) == 2 and server.pacer.held == 2  # beyond two, answered at once
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=SLACK + 1).status == \
                health_pb2.HealthCheckResponse.SERVING
        for call in calls:
            assert call.exception(timeout=30).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert server.pacer.held == 0


def test_a_held_refusal_gives_its_scoring_place_back(kit, tiny_model_path):
    request = kit.raw_request(PIXELS, scales=[64])
    settings = dict(refusals_per_second=0.2, refusals_per_answer=0,
                    max_refusal_hold_ms=5000, grpc_workers=3, reserved_workers=1,
                    max_calls_per_peer=0)  # two places for scoring calls
    with kit.serving([tiny_model_path], **settings) as (server, _port, stub):
        server.front.ready.clear()  # every Score refused UNAVAILABLE (warming up), with a hint
        refused(stub, request)  # the pace's burst
        calls = [stub.Score.future(request, timeout=30) for _ in range(2)]
        while server.pacer.held < 2:
            time.sleep(0.01)
        _latency, error = refused(stub, request, timeout=1)  # both places are free again: the servicer answers
        assert error.code() == grpc.StatusCode.UNAVAILABLE and "warming up" in error.details()
        for call in calls:
            assert call.exception(timeout=30).code() == grpc.StatusCode.UNAVAILABLE


def test_the_http_edge_answers_transient_refusals_at_the_same_pace(kit, tiny_model_path):
    """One pacer per server: a curl loop that resends at once is held on the HTTP port as on gRPC's."""
    import httpx

    bound = 0.6
    with kit.serving([tiny_model_path], http_port=0, refusals_per_second=2, refusals_per_answer=0,
                     max_refusal_hold_ms=1000 * bound) as (server, _port, _stub):
        server.front.ready.clear()  # warming up again: every score is refused 503, with a Retry-After
        url = f"http://127.0.0.1:{server.http.port}/v1/models/{server.pipeline.models()[0].name}/score"
        latencies = []
        with httpx.Client(timeout=30) as client:
            for _ in range(8):
                started = time.monotonic()
                answer = client.post(url, files={"image": ("x.png", b"\x89PNG\r\n\x1a\n", "image/png")})
                latencies.append(time.monotonic() - started)
                assert answer.status_code == 503 and answer.headers["Retry-After"]
        assert max(latencies) < bound + SLACK
        assert sum(latency >= bound / 2 for latency in latencies) >= 4  # past the burst, each waited its turn
        assert server.pacer.held == 0


def test_calls_answered_on_either_edge_raise_the_pace_so_an_open_loop_is_refused_at_once(kit, tiny_model_path):
    """Three calls answered (one over HTTP, two over gRPC) at 8 refusals per answer allow 24 refusals a second:
    ten refusals right after them are answered at once, where the floor alone (0.5 a second) holds all but
    the first."""
    import io

    import httpx
    from PIL import Image

    bound = 2.0
    png = io.BytesIO()
    Image.fromarray(PIXELS).save(png, format="PNG")
    request = kit.raw_request(PIXELS, scales=[64])
    with kit.serving([tiny_model_path], http_port=0, refusals_per_second=0.5, refusals_per_answer=8,
                     max_refusal_hold_ms=1000 * bound) as (server, _port, stub):
        url = f"http://127.0.0.1:{server.http.port}/v1/models/{server.pipeline.models()[0].name}/score"
        with httpx.Client(timeout=30) as client:
            assert client.post(url, files={"image": ("x.png", png.getvalue(), "image/png")}).status_code == 200
        stub.Score(request, timeout=30)
        stub.Score(request, timeout=30)
        assert server.pacer.pace(time.monotonic()) == 8 * 3  # each edge counted its answers
        server.front.ready.clear()  # warming up again: every score is refused, with a retry hint
        arrivals = [as_new_work(request, n) for n in range(10)]  # new work each, not resends
        answers = [refused(stub, arrival) for arrival in arrivals]
        assert all(error.code() == grpc.StatusCode.UNAVAILABLE for _, error in answers)
        assert max(latency for latency, _ in answers) < bound / 2


def test_a_resend_waits_at_the_door_until_a_call_frees_a_place_the_oldest_first():
    pacer = RefusalPacer(per_answer=0, floor=100, max_hold=2, max_held=10, resend_memory=10)
    answer(pacer)  # the server is answering
    for key in ("a", "b"):
        assert holds_keyed(pacer, key) == 0.0  # refused at once, within the pace, and remembered
    woken = []
    with (pacer.door("a", wake=lambda: woken.append("a")) as a, pacer.door("b", wake=lambda: woken.append("b")) as b,
          pacer.door("new", wake=lambda: woken.append("new")) as new):
        assert (a, b, new) == (2, 2, 0.0) and pacer.held == 2  # a request not refused before goes straight on
        answer(pacer)
        assert woken == ["a"]
        pacer.answered()  # an answer alone (a probe, a call that took no place) frees no place
        assert woken == ["a"]
        pacer.freed()  # a call that failed gives its place back too
        answer(pacer)  # no one left waiting: a place free for the next resend
        assert woken == ["a", "b"]
    assert pacer.held == 0
    with pacer.door("a", wake=lambda: None) as seconds:
        assert seconds == 0.0  # it takes the place freed while no one waited (else no answer might wake it)
    found = time.monotonic()
    answer(pacer)  # a place freed after a refusal was found, before the refusal gets to the pacer
    with pacer.hold("b", decided=found):
        pass
    with pacer.door("a", wake=lambda: None) as seconds:
        assert seconds == 0.0  # that refusal is no evidence against the place freed after it
    holds_keyed(pacer, "b")  # a refusal found now: no place is free
    deadline = time.monotonic() + 0.3
    with pacer.door("a", wake=lambda: None, deadline=deadline) as seconds:
        assert 0 < seconds <= 0.3 - ANSWER_MARGIN_SECONDS  # never past the call's deadline
    full = RefusalPacer(per_answer=0, floor=100, max_hold=2, max_held=1, resend_memory=10)
    answer(full)
    holds_keyed(full, "a")
    with full.door("a", wake=lambda: None) as first, full.door("a", wake=lambda: None) as second:
        assert (first, second) == (2, 0.0)  # beyond max_held no thread to hold it on: it goes on


def test_the_door_is_open_unless_the_server_is_refusing_and_answering_and_it_forgets():
    def door(pacer, key="a"):
        with pacer.door(key, wake=lambda: None) as seconds:
            return seconds

    silent = RefusalPacer(per_answer=0, floor=100, max_hold=2, max_held=10, resend_memory=10)
    holds_keyed(silent, "a")
    assert door(silent) == 0.0  # no answer in the last second: nothing would wake it
    answer(silent)
    holds_keyed(silent, "a")  # refused again: no place free
    assert door(silent) == 2
    time.sleep(1.05)  # the refusal is over a second old: the server is not refusing now
    answer(silent)
    assert not silent.refusing and door(silent) == 0.0
    off = RefusalPacer(per_answer=0, floor=100, max_hold=2, max_held=10, resend_memory=0)
    answer(off)
    holds_keyed(off, "a")
    assert door(off) == 0.0  # --resend-memory-seconds 0: no door
    brief = RefusalPacer(per_answer=0, floor=10_000, max_hold=2, max_held=10, resend_memory=0.2)  # none held
    answer(brief)
    holds_keyed(brief, "a")
    time.sleep(0.25)
    holds_keyed(brief, "b")
    assert door(brief, "a") == 0.0 and door(brief, "b") == 2  # "a" is forgotten after resend_memory
    for n in range(REMEMBERED_REFUSALS + 1):
        holds_keyed(brief, n)
    assert door(brief, 0) == 0.0 and door(brief, REMEMBERED_REFUSALS) == 2  # the oldest key forgotten first


def test_copies_sent_before_the_first_refusal_of_their_run_was_answered_are_no_resends():
    """Copies of one request sent together (a burst) go on and are refused at once, with their retry hint, until the
    first refusal's hint has passed; a copy sent after that is a resend, and waits at the door; a request refused
    again once the door has forgotten it starts again."""
    def door(pacer, started, key="a"):
        with pacer.door(key, wake=lambda: None, started=started) as seconds:
            return seconds

    pacer = RefusalPacer(per_answer=0, floor=100, max_hold=2, max_held=10, resend_memory=10)
    answer(pacer)
    sent = time.monotonic()  # the burst's copies reach the server together
    holds_keyed(pacer, "a")  # the first copy refused, answered at once
    assert door(pacer, sent) == 0.0  # the others were sent before that answer: they go on, to be refused at once
    holds_keyed(pacer, "a")  # refused again: its first answer is the one that counts
    assert door(pacer, sent) == 0.0
    assert door(pacer, time.monotonic()) == 2  # a copy sent after an answer: a resend, held at the door
    assert door(pacer, None) == 2  # a call whose arrival the edge does not know: taken to come now, a resend
    hinted = RefusalPacer(per_answer=0, floor=100, max_hold=2, max_held=10, resend_memory=10)
    answer(hinted)
    with hinted.hold("a", retry_after=0.3):
        pass
    assert door(hinted, time.monotonic()) == 0.0  # within the first refusal's hint: still taken for the burst
    with hinted.hold("a", retry_after=5):
        pass  # a later refusal's hint changes nothing
    time.sleep(0.35)
    assert door(hinted, time.monotonic()) == 2  # past it: a resend
    later = RefusalPacer(per_answer=0, floor=100, max_hold=2, max_held=10, resend_memory=0.2)
    answer(later)
    holds_keyed(later, "a")
    time.sleep(0.25)  # longer than the door remembers
    answer(later)
    sent = time.monotonic()  # a new burst of the same request
    holds_keyed(later, "a")  # refused again: remembered anew, answered now
    assert door(later, sent) == 0.0  # sent before this refusal's answer: no resend of the forgotten one
    assert door(later, time.monotonic()) == 2


def answer(pacer: RefusalPacer) -> None:
    """A call answered OK, its place given back."""
    pacer.answered()
    pacer.freed()


def holds_keyed(pacer: RefusalPacer, key) -> float:
    """One refusal of the request `key`, its hold ended at once."""
    with pacer.hold(key) as seconds:
        return seconds


def test_clients_resending_at_once_wait_at_the_door_instead_of_being_refused_again(kit, tiny_model_path):
    """8 clients resend one request at once, whatever the answer, to a server with two scoring places. Without
    the door (--resend-memory-seconds 0) most of their calls are refusals; at the door they wait for room."""
    request = kit.raw_request(PIXELS, scales=[BUSY_SCALE])

    def send(stub) -> str:
        try:
            stub.Score(request, timeout=30)
            return "OK"
        except grpc.RpcError as error:
            return error.code().name

    counts = {}
    for memory in (10, 0):
        with kit.serving([tiny_model_path], resend_memory_seconds=memory, **TWO_PLACES) as (server, _port, stub):
            counts[memory] = resend_at_once(functools.partial(send, stub), clients=8, seconds=2)
            assert server.pacer.held == 0
    assert_door_kept_refusals_down(at_door=counts[10], without=counts[0], refused="RESOURCE_EXHAUSTED", ok="OK")


def test_http_clients_resending_one_body_wait_at_the_door_too(kit, tiny_model_path):
    """As above over HTTP, with 16 clients: the same body to the same URL again is a resend (read once, at the
    door)."""
    import io

    import httpx
    from PIL import Image

    png = io.BytesIO()
    Image.fromarray(PIXELS).save(png, format="PNG")
    counts = {}
    for memory in (10, 0):
        with kit.serving([tiny_model_path], http_port=0, resend_memory_seconds=memory, **TWO_PLACES) as (server, _, _s):
            model = server.pipeline.models()[0].name
            url = f"http://127.0.0.1:{server.http.port}/v1/models/{model}/score?scales={BUSY_SCALE}"
            with httpx.Client(timeout=30, limits=httpx.Limits(max_connections=16)) as client:
                def send() -> str:
                    return str(client.post(url, content=png.getvalue(), headers={"content-type": "image/png"})
                               .status_code)

                counts[memory] = resend_at_once(send, clients=16, seconds=2)
            assert server.pacer.held == 0
    assert_door_kept_refusals_down(at_door=counts[10], without=counts[0], refused="429", ok="200")


# Two scoring places; refusals unpaced, so what the door does is all that differs.
TWO_PLACES = dict(grpc_workers=4, reserved_workers=2, max_calls_per_peer=0, max_refusal_hold_ms=2000,
                  refusals_per_second=0, refusals_per_answer=0)


def assert_door_kept_refusals_down(*, at_door: collections.Counter, without: collections.Counter, refused: str,
                                   ok: str) -> None:
    assert without[refused] > without[ok] / 10, without  # the test makes the overload it means to
    assert at_door[refused] < at_door[ok] / 20, at_door  # (measured: 1 in 100 or fewer)
    assert at_door[refused] < without[refused] / 5, (at_door, without)  # (without the door: 1 in 3 to 2 in 3)
    assert at_door[ok] > without[ok] / 2, (at_door, without)  # the waits cost no throughput (measured: 20% more)
    assert set(at_door) <= {ok, refused}, at_door


def resend_at_once(send: Callable[[], str], *, clients: int, seconds: float) -> collections.Counter:
    """Answers by status of `clients` threads calling `send` again as soon as each call ends, counting the
    calls sent after the first SETTLE_SECONDS (before the first answers no resend can be told apart)."""
    statuses: collections.Counter = collections.Counter()
    started = time.monotonic()
    lock = threading.Lock()

    def caller():
        while (sent := time.monotonic()) < started + SETTLE_SECONDS + seconds:
            status = send()
            if sent >= started + SETTLE_SECONDS:
                with lock:
                    statuses[status] += 1

    threads = [threading.Thread(target=caller) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return statuses


def test_over_http_a_copy_sent_before_its_request_was_first_refused_goes_on_and_a_resend_waits(kit, tiny_model_path):
    """Over a real HTTP port, where the server knows when a request's head came: copy B's head is sent, then copy A
    of the same body is refused, then B's body follows. B was sent before any refusal of its request was answered, so
    it is refused at once, with its Retry-After, though nothing frees a place (at the door it would wait the whole
    hold, 60 s, beyond this test's socket timeout). Copy C, sent once A's retry hint has passed, is a resend: it waits
    at the door until a call gives back its place."""
    import io
    import socket

    import httpx
    from PIL import Image

    png = io.BytesIO()
    Image.fromarray(PIXELS).save(png, format="PNG")
    body = png.getvalue()
    with kit.serving([tiny_model_path], http_port=0, refusals_per_second=0, refusals_per_answer=0,
                     max_refusal_hold_ms=60_000) as (server, _port, _stub):
        model = server.pipeline.models()[0].name
        base = f"http://127.0.0.1:{server.http.port}"
        path = f"/v1/models/{model}/score?scales=64"
        server.front.ready.clear()  # warming up again: every score is refused 503 with a Retry-After, a transient refusal
        with httpx.Client(base_url=base, timeout=30) as client, \
                socket.create_connection(("127.0.0.1", server.http.port), timeout=20) as copy_b:
            assert client.get("/v1/models").status_code == 200  # the server is answering
            other = client.post(path, content=body + b"\0", headers={"content-type": "image/png"})
            assert other.status_code == 503 and server.pacer.refusing  # another request refused: the door is on
            copy_b.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                           f"Content-Length: {len(body)}\r\n\r\n".encode())
            while server.front.active < 1:  # B's head is read: it has reached the edge
                time.sleep(0.01)
            copy_a = client.post(path, content=body, headers={"content-type": "image/png"})
            assert copy_a.status_code == 503 and copy_a.headers["Retry-After"]
            copy_b.sendall(body)
            answered = copy_b.recv(65536).decode("latin-1")  # a socket timeout here: B waited at the door
            assert answered.startswith("HTTP/1.1 503") and "retry-after" in answered.lower(), answered[:300]
            assert server.pacer.held == 0
            time.sleep(int(copy_a.headers["Retry-After"]) + 0.1)  # A's hint passed: the next copy is a resend
            assert client.get("/v1/models").status_code == 200  # the server is still answering
            other = client.post(path, content=body + b"\0", headers={"content-type": "image/png"})
            assert other.status_code == 503  # and refusing, with no place free
            statuses: list[int] = []
            with httpx.Client(base_url=base, timeout=30) as resender:
                copy_c = threading.Thread(target=lambda: statuses.append(
                    resender.post(path, content=body, headers={"content-type": "image/png"}).status_code))
                copy_c.start()
                while server.pacer.held < 1 and copy_c.is_alive():  # C, a resend, waits at the door
                    time.sleep(0.01)
                assert server.pacer.held == 1 and not statuses
                assert client.get("/v1/models").status_code == 200  # a call gives its place back: C goes on
                copy_c.join(30)
                assert statuses == [503] and server.pacer.held == 0
