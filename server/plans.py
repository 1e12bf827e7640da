"""Plans: one onnxruntime session pinned to one input shape, made once, kept while memory allows.

A plan runs the device graph (server/device_graph.py) of one model for one (canvas height x
width, batch size, passes): uint8 canvases in, lattices and image-level probabilities out. Its
buffers are bound once (IO binding on the GPU), so a run is: copy the canvases in, run, copy back
what the responses hold. A model's plans are made on first use or at warm-up, measured, and dropped
least recently used when a new one would not fit the memory budget (issues 9 and 14).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime

from server.runtime_memory import measure_footprint
from protos.model_card_pb2 import ModelCard
from server.admission import Admission
from server.dense import PassPlan
from server.device_graph import LATTICE, LATTICE_FP16, PIXELS, PROBABILITIES, VALID, build_plan_graph
from server.engine import Engine

LOG = logging.getLogger(__name__)
MAKING = threading.Lock()  # held while a plan is made and measured: the readings are process-wide


@dataclass(frozen=True)
class PlanKey:
    """The one shape a plan runs: canvas, batch size and passes."""

    height: int
    width: int
    batch: int
    passes: PassPlan

    def __str__(self) -> str:
        return f"{self.batch}x{self.height}x{self.width}x{len(self.passes.offsets)} passes"


class Plan:
    """One session of one fixed shape, with its input and output buffers bound once."""

    def __init__(self, key: PlanKey, session: onnxruntime.InferenceSession, *, on_gpu: bool) -> None:
        self.key = key
        self.session = session
        self._lock = threading.Lock()  # one run at a time: the bound buffers are shared (warm-up runs beside traffic)
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
        to copy back (LATTICE, or LATTICE_FP16: half the bytes) or None when no response needs one."""
        with self._lock:
            return self._run(pixels, valid, lattice=lattice)

    def _run(self, pixels: np.ndarray, valid: np.ndarray, *, lattice: str | None) -> tuple[np.ndarray | None, np.ndarray]:
        if self._binding is None:
            names = [lattice, PROBABILITIES] if lattice else [PROBABILITIES]
            outputs = self.session.run(names, {PIXELS: pixels, VALID: valid})
            return (outputs[0] if lattice else None), outputs[-1]
        self._inputs[PIXELS].update_inplace(pixels)
        self._inputs[VALID].update_inplace(valid)
        self.session.run_with_iobinding(self._binding)
        maps = self._outputs[lattice].numpy() if lattice else None
        return maps, self._outputs[PROBABILITIES].numpy()


class PlanCache:
    """A model's plans by key, made on demand, dropped least recently used when the memory budget needs room
    or the model has `max_plans`.

    Admission (server/admission.py) accounts every plan of every model in one budget: it reserves a
    new plan's predicted bytes (evicting what it must, here or in other models' caches through
    `drop`), then gets the plan's measured footprint. Plans are made one at a time, server-wide.
    """

    def __init__(self, net: onnx.ModelProto, card: ModelCard, engine: Engine, admission: Admission, *,
                 max_plans: int) -> None:
        self._net = net
        self._card = card
        self._engine = engine
        self._admission = admission
        self._max_plans = max(1, max_plans)
        self._plans: collections.OrderedDict[PlanKey, Plan] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.made = 0
        admission.on_evict = self.drop

    def drop(self, key: PlanKey) -> None:
        """Forget a plan (its session goes once no batch runs it)."""
        with self._lock:
            self._plans.pop(key, None)

    def get(self, key: PlanKey) -> tuple[Plan, float]:
        """The plan of `key` and the seconds spent making it (0 when it existed); ScoringError
        (RESOURCE_EXHAUSTED, with the numbers) when it cannot fit the memory budget."""
        plan = self._cached(key)
        if plan is not None:
            return plan, 0.0
        with MAKING:  # one plan made at a time, server-wide: its footprint is a process-wide reading
            plan = self._cached(key)  # made by another thread meanwhile
            return (plan, 0.0) if plan is not None else self._make_measured(key)

    def _cached(self, key: PlanKey) -> Plan | None:
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
        if plan is not None:
            self._admission.plan_used(key)
        return plan

    def _make_measured(self, key: PlanKey) -> tuple[Plan, float]:
        with self._lock:
            oldest = next(iter(self._plans)) if len(self._plans) >= self._max_plans else None
        if oldest is not None:  # --max-plans: sessions (and their threads) per model stay bounded
            LOG.info("%s: plan %s dropped (least recently used; --max-plans %d)", self._card.name, oldest,
                     self._max_plans)
            self.drop(oldest)
            self._admission.plan_evicted(oldest)
        started = time.monotonic()
        for evicted in self._admission.make_room(key, height=key.height, width=key.width,
                                                 batch=key.batch * len(key.passes.offsets)):
            LOG.info("%s: plan %s evicted (least recently used)", self._card.name, evicted)
            self.drop(evicted)
        try:
            plan, footprint = measure_footprint(lambda: self._make(key), on_gpu=self._engine.on_gpu)
        except BaseException:
            self._admission.plan_evicted(key)
            raise
        self._admission.plan_created(key, footprint.device_bytes if self._engine.on_gpu else footprint.host_bytes)
        with self._lock:
            self._plans[key] = plan
        self.made += 1
        return plan, time.monotonic() - started

    def _make(self, key: PlanKey) -> Plan:
        """A plan's session, run once (so its footprint includes what the first run allocates)."""
        graph = build_plan_graph(
            self._net, self._card, batch=key.batch, height=key.height, width=key.width,
            offsets=key.passes.offsets, factor=key.passes.factor, stride=key.passes.stride,
        )
        plan = Plan(key, self._engine.session(graph.SerializeToString()), on_gpu=self._engine.on_gpu)
        valid = np.zeros((key.batch, *plan.lattice_shape[2:]), dtype=np.float32)
        valid[:, 0, 0] = 1.0
        plan.run(np.zeros((key.batch, key.height, key.width, 3), dtype=np.uint8), valid, lattice=LATTICE)
        return plan
