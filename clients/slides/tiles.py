"""Scoring an image tile by tile through any scorer that answers ScoreRequests (server or in-process).

Each tile goes as raw pixels at its own shorter side, so the server does not resize it, and comes
back as its [K, h, w] map; server.geometry.tiling says which of its cells it owns. The one pass this
equals is the same request over the whole image.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from clients.api.results import decode_tensor
from protos import model_card_pb2, scoring_pb2
from server.geometry import dense, tiling

Scorer = Callable[[scoring_pb2.ScoreRequest], scoring_pb2.ScoreResponse]


@dataclass(frozen=True)
class TileOptions:
    """What every tile's request asks: the same for every tile, so the tiles stitch."""

    model: str = ""
    output_stride: int = 0
    shift: int = scoring_pb2.SHIFT_UNSPECIFIED
    flip: bool = False
    classes: tuple[int, ...] = ()


def plan_for(card: model_card_pb2.ModelCard, image: tuple[int, int], canvas: tuple[int, int], *,
             options: TileOptions, halo: int | None = None) -> tiling.TilePlan:
    """The tiles of `image` (height, width) for `card`'s model on `canvas`, with the passes `options` ask."""
    passes = dense.passes_for(native_stride=card.output_stride, output_stride=options.output_stride,
                               shift=options.shift)
    field = card.receptive_field
    return tiling.plan(image, canvas, field_size=field.size, field_center=(field.center_y, field.center_x),
                       training=(card.training_height, card.training_width),
                       passes=passes, halo=halo, multiple=card.size_multiple or card.output_stride,
                       flip=options.flip)


def tile_request(pixels: np.ndarray, options: TileOptions) -> scoring_pb2.ScoreRequest:
    """The request scoring [h, w, 3] uint8 `pixels` at their own size, maps in float32."""
    height, width = pixels.shape[:2]
    return scoring_pb2.ScoreRequest(
        model=options.model, scales=[min(height, width)], output_stride=options.output_stride, shift=options.shift,
        flip=options.flip, return_maps=True, map_dtype=scoring_pb2.FLOAT32, classes=list(options.classes),
        raw=scoring_pb2.RawImage(data=np.ascontiguousarray(pixels, np.uint8).tobytes(), height=height, width=width,
                                 channels=3),
    )


def score_map(score: Scorer, pixels: np.ndarray, options: TileOptions) -> np.ndarray:
    """The [K, h, w] float32 map of `pixels` scored whole (one tile, or the one-pass reference)."""
    response = score(tile_request(pixels, options))
    return decode_tensor(response.maps[0].scores)


def score_tiled(score: Scorer, image: np.ndarray, plan: tiling.TilePlan, options: TileOptions) -> np.ndarray:
    """An in-memory image's map scored tile by tile and stitched (the bounded-memory path writes to Zarr)."""
    tiles = list(plan)
    last = score_map(score, image[plan.last.region], options)
    out = np.full((last.shape[0], *plan.map_cells(last.shape[1:])), np.nan, dtype=np.float32)
    for tile in tiles[:-1]:
        tiling.stitch_into(out, tile, score_map(score, image[tile.region], options))
    tiling.stitch_into(out, plan.last, last)
    return out
