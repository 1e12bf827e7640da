"""The engine reached from a front process: `RemoteClient`, the `EngineClient` over a Unix socket and shared memory.

The front writes each canvas into its own shared-memory region (`ShmCanvases`), sends the engine a small
typed message (server/engine/messages.py) over its connection (server/engine/channel.py) and reads the lattices
back from the same region. Admission decides here, without a round trip, on the queue's state the engine sends
with every answer (`QueueView`); the engine decides again when the items arrive, as other fronts may have filled
the queue meanwhile. The calls' threads send; one thread reads, waking each waiting call by its id. When the
connection ends, the engine is gone: every call waiting fails at once with UNAVAILABLE and a retry hint, and
`on_ready(False)`; the thread then connects again until a new engine listens, which it does once warm
(`on_ready(True)` with its facts). Nothing here opens a session or imports onnxruntime.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from server.engine.channel import Channel, connect
from server.engine.client import CanvasStore, EngineClient, PlanKey, QueueState, Ran, Submission
from server.engine.device_graph import LATTICE_FP16
from server.engine.messages import (Abort, Ask, Done, Facts, Failed, Hello, ItemSpec, PassesSpec, Queue, Submit,
                                    Warm, Warmed, decode_from_engine)
from server.engine.shm import Allocator, Region
from server.errors import NoRoom, Refusal, ScoringError, Transient, retry_after, shutting_down
from server.scoring.request import ItemKey, Scored

__all__ = ["RemoteClient", "ShmCanvases"]

LOG = logging.getLogger(__name__)
POLL_SECONDS = 0.05  # how often a waiting call looks at its cancellation flag
RECONNECT_SECONDS = 0.05  # how often a front whose engine is gone tries to connect to the new one
ABORT_ACK_SECONDS = 1.0  # how long an ended call waits for the engine to say it writes nothing more for it
TRUSTED_SECONDS = 0.001  # a queue state that refuses is asked again once older than this, or one item's time
ENGINE_GONE = "the engine process is not running (it is being started again); retry shortly"


@dataclass(eq=False)
class RemotePlaces:
    """Places this front counts in a model's queue for one request, from its admission until its items are sent."""

    model: str
    items: int


@dataclass(eq=False)
class QueueView:
    """A model's queue as this front knows it on one connection: the state the engine last sent, when it came, and
    what this front adds to it: places of requests it admitted, still decoding, and the items it sent that the engine
    had not acted on when it read the state (`sent` on this connection less the engine's `acted`; a state read
    before a submit was acted on can arrive after it was sent), at most those of its calls still unanswered (a
    submit the engine never acted on counts no longer than its call waits)."""

    state: QueueState
    heard: float
    channel: Channel | None
    held: int = 0
    sent: int = 0
    acted: int = 0
    unanswered: int = 0

    def room(self, items: int, *, deadline: float | None, now: float) -> NoRoom | None:
        not_in_state = min(self.unanswered, max(0, self.sent - self.acted))
        return self.state.room(items, deadline=deadline, now=now, ahead=self.held + not_in_state)

    def trusted(self, now: float) -> bool:
        """Recent enough to refuse on: no item could have left the queue since."""
        return now - self.heard <= max(TRUSTED_SECONDS, self.state.seconds_per_item / self.state.runners)


@dataclass(eq=False)
class Pending:
    """A call waiting for the engine's answers, on the connection it was opened on: a call is never sent on a
    connection made after it was failed."""

    channel: Channel | None
    model: str | None = None
    expected: int = 1
    answers: dict[int, object] = field(default_factory=dict)
    error: ScoringError | None = None
    abandon: bool = False  # its arrays may still be written: this front cut the connection to a live engine
    # Given a value once its answers are all in or it failed; one thread waits on it. A queue, not an Event: an
    # Event makes a Condition, twenty times the cost, once per call.
    done: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)

    def end(self) -> None:
        self.done.put(None)


class ShmCanvases:
    """One request's arrays in the front's region; an array the region has no room for is made on the heap (and
    sent inline)."""

    def __init__(self, client: RemoteClient) -> None:
        self._client = client
        self._offsets: list[int] = []

    def allocate(self, shape: tuple[int, ...], dtype: type = np.uint8) -> np.ndarray:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        offset = self._client.allocator.allocate(nbytes)
        if offset is None:
            return np.empty(shape, dtype=dtype)
        self._offsets.append(offset)
        return self._client.region.array(offset, shape, dtype)

    def release(self) -> None:
        offsets, self._offsets = self._offsets, []
        for offset in offsets:
            self._client.allocator.free(offset)

    def abandon(self) -> None:
        """Never free these arrays (the engine may still write into them): a little of the region lost, logged."""
        if self._offsets:
            LOG.warning("%d arrays of an ended call kept out of the shared region: the engine did not say it was "
                        "done with them", len(self._offsets))
        self._offsets = []


class RemoteClient(EngineClient):
    """The engine process's client in front `front`: connects to the engine listening at `engine_address`, writes
    arrays into region `region_name` of `region_bytes`. Its `facts` are known once the engine has said them
    (`wait_for_engine`)."""

    def __init__(self, *, front: int, engine_address: str, region_name: str, region_bytes: int) -> None:
        self.front = front
        self.region = Region(region_name, region_bytes, create=True)
        self.allocator = Allocator(region_bytes)
        self._base = self.region.array(0, (1,), np.uint8).__array_interface__["data"][0]
        self._engine_address = engine_address
        self._channel: Channel | None = None  # while connected
        self._calls = itertools.count(time.monotonic_ns())  # never an id an earlier front of this index used
        self._pending: dict[int, Pending] = {}
        self._ending: dict[int, threading.Event] = {}  # calls ended here, until the engine acknowledges
        self._lock = threading.Lock()
        self._facts_known = threading.Event()
        self._classes: dict[str, int] = {}
        self._views: dict[str, QueueView] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._link, name="engine-results", daemon=True)
        self._thread.start()

    def wait_for_engine(self, timeout: float | None) -> bool:
        """Block until the engine has said its facts (it is warm); False after `timeout` seconds."""
        return self._facts_known.wait(timeout)

    @property
    def ready(self) -> bool:
        return self._facts_known.is_set()

    # --- the EngineClient verbs ----------------------------------------------------------------------------
    def canvases(self) -> CanvasStore:
        return ShmCanvases(self)

    def reserve(self, model: str, items: int, *, deadline: float | None) -> RemotePlaces | NoRoom:
        """Room on the queue's state as the engine last said it, asked again when that would refuse and is older
        than one item's time (the queue may have moved on; a front not sending hears nothing)."""
        if not self._facts_known.is_set():  # the engine is gone or not warm yet: refused before any decode
            raise engine_gone()
        for asked in (False, True):
            now = time.monotonic()
            with self._lock:
                view = self._views.get(model)
                if view is None:
                    break
                no_room = view.room(items, deadline=deadline, now=now)
                if no_room is None:
                    view.held += items
                    return RemotePlaces(model, items)
                if asked or view.trusted(now):
                    return no_room
            self._ask(model, deadline=deadline)
        raise engine_gone()

    def release(self, model: str, places: RemotePlaces) -> None:
        with self._lock:
            view = self._views.get(model)
            if view is not None:
                view.held -= places.items
        places.items = 0

    def run(self, model: str, places: RemotePlaces, submissions: Sequence[Submission], *, canvases: CanvasStore,
            cancelled: threading.Event | None) -> dict[ItemKey, Ran]:
        specs, slots = [], []
        for submission in submissions:
            item = submission.item
            spec = ItemSpec(submission.group.height, submission.group.width, PassesSpec.of(submission.group.passes),
                            tuple(item.cells), self._offset(item.canvas), submission.limit, lattice=item.lattice,
                            traffic=item.traffic, kept=kept_of(item.kept), classes=tuple(item.classes),
                            deadline=submission.deadline)
            slot = None
            if item.lattice:
                classes = len(item.classes) or self._classes.get(model, 0)
                dtype = np.float16 if item.lattice == LATTICE_FP16 else np.float32
                slot = canvases.allocate((classes, *item.cells), dtype)
                spec.lattice_offset, spec.lattice_bytes = self._offset(slot), slot.nbytes
            if spec.canvas_offset < 0:
                spec.inline = np.ascontiguousarray(item.canvas).tobytes()
            specs.append(spec)
            slots.append(slot)
        call, pending = self._open(model, expected=len(specs))
        counted = None
        with self._lock:  # its places become items sent, counted until a state says the engine acted on them
            view = self._views.get(model)
            if view is not None:
                view.held -= places.items
                if view.channel is pending.channel:  # else it is never sent: the connection it was opened on ended
                    view.sent += len(specs)
                    view.unanswered += len(specs)
                    counted = view
        places.items = 0
        deadline = min((s.deadline for s in submissions if s.deadline is not None), default=None)
        try:
            self._send(Submit(call, model, self.region.name, specs), call, pending)
            answers = self._wait(call, pending, deadline=deadline, cancelled=cancelled)
        except ScoringError as error:
            unacknowledged = (error.refusal in (Refusal.CANCELLED, Refusal.DEADLINE_EXCEEDED)
                              and not self._ended(call, pending))
            if pending.abandon or unacknowledged:
                canvases.abandon()  # the engine may still write a lattice there: never given to another request
            raise
        finally:
            if counted is not None:
                with self._lock:
                    counted.unanswered -= len(specs)
        ran = {}
        for index, submission in enumerate(submissions):
            done = answers[index]
            assert isinstance(done, Done)
            ran[submission.key] = Ran(Scored(lattice_of(done, slots[index]),
                                             np.frombuffer(done.probabilities, dtype=np.float32),
                                             done.planning_seconds),
                                      enqueued=done.enqueued, started=done.started, run_seconds=done.run_seconds,
                                      batch_id=done.batch_id)
        return ran

    def warm(self, model: str, keys: Sequence[PlanKey], *, background: bool = False) -> list[str]:
        call, pending = self._open(None)
        self._send(Warm(call, model, [(k.height, k.width, k.batch, PassesSpec.of(k.passes)) for k in keys],
                        background), call, pending)
        warmed = self._wait(call, pending, deadline=None, cancelled=None)[0]
        assert isinstance(warmed, Warmed)
        return list(warmed.failures)

    def close(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._fail_all(shutting_down())
        channel = self._channel
        if channel is not None:
            channel.close()  # its reader wakes and ends
        self._thread.join(timeout=2)
        self.region.close()

    # --- sending and waiting -------------------------------------------------------------------------------
    def _open(self, model: str | None, expected: int = 1) -> tuple[int, Pending]:
        call = next(self._calls)
        with self._lock:
            pending = self._pending[call] = Pending(self._channel, model, expected)
        return call, pending

    def _ask(self, model: str, *, deadline: float | None) -> None:
        """The queue's state now, from the engine (the answer updates the view as every answer does)."""
        call, pending = self._open(model)
        self._send(Ask(call, model), call, pending)
        try:
            self._wait(call, pending, deadline=deadline, cancelled=None)
        except ScoringError:
            with self._lock:
                self._ending.pop(call, None)  # no arrays: nothing to wait for
            raise

    def _offset(self, array: np.ndarray) -> int:
        """Where `array` lies in the region, or -1 when it is not in it (it goes inline)."""
        offset = array.__array_interface__["data"][0] - self._base
        return offset if 0 <= offset < self.allocator.size and array.flags.c_contiguous else -1

    def _send(self, message, call: int, pending: Pending, *, quiet: bool = False) -> None:
        """Send on the call's connection, or (unless `quiet`) refuse the call with UNAVAILABLE when it is gone."""
        channel = pending.channel
        if channel is not None and self._facts_known.is_set() and channel.send(message):
            return
        if not quiet:
            with self._lock:
                self._pending.pop(call, None)
            raise engine_gone()

    def _wait(self, call: int, pending: Pending, *, deadline: float | None,
              cancelled: threading.Event | None) -> dict[int, object]:
        """The call's answers by item index; raises its refusal, or CANCELLED / DEADLINE_EXCEEDED (the engine is
        then told to drop what it holds of it)."""
        try:
            while not ended(pending.done, deadline):
                if cancelled is not None and cancelled.is_set():
                    self._end(call, pending)
                    raise ScoringError(Refusal.CANCELLED, "the call was cancelled")
                if deadline is not None and time.monotonic() > deadline:
                    self._end(call, pending, expired=True)
                    raise ScoringError(Refusal.DEADLINE_EXCEEDED,
                                       "the deadline passed before the engine answered; dropped")
        finally:
            with self._lock:
                self._pending.pop(call, None)
        if pending.error is not None:
            raise pending.error.detached()
        return pending.answers

    def _end(self, call: int, pending: Pending, *, expired: bool = False) -> None:
        """Tell the engine to drop what it holds of `call`; its acknowledgement is awaited by `_ended`. A call no
        longer pending was answered whole, or failed as its connection ended (`_fail_all`): the engine holds nothing
        of it, and no acknowledgement comes."""
        with self._lock:
            if call not in self._pending:
                return
            self._ending[call] = threading.Event()
        self._send(Abort(call, expired), call, pending, quiet=True)

    def _ended(self, call: int, pending: Pending) -> bool:
        """Whether the engine acknowledged ending `call` (after which it writes nothing more for it), within
        ABORT_ACK_SECONDS, or the connection ended at the engine's end (a gone engine writes nothing either)."""
        with self._lock:
            acknowledged = self._ending.get(call)
        # Set by the acknowledgement, or by the connection's end at the engine's end; one this front cut may still
        # be written.
        ended = acknowledged is None or acknowledged.wait(ABORT_ACK_SECONDS)
        ended = ended and not (pending.channel is not None and pending.channel.cut)
        with self._lock:
            self._ending.pop(call, None)
        return ended

    # --- receiving -----------------------------------------------------------------------------------------
    def _link(self) -> None:
        """Connect to the engine, say which front this is, and read its answers until the connection ends; then,
        the engine gone, fail what waits for it and connect again."""
        said = ""  # the last failure to connect logged: one that persists is logged once
        while not self._stopping.is_set():
            try:
                channel = connect(self._engine_address)
            except OSError as error:  # its backlog full, no descriptor left: tried again, as a missing engine is
                if str(error) != said:
                    LOG.warning("cannot connect to the engine (%s): trying again", error)
                    said = str(error)
                channel = None
            if channel is None:  # not listening: not warm yet, or being started again
                self._stopping.wait(RECONNECT_SECONDS)
                continue
            said = ""
            self._channel = channel
            if self._stopping.is_set() or not channel.send(Hello(self.front)):
                channel.close()
            for message in channel.messages(decode_from_engine, reader="this front"):
                try:
                    self._handle(message)
                except Exception:  # a bug in one answer's handling never stops this front hearing the engine
                    LOG.exception("this front failed handling the engine's %s", type(message).__name__)
            self._channel = None
            channel.release()
            if self._stopping.is_set():
                return
            LOG.error("the engine process went away: calls refused until it is back")
            self._facts_known.clear()
            if self.on_ready is not None:
                self.on_ready(False)
            # Connections end at the engine's end once it writes nothing more for this front (it forgets a front's
            # calls before it cuts one, and its process ended otherwise); one this front cut may still be written.
            self._fail_all(engine_gone(), abandon=channel.cut)

    def _handle(self, message) -> None:
        if isinstance(message, Facts):  # a new connection: nothing sent on it yet
            self.facts, self._classes = message.facts(), dict(message.classes)
            now = time.monotonic()
            with self._lock:
                held = {model: view.held for model, view in self._views.items()}  # requests still decoding
                self._views = {model: QueueView(state, now, self._channel, held=held.get(model, 0))
                               for model, state in message.queues.items()}
            self._facts_known.set()
            LOG.info("the engine is ready (%s)", self.facts.provider)
            if self.on_ready is not None:
                self.on_ready(True)
            return
        complete = False
        with self._lock:
            pending = self._pending.get(message.call)
            ending = self._ending.get(message.call) if isinstance(message, Failed) else None
            state = message.state if isinstance(message, Queue) else getattr(message, "queue", None)
            if state is not None and pending is not None and pending.model is not None:
                self._heard(pending.model, state, getattr(message, "acted", 0))
            if ending is None and pending is not None:  # none once it ended here (cancelled, its deadline passed)
                if isinstance(message, Failed):
                    pending.error = message.error()
                else:
                    pending.answers[message.index if isinstance(message, Done) else 0] = message
                # Its answer is whole: no longer pending, so the connection's end (`_fail_all`) cannot fail it.
                complete = pending.error is not None or len(pending.answers) == pending.expected
                if complete:
                    del self._pending[message.call]
        if ending is not None:  # the engine's acknowledgement of an ended call
            ending.set()
        elif complete:
            pending.end()

    def _heard(self, model: str, state: QueueState, acted: int) -> None:
        """The engine's newest state of `model`'s queue (under the lock), read once it had acted on `acted` of the
        items this front sent on this connection. The two are kept as a pair: answers sent by different threads
        may come in another order than their states were read."""
        view = self._views.get(model)
        if view is not None:
            view.state, view.heard, view.acted = state, time.monotonic(), acted

    def _fail_all(self, error: ScoringError, *, abandon: bool = False) -> None:
        """Fail every call waiting (`abandon`: their arrays kept from other requests), and stop waiting for the
        acknowledgement of calls ended here."""
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
            ending = list(self._ending.values())
        for each in pending:
            each.error, each.abandon = error, abandon
            each.end()
        for event in ending:
            event.set()


def ended(done: queue.SimpleQueue, deadline: float | None) -> bool:
    """Whether `done` was given its value within POLL_SECONDS, or by `deadline` when that comes first."""
    timeout = POLL_SECONDS if deadline is None else min(POLL_SECONDS, max(deadline - time.monotonic(), 0.0))
    try:
        done.get(timeout=timeout)
    except queue.Empty:
        return False
    return True


def engine_gone() -> ScoringError:
    return ScoringError(Refusal.UNAVAILABLE, ENGINE_GONE, retry_after_seconds=retry_after(Transient.WARMING_UP))


def kept_of(kept: tuple[slice, slice] | None) -> tuple[int, int, int, int] | None:
    if kept is None:
        return None
    rows, columns = kept
    return rows.start, rows.stop, columns.start, columns.stop


def lattice_of(done: Done, slot: np.ndarray | None) -> np.ndarray | None:
    """The item's lattice: a view of the place made for it, or its inline bytes."""
    if not done.lattice_dtype:
        return None
    shape, dtype = tuple(done.lattice_shape), np.dtype(done.lattice_dtype)
    if done.lattice:
        return np.frombuffer(done.lattice, dtype=dtype).reshape(shape)
    if slot.shape == shape and slot.dtype == dtype:
        return slot
    return slot.reshape(-1).view(np.uint8)[:math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)
