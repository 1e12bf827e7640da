"""Loading a converted model and warming it up: its card, buckets and memory check; the plans to warm.

`load` builds a `Model` (server/scoring/model.py) and hands back its graph for the engine to plan;
`warm_up` has the engine make and run every configured plan, then scores a request at each offered stride, so
health never says SERVING over a broken model; `warm_up_tiles` has it make the tile canvas an image larger than
every bucket runs on.
"""

from __future__ import annotations

import logging
import pathlib
import threading
from collections.abc import Callable

import numpy as np
import onnx
from google.protobuf.message import DecodeError

from convert.arguments import format_bytes
from convert.card import CardError, ImageInput, Precision, batch_shape, read_card
from convert.profile import ProfileError
from protos import scoring_pb2
from server.engine.client import EngineClient, EngineFacts, PlanKey
from server.engine.device_graph import DeviceGraphError, scores_shape
from server.errors import Refusal, ScoringError, invalid
from server.geometry import buckets, dense
from server.memory.device import MemoryBudget, PlanMemory
from server.memory.host_budget import HostBudget
from server.metrics import Metrics
from server.scoring import imaging
from server.scoring.fitting import scale_job
from server.scoring.model import FALLBACK_SCALE, Model
from server.settings import Settings

LOG = logging.getLogger(__name__)
CONVERT_FIRST = "convert a classifier with `scoremap-convert`, then serve the .onnx file it writes"
WARM_UP_FAILURES_SHOWN = 3  # failed plans named in the warm-up error (the log line stays readable)


def load(name: str, path: str, *, settings: Settings, facts: EngineFacts, budget: MemoryBudget | None,
         host_budget: HostBudget, metrics: Metrics | None, share: int) -> tuple[Model, onnx.ModelProto]:
    """A model's card, buckets and memory check, with its graph for the engine to plan; it gets 1/`share` of the
    memory budget, since every model's batcher runs its batches concurrently with the others'. `budget`: the
    engine's, when it runs in this process (its plans are then accounted in it); None where the engine runs in a
    process of its own, whose memory budget (`facts`) this process predicts against."""
    try:
        net = onnx.load(path)
    except DecodeError as error:  # protobuf's own words ("Wire format was corrupt") say nothing to a user
        raise ScoringError(Refusal.INVALID_ARGUMENT, f"{path} is not an ONNX file (it does not parse as an ONNX "
                           f"model): {CONVERT_FIRST}") from error
    except OSError as error:
        raise ScoringError(Refusal.INVALID_ARGUMENT, f"{path}: {error}") from error
    if not net.graph.node:  # an empty file parses as an empty ModelProto
        raise ScoringError(Refusal.INVALID_ARGUMENT, f"{path} is not an ONNX file (it holds no graph): "
                           f"{CONVERT_FIRST}")
    try:
        card = read_card(net)
        image = ImageInput.of(card)
        imaging.resample_filter(image.resize_filter)
    except (CardError, imaging.ImageError) as error:
        raise ScoringError(Refusal.INVALID_ARGUMENT, f"{path}: {error}") from error
    if card.precision == Precision.PRECISION_INT8 and (refusal := facts.int8_refusal(card.quantization.weights)):
        raise ScoringError(Refusal.FAILED_PRECONDITION, f"{path}: {refusal}")
    name = name or card.name or pathlib.Path(path).stem  # never the folders, which ListModels would show
    total = facts.memory_budget_bytes
    plan_memory = PlanMemory(net, budget_bytes=total // share if total else None, device=facts.device, name=name,
                             shared=budget, metrics=metrics if budget is not None else None, runners=facts.runners)
    passes = [dense.passes_for(native_stride=card.output_stride, output_stride=s, shift=0)
              for s in dense.offered_strides(card.output_stride)]
    if settings.shape_buckets:
        shape_buckets = buckets.Buckets(settings.shape_buckets, buckets.batch_buckets(facts.max_batch))
    else:
        shape_buckets = buckets.default_buckets(
            scales=settings.warm_up_scales or (card.default_scale or FALLBACK_SCALE,),
            slacks=sorted({p.slack for p in passes}), multiple=card.size_multiple or card.output_stride,
            max_batch=facts.max_batch, every_step=not facts.on_gpu,
        )
    training = batch_shape(image.layout, batch=1, channels=3, height=card.training_height, width=card.training_width)
    try:
        (_batch, classes, _h, _w), _type = scores_shape(net, input_name=image.name, scores_name=card.scores_name,
                                                        input_shape=training)
    except DeviceGraphError as error:
        raise ScoringError(Refusal.INVALID_ARGUMENT, f"{path}: {error}") from error
    multiple = card.size_multiple or card.output_stride
    if any(side % multiple for side in settings.tile_canvas):
        height, width = (-(-side // multiple) * multiple for side in settings.tile_canvas)
        raise ScoringError(Refusal.INVALID_ARGUMENT,
                           f"--tile-canvas {settings.tile_canvas[0]}x{settings.tile_canvas[1]} is not a multiple of "
                           f"model {name}'s size multiple {multiple}; give e.g. {height}x{width}")
    model = Model(
        name=name, path=path, card=card, image=image, classes=classes, plan_memory=plan_memory,
        buckets=shape_buckets, fill=dense.mean_colour(card), limits=settings, host_budget=host_budget,
        strict_shapes=settings.strict_shapes, halo=settings.halo, tile_canvas=settings.tile_canvas,
        queue_depth=settings.queue_depth,
    )
    LOG.info("loaded %s from %s on %s (memory budget %s bytes, shared; canvases %s; batches %s)", name, path,
             facts.provider, total, shape_buckets.describe(), shape_buckets.batches)
    return model, net


def configured_plans(model: Model, scales: tuple[int, ...]) -> list[PlanKey]:
    """The plans traffic at the warm-up scales will use: each common aspect x stride x batch bucket."""
    keys = []
    for stride in model.strides:
        passes = dense.passes_for(native_stride=model.card.output_stride, output_stride=stride, shift=0)
        for scale in scales or (model.default_scale,):
            for tall, wide in buckets.COMMON_ASPECTS:
                size = dense.resized_size(tall, wide, scale=scale, multiple=model.multiple)
                canvas = model.buckets.canvas_for(*size, slack=passes.slack)
                if canvas is not None:
                    keys.extend(PlanKey(*canvas, batch, passes) for batch in model.buckets.batches)
    return list(dict.fromkeys(keys))


def tiled_plans(model: Model) -> list[PlanKey]:
    """The plans an image larger than every bucket runs on at the model's own stride: its tiles' canvas (the tile
    canvas by default), at each batch bucket a batch of its tiles may fill. Warmed up, so a phone photo scored at
    its own size makes no plan. Empty when such an image cannot be tiled within the budget (admission
    refuses it, naming why)."""
    passes = dense.passes_for(native_stride=model.card.output_stride, output_stride=0, shift=0)
    side = 2 * max(model.tile_canvas)  # larger than the tile canvas both ways: tiled
    try:
        job = scale_job(model, (side, side), side, passes, flip=False)
    except ScoringError as error:
        LOG.info("%s: no tile canvas warmed up: %s", model.name, error.message)
        return []
    if job.tiling is None:
        return []
    return [PlanKey(*job.canvas, batch, passes) for batch in model.buckets.batches if batch <= job.items_per_batch]


def check_warm_up_scales(models: list[Model], scales: tuple[int, ...]) -> None:
    """ScoringError(INVALID_ARGUMENT) naming --warm-up-scales and the fix, before any plan is made, for a warm-up
    scale the model cannot serve: below its smallest scale, above --max-scale, or with a plan predicted beyond
    the memory budget (never a generic warm-up error after the models have loaded)."""
    for model in models:
        for scale in scales or (model.default_scale,):
            named = (f"--warm-up-scales {scale}" if scales else
                     f"{model.name}'s default scale {scale} (the warm-up scale without --warm-up-scales)")
            if scale < model.training_size:
                raise invalid(f"{named} is below {model.name}'s training size {model.training_size}, the smallest "
                              f"input it can take: give --warm-up-scales of at least {model.training_size}")
            most = model.limits.max_scale
            if scale < model.min_scale or most is not None and scale > most:
                bounds = (f"[{model.min_scale}, {most}] (--min-scale, --max-scale)" if most is not None
                          else f"{model.min_scale} (--min-scale) and up")
                raise invalid(f"{named} is outside the scales requests may ask for, {bounds}: give --warm-up-scales "
                              "within them")
            total = model.plan_memory.shared.total_bytes if model.plan_memory.shared is not None else None
            model_budget, runners = model.plan_memory.budget_bytes, model.plan_memory.runners
            for key in configured_plans(model, (scale,)):
                try:
                    needed = model.plan_memory.predicted_bytes(key.height, key.width,
                                                             key.batch * len(key.passes.offsets))
                    # a batch of one must fit the model's share, its runners all running it: every request does
                    single = model.plan_memory.running_bytes(key.height, key.width, len(key.passes.offsets))
                except ProfileError:
                    continue  # a shape the net cannot take: warm-up names it
                if total is not None and needed > total:
                    raise invalid(f"{named}: {model.name}'s plan {key} is predicted to need {format_bytes(needed)}, "
                                  f"beyond the memory budget of {format_bytes(total)}: give a smaller "
                                  "--warm-up-scales, or a larger --memory-budget")
                if model_budget is not None and single > model_budget:
                    raise invalid(f"{named}: one image on {model.name}'s canvas {key.height}x{key.width} is predicted "
                                  f"to need {format_bytes(single)}{model.plan_memory.runners_said}, beyond the memory "
                                  f"budget of {format_bytes(model_budget)} it may use: give a smaller --warm-up-scales"
                                  f"{', fewer --cpu-runners' * (runners > 1)}, or a larger --memory-budget")


def warm_up(models: list[Model], scales: tuple[int, ...], engine: EngineClient,
            score: Callable[[scoring_pb2.ScoreRequest], scoring_pb2.ScoreResponse], *,
            stop: threading.Event | None = None) -> None:
    """Make and run every configured plan of every model, then `score` a gray request at each offered stride;
    ScoringError(UNAVAILABLE) naming every failure. Once `stop` is set (the server is stopping) it returns at the
    next plan or request, with no error: a plan being made cannot be interrupted."""
    stop = threading.Event() if stop is None else stop
    failures = []
    for model in models:
        for key in configured_plans(model, scales):
            if stop.is_set():
                return
            failures += engine.warm(model.name, [key])  # any failure keeps the server NOT_SERVING, and says why
        if failures:
            continue
        scale = (scales or (model.default_scale,))[0]
        gray = np.full((scale, scale, 3), 128, dtype=np.uint8)
        for stride in model.strides:
            if stop.is_set():
                return
            request = scoring_pb2.ScoreRequest(
                model=model.name, scales=[scale], output_stride=stride, return_maps=True,
                raw=scoring_pb2.RawImage(data=gray.tobytes(), height=scale, width=scale, channels=3),
            )
            try:
                score(request)
            except ScoringError as error:
                failures.append(f"{model.name} at scale {scale} stride {stride}: {error.message}")
    if failures and not stop.is_set():  # stopping fails what was queued: no failure of the model's
        shown = failures[:WARM_UP_FAILURES_SHOWN]
        more = f"; and {len(failures) - len(shown)} more" if len(failures) > len(shown) else ""
        raise ScoringError(Refusal.UNAVAILABLE, "warm-up failed: " + "; ".join(shown) + more)


def warm_up_tiles(models: list[Model], engine: EngineClient, *, stop: threading.Event | None = None) -> None:
    """Make and run every model's tile canvas plans (`tiled_plans`), which only images larger than every bucket
    use: the server does it once SERVING (2 s of its start-up for the default model on 2 cores), so a phone photo
    arriving later makes no plan. They are made in the background (server.engine.plans.PlanCache.get): a request's
    own plan is never made behind one. A failure is logged: such an image makes the plan on demand, or is refused with the reason.
    Once `stop` is set it returns at the next plan."""
    for model in models:
        for key in tiled_plans(model):
            if stop is not None and stop.is_set():
                return
            failed = engine.warm(model.name, [key], background=True)
            if failed:
                if stop is not None and stop.is_set():
                    return  # its run was ended: the server is stopping
                LOG.warning("%s: tile canvas plan not made: %s", model.name, failed[0])
            else:
                LOG.info("%s: tile canvas plan %s ready", model.name, key)
