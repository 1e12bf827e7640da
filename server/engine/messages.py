"""What crosses between a front process and the engine process: typed msgspec structs (server/engine/channel.py
carries them).

Every message is small: ids, places, shapes, offsets into the front's shared-memory region
(server/engine/shm.py), deadlines (time.monotonic(), one clock for every process of a machine). Pixels and
lattices stay in shared memory; only an array the region had no room for travels inline, as bytes. Nothing
is pickled, and nothing holds a lock, event or object of the other side (vLLM V1's serial_utils does the same).
Decoded with one tagged-union decoder per direction.
"""

from __future__ import annotations

import msgspec

from server.engine.client import EngineFacts, PlanKey, QueueState
from server.errors import Refusal, ScoringError
from server.geometry.dense import Passes
from convert.memory_model import Device

__all__ = ["Abort", "Ask", "Done", "Failed", "Facts", "Hello", "ItemSpec", "Queue", "Submit", "Warm", "Warmed",
           "decode_from_engine", "decode_to_engine", "encode"]

STRUCT = dict(tag=True, array_like=True, omit_defaults=True, gc=False)


class PassesSpec(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """`Passes` on the wire; frozen, so the engine can key what it makes of one on it."""

    stride: int
    factor: int
    shift: int
    offsets: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, passes: Passes) -> PassesSpec:
        return cls(passes.stride, passes.factor, passes.shift, passes.offsets)

    def passes(self) -> Passes:
        return Passes(self.stride, self.factor, self.shift, self.offsets)


# --- front to engine ----------------------------------------------------------------------------------------
class Hello(msgspec.Struct, **STRUCT):
    """A front's first message on its connection: which front it is (answered by `Facts`); the messages after it
    are that front's."""

    front: int


class Ask(msgspec.Struct, **STRUCT):
    """The state of `model`'s queue now (answered by `Queue`): a front asks when the state it holds would refuse a
    request and is older than one item's time in the queue."""

    call: int
    model: str


class ItemSpec(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One item: its batch group, what its plan gives back, and where its canvas and lattice are in the region
    (offset -1: the canvas inline in `inline`, or no lattice wanted)."""

    height: int
    width: int
    passes: PassesSpec
    cells: tuple[int, int]
    canvas_offset: int
    limit: int
    lattice: str | None = None
    lattice_offset: int = -1
    lattice_bytes: int = 0  # the place the front made for it: a larger lattice comes back inline
    traffic: bool = True
    kept: tuple[int, int, int, int] | None = None  # rows start, stop, columns start, stop
    classes: tuple[int, ...] = ()
    deadline: float | None = None
    inline: bytes = b""


class Submit(msgspec.Struct, **STRUCT):
    """Queue call `call`'s items if the queue has room for them (answered by one `Done` per item, or one `Failed`
    with the refusal and its numbers)."""

    call: int
    model: str
    region: str
    items: list[ItemSpec]


class Abort(msgspec.Struct, **STRUCT):
    """The call ended (cancelled, its deadline passed, or its items are no longer wanted): drop what has not run,
    counted as dropped at its deadline when `expired` (as one process counts it)."""

    call: int
    expired: bool = False


class Warm(msgspec.Struct, **STRUCT):
    """Make and run these plans of `model` (answered by `Warmed`)."""

    call: int
    model: str
    keys: list[tuple[int, int, int, PassesSpec]]
    background: bool = False


# --- engine to front ----------------------------------------------------------------------------------------
class Facts(msgspec.Struct, **STRUCT):
    """The engine is up, and what the front needs to know of it: the answer to `Hello` (the engine listens once
    it has warmed)."""

    provider: str
    device: str
    memory_budget_bytes: int | None
    runners: int
    max_batch: int
    int8_sums_saturate: bool
    classes: dict[str, int]
    queues: dict[str, QueueState]

    def facts(self) -> EngineFacts:
        return EngineFacts(self.provider, Device(self.device), self.memory_budget_bytes, self.runners, self.max_batch,
                           self.int8_sums_saturate)


class Queue(msgspec.Struct, **STRUCT):
    """The answer to `Ask`. With each queue state the engine says how many of this front's items for the model it
    had acted on (queued or refused) when it read the state: the front counts those it sent after as not in it."""

    call: int
    state: QueueState
    acted: int = 0


class Done(msgspec.Struct, **STRUCT):
    """Item `index` of call `call` ran: its probabilities inline, its lattice (when it asked for one: shape and
    dtype) in the region, or `lattice` inline when it had no place there, and its timings."""

    call: int
    index: int
    probabilities: bytes
    planning_seconds: float
    enqueued: float
    started: float
    run_seconds: float
    batch_id: int
    lattice_shape: tuple[int, ...] = ()
    lattice_dtype: str = ""
    lattice: bytes = b""
    queue: QueueState | None = None  # the call's model's queue as the item left it
    acted: int = 0  # as in `Queue`


class Failed(msgspec.Struct, **STRUCT):
    """Call `call` failed (every item of it): the refusal as the engine said it."""

    call: int
    refusal: str
    message: str
    retry_after_seconds: float | None = None
    queue: QueueState | None = None  # the call's model's queue, when it refused the call
    acted: int = 0  # as in `Queue`

    @classmethod
    def of(cls, call: int, error: ScoringError, queue: tuple[QueueState | None, int] = (None, 0)) -> Failed:
        return cls(call, error.refusal.name, error.message, error.retry_after_seconds, *queue)

    def error(self) -> ScoringError:
        return ScoringError(Refusal[self.refusal], self.message, retry_after_seconds=self.retry_after_seconds)


class Warmed(msgspec.Struct, **STRUCT):
    """The answer to `Warm`: the plans that failed, one line each."""

    call: int
    failures: list[str]


ToEngine = Hello | Ask | Submit | Abort | Warm
FromEngine = Facts | Queue | Done | Failed | Warmed
_ENCODER = msgspec.msgpack.Encoder()
_TO_ENGINE = msgspec.msgpack.Decoder(ToEngine)
_FROM_ENGINE = msgspec.msgpack.Decoder(FromEngine)


def encode(message: msgspec.Struct) -> bytes:
    return _ENCODER.encode(message)


def decode_to_engine(data: bytes | memoryview) -> ToEngine:
    return _TO_ENGINE.decode(data)


def decode_from_engine(data: bytes | memoryview) -> FromEngine:
    return _FROM_ENGINE.decode(data)


def plan_key(spec: tuple[int, int, int, PassesSpec]) -> PlanKey:
    height, width, batch, passes = spec
    return PlanKey(height, width, batch, passes.passes())
