from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from clients.api.heatmap import MIN_CANVAS_SIDE, HeatmapError, canvas_scale, colormap, render_heatmap
from clients.api.results import Geometry, Prediction, ScaleResult, ScoreResult

SAMPLES = Path(__file__).resolve().parents[3] / "samples"


def result(height: int, width: int, scores: np.ndarray, geometry: Geometry) -> ScoreResult:
    return ScoreResult(model="m", image_height=height, image_width=width, top_k=[Prediction("hot", 1, 0.9)],
                       maps=[ScaleResult(64, scores.shape[1], scores.shape[2], geometry, (), scores)])


def test_cells_are_painted_where_the_geometry_puts_them():
    photo = Image.new("RGB", (384, 288), (128, 128, 128))
    scores = np.zeros((2, 3, 4), np.float32)
    scores[1, 2, 3] = 1.0  # class 1 lights up only in the bottom-right cell
    geometry = Geometry(96, 96, 48, 48, 96, 96, 1.0, 288, 384)
    pixels = np.asarray(render_heatmap(photo, result(288, 384, scores, geometry))).astype(int)
    hot, cold = pixels[240, 336], pixels[144, 144]  # centres of cells (2, 3) and (1, 1)
    yellow, purple = colormap(np.array(1.0)).astype(int), colormap(np.array(0.0)).astype(int)
    assert np.abs(hot - (0.45 * 128 + 0.55 * yellow)).max() <= 2
    assert np.abs(cold - (0.45 * 128 + 0.55 * purple)).max() <= 2


def test_the_whole_photo_is_coloured_by_its_nearest_cell():
    # Cell centres span only the middle (a receptive field of 256 px centred at 127.5 + 32 i):
    # the pixels beyond them take the colour of the nearest (border) cell.
    photo = Image.new("RGB", (320, 320), (0, 0, 0))
    scores = np.zeros((2, 3, 3), np.float32)
    scores[1, 0, 0] = scores[1, 2, 2] = 1.0
    geometry = Geometry(32, 32, 127.5, 127.5, 256, 256, 1.0, 320, 320)
    pixels = np.asarray(render_heatmap(photo, result(320, 320, scores, geometry))).astype(int)
    yellow, purple = colormap(np.array([1.0, 0.0])) * 0.55
    assert np.abs(pixels[150, 20] - purple).max() <= 2  # left edge, row of cell (0..1, 0): cell (1, 0)
    assert np.abs(pixels[319, 319] - yellow).max() <= 2  # bottom-right corner: cell (2, 2)
    assert np.abs(pixels[100, 5] - yellow).max() <= 2  # far left of the top rows: cell (0, 0)


def test_legend_is_drawn_and_the_size_is_the_photos():
    photo = Image.new("RGB", (400, 300), (255, 255, 255))
    scores = np.random.default_rng(0).normal(size=(2, 4, 6)).astype(np.float32)  # logits: softmaxed
    image = render_heatmap(photo, result(300, 400, scores, Geometry(64, 64, 32, 32, 64, 64, 1.0, 300, 400)))
    assert image.size == (400, 300)
    assert np.asarray(image)[2:8, 2:60].mean() < 120  # the dark legend box in the top-left corner


def test_a_tiny_photo_is_enlarged_so_the_legend_stays_readable():
    photo = Image.new("RGB", (10, 12), (255, 255, 255))
    scores = np.ones((2, 1, 1), np.float32) / 2
    image = render_heatmap(photo, result(12, 10, scores, Geometry(32, 32, 4.5, 5.5, 224, 224, 22.4, 224, 224)))
    factor = canvas_scale(10, 12)
    assert factor == 26 and image.size == (10 * factor, 12 * factor) and min(image.size) >= MIN_CANVAS_SIDE
    legend = np.asarray(image.convert("L"))[:80, :200]
    assert (legend > 200).sum() > 100  # white legend text, not a strip of the 10-pixel photo
    assert canvas_scale(640, 480) == 1


def test_a_photo_that_is_not_the_scored_image_is_refused():
    with pytest.raises(HeatmapError, match="photo is 10x10 but the scored image was 128x96"):
        render_heatmap(Image.new("RGB", (10, 10)), result(96, 128, np.zeros((2, 3, 4), np.float32),
                                                           Geometry(32, 32, 16, 16, 32, 32, 1.0, 96, 128)))


def test_colormap_runs_dark_to_bright():
    colours = colormap(np.linspace(0, 1, 9)).astype(int).sum(axis=1)
    assert colours[0] < colours[4] < colours[8]


def test_logits_are_drawn_as_cell_probabilities():
    photo = Image.new("RGB", (512, 256), (0, 0, 0))
    scores = np.zeros((2, 1, 2), np.float32)
    scores[1, 0, 0] = 50.0  # class 1 certain in cell (0, 0), a coin toss in cell (0, 1)
    geometry = Geometry(256, 256, 128, 128, 256, 256, 1.0, 256, 512)
    image = np.asarray(render_heatmap(photo, result(256, 512, scores, geometry))).astype(float)
    expected = colormap(np.array([1.0, 0.5])) * 0.55
    assert np.abs(image[200, 128] - expected[0]).max() <= 2 and np.abs(image[200, 384] - expected[1]).max() <= 2


def test_a_modest_probability_peak_is_stretched_from_zero_to_the_brightest_colour():
    photo = Image.new("RGB", (512, 256), (0, 0, 0))
    scores = np.zeros((2, 1, 2), np.float32)
    scores[1] = [[0.3, 0.15]]  # probabilities: the peak 0.3 draws yellow, half of it mid-scale
    geometry = Geometry(256, 256, 128, 128, 256, 256, 1.0, 256, 512)
    image = np.asarray(render_heatmap(photo, result(256, 512, scores, geometry))).astype(float)
    expected = colormap(np.array([1.0, 0.5])) * 0.55
    assert np.abs(image[200, 128] - expected[0]).max() <= 2 and np.abs(image[200, 384] - expected[1]).max() <= 2


def test_a_16_bit_photo_is_drawn_as_its_8_bit_rendering(tmp_path):
    """The photo under a 16-bit image's map is its values scaled to 8 bits, not clipped (flat purple)."""
    from clients.api.images import open_photo

    grey = np.asarray(Image.open(SAMPLES / "astronaut.jpg").convert("L").resize((192, 160)), dtype=np.float64)
    sixteen = np.round(grey * 257.0 * 0.8 + 3000.0).astype(np.uint16)
    eight = np.round(sixteen / 65535.0 * 255.0).astype(np.uint8)  # the server's own conversion (server/scoring/imaging.py)
    Image.fromarray(sixteen).save(tmp_path / "a16.png")
    scores = np.random.default_rng(0).random((2, 3, 4)).astype(np.float32)
    scored = result(160, 192, scores, Geometry(48, 48, 24, 24, 64, 64, 1.0, 160, 192))
    expected = np.asarray(render_heatmap(Image.fromarray(eight), scored)).astype(int)
    for photo in (open_photo(tmp_path / "a16.png"), open_photo((tmp_path / "a16.png").read_bytes()),
                  Image.open(tmp_path / "a16.png"), sixteen):
        drawn = np.asarray(render_heatmap(photo if isinstance(photo, Image.Image) else open_photo(photo), scored))
        assert np.abs(drawn.astype(int) - expected).max() <= 1
    assert expected[100:, 100:].std() > 10  # the photo's detail shows through the overlay


@pytest.mark.filterwarnings("error")  # numpy's "All-NaN slice" on the holes' logits included
@pytest.mark.parametrize("peak", [0.2, 8.0], ids=["probabilities", "logits"])
def test_the_diagonal_shifts_holes_are_drawn_as_holes_and_the_legend_says_so(peak):
    """NaN cells (a quincunx) are painted grey, never in the colormap's darkest colour, like the lowest scores."""
    from clients.api.heatmap import HOLE_COLOUR, OVERLAY_ALPHA, legend_notes

    photo = Image.new("RGB", (512, 512), (200, 200, 200))
    scores = np.zeros((2, 4, 4), np.float32)
    scores[1] = peak
    scores[:, (np.add.outer(np.arange(4), np.arange(4)) % 2).astype(bool)] = np.nan  # the quincunx's holes
    geometry = Geometry(128, 128, 64, 64, 128, 128, 1.0, 512, 512)
    pixels = np.asarray(render_heatmap(photo, result(512, 512, scores, geometry))).astype(float)
    hole = 200 * (1 - OVERLAY_ALPHA) + np.array(HOLE_COLOUR) * OVERLAY_ALPHA
    scored = 200 * (1 - OVERLAY_ALPHA) + colormap(np.array(1.0)) * OVERLAY_ALPHA
    assert np.abs(pixels[64 + 128 * 3, 64 + 128 * 2] - hole).max() <= 2  # cell (3, 2): a hole
    assert np.abs(pixels[64 + 128 * 3, 64 + 128 * 3] - scored).max() <= 2  # cell (3, 3): scored
    lowest = 200 * (1 - OVERLAY_ALPHA) + colormap(np.array(0.0)) * OVERLAY_ALPHA
    assert np.abs(hole - lowest).max() > 30  # a hole does not look like a low score
    assert any("not scored" in note for note in legend_notes(geometry, holes=True))
    assert not any("not scored" in note for note in legend_notes(geometry, holes=False))


def test_legend_numbers_read_as_people_write_them():
    """The legend says `1,390 px` for the default model's receptive field, never `1.39e+03 px`."""
    from clients.api.heatmap import legend_notes

    notes = legend_notes(Geometry(16, 16, 8, 8, 1390, 1390, 1.0, 384, 384), holes=False)
    assert notes[0] == "16 px cells, each sees 1,390 px"
    assert legend_notes(Geometry(10.5, 10.5, 5, 5, 99.25, 99.25, 1.0, 9, 9), holes=False)[0] == \
        "10.5 px cells, each sees 99.2 px"
