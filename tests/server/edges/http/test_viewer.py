"""The score-map viewer in a real browser: Debian's Chromium, headless, driven by Playwright.

No browser is downloaded: Playwright launches /usr/bin/chromium (`make setup` installs Debian's
`chromium` package). Where it cannot start, this test fails; it does not skip.

Where the cat is, is told two ways: the hottest cell must be the one gRPC's own map ranks first
for the class (with the same per-cell softmax, float16 map, scale and stride), and it must lie on
the cat's head, which in samples/cat.jpg (451 x 300) spans x 60..370 (left of it the shoulder,
right of it the room behind: looked at, not computed).
"""

import io
import os

import httpx
import numpy as np
import pytest
from PIL import Image
from playwright.sync_api import sync_playwright

from protos import scoring_pb2

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
CAT = os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "samples", "cat.jpg")
CAT_HEAD_X = (60, 370)  # image pixels, see the module docstring
SCREENSHOT = os.path.join("out", "viewer_cat.png")
TIMEOUT_MS = 120_000  # scoring on a shared CPU


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


def class_probabilities(response: scoring_pb2.ScoreResponse, index: int, kit) -> np.ndarray:
    """Class `index`'s per-cell probability [h, w]: softmax over the classes of each cell, as the viewer draws."""
    logits = kit.decode_tensor(response.maps[0].scores).astype(np.float64)
    shifted = np.exp(logits - logits.max(axis=0, keepdims=True))
    return (shifted / shifted.sum(axis=0, keepdims=True))[index]


def overlay(page) -> np.ndarray:
    """The overlay canvas as drawn: [h, w, 4] RGBA, one pixel per cell."""
    width, height, data = page.evaluate("""() => {
        const canvas = document.getElementById("overlay");
        const pixels = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height);
        return [canvas.width, canvas.height, Array.from(pixels.data)];
    }""")
    return np.array(data, np.uint8).reshape(height, width, 4)


def hottest(drawn: np.ndarray) -> tuple[int, int]:
    """The cell drawn nearest viridis' top colour (the map's peak)."""
    distance = np.abs(drawn[..., :3].astype(int) - (253, 231, 37)).sum(axis=-1) + 1000 * (drawn[..., 3] == 0)
    return np.unravel_index(np.argmin(distance), distance.shape)


def test_the_viewer_draws_the_cat_s_map_over_the_cat(kit, default_model_path, browser, tmp_path):
    with kit.serving({"default": default_model_path}, http_port=0) as (server, _port, stub):
        base = f"http://127.0.0.1:{server.http.port}"
        labels = list(server.pipeline.card("default").labels)
        tabby = next(index for index, label in enumerate(labels) if "tabby" in label)
        expected = stub.Score(scoring_pb2.ScoreRequest(encoded=open(CAT, "rb").read(), scales=[384], output_stride=16,
                                                       return_maps=True, map_dtype=scoring_pb2.FLOAT16))
        reference = class_probabilities(expected, tabby, kit)

        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(f"{base}/")
        page.wait_for_selector("#model option[value=default]", state="attached")
        page.fill("#scales", "384")
        page.select_option("#stride", "16")
        page.set_input_files("#file", CAT)
        page.wait_for_selector("#stage[data-state=rendered]")
        page.fill("#search", labels[tabby])  # the class searched by name
        page.dispatch_event("#search", "change")
        page.wait_for_selector(f"#stage[data-cls='{tabby}']")

        drawn = overlay(page)
        assert drawn.shape[:2] == reference.shape
        row, col = hottest(drawn)
        assert reference[row, col] >= 0.99 * reference.max(), (row, col, np.unravel_index(reference.argmax(),
                                                                                           reference.shape))
        geometry = expected.maps[0].geometry
        centre_x = geometry.center_x + col * geometry.stride_x
        centre_y = geometry.center_y + row * geometry.stride_y
        assert CAT_HEAD_X[0] <= centre_x <= CAT_HEAD_X[1]
        # Where the page puts that cell: its box on the overlay, in the photo's pixels.
        box, photo = page.eval_on_selector("#overlay", "e => e.getBoundingClientRect().toJSON()"), \
            page.eval_on_selector("#photo", "e => e.getBoundingClientRect().toJSON()")
        shown_x = box["x"] + (col + 0.5) * box["width"] / drawn.shape[1]
        shown_y = box["y"] + (row + 0.5) * box["height"] / drawn.shape[0]
        to_image = expected.image_width / photo["width"]
        assert (shown_x - photo["x"]) * to_image - 0.5 == pytest.approx(centre_x, abs=1.0)
        assert (shown_y - photo["y"]) * to_image - 0.5 == pytest.approx(centre_y, abs=1.0)

        page.mouse.move(shown_x, shown_y)  # hovering shows the cell's box and top-k
        assert page.is_visible("#box") and f"cell ({row}, {col})" in page.text_content("#cell")
        os.makedirs(os.path.dirname(SCREENSHOT), exist_ok=True)
        page.screenshot(path=SCREENSHOT, full_page=True)

        with page.expect_download() as download:
            page.click("#npy")
        saved = np.load(io.BytesIO(open(download.value.path(), "rb").read()))
        np.testing.assert_allclose(saved, reference, atol=1e-5)  # float32 softmax of the same float16 map

        other = page.eval_on_selector_all("#class option", "options => options.map(o => o.value)")
        other = next(value for value in other if int(value) != tabby)
        page.select_option("#class", other)
        page.wait_for_selector(f"#stage[data-cls='{other}']")
        assert not np.array_equal(overlay(page), drawn)

        page.select_option("#shift", "diagonal")  # two passes: a quincunx, its other cells NaN
        page.click("#score")
        page.wait_for_selector("#stage[data-state=scoring]", state="detached")
        page.wait_for_selector("#stage[data-state=rendered]")
        diagonal = stub.Score(scoring_pb2.ScoreRequest(encoded=open(CAT, "rb").read(), scales=[384], output_stride=16,
                                                       shift=scoring_pb2.SHIFT_DIAGONAL, return_maps=True,
                                                       map_dtype=scoring_pb2.FLOAT16))
        holes = np.isnan(kit.decode_tensor(diagonal.maps[0].scores)[0])
        assert holes.any()
        np.testing.assert_array_equal(overlay(page)[..., 3] == 0, holes)  # drawn as holes, nothing else is

        # A TIFF: scored, but Chromium cannot display it: the map goes over a gray canvas of its size.
        tiff = io.BytesIO()
        Image.open(CAT).save(tiff, format="TIFF")
        page.select_option("#shift", "auto")
        page.set_input_files("#file", {"name": "cat.tiff", "mimeType": "image/tiff", "buffer": tiff.getvalue()})
        page.wait_for_selector("#stage[data-state=scoring]", state="detached")
        page.wait_for_selector("#stage[data-state=rendered]")
        page.wait_for_selector("#note:has-text('cannot display TIFF images')")
        page.wait_for_function("() => document.getElementById('photo').src.startsWith('data:') && "
                               "document.getElementById('photo').naturalWidth > 0")
        assert page.eval_on_selector("#photo", "e => [e.naturalWidth, e.naturalHeight]") == [
            expected.image_width, expected.image_height]
        placed = page.eval_on_selector("#overlay", "e => e.getBoundingClientRect().toJSON()"), \
            page.eval_on_selector("#photo", "e => e.getBoundingClientRect().toJSON()")
        for side in ("width", "height"):  # the overlay and the picture as the JPEG's were, not collapsed
            assert placed[1][side] == pytest.approx(photo[side], abs=1), (placed, photo)
            assert placed[0][side] == pytest.approx(box[side], abs=1), (placed, box)
        assert overlay(page).shape[:2] == reference.shape
        assert page.eval_on_selector_all("#topk li", "items => items.length") > 0

        not_an_image = b"these are words, not pixels"
        message = httpx.post(f"{base}/v1/models/default/score?scales=384",
                             files={"image": ("notes.txt", not_an_image)}).json()["error"]
        page.set_input_files("#file", {"name": "notes.txt", "mimeType": "text/plain", "buffer": not_an_image})
        page.wait_for_selector("#stage[data-state=error]", state="attached")
        assert page.is_visible("#error") and message in page.text_content("#error")
        # Nothing of the TIFF stays under the error: its top-k, class menu, maps, note and picture.
        assert page.eval_on_selector_all("#topk li, #class option, #scale option", "items => items.length") == 0
        for shown in ("#results", "#stage", "#note"):
            assert not page.is_visible(shown), shown
        page.close()


def test_the_viewer_asks_for_the_token_of_a_server_that_wants_one(kit, tiny_model_path, browser, tmp_path):
    photo = tmp_path / "noise.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (64, 96, 3), dtype=np.uint8)).save(photo)
    with kit.serving([tiny_model_path], http_port=0, token="s3cret") as (server, _port, stub):
        page = browser.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(f"http://127.0.0.1:{server.http.port}/")  # the page itself needs no token
        page.wait_for_selector("#error:has-text('401')")
        page.fill("#token", "s3cret")
        page.dispatch_event("#token", "change")
        page.wait_for_selector("#model option[value=tiny]", state="attached")
        assert not page.is_visible("#error")
        page.fill("#scales", "64")
        page.set_input_files("#file", str(photo))
        page.wait_for_selector("#stage[data-state=rendered]")
        expected = stub.Score(scoring_pb2.ScoreRequest(encoded=photo.read_bytes(), scales=[64], return_maps=True),
                              metadata=(("authorization", "Bearer s3cret"),))
        assert overlay(page).shape[:2] == (expected.maps[0].height, expected.maps[0].width)
        page.close()
