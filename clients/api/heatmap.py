"""Heatmaps: the photo with its top class's score map overlaid, and a legend, readable at a glance.

Every pixel takes the colour of the cell whose centre is nearest (MapGeometry: centre = center +
i * stride), so each cell covers the stride-sized box around its centre and the border cells
reach out to the photo's edges: the whole photo is coloured, where painting only the boxes
around the centres would leave a band of half a receptive field uncoloured on every side, and the overlay lines up with the photo at any scale, shift or stride. The legend says so.
Small photos are enlarged (by a whole factor, nearest neighbour) so the legend stays readable.
The colormap is viridis, interpolated from nine stops: perceptually uniform and
readable by colour-blind viewers, and not worth a matplotlib dependency for one lookup table.
"""

from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from clients.api.images import open_photo
from clients.api.results import Geometry, ScaleResult, ScoreResult

__all__ = ["render_heatmap", "heatmap_png", "colormap", "canvas_scale", "legend_notes", "HeatmapError"]

# matplotlib's viridis sampled at 0, 1/8, ..., 1.
_VIRIDIS = np.array([
    (68, 1, 84), (71, 44, 122), (59, 81, 139), (44, 113, 142), (33, 144, 141),
    (39, 173, 129), (92, 200, 99), (170, 220, 50), (253, 231, 37),
], dtype=np.float64)
# How much of the map colour shows over the photo.
OVERLAY_ALPHA = 0.55
# Cells no pass scored (NaN: a diagonal shift's quincunx holes) are drawn in this neutral grey, which is
# no colour of viridis, so a hole never reads as a low score; the legend says so.
HOLE_COLOUR = (128, 128, 128)
# Legend text height as a fraction of the photo's shorter side (bounded below for small photos).
LEGEND_TEXT_FRACTION = 1 / 22
LEGEND_MIN_TEXT_PX = 12
# Photos whose shorter side is below this many pixels are drawn enlarged by a whole factor.
MIN_CANVAS_SIDE = 256


class HeatmapError(ValueError):
    """The result cannot be drawn (no maps, or the photo is not the image that was scored)."""


def colormap(values: np.ndarray) -> np.ndarray:
    """uint8 RGB colours [..., 3] of `values` in 0..1 (clipped) under viridis."""
    v = np.clip(np.nan_to_num(values, nan=0.0), 0.0, 1.0) * (len(_VIRIDIS) - 1)
    low = np.floor(v).astype(int).clip(0, len(_VIRIDIS) - 2)
    frac = (v - low)[..., None]
    return np.round(_VIRIDIS[low] * (1 - frac) + _VIRIDIS[low + 1] * frac).astype(np.uint8)


def _finest(result: ScoreResult) -> ScaleResult:
    with_maps = [m for m in result.maps if m.scores is not None]
    if not with_maps:
        raise HeatmapError("the result has no score maps; score with return_maps=True")
    return max(with_maps, key=lambda m: m.height * m.width)


def _normalise(cells: np.ndarray) -> tuple[np.ndarray, float, float]:
    """Values mapped to 0..1 and the (low, high) they span. Probabilities are stretched from 0 to
    the map's peak, so zero stays the darkest colour while a 1000-way classifier's modest peak
    (often 0.2-0.5, shared between near-synonym classes) still reads at a glance; the legend
    gives the peak's value. Other scores (logits) are stretched min..max. Cells no pass scored
    stay NaN (drawn as holes)."""
    cells = cells.astype(np.float64)
    if np.isnan(cells).all():
        return cells, 0.0, 1.0
    low, high = float(np.nanmin(cells)), float(np.nanmax(cells))
    if low >= 0.0 and high <= 1.0:
        low = 0.0
    return (cells - low) / (high - low if high > low else 1.0), low, high


def _cell_probabilities(scale: ScaleResult, index: int) -> np.ndarray:
    """The [h, w] map of class `index`; logits over all classes become per-cell probabilities
    (softmax across classes), whose absolute 0..1 scale reads better than raw logits."""
    scores = scale.scores
    every_class = not scale.classes or scale.classes == tuple(range(scores.shape[0]))
    finite = scores[np.isfinite(scores)]
    if every_class and scores.shape[0] > 1 and finite.size and (finite.min() < 0 or finite.max() > 1):
        holes = np.isnan(scores).any(axis=0)  # cells no pass scored stay holes
        filled = np.where(holes, 0.0, scores)
        shifted = np.exp(filled - filled.max(axis=0, keepdims=True))
        return np.where(holes, np.nan, (shifted / shifted.sum(axis=0, keepdims=True))[index])
    return scale.class_map(index)


def canvas_scale(width: int, height: int) -> int:
    """The whole factor a width x height photo is enlarged by, so its shorter side reaches MIN_CANVAS_SIDE."""
    return max(1, math.ceil(MIN_CANVAS_SIDE / max(1, min(width, height))))


def _nearest_cells(size: int, factor: int, center: float, stride: float, cells: int) -> np.ndarray:
    """For each canvas pixel along one axis, the index of the cell whose centre is nearest."""
    photo_pixels = (np.arange(size) + 0.5) / factor - 0.5  # pixel i is centred at i (docs/concepts.md)
    return np.clip(np.round((photo_pixels - center) / stride), 0, cells - 1).astype(np.intp)


def render_heatmap(photo: Image.Image, result: ScoreResult) -> Image.Image:
    """`photo` (the scored image, original size) with the top class's map overlaid and a legend,
    enlarged by canvas_scale() when it is small. The photo is converted to RGB as the server converts
    it for scoring (16-bit scaled, not clipped), so the map lies over the image that was scored."""
    photo = open_photo(photo)
    if (photo.height, photo.width) != (result.image_height, result.image_width):
        raise HeatmapError(
            f"photo is {photo.width}x{photo.height} but the scored image was "
            f"{result.image_width}x{result.image_height}; draw over the image that was scored"
        )
    if not result.top_k:
        raise HeatmapError("the result has no image-level top-k to pick the class to draw")
    top = result.top_k[0]
    scale = _finest(result)
    if scale.classes and top.index not in scale.classes:
        raise HeatmapError(f"the maps carry classes {list(scale.classes)}, not the top class {top.index}")
    values, low, high = _normalise(_cell_probabilities(scale, top.index))
    g = scale.geometry
    factor = canvas_scale(photo.width, photo.height)
    canvas = photo
    if factor > 1:
        canvas = canvas.resize((photo.width * factor, photo.height * factor), Image.Resampling.NEAREST)
    rows = _nearest_cells(canvas.height, factor, g.center_y, g.stride_y, scale.height)
    cols = _nearest_cells(canvas.width, factor, g.center_x, g.stride_x, scale.width)
    holes = np.isnan(values)
    cell_colours = colormap(values)
    cell_colours[holes] = HOLE_COLOUR
    colours = cell_colours[rows][:, cols].astype(np.float64)
    pixels = np.asarray(canvas).astype(np.float64)
    blended = Image.fromarray(np.round(pixels * (1 - OVERLAY_ALPHA) + colours * OVERLAY_ALPHA).astype(np.uint8), "RGB")
    _draw_legend(blended, f"{top.label}  p={top.probability:.2f}", low, high, legend_notes(g, holes=bool(holes.any())))
    return blended


def legend_notes(geometry: Geometry, *, holes: bool) -> tuple[str, ...]:
    """The legend's lines under the colour bar: the cells' geometry, and what grey means when there are holes."""
    notes = (f"{_number(geometry.stride_x)} px cells, each sees {_number(geometry.box_width)} px",
             "a pixel shows its nearest cell")
    return notes + (("grey: cells not scored (holes of the diagonal shift)",) if holes else ())


def _number(value: float) -> str:
    """A legend number as people write it: 1,390 and 16, not 1.39e+03; three significant digits below 100."""
    return f"{value:,.0f}" if abs(value) >= 100 or value == round(value) else f"{value:.3g}"


def _draw_legend(image: Image.Image, title: str, low: float, high: float, notes: tuple[str, ...]) -> None:
    size = max(LEGEND_MIN_TEXT_PX, round(min(image.size) * LEGEND_TEXT_FRACTION))
    font = ImageFont.load_default(size=size)
    draw = ImageDraw.Draw(image, "RGBA")
    pad = max(2, size // 3)
    bar_width = max(size * 6, draw.textlength(title, font=font))
    small = ImageFont.load_default(size=max(LEGEND_MIN_TEXT_PX - 2, size * 3 // 4))
    note_top = pad * 4 + size * 2 + size // 2
    line = small.size + pad
    widest = max([bar_width] + [draw.textlength(note, font=small) for note in notes])
    box = (pad, pad, pad * 3 + widest, note_top + line * len(notes))
    draw.rectangle(box, fill=(0, 0, 0, 170))
    draw.text((pad * 2, pad * 2), title, font=font, fill=(255, 255, 255, 255))
    bar_top = pad * 3 + size
    ramp = colormap(np.linspace(0.0, 1.0, int(bar_width))[None, :].repeat(max(1, size // 2), axis=0))
    image.paste(Image.fromarray(ramp, "RGB"), (pad * 2, bar_top))
    label_top = bar_top + size // 2 + 1
    draw.text((pad * 2, label_top), _number(low), font=small, fill=(255, 255, 255, 255))
    high_text = _number(high)
    draw.text((pad * 2 + bar_width - draw.textlength(high_text, font=small), label_top), high_text,
              font=small, fill=(255, 255, 255, 255))
    for n, note in enumerate(notes):
        draw.text((pad * 2, note_top + n * line), note, font=small, fill=(255, 255, 255, 255))


def heatmap_png(photo: Image.Image, result: ScoreResult) -> bytes:
    """The heatmap of `result` over `photo`, encoded as PNG."""
    buffer = io.BytesIO()
    render_heatmap(photo, result).save(buffer, format="PNG")
    return buffer.getvalue()
