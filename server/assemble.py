"""Stage 4, assemble: the plans' outputs of one request into its response.

Per scale: the kept lattices (the mirrored one moved back), averaged over flips, as maps, per-cell
top-k and geometry; over everything: the image-level top-k from the mean of the device's
per-image probabilities (VGG's dense evaluation). Tensors are written as bytes once. A response
is finite or an error: the only NaN allowed is a diagonal shift's unscored cell, which the
contract documents.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protos import scoring_pb2
from server import dense

FLOAT16_BYTES, FLOAT32_BYTES, INT32_BYTES = 2, 4, 4
OVERHEAD_BYTES = 4096  # geometry, timings, model name, warnings and framing of a response, generously
ENTRY_FRAMING_BYTES = 8  # an image-level top-k entry's tags and lengths


class NonFiniteError(ArithmeticError):
    """The net produced NaN or infinity where a score belongs; the message says where."""


@dataclass(frozen=True)
class ScaleJob:
    """One scale of a request as planned: sizes, the canvas bucket and the cells kept."""

    scale: int
    resized: tuple[int, int]
    canvas: tuple[int, int]
    cells: tuple[int, int]
    batch_limit: int  # items of this canvas one batch may hold in memory (a batch bucket)


def response_bytes(request: scoring_pb2.ScoreRequest, jobs: list[ScaleJob], *, classes: int, top_k: int,
                   label_bytes: int) -> int:
    """An upper estimate of the response's size, known before any compute: the maps, the cells' top-k,
    the image's `top_k` entries, each with a label of up to `label_bytes`, and the echoed request id."""
    total = OVERHEAD_BYTES + len(request.request_id.encode()) + min(top_k, classes) * (
        INT32_BYTES + FLOAT32_BYTES + label_bytes + ENTRY_FRAMING_BYTES)
    for job in jobs:
        cells = job.cells[0] * job.cells[1]
        if request.return_maps:
            width = FLOAT16_BYTES if request.map_dtype == scoring_pb2.FLOAT16 else FLOAT32_BYTES
            total += cells * (len(request.classes) or classes) * width
        total += cells * min(request.cell_top_k, classes) * (INT32_BYTES + FLOAT32_BYTES)
    return total


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
        chosen = lattice[list(request.classes)] if request.classes else lattice
        if request.map_dtype == scoring_pb2.FLOAT16 and chosen.dtype != np.float16:  # ranked in float32
            chosen = chosen.astype(np.float16)
            require_finite_map(chosen)
        scale_map.classes.extend(request.classes)
        write_tensor(scale_map.scores, chosen, "float16" if request.map_dtype == scoring_pb2.FLOAT16 else "float32")
    if request.cell_top_k:
        indices, values = dense.cell_top_k(lattice, request.cell_top_k)
        write_tensor(scale_map.cell_top_k_indices, indices, "int32")
        write_tensor(scale_map.cell_top_k_scores, values, "float32")


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
