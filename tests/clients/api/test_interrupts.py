"""clients/api/interrupts.py: a main thread waiting on futures still stops at once on Ctrl-C."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from clients.api.interrupts import first_done
from tests.signal_threads import ctrl_c_from_another_thread


def test_the_first_futures_done_are_returned_as_soon_as_one_is():
    with ThreadPoolExecutor(2) as pool:
        quick, slow = pool.submit(time.sleep, 0.05), pool.submit(time.sleep, 2)
        started = time.monotonic()
        assert first_done([quick, slow]) == {quick}
        assert time.monotonic() - started < 1.5
    assert first_done([]) == set()


def test_ctrl_c_handed_to_another_thread_ends_a_wait_on_futures_at_once():
    """The kernel may hand a process's SIGINT to any of its threads; Python raises KeyboardInterrupt in the main
    thread only once its wait returns, so a wait on a future must return in slices (this one ends after 12 s, or
    when the test does: a wait in one piece would hold Ctrl-C back that long)."""
    future, test_over = Future(), threading.Event()

    def end_the_future() -> None:
        test_over.wait(12)
        future.set_result(None)

    threading.Thread(target=end_the_future, daemon=True).start()
    started = time.monotonic()
    try:
        with ctrl_c_from_another_thread(), pytest.raises(KeyboardInterrupt):
            first_done([future])
        assert time.monotonic() - started < 10
    finally:
        test_over.set()
