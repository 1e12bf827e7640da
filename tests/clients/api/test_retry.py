import threading
import time

import grpc
import pytest

from clients.api.errors import RETRY_AFTER_KEY, ScoremapError, from_rpc_error
from clients.api.retry import Backoff, Interrupted, Retrying, Verdict, call_with_retries, classify
from tests.signal_threads import ctrl_c_from_another_thread

FAST = Backoff(initial_s=0.001, max_s=0.002)


def failing(error: ScoremapError, calls: list):
    def attempt():
        calls.append(time.monotonic())
        raise error
    return attempt


def test_retries_are_bounded_by_time_not_by_a_count():
    calls: list[float] = []
    started = time.monotonic()
    with pytest.raises(ScoremapError) as caught:
        call_with_retries(failing(ScoremapError(grpc.StatusCode.UNAVAILABLE, "down"), calls),
                          Retrying(budget_s=0.3, backoff=FAST))
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    assert len(calls) > 20  # far more than the old max_attempts=8 ...
    assert calls[-1] - started >= 0.3 * 0.9  # ... and the last one at the end of the budget


def test_a_shorter_budget_per_verdict():
    calls: list[float] = []
    with pytest.raises(ScoremapError):
        call_with_retries(failing(ScoremapError(grpc.StatusCode.UNAVAILABLE, "down"), calls),
                          Retrying(budget_s=60, backoff=FAST,
                                   budget_for=lambda v: 0.05 if v is Verdict.RECONNECT else 60))
    assert calls[-1] - calls[0] < 30


def test_what_is_retried_is_decided_by_status_and_hint_never_by_words():
    exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
    assert classify(ScoremapError(exhausted, "queue full")) is Verdict.FINAL  # no hint: memory, message size
    assert classify(ScoremapError(exhausted, "anything", retry_after_s=0.1)) is Verdict.LATER
    assert classify(ScoremapError(grpc.StatusCode.UNAVAILABLE, "")) is Verdict.RECONNECT
    assert classify(ScoremapError(grpc.StatusCode.CANCELLED, "")) is Verdict.LATER
    assert classify(ScoremapError(grpc.StatusCode.INVALID_ARGUMENT, "")) is Verdict.FINAL
    calls: list[float] = []
    with pytest.raises(ScoremapError):
        call_with_retries(failing(ScoremapError(exhausted, "memory budget"), calls), Retrying(budget_s=5, backoff=FAST))
    assert len(calls) == 1


def test_the_servers_hint_lengthens_the_pause():
    calls: list[float] = []
    with pytest.raises(ScoremapError):
        call_with_retries(failing(ScoremapError(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", retry_after_s=0.1), calls),
                          Retrying(budget_s=0.25, backoff=FAST))
    assert 2 <= len(calls) <= 4
    assert calls[1] - calls[0] >= 0.1 * 0.9  # not the 1-2 ms of the backoff (the last pause ends at the budget)


def test_a_stop_ends_the_pause_with_interrupted():
    stop = threading.Event()
    threading.Timer(0.1, stop.set).start()
    with pytest.raises(Interrupted):
        call_with_retries(failing(ScoremapError(grpc.StatusCode.UNAVAILABLE, "down"), []),
                          Retrying(budget_s=60, backoff=Backoff(initial_s=30, max_s=30), stop=stop))


@pytest.mark.parametrize("stop", [threading.Event(), None], ids=["stoppable", "plain"])
def test_ctrl_c_handed_to_another_thread_ends_a_long_pause_at_once(stop):
    """The kernel may hand a process's SIGINT to any of its threads (gRPC's among them); Python raises
    KeyboardInterrupt in the main thread only once its wait returns, so a 30 s pause must wait in short slices."""
    started = time.monotonic()
    with ctrl_c_from_another_thread(), pytest.raises(KeyboardInterrupt):
        call_with_retries(failing(ScoremapError(grpc.StatusCode.UNAVAILABLE, "down"), []),
                          Retrying(budget_s=60, backoff=Backoff(initial_s=30, max_s=30), stop=stop))
    assert time.monotonic() - started < 10  # not the pause's 15-30 s


def test_the_hint_is_read_from_trailing_metadata():
    class Error(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.RESOURCE_EXHAUSTED

        def details(self):
            return "queue full"

        def trailing_metadata(self):
            return ((RETRY_AFTER_KEY, "250"),)

    assert from_rpc_error(Error()).retry_after_s == 0.25


def test_a_server_warming_up_is_waited_for_as_reached_not_as_unreachable():
    warming = ScoremapError(grpc.StatusCode.UNAVAILABLE, "the server is warming up", retry_after_s=1.0)
    gone = ScoremapError(grpc.StatusCode.UNAVAILABLE, "connection refused")
    assert (classify(warming), classify(gone)) == (Verdict.LATER, Verdict.RECONNECT)
