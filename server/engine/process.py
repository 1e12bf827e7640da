"""The engine process's loop: the fronts' messages in, results out, beside the batcher's busy runners.

As vLLM V1's `EngineCoreProc`, with I/O threads beside the runners: each front's connection (server/engine/
channel.py) has two input threads that take turns on its messages, one acting on each (a submit is queued if
the queue has room for it, in one step; asks and aborts go straight to the in-process engine, whose batcher is
thread-safe; a warm-up runs on a thread of its own) and answer asks and refusals themselves; each batcher runner
sends its items' results, with the queue's state, as it ends them. No message waits for another thread to pass it
on: each hand-over would add a thread's wake-up to every request's round trip. For the same reason, on the CPU, a
submit whose items a free runner would take at once is run by the input thread that read it (`Batcher.offer`'s
claim), once it has acted on the message, while the other waits for the next: a front claims one batch at a time,
so its messages are never held up by a run. A front's connection ending (the front went away, however, or the
engine cut it: the front took no answers) drops its queued items and unmaps its shared-memory regions; its calls
are forgotten under the loop's lock before the front can see the end, so no lattice is written into memory the
front has since given to another request.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from setproctitle import setthreadtitle

from server.engine.batcher import Claim, Work
from server.engine.channel import Channel, EngineListener
from server.engine.client import QueueState, Submission
from server.engine.core import EngineCore
from server.engine.messages import (Abort, Ask, Done, Facts, Failed, Hello, ItemSpec, PassesSpec, Queue, Submit, Warm,
                                    Warmed, decode_to_engine, plan_key)
from server.engine.shm import Region
from server.errors import Dropped, NoRoom, Refusal, ScoringError
from server.scoring.request import GroupKey, Item, ItemKey

__all__ = ["EngineLoop"]

LOG = logging.getLogger(__name__)


@dataclass(eq=False)
class Front:
    """One front's connection as the engine holds it, and the regions of that front it mapped."""

    index: int
    channel: Channel
    regions: dict[str, Region] = field(default_factory=dict)  # mapped by the input thread acting on a message
    # By model, the items of its submits acted on (queued or refused), in the order they came: sent with each queue
    # state, so that the front counts those it sent since as not in it, whichever thread read the state when.
    acted: dict[str, int] = field(default_factory=dict)
    claiming: bool = False  # one of its input threads runs a batch it claimed: the other must stay free to read


@dataclass(eq=False)
class Call:
    """One front's call as the engine holds it, from its submit until its last item is answered."""

    model: str
    specs: list[ItemSpec]
    region: Region
    left: int
    works: list[Work] = field(default_factory=list)
    ended: bool = False  # failed, aborted or its front lost: nothing more is written or run for it


class EngineLoop:
    """Serves `core` to the fronts that connect at `address` (a Unix socket's path)."""

    def __init__(self, core: EngineCore, *, address: str, classes: dict[str, int],
                 on_idle: Callable[[], None] | None = None) -> None:
        self.core = core
        self.address = address
        self._classes = classes
        self._calls: dict[tuple[Front, int], Call] = {}  # by front and the front's call id
        self._fronts: set[Front] = set()  # those connected, not lost: calls are queued and answered for these alone
        self._channels: set[Channel] = set()  # every connection accepted, until its input threads end
        self._lock = threading.Lock()  # the calls, fronts and channels: input, runner and warm-up threads share them
        self._on_idle = on_idle
        # On a GPU every thread that runs a session gets onnxruntime's per-thread CUDA handles and workspace, which
        # the memory budget does not count: batches there run on the runner alone.
        self._claims = not core.facts.on_gpu
        self._listener: EngineListener | None = None
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Listen: fronts connect from now on (each is told the engine's facts at once)."""
        self._listener = EngineListener(self.address)
        accepting = titled(self._accept, "engine-accept")
        accepting.start()
        self._threads.append(accepting)

    def drain(self, timeout: float) -> bool:
        """Wait until every front has gone and no call is held, at most `timeout` seconds. The fronts drain first:
        stopped before the engine, or at the same moment when the supervisor died, when a front still decoding a
        request it admitted has yet to send its items."""
        ends = time.monotonic() + timeout
        while time.monotonic() < ends:
            with self._lock:
                if not self._calls and not self._fronts:
                    return True
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        """Stop answering (every front forgotten first); the engine itself is closed by its owner."""
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            fronts, channels = list(self._fronts), list(self._channels)
        for front in fronts:
            self._lose(front)
        for channel in channels:
            channel.close()
        for thread in list(self._threads):
            thread.join(timeout=5)

    # --- input ---------------------------------------------------------------------------------------------
    def _accept(self) -> None:
        while (channel := self._listener.accept()) is not None:
            with self._lock:
                self._channels.add(channel)
            reading = titled(self._serve, "engine-input", channel)
            reading.start()
            self._threads = [thread for thread in self._threads if thread.is_alive()] + [reading]

    def _serve(self, channel: Channel) -> None:
        """One front's connection, from its `Hello` until it ends: two input threads take turns on it, so that one
        runs a batch it claimed (`_submit`) while the other waits for the front's next message."""
        front = self._greet(channel)
        if front is not None:
            other = titled(self._take_turns, "engine-input", front)
            other.start()
            self._take_turns(front)
            other.join()
        with self._lock:
            self._channels.discard(channel)
        channel.release()
        if front is not None:
            self._unmap(front)

    def _greet(self, channel: Channel) -> Front | None:
        """A connection's first message names its front, which is told the engine's facts; a connection that does
        not begin so is closed."""
        message = channel.receive(decode_to_engine, reader="the engine")
        if not isinstance(message, Hello):
            if message is not None:
                LOG.error("a connection began with %s, not saying which front it is: closed", type(message).__name__)
            channel.close()
            return None
        try:
            facts = self._facts()
        except Exception:  # a bug here never stops the engine's input: the front connects again
            LOG.exception("the engine failed greeting front %d", message.front)
            channel.close()
            return None
        front = Front(message.front, channel)
        with self._lock:
            self._fronts.add(front)
        channel.on_cut = functools.partial(self._lose, front)
        channel.send(facts)
        channel.next_turn()
        return front

    def _take_turns(self, front: Front) -> None:
        """Act on the front's messages as they come, each woken for one (`Channel.receive`): a batch claimed for
        this thread runs once it has acted, while the other thread waits for the next message."""
        while (message := front.channel.receive(decode_to_engine, reader="the engine")) is not None:
            claim = self._act(front, message)
            front.channel.next_turn()
            if claim is not None:
                claim.run()
                front.claiming = False
                del claim  # an idle input thread keeps no batch's arrays alive
        # The first of the two to find the connection ended frees the front's calls at once, while the other may
        # still run a batch it claimed: the front's queued items never wait for that batch, nor run for no one.
        self._front_gone(front)

    def _act(self, front: Front, message) -> Claim | None:
        """Act on one message; a batch claimed for the calling thread to run (a submit's)."""
        try:
            if isinstance(message, Submit):
                return self._submit(front, message)
            if isinstance(message, Ask):
                try:
                    acted = front.acted.get(message.model, 0)
                    front.channel.send(Queue(message.call, self.core.queue_state(message.model), acted))
                except ScoringError as error:
                    front.channel.send(Failed.of(message.call, error))
            elif isinstance(message, Abort):
                self._abort(front, message.call, expired=message.expired)
            elif isinstance(message, Warm):
                titled(self._warm, "engine-warm", front, message).start()
        except Exception as error:  # a bug in one call's handling never stops the engine's input
            LOG.exception("the engine failed handling %s", type(message).__name__)
            front.channel.send(Failed.of(message.call, ScoringError(
                Refusal.INTERNAL, f"the engine failed handling the call: {error}")))
        return None

    def _submit(self, front: Front, message: Submit) -> Claim | None:
        """Queue the call's items if the queue has room for them now (the front admitted it on the state it last
        heard, which other fronts may have changed since), else refuse it with the queue's numbers. Items a free
        runner would take at once are claimed instead, for this thread to run: no runner is woken for them."""
        key, model = (front, message.call), message.model
        deadline = min((spec.deadline for spec in message.items if spec.deadline is not None), default=None)
        try:
            region = self._region(front, message.region)
            submissions = [submission(index, spec, region) for index, spec in enumerate(message.items)]
            call = Call(model, message.items, region, left=len(submissions))
            with self._lock:
                if front not in self._fronts:  # cut meanwhile: no one reads an answer
                    return None
                self._calls[key] = call  # before its first item can end
            offered = self.core.offer(model, submissions, deadline=deadline, here=self._claims and not front.claiming,
                                      on_done=functools.partial(self._finished, key))
            if isinstance(offered, NoRoom):
                raise offered.refusal(deadline=deadline)
        except Exception as error:
            with self._lock:
                self._calls.pop(key, None)
            if not isinstance(error, ScoringError):
                LOG.exception("the engine could not queue a call's items")
                error = ScoringError(Refusal.INTERNAL, f"the engine could not queue the request's items: {error}")
            count_acted(front, message)
            front.channel.send(Failed.of(message.call, error, self._queue_state(front, model)))
            return None
        count_acted(front, message)  # once its items are in the queue: a state read from now on counts them
        works, claim = offered
        if claim is not None:  # set while acting, which holds the turn: the other thread reads it after
            front.claiming = True
        with self._lock:
            call.works = works
            ended = call.ended
        if ended:  # it ended (an item failed, or a cut lost its front) before it knew its works: drop them
            self.core.cancel(model, works)
        return claim  # run even when ended, as a runner that had taken them: its results are written for no one

    def _queue_state(self, front: Front, model: str) -> tuple[QueueState | None, int]:
        """The model's queue now, and how many of the front's items for it were acted on before it was read."""
        acted = front.acted.get(model, 0)
        try:
            return self.core.queue_state(model), acted
        except ScoringError:
            return None, acted

    def _abort(self, front: Front, call_id: int, *, expired: bool) -> None:
        """Forget a call, drop its items not yet run (counted as dropped at their deadline when it `expired`), and
        tell the front, which may then reuse its arrays' memory (the engine writes a lattice only under the lock,
        for a call it still holds)."""
        self._end_call((front, call_id), dropped=Dropped.DEADLINE if expired else None)
        front.channel.send(Failed.of(call_id, ScoringError(Refusal.CANCELLED, "the call was ended")))
        self._tell_if_idle()

    def _warm(self, front: Front, message: Warm) -> None:
        try:
            failures = self.core.warm(message.model, [plan_key(key) for key in message.keys],
                                      background=message.background)
        except Exception as error:  # the front waits for an answer whatever happened
            failures = [error.message if isinstance(error, ScoringError) else f"{message.model}: {error}"]
        front.channel.send(Warmed(message.call, failures))

    @staticmethod
    def _region(front: Front, name: str) -> Region:
        """The front's region of `name`, mapped once (by the input thread acting on a message, one at a time)."""
        region = front.regions.get(name)
        if region is None:
            region = front.regions[name] = Region(name, create=False)
        return region

    # --- output --------------------------------------------------------------------------------------------
    def _finished(self, key: tuple[Front, int], index: int, work: Work) -> None:
        """A batcher runner ended item `index` of a call: answered from that thread (unless the call ended), then,
        the engine idle, its arena told (after the answer: it is not the caller's wait)."""
        try:
            answer = self._done(key, index, work)
        except Exception as error:  # a bug answering one item never leaves its call waiting for good
            LOG.exception("the engine failed answering an item")
            answer = self._fail(key, ScoringError(Refusal.INTERNAL, f"the engine failed answering the request: {error}"))
        if answer is not None:
            key[0].channel.send(answer)
        self._tell_if_idle()  # also after the run of a call that ended meanwhile: the run is what the arena counts

    def _tell_if_idle(self) -> None:
        """Tell the arena the engine holds no call, if so: however its last call ended (answered, aborted, its
        front gone), else the arena would keep what the burst took until a later request was answered."""
        with self._lock:
            idle = not self._calls
        if idle and self._on_idle is not None:
            self._on_idle()

    def _fail(self, key: tuple[Front, int], error: ScoringError) -> Failed | None:
        """End a call with `error`: its refusal, or None when it had ended already."""
        call = self._end_call(key)
        return None if call is None else Failed.of(key[1], error, self._queue_state(key[0], call.model))

    def _end_call(self, key: tuple[Front, int], *, dropped: Dropped | None = None) -> Call | None:
        """Forget a call under the lock (nothing more is written or run for it) and drop its items not yet run
        (counted as `dropped`, when given); the call, or None when it had ended already."""
        with self._lock:
            call = self._calls.pop(key, None)
            if call is None:
                return None
            call.ended = True  # for its `_submit`, which may not know its works yet
        if call.works:
            self.core.cancel(call.model, call.works, dropped=dropped)
        return call

    def _facts(self) -> Facts:
        facts = self.core.facts
        return Facts(facts.provider, facts.device.value, facts.memory_budget_bytes, facts.runners, facts.max_batch,
                     facts.int8_sums_saturate, self._classes,
                     {model: self.core.queue_state(model) for model in self._classes})

    def _done(self, key: tuple[Front, int], index: int, work: Work) -> Done | Failed | None:
        """The answer for item `index` of a call: its result, its lattice written into the
        front's region (or sent inline), or the call's refusal (once; its other items are then cancelled); None
        when no one waits for it any more. The lattice is written under the lock, for a call still held: once a
        call is ended (`_abort`) or failed, nothing more is written into the arrays its front may then reuse."""
        if work.error is not None:
            return self._fail(key, work.error)
        inline, shape, dtype = b"", (), ""
        with self._lock:
            call = self._calls.get(key)
            if call is None:  # ended: nothing more is written for it
                return None
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
        return Done(key[1], index, scored.probabilities.astype(np.float32, copy=False).tobytes(),
                    scored.planning_seconds, work.enqueued, work.started, work.run_seconds, work.batch_id, shape,
                    dtype, inline, *self._queue_state(key[0], call.model))

    # --- fronts going ---------------------------------------------------------------------------------------
    def _lose(self, front: Front) -> list[Call]:
        """Forget `front` and its calls, under the lock (no runner writes for them after), and drop their items
        not yet run; the calls forgotten."""
        with self._lock:
            self._fronts.discard(front)
            calls = [self._calls.pop(key) for key in [key for key in self._calls if key[0] is front]]
            for call in calls:
                call.ended = True
        for call in calls:
            if call.works:
                self.core.cancel(call.model, call.works)
        return calls

    def _front_gone(self, front: Front) -> None:
        """A front's connection ended: free every call it held (logged once, by the first to find it)."""
        calls = self._lose(front)
        if calls:
            LOG.warning("front %d went away: %d of its calls freed", front.index, len(calls))
            self._tell_if_idle()

    @staticmethod
    def _unmap(front: Front) -> None:
        """Unmap a gone front's regions, once both its input threads (which alone map them, and one of which may
        run a batch reading them) have ended."""
        mapped, front.regions = list(front.regions.values()), {}
        for region in mapped:
            region.close()


def count_acted(front: Front, message: Submit) -> None:
    """The submit's items acted on, queued or refused (by the input thread acting on it, one at a time)."""
    front.acted[message.model] = front.acted.get(message.model, 0) + len(message.items)


def titled(target: Callable[..., None], name: str, *args) -> threading.Thread:
    """A daemon thread named `name` also where top -H and /proc/PID/task/TID/comm look."""
    def run() -> None:
        setthreadtitle(name[:15])
        target(*args)

    return threading.Thread(target=run, name=name, daemon=True)


@functools.lru_cache(maxsize=1024)
def group_of(height: int, width: int, passes: PassesSpec) -> GroupKey:
    """The batch group of a canvas shape and passes: made once, as the engine acts on each message while the front
    that sent it waits."""
    return GroupKey(height, width, passes.passes())


def submission(index: int, spec: ItemSpec, region: Region) -> Submission:
    """An item as the engine runs it: its canvas a view of the front's region (or its inline bytes)."""
    shape = (spec.height, spec.width, 3)
    if spec.canvas_offset >= 0:
        canvas = region.array(spec.canvas_offset, shape, np.uint8)
    else:
        canvas = np.frombuffer(spec.inline, dtype=np.uint8).reshape(shape)
    kept = None if spec.kept is None else (slice(spec.kept[0], spec.kept[1]), slice(spec.kept[2], spec.kept[3]))
    item = Item(canvas, tuple(spec.cells), spec.lattice, spec.traffic, kept, tuple(spec.classes))
    return Submission(ItemKey(index, False, 0), group_of(spec.height, spec.width, spec.passes), item,
                      spec.limit, spec.deadline)

