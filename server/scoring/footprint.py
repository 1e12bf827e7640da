"""A request's footprint before compute, and what would fit when it is too large.

What a request will hold on the host (`host_estimate`: server/memory/host.py's terms over its scale jobs)
and send back (`response_bytes`) follow from the image's header and the request's options. Admission
refuses either past its limit (--max-request-host-bytes, --max-message-bytes): those limits, not a size
cap, decide how large a request may be, so a phone photo at its own size is scored when it fits.
A refusal then names what would fit (`what_fits`), found with these same estimates over the jobs
`fitting.scale_job` makes, so what it suggests is what admission takes: the largest scale, the model's own
stride, no flip, lighter maps (float16, fewer classes, cell top-k instead), each in the request's words.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from convert.memory_model import Device
from protos import scoring_pb2
from server.engine.device_graph import LATTICE_FP16
from server.errors import ScoringError
from server.geometry import dense
from server.memory.host import DEVICE_PASSES, RGB, HostEstimate, TiledScale, estimate_request
from server.scoring.fitting import largest_fitting, scale_job
from server.scoring.request import ScaleJob, lattice_classes, lattice_output, top_k

if TYPE_CHECKING:
    from server.scoring.imaging import OpenedImage
    from server.scoring.model import Model

__all__ = ["host_estimate", "oversized_scale", "queue_items", "response_bytes", "what_fits"]

FLOAT16_BYTES, FLOAT32_BYTES, INT32_BYTES = 2, 4, 4
OVERHEAD_BYTES = 4096  # geometry, timings, model name, warnings and framing of a response, generously
ENTRY_FRAMING_BYTES = 8  # an image-level top-k entry's tags and lengths
CELL_TOP_K_BYTES = INT32_BYTES + FLOAT32_BYTES  # a cell's index and score


def host_estimate(request: scoring_pb2.ScoreRequest, model: Model, opened: OpenedImage, jobs: Sequence[ScaleJob],
                  passes: dense.Passes) -> HostEstimate:
    """The host memory the request holds at its peak, from its jobs (server/memory/host.py): its lattices of the
    classes the host keeps (`lattice_classes`), and one batch's lattice of every class as it comes back."""
    wanted = lattice_output(request)
    itemsize = 0 if wanted is None else FLOAT16_BYTES if wanted == LATTICE_FP16 else FLOAT32_BYTES
    estimate = estimate_request(
        encoded_bytes=opened.encoded_bytes, image_size=(opened.height, opened.width),
        resized_sizes=[job.canvas for job in jobs if job.tiling is None], passes=len(passes.offsets),
        flip=request.flip, classes=len(lattice_classes(request)) or model.classes,
        native_stride=model.card.output_stride, output_stride=passes.stride, path=DEVICE_PASSES,
        tiled=[TiledScale(job.resized, job.canvas, len(job.tiles), max(t.cells[0] * t.cells[1] for t in job.tiles))
               for job in jobs if job.tiling is not None],
        lattice_itemsize=itemsize,
    )
    batch = max((min(job.items_per_batch, model.buckets.batches[-1]) * -(-job.canvas[0] // passes.stride)
                 * -(-job.canvas[1] // passes.stride) for job in jobs), default=0)
    # A CPU plan gives its lattice back in float32 whatever the request asked (device_graph: no half lattice there).
    returned = itemsize if wanted is None or model.plan_memory.device == Device.CUDA else FLOAT32_BYTES
    return dataclasses.replace(estimate, maps=estimate.maps + batch * model.classes * returned)


def response_bytes(request: scoring_pb2.ScoreRequest, model: Model, jobs: Sequence[ScaleJob]) -> int:
    """An upper estimate of the response's size, known before any compute: the maps, the cells' top-k,
    the image's top-k entries, each with a label of up to the model's longest, and the echoed request id."""
    classes = model.classes
    total = OVERHEAD_BYTES + len(request.request_id.encode()) + min(top_k(request, model.limits), classes) * (
        INT32_BYTES + FLOAT32_BYTES + model.label_bytes + ENTRY_FRAMING_BYTES)
    for job in jobs:
        cells = job.cells[0] * job.cells[1]
        if request.return_maps:
            total += cells * (len(request.classes) or classes) * map_itemsize(request)
        total += cells * min(request.cell_top_k, classes) * CELL_TOP_K_BYTES
    return total


def queue_items(jobs: Sequence[ScaleJob], *, orientations: int) -> int:
    """The queue places a request's jobs take: one per untiled scale or tile, and orientation (2 with its mirror)."""
    return sum(job.parts for job in jobs) * orientations


def map_itemsize(request: scoring_pb2.ScoreRequest) -> int:
    return FLOAT16_BYTES if request.map_dtype == scoring_pb2.FLOAT16 else FLOAT32_BYTES


Fits = Callable[[scoring_pb2.ScoreRequest, list[ScaleJob], dense.Passes], bool]


def resized_bytes(model: Model, original: tuple[int, int], scale: int) -> int:
    """The RGB bytes of a scale's resized image: the least of its host memory, known before a tile is planned."""
    height, width = dense.resized_size(*original, scale=scale, multiple=model.card.size_multiple)
    return height * width * RGB


def oversized_scale(model: Model, original: tuple[int, int], scales: Sequence[int]) -> tuple[int, int] | None:
    """The first scale whose resized image alone is beyond --max-request-host-bytes, with its RGB bytes: refused
    before its tiles are planned (no size cap by default: a scale of 10**6 px would have millions)."""
    limit = model.limits.max_request_host_bytes
    return next(((scale, alone) for scale in scales if (alone := resized_bytes(model, original, scale)) > limit),
                None)


def what_fits(request: scoring_pb2.ScoreRequest, model: Model, opened: OpenedImage, jobs: list[ScaleJob] | None,
              passes: dense.Passes) -> list[str]:
    """The changes to the request, each alone, that bring it within every size limit admission checks (its
    tiles within --queue-depth, its response within --max-message-bytes, its host memory estimate within
    --max-request-host-bytes), in the request's words: the largest scale, the model's own stride, no flip,
    lighter maps (these only with `jobs`, the request's own). Empty when none does."""
    limits = model.limits

    def fits(changed: scoring_pb2.ScoreRequest, changed_jobs: list[ScaleJob], changed_passes: dense.Passes) -> bool:
        host = host_estimate(changed, model, opened, changed_jobs, changed_passes).total
        return (queue_items(changed_jobs, orientations=2 if changed.flip else 1) <= model.queue_depth
                and host <= limits.max_request_host_bytes
                and response_bytes(changed, model, changed_jobs) <= limits.max_message_bytes)

    found = []
    scale = largest_scale(request, model, opened, passes, fits)
    if scale:
        several = sum(s > scale for s in scales_of(request, model)) > 1
        found.append(f"{'scales' if several else 'a scale'} of at most {scale} (`scales`)")
    native = model.card.output_stride
    if passes.stride != native:
        coarser = changed_request(request, output_stride=native, shift=scoring_pb2.SHIFT_UNSPECIFIED)
        if variant_fits(coarser, model, opened, fits):
            found.append(f"the model's own stride {native} (`stride`, output_stride)")
    if request.flip and variant_fits(changed_request(request, flip=False), model, opened, fits):
        found.append("no flip (`flip` false)")
    return found + (lighter_maps(request, model, jobs, passes, fits) if jobs else [])


def lighter_maps(request: scoring_pb2.ScoreRequest, model: Model, jobs: list[ScaleJob], passes: dense.Passes,
                 fits: Fits) -> list[str]:
    """Maps in float16, maps of fewer classes, or each cell's top-k classes instead of maps: the most of each
    that fits."""
    found = []
    if request.return_maps:
        if request.map_dtype != scoring_pb2.FLOAT16 and fits(changed_request(request, map_dtype=scoring_pb2.FLOAT16),
                                                             jobs, passes):
            found.append("`map_dtype` float16")
        asked = len(request.classes) or model.classes
        for dtype, name in ((scoring_pb2.FLOAT32, "float32"), (scoring_pb2.FLOAT16, "float16")):
            most = most_classes(request, model, jobs, passes, fits, dtype)
            if 0 < most < asked:
                found.append(f"maps of at most {most} `classes` in {name}")
    if request.return_maps or request.cell_top_k:
        without = changed_request(request, return_maps=False, cell_top_k=0)
        most = largest_fitting(lambda k: fits(changed_request(without, cell_top_k=k), jobs, passes),
                             model.classes if request.return_maps else request.cell_top_k - 1)
        if most:
            found.append(f"{'no maps but ' if request.return_maps else ''}each cell's top {most} classes "
                         f"({'`return_maps` false, ' if request.return_maps else ''}`cell_top_k` {most})")
        elif fits(without, jobs, passes):
            found.append(f"no maps{' nor cell top-k' if request.cell_top_k else ''} (`return_maps` false, "
                         "`cell_top_k` 0)")
    return found


def most_classes(request: scoring_pb2.ScoreRequest, model: Model, jobs: list[ScaleJob], passes: dense.Passes,
                 fits: Fits, dtype: int) -> int:
    """The most classes whose maps of `dtype` fit (the first ones asked, or the model's first)."""
    chosen = list(request.classes) or list(range(model.classes))
    return largest_fitting(lambda n: fits(changed_request(request, classes=chosen[:n], map_dtype=dtype), jobs, passes),
                         len(chosen))


def largest_scale(request: scoring_pb2.ScoreRequest, model: Model, opened: OpenedImage, passes: dense.Passes,
                  fits: Fits) -> int:
    """The largest scale S (a multiple of the model's size multiple) at which the request, each of its scales
    capped at S, fits; 0 when none at or above the smallest scale does."""
    step, scales = model.multiple, scales_of(request, model)
    lowest = -(-model.min_scale // step)

    def capped(steps: int) -> bool:
        return variant_fits(changed_request(request, scales=sorted({min(s, steps * step) for s in scales})), model,
                            opened, fits, passes)

    if max(scales) // step < lowest or not capped(lowest):
        return 0
    # `lowest` fits; the request's own largest, rounded up, does not
    return largest_fitting(capped, -(-max(scales) // step) - 1, least=lowest) * step


def variant_fits(changed: scoring_pb2.ScoreRequest, model: Model, opened: OpenedImage, fits: Fits,
                 passes: dense.Passes | None = None) -> bool:
    """Whether a changed request would be admitted on its size: its jobs made as admission makes them."""
    original, scales = (opened.height, opened.width), scales_of(changed, model)
    if oversized_scale(model, original, scales) is not None:
        return False
    try:
        passes = passes or dense.passes_for(native_stride=model.card.output_stride,
                                            output_stride=changed.output_stride, shift=changed.shift)
        jobs = [scale_job(model, original, scale, passes, flip=changed.flip) for scale in scales]
    except (ScoringError, dense.PassesError):
        return False
    return fits(changed, jobs, passes)


def scales_of(request: scoring_pb2.ScoreRequest, model: Model) -> list[int]:
    return list(request.scales) or [model.default_scale]


def changed_request(request: scoring_pb2.ScoreRequest, **fields) -> scoring_pb2.ScoreRequest:
    """A copy of the request's options (not its image) with `fields` set."""
    changed = scoring_pb2.ScoreRequest(
        model=request.model, scales=request.scales, output_stride=request.output_stride, shift=request.shift,
        flip=request.flip, return_maps=request.return_maps, map_dtype=request.map_dtype, classes=request.classes,
        cell_top_k=request.cell_top_k, top_k=request.top_k, request_id=request.request_id)
    for name, value in fields.items():
        if isinstance(value, (list, tuple)):
            changed.ClearField(name)
            getattr(changed, name).extend(value)
        else:
            setattr(changed, name, value)
    return changed
