"""Tiling an image of any size onto one canvas shape, exactly: plain numpy and dataclasses (docs/design.md: exact tiles with the exact halo).

A map cell's score depends on the pixels of its receptive field only, so a tile that holds every
owned cell's whole field scores those cells as one pass over the whole image does. Three facts
make the tiles stitch to that pass cell for cell:
- lattice: a tile starts on a multiple of the net's stride S (= the lattice stride times the pass
  factor), so its passes' cells fall on the whole image's cells; it ends on the image's width
  modulo S, so its mirror falls on the mirrored image's cells too (flips);
- halo: an owned cell's centre lies at least `halo` pixels inside its tile; `exact_halo` is half
  the receptive field, beyond which no pixel reaches the cell;
- edges: a tile on an image edge starts (or ends) on that edge, so it sees what the one pass sees
  there: the net's own padding before the first pixel, `fill` pixels of canvas fill after the last
  (the one pass's canvas is the image plus the passes' slack, rounded up to the canvas multiple),
  never a halo.

Each map cell is owned by exactly one tile: the one whose owned range [start, end) of cell centres
holds it (the first tile's range starts at -inf, the last's ends at +inf). A smaller halo than the
exact one is a measured trade-off (bench/bench_halo.py); every plan says whether it is exact.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from server.geometry.dense import Passes


class TilingError(ValueError):
    """A tile canvas too small for the halo asked; the message says the least canvas that works."""


@dataclass(frozen=True)
class Lattice:
    """Where a map's cells lie on one axis of the image: cell m is centred at first + stride*m."""

    stride: int  # pixels between cells of the map
    net_stride: int  # the net's own stride: tiles start on its multiples
    first: float  # the centre of cell 0, in image pixels (the receptive field's centre less the slack)
    slack: int  # canvas pixels the shifted passes need beyond the image
    multiple: int  # what a canvas planned for one pass is rounded up to (server.geometry.buckets.on_demand_canvas)
    training: int  # the classifier's training size: an input of it gives one cell per pass

    @classmethod
    def of(cls, *, field_center: float, passes: Passes, training: int, multiple: int = 0) -> Lattice:
        """The lattice of a model (its card's receptive-field centre and training size) scored with `passes`;
        `multiple` 0: the net stride."""
        net = passes.stride * passes.factor
        return cls(stride=passes.stride, net_stride=net, first=field_center - passes.slack, slack=passes.slack,
                   multiple=multiple or net, training=training)

    def fill(self, length: int) -> int:
        """Canvas fill after an image of `length` in one pass: the slack, rounded up to the canvas multiple."""
        return math.ceil((length + self.slack) / self.multiple) * self.multiple - length

    def mirror_offset(self, length: int) -> float:
        """Pixels between a mirrored cell and the unmirrored one it is averaged with (server.geometry.dense.mirror_back)."""
        anchor = (length - 1 - 2 * self.first) / self.stride
        return abs(anchor - round(anchor)) * self.stride

    def context(self, halo: int, *, length: int, mirrored: bool = False) -> tuple[int, int]:
        """Pixels a tile reads (before, after) its owned cell centres, for `halo` on an axis of `length`."""
        net = self.net_stride
        if mirrored:  # a mirrored cell lands on the nearest unmirrored one, up to half a cell away
            halo += math.ceil(self.mirror_offset(length))
        # After the last owned centre: the halo, and room for the tile's last cell. A pass over the training
        # size T gives one cell, centred at c (the unshifted field centre), and one more per whole stride S
        # beyond, so the last lies less than T - c + S before the tile's end, padded net or not.
        trail = max(halo, math.ceil(self.training - self.first - self.slack)) + net
        # Before the first owned centre, on the lattice: at least to the tile's first cell, and when mirrored,
        # what its mirror needs after.
        lead = math.ceil(max(halo, self.first, trail if mirrored else 0) / net) * net
        return lead, trail

    def least_canvas(self, halo: int, *, length: int, step: int, mirrored: bool = False) -> int:
        """The smallest canvas whose interior tiles own `step` pixels each (a multiple of S) with `halo`."""
        lead, trail = self.context(halo, length=length, mirrored=mirrored)
        return math.ceil((lead + trail + step + self.fill(length)) / self.multiple) * self.multiple

    def first_cell_at_or_after(self, pixel: float) -> int:
        """The index of the first cell whose centre is at or after `pixel`."""
        return math.ceil((pixel - self.first) / self.stride)


def exact_halo(field_size: int) -> int:
    """Pixels of context each side of an owned cell's centre beyond which nothing reaches it."""
    return math.ceil((field_size - 1) / 2)


@dataclass(frozen=True)
class Span:
    """One tile along one axis: the image pixels it reads and the map cells it owns."""

    start: int  # first image pixel of the tile (a multiple of the net stride)
    stop: int  # one past its last pixel
    first_cell: int  # the image-map index of the tile's own cell 0 (start / stride)
    owned: tuple[int, int | None]  # image-map cells it owns, [begin, end); end None: to the map's end

    @property
    def length(self) -> int:
        return self.stop - self.start

    def local(self, cells: int) -> slice:
        """The owned cells as a slice of the tile's own map of `cells` cells."""
        begin, end = self.owned
        return slice(begin - self.first_cell, cells if end is None else end - self.first_cell)


def plan_axis(length: int, *, extent: int, halo: int, lattice: Lattice, mirrored: bool = False) -> tuple[Span, ...]:
    """Tiles of at most `extent` pixels covering an axis of `length`, each owning whole cells, none twice.

    `extent` is the longest tile: the canvas less the one pass's fill (see `plan`). Owned ranges
    step by a multiple of the net stride; every tile but the last reads `extent` pixels, the last
    ends on the image's end and starts as early as `extent` lets it (more context, same cells).
    `mirrored`: the axis is also scored flipped, so each tile's start is its mirror's end.
    """
    net = lattice.net_stride
    if length <= extent:
        return (Span(0, length, 0, (0, None)),)
    lead, trail = lattice.context(halo, length=length, mirrored=mirrored)
    first_step = (extent - trail) // net * net
    step = (extent - lead - trail) // net * net
    if first_step <= 0 or step <= 0:
        need = lead + trail + net
        raise TilingError(
            f"a tile of {extent} px cannot hold a halo of {halo} px each side and a {net}-px step of the lattice; "
            f"use tiles of at least {need} px (a canvas of at least "
            f"{math.ceil((need + lattice.fill(length)) / lattice.multiple) * lattice.multiple} px) or a smaller halo")
    bounds = [0, first_step]  # owned ranges of cell centres, in image pixels
    while bounds[-1] - lead + extent < length:
        bounds.append(bounds[-1] + step)
    spans = []
    for index, begin in enumerate(bounds):
        last = index == len(bounds) - 1
        start = math.ceil((length - extent) / net) * net if last else max(0, begin - lead)
        stop = length if last else start + extent
        owned_begin = 0 if index == 0 else lattice.first_cell_at_or_after(begin)
        owned_end = None if last else lattice.first_cell_at_or_after(bounds[index + 1])
        spans.append(Span(start, stop, start // lattice.stride, (owned_begin, owned_end)))
    return tuple(spans)


@dataclass(frozen=True)
class Tile:
    """One tile: the image region it reads (with its halo) and the map cells it owns."""

    row: int
    column: int
    y: Span
    x: Span

    @property
    def region(self) -> tuple[slice, slice]:
        """The image pixels to read, (rows, columns)."""
        return slice(self.y.start, self.y.stop), slice(self.x.start, self.x.stop)

    def owned(self, cells: tuple[int, int]) -> tuple[slice, slice]:
        """The owned cells as slices of the tile's own map of `cells` (rows, columns)."""
        return self.y.local(cells[0]), self.x.local(cells[1])

    def placed(self, cells: tuple[int, int]) -> tuple[slice, slice]:
        """Where the owned cells go in the image's map."""
        rows, columns = self.owned(cells)
        return (slice(rows.start + self.y.first_cell, rows.stop + self.y.first_cell),
                slice(columns.start + self.x.first_cell, columns.stop + self.x.first_cell))


@dataclass(frozen=True)
class TilePlan:
    """The tiles of one image on one canvas shape, and what stitching them gives."""

    image: tuple[int, int]
    canvas: tuple[int, int]
    halo: int
    exact: bool
    lattices: tuple[Lattice, Lattice]
    rows: tuple[Span, ...]
    columns: tuple[Span, ...]

    def __iter__(self) -> Iterator[Tile]:
        for r, y in enumerate(self.rows):
            for c, x in enumerate(self.columns):
                yield Tile(r, c, y, x)

    def __len__(self) -> int:
        return len(self.rows) * len(self.columns)

    @property
    def last(self) -> Tile:
        """The bottom-right tile: its map's size gives the image map's size (`map_cells`)."""
        return Tile(len(self.rows) - 1, len(self.columns) - 1, self.rows[-1], self.columns[-1])

    def map_cells(self, last_tile_cells: tuple[int, int]) -> tuple[int, int]:
        """Cells (rows, columns) of the image's map, from the cells of the last tile's map."""
        return self.rows[-1].first_cell + last_tile_cells[0], self.columns[-1].first_cell + last_tile_cells[1]

    def describe(self) -> str:
        return (f"{len(self.rows)}x{len(self.columns)} tiles of at most {self.canvas[0]}x{self.canvas[1]} canvas, "
                f"halo {self.halo} px ({'exact' if self.exact else 'approximate'})")


def plan(image: tuple[int, int], canvas: tuple[int, int], *, field_size: int, field_center: tuple[float, float],
         training: tuple[int, int], passes: Passes, halo: int | None = None, multiple: int = 0,
         flip: bool = False) -> TilePlan:
    """The tiles of an `image` (height, width) scored on canvases of `canvas` (height, width) with `passes`.

    A tile reads at most the canvas less the one pass's fill after the image, so an edge tile's
    canvas ends where the one pass's does. `halo` None: exact (half the receptive field). `training`: the
    classifier's training size (height, width), which places a tile's last cell.
    `multiple`: what the server rounds canvases to (the card's size multiple, else its stride);
    `flip`: the columns are also scored mirrored.
    """
    exact = exact_halo(field_size)
    halo = exact if halo is None else halo
    if halo < 0:
        raise TilingError(f"halo {halo} is negative; give 0 or more pixels, or none for the exact {exact}")
    if multiple and any(side % multiple for side in canvas):
        raise TilingError(f"canvas {canvas[0]}x{canvas[1]} is not a multiple of {multiple}, as the server's canvases "
                          f"are; use one that is, e.g. {math.ceil(canvas[0] / multiple) * multiple}")
    lattices = tuple(Lattice.of(field_center=center, passes=passes, training=size, multiple=multiple)
                     for center, size in zip(field_center, training))
    spans = []
    for axis in range(2):
        lattice = lattices[axis]
        extent = canvas[axis] - lattice.fill(image[axis])
        spans.append(plan_axis(image[axis], extent=extent, halo=halo, lattice=lattice, mirrored=flip and axis == 1))
    return TilePlan(image, canvas, halo, halo >= exact, lattices, spans[0], spans[1])


def stitch_into(out: np.ndarray, tile: Tile, tile_map: np.ndarray) -> None:
    """Copy a tile's owned cells from its map [K, h, w] into the image's map `out` [K, H, W] (numpy or zarr)."""
    cells = tile_map.shape[-2:]
    rows, columns = tile.owned(cells)
    if min(rows.start, columns.start) < 0 or rows.stop > cells[0] or columns.stop > cells[1]:
        raise TilingError(
            f"tile {tile.row},{tile.column} scored {cells[0]}x{cells[1]} cells, which do not hold the cells it owns "
            f"(rows {rows.start}..{rows.stop}, columns {columns.start}..{columns.stop} of its map): a net without "
            "padding gives no cell whose receptive field leaves the tile; use the exact halo")
    out[(slice(None), *tile.placed(cells))] = tile_map[(slice(None), *tile.owned(cells))]
