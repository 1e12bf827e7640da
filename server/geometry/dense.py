"""Dense-scoring geometry in plain numpy: scales, passes, lattices, crops, flips, cell geometry.

A network of output stride S scores one cell every S pixels. Two ways to a finer lattice s = S/2
(OverFeat, Sermanet et al. 2014, sec. 3.3; cs231n "ConvNets in practice"):
- GRID: 4 passes of the image shifted by (0|s, 0|s) pixels, interleaved: the full stride-s lattice.
- DIAGONAL: 2 passes, (0, 0) and (s, s): only a quincunx (checkerboard) of the stride-s lattice;
  the cells no pass looked at are NaN in the returned maps.
- ATROUS: one pass of a model converted with a smaller output stride (its own stride is s).

Every pass sees the whole image: a pass shifted by (dy, dx) puts the image dy pixels down and dx
right on a canvas of the mean colour (zero once normalised), so nothing is cut off and nothing is
smeared (edge-replicated windows band the grid by row: docs/design.md, shifted passes on a mean-colour
canvas). The canvas is a fixed plan shape at least `slack` larger than the image; the device graph
(server/engine/device_graph.py) makes the passes and interleaves them. Lattice cell m then lies at c - slack + s*m (c the receptive-field
centre of cell 0 of an unshifted pass), and the map keeps as many cells per axis as an unpadded
run of the image gives, factor times over: the cells whose centre lies in the canvas padding go.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from convert.card import ImageInput, ModelCard
from protos.scoring_pb2 import MapGeometry, Shift

SHIFT_NAMES = ", ".join(Shift.keys())


@dataclass(frozen=True)
class Passes:
    """How one scale is scored: the lattice stride, the shift mode, and the (dy, dx) of each pass."""

    stride: int
    factor: int
    shift: int
    offsets: tuple[tuple[int, int], ...]

    @property
    def slack(self) -> int:
        """Pixels the canvas needs beyond the image, per axis, so the shifted passes lose nothing."""
        return (self.factor - 1) * self.stride


class PassesError(ValueError):
    """A stride/shift combination the model cannot produce; the message says what can."""


def passes_for(*, native_stride: int, output_stride: int, shift: int) -> Passes:
    """The passes giving `output_stride` (0: native) from a model of `native_stride`."""
    if shift not in Shift.values():
        raise PassesError(f"shift {shift} is not a Shift; use one of {SHIFT_NAMES}")
    stride = output_stride or native_stride
    names = Shift.Name
    if stride == native_stride:
        if shift in (Shift.SHIFT_GRID, Shift.SHIFT_DIAGONAL):
            raise PassesError(
                f"shift {names(shift)} needs output_stride {native_stride // 2} (half the model's stride "
                f"{native_stride}); received output_stride {stride}"
            )
        if shift == Shift.SHIFT_ATROUS and native_stride >= 32:
            raise PassesError(
                f"shift SHIFT_ATROUS needs a model converted with `scoremap-convert --output-stride 16`; "
                f"this model's stride is {native_stride}"
            )
        atrous = shift == Shift.SHIFT_ATROUS or (shift == Shift.SHIFT_UNSPECIFIED and native_stride < 32)
        return Passes(stride, 1, Shift.SHIFT_ATROUS if atrous else Shift.SHIFT_NONE, ((0, 0),))
    if stride * 2 == native_stride:
        if shift in (Shift.SHIFT_UNSPECIFIED, Shift.SHIFT_GRID):
            offsets = ((0, 0), (0, stride), (stride, 0), (stride, stride))
            return Passes(stride, 2, Shift.SHIFT_GRID, offsets)
        if shift == Shift.SHIFT_DIAGONAL:
            return Passes(stride, 2, Shift.SHIFT_DIAGONAL, ((0, 0), (stride, stride)))
        raise PassesError(
            f"output_stride {stride} on a stride-{native_stride} model needs shift SHIFT_GRID or SHIFT_DIAGONAL "
            f"(or a model converted with --output-stride {stride} for SHIFT_ATROUS); received {names(shift)}"
        )
    raise PassesError(
        f"output_stride {stride} is not supported by this model (native stride {native_stride}): "
        f"use 0, {native_stride} or {native_stride // 2}"
    )


def scored_cells(passes: Passes, rows: slice, columns: slice) -> int:
    """How many cells of a lattice region some pass scores: all of them but on the diagonal (a quincunx),
    whose pass (dy, dx) scores the cells (i, j) with (i, j) = (dy, dx) / stride modulo the factor."""
    factor = passes.factor
    row_slots = np.bincount(np.arange(rows.start, rows.stop) % factor, minlength=factor)
    column_slots = np.bincount(np.arange(columns.start, columns.stop) % factor, minlength=factor)
    return int(sum(row_slots[dy // passes.stride] * column_slots[dx // passes.stride] for dy, dx in passes.offsets))


def offered_strides(native_stride: int) -> tuple[int, ...]:
    """The output strides a model of `native_stride` can give: its own, and half of it from 32 up."""
    return (native_stride, native_stride // 2) if native_stride >= 32 else (native_stride,)


def resized_size(height: int, width: int, *, scale: int, multiple: int) -> tuple[int, int]:
    """Shorter side to `scale`, aspect kept, both sides rounded to the nearest `multiple` (at least one)."""
    short = min(height, width)
    step = max(multiple, 1)

    def fit(side: int) -> int:
        exact = side * scale / short
        return max(step, int(round(exact / step)) * step)

    return fit(height), fit(width)


def mean_colour(card: ModelCard) -> np.ndarray:
    """[3] uint8 RGB pixel that normalises to (about) zero: what the canvas around an image is filled with."""
    image = ImageInput.of(card)
    mean = np.resize(np.asarray(image.mean or (0.0,), dtype=np.float64), 3)
    colour = mean / image.pixel_scale
    if image.bgr:
        colour = colour[::-1]
    return np.clip(np.rint(colour), 0, 255).astype(np.uint8)


def canvas(image: np.ndarray, size: tuple[int, int], fill: np.ndarray, *,
           out: np.ndarray | None = None) -> np.ndarray:
    """[H, W, 3] uint8 of `size`: `image` at the top left, `fill` elsewhere (written into `out` when given)."""
    height, width = image.shape[:2]
    out = frame((height, width), size, fill, out=out)
    out[:height, :width] = image
    return out


def frame(image: tuple[int, int], size: tuple[int, int], fill: np.ndarray, *,
          out: np.ndarray | None = None) -> np.ndarray:
    """[H, W, 3] uint8 of `size` (`out` when given): `fill` around a top-left `image` (height, width) left
    unwritten, for a resize or a flip to write straight into (no copy of the image)."""
    height, width = image
    if out is None:
        out = np.empty((*size, 3), dtype=np.uint8)
    row = np.tile(fill, (size[1], 1))  # whole rows: numpy fills them 15x faster than pixel by 3-byte pixel
    out[height:] = row
    out[:height, width:] = row[width:]
    return out


def mirror_back(lattice: np.ndarray, *, resized_width: int, first_center_x: float, stride: int) -> np.ndarray:
    """A mirrored image's [K, h, w] lattice put back on the unmirrored lattice's columns, NaN where none lands.

    Mirrored column n lies at x' = c0 + stride*n, i.e. x = W - 1 - x' in the image, which is
    unmirrored column A - n with A = (W - 1 - 2*c0) / stride: the plain mirror when the receptive
    field sits symmetrically, a whole-cell offset with TensorFlow's one-sided 'SAME' padding,
    rounded to the nearest cell otherwise.
    """
    width = lattice.shape[-1]
    anchor = int(round((resized_width - 1 - 2 * first_center_x) / stride))
    source = anchor - np.arange(width)
    inside = (source >= 0) & (source < width)
    moved = np.full_like(lattice, np.nan)
    moved[:, :, inside] = lattice[:, :, source[inside]]
    return moved


def average_flips(lattices: list[np.ndarray]) -> np.ndarray:
    """Cell-wise mean of the unmirrored and mirrored-back lattices (VGG's flip averaging).

    A cell only one of them covers (an edge column after alignment) keeps that one's value.
    """
    if len(lattices) == 1:
        return lattices[0]
    # In place, one float32 lattice and a byte per value beside the inputs: stacking them would hold ~9 lattices
    # of a 1000-class map at once, beyond the request's host memory estimate (server/memory/host.py).
    total = np.zeros(lattices[0].shape, dtype=np.float32)
    count = np.zeros(lattices[0].shape, dtype=np.uint8)
    for lattice in lattices:
        scored = ~np.isnan(lattice)
        np.add(total, lattice, out=total, where=scored)
        count += scored
        del scored
    np.divide(total, count, out=total, where=count > 0)
    total[count == 0] = np.nan
    return total


def cell_geometry(
    *,
    original: tuple[int, int],
    resized: tuple[int, int],
    canvas: tuple[int, int],
    cells: tuple[int, int],
    stride: int,
    field_size: int,
    first_center: tuple[float, float],
) -> MapGeometry:
    """Map the lattice from resized-image pixels back to the original image (the contract's message).

    Pixel centres are matched the way PIL resizes (pixel k covers [k, k+1)):
    original = (resized + 0.5) / factor - 0.5. Border cells whose receptive field reaches past the
    image into the canvas padding are counted, per axis, when the canvas is larger than the image.
    """
    factor_y = resized[0] / original[0]
    factor_x = resized[1] / original[1]

    def padded(axis: int) -> int:
        if canvas[axis] <= resized[axis]:
            return 0
        reach = first_center[axis] + stride * np.arange(cells[axis]) + field_size / 2
        return int(np.count_nonzero(reach > resized[axis]))

    return MapGeometry(
        stride_y=stride / factor_y,
        stride_x=stride / factor_x,
        center_y=(first_center[0] + 0.5) / factor_y - 0.5,
        center_x=(first_center[1] + 0.5) / factor_x - 0.5,
        box_height=field_size / factor_y,
        box_width=field_size / factor_x,
        scale_factor=min(resized) / min(original),
        resized_height=resized[0],
        resized_width=resized[1],
        padded_border_rows=padded(0),
        padded_border_cols=padded(1),
    )


def top_k(probabilities: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k largest entries as (index, value), largest first (ties: lower index first)."""
    k = min(k, probabilities.shape[0])
    candidates = np.argpartition(-probabilities, k - 1)[:k] if k < probabilities.shape[0] else np.arange(k)
    order = candidates[np.lexsort((candidates, -probabilities[candidates]))]
    return [(int(i), float(probabilities[i])) for i in order]


def cell_top_k(lattice: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per cell, the k best classes: ([k, h, w] int32 indices, [k, h, w] float32 scores), best first.

    Unscored cells (NaN) get index -1 and score NaN. argpartition, then a sort of the k only.
    """
    classes = lattice.shape[0]
    k = min(k, classes)
    missing = np.isnan(lattice).any(axis=0)
    filled = np.where(missing[None], -np.inf, lattice)
    candidates = np.argpartition(-filled, k - 1, axis=0)[:k] if k < classes else np.broadcast_to(
        np.arange(classes)[:, None, None], filled.shape).copy()
    values = np.take_along_axis(filled, candidates, axis=0)
    order = np.argsort(-values, axis=0, kind="stable")
    indices = np.take_along_axis(candidates, order, axis=0).astype(np.int32)
    scores = np.take_along_axis(values, order, axis=0).astype(np.float32)
    indices[:, missing] = -1
    scores[:, missing] = np.nan
    return indices, scores
