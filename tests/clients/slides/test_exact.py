"""Exact tiling on real converted graphs: the stitched map equals one pass over the whole image.

Both go through the in-process pipeline users get (`scoremap-score --local`), raw pixels at their own
size (no resize), and canvases planned as the one pass's (image + slack, rounded), so an edge tile's
canvas ends where the one pass's does.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from clients.slides.tiles import TileOptions, plan_for, score_map, score_tiled
from convert.card import read_card
from protos.scoring_pb2 import SHIFT_ATROUS, SHIFT_DIAGONAL, SHIFT_GRID, SHIFT_NONE
from server.scoring.pipeline import Pipeline
from tests.clients.slides.nets import ON_DEMAND

TOLERANCE = 1e-5  # float32 on the CPU; |difference| per cell, logits


def image(height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def assert_tiles_equal_one_pass(path: str, pixels: np.ndarray, canvas: tuple[int, int], options: TileOptions,
                                *, min_tiles: int = 4) -> None:
    card = read_card(path)
    pipeline = Pipeline([path], settings=ON_DEMAND)
    try:
        plan = plan_for(card, pixels.shape[:2], canvas, options=options)
        assert plan.exact and len(plan) >= min_tiles, plan.describe()
        whole = score_map(pipeline.score, pixels, options)
        tiled = score_tiled(pipeline.score, pixels, plan, options)
    finally:
        pipeline.close()
    assert tiled.shape == whole.shape
    assert np.array_equal(np.isnan(tiled), np.isnan(whole)), "the same cells are unscored (diagonal) in both"
    difference = np.nanmax(np.abs(tiled - whole))
    assert difference <= TOLERANCE, f"max |tiled - one pass| = {difference:.3g} over {plan.describe()}"


SCHEMES = {
    "none": (32, TileOptions(shift=SHIFT_NONE)),
    "grid": (32, TileOptions(output_stride=16, shift=SHIFT_GRID)),
    "diagonal": (32, TileOptions(output_stride=16, shift=SHIFT_DIAGONAL)),
    "atrous": (16, TileOptions(shift=SHIFT_ATROUS)),
}


@pytest.mark.parametrize("flip", [False, True], ids=["plain", "flip"])
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "pad-free"])
def test_tiles_stitch_to_one_pass_on_tiny_converted_nets(converted, scheme, padded, flip):
    output_stride, options = SCHEMES[scheme]
    path = converted(padded, False, output_stride)
    # Sizes that are no multiple of the tile, nor of the stride (the pad-free net's ragged end included).
    assert_tiles_equal_one_pass(path, image(617, 541), (320, 288), dataclasses.replace(options, flip=flip))


@pytest.mark.parametrize("scheme", ["grid", "atrous"])
def test_tiles_stitch_to_one_pass_in_nhwc(converted, scheme):
    output_stride, options = SCHEMES[scheme]
    path = converted(True, True, output_stride)
    assert_tiles_equal_one_pass(path, image(500, 700, seed=1), (288, 320), dataclasses.replace(options, flip=True))


def test_the_default_model_tiles_to_one_pass_on_the_grid(default_model_path):
    # Receptive field 1043 px: a halo of 521 px each side, so the canvas holds ~1.1 k px of halo per tile. Flips
    # stitch as the tiny nets show; here the real receptive field and padding, on the grid's four passes.
    assert_tiles_equal_one_pass(default_model_path, image(1280, 1184, seed=2), (1248, 1248),
                                TileOptions(output_stride=16, shift=SHIFT_GRID), min_tiles=2)


def test_a_halo_below_the_receptive_field_is_flagged_and_differs(converted):
    """The exactness check can fail: with too little context the seams show."""
    path = converted(True, False)
    pixels, options = image(617, 541), TileOptions(output_stride=16, shift=SHIFT_GRID)
    pipeline = Pipeline([path], settings=ON_DEMAND)
    try:
        plan = plan_for(read_card(path), pixels.shape[:2], (320, 288), options=options, halo=8)
        assert not plan.exact and "approximate" in plan.describe()
        difference = np.abs(score_tiled(pipeline.score, pixels, plan, options) - score_map(pipeline.score, pixels, options))
    finally:
        pipeline.close()
    assert difference.max() > 1e-3
