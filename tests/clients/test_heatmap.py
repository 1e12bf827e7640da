import numpy as np
import pytest
from PIL import Image

from clients.heatmap import HeatmapError, colormap, render_heatmap
from clients.results import Geometry, Prediction, ScaleResult, ScoreResult


def result(height: int, width: int, scores: np.ndarray, geometry: Geometry) -> ScoreResult:
    return ScoreResult(model="m", image_height=height, image_width=width, top_k=[Prediction("hot", 1, 0.9)],
                       maps=[ScaleResult(64, scores.shape[1], scores.shape[2], geometry, (), scores)])


def test_cells_are_painted_where_the_geometry_puts_them():
    photo = Image.new("RGB", (128, 96), (128, 128, 128))
    scores = np.zeros((2, 3, 4), np.float32)
    scores[1, 2, 3] = 1.0  # class 1 lights up only in the bottom-right cell
    geometry = Geometry(32, 32, 16, 16, 32, 32, 1.0, 96, 128)
    pixels = np.asarray(render_heatmap(photo, result(96, 128, scores, geometry))).astype(int)
    hot, cold = pixels[80, 112], pixels[48, 48]  # centres of cells (2, 3) and (1, 1)
    yellow, purple = colormap(np.array(1.0)).astype(int), colormap(np.array(0.0)).astype(int)
    assert np.abs(hot - (0.45 * 128 + 0.55 * yellow)).max() <= 2
    assert np.abs(cold - (0.45 * 128 + 0.55 * purple)).max() <= 2


def test_legend_is_drawn_and_the_size_is_the_photos():
    photo = Image.new("RGB", (200, 150), (255, 255, 255))
    scores = np.random.default_rng(0).normal(size=(2, 4, 6)).astype(np.float32)  # logits: softmaxed
    image = render_heatmap(photo, result(150, 200, scores, Geometry(32, 32, 16, 16, 32, 32, 1.0, 150, 200)))
    assert image.size == (200, 150)
    assert np.asarray(image)[2:8, 2:60].mean() < 120  # the dark legend box in the top-left corner


def test_a_photo_that_is_not_the_scored_image_is_refused():
    with pytest.raises(HeatmapError, match="photo is 10x10 but the scored image was 128x96"):
        render_heatmap(Image.new("RGB", (10, 10)), result(96, 128, np.zeros((2, 3, 4), np.float32),
                                                           Geometry(32, 32, 16, 16, 32, 32, 1.0, 96, 128)))


def test_colormap_runs_dark_to_bright():
    colours = colormap(np.linspace(0, 1, 9)).astype(int).sum(axis=1)
    assert colours[0] < colours[4] < colours[8]


def test_logits_are_drawn_as_cell_probabilities():
    photo = Image.new("RGB", (256, 128), (0, 0, 0))
    scores = np.zeros((2, 1, 2), np.float32)
    scores[1, 0, 0] = 50.0  # class 1 certain in cell (0, 0), a coin toss in cell (0, 1)
    geometry = Geometry(128, 128, 64, 64, 128, 128, 1.0, 128, 256)
    image = np.asarray(render_heatmap(photo, result(128, 256, scores, geometry))).astype(float)
    expected = colormap(np.array([1.0, 0.5])) * 0.55
    assert np.abs(image[100, 64] - expected[0]).max() <= 2 and np.abs(image[100, 192] - expected[1]).max() <= 2


def test_a_modest_probability_peak_is_stretched_from_zero_to_the_brightest_colour():
    photo = Image.new("RGB", (256, 128), (0, 0, 0))
    scores = np.zeros((2, 1, 2), np.float32)
    scores[1] = [[0.3, 0.15]]  # probabilities: the peak 0.3 draws yellow, half of it mid-scale
    geometry = Geometry(128, 128, 64, 64, 128, 128, 1.0, 128, 256)
    image = np.asarray(render_heatmap(photo, result(128, 256, scores, geometry))).astype(float)
    expected = colormap(np.array([1.0, 0.5])) * 0.55
    assert np.abs(image[100, 64] - expected[0]).max() <= 2 and np.abs(image[100, 192] - expected[1]).max() <= 2
