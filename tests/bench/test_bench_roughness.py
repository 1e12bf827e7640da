"""The roughness measure and the à trous / grid alignment of bench/bench_roughness.py, on arrays."""

from __future__ import annotations

import numpy as np
import pytest

from bench.bench_roughness import aligned_difference, roughness, row_profile
from protos import scoring_pb2


def test_a_linear_profile_is_smooth_and_an_alternating_one_is_not():
    assert roughness(np.linspace(0.1, 0.9, 9)) == pytest.approx(0.0, abs=1e-12)
    assert roughness(np.array([0.2, 0.3, 0.2, 0.3, 0.2])) == pytest.approx(0.1)


def test_row_profiles_skip_the_cells_no_pass_scored():
    probabilities = np.array([[0.2, np.nan, 0.4], [np.nan, 0.5, np.nan]])
    np.testing.assert_allclose(row_profile(probabilities), [0.3, 0.5])


def test_maps_are_compared_on_the_cells_centred_on_the_same_pixels():
    rng = np.random.default_rng(0)
    atrous = rng.normal(size=(3, 4, 5)).astype(np.float32)
    grid = np.full((3, 6, 7), 100.0, dtype=np.float32)
    grid[:, 1:5, 1:6] = atrous + 0.5  # the grid's lattice starts one cell (16 px) earlier on each axis

    def scale_map(center: float) -> scoring_pb2.ScaleMap:
        return scoring_pb2.ScaleMap(geometry=scoring_pb2.MapGeometry(center_y=center, center_x=center,
                                                                    stride_y=16, stride_x=16))

    assert aligned_difference((grid, scale_map(100.0)), (atrous, scale_map(116.0))) == pytest.approx((0.5, 0.5))
