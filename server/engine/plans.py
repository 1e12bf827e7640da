"""Plans: one onnxruntime session pinned to one input shape, made once, kept while memory allows.

A plan runs the device graph (server/engine/device_graph.py) of one model for one (canvas height x
width, batch size, passes): uint8 canvases in, lattices and image-level probabilities out. Its
buffers are bound once (IO binding on the GPU), so a run is: copy the canvases in, run, copy back
what the responses hold. A model's plans are made on first use or at warm-up, measured, and dropped
least recently used when a new one would not fit the memory budget (docs/design.md: one session per shape).

The run stage is `PlanCache.run`, the batcher's runner: a batch of items padded up to its batch
bucket, with the valid mask saying which cells each item keeps (a tile: the cells it owns).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime

from server.engine.shared_weights import SharedWeights
from server.memory.arena import CPU_ARENA
from server.memory.device import MEASUREMENT_RESOLUTION_BYTES, PlanMemory
from server.memory.runtime import HOST_ACTIVITY, HostActivity, measure_footprint
from protos.model_card_pb2 import ModelCard
from server.geometry.buckets import Buckets
from server.engine.device_graph import (LATTICE, LATTICE_FP16, PIXELS, PROBABILITIES, VALID, DeviceGraphError,
                                 build_plan_graph)
from server.engine.providers import Engine, EngineError, stoppable
from server.errors import Refusal, ScoringError
from server.metrics import Metrics
from server.engine.batcher import Work, paced
from server.engine.client import PlanKey
from server.scoring.request import GroupKey, Item, Scored

LOG = logging.getLogger(__name__)
MAKING = threading.Lock()  # held while a request's plan is made and measured: the readings are process-wide
# Every plan being made, the background's too: a footprint reading is its plan's alone if no other was made meanwhile.
PLANS_BEING_MADE = HostActivity()


class Plan:
    """One session of one fixed shape, with its input and output buffers bound once; on the CPU its runs take
    `arena_bytes` from the process's shared arena (server.memory.arena) and hand them back."""

    def __init__(self, key: PlanKey, session: onnxruntime.InferenceSession, *, on_gpu: bool,
                 arena_bytes: int = 0, runs: onnxruntime.RunOptions | None = None) -> None:
        self.key = key
        self.session = session
        self._runs = runs  # the engine's (Engine.runs): closing the pipeline ends a run under way
        self.arena_bytes = arena_bytes
        self._lock = threading.Lock()
        shapes = {output.name: tuple(output.shape) for output in session.get_outputs()}
        self.lattice_shape, self.probabilities_shape = shapes[LATTICE], shapes[PROBABILITIES]
        self._binding = None
        if on_gpu:
            self._binding = session.io_binding()
            self._inputs = {
                PIXELS: self._device((key.batch, key.height, key.width, 3), np.uint8),
                VALID: self._device((key.batch, *self.lattice_shape[2:]), np.float32),
            }
            self._outputs = {
                LATTICE: self._device(self.lattice_shape, np.float32),
                LATTICE_FP16: self._device(self.lattice_shape, np.float16),
                PROBABILITIES: self._device(self.probabilities_shape, np.float32),
            }
            for name, value in self._inputs.items():
                self._binding.bind_ortvalue_input(name, value)
            for name, value in self._outputs.items():
                self._binding.bind_ortvalue_output(name, value)

    @staticmethod
    def _device(shape: tuple[int, ...], dtype: type) -> onnxruntime.OrtValue:
        return onnxruntime.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, "cuda", 0)

    def run(self, pixels: np.ndarray, valid: np.ndarray, *, lattice: str | None) -> tuple[np.ndarray | None, np.ndarray]:
        """(lattice [B, K, HL, WL], probabilities [B, K]) of one full batch; `lattice` names the lattice output
        to copy back (LATTICE, or LATTICE_FP16: half the bytes, on a GPU; a CPU plan gives LATTICE) or None when no
        response needs one."""
        if self._binding is None:  # a CPU session runs batches side by side (--cpu-runners)
            names = [LATTICE, PROBABILITIES] if lattice else [PROBABILITIES]
            with CPU_ARENA.running(self.arena_bytes), stoppable(self._runs):
                outputs = self.session.run(names, {PIXELS: pixels, VALID: valid}, self._runs)
            return (outputs[0] if lattice else None), outputs[-1]
        with self._lock:  # the bound buffers take one batch at a time (warm-up runs beside traffic)
            self._inputs[PIXELS].update_inplace(pixels)
            self._inputs[VALID].update_inplace(valid)
            with stoppable(self._runs):
                self.session.run_with_iobinding(self._binding, self._runs)
            maps = self._outputs[lattice].numpy() if lattice else None
            return maps, self._outputs[PROBABILITIES].numpy()


def kept_lattice(lattices: np.ndarray | None, index: int, item: Item) -> np.ndarray | None:
    """A copy of item `index`'s cells of the batch's lattice, of only the classes it keeps (all when none are
    named), in float16 when it asked for the half lattice: the batch's array goes once every item has its own."""
    if not item.lattice:
        return None
    cells = lattices[index, :, :item.cells[0], :item.cells[1]]
    dtype = np.float16 if item.lattice == LATTICE_FP16 else cells.dtype
    return cells[list(item.classes)].astype(dtype, copy=False) if item.classes else cells.astype(dtype)


class PlanCache:
    """A model's plans by key, made on demand, dropped least recently used (in the memory budget's one
    server-wide order) when the budget needs room or the model has `max_plans`.

    PlanMemory (server/memory/device.py) accounts every plan of every model in one budget: it reserves a
    new plan's predicted bytes (evicting what it must, here or in other models' caches through
    `drop`), then gets the plan's measured footprint. Requests' plans are made one at a time, server-wide; a
    background plan beside them (`get`).
    """

    def __init__(self, net: onnx.ModelProto, card: ModelCard, engine: Engine, plan_memory: PlanMemory, *,
                 max_plans: int, buckets: Buckets, fill: np.ndarray, metrics: Metrics | None = None,
                 name: str = "") -> None:
        self._buckets = buckets
        self._fill = fill
        self._metrics = metrics
        self._name = name or card.name
        self._net = net
        self._card = card
        self._engine = engine
        self._memory = plan_memory
        self._weights = None if engine.on_gpu else SharedWeights()  # the model's, shared by its CPU plans
        self._max_plans = max(1, max_plans)
        self._plans: dict[PlanKey, Plan] = {}  # in no order: the memory budget keeps the one LRU order
        self._beside: dict[PlanKey, threading.Event] = {}  # plans being made in the background, set once made
        self._lock = threading.Lock()
        self.made = 0
        self._seconds_per_item: dict[PlanKey, float] = {}  # CPU: full batches' pace per plan (the batcher's threads)
        plan_memory.on_evict = self.drop

    def run(self, works: list[Work]) -> list[Scored]:
        """Score one batch of the batcher's (items of one group), on one of the batcher's threads, in the runs
        `_sizes` says."""
        group: GroupKey = works[0].key
        items: list[Item] = [work.payload for work in works]
        wanted = {item.lattice for item in items}
        lattice = LATTICE if LATTICE in wanted else LATTICE_FP16 if LATTICE_FP16 in wanted else None
        scored, start = [], 0
        for size in self._sizes(group, len(items)):
            scored += self.run_plan(self._key(group, size), items[start:start + size], lattice=lattice)
            start += size
        return scored

    def first_run(self, group: GroupKey, count: int) -> int:
        """How many of `count` queued items of `group` the next batch should take: those its first run scores.
        The rest wait in the queue, where the batch after takes them the moment this one ends, rather than wait
        for runs after their own (docs/design.md: CPU batching off by default, work-conserving batching)."""
        return min(count, self._sizes(group, count)[0])

    def _sizes(self, group: GroupKey, count: int) -> list[int]:
        """The plan batch sizes `count` items of `group` run in: on a GPU one run, in the smallest batch bucket
        holding them, padded (a padded slot costs little there); on the CPU runs of the buckets they fill exactly
        that were measured cheapest per item (Buckets.cheapest_batches; batching on was 0.77x off at 4 clients
        when every batch ran padded), unless one of those plans is not made yet and the padded one is: making a
        plan costs more than the padded slots."""
        padded = self._buckets.batch_for(count)
        if self._engine.on_gpu:
            return [padded]
        sizes = self._buckets.cheapest_batches(count, lambda size: self._seconds_per_item.get(self._key(group, size)))
        if self._key(group, padded) in self._plans and any(self._key(group, size) not in self._plans for size in sizes):
            return [padded]
        return sizes

    @staticmethod
    def _key(group: GroupKey, size: int) -> PlanKey:
        return PlanKey(group.height, group.width, size, group.passes)

    def run_plan(self, key: PlanKey, items: list[Item], *, lattice: str | None,
                 background: bool = False) -> list[Scored]:
        """Run `items` (at most key.batch; the rest of the batch is padding) through the plan of `key`;
        no items: a warm-up run (`background`: made beside requests' plans, `get`)."""
        try:
            plan, planning = self.get(key, background=background)
        except (DeviceGraphError, EngineError) as error:
            raise ScoringError(Refusal.FAILED_PRECONDITION, f"model {self._name} cannot run {key}: {error}") from error
        if planning and items and self._metrics is not None:
            self._metrics.plans_made.labels(self._name).inc()  # a shape outside the warm-up's plans
        if planning:
            LOG.info("%s: planned %s in %.0f ms", self._name, key, 1000 * planning)
            if not items:
                return []  # a warm-up run: making the plan ran it already
        with HOST_ACTIVITY.busy():  # a plan made meanwhile on another runner's thread would count this batch
            return self._run_batch(plan, key, items, planning, lattice=lattice)

    def _run_batch(self, plan: Plan, key: PlanKey, items: list[Item], planning: float, *,
                   lattice: str | None) -> list[Scored]:
        if len(items) == key.batch == 1:
            pixels = items[0].canvas[np.newaxis]  # a lone item runs on its own canvas: no copy, no fresh pages
        else:
            pixels = np.empty((key.batch, key.height, key.width, 3), dtype=np.uint8)
            pixels[len(items):] = self._fill  # the batch bucket's padding: the canvases hold their own fill
            for index, item in enumerate(items):
                pixels[index] = item.canvas
        valid = np.zeros((key.batch, *plan.lattice_shape[2:]), dtype=np.float32)
        for index, item in enumerate(items):
            valid[(index, *item.valid())] = 1.0
        if not items:
            valid[:, :1, :1] = 1.0  # a warm-up run: one cell each, so the averages are defined
        started = time.monotonic()
        lattices, probabilities = plan.run(pixels, valid, lattice=lattice)
        if not self._engine.on_gpu and len(items) == key.batch:  # a full batch's pace, for `run` to choose by
            self._seconds_per_item[key] = paced(self._seconds_per_item.get(key),
                                                (time.monotonic() - started) / key.batch)
        return [Scored(kept_lattice(lattices, index, item), probabilities[index].copy(),
                       planning if index == 0 else 0.0) for index, item in enumerate(items)]

    def drop(self, key: PlanKey) -> None:
        """Forget a plan (its session goes once no batch runs it)."""
        with self._lock:
            self._plans.pop(key, None)

    def get(self, key: PlanKey, *, background: bool = False) -> tuple[Plan, float]:
        """The plan of `key` and the seconds spent making it (0 when it existed); ScoringError
        (RESOURCE_EXHAUSTED, with the numbers) when it cannot fit the memory budget.

        Requests' plans are made one at a time, server-wide (MAKING): a footprint is a process-wide reading. A
        `background` plan (the tile canvas made once SERVING) starts when no request's plan is being made, and is
        made outside MAKING: a request never waits behind it, unless for that very plan. A plan made beside another
        is not measured (PLANS_BEING_MADE): the budget keeps its prediction."""
        plan = self._cached(key)
        if plan is not None:
            return plan, 0.0
        while True:
            with MAKING:
                plan = self._cached(key)  # made by another thread meanwhile
                if plan is not None:
                    return plan, 0.0
                with self._lock:
                    beside = self._beside.get(key)
                    if beside is None and background:
                        beside = self._beside[key] = threading.Event()
                        break  # made below, once MAKING is free for requests
                if beside is None:
                    return self._make_measured(key)
            beside.wait()  # the background is making this very plan: sooner done than made again
        try:
            return self._make_measured(key)
        finally:
            with self._lock:
                del self._beside[key]
            beside.set()

    def _cached(self, key: PlanKey) -> Plan | None:
        with self._lock:
            plan = self._plans.get(key)
        if plan is not None:
            self._memory.plan_used(key)
        return plan

    def _make_measured(self, key: PlanKey) -> tuple[Plan, float]:
        with self._lock:
            full = len(self._plans) >= self._max_plans
        oldest = self._memory.oldest_plan() if full else None
        if oldest is not None:  # --max-plans: sessions (and their threads) per model stay bounded
            LOG.info("%s: plan %s dropped (least recently used; --max-plans %d)", self._card.name, oldest,
                     self._max_plans)
            self.drop(oldest)
            self._memory.plan_evicted(oldest)
        started = time.monotonic()
        for evicted in self._memory.make_room(key, height=key.height, width=key.width,
                                                 batch=key.batch * len(key.passes.offsets)):
            LOG.info("%s: plan %s evicted (least recently used)", self._card.name, evicted)
            self.drop(evicted)
        try:
            with PLANS_BEING_MADE.busy() as began:
                alone = functools.partial(PLANS_BEING_MADE.alone_since, began)
                make = self._make_on_gpu if self._engine.on_gpu else self._make_on_cpu
                plan = make(key, alone=alone)
        except BaseException:
            self._memory.plan_evicted(key)
            raise
        with self._lock:
            self._plans[key] = plan
        self.made += 1
        return plan, time.monotonic() - started

    def _make_on_gpu(self, key: PlanKey, *, alone: Callable[[], bool]) -> Plan:
        """A plan's session, run once, measured together (CUDA's arena keeps what the run took, per plan); the
        reading is used when no other plan was made meanwhile (`alone`)."""
        plan, footprint = measure_footprint(lambda: self._warm(Plan(key, self._engine.session(self._graph(key)),
                                                                    on_gpu=True, runs=self._engine.runs)), on_gpu=True)
        if alone():
            self._memory.plan_created(key, footprint.device_bytes)
        else:
            LOG.debug("%s: plan %s measured while another plan was made: not used", self._card.name, key)
        return plan

    def _make_on_cpu(self, key: PlanKey, *, alone: Callable[[], bool]) -> Plan:
        """A plan's session on the model's shared weights, then its warm-up run, measured apart: what the session
        keeps (the weights new to the model are the model's, not the plan's) and what its run takes from the shared
        arena, which the measurement starts empty (server.memory.runtime.measure_footprint); used when no other
        work ran in the process meanwhile (HOST_ACTIVITY) and no other plan was made (`alone`)."""
        graph = self._graph(key)
        weights_before = self._weights.bytes
        session, built = measure_footprint(lambda: self._engine.session(graph, weights=self._weights), on_gpu=False)
        predicted_run = self._memory.terms(key.height, key.width, key.batch * len(key.passes.offsets)).per_run
        plan = Plan(key, session, on_gpu=False, arena_bytes=predicted_run, runs=self._engine.runs)
        _, ran = measure_footprint(lambda: self._warm(plan), on_gpu=False)
        own = built.host_bytes - (self._weights.bytes - weights_before)
        self._memory.weights_held = self._weights.bytes  # exact: what the shared values hold
        if (built.host_shared or ran.host_shared or not alone() or own < -MEASUREMENT_RESOLUTION_BYTES
                or ran.host_bytes < predicted_run // 2):
            # decoding beside it grew (or shrank) the resident set too, or memory was freed elsewhere meanwhile (a
            # run holds at least its live activations): admission keeps the prediction. A session a little below its
            # new weights is within what the resident set resolves (they filled free pages already resident: the
            # suite read -21 kB), and holds nothing of its own.
            LOG.debug("%s: plan %s measured while other work ran in the process (session %d B%s, run %d B%s of "
                      "%d B predicted): not used", self._card.name, key, own, " shared" * built.host_shared,
                      ran.host_bytes, " shared" * ran.host_shared, predicted_run)
            return plan
        plan.arena_bytes = ran.host_bytes
        CPU_ARENA.took(ran.host_bytes)
        self._memory.plan_created(key, self._weights.bytes + max(own, 0) + ran.host_bytes, run_bytes=ran.host_bytes)
        return plan

    def _graph(self, key: PlanKey) -> bytes:
        return build_plan_graph(
            self._net, self._card, batch=key.batch, height=key.height, width=key.width,
            offsets=key.passes.offsets, factor=key.passes.factor, stride=key.passes.stride,
            on_gpu=self._engine.on_gpu,
        ).SerializeToString()

    @staticmethod
    def _warm(plan: Plan) -> Plan:
        """Run `plan` once on a blank batch (its footprint then includes what a run takes)."""
        key = plan.key
        valid = np.zeros((key.batch, *plan.lattice_shape[2:]), dtype=np.float32)
        valid[:, 0, 0] = 1.0
        plan.run(np.zeros((key.batch, key.height, key.width, 3), dtype=np.uint8), valid, lattice=LATTICE)
        return plan
