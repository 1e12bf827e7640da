"""The request's types, below every stage: what a request becomes on its way through the pipeline.

    ScoreRequest --admission--> Ticket (one ScaleJob per scale) --decode--> Items --engine.run--> Scored
                 --assemble--> ScoreResponse

A scale larger than every canvas bucket is tiled onto one (server/geometry/tiling.py): its job holds
the tile plan, each tile (and its mirror) is an Item, and assemble stitches their owned cells.

Every stage module takes these types from here, and this module imports no stage, so the stages never import
each other for their types. server/scoring/pipeline.py sequences the stages; admission also calls the checks of
imaging, fitting and footprint, the same code a stage or `scoremap-inspect` runs, so what it admits is what runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from protos import scoring_pb2
from server.engine.device_graph import LATTICE, LATTICE_FP16
from server.geometry.dense import Passes
from server.settings import RequestLimits
from server.geometry.tiling import Tile, TilePlan

Cells = tuple[slice, slice]  # a region of a lattice (rows, columns)


@dataclass(frozen=True)
class TileJob:
    """One tile of a tiled scale: where it reads and what it owns (`tile`), the cells of its own map, and the
    cells of its lattice that count towards the image-level mean, unmirrored and mirrored (each map cell, and
    each cell of the whole image's mirrored lattice, once over the tiles)."""

    tile: Tile
    cells: tuple[int, int]
    kept: Cells
    kept_mirrored: Cells


@dataclass(frozen=True)
class ScaleJob:
    """One scale of a request as admitted: sizes, the canvas bucket and the cells kept."""

    scale: int
    resized: tuple[int, int]
    canvas: tuple[int, int]
    cells: tuple[int, int]
    items_per_batch: int  # items of this canvas one batch may hold in memory (a batch bucket)
    tiling: TilePlan | None = None  # set when the resized image is tiled onto `canvas` (no bucket holds it)
    tiles: tuple[TileJob, ...] = ()

    @property
    def parts(self) -> int:
        """Items per orientation: its tiles, or the one canvas."""
        return len(self.tiles) or 1

    def pieces(self, mirrored: bool) -> list[tuple[tuple[int, int], Cells | None]]:
        """Each item's cells and the cells its image-level mean counts (None: all), for one orientation."""
        if not self.tiles:
            return [(self.cells, None)]
        return [(tile.cells, tile.kept_mirrored if mirrored else tile.kept) for tile in self.tiles]


class ItemKey(NamedTuple):
    """Which item of a request a canvas or a result is: its scale (the index of its ScaleJob), orientation and
    part (tile). Decoding and assembly find each other's items by it, never by position (as vLLM's output
    processor keys outputs by request id)."""

    scale: int
    flip: bool
    part: int


@dataclass(frozen=True)
class GroupKey:
    """Items that can share a batch: one canvas shape, one set of passes."""

    height: int
    width: int
    passes: Passes


@dataclass(frozen=True)
class Item:
    """One canvas to score: a scale of an image, or its mirror."""

    canvas: np.ndarray
    cells: tuple[int, int]
    lattice: str | None  # the plan output its response needs (LATTICE, LATTICE_FP16), or None
    traffic: bool  # False for the server's own warm-up, which the metrics leave out
    kept: Cells | None = None  # the cells its image-level mean counts (a tile's own); None: all `cells`
    classes: tuple[int, ...] = ()  # the lattice's classes the host keeps (`lattice_classes`); (): every class

    def valid(self) -> Cells:
        return self.kept or (slice(0, self.cells[0]), slice(0, self.cells[1]))


@dataclass
class Scored:
    """What the run stage gives back for one item."""

    lattice: np.ndarray | None
    probabilities: np.ndarray
    planning_seconds: float


def top_k(request: scoring_pb2.ScoreRequest, limits: RequestLimits) -> int:
    """How many of the image's classes the response lists."""
    return request.top_k or limits.default_top_k


def lattice_output(request: scoring_pb2.ScoreRequest) -> str | None:
    """The plan output a request's response needs: none without maps and cell top-k (the image's probabilities
    come back alone), half the bytes for float16 maps (cell top-k ranks in float32)."""
    if not (request.return_maps or request.cell_top_k):
        return None
    return LATTICE_FP16 if request.map_dtype == scoring_pb2.FLOAT16 and not request.cell_top_k else LATTICE


def lattice_classes(request: scoring_pb2.ScoreRequest) -> tuple[int, ...]:
    """The classes the host keeps of each lattice as it comes back: the maps' `classes` when nothing else needs
    the others (cell top-k ranks every class), else () for all. Fewer classes then hold less host memory, not
    only fewer response bytes, so `classes` lets a large image's maps fit both."""
    if request.return_maps and request.classes and not request.cell_top_k:
        return tuple(request.classes)
    return ()
