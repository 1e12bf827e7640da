"""The default EfficientNet-Lite0, served: shifted passes of the stride-32 graph vs its à trous stride-16 graph."""

import io
import pathlib

import numpy as np
import pytest
from PIL import Image

from protos import scoring_pb2

SAMPLES = pathlib.Path(__file__).resolve().parents[3] / "samples"
MARGIN = 2  # lattice cells kept off each border, where the shifted passes' mean-colour fill and zero padding differ


def test_atrous_and_grid_lattices_line_up(kit, default_model_path, default_model_os16_path):
    cat = (SAMPLES / "cat.jpg").read_bytes()
    request = scoring_pb2.ScoreRequest(encoded=cat, scales=[320], output_stride=16, return_maps=True)
    with kit.serving([default_model_path], max_batch=4) as (_server, _port, stub):
        grid = stub.Score(request)
    with kit.serving([default_model_os16_path]) as (_server, _port, stub):
        atrous = stub.Score(request)
    assert (grid.shift, atrous.shift) == (scoring_pb2.SHIFT_GRID, scoring_pb2.SHIFT_ATROUS)
    g, a = grid.maps[0].geometry, atrous.maps[0].geometry
    # The grid's passes shifted by 16 px add one cell before the à trous lattice's first, in each axis.
    assert g.center_y == pytest.approx(a.center_y - g.stride_y) and g.center_x == pytest.approx(a.center_x - g.stride_x)
    first = kit.decode_tensor(grid.maps[0].scores)[:, 1:, 1:]
    second = kit.decode_tensor(atrous.maps[0].scores)
    height, width = min(first.shape[1], second.shape[1]), min(first.shape[2], second.shape[2])
    first = first[:, MARGIN:height - MARGIN, MARGIN:width - MARGIN]
    second = second[:, MARGIN:height - MARGIN, MARGIN:width - MARGIN]
    assert first.shape[1] >= 3 and first.shape[2] >= 6
    difference = np.abs(first - second).mean()
    # The lattices line up: the same cell in both is far closer than neighbouring cells of one map.
    # Not equal: EfficientNet-Lite0's receptive field spans the image, so no cell is free of the
    # border's padding, where shifted passes and dilated convolutions differ (README, "À trous").
    neighbours = min(np.abs(first[:, :, 1:] - second[:, :, :-1]).mean(), np.abs(first[:, 1:] - second[:, :-1]).mean())
    assert difference < 0.1 and difference < 0.75 * neighbours, (difference, neighbours)
    assert (first.argmax(0) == second.argmax(0)).mean() >= 0.95
    assert grid.top_k[0].label == atrous.top_k[0].label and "cat" in grid.top_k[0].label


def test_a_one_cell_wide_map_with_flip_has_a_finite_top_k(kit, default_model_path):
    """cat.jpg cropped to 300x300 at scale 224 with flip: a map one cell wide, and a finite image-level top-k."""
    with Image.open(SAMPLES / "cat.jpg") as image:
        crop = io.BytesIO()
        image.convert("RGB").crop((0, 0, 300, 300)).save(crop, "JPEG")
    with kit.serving([default_model_path]) as (_server, _port, stub):
        for stride in (32, 16):
            response = stub.Score(scoring_pb2.ScoreRequest(encoded=crop.getvalue(), scales=[224], flip=True,
                                                           return_maps=True, output_stride=stride, top_k=5))
            assert np.isfinite(kit.decode_tensor(response.maps[0].scores)).all()
            probabilities = [label.probability for label in response.top_k]
            assert np.isfinite(probabilities).all() and 0 < sum(probabilities) <= 1 + 1e-4
