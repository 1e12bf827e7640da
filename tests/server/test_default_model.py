"""The default EfficientNet-Lite0, served: shifted passes of the stride-32 graph vs its à trous stride-16 graph."""

import pathlib

import numpy as np

from protos import scoring_pb2

SAMPLES = pathlib.Path(__file__).resolve().parents[2] / "samples"
MARGIN = 2  # lattice cells kept off each border, where edge padding (grid) and zero padding (à trous) differ


def test_atrous_and_grid_interiors_agree(kit, default_model_path, default_model_os16_path):
    cat = (SAMPLES / "cat.jpg").read_bytes()
    with kit.serving([default_model_path], max_batch=4) as (_server, _port, stub):
        grid = stub.Score(scoring_pb2.ScoreRequest(encoded=cat, scales=[320], output_stride=16, return_maps=True))
    with kit.serving([default_model_os16_path]) as (_server, _port, stub):
        atrous = stub.Score(scoring_pb2.ScoreRequest(encoded=cat, scales=[320], output_stride=16, return_maps=True))
    assert (grid.shift, atrous.shift) == (scoring_pb2.SHIFT_GRID, scoring_pb2.SHIFT_ATROUS)
    assert grid.maps[0].geometry == atrous.maps[0].geometry
    a = kit.decode_tensor(grid.maps[0].scores)
    b = kit.decode_tensor(atrous.maps[0].scores)
    # Both lattices start at the same cell (0, 0); the à trous one may stop a cell earlier, where the
    # last shifted passes look into the edge padding.
    height, width = min(a.shape[1], b.shape[1]), min(a.shape[2], b.shape[2])
    assert 0 <= a.shape[1] - height <= 1 and 0 <= a.shape[2] - width <= 1 and b.shape[1:] == (height, width)
    a = a[:, MARGIN:height - MARGIN, MARGIN:width - MARGIN]
    b = b[:, MARGIN:height - MARGIN, MARGIN:width - MARGIN]
    assert a.shape[1] >= 3 and a.shape[2] >= 6
    difference = np.abs(a - b).mean()
    # The lattices line up: the same cell in both is far closer than neighbouring cells of one map.
    # (Deterministic numbers; measured 0.05 here vs 0.13 between neighbouring cells at scale 320.)
    neighbours = min(np.abs(a[:, :, 1:] - b[:, :, :-1]).mean(), np.abs(a[:, 1:] - b[:, :-1]).mean())
    assert difference < 0.1 and difference < 0.75 * neighbours, (difference, neighbours)
    assert (a.argmax(0) == b.argmax(0)).mean() >= 0.95
    assert grid.top_k[0].label == atrous.top_k[0].label and "cat" in grid.top_k[0].label
