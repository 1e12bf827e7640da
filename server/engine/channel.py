"""A front's connection to the engine process: framed messages both ways over one Unix socket.

Each message is its length (8 bytes, big-endian) and then its bytes, read with two `recv`s that wait for all of it
(MSG_WAITALL): no Python read loop, which ran cold on every message with `multiprocessing.connection`
(docs/design.md). A message is written by the thread that has it and read by a thread that waited for it, with no
I/O thread between: one wake-up per message. Readers wait in epoll for input alone: blocked in `recv`, a reader is also
woken each time the other side reads what this side sent (a Unix stream socket wakes its sleepers when room to write
frees). Where two threads take turns on one connection (the engine's), the connection is armed for one wake-up
(EPOLLONESHOT): a message wakes one of them, and no other until that one has acted on it (`next_turn`), so messages
are acted on in order without handing the connection over. The connection itself says when the other side goes: its
reader sees the end of the stream, however the process ended.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from multiprocessing.connection import Client, Connection, Listener
from typing import TypeVar

import msgspec

from server.engine.messages import encode

__all__ = ["Channel", "EngineListener", "connect"]

LOG = logging.getLogger(__name__)
T = TypeVar("T")
TURN = select.EPOLLIN | select.EPOLLONESHOT  # a message wakes one of the readers taking turns, until armed again
INPUT = select.EPOLLIN  # a message wakes the single reader
SEND_TIMEOUT_SECONDS = 2.0  # a write the other side takes nothing of for this long cuts the connection
BACKLOG = 64  # fronts connecting at once (each holds one connection)
HEADER_BYTES = 8  # a message's length, big-endian
MAX_MESSAGE_BYTES = 1 << 32  # beyond any canvas or lattice sent inline: a longer length is a broken stream
SEPARATE_HEADER_BYTES = 1 << 14  # a longer message is sent after its header, not copied behind it


class Channel:
    """One connection: `send` from any thread (one at a time: a message is written whole), `receive` from one or
    more reader threads, each message given to one (`messages` for a single reader); `release` closes the
    descriptor once no thread reads it any more.

    A write the other side takes nothing of for SEND_TIMEOUT_SECONDS (it is stopped or stuck) cuts the connection,
    as a partly written message leaves the stream unreadable, and so does a stream read broken: `on_cut` runs first
    (so that the side cutting forgets what it would still write for the other before the other sees the cut), then
    the socket is shut down. `cut` says this side did so; a send that finds the other side's end closed (its process
    gone, or it ended the connection) only ends it here."""

    def __init__(self, connection: Connection) -> None:
        self._socket = socket.socket(fileno=os.dup(connection.fileno()))  # the descriptor's reads without a wrapper
        connection.close()
        self._sending = threading.Lock()  # one writer at a time; the descriptor stays open while it is held
        self._state = threading.Lock()  # `closed`, and the descriptor's shutdown
        self.closed = False
        self.ended = False  # a reader found the connection ended
        self.cut = False
        self.on_cut: Callable[[], None] | None = None
        self._readers = select.epoll()  # where the connection's readers wait for a message
        self._readers.register(self._socket.fileno(), TURN)
        seconds = int(SEND_TIMEOUT_SECONDS)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                                struct.pack("ll", seconds, int((SEND_TIMEOUT_SECONDS - seconds) * 1e6)))

    def send(self, message: msgspec.Struct) -> bool:
        """Send `message` whole; False when the channel is closed, or was cut because it could not be written."""
        data = encode(message)
        header = len(data).to_bytes(HEADER_BYTES, "big")
        with self._sending:
            if self.closed or self.cut:
                return False
            try:
                if len(data) > SEPARATE_HEADER_BYTES:
                    self._socket.sendall(header)
                    self._socket.sendall(data)
                else:
                    self._socket.sendall(header + data)
                return True
            except (BrokenPipeError, ConnectionResetError):  # the other side ended the connection: no cut of this one
                cutting = False
            except OSError as error:
                if self.closed:  # closed meanwhile: the shutdown broke the write
                    return False
                LOG.warning("a message could not be sent (%s): the connection is cut", error)
                self.cut = cutting = True  # nothing more is written after a partly written message
        # Outside the send lock: `on_cut` may wait for a lock that a thread waiting to send here holds.
        if cutting:
            self._cut()
        else:
            self.close()
        return False

    def receive(self, decode: Callable[[bytes], T], *, reader: str) -> T | None:
        """The next message, decoded; None once the connection ended or was closed. Readers wait here together:
        each message wakes one, and the connection wakes no other until that one calls `next_turn` (once it has
        acted on the message). A message `reader` cannot read is logged and dropped."""
        while not self.ended:
            try:
                self._readers.poll()
                data = self._read()
            except (EOFError, OSError, ValueError):  # ended, or closed here (the epoll or the descriptor)
                self.ended = True
                self.next_turn()  # another reader waiting wakes to find the end too
                return None
            message = _decoded(data, decode, reader)
            if message is not None:
                return message
            self.next_turn()
        return None

    def _read(self) -> bytes:
        """The next message's bytes; EOFError once the connection ended (or ended within a message, or says a
        length no message has)."""
        size = int.from_bytes(self._read_exactly(HEADER_BYTES), "big")
        if size > MAX_MESSAGE_BYTES:  # cut both ways, so that the other side and any other reader see it
            LOG.error("a message of %d bytes: the connection's stream is broken, and is cut", size)
            self._cut()
            raise EOFError
        return self._read_exactly(size)

    def _read_exactly(self, size: int) -> bytes:
        data = self._socket.recv(size, socket.MSG_WAITALL)
        while len(data) < size:  # a caught signal ended the wait early, or the connection ended
            more = self._socket.recv(size - len(data), socket.MSG_WAITALL)
            if not more:
                raise EOFError
            data += more
        return data

    def _cut(self) -> None:
        """End the connection as this side's doing: `on_cut` first, so that this side forgets what it would still
        write for the other before the other sees the end (which lets it reuse that memory), then the shutdown."""
        self.cut = True
        if self.on_cut is not None:
            self.on_cut()
        self.close()

    def next_turn(self) -> None:
        """Let the connection wake a reader for its next message."""
        with contextlib.suppress(OSError, ValueError):  # released meanwhile
            self._readers.modify(self._socket.fileno(), TURN)

    def messages(self, decode: Callable[[bytes], T], *, reader: str) -> Iterator[T]:
        """Each message that arrives, decoded, until the connection ends: for a single reader, woken by every
        message (the connection armed for input alone, not one wake-up at a time). A message `reader` cannot read
        is logged and dropped."""
        with contextlib.suppress(OSError, ValueError):  # released meanwhile: the read below finds it ended
            self._readers.modify(self._socket.fileno(), INPUT)
        while not self.ended:
            try:
                self._readers.poll()
                data = self._read()
            except (EOFError, OSError, ValueError):  # ended, or closed here (the epoll or the descriptor)
                self.ended = True
                return
            message = _decoded(data, decode, reader)
            if message is not None:
                yield message

    def release(self) -> None:
        """Close the descriptor, once no thread reads the connection any more (every reader found it ended)."""
        with self._sending, self._state:
            self.closed = self.ended = True
            self._socket.close()
        self._readers.close()

    def close(self) -> None:
        """End the connection both ways, from any thread, without waiting for a write under way (it fails): its
        readers wake to find it ended (closing the descriptor alone would not wake them)."""
        with self._state:
            if self.closed:
                return
            self.closed = True
            with contextlib.suppress(OSError):
                self._socket.shutdown(socket.SHUT_RDWR)


def connect(path: str) -> Channel | None:
    """A channel to the engine listening at `path`; None while it is not listening (not started yet, or gone). Any
    other failure to connect is raised."""
    try:
        return Channel(Client(path, family="AF_UNIX"))
    except (FileNotFoundError, ConnectionRefusedError):
        return None


class EngineListener:
    """The engine's end: fronts connect at `path` (a socket file left by an engine killed before is replaced).
    One thread accepts; `close` from another ends it."""

    def __init__(self, path: str) -> None:
        self.path = path
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._listener = Listener(path, family="AF_UNIX", backlog=BACKLOG)
        self._guard = threading.Lock()
        self._closed = False
        self._waiting = False  # a thread is in accept

    def accept(self) -> Channel | None:
        """The next front's channel; None once `close` was called."""
        with self._guard:
            if self._closed:
                return None
            self._waiting = True
        try:
            connection = self._listener.accept()
        finally:
            with self._guard:
                self._waiting = False
        if self._closed:  # the connection `close` made to wake this thread, or a front's just after
            connection.close()
            self._listener.close()
            return None
        return Channel(connection)

    def close(self) -> None:
        """Stop accepting. A thread blocked in `accept` is woken by a connection of its own (closing the socket
        would not wake it) and closes the listener; with none waiting, it is closed here."""
        with self._guard:
            self._closed = True
            if not self._waiting:
                self._listener.close()
                return
        with contextlib.suppress(OSError):
            Client(self.path, family="AF_UNIX").close()


def _decoded(data: bytes, decode: Callable[[bytes], T], reader: str) -> T | None:
    """`data` decoded; None (logged, the message dropped) when `reader` cannot read it."""
    try:
        return decode(data)
    except Exception:
        LOG.exception("a message %s cannot read: dropped", reader)
        return None
