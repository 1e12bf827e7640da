"""A front's connection to the engine process: framed messages both ways over one Unix socket.

`multiprocessing.connection` frames each message (its length, then its bytes) on a stream socket. A message is
written by the thread that has it and read by a thread blocked in `recv`, with no I/O thread between: one wake-up
per message, which halved a message's time from one process's thread to the other's against ZMQ's (its I/O thread
on each side adds two; docs/design.md). The connection itself says when the other side goes: its reader sees the
end of the stream, however the process ended.
"""

from __future__ import annotations

import contextlib
import logging
import os
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
SEND_TIMEOUT_SECONDS = 2.0  # a send the other side takes nothing of for this long cuts the connection
BACKLOG = 64  # fronts connecting at once (each holds one connection)


class Channel:
    """One connection: `send` from any thread (under a lock: a message is written whole), `messages` on one reader
    thread. A send that cannot be written within SEND_TIMEOUT_SECONDS (the other side is stopped or stuck) closes
    the channel, as a partly written message leaves the stream unreadable; its reader then ends as on any loss."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._lock = threading.Lock()
        self.closed = False
        with _socket_of(connection) as sock:
            seconds = int(SEND_TIMEOUT_SECONDS)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                            struct.pack("ll", seconds, int((SEND_TIMEOUT_SECONDS - seconds) * 1e6)))

    def send(self, message: msgspec.Struct) -> bool:
        """Send `message` whole; False (the channel closed) when it could not be."""
        data = encode(message)
        with self._lock:
            if self.closed:
                return False
            try:
                self._connection.send_bytes(data)
                return True
            except OSError as error:
                LOG.warning("a message could not be sent (%s): the connection is closed", error)
        self.close()
        return False

    def messages(self, decode: Callable[[bytes], T], *, reader: str) -> Iterator[T]:
        """Each message that arrives, decoded, until the connection ends or is closed; one `reader` cannot read is
        logged and dropped. The reader owns the descriptor: it is closed here, once no one reads it."""
        try:
            while True:
                try:
                    data = self._connection.recv_bytes()
                except (EOFError, OSError):
                    return
                try:
                    message = decode(data)
                except Exception:
                    LOG.exception("a message %s cannot read: dropped", reader)
                    continue
                yield message
        finally:
            with self._lock:  # no send is writing meanwhile
                self.closed = True
                self._connection.close()

    def close(self) -> None:
        """End the connection both ways, from any thread: its reader wakes to find it ended (closing the
        descriptor alone would not wake it) and closes the descriptor."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            with contextlib.suppress(OSError), _socket_of(self._connection) as sock:
                sock.shutdown(socket.SHUT_RDWR)


def connect(path: str) -> Channel | None:
    """A channel to the engine listening at `path`; None while it is not listening (not started yet, or gone)."""
    try:
        return Channel(Client(path, family="AF_UNIX"))
    except (FileNotFoundError, ConnectionRefusedError):
        return None


class EngineListener:
    """The engine's end: fronts connect at `path` (a socket file left by an engine killed before is replaced)."""

    def __init__(self, path: str) -> None:
        self.path = path
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._listener = Listener(path, family="AF_UNIX", backlog=BACKLOG)
        self._closed = False

    def accept(self) -> Channel | None:
        """The next front's channel; None once `close` was called."""
        while True:
            try:
                connection = self._listener.accept()
            except OSError:
                if self._closed:
                    return None
                raise
            if self._closed:
                connection.close()
                return None
            return Channel(connection)

    def close(self) -> None:
        """Stop accepting: a thread blocked in `accept` is woken by a connection of its own, then told to end."""
        self._closed = True
        with contextlib.suppress(OSError):
            Client(self.path, family="AF_UNIX").close()
        self._listener.close()


def _socket_of(connection: Connection) -> socket.socket:
    """A socket object on a duplicate of the connection's descriptor: options and shutdown reach the one socket,
    and closing it leaves the connection's own descriptor open."""
    return socket.socket(fileno=os.dup(connection.fileno()))
