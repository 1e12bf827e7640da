"""Dense-scoring geometry in plain numpy: scales, shifted passes, interleaving, flips, cell geometry.

A network of output stride S scores one cell every S pixels. Two ways to a finer lattice R = S/2
(OverFeat, Sermanet et al. 2014, sec. 3.3; cs231n "ConvNets in practice"):
- GRID: run the image shifted by (0|R, 0|R) pixels, 4 passes, and interleave them: the full
  stride-R lattice.
- DIAGONAL: 2 passes, (0, 0) and (R, R): only a quincunx (checkerboard) of the stride-R lattice;
  the cells no pass looked at are NaN in the returned maps.
- ATROUS: one pass of a model converted with a smaller output stride (its own stride is R).
Shifted passes keep the image's size: the image is edge-padded by R and a window of the original
size is cut at the offset, so every pass of a scale has one shape and they batch together.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protos.scoring_pb2 import MapGeometry, Shift


@dataclass(frozen=True)
class PassPlan:
    """How one scale is scored: the lattice stride, the shift mode, and the (dy, dx) of each pass."""

    stride: int
    factor: int
    shift: int
    offsets: tuple[tuple[int, int], ...]


class PlanError(ValueError):
    """A stride/shift combination the model cannot produce; the message says what can."""


def plan_passes(*, native_stride: int, output_stride: int, shift: int) -> PassPlan:
    """The passes giving `output_stride` (0: native) from a model of `native_stride`."""
    stride = output_stride or native_stride
    names = Shift.Name
    if stride == native_stride:
        if shift in (Shift.SHIFT_GRID, Shift.SHIFT_DIAGONAL):
            raise PlanError(
                f"shift {names(shift)} needs output_stride {native_stride // 2} (half the model's stride "
                f"{native_stride}); received output_stride {stride}"
            )
        if shift == Shift.SHIFT_ATROUS and native_stride >= 32:
            raise PlanError(
                f"shift SHIFT_ATROUS needs a model converted with `scoremap-convert --output-stride 16`; "
                f"this model's stride is {native_stride}"
            )
        atrous = shift == Shift.SHIFT_ATROUS or (shift == Shift.SHIFT_UNSPECIFIED and native_stride < 32)
        return PassPlan(stride, 1, Shift.SHIFT_ATROUS if atrous else Shift.SHIFT_NONE, ((0, 0),))
    if stride * 2 == native_stride:
        if shift in (Shift.SHIFT_UNSPECIFIED, Shift.SHIFT_GRID):
            offsets = ((0, 0), (0, stride), (stride, 0), (stride, stride))
            return PassPlan(stride, 2, Shift.SHIFT_GRID, offsets)
        if shift == Shift.SHIFT_DIAGONAL:
            return PassPlan(stride, 2, Shift.SHIFT_DIAGONAL, ((0, 0), (stride, stride)))
        raise PlanError(
            f"output_stride {stride} on a stride-{native_stride} model needs shift SHIFT_GRID or SHIFT_DIAGONAL "
            f"(or a model converted with --output-stride {stride} for SHIFT_ATROUS); received {names(shift)}"
        )
    raise PlanError(
        f"output_stride {stride} is not supported by this model (native stride {native_stride}): "
        f"use 0, {native_stride} or {native_stride // 2}"
    )


def resized_size(height: int, width: int, *, scale: int, multiple: int) -> tuple[int, int]:
    """Shorter side to `scale`, aspect kept, both sides rounded to the nearest `multiple` (at least one)."""
    short = min(height, width)
    step = max(multiple, 1)

    def fit(side: int) -> int:
        exact = side * scale / short
        return max(step, int(round(exact / step)) * step)

    return fit(height), fit(width)


def pass_images(image: np.ndarray, plan: PassPlan, *, flip: bool) -> list[np.ndarray]:
    """One [H, W, C] array per pass of `plan`: the image (mirrored if `flip`) shifted by each offset.

    A mirrored pass is shifted left instead of right, so once its map is mirrored back it lands on
    the same lattice positions as the unmirrored pass with that offset.
    """
    source = image[:, ::-1] if flip else image
    pad = max(max(dy, dx) for dy, dx in plan.offsets)
    if pad == 0:
        return [np.ascontiguousarray(source)]
    padded = np.pad(source, ((pad, pad), (pad, pad), (0, 0)), mode="edge")
    height, width = image.shape[:2]
    windows = []
    for dy, dx in plan.offsets:
        top, left = pad + dy, pad + (-dx if flip else dx)
        windows.append(np.ascontiguousarray(padded[top:top + height, left:left + width]))
    return windows


def interleave(maps: list[np.ndarray], plan: PassPlan, *, flip: bool) -> np.ndarray:
    """The [K, factor*h, factor*w] lattice from the passes' [K, h, w] maps; NaN where no pass looked."""
    if flip:
        maps = [m[:, :, ::-1] for m in maps]
    if plan.factor == 1:
        return np.ascontiguousarray(maps[0], dtype=np.float32)
    classes, height, width = maps[0].shape
    lattice = np.full((classes, height * plan.factor, width * plan.factor), np.nan, dtype=np.float32)
    for (dy, dx), scores in zip(plan.offsets, maps):
        lattice[:, dy // plan.stride::plan.factor, dx // plan.stride::plan.factor] = scores
    return lattice


def mirror_shift(*, resized_width: int, center_x: float, native_stride: int, pass_width: int, stride: int) -> int:
    """Lattice cells by which a mirrored-back map must move to line up with the unmirrored one.

    Mirrored-back cell j sits at c' + j*stride with c' = W - 1 - c - S*(w - 1) (W resized width,
    c the card's centre, S the native stride, w cells per pass): 0 when the receptive field is
    centred symmetrically (c = (W - 1 - S*(w - 1)) / 2), else a whole number of cells for the
    asymmetric 'SAME' padding of TensorFlow-trained nets; rounded to the nearest cell otherwise.
    """
    offset = resized_width - 1 - 2 * center_x - native_stride * (pass_width - 1)
    return int(round(offset / stride))


def align(lattice: np.ndarray, cells: int) -> np.ndarray:
    """Move a lattice `cells` columns right (negative: left), NaN where nothing moved in."""
    if cells == 0:
        return lattice
    moved = np.full_like(lattice, np.nan)
    if cells > 0:
        moved[:, :, cells:] = lattice[:, :, :-cells]
    else:
        moved[:, :, :cells] = lattice[:, :, -cells:]
    return moved


def average_flips(lattices: list[np.ndarray]) -> np.ndarray:
    """Cell-wise mean of the unmirrored and aligned mirrored-back lattices (VGG's flip averaging).

    A cell only one of them covers (an edge column after alignment) keeps that one's value.
    """
    if len(lattices) == 1:
        return lattices[0]
    stack = np.stack(lattices)
    scored = ~np.isnan(stack)
    total = np.where(scored, stack, 0).sum(axis=0)
    count = scored.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan).astype(np.float32)


def cell_geometry(
    *,
    original: tuple[int, int],
    resized: tuple[int, int],
    stride: int,
    field_size: int,
    field_center: tuple[float, float],
) -> MapGeometry:
    """Map the lattice from resized-image pixels back to the original image (the contract's message).

    Pixel centres are matched the way PIL resizes (pixel k covers [k, k+1)):
    original = (resized + 0.5) / factor - 0.5.
    """
    factor_y = resized[0] / original[0]
    factor_x = resized[1] / original[1]
    return MapGeometry(
        stride_y=stride / factor_y,
        stride_x=stride / factor_x,
        center_y=(field_center[0] + 0.5) / factor_y - 0.5,
        center_x=(field_center[1] + 0.5) / factor_x - 0.5,
        box_height=field_size / factor_y,
        box_width=field_size / factor_x,
        scale_factor=min(resized) / min(original),
        resized_height=resized[0],
        resized_width=resized[1],
    )


def softmax(scores: np.ndarray, *, axis: int = 0) -> np.ndarray:
    shifted = scores - np.max(scores, axis=axis, keepdims=True)
    exp = np.exp(shifted)
    return exp / np.sum(exp, axis=axis, keepdims=True)


def mean_probabilities(lattice: np.ndarray, *, logits: bool) -> np.ndarray:
    """[K] class probabilities averaged over the lattice's scored cells (NaN cells skipped)."""
    classes = lattice.shape[0]
    cells = lattice.reshape(classes, -1)
    cells = cells[:, ~np.isnan(cells).any(axis=0)]
    probabilities = softmax(cells, axis=0) if logits else cells
    return probabilities.mean(axis=1)


def top_k(probabilities: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k largest entries as (index, value), largest first."""
    k = min(k, probabilities.shape[0])
    order = np.argsort(-probabilities, kind="stable")[:k]
    return [(int(i), float(probabilities[i])) for i in order]


def cell_top_k(lattice: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per cell, the k best classes: ([k, h, w] int32 indices, [k, h, w] float32 scores).

    Unscored cells (NaN) get index -1 and score NaN.
    """
    k = min(k, lattice.shape[0])
    missing = np.isnan(lattice).any(axis=0)
    filled = np.where(missing[None], -np.inf, lattice)
    order = np.argsort(-filled, axis=0, kind="stable")[:k]
    scores = np.take_along_axis(lattice, order, axis=0).astype(np.float32)
    indices = order.astype(np.int32)
    indices[:, missing] = -1
    scores[:, missing] = np.nan
    return indices, scores
