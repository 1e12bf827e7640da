"""The assemble stage: the plans' outputs of one request into its response (`response`), and its timings.

Per scale: the kept lattices (the mirrored one moved back; a tiled scale's tiles stitched into one map,
stated in its `tiling`), averaged over flips, as maps, per-cell top-k and geometry; over everything:
the image-level top-k from the mean of the device's per-image probabilities (VGG's dense evaluation;
a tiled scale's tiles weighted by the cells each counts). Tensors are written as bytes once. A response
is finite or an error: the only NaN allowed is a diagonal shift's unscored cell, which the
contract documents.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from protos import scoring_pb2
from server.geometry import dense, tiling
from server.errors import Refusal, ScoringError
from server.metrics import Stage
from server.scoring.request import ItemKey, ScaleJob, Scored, lattice_classes, top_k

if TYPE_CHECKING:
    from server.scoring.admission import Ticket
    from server.engine.client import Ran

# An image below the training size enlarged more than this many times is scored with a warning: beyond 3x,
# a 3x3 stem convolution sees only the interpolation between two source pixels, never an edge (100x100 at
# scale 384 is 3.84x: warned).
TINY_IMAGE_FACTOR = 3


class NonFiniteError(ArithmeticError):
    """The net produced NaN or infinity where a score belongs; the message says where."""


def fill_scale_map(
    scale_map: scoring_pb2.ScaleMap, request: scoring_pb2.ScoreRequest, job: ScaleJob,
    lattices: list[np.ndarray] | None, geometry: scoring_pb2.MapGeometry, *, holes: bool,
) -> None:
    """Fill one scale's map message in place, the response's own, so a map's bytes are copied twice (the
    packed array, then protobuf's copy: the least Python allows; a message built apart and appended took
    four); `lattices` (unmirrored first, mirrored-back next) only when maps or cell top-k are asked. On
    NonFiniteError the message is left part-filled: the response is to be dropped."""
    scale_map.scale, scale_map.height, scale_map.width = job.scale, *job.cells
    scale_map.geometry.CopyFrom(geometry)
    if lattices is None:
        return

    def require_finite_map(values: np.ndarray) -> None:
        # A diagonal shift's unscored cells are NaN by contract; a NaN the net gave shows in the probabilities.
        # A score beyond float16's range (the device's half lattice, or maps cast for sending) is infinite.
        half = " in float16 (ask for map_dtype FLOAT32)" if values.dtype == np.float16 else ""
        require_finite(values[~np.isnan(values)] if holes else values, f"the score map at scale {job.scale}{half}")

    lattice = dense.average_flips(lattices)
    require_finite_map(lattice)
    if request.return_maps:
        chosen = lattice[list(request.classes)] if request.classes and not lattice_classes(request) else lattice
        if request.map_dtype == scoring_pb2.FLOAT16 and chosen.dtype != np.float16:  # ranked in float32
            chosen = chosen.astype(np.float16)
            require_finite_map(chosen)
        scale_map.classes.extend(request.classes)
        write_tensor(scale_map.scores, chosen, "float16" if request.map_dtype == scoring_pb2.FLOAT16 else "float32")
    if request.cell_top_k:
        indices, values = dense.cell_top_k(lattice, request.cell_top_k)
        write_tensor(scale_map.cell_top_k_indices, indices, "int32")
        write_tensor(scale_map.cell_top_k_scores, values, "float32")


def scale_lattice(job: ScaleJob, parts: list[Scored], *, mirrored: bool, first_center_x: float,
                  stride: int) -> np.ndarray:
    """One orientation's [K, *job.cells] lattice on the unmirrored cells: its one item's, or its tiles' owned
    cells stitched (each mirrored tile moved back within itself first)."""
    def unmirrored(lattice: np.ndarray, width: int) -> np.ndarray:
        if not mirrored:
            return lattice
        return dense.mirror_back(lattice, resized_width=width, first_center_x=first_center_x, stride=stride)

    if job.tiling is None:
        return unmirrored(parts[0].lattice, job.resized[1])
    out = np.full((parts[0].lattice.shape[0], *job.cells), np.nan, dtype=parts[0].lattice.dtype)
    for tile, result in zip(job.tiles, parts):
        tiling.stitch_into(out, tile.tile, unmirrored(result.lattice, tile.tile.x.length))
    return out


def scale_probabilities(job: ScaleJob, parts: list[Scored], passes: dense.Passes, *, mirrored: bool) -> np.ndarray:
    """One orientation's image-level probabilities: its one item's, or its tiles' weighted by the cells each
    counted (its own), so the mean is the one pass's over every cell."""
    if job.tiling is None:
        return parts[0].probabilities
    weights = np.array([dense.scored_cells(passes, *(tile.kept_mirrored if mirrored else tile.kept))
                        for tile in job.tiles], dtype=np.float64)
    counted = weights > 0  # a tile counting no cell gave no mean (0/0)
    stacked = np.stack([result.probabilities for result in parts])[counted]
    return (np.tensordot(weights[counted], stacked, axes=1) / weights.sum()).astype(np.float32)


def one_pass_canvas(job: ScaleJob) -> tuple[int, int]:
    """The canvas one pass over the scale's image has: its own, or, tiled, the one an edge tile ends like."""
    if job.tiling is None:
        return job.canvas
    return tuple(side + lattice.fill(side) for side, lattice in zip(job.resized, job.tiling.lattices))


def image_top_k(probabilities: list[np.ndarray], k: int, labels) -> list[scoring_pb2.Label]:
    """The k most probable classes over every scale and flip; labels[i] names class i."""
    mean = np.mean(probabilities, axis=0)
    require_finite(mean, "the image-level probabilities")
    return [
        scoring_pb2.Label(index=index, label=labels(index), probability=probability)
        for index, probability in dense.top_k(mean, k)
    ]


def require_finite(values: np.ndarray, what: str) -> None:
    if not np.isfinite(values).all():
        bad = int(np.count_nonzero(~np.isfinite(values)))
        raise NonFiniteError(f"{what} holds {bad} NaN or infinite values out of {values.size}")


def write_tensor(message: scoring_pb2.Tensor, array: np.ndarray, dtype: str) -> None:
    """Packed little-endian bytes with dtype and shape, written into `message`."""
    message.dtype = dtype
    message.shape.extend(array.shape)
    message.data = np.ascontiguousarray(array, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()


def response(ticket: Ticket, scored: Mapping[ItemKey, Scored], *, provider: str) -> scoring_pb2.ScoreResponse:
    """The response of an admitted request from its items' results, by their keys."""
    request, model, passes, original = ticket.request, ticket.model, ticket.passes, ticket.original
    answer = scoring_pb2.ScoreResponse(
        model=model.name, request_id=request.request_id, image_height=original[0], image_width=original[1],
        execution_provider=provider, output_stride=passes.stride, shift=passes.shift,
    )
    field = model.card.receptive_field
    first = (field.center_y - passes.slack, field.center_x - passes.slack)
    probabilities = []
    try:
        for index, job in enumerate(ticket.jobs):
            orientations = [(flip, [scored[ItemKey(index, flip, part)] for part in range(job.parts)])
                            for flip in ticket.flips]
            probabilities.extend(scale_probabilities(job, parts, passes, mirrored=flip) for flip, parts in orientations)
            lattices = None
            if orientations[0][1][0].lattice is not None:
                lattices = [scale_lattice(job, parts, mirrored=flip, first_center_x=first[1], stride=passes.stride)
                            for flip, parts in orientations]
            geometry = dense.cell_geometry(
                original=original, resized=job.resized, canvas=one_pass_canvas(job), cells=job.cells,
                stride=passes.stride, field_size=field.size, first_center=first,
            )
            scale_map = answer.maps.add()
            fill_scale_map(scale_map, request, job, lattices, geometry,
                           holes=passes.shift == scoring_pb2.SHIFT_DIAGONAL)
            if job.tiling is not None:
                scale_map.tiling.CopyFrom(scoring_pb2.Tiling(
                    tiles=len(job.tiles), halo_px=job.tiling.halo, exact=job.tiling.exact,
                    canvas_height=job.canvas[0], canvas_width=job.canvas[1]))
        answer.top_k.extend(image_top_k(probabilities, top_k(request, model.limits), model.label))
    except NonFiniteError as error:
        raise ScoringError(Refusal.INTERNAL, f"model {model.name} gave no usable scores: {error}") from error
    smallest = min(original)
    if ticket.jobs[0].scale / smallest > TINY_IMAGE_FACTOR and smallest < model.training_size:
        answer.warnings.append(
            f"the image is {original[0]}x{original[1]}, far below model {model.name}'s training size "
            f"{model.training_size}: enlarged {ticket.jobs[0].scale / smallest:.1f}x, its scores may mean little"
        )
    return answer


def timings(answer: scoring_pb2.ScoreResponse, ran: Mapping[ItemKey, Ran], *, started: float, decoded: float,
            computed: float) -> dict[Stage, float]:
    """Fill the response's timings (ms) from the stages' instants and its items' batches; the seconds by stage."""
    finished = time.monotonic()
    queue = max(each.started - each.enqueued for each in ran.values())
    inference = sum({each.batch_id: each.run_seconds for each in ran.values()}.values())
    setups: dict[int, float] = {}
    for each in ran.values():
        setups[each.batch_id] = max(setups.get(each.batch_id, 0.0), each.scored.planning_seconds)
    shown = answer.timings
    shown.queue_ms = 1000 * queue
    shown.preprocess_ms = 1000 * (decoded - started)
    shown.inference_ms = 1000 * inference
    shown.postprocess_ms = 1000 * (finished - computed)
    shown.total_ms = 1000 * (finished - started)
    shown.planning_ms = 1000 * sum(setups.values())
    return {Stage.QUEUE: queue, Stage.PREPROCESS: decoded - started, Stage.INFERENCE: inference,
            Stage.POSTPROCESS: finished - computed}
