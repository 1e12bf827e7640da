"""clients/api/interrupts.py: a main thread waiting on futures still stops at once on Ctrl-C."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from clients.api.interrupts import first_done


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
    assert threading.current_thread() is threading.main_thread()
    future, test_over = Future(), threading.Event()

    def interrupt_from_another_thread() -> None:
        time.sleep(0.2)
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # delivered to this thread, not the main one
        test_over.wait(12)
        future.set_result(None)

    # Python's own Ctrl-C handler, as in a CLI: a server started earlier in this process may have installed its own.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt_from_another_thread, daemon=True).start()
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            first_done([future])
        assert time.monotonic() - started < 10
    finally:
        test_over.set()
        signal.signal(signal.SIGINT, previous)
