"""The scoring pipeline: request in, response out, no gRPC needed.

The servicer is a thin adapter over it and `scoremap-score --local` runs it directly. `score` only
sequences the stages, each a module a request enters once:

    admit (admission)  ->  decode (imaging)  ->  run (the engine)  ->  assemble (assemble)

Admission checks the request whole before any pixel is decoded and gives a ticket holding its queue
places and host bytes. The image is decoded and resized in a thread pool, each scale (and its mirror)
put on its uint8 canvas (a scale no canvas bucket holds: each of its tiles, on a bucket's canvas), in
the store the engine reads canvases from (shared memory when it runs in a process of its own). The
engine (server/engine/client.py) batches items of one canvas and passes together through the model's
plans, whose device graph makes the shifted passes, normalises, runs the net and averages
probabilities, so the host only stacks uint8 arrays and copies back what the response holds.
Models are loaded and warmed up by server/scoring/loading.py; the request's types are server/scoring/request.py's.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import CancelledError, ThreadPoolExecutor

import numpy as np

from convert.card import Precision, label
from protos import model_card_pb2, scoring_pb2
from server.engine.client import EngineClient, Submission
from server.engine.priority import lower_this_thread
from server.errors import Refusal, ScoringError, shutting_down
from server.memory.host_budget import HostBudget
from server.memory.activity import HOST_ACTIVITY
from server.metrics import Metrics
from server.scoring import admission, assemble, imaging, loading
from server.scoring.admission import Ticket
from server.scoring.model import Model
from server.scoring.request import GroupKey, Item, ItemKey, lattice_classes, lattice_output
from server.settings import Settings


class Pipeline:
    """Loads converted models and scores requests against them."""

    def __init__(
        self, models: Sequence[str] | Mapping[str, str], *, settings: Settings | None = None,
        metrics: Metrics | None = None, engine: EngineClient | None = None,
    ) -> None:
        """`models`: converted .onnx paths (each named by its card) or {name: path}; `engine`: an engine process's
        client (RemoteClient), else the engine runs in this process."""
        pairs = list(models.items()) if isinstance(models, Mapping) else [("", str(path)) for path in models]
        if not pairs:
            raise ScoringError(Refusal.INVALID_ARGUMENT, "no model given: pass at least one converted .onnx file")
        self.settings = settings or Settings()
        self.metrics = metrics
        self._models: dict[str, Model] = {}
        self._closing = threading.Event()  # set by `close`: a warm-up stops at its next plan
        self._warming = threading.Lock()  # held by a warm-up while it makes or runs plans
        self._decoder = ThreadPoolExecutor(self.settings.decode_threads or os.cpu_count() or 1,
                                           thread_name_prefix="decode", initializer=lower_this_thread,
                                           initargs=(self.settings.compute_nice,))
        core = None
        if engine is None:
            from server.engine.core import EngineCore  # onnxruntime: only where the engine runs in this process

            engine = core = EngineCore(self.settings, metrics=metrics)
        self.engine = engine
        self.host_budget = HostBudget.sized(self.settings.host_memory_budget_bytes,
                                            fraction=self.settings.host_memory_fraction,
                                            at_least=self.settings.max_request_host_bytes,
                                            share=self.settings.budget_share,
                                            shared_by="--fronts" if self.settings.split_role else "--workers")
        if core is not None:
            self.host_budget.on_idle = core.went_idle
        try:
            for name, path in pairs:
                model, net = loading.load(name, str(path), settings=self.settings, facts=engine.facts,
                                          budget=core.budget if core is not None else None,
                                          host_budget=self.host_budget, metrics=self.metrics, share=len(pairs))
                if core is not None:
                    core.add(model.name, net, model.card, plan_memory=model.plan_memory, buckets=model.buckets,
                             fill=model.fill)
                del net  # the engine's plans hold what they need of it
                if model.name in self._models:
                    raise ScoringError(
                        Refusal.INVALID_ARGUMENT,
                        f"two models are named {model.name!r} ({self._models[model.name].path} and {path}); "
                        "name them apart with NAME=PATH",
                    )
                self._models[model.name] = model
            if self.settings.warm_up:
                self.check_warm_up()
                self.warm_up()
                self.warm_up_tiles()
        except BaseException:
            self.close()
            raise

    def check_warm_up(self) -> None:
        """ScoringError(INVALID_ARGUMENT) naming --warm-up-scales for a scale no model could warm up, before any
        plan is made: a bad command line, not a failed warm-up."""
        loading.check_warm_up_scales(list(self._models.values()), self.settings.warm_up_scales)

    def warm_up(self) -> None:
        """Every configured plan of every model made and run, then a request scored at each offered stride;
        ScoringError(UNAVAILABLE) naming every failure, so health never says SERVING over a broken model."""
        with self._warming:
            loading.warm_up(list(self._models.values()), self.settings.warm_up_scales, self.engine,
                            lambda request: self.score(request, record=False), stop=self._closing)

    def warm_up_tiles(self) -> None:
        """Every model's tile canvas plans made and run (failures logged: loading.warm_up_tiles)."""
        with self._warming:
            loading.warm_up_tiles(list(self._models.values()), self.engine, stop=self._closing)

    # --- queries ------------------------------------------------------------------------------
    def models(self) -> list[scoring_pb2.ModelSummary]:
        return [
            scoring_pb2.ModelSummary(
                name=m.name, classes=m.classes, output_stride=m.card.output_stride,
                precision=label(Precision, m.card.precision), path=m.path if self.settings.expose_paths else "",
                output_strides=m.strides, min_scale=m.min_scale, max_scale=self.settings.max_scale or 0,
                default_scale=m.default_scale,
            )
            for m in self._models.values()
        ]

    def card(self, name: str) -> model_card_pb2.ModelCard:
        return self._model(name).card

    def provider(self, name: str = "") -> str:
        self._model(name)
        return self.engine.facts.provider

    def _model(self, name: str) -> Model:
        if not name:
            if len(self._models) == 1:
                return next(iter(self._models.values()))
            raise ScoringError(Refusal.INVALID_ARGUMENT,
                               f"several models are loaded ({', '.join(self._models)}): name one in the request's "
                               "`model`")
        try:
            return self._models[name]
        except KeyError:
            raise ScoringError(
                Refusal.NOT_FOUND, f"no model named {name!r}; loaded: {', '.join(self._models)}"
            ) from None

    # --- scoring ------------------------------------------------------------------------------
    def score(
        self,
        request: scoring_pb2.ScoreRequest,
        *,
        deadline: float | None = None,
        cancelled: threading.Event | None = None,
        record: bool = True,
    ) -> scoring_pb2.ScoreResponse:
        """Score one request; `deadline` is a time.monotonic() instant, `cancelled` set when the caller left,
        `record` False for the server's own warm-up (not traffic, not in the metrics)."""
        started = time.monotonic()
        model = self._model(request.model)
        with admission.admit(request, model, engine=self.engine, deadline=deadline) as ticket:  # released however it ends
            submissions = self._decode(ticket, traffic=record)
            decoded = time.monotonic()
            if cancelled is not None and cancelled.is_set():  # the caller left while its image decoded
                raise ScoringError(Refusal.CANCELLED, "the call was cancelled")
            places, ticket.places = ticket.places, None  # queued with its items, nothing left to release
            ran = self.engine.run(model.name, places, submissions, canvases=ticket.canvases, cancelled=cancelled)
            computed = time.monotonic()
            with HOST_ACTIVITY.busy():
                response = assemble.response(ticket, {key: each.scored for key, each in ran.items()},
                                             provider=self.engine.facts.provider)
            seconds = assemble.timings(response, ran, started=started, decoded=decoded, computed=computed)
        if record and self.metrics is not None:
            self.metrics.record_stages(model.name, seconds)
        return response

    def _decode(self, ticket: Ticket, *, traffic: bool) -> list[Submission]:
        """The request's items, each a canvas made on a decoding thread, with its batch group and limits."""
        try:
            canvases = self._decoder.submit(self._canvases, ticket).result()
        except imaging.ImageError as error:
            raise ScoringError(Refusal.INVALID_ARGUMENT, str(error)) from error
        except (RuntimeError, CancelledError) as error:  # the pool was shut down: the server is stopping
            raise shutting_down() from error
        passes, lattice, classes = ticket.passes, lattice_output(ticket.request), lattice_classes(ticket.request)
        submissions = []
        for key, canvas in canvases.items():
            job = ticket.jobs[key.scale]
            cells, kept = job.pieces(key.flip)[key.part]
            submissions.append(Submission(key, GroupKey(*job.canvas, passes),
                                          Item(canvas, cells, lattice, traffic, kept, classes),
                                          job.items_per_batch, ticket.deadline))
        return submissions

    def _canvases(self, ticket: Ticket) -> dict[ItemKey, np.ndarray]:
        model = ticket.model
        ticket.canvases = self.engine.canvases()
        with HOST_ACTIVITY.busy():  # a plan measured meanwhile would count these pixels as its own
            return imaging.canvases(ticket.opened, ticket.jobs, ticket.flips, fill=model.fill,
                                    resize_filter=model.image.resize_filter, allocate=ticket.canvases.allocate)

    def close(self) -> None:
        """Stop the engine (runs under way end at once, queued work fails with UNAVAILABLE), the warm-up and the
        decoding threads. A warm-up stops at its next plan, and close waits for the one being made: a thread inside
        onnxruntime when the process exits aborts it (std::terminate), a death by signal instead of the drain's
        exit 0."""
        self._closing.set()
        self.engine.close()
        with self._warming:  # the plan a warm-up is making, done
            pass
        self._models.clear()
        self._decoder.shutdown(wait=False, cancel_futures=True)
