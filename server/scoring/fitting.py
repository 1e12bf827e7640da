"""Fitting: how each scale of a request runs, so that no plan grows with the image.

A scale is resized, then put on the smallest canvas bucket that holds it, or tiled onto one with the
server's halo, or planned on demand; `scale_job` says which, with the cells it keeps and how many of its
items one batch may hold in the model's device memory (`items_per_batch`); `largest_scale` is what the
refusals suggest instead.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from convert.profile import ProfileError
from server.engine.device_graph import DeviceGraphError
from server.errors import Refusal, ScoringError, invalid
from server.geometry import dense, tiling
from server.scoring.request import ScaleJob, TileJob

if TYPE_CHECKING:
    from server.scoring.model import Model

__all__ = ["items_per_batch", "largest_scale", "scale_job", "tile_jobs", "tile_plan"]


def scale_job(model: Model, original: tuple[int, int], scale: int, passes: dense.Passes, *,
              flip: bool) -> ScaleJob:
    """How one scale runs: on the smallest canvas bucket that holds it; else tiled onto a bucket that holds
    the halo; else, when it fits --tile-canvas, on a canvas planned on demand (the tile canvas under
    --strict-shapes); else tiled onto the tile canvas: no plan grows with the image."""
    size = dense.resized_size(*original, scale=scale, multiple=model.card.size_multiple)
    check_resized_cap(model, original, scale, size)
    cells = job_cells(model, size, scale, passes)
    if 0 in cells:
        raise invalid(
            f"scale {scale} resizes the {original[0]}x{original[1]} image to {size[0]}x{size[1]}, smaller than "
            f"model {model.name}'s training size {model.card.training_height}x{model.card.training_width}; "
            "use a larger scale"
        )

    def on(canvas: tuple[int, int], tiles: tiling.TilePlan | None = None) -> ScaleJob:
        return ScaleJob(scale, size, canvas, cells, items_per_batch(model, canvas, scale, passes, original), tiling=tiles,
                        tiles=() if tiles is None else tile_jobs(model, tiles, scale, passes))

    canvas = model.buckets.canvas_for(*size, slack=passes.slack)
    if canvas is not None:
        return on(canvas)
    try:
        tiles = tile_plan(model, size, passes, flip=flip)
    except tiling.TilingError:
        tiles = None  # no bucket holds the halo: planned on demand, or tiled onto the tile canvas
    if tiles is not None:
        return on(tiles.canvas, tiles)
    canvas = model.canvas_for(size, passes)  # planned on demand, up to the tile canvas
    if canvas is not None:
        return on(canvas)
    try:
        tiles = tile_plan(model, size, passes, flip=flip, canvases=(model.tiling_canvas(size, passes),))
    except tiling.TilingError as error:
        raise invalid(
            f"scale {scale} gives a {size[0]}x{size[1]} image (+{passes.slack} px for shifted passes) that no "
            f"canvas bucket holds ({model.buckets.describe()}), nor can it be tiled onto one or onto --tile-canvas "
            f"{model.tile_canvas[0]}x{model.tile_canvas[1]}: {error}; use a smaller scale, or restart the server with "
            "a larger --shape-buckets or --tile-canvas, or a smaller --halo"
        ) from error
    return on(tiles.canvas, tiles)


def largest_fitting(fits: Callable[[int], bool], most: int, *, least: int = 0) -> int:
    """The largest n in least+1..`most` with fits(n), where fits falls as n grows; `least` when none does."""
    return least + bisect.bisect_left(range(least + 1, most + 1), True, key=lambda n: not fits(n))


def check_resized_cap(model: Model, original: tuple[int, int], scale: int, size: tuple[int, int]) -> None:
    """INVALID_ARGUMENT, naming the largest scale within it, past --max-resized-pixels: a cap the operator set
    (none by default: the request's own host memory estimate decides, docs/design.md)."""
    limit = model.limits.max_resized_pixels
    if limit is None or size[0] * size[1] <= limit:
        return
    step = model.multiple

    def within_cap(steps: int) -> bool:
        resized = dense.resized_size(*original, scale=steps * step, multiple=model.card.size_multiple)
        return resized[0] * resized[1] <= limit

    low = largest_fitting(within_cap, -(-scale // step) - 1)  # the scale's own steps, rounded up, do not fit
    within = (f"ask for a scale of at most {low * step}" if low * step >= model.min_scale
              else "no scale of this image is within it")
    raise invalid(
        f"scale {scale} resizes the {original[0]}x{original[1]} image to {size[0]}x{size[1]} = "
        f"{size[0] * size[1]} pixels, above the server's --max-resized-pixels {limit}: {within}, or restart the "
        "server with a larger --max-resized-pixels or without it (then the request's own host memory estimate "
        "decides)"
    )


def job_cells(model: Model, size: tuple[int, int], scale: int, passes: dense.Passes) -> tuple[int, int]:
    """The lattice cells one pass over an image of `size` keeps (the passes' factor times the net's cells)."""
    try:
        return tuple(passes.factor * side for side in model.net_cells(*size))
    except DeviceGraphError as error:
        raise invalid(f"scale {scale} gives a {size[0]}x{size[1]} input model {model.name} cannot take: "
                      f"{error}") from error


def tile_plan(model: Model, size: tuple[int, int], passes: dense.Passes, *, flip: bool,
              canvases: Sequence[tuple[int, int]] | None = None) -> tiling.TilePlan:
    """The tiles of a resized image on the canvas (of `canvases`, default the buckets) that computes the fewest
    pixels for it, with the server's --halo (None: exact); raises the largest canvas's TilingError when none
    holds the halo."""
    field = model.card.receptive_field
    plans, refusal = [], None
    for canvas in sorted(model.buckets.canvases if canvases is None else canvases, key=lambda c: c[0] * c[1]):
        try:
            plans.append(tiling.plan(
                size, canvas, field_size=field.size, field_center=(field.center_y, field.center_x),
                training=(model.card.training_height, model.card.training_width), passes=passes,
                halo=model.halo, multiple=model.multiple, flip=flip))
        except tiling.TilingError as error:
            refusal = error
    if not plans:
        raise refusal
    return min(plans, key=lambda plan: (len(plan) * plan.canvas[0] * plan.canvas[1], plan.canvas))


def tile_jobs(model: Model, plan: tiling.TilePlan, scale: int, passes: dense.Passes) -> tuple[TileJob, ...]:
    """Each tile's own map cells and the cells of its lattice the image-level mean counts, as the one pass's:
    every map cell once (the cells it owns), and every cell of the mirrored lattice once (those whose
    unmirrored cell it owns; an edge tile also those landing beyond the image's edge)."""
    first_x = model.card.receptive_field.center_x - passes.slack
    last = len(plan.columns) - 1
    jobs = []
    for tile in plan:
        cells = job_cells(model, (tile.y.length, tile.x.length), scale, passes)
        rows, columns = tile.owned(cells)
        # Mirrored column m lands on unmirrored column anchor - m (dense.mirror_back).
        anchor = int(round((tile.x.length - 1 - 2 * first_x) / passes.stride))
        lowest = anchor - columns.stop + 1 if tile.column < last else 0
        highest = anchor - columns.start + 1 if tile.column > 0 else cells[1]
        mirrored = slice(max(lowest, 0), min(highest, cells[1]))
        jobs.append(TileJob(tile, cells, (rows, columns), (rows, mirrored)))
    return tuple(jobs)


def items_per_batch(model: Model, canvas: tuple[int, int], scale: int, passes: dense.Passes,
                original: tuple[int, int]) -> int:
    """How many items of this canvas one batch may hold in memory (each runs all its passes), as a batch
    bucket: a batch is padded up to its bucket, so the limit is rounded down to one."""
    limit = model.plan_memory.require_batch(*canvas, scale=scale, largest_scale=lambda: largest_scale(model, original, passes))
    items = limit // len(passes.offsets)
    if items == 0:
        raise ScoringError(
            Refusal.RESOURCE_EXHAUSTED,
            f"scale {scale} needs {len(passes.offsets)} passes of {canvas[0]}x{canvas[1]} at once but "
            f"only {limit} fit the memory budget; the largest scale that fits is "
            f"{largest_scale(model, original, passes)}",
        )
    if items >= model.buckets.batches[-1]:
        return items
    return max(bucket for bucket in model.buckets.batches if bucket <= items)


def largest_scale(model: Model, original: tuple[int, int], passes: dense.Passes) -> int:
    """The largest scale of this image whose passes fit the memory budget (0: none)."""
    step = model.multiple
    # `low` fits or is 0; beyond the ceiling every scale runs on the tile canvas.
    low, high = max(model.min_scale // step - 1, 0), scale_ceiling(model, original, passes) // step + 1
    while high - low > 1:
        middle = (low + high) // 2
        # A scale beyond the tile canvas runs on it, tile by tile.
        canvas = model.canvas_for(dense.resized_size(*original, scale=middle * step, multiple=step),
                                  passes) or model.tile_canvas
        try:
            fits = model.plan_memory.fitting_batch(*canvas) >= len(passes.offsets)
        except ProfileError:  # a size the net cannot take
            fits = False
        if fits:
            low = middle
        else:
            high = middle
    return low * step


def scale_ceiling(model: Model, original: tuple[int, int], passes: dense.Passes) -> int:
    """A scale no search for the largest that fits the plans' memory needs to pass: --max-scale, or else one
    whose image is tiled onto the tile canvas (every scale beyond it runs on that canvas too, so fits as it does)."""
    if model.limits.max_scale is not None:
        return model.limits.max_scale
    short, long = sorted(original)
    tile_pixels = model.tile_canvas[0] * model.tile_canvas[1]
    side = math.isqrt(tile_pixels * short // long) + 2 * (passes.slack + model.multiple)
    return max(side, model.min_scale) + model.multiple
