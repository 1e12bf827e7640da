"""A loaded model as every front stage reads it: its card, buckets, memory predictions and limits (its plans and
batcher are the engine's)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from convert.card import ImageInput, batch_shape
from protos import model_card_pb2
from server.engine.device_graph import scores_shape
from server.geometry import buckets, dense
from server.memory.device import PlanMemory
from server.memory.host_budget import HostBudget
from server.settings import RequestLimits

__all__ = ["Model"]

FALLBACK_SCALE = 384  # when a card names no default scale
CELLS_CACHE_SIZE = 4096  # resized sizes whose cell counts each model remembers


@dataclass(eq=False)
class Model:
    """A model ready to score: its card, buckets, memory check and the limits it serves under."""

    name: str
    path: str
    card: model_card_pb2.ModelCard
    image: ImageInput
    classes: int
    plan_memory: PlanMemory
    buckets: buckets.Buckets
    fill: np.ndarray
    limits: RequestLimits
    host_budget: HostBudget
    strict_shapes: bool
    halo: int | None  # --halo: context of the tiles of an image no bucket holds (None: exact)
    tile_canvas: tuple[int, int]  # --tile-canvas: beyond it images are tiled, never planned
    queue_depth: int  # --queue-depth: items of this model that may wait or decode at once

    @property
    def default_scale(self) -> int:
        return self.card.default_scale or FALLBACK_SCALE

    @property
    def training_size(self) -> int:
        return max(self.card.training_height, self.card.training_width)

    @property
    def min_scale(self) -> int:
        return max(self.limits.min_scale or 0, self.training_size)

    @property
    def strides(self) -> tuple[int, ...]:
        return dense.offered_strides(self.card.output_stride)

    def label(self, index: int) -> str:
        return self.card.labels[index] if index < len(self.card.labels) else str(index)

    @functools.cached_property
    def label_bytes(self) -> int:
        """The longest label's size in a response (UTF-8), for its size estimate."""
        return max(len(self.label(index).encode()) for index in range(self.classes))

    @property
    def multiple(self) -> int:
        """What sizes are rounded to: the card's size multiple, else the model's stride."""
        return self.card.size_multiple or self.card.output_stride

    def __post_init__(self) -> None:
        # Per instance (functools.lru_cache on a method would be shared, and keep every model alive).
        self._rows = functools.lru_cache(maxsize=CELLS_CACHE_SIZE)(lambda height: self._net_cells(height, None)[0])
        self._columns = functools.lru_cache(maxsize=CELLS_CACHE_SIZE)(lambda width: self._net_cells(None, width)[1])

    def net_cells(self, height: int, width: int) -> tuple[int, int]:
        """Cells (rows, columns) the net gives for an unpadded input of this size: what a map keeps per pass;
        0 along an axis below the training size. Each axis depends on that side only, so each is cached alone."""
        return self._rows(height), self._columns(width)

    def _net_cells(self, height: int | None, width: int | None) -> tuple[int, int]:
        height = height or self.card.training_height
        width = width or self.card.training_width
        if height < self.card.training_height or width < self.card.training_width:
            return 0, 0
        shape = batch_shape(self.image.layout, batch=1, channels=3, height=height, width=width)
        dims, _type = scores_shape(self.plan_memory.model.model, input_name=self.image.name,
                                   scores_name=self.card.scores_name, input_shape=shape)
        return dims[2], dims[3]

    def canvas_for(self, size: tuple[int, int], passes: dense.Passes) -> tuple[int, int] | None:
        """The canvas bucket of a resized size; else, within --tile-canvas's pixels (what a plan's memory follows),
        one planned on demand (under --strict-shapes, which plans no other shape, the tile canvas when it holds
        it); None when it must be tiled."""
        canvas = self.buckets.canvas_for(*size, slack=passes.slack)
        if canvas is not None:
            return canvas
        canvas = buckets.on_demand_canvas(*size, slack=passes.slack, multiple=self.multiple)
        if canvas[0] * canvas[1] > self.tile_canvas[0] * self.tile_canvas[1]:
            return None
        if not self.strict_shapes:
            return canvas
        return self.tile_canvas if canvas[0] <= self.tile_canvas[0] and canvas[1] <= self.tile_canvas[1] else None

    def tiling_canvas(self, size: tuple[int, int], passes: dense.Passes) -> tuple[int, int]:
        """The canvas an image beyond --tile-canvas is tiled onto: the tile canvas, cut along an axis the image
        fits to what one pass needs there (a panorama's strip is not padded to a square), unless
        --strict-shapes allows no other shape."""
        if self.strict_shapes:
            return self.tile_canvas
        needed = buckets.on_demand_canvas(*size, slack=passes.slack, multiple=self.multiple)
        return min(self.tile_canvas[0], needed[0]), min(self.tile_canvas[1], needed[1])
