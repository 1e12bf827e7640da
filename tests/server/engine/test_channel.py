"""The front-to-engine connection on a real Unix socket: messages both ways, a single reader woken by messages alone,
a reader woken by a close, a listener stopped while it waits, and a send the other side never takes cutting the
connection instead of stalling."""

from __future__ import annotations

import pathlib
import signal
import socket
import threading
import time

import pytest

from server.engine import channel as channel_module
from server.engine.channel import EngineListener, connect
from server.engine.messages import Abort, Hello, Warmed, decode_from_engine, decode_to_engine, encode
from tests.server.test_split import wait_until


@pytest.fixture
def pair(tmp_path):
    """(engine side, front side) of one connection, and the listener."""
    listener = EngineListener(str(tmp_path / "engine.sock"))
    accepted = []
    accepting = threading.Thread(target=lambda: accepted.append(listener.accept()))
    accepting.start()
    front = connect(listener.path)
    accepting.join(10)
    try:
        yield accepted[0], front, listener
    finally:
        front.close()
        accepted[0].close()
        listener.close()


def reading(channel, decode) -> threading.Event:
    """Read `channel` on a thread of its own until it ends; the event is set then."""
    ended = threading.Event()

    def read() -> None:
        for _ in channel.messages(decode, reader="the test"):
            pass
        ended.set()

    threading.Thread(target=read, daemon=True).start()
    return ended


def test_messages_cross_both_ways_in_order(pair):
    engine, front, _ = pair
    assert front.send(Hello(3)) and front.send(Abort(7))
    received = engine.messages(decode_to_engine, reader="the test")
    assert next(received) == Hello(3)
    assert next(received) == Abort(7)
    large, sent = Warmed(8, ["x" * (1 << 20)]), []  # its header sent before it, not copied in front of it
    assert engine.send(Warmed(7, ["one failure"]))
    sending = threading.Thread(target=lambda: sent.append(engine.send(large)))  # read meanwhile: larger than buffers
    sending.start()
    answers = front.messages(decode_from_engine, reader="the test")
    assert next(answers) == Warmed(7, ["one failure"]) and next(answers) == large
    sending.join(5)
    assert sent == [True]


def test_a_single_reader_is_not_woken_by_the_other_side_reading_what_this_side_sent(pair):
    """A reader blocked in `recv` on a Unix stream socket is woken each time the other side reads what this side
    sent (a front's reader would wake once a request, on the engine's CPU in the middle of its work). Waiting in epoll
    for input alone, it sleeps through them and wakes for the messages."""
    engine, front, _ = pair
    got, native = [], []

    def read() -> None:
        native.append(threading.get_native_id())
        got.extend(front.messages(decode_from_engine, reader="the test"))

    threading.Thread(target=read, daemon=True).start()
    assert wait_until(lambda: native, 10)
    time.sleep(0.2)  # waiting for a message
    before = woken(native[0])
    received = engine.messages(decode_to_engine, reader="the test")
    for call in range(20):
        assert front.send(Abort(call))
        assert next(received) == Abort(call)
        time.sleep(0.005)  # the reader asleep again, were it woken
    assert woken(native[0]) - before <= 2, "the reader woke while the engine read the front's messages"
    assert engine.send(Warmed(1, []))
    assert wait_until(lambda: got == [Warmed(1, [])], 10)


def woken(thread_id: int) -> int:
    """How many times thread `thread_id` of this process went to sleep and was woken."""
    status = pathlib.Path(f"/proc/self/task/{thread_id}/status").read_text()
    return int(status.split("voluntary_ctxt_switches:")[1].split()[0])


def test_a_message_cut_short_by_a_signal_is_read_whole(pair):
    """A signal caught while a message is half there ends the reader's wait early with part of it: the reader goes on
    reading the rest (a short read taken for the whole would lose the stream's framing)."""
    engine, front, _ = pair
    data = encode(Warmed(5, ["x" * 100_000]))
    framed = len(data).to_bytes(channel_module.HEADER_BYTES, "big") + data
    received = []
    reader = threading.Thread(target=lambda: received.append(next(front.messages(decode_from_engine,
                                                                                 reader="the test"))))
    previous = signal.signal(signal.SIGUSR1, lambda *_: None)
    try:
        reader.start()
        engine._socket.sendall(framed[:50_000])
        time.sleep(0.2)  # the reader waits for the rest
        signal.pthread_kill(reader.ident, signal.SIGUSR1)
        time.sleep(0.2)
        engine._socket.sendall(framed[50_000:])
        reader.join(5)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert received == [Warmed(5, ["x" * 100_000])]


def test_a_length_no_message_has_ends_the_connection_for_every_reader(pair):
    """A broken stream (a length beyond any message) is the connection's end, not a reader thread's death: both
    readers taking turns find the end. It is cut, as a write that could not finish: this side forgets what it would
    still write for the other (`on_cut`) before the other sees the end."""
    engine, front, _ = pair
    ended, forgot = [], []
    engine.on_cut = lambda: forgot.append(front.ended)

    def take_turns() -> None:
        while engine.receive(decode_to_engine, reader="the test") is not None:
            engine.next_turn()
        ended.append(True)

    readers = [threading.Thread(target=take_turns, daemon=True) for _ in range(2)]
    for reader in readers:
        reader.start()
    front._socket.sendall((1 << 63).to_bytes(channel_module.HEADER_BYTES, "big"))
    for reader in readers:
        reader.join(5)
    assert ended == [True, True] and engine.ended
    assert forgot == [False] and engine.cut  # before the other side could read the end
    engine.release()


def test_readers_taking_turns_get_one_message_each_and_the_next_only_once_the_turn_is_passed(pair):
    """Two threads wait on one connection: a message wakes one of them, and the next wakes none until that one
    passes the turn, so messages are acted on in order; a close wakes every reader to find the end."""
    engine, front, _ = pair
    got, passed = [], threading.Event()

    def take_turns() -> None:
        while (message := engine.receive(decode_to_engine, reader="the test")) is not None:
            got.append(message)
            if len(got) == 1:
                passed.wait(10)
            engine.next_turn()

    readers = [threading.Thread(target=take_turns, daemon=True) for _ in range(2)]
    for reader in readers:
        reader.start()
    assert front.send(Abort(1)) and front.send(Abort(2))
    time.sleep(0.3)
    assert got == [Abort(1)]  # the second message waits for the turn, though a reader is free
    passed.set()
    assert wait_until(lambda: got == [Abort(1), Abort(2)])
    engine.close()
    for reader in readers:
        reader.join(10)
        assert not reader.is_alive()
    engine.release()


def test_closing_wakes_a_blocked_reader_and_the_other_side_sees_the_end(pair):
    engine, front, _ = pair
    ended = reading(engine, decode_to_engine)
    time.sleep(0.1)  # blocked in recv
    front.close()  # as a front process ending closes its socket
    assert ended.wait(5)
    assert not engine.send(Warmed(1, []))  # nothing to send to: refused, not raised


def test_a_listener_closed_while_waiting_for_a_front_ends_its_accept(tmp_path):
    listener = EngineListener(str(tmp_path / "engine.sock"))
    result = []
    waiting = threading.Thread(target=lambda: result.append(listener.accept()))
    waiting.start()
    time.sleep(0.1)
    listener.close()
    waiting.join(5)
    assert result == [None]
    assert connect(listener.path) is None  # no one listens there any more


def test_a_socket_file_left_by_a_killed_engine_is_replaced(tmp_path):
    path = str(tmp_path / "engine.sock")
    left = socket.socket(socket.AF_UNIX)
    left.bind(path)  # as a killed engine leaves it: the file stays, no one listens
    left.close()
    assert connect(path) is None
    listener = EngineListener(path)  # a new engine listens at the same path
    threading.Thread(target=listener.accept, daemon=True).start()
    front = connect(path)
    assert front is not None
    front.close()
    listener.close()


def test_a_send_the_other_side_never_takes_cuts_the_connection(pair, monkeypatch):
    monkeypatch.setattr(channel_module, "SEND_TIMEOUT_SECONDS", 0.2)
    _, other, listener = pair
    never_read = []  # held, so its end stays open
    threading.Thread(target=lambda: never_read.append(listener.accept()), daemon=True).start()
    unread = connect(listener.path)  # made with the short timeout
    gave_up = threading.Event()

    def send_until_refused() -> None:
        while unread.send(Warmed(1, ["x" * 65536])):
            pass
        gave_up.set()

    threading.Thread(target=send_until_refused, daemon=True).start()
    assert gave_up.wait(30), "a send no one takes blocked instead of cutting the connection"
    assert unread.closed
    assert other.send(Abort(0))  # other connections are untouched


def test_closing_a_channel_wakes_its_own_blocked_reader(pair):
    engine, _, _ = pair
    ended = reading(engine, decode_to_engine)
    time.sleep(0.1)  # blocked in recv
    engine.close()  # as a stop closes the connections of a process that goes on running
    assert ended.wait(1), "closing a channel left its reader blocked (the descriptor closed, the socket not shut down)"


def test_a_cut_tells_its_side_before_the_other_side_can_see_it(pair, monkeypatch):
    """The side that cuts forgets what it would still write for the other first (`on_cut`): the other side may reuse
    that memory as soon as it sees the connection end."""
    monkeypatch.setattr(channel_module, "SEND_TIMEOUT_SECONDS", 0.2)
    _, _, listener = pair
    never_read = []  # held, so its end stays open
    threading.Thread(target=lambda: never_read.append(listener.accept()), daemon=True).start()
    unread = connect(listener.path)
    seen = []
    unread.on_cut = lambda: seen.append(unread.closed)
    while unread.send(Warmed(1, ["x" * 65536])):
        pass
    assert seen == [False] and unread.cut and unread.closed


def test_a_send_after_the_other_side_ended_the_connection_is_no_cut_of_this_side(pair):
    """The other side's end closed (its process gone, or it cut the connection after forgetting its calls): the send
    fails and the connection ends, but this side did not cut it, so nothing tells it the other may still write."""
    engine, front, _ = pair
    ended = reading(engine, decode_to_engine)
    engine.close()  # as an engine process ending closes its socket
    assert ended.wait(5)
    told = []
    front.on_cut = lambda: told.append(True)
    assert not front.send(Abort(1))
    assert front.closed and not front.cut and not told


def test_a_cut_waits_for_no_lock_a_thread_waiting_to_send_holds(pair, monkeypatch):
    """The engine's `on_cut` takes the batcher's lock (to drop the cut front's items) while a runner holding that
    lock (dropping an expired item) waits to send on the same connection: the cut must not hold the send lock."""
    monkeypatch.setattr(channel_module, "SEND_TIMEOUT_SECONDS", 0.2)
    _, _, listener = pair
    never_read = []  # held, so its end stays open
    threading.Thread(target=lambda: never_read.append(listener.accept()), daemon=True).start()
    unread = connect(listener.path)
    batcher_lock, sending = threading.Lock(), threading.Event()

    def cut() -> None:
        with batcher_lock:
            pass

    unread.on_cut = cut
    ended = []

    def stalled_send() -> None:  # a message larger than the socket's buffers: the write stalls, then times out
        sending.set()
        ended.append(unread.send(Warmed(1, ["x" * (8 << 20)])))

    def send_under_lock() -> None:
        with batcher_lock:
            assert sending.wait(5)
            time.sleep(0.05)  # the stalled send holds the connection
            ended.append(unread.send(Abort(1)))

    threads = [threading.Thread(target=stalled_send, daemon=True), threading.Thread(target=send_under_lock, daemon=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert ended == [False, False], "a cut and a send waiting behind it deadlocked"
    assert unread.cut and unread.closed
