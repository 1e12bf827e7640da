"""The in-process scoring pipeline: request in, response out, no gRPC needed.

The servicer is a thin adapter over it and `scoremap-score --local` runs it directly. Per scale:
decode, resize (card's filter), normalize (card's preprocessing), cut the shifted (and mirrored)
passes, run them through the model's batcher, interleave, average flips, post-process.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np
import onnx
from google.protobuf.message import DecodeError
from PIL import Image

from convert.card import CardError, Precision, is_logits, label, read_card
from protos import model_card_pb2, scoring_pb2
from server import dense, imaging
from server.admission import Admission, available_memory_bytes
from server.batcher import Batcher
from server.engine import Engine
from server.errors import ScoringError
from server.metrics import Metrics
from server.settings import Settings

LOG = logging.getLogger(__name__)
FALLBACK_SCALE = 384  # when a card names no default scale


@dataclass
class LoadedModel:
    """A model ready to score: its card, session, batcher and memory admission."""

    name: str
    path: str
    card: model_card_pb2.ModelCard
    engine: Engine
    batcher: Batcher
    admission: Admission
    classes: int

    @property
    def default_scale(self) -> int:
        return self.card.default_scale or FALLBACK_SCALE

    def label(self, index: int) -> str:
        return self.card.labels[index] if index < len(self.card.labels) else str(index)


@dataclass(frozen=True)
class PassGroup:
    """The passes of one scale and one orientation: where they sit in the request's list of passes."""

    scale: int
    size: tuple[int, int]
    flip: bool
    passes: slice


def invalid(message: str) -> ScoringError:
    return ScoringError(grpc.StatusCode.INVALID_ARGUMENT, message)


class Pipeline:
    """Loads converted models and scores requests against them."""

    def __init__(
        self, model_paths: Sequence[str], *, settings: Settings | None = None, metrics: Metrics | None = None
    ) -> None:
        if not model_paths:
            raise ScoringError(grpc.StatusCode.INVALID_ARGUMENT, "no model given: pass at least one converted .onnx file")
        self.settings = settings or Settings()
        self.metrics = metrics
        self._models: dict[str, LoadedModel] = {}
        try:
            for path in model_paths:
                model = self._load(str(path), share=len(model_paths))
                if model.name in self._models:
                    model.batcher.close()
                    raise ScoringError(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"two models are named {model.name!r} ({self._models[model.name].path} and {path})",
                    )
                self._models[model.name] = model
            if metrics is not None:
                metrics.track_queue_depth(lambda: sum(m.batcher.depth() for m in self._models.values()))
            if self.settings.warm_up:
                self.warm_up()
        except BaseException:
            self.close()
            raise

    # --- loading ------------------------------------------------------------------------------
    def _load(self, path: str, *, share: int) -> LoadedModel:
        """Card, session, batcher and admission for one model; it gets 1/`share` of the memory budget,
        since every model's batcher runs its batches concurrently with the others'."""
        try:
            graph = onnx.load(path, load_external_data=False)  # read once: admission profiles this copy
            card = read_card(graph)
        except (CardError, DecodeError, OSError) as error:
            raise ScoringError(grpc.StatusCode.INVALID_ARGUMENT, f"{path}: {error}") from error
        settings = self.settings
        engine = Engine(path, input_name=card.preprocessing.input_name, output_name=card.scores_name, settings=settings)
        budget = settings.memory_budget_bytes
        if budget is None:
            budget = engine.free_gpu_bytes()
        if budget is None:
            available = available_memory_bytes()
            budget = int(available * settings.cpu_memory_fraction) if available else None
        if budget is not None:
            budget //= share
        admission = Admission(graph, budget_bytes=budget)
        output_shape = engine.session.get_outputs()[0].shape
        classes = output_shape[1] if isinstance(output_shape[1], int) else len(card.labels)
        name = card.name or path
        preprocessing = card.preprocessing

        def run(images: list[np.ndarray]) -> np.ndarray:
            return engine.run(imaging.to_batch(images, preprocessing))

        def on_batch(shape: tuple[int, ...], size: int) -> None:
            if self.metrics is not None:
                self.metrics.batch_size.labels(name).observe(size)
                self.metrics.batch_memory.labels(name).observe(admission.predicted_bytes(shape[0], shape[1], size))

        batcher = Batcher(
            run,
            max_batch=settings.batch_limit(on_gpu=engine.on_gpu),
            max_delay_seconds=settings.max_queue_delay_ms / 1000,
            queue_depth=settings.queue_depth,
            on_batch=on_batch,
            name=name,
        )
        LOG.info("loaded %s from %s on %s (memory budget %s bytes)", name, path, engine.provider, budget)
        return LoadedModel(name, path, card, engine, batcher, admission, classes)

    def warm_up(self) -> None:
        """Run every warm-up scale at every stride each model offers, so first requests pay no set-up."""
        for model in list(self._models.values()):
            native = model.card.output_stride or 32
            strides = [native, native // 2] if native >= 32 else [native]
            for scale in self.settings.warm_up_scales or (model.default_scale,):
                gray = np.full((scale, scale, 3), 128, dtype=np.uint8)
                for stride in strides:
                    request = scoring_pb2.ScoreRequest(
                        model=model.name,
                        raw=scoring_pb2.RawImage(data=gray.tobytes(), height=scale, width=scale, channels=3),
                        scales=[scale], output_stride=stride,
                    )
                    try:
                        self.score(request)
                    except ScoringError as error:
                        LOG.warning("warm-up of %s at scale %d stride %d skipped: %s", model.name, scale, stride, error)

    # --- queries ------------------------------------------------------------------------------
    def models(self) -> list[scoring_pb2.ModelSummary]:
        return [
            scoring_pb2.ModelSummary(
                name=m.name, classes=m.classes, output_stride=m.card.output_stride,
                precision=label(Precision, m.card.precision), path=m.path,
            )
            for m in self._models.values()
        ]

    def card(self, name: str) -> model_card_pb2.ModelCard:
        return self._model(name).card

    def provider(self, name: str = "") -> str:
        return self._model(name).engine.provider

    def _model(self, name: str) -> LoadedModel:
        if not name:
            if len(self._models) == 1:
                return next(iter(self._models.values()))
            raise invalid(f"several models are loaded ({', '.join(self._models)}): name one in the request's `model`")
        try:
            return self._models[name]
        except KeyError:
            raise ScoringError(
                grpc.StatusCode.NOT_FOUND, f"no model named {name!r}; loaded: {', '.join(self._models)}"
            ) from None

    # --- scoring ------------------------------------------------------------------------------
    def score(
        self,
        request: scoring_pb2.ScoreRequest,
        *,
        deadline: float | None = None,
        cancelled: threading.Event | None = None,
    ) -> scoring_pb2.ScoreResponse:
        """Score one request; `deadline` is a time.monotonic() instant, `cancelled` set when the caller left."""
        started = time.monotonic()
        model = self._model(request.model)
        scales, plan = self._validate(request, model)

        image = self._decode(request)
        original = (image.height, image.width)
        groups: list[PassGroup] = []
        passes: list[np.ndarray] = []
        limits: list[int] = []
        for scale in scales:
            size = self._size(model, original, scale)
            limit = model.admission.admit(*size, scale=scale, largest_scale=lambda: self._largest_scale(model, original))
            pixels = imaging.normalize(
                imaging.resize(image, size, filter_name=model.card.preprocessing.resize_filter), model.card.preprocessing
            )
            for flip in (False, True) if request.flip else (False,):
                windows = dense.pass_images(pixels, plan, flip=flip)
                groups.append(PassGroup(scale, size, flip, slice(len(passes), len(passes) + len(windows))))
                passes.extend(windows)
                limits.extend([limit] * len(windows))
        preprocessed = time.monotonic()

        works = model.batcher.submit(passes, limits=limits, deadline=deadline)
        scores = model.batcher.wait(works, cancelled=cancelled)
        computed = time.monotonic()

        response = scoring_pb2.ScoreResponse(
            model=model.name, request_id=request.request_id, image_height=original[0], image_width=original[1],
            execution_provider=model.engine.provider, output_stride=plan.stride, shift=plan.shift,
        )
        probabilities = []
        for scale in scales:
            mine = [group for group in groups if group.scale == scale]
            lattices = [self._lattice(model, plan, group, scores[group.passes]) for group in mine]
            logits = is_logits(model.card)
            probabilities.extend(dense.mean_probabilities(lattice, logits=logits) for lattice in lattices)
            lattice = dense.average_flips(lattices)
            response.maps.append(self._scale_map(request, model, plan, scale, original, mine[0].size, lattice))
        top_k = request.top_k or self.settings.default_top_k
        for index, probability in dense.top_k(np.mean(probabilities, axis=0), top_k):
            response.top_k.append(scoring_pb2.Label(index=index, label=model.label(index), probability=probability))
        finished = time.monotonic()

        queue = max(w.started - w.enqueued for w in works)
        inference = sum({w.batch_id: w.run_seconds for w in works}.values())
        timings = response.timings
        timings.queue_ms = 1000 * queue
        timings.preprocess_ms = 1000 * (preprocessed - started)
        timings.inference_ms = 1000 * inference
        timings.postprocess_ms = 1000 * (finished - computed)
        timings.total_ms = 1000 * (finished - started)
        if self.metrics is not None:
            self.metrics.observe_stages({
                "queue": queue, "preprocess": preprocessed - started,
                "inference": inference, "postprocess": finished - computed,
            })
        return response

    @staticmethod
    def _lattice(model: LoadedModel, plan: dense.PassPlan, group: PassGroup, scores: list[np.ndarray]) -> np.ndarray:
        """One scale's lattice from its passes; a mirrored one moved back onto the unmirrored sites."""
        lattice = dense.interleave(scores, plan, flip=group.flip)
        if not group.flip:
            return lattice
        return dense.align(lattice, dense.mirror_shift(
            resized_width=group.size[1], center_x=model.card.receptive_field.center_x,
            native_stride=model.card.output_stride or 32, pass_width=scores[0].shape[-1], stride=plan.stride,
        ))

    def _validate(self, request: scoring_pb2.ScoreRequest, model: LoadedModel) -> tuple[list[int], dense.PassPlan]:
        settings = self.settings
        scales = list(request.scales) or [model.default_scale]
        if len(scales) > settings.max_scales:
            raise invalid(f"{len(scales)} scales requested; at most {settings.max_scales} are allowed (--max-scales)")
        for scale in scales:
            if not settings.min_scale <= scale <= settings.max_scale:
                raise invalid(
                    f"scale {scale} is outside [{settings.min_scale}, {settings.max_scale}] "
                    "(the target shorter side in pixels)"
                )
        if len(set(scales)) != len(scales):
            raise invalid(f"scales {scales} repeat a value; give each scale once")
        if request.top_k < 0 or request.cell_top_k < 0:
            raise invalid(f"top_k and cell_top_k must be >= 0; received {request.top_k} and {request.cell_top_k}")
        bad = [c for c in request.classes if not 0 <= c < model.classes]
        if bad:
            raise invalid(f"classes {bad} are out of range: model {model.name} has classes 0..{model.classes - 1}")
        if request.map_dtype not in (scoring_pb2.MAP_DTYPE_UNSPECIFIED, scoring_pb2.FLOAT32, scoring_pb2.FLOAT16):
            raise invalid(f"map_dtype {request.map_dtype} is not FLOAT32 or FLOAT16")
        if request.output_stride < 0:
            raise invalid(f"output_stride must be 0 (native) or positive; received {request.output_stride}")
        try:
            plan = dense.plan_passes(
                native_stride=model.card.output_stride or 32, output_stride=request.output_stride, shift=request.shift
            )
        except dense.PlanError as error:
            raise invalid(f"model {model.name}: {error}") from error
        return scales, plan

    def _decode(self, request: scoring_pb2.ScoreRequest) -> Image.Image:
        kind = request.WhichOneof("image")
        try:
            if kind == "encoded":
                return imaging.decode(request.encoded, max_pixels=self.settings.max_image_pixels)
            if kind == "raw":
                return imaging.from_raw(request.raw, max_pixels=self.settings.max_image_pixels)
        except imaging.ImageError as error:
            raise invalid(str(error)) from error
        raise invalid("the request has no image: set `encoded` (JPEG, PNG, WebP, BMP, TIFF bytes) or `raw` pixels")

    def _size(self, model: LoadedModel, original: tuple[int, int], scale: int) -> tuple[int, int]:
        size = dense.resized_size(*original, scale=scale, multiple=model.card.size_multiple)
        if size[0] * size[1] > self.settings.max_resized_pixels:
            raise invalid(
                f"scale {scale} resizes the {original[0]}x{original[1]} image to {size[0]}x{size[1]} = "
                f"{size[0] * size[1]} pixels, above the limit of {self.settings.max_resized_pixels} (--max-resized-pixels)"
            )
        return size

    def _largest_scale(self, model: LoadedModel, original: tuple[int, int]) -> int:
        """The largest scale of this image whose single pass fits the memory budget (0: none)."""
        step = max(model.card.size_multiple, 1)
        low, high = 0, self.settings.max_scale // step + 1  # low*step fits (0: nothing yet), high does not
        while high - low > 1:
            middle = (low + high) // 2
            if model.admission.fits(*dense.resized_size(*original, scale=middle * step, multiple=step)):
                low = middle
            else:
                high = middle
        return low * step

    def _scale_map(
        self,
        request: scoring_pb2.ScoreRequest,
        model: LoadedModel,
        plan: dense.PassPlan,
        scale: int,
        original: tuple[int, int],
        size: tuple[int, int],
        lattice: np.ndarray,
    ) -> scoring_pb2.ScaleMap:
        field = model.card.receptive_field
        geometry = dense.cell_geometry(
            original=original, resized=size, stride=plan.stride,
            field_size=field.size, field_center=(field.center_y, field.center_x),
        )
        scale_map = scoring_pb2.ScaleMap(scale=scale, height=lattice.shape[1], width=lattice.shape[2], geometry=geometry)
        if request.return_maps:
            chosen = lattice[list(request.classes)] if request.classes else lattice
            scale_map.classes.extend(request.classes)
            dtype = "float16" if request.map_dtype == scoring_pb2.FLOAT16 else "float32"
            scale_map.scores.CopyFrom(tensor(chosen, dtype))
        if request.cell_top_k:
            indices, values = dense.cell_top_k(lattice, request.cell_top_k)
            scale_map.cell_top_k_indices.CopyFrom(tensor(indices, "int32"))
            scale_map.cell_top_k_scores.CopyFrom(tensor(values, "float32"))
        return scale_map

    def close(self) -> None:
        """Stop the batchers (queued work fails with UNAVAILABLE)."""
        for model in self._models.values():
            model.batcher.close()
        self._models.clear()


def tensor(array: np.ndarray, dtype: str) -> scoring_pb2.Tensor:
    """Packed little-endian bytes with dtype and shape."""
    packed = np.ascontiguousarray(array, dtype=np.dtype(dtype).newbyteorder("<"))
    return scoring_pb2.Tensor(dtype=dtype, shape=list(array.shape), data=packed.tobytes())
