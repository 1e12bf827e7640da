"""The in-process scoring pipeline: request in, response out, no gRPC needed.

The servicer is a thin adapter over it and `scoremap-score --local` runs it directly. A request
flows one way through four stages, each a module it passes through once:

    decode (imaging)  ->  plan (dense, buckets)  ->  run (batcher, plans, device_graph)  ->  assemble

The request is checked whole before any pixel is decoded: its fields (the image's first bytes
included), then the queue's room and expected wait, then what the image's header tells (its size):
the canvas bucket of every scale, the response's size, the memory. Then the image is decoded and resized in a thread pool, each scale
(and its mirror) is put on its uint8 canvas and batched with others of the same plan; the device
graph makes the shifted passes, normalises, runs the net and averages probabilities, so the host
only stacks uint8 arrays and copies back what the response holds.
"""

from __future__ import annotations

import functools
import logging
import os
import pathlib
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import CancelledError, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import onnx
from google.protobuf.message import DecodeError

from convert.memory_model import Device
from convert.profile import ProfileError
from server.runtime_memory import configure_allocator, release_free_memory
from convert.card import CardError, ImageInput, Precision, batch_shape, label, read_card
from protos import model_card_pb2, scoring_pb2
from server import assemble, buckets, dense, imaging
from server.admission import Admission, HostBudget, MemoryBudget, admit_host, available_memory_bytes
from server.batcher import Batcher, Reservation, Work
from server.device_graph import LATTICE, LATTICE_FP16, DeviceGraphError, scores_shape
from server.engine import Engine, EngineError
from server.errors import Refusal, ScoringError
from server.host_memory import DEVICE_PASSES, HostEstimate, estimate_request
from server.metrics import Metrics, Stage
from server.plans import PlanCache, PlanKey
from server.settings import Settings

LOG = logging.getLogger(__name__)
FALLBACK_SCALE = 384  # when a card names no default scale
CELLS_CACHE_SIZE = 4096  # resized sizes whose cell counts each model remembers
TRIM_AFTER_BYTES = 256 * 2**20  # host memory held by requests since the last trim that makes going idle trim
WARM_UP_FAILURES_SHOWN = 3  # failed plans named in the warm-up error (the log line stays readable)
TINY_IMAGE_FACTOR = 4  # an image enlarged more than this many times is scored with a warning


@dataclass(frozen=True)
class GroupKey:
    """Items that can share a batch: one canvas shape, one set of passes."""

    height: int
    width: int
    passes: dense.PassPlan


@dataclass(frozen=True)
class Item:
    """One canvas to score: a scale of an image, or its mirror."""

    canvas: np.ndarray
    cells: tuple[int, int]
    lattice: str | None  # the plan output its response needs (LATTICE, LATTICE_FP16), or None
    traffic: bool  # False for the server's own warm-up, which the metrics leave out


@dataclass
class Scored:
    """What the run stage gives back for one item."""

    lattice: np.ndarray | None
    probabilities: np.ndarray
    planning_seconds: float


@dataclass(frozen=True)
class Order:
    """A request checked whole before any pixel is decoded: what it will run and hold."""

    model: LoadedModel
    passes: dense.PassPlan
    opened: imaging.OpenedImage
    jobs: list[assemble.ScaleJob]
    flips: tuple[bool, ...]
    host: HostEstimate
    places: Reservation  # its items' places in the model's queue, held while it decodes


@dataclass(eq=False)
class LoadedModel:
    """A model ready to score: its card, plans, batcher, buckets and memory admission."""

    name: str
    path: str
    card: model_card_pb2.ModelCard
    image: ImageInput
    classes: int
    plans: PlanCache
    admission: Admission
    buckets: buckets.Buckets
    fill: np.ndarray
    batcher: Batcher = field(init=False)

    @property
    def default_scale(self) -> int:
        return self.card.default_scale or FALLBACK_SCALE

    @property
    def training_size(self) -> int:
        return max(self.card.training_height, self.card.training_width)

    @property
    def strides(self) -> tuple[int, ...]:
        return dense.offered_strides(self.card.output_stride)

    def label(self, index: int) -> str:
        return self.card.labels[index] if index < len(self.card.labels) else str(index)

    @functools.cached_property
    def label_bytes(self) -> int:
        """The longest label's size in a response (UTF-8), for its size estimate."""
        return max(len(self.label(index).encode()) for index in range(self.classes))

    @property
    def multiple(self) -> int:
        """What sizes are rounded to: the card's size multiple, else the model's stride."""
        return self.card.size_multiple or self.card.output_stride

    def __post_init__(self) -> None:
        # Per instance (functools.lru_cache on a method would be shared, and keep every model alive).
        self._rows = functools.lru_cache(maxsize=CELLS_CACHE_SIZE)(lambda height: self._net_cells(height, None)[0])
        self._columns = functools.lru_cache(maxsize=CELLS_CACHE_SIZE)(lambda width: self._net_cells(None, width)[1])

    def net_cells(self, height: int, width: int) -> tuple[int, int]:
        """Cells (rows, columns) the net gives for an unpadded input of this size: what a map keeps per pass;
        0 along an axis below the training size. Each axis depends on that side only, so each is cached alone."""
        return self._rows(height), self._columns(width)

    def _net_cells(self, height: int | None, width: int | None) -> tuple[int, int]:
        height = height or self.card.training_height
        width = width or self.card.training_width
        if height < self.card.training_height or width < self.card.training_width:
            return 0, 0
        shape = batch_shape(self.image.layout, batch=1, channels=3, height=height, width=width)
        dims, _type = scores_shape(self.admission.model.model, input_name=self.image.name,
                                   scores_name=self.card.scores_name, input_shape=shape)
        return dims[2], dims[3]


def one_line(error: Exception, limit: int = 300) -> str:
    """An error's message on one line, cut to `limit` characters (onnxruntime's span several)."""
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def invalid(message: str) -> ScoringError:
    return ScoringError(Refusal.INVALID_ARGUMENT, message)


class Pipeline:
    """Loads converted models and scores requests against them."""

    def __init__(
        self, models: Sequence[str] | Mapping[str, str], *, settings: Settings | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        """`models`: converted .onnx paths (each named by its card) or {name: path}."""
        pairs = list(models.items()) if isinstance(models, Mapping) else [("", str(path)) for path in models]
        if not pairs:
            raise ScoringError(Refusal.INVALID_ARGUMENT, "no model given: pass at least one converted .onnx file")
        self.settings = settings or Settings()
        self.metrics = metrics
        self._models: dict[str, LoadedModel] = {}
        self._decoder = ThreadPoolExecutor(self.settings.decode_threads or os.cpu_count() or 1,
                                           thread_name_prefix="decode")
        try:
            self.engine = Engine(self.settings)
        except EngineError as error:
            raise ScoringError(Refusal.FAILED_PRECONDITION, str(error)) from error
        configure_allocator()
        self.budget = MemoryBudget(self._budget_bytes(), device=Device.CUDA if self.engine.on_gpu else Device.CPU)
        self.host_budget = HostBudget.for_settings(self.settings)
        self._idle = threading.Lock()  # guards the two counts below
        self._in_flight = 0
        self._held_since_trim = 0
        try:
            for name, path in pairs:
                model = self._load(name, str(path), share=len(pairs))
                if model.name in self._models:
                    model.batcher.close()
                    raise ScoringError(
                        Refusal.INVALID_ARGUMENT,
                        f"two models are named {model.name!r} ({self._models[model.name].path} and {path}); "
                        "name them apart with NAME=PATH",
                    )
                self._models[model.name] = model
            if self.settings.warm_up:
                self.warm_up()
        except BaseException:
            self.close()
            raise

    # --- loading ------------------------------------------------------------------------------
    def _load(self, name: str, path: str, *, share: int) -> LoadedModel:
        """Card, plans, batcher and admission for one model; it gets 1/`share` of the memory budget,
        since every model's batcher runs its batches concurrently with the others'."""
        try:
            net = onnx.load(path)
            card = read_card(net)
            image = ImageInput.of(card)
            imaging.resample_filter(image.resize_filter)
        except (CardError, DecodeError, OSError, imaging.ImageError) as error:
            raise ScoringError(Refusal.INVALID_ARGUMENT, f"{path}: {error}") from error
        settings = self.settings
        name = name or card.name or pathlib.Path(path).stem  # never the folders, which ListModels would show
        admission = Admission(net, budget_bytes=self.budget.total_bytes // share if self.budget.total_bytes else None,
                              device=self.budget.device, name=name, shared=self.budget, metrics=self.metrics)
        max_batch = settings.batch_limit(on_gpu=self.engine.on_gpu)
        plans_of = [dense.plan_passes(native_stride=card.output_stride, output_stride=s, shift=0)
                    for s in dense.offered_strides(card.output_stride)]
        if settings.shape_buckets:
            shape_buckets = buckets.Buckets(settings.shape_buckets, buckets.batch_buckets(max_batch))
        else:
            shape_buckets = buckets.default_buckets(
                scales=settings.warm_up_scales or (card.default_scale or FALLBACK_SCALE,),
                slacks=sorted({p.slack for p in plans_of}), multiple=card.size_multiple or card.output_stride,
                max_batch=max_batch,
            )
        training = batch_shape(image.layout, batch=1, channels=3, height=card.training_height, width=card.training_width)
        try:
            (_batch, classes, _h, _w), _type = scores_shape(net, input_name=image.name, scores_name=card.scores_name,
                                                            input_shape=training)
        except DeviceGraphError as error:
            raise ScoringError(Refusal.INVALID_ARGUMENT, f"{path}: {error}") from error
        model = LoadedModel(
            name=name, path=path, card=card, image=image, classes=classes,
            plans=PlanCache(net, card, self.engine, admission, max_plans=settings.max_plans),
            admission=admission, buckets=shape_buckets, fill=dense.mean_colour(card),
        )
        model.batcher = Batcher(
            lambda works: self._run(model, works),
            max_batch=max_batch,
            max_delay_seconds=settings.max_queue_delay_ms / 1000,
            max_queue_seconds=settings.max_queue_ms / 1000,
            queue_depth=settings.queue_depth,
            on_batch=lambda works: self._on_batch(model, works),
            on_drop=None if self.metrics is None else functools.partial(self.metrics.count_dropped, name),
            name=name,
        )
        if self.metrics is not None:
            self.metrics.track_queue(name, model.batcher.depth)
        LOG.info("loaded %s from %s on %s (memory budget %s bytes, shared; canvases %s; batches %s)", name, path,
                 self.engine.provider, self.budget.total_bytes, shape_buckets.describe(), shape_buckets.batches)
        return model

    def _budget_bytes(self) -> int | None:
        """--memory-budget, else the GPU's free memory, else a share of the available RAM."""
        if self.settings.memory_budget_bytes is not None:
            return self.settings.memory_budget_bytes
        free = self.engine.free_gpu_bytes()
        if free is not None:
            return free
        available = available_memory_bytes()
        return int(available * self.settings.cpu_memory_fraction) if available else None

    def warm_up(self) -> None:
        """Make and run every configured plan of every model, then score a request at each offered stride;
        ScoringError(UNAVAILABLE) naming every failure, so health never says SERVING over a broken model."""
        failures = []
        for model in list(self._models.values()):
            for key in self._configured_plans(model):
                try:
                    self._run_plan(model, key, [], lattice=LATTICE)
                except Exception as error:  # any failure keeps the server NOT_SERVING, and says why
                    failures.append(f"{model.name} plan {key}: {one_line(error)}")
            if failures:
                continue
            scale = (self.settings.warm_up_scales or (model.default_scale,))[0]
            gray = np.full((scale, scale, 3), 128, dtype=np.uint8)
            for stride in model.strides:
                request = scoring_pb2.ScoreRequest(
                    model=model.name, scales=[scale], output_stride=stride, return_maps=True,
                    raw=scoring_pb2.RawImage(data=gray.tobytes(), height=scale, width=scale, channels=3),
                )
                try:
                    self.score(request, record=False)
                except ScoringError as error:
                    failures.append(f"{model.name} at scale {scale} stride {stride}: {error.message}")
        if failures:
            shown = failures[:WARM_UP_FAILURES_SHOWN]
            more = f"; and {len(failures) - len(shown)} more" if len(failures) > len(shown) else ""
            raise ScoringError(Refusal.UNAVAILABLE, "warm-up failed: " + "; ".join(shown) + more)

    def _configured_plans(self, model: LoadedModel) -> list[PlanKey]:
        """The plans traffic at the warm-up scales will use: each common aspect x stride x batch bucket."""
        keys = []
        for stride in model.strides:
            passes = dense.plan_passes(native_stride=model.card.output_stride, output_stride=stride, shift=0)
            for scale in self.settings.warm_up_scales or (model.default_scale,):
                for tall, wide in buckets.COMMON_ASPECTS:
                    size = dense.resized_size(tall, wide, scale=scale, multiple=model.multiple)
                    canvas = model.buckets.canvas_for(*size, slack=passes.slack)
                    if canvas is not None:
                        keys.extend(PlanKey(*canvas, batch, passes) for batch in model.buckets.batches)
        return list(dict.fromkeys(keys))

    # --- queries ------------------------------------------------------------------------------
    def models(self) -> list[scoring_pb2.ModelSummary]:
        return [
            scoring_pb2.ModelSummary(
                name=m.name, classes=m.classes, output_stride=m.card.output_stride,
                precision=label(Precision, m.card.precision), path=m.path if self.settings.expose_paths else "",
                output_strides=m.strides, min_scale=self._min_scale(m), max_scale=self.settings.max_scale,
                default_scale=m.default_scale,
            )
            for m in self._models.values()
        ]

    def card(self, name: str) -> model_card_pb2.ModelCard:
        return self._model(name).card

    def provider(self, name: str = "") -> str:
        self._model(name)
        return self.engine.provider

    def _model(self, name: str) -> LoadedModel:
        if not name:
            if len(self._models) == 1:
                return next(iter(self._models.values()))
            raise invalid(f"several models are loaded ({', '.join(self._models)}): name one in the request's `model`")
        try:
            return self._models[name]
        except KeyError:
            raise ScoringError(
                Refusal.NOT_FOUND, f"no model named {name!r}; loaded: {', '.join(self._models)}"
            ) from None

    def _min_scale(self, model: LoadedModel) -> int:
        return max(self.settings.min_scale or 0, model.training_size)

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
        order = self._admit(request, deadline=deadline)
        with order.places:  # given back unless its items are queued
            with self._idle:
                self._in_flight += 1
            try:
                with self.host_budget.hold(order.host):
                    return self._fulfil(request, order, started=started, deadline=deadline, cancelled=cancelled,
                                        record=record)
            finally:
                self._finished(order.host.total)

    def _finished(self, held_bytes: int) -> None:
        """When the last request in flight ends and requests have held `TRIM_AFTER_BYTES` since the last
        time, give glibc's freed memory back (malloc_trim): it would keep it, and idle RSS ratcheted up
        after large requests (issue 14). Not after each request: memory given back is faulted in again."""
        with self._idle:
            self._in_flight -= 1
            self._held_since_trim += held_bytes
            trim = self._in_flight == 0 and self._held_since_trim > TRIM_AFTER_BYTES
            if trim:
                self._held_since_trim = 0
        if trim:
            release_free_memory()

    def _admit(self, request: scoring_pb2.ScoreRequest, *, deadline: float | None) -> Order:
        """Everything that can refuse a request, from its fields and its image's header only.

        The queue is asked once the fields are checked (the image's presence and first bytes included),
        before the header is read: under overload most requests are refused, and each refusal then costs
        no header parsing or planning (26% of its server CPU, measured). A broken header is found once
        there is room, so under overload it is first refused as transient."""
        model = self._model(request.model)
        scales, passes = self._validate(request, model)
        flips = (False, True) if request.flip else (False,)
        places = model.batcher.reserve(len(scales) * len(flips), deadline=deadline)
        try:
            opened = self._open(request)
            original = (opened.height, opened.width)
            jobs = [self._plan_scale(model, original, scale, passes) for scale in scales]
            self._check_response_size(request, model, jobs)
            host = estimate_request(
                encoded_bytes=opened.encoded_bytes, image_size=original, resized_sizes=[job.canvas for job in jobs],
                passes=len(passes.offsets), flip=request.flip, classes=model.classes,
                native_stride=model.card.output_stride, output_stride=passes.stride, path=DEVICE_PASSES,
            )
            admit_host(host, limit_bytes=self.settings.max_request_host_bytes)
        except BaseException:
            model.batcher.release(places)
            raise
        return Order(model, passes, opened, jobs, flips, host, places)

    def _canvases(self, order: Order) -> list[np.ndarray]:
        """Decode once, then per scale resize and put on the canvas, the mirror after: on a decoding thread."""
        model = order.model
        largest = max((job.resized for job in order.jobs), key=lambda size: size[0] * size[1])
        image = imaging.load(order.opened, largest=largest)
        canvases = []
        for job in order.jobs:
            pixels = imaging.resize(image, job.resized, filter_name=model.image.resize_filter)
            for flip in order.flips:
                source = np.ascontiguousarray(pixels[:, ::-1]) if flip else pixels
                canvases.append(dense.canvas(source, job.canvas, model.fill))
        return canvases

    def _fulfil(self, request: scoring_pb2.ScoreRequest, order: Order, *, started: float, deadline: float | None,
                cancelled: threading.Event | None, record: bool) -> scoring_pb2.ScoreResponse:
        """Decode, put each scale (and its mirror) on its canvas, run them batched, assemble the response."""
        model, passes, original = order.model, order.passes, (order.opened.height, order.opened.width)
        try:
            canvases = self._decoder.submit(self._canvases, order).result()
        except imaging.ImageError as error:
            raise invalid(str(error)) from error
        except (RuntimeError, CancelledError) as error:  # the pool was shut down: the server is stopping
            raise ScoringError(Refusal.UNAVAILABLE, "the server is shutting down") from error
        lattice = None
        if request.return_maps or request.cell_top_k:
            half = request.map_dtype == scoring_pb2.FLOAT16 and not request.cell_top_k  # ranks from float32
            lattice = LATTICE_FP16 if half else LATTICE
        slots = [(job, flip) for job in order.jobs for flip in order.flips]
        works = [Work(GroupKey(*job.canvas, passes), Item(canvas, job.cells, lattice, record), job.batch_limit, deadline)
                 for (job, _flip), canvas in zip(slots, canvases)]
        del canvases
        preprocessed = time.monotonic()

        if cancelled is not None and cancelled.is_set():  # the caller left while its image decoded
            raise ScoringError(Refusal.CANCELLED, "the call was cancelled")
        model.batcher.submit(works, order.places)
        scored: list[Scored] = model.batcher.wait(works, cancelled=cancelled)
        computed = time.monotonic()
        queue = max(w.started - w.enqueued for w in works)
        inference = sum({w.batch_id: w.run_seconds for w in works}.values())
        setups: dict[int, float] = {}
        for work, result in zip(works, scored):
            setups[work.batch_id] = max(setups.get(work.batch_id, 0.0), result.planning_seconds)
        planning = sum(setups.values())

        response = self._assemble(request, model, passes, original, order.jobs, order.flips, scored)
        finished = time.monotonic()
        timings = response.timings
        timings.queue_ms = 1000 * queue
        timings.preprocess_ms = 1000 * (preprocessed - started)
        timings.inference_ms = 1000 * inference
        timings.postprocess_ms = 1000 * (finished - computed)
        timings.total_ms = 1000 * (finished - started)
        timings.planning_ms = 1000 * planning
        if record and self.metrics is not None:
            self.metrics.record_stages(model.name, {
                Stage.QUEUE: queue, Stage.PREPROCESS: preprocessed - started,
                Stage.INFERENCE: inference, Stage.POSTPROCESS: finished - computed,
            })
        return response

    def _validate(self, request: scoring_pb2.ScoreRequest, model: LoadedModel) -> tuple[list[int], dense.PassPlan]:
        settings = self.settings
        scales = list(request.scales) or [model.default_scale]
        if len(scales) > settings.max_scales:
            raise invalid(f"{len(scales)} scales requested; at most {settings.max_scales} are allowed (--max-scales)")
        low = self._min_scale(model)
        for scale in scales:
            if not low <= scale <= settings.max_scale:
                raise invalid(
                    f"scale {scale} is outside [{low}, {settings.max_scale}] (the target shorter side in pixels; "
                    f"model {model.name} needs at least its training size {model.training_size})"
                )
        if len(set(scales)) != len(scales):
            raise invalid(f"scales {scales} repeat a value; give each scale once")
        if request.top_k < 0 or request.cell_top_k < 0:
            raise invalid(f"top_k and cell_top_k must be >= 0; received {request.top_k} and {request.cell_top_k}")
        bad = [c for c in request.classes if not 0 <= c < model.classes]
        if bad:
            raise invalid(f"classes {bad} are out of range: model {model.name} has classes 0..{model.classes - 1}")
        if request.map_dtype not in scoring_pb2.MapDtype.values():
            raise invalid(f"map_dtype {request.map_dtype} is not a MapDtype; use one of "
                          f"{', '.join(scoring_pb2.MapDtype.keys())}")
        if request.output_stride < 0:
            raise invalid(f"output_stride must be 0 (native) or positive; received {request.output_stride}")
        try:
            passes = dense.plan_passes(
                native_stride=model.card.output_stride, output_stride=request.output_stride, shift=request.shift
            )
        except dense.PlanError as error:
            raise invalid(f"model {model.name}: {error}") from error
        kind = request.WhichOneof("image")
        if kind is None:
            raise invalid("the request has no image: set `encoded` (JPEG, PNG, WebP, BMP, TIFF bytes) or `raw` pixels")
        if kind == "encoded":
            try:
                imaging.check_encoded(request.encoded)  # its first bytes: a permanent refusal stays one under load
            except imaging.ImageError as error:
                raise invalid(str(error)) from error
        return scales, passes

    def _open(self, request: scoring_pb2.ScoreRequest) -> imaging.OpenedImage:
        """The image's header read (`_validate` has made sure there is one)."""
        try:
            if request.WhichOneof("image") == "encoded":
                return imaging.open_image(request.encoded, max_pixels=self.settings.max_image_pixels)
            return imaging.from_raw(request.raw, max_pixels=self.settings.max_image_pixels)
        except imaging.ImageError as error:
            raise invalid(str(error)) from error

    def _plan_scale(self, model: LoadedModel, original: tuple[int, int], scale: int,
                    passes: dense.PassPlan) -> assemble.ScaleJob:
        """Resized size, canvas bucket and kept cells of one scale; INVALID_ARGUMENT when the image cannot take it."""
        card = model.card
        size = dense.resized_size(*original, scale=scale, multiple=card.size_multiple)
        if size[0] * size[1] > self.settings.max_resized_pixels:
            raise invalid(
                f"scale {scale} resizes the {original[0]}x{original[1]} image to {size[0]}x{size[1]} = "
                f"{size[0] * size[1]} pixels, above the limit of {self.settings.max_resized_pixels} (--max-resized-pixels)"
            )
        try:
            cells = tuple(passes.factor * side for side in model.net_cells(*size))
        except DeviceGraphError as error:
            raise invalid(f"scale {scale} gives a {size[0]}x{size[1]} input model {model.name} cannot take: {error}") from error
        if 0 in cells:
            raise invalid(
                f"scale {scale} resizes the {original[0]}x{original[1]} image to {size[0]}x{size[1]}, smaller than "
                f"model {model.name}'s training size {card.training_height}x{card.training_width}; use a larger scale"
            )
        canvas = self._canvas(model, size, passes)
        if canvas is None:
            raise invalid(
                f"scale {scale} gives a {size[0]}x{size[1]} image (+{passes.slack} px for shifted passes) that no "
                f"canvas bucket holds ({model.buckets.describe()}); use a smaller scale, or restart the server "
                "with a larger --shape-buckets or without --strict-shapes"
            )
        return assemble.ScaleJob(scale, size, canvas, cells, self._batch_limit(model, canvas, scale, passes, original))

    def _canvas(self, model: LoadedModel, size: tuple[int, int], passes: dense.PassPlan) -> tuple[int, int] | None:
        """The canvas bucket of a resized size; one planned on demand, or None under --strict-shapes."""
        canvas = model.buckets.canvas_for(*size, slack=passes.slack)
        if canvas is None and not self.settings.strict_shapes:
            canvas = buckets.on_demand_canvas(*size, slack=passes.slack, multiple=model.multiple)
        return canvas

    def _check_response_size(self, request: scoring_pb2.ScoreRequest, model: LoadedModel,
                             jobs: list[assemble.ScaleJob]) -> None:
        expected = assemble.response_bytes(request, jobs, classes=model.classes,
                                           top_k=self._top_k(request),
                                           label_bytes=model.label_bytes)
        if expected > self.settings.max_message_bytes:
            raise ScoringError(
                Refusal.RESOURCE_EXHAUSTED,
                f"the response would be about {expected} bytes, above the server's --max-message-bytes "
                f"{self.settings.max_message_bytes}; ask for fewer `classes`, a smaller `cell_top_k`, "
                "`map_dtype` FLOAT16, fewer or smaller scales, or no maps",
            )

    def _batch_limit(self, model: LoadedModel, canvas: tuple[int, int], scale: int, passes: dense.PassPlan,
                     original: tuple[int, int]) -> int:
        """How many items of this canvas one batch may hold in memory (each runs all its passes), as a batch
        bucket: a batch is padded up to its bucket, so the limit is rounded down to one."""
        limit = model.admission.admit(*canvas, scale=scale,
                                      largest_scale=lambda: self._largest_scale(model, original, passes))
        items = limit // len(passes.offsets)
        if items == 0:
            raise ScoringError(
                Refusal.RESOURCE_EXHAUSTED,
                f"scale {scale} needs {len(passes.offsets)} passes of {canvas[0]}x{canvas[1]} at once but "
                f"only {limit} fit the memory budget; the largest scale that fits is "
                f"{self._largest_scale(model, original, passes)}",
            )
        return max(bucket for bucket in model.buckets.batches if bucket <= items) if items < model.buckets.batches[
            -1] else items

    def _largest_scale(self, model: LoadedModel, original: tuple[int, int], passes: dense.PassPlan) -> int:
        """The largest scale of this image whose passes fit the memory budget (0: none)."""
        step = model.multiple
        low, high = self._min_scale(model) // step - 1, self.settings.max_scale // step + 1  # low fits or is 0
        low = max(low, 0)
        while high - low > 1:
            middle = (low + high) // 2
            canvas = self._canvas(model, dense.resized_size(*original, scale=middle * step, multiple=step), passes)
            try:
                fits = canvas is not None and model.admission.batch_limit(*canvas) >= len(passes.offsets)
            except ProfileError:  # a size the net cannot take
                fits = False
            if fits:
                low = middle
            else:
                high = middle
        return low * step

    # --- run (the batcher's thread) -----------------------------------------------------------------
    def _run(self, model: LoadedModel, works: list[Work]) -> list[Scored]:
        group: GroupKey = works[0].key
        key = PlanKey(group.height, group.width, model.buckets.batch_for(len(works)), group.passes)
        items: list[Item] = [work.payload for work in works]
        wanted = {item.lattice for item in items}
        lattice = LATTICE if LATTICE in wanted else LATTICE_FP16 if LATTICE_FP16 in wanted else None
        return self._run_plan(model, key, items, lattice=lattice)

    def _run_plan(self, model: LoadedModel, key: PlanKey, items: list[Item], *, lattice: str | None) -> list[Scored]:
        """Run `items` (at most key.batch; the rest of the batch is padding) through the plan of `key`."""
        try:
            plan, planning = model.plans.get(key)
        except (DeviceGraphError, EngineError) as error:
            raise ScoringError(Refusal.FAILED_PRECONDITION,
                               f"model {model.name} cannot run {key}: {error}") from error
        if planning and items and self.metrics is not None:
            self.metrics.plans_made.labels(model.name).inc()  # a shape outside the warm-up's plans
        if planning:
            LOG.info("%s: planned %s in %.0f ms", model.name, key, 1000 * planning)
        pixels = np.empty((key.batch, key.height, key.width, 3), dtype=np.uint8)
        pixels[len(items):] = model.fill  # the batch bucket's padding: the canvases hold their own fill
        valid = np.zeros((key.batch, *plan.lattice_shape[2:]), dtype=np.float32)
        for index, item in enumerate(items):
            pixels[index] = item.canvas
            valid[index, :item.cells[0], :item.cells[1]] = 1.0
        if not items:
            valid[:, :1, :1] = 1.0  # a warm-up run: one cell each, so the averages are defined
        lattices, probabilities = plan.run(pixels, valid, lattice=lattice)
        return [
            Scored(
                lattices[index, :, :item.cells[0], :item.cells[1]].copy() if item.lattice else None,
                probabilities[index].copy(), planning if index == 0 else 0.0,
            )
            for index, item in enumerate(items)
        ]

    def _on_batch(self, model: LoadedModel, works: list[Work]) -> None:
        if self.metrics is not None and any(work.payload.traffic for work in works):
            group: GroupKey = works[0].key
            passes = model.buckets.batch_for(len(works)) * len(group.passes.offsets)  # the padded batch runs
            self.metrics.record_batch(model.name, len(works),
                                      model.admission.predicted_bytes(group.height, group.width, passes))

    # --- assemble ---------------------------------------------------------------------------------
    def _top_k(self, request: scoring_pb2.ScoreRequest) -> int:
        """How many of the image's classes the response lists."""
        return request.top_k or self.settings.default_top_k

    def _assemble(self, request: scoring_pb2.ScoreRequest, model: LoadedModel, passes: dense.PassPlan,
                  original: tuple[int, int], jobs: list[assemble.ScaleJob], flips: tuple[bool, ...],
                  scored: list[Scored]) -> scoring_pb2.ScoreResponse:
        response = scoring_pb2.ScoreResponse(
            model=model.name, request_id=request.request_id, image_height=original[0], image_width=original[1],
            execution_provider=self.engine.provider, output_stride=passes.stride, shift=passes.shift,
        )
        field = model.card.receptive_field
        first = (field.center_y - passes.slack, field.center_x - passes.slack)
        results = iter(scored)
        probabilities = []
        try:
            for job in jobs:
                mine = [next(results) for _flip in flips]
                probabilities.extend(result.probabilities for result in mine)
                lattices = None
                if mine[0].lattice is not None:
                    lattices = [mine[0].lattice] + [
                        dense.mirror_back(result.lattice, resized_width=job.resized[1], first_center_x=first[1],
                                          stride=passes.stride)
                        for result in mine[1:]
                    ]
                geometry = dense.cell_geometry(
                    original=original, resized=job.resized, canvas=job.canvas, cells=job.cells,
                    stride=passes.stride, field_size=field.size, first_center=first,
                )
                assemble.fill_scale_map(response.maps.add(), request, job, lattices, geometry,
                                        holes=passes.shift == scoring_pb2.SHIFT_DIAGONAL)
            response.top_k.extend(assemble.image_top_k(
                probabilities, self._top_k(request), model.label))
        except assemble.NonFiniteError as error:
            raise ScoringError(Refusal.INTERNAL, f"model {model.name} gave no usable scores: {error}") from error
        smallest = min(original)
        if jobs[0].scale / smallest > TINY_IMAGE_FACTOR and smallest < model.training_size:
            response.warnings.append(
                f"the image is {original[0]}x{original[1]}, far below model {model.name}'s training size "
                f"{model.training_size}: enlarged {jobs[0].scale / smallest:.1f}x, its scores may mean little"
            )
        return response

    def close(self) -> None:
        """Stop the batchers (queued work fails with UNAVAILABLE) and the decoding threads."""
        for model in self._models.values():
            model.batcher.close()
        self._models.clear()
        self._decoder.shutdown(wait=False, cancel_futures=True)
