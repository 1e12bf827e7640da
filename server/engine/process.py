"""The engine process's loop: the fronts' messages in, results out, beside the batcher's busy runners.

As vLLM V1's `EngineCoreProc`: an input thread receives every front's messages on one socket and acts on them (a
submit is queued if the queue has room for it, in one step; asks and aborts go straight to the in-process engine,
whose batcher is thread-safe; a warm-up runs on a thread of its own) and answers asks and refusals itself; each
batcher runner sends its items' results, with the queue's state, as it ends them; an output thread sends the rest
(facts, warm-ups); a watch thread hears when a front connects (it is told the engine's facts, so a front started
again finds the engine) or goes away (its queued items are dropped and its shared-memory region unmapped). Each
thread has its own sockets, as ZMQ wants; a hand-over between threads would add a wake-up to every request's
round trip.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import zmq
from setproctitle import setthreadtitle
from zmq.utils.monitor import recv_monitor_message

from server.engine.batcher import Work
from server.engine.client import QueueState, Submission
from server.engine.core import EngineCore
from server.engine.messages import (Abort, Ask, Done, Facts, Failed, ItemSpec, Queue, Submit, Warm, Warmed,
                                    decode_to_engine, encode, plan_key, received, waking)
from server.engine.shm import Region, region_of_front
from server.errors import NoRoom, Refusal, ScoringError
from server.scoring.request import GroupKey, Item, ItemKey

__all__ = ["EngineLoop"]

LOG = logging.getLogger(__name__)
LINGER_MS = 0  # a closing engine drops what it could not send: its fronts see it gone and refuse at once


@dataclass(eq=False)
class Call:
    """One front's call as the engine holds it, from its submit until its last item is answered."""

    model: str
    specs: list[ItemSpec]
    region: Region
    left: int
    works: list[Work] = field(default_factory=list)
    failed: bool = False


class EngineLoop:
    """Serves `core` to the fronts: `fronts` maps each front's index to the address its results go to."""

    def __init__(self, core: EngineCore, *, input_address: str, fronts: dict[int, str], classes: dict[str, int],
                 on_idle: Callable[[], None] | None = None) -> None:
        self.core = core
        self._context = zmq.Context()
        self._input_address = input_address
        self._input = self._context.socket(zmq.PULL)
        self._input.bind(input_address)
        self._fronts = fronts
        self._classes = classes
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._calls: dict[tuple[int, int], Call] = {}
        self._regions: dict[str, Region] = {}
        self._lock = threading.Lock()  # the calls and regions: the input, runner and watch threads share them
        self._on_idle = on_idle
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._local = threading.local()  # each batcher runner's sockets to the fronts
        self._thread_sockets: list[dict[int, zmq.Socket]] = []

    def start(self) -> None:
        ready = threading.Event()
        monitors: dict[int, zmq.Socket] = {}
        self._threads = [titled(self._receive, "engine-input"), titled(self._send, "engine-output", monitors, ready)]
        for thread in self._threads:
            thread.start()
        ready.wait()
        watch = titled(self._watch, "engine-watch", monitors)
        watch.start()
        self._threads.append(watch)

    def drain(self, timeout: float) -> bool:
        """Wait until no front's call is held (the fronts drain first), at most `timeout` seconds."""
        ends = time.monotonic() + timeout
        while time.monotonic() < ends:
            with self._lock:
                if not self._calls:
                    return True
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        """Stop answering; the engine itself is closed by its owner."""
        self._stopping.set()
        self._out.put(None)  # the output thread ends; closing its sockets wakes the watch thread
        with waking(self._context, self._input_address):
            for thread in self._threads:
                thread.join(timeout=5)
        with self._lock:
            for sockets in self._thread_sockets:
                for socket in sockets.values():
                    socket.close(linger=LINGER_MS)
        self._input.close(linger=LINGER_MS)
        self._context.destroy(linger=LINGER_MS)

    # --- input ---------------------------------------------------------------------------------------------
    def _receive(self) -> None:
        # The input thread answers asks and refusals on sockets of its own: a hand-over to the output thread would
        # add a thread's wake-up to every request's round trip.
        self._replies = {index: self._connect(address) for index, address in self._fronts.items()}
        for message in received(self._input, decode_to_engine, self._stopping, reader="the engine"):
            try:
                self._dispatch(message)
            except Exception as error:  # a bug in one call's handling never stops the engine's input
                LOG.exception("the engine failed handling %s", type(message).__name__)
                self._reply(message.front, Failed.of(message.call, ScoringError(
                    Refusal.INTERNAL, f"the engine failed handling the call: {error}")))
        for socket in self._replies.values():
            socket.close(linger=LINGER_MS)

    def _dispatch(self, message) -> None:
        if isinstance(message, Submit):
            self._submit(message)
        elif isinstance(message, Ask):
            try:
                self._reply(message.front, Queue(message.call, self.core.queue_state(message.model)))
            except ScoringError as error:
                self._reply(message.front, Failed.of(message.call, error))
        elif isinstance(message, Abort):
            self._abort(message.front, message.call)
        elif isinstance(message, Warm):
            titled(self._warm, "engine-warm", message).start()

    def _submit(self, message: Submit) -> None:
        """Queue the call's items if the queue has room for them now (the front admitted it on the state it last
        heard, which other fronts may have changed since), else refuse it with the queue's numbers."""
        key, model = (message.front, message.call), message.model
        deadline = min((spec.deadline for spec in message.items if spec.deadline is not None), default=None)
        try:
            with self._lock:
                region = self._region(message.region)
            submissions = [submission(index, spec, region) for index, spec in enumerate(message.items)]
            places = self.core.reserve(model, len(submissions), deadline=deadline)
            if isinstance(places, NoRoom):
                raise places.refusal(deadline=deadline)
            call = Call(model, message.items, region, left=len(submissions))
            with self._lock:
                self._calls[key] = call  # before its first item can end
            works = self.core.submit(model, places, submissions,
                                     on_done=functools.partial(self._finished, message.front, message.call))
        except Exception as error:
            with self._lock:
                self._calls.pop(key, None)
            if not isinstance(error, ScoringError):
                LOG.exception("the engine could not queue a call's items")
                error = ScoringError(Refusal.INTERNAL, f"the engine could not queue the request's items: {error}")
            self._reply(message.front, Failed.of(message.call, error, self._queue_state(model)))
            return
        with self._lock:
            call.works = works
            failed = call.failed
        if failed:  # an item failed before its call knew its works: the rest run for no one
            self.core.cancel(model, works)

    def _queue_state(self, model: str) -> QueueState | None:
        try:
            return self.core.queue_state(model)
        except ScoringError:
            return None

    def _abort(self, front: int, call_id: int) -> None:
        """Forget a call, drop its items not yet run, and tell the front, which may then reuse its arrays' memory
        (the engine writes a lattice only under the lock, for a call it still holds)."""
        with self._lock:
            call = self._calls.pop((front, call_id), None)
        if call is not None and call.works:
            self.core.cancel(call.model, call.works)
        self._reply(front, Failed.of(call_id, ScoringError(Refusal.CANCELLED, "the call was ended")))

    def _warm(self, message: Warm) -> None:
        try:
            failures = self.core.warm(message.model, [plan_key(key) for key in message.keys],
                                      background=message.background)
        except Exception as error:  # the front waits for an answer whatever happened
            failures = [error.message if isinstance(error, ScoringError) else f"{message.model}: {error}"]
        self._answer(message.front, Warmed(message.call, failures))

    def _region(self, name: str) -> Region:
        """The front's region of `name`, mapped once (under the lock)."""
        region = self._regions.get(name)
        if region is None:
            region = self._regions[name] = Region(name, create=False)
        return region

    # --- output --------------------------------------------------------------------------------------------
    def _finished(self, front: int, call_id: int, index: int, work: Work) -> None:
        """A batcher runner ended item `index` of a call: answered from that thread, on its own sockets (a hand-over
        to the output thread would add a thread's wake-up to every request)."""
        data = self._done(front, call_id, index, work)
        if data is None or self._stopping.is_set():
            return
        try:
            sockets = getattr(self._local, "sockets", None)
            if sockets is None:
                sockets = self._local.sockets = {i: self._connect(address) for i, address in self._fronts.items()}
                with self._lock:
                    self._thread_sockets.append(sockets)
            sockets[front].send(data, zmq.NOBLOCK)
        except zmq.Again:
            LOG.warning("front %d is not taking answers; one dropped", front)
        except zmq.ZMQError:  # the loop stopped meanwhile
            pass

    def _reply(self, front: int, message) -> bool:
        """Answer on the input thread's own socket (the input thread only); False when it could not be sent."""
        try:
            self._replies[front].send(encode(message), zmq.NOBLOCK)
        except zmq.Again:
            LOG.warning("front %d is not taking answers; one dropped", front)
            return False
        return True

    def _connect(self, address: str) -> zmq.Socket:
        socket = self._context.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, LINGER_MS)
        socket.connect(address)
        return socket

    def _facts(self) -> bytes:
        facts = self.core.facts
        return encode(Facts(facts.provider, facts.device.value, facts.memory_budget_bytes, facts.runners,
                            facts.max_batch, facts.int8_sums_saturate, self._classes,
                            {model: self.core.queue_state(model) for model in self._classes}))

    def _answer(self, front: int, message) -> None:
        self._out.put((front, encode(message)))

    def _send(self, monitors: dict[int, zmq.Socket], ready: threading.Event) -> None:
        sockets = {}
        for index, address in self._fronts.items():
            socket = sockets[index] = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, LINGER_MS)
            monitors[index] = socket.get_monitor_socket(
                zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED)
            socket.connect(address)
        ready.set()
        while True:
            entry = self._out.get()
            if entry is None:
                break
            front, data = entry
            if data is None:  # the engine's facts, with its queues as they are now
                data = self._facts()
            try:
                sockets[front].send(data, zmq.NOBLOCK)
            except zmq.Again:  # the front is gone and its queue full: it will find the engine again on connect
                LOG.warning("front %d is not taking answers; one dropped", front)
        for socket in sockets.values():
            socket.close(linger=LINGER_MS)

    def _done(self, front: int, call_id: int, index: int, work: Work) -> bytes | None:
        """The answer for item `index` of a call: its result, its lattice written into the front's region (or sent
        inline), or the call's refusal (once; its other items are then cancelled); None when no one waits for it
        any more. The lattice is written under the lock, for a call still held: once a call is ended (`_abort`)
        or failed, nothing more is written into the arrays its front may then reuse."""
        key = (front, call_id)
        inline, shape, dtype = b"", (), ""
        with self._lock:
            call = self._calls.get(key)
            if call is None or call.failed:
                return None
            if work.error is not None:
                call.failed = True
                self._calls.pop(key, None)
                works = list(call.works)
            else:
                spec, scored = call.specs[index], work.result
                lattice = scored.lattice
                if lattice is not None:
                    shape, dtype = lattice.shape, lattice.dtype.str
                    fits = lattice.nbytes <= spec.lattice_bytes and spec.lattice_offset + lattice.nbytes <= call.region.size
                    if spec.lattice_offset >= 0 and fits:
                        call.region.array(spec.lattice_offset, lattice.shape, lattice.dtype)[...] = lattice
                    else:
                        inline = lattice.tobytes()
                call.left -= 1
                if call.left == 0:
                    self._calls.pop(key, None)
            idle = not self._calls
        if work.error is not None:
            if works:
                self.core.cancel(call.model, works)
            return encode(Failed.of(call_id, work.error, self._queue_state(call.model)))
        if idle and self._on_idle is not None:
            self._on_idle()
        return encode(Done(call_id, index, scored.probabilities.astype(np.float32, copy=False).tobytes(),
                           scored.planning_seconds, work.enqueued, work.started, work.run_seconds, work.batch_id,
                           shape, dtype, inline, self._queue_state(call.model)))

    # --- fronts coming and going ---------------------------------------------------------------------------
    def _watch(self, monitors: dict[int, zmq.Socket]) -> None:
        """Blocks with no timeout (an idle engine never wakes it): the output thread's closing sockets end it."""
        poller = zmq.Poller()
        fronts = {}
        for index, monitor in monitors.items():
            poller.register(monitor, zmq.POLLIN)
            fronts[monitor] = index
        while not self._stopping.is_set():
            for monitor, _ in poller.poll():
                event = recv_monitor_message(monitor)["event"]
                front = fronts[monitor]
                if event == zmq.EVENT_CONNECTED:
                    self._out.put((front, None))
                elif event == zmq.EVENT_DISCONNECTED:
                    self._front_gone(front)
        for monitor in fronts:
            monitor.close(linger=0)

    def _front_gone(self, front: int) -> None:
        """A front went away: free every call it held and unmap its regions."""
        with self._lock:
            gone = [key for key in self._calls if key[0] == front]
            calls = [self._calls.pop(key) for key in gone]
            regions = {call.region.name for call in calls}
            regions.update(name for name in self._regions if region_of_front(name, front))
            mapped = [self._regions.pop(name) for name in regions if name in self._regions]
        for call in calls:
            if call.works:
                self.core.cancel(call.model, call.works)
        for region in mapped:
            region.close()
        if calls:
            LOG.warning("front %d went away: %d of its calls freed", front, len(calls))


def titled(target: Callable[..., None], name: str, *args) -> threading.Thread:
    """A daemon thread named `name` also where top -H and /proc/PID/task/TID/comm look."""
    def run() -> None:
        setthreadtitle(name[:15])
        target(*args)

    return threading.Thread(target=run, name=name, daemon=True)


def submission(index: int, spec: ItemSpec, region: Region) -> Submission:
    """An item as the engine runs it: its canvas a view of the front's region (or its inline bytes)."""
    shape = (spec.height, spec.width, 3)
    if spec.canvas_offset >= 0:
        canvas = region.array(spec.canvas_offset, shape, np.uint8)
    else:
        canvas = np.frombuffer(spec.inline, dtype=np.uint8).reshape(shape)
    kept = None if spec.kept is None else (slice(spec.kept[0], spec.kept[1]), slice(spec.kept[2], spec.kept[3]))
    item = Item(canvas, tuple(spec.cells), spec.lattice, spec.traffic, kept, tuple(spec.classes))
    return Submission(ItemKey(index, False, 0), GroupKey(spec.height, spec.width, spec.passes.passes()), item,
                      spec.limit, spec.deadline)

