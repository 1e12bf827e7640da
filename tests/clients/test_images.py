import io

import grpc
import numpy as np
import pytest
from PIL import Image

from clients.errors import ScoremapError
from clients.images import image_fields, looks_like_image, open_photo


def png_bytes(width: int = 8, height: int = 6) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_paths_and_bytes_travel_encoded(tmp_path):
    data = png_bytes()
    path = tmp_path / "a.png"
    path.write_bytes(data)
    assert image_fields(path) == {"encoded": data}
    assert image_fields(str(path)) == {"encoded": data}
    assert image_fields(data) == {"encoded": data}


def test_arrays_and_pil_images_travel_as_raw_pixels():
    array = np.arange(6 * 8 * 3, dtype=np.uint8).reshape(6, 8, 3)
    raw = image_fields(array)["raw"]
    assert (raw.height, raw.width, raw.channels) == (6, 8, 3)
    assert np.array_equal(np.frombuffer(raw.data, np.uint8).reshape(6, 8, 3), array)
    grey = image_fields(np.zeros((4, 5), np.uint8))["raw"]
    assert (grey.height, grey.width, grey.channels) == (4, 5, 1)
    two_colours = np.where(array % 2 == 0, 200, 40).astype(np.uint8)
    palette = Image.fromarray(two_colours).quantize(colors=2)
    pil = image_fields(palette)["raw"]  # palette images become RGB
    assert palette.mode == "P" and pil.channels == 3
    assert np.array_equal(np.frombuffer(pil.data, np.uint8).reshape(6, 8, 3), two_colours)


@pytest.mark.parametrize("bad, says", [
    (np.zeros((4, 4, 3), np.float32), "dtype float32; expected uint8"),
    (np.zeros((4, 4, 2), np.uint8), "shape (4, 4, 2); expected"),
    (np.zeros((2, 4, 4, 3), np.uint8), "shape (2, 4, 4, 3)"),
    (np.zeros((0, 4, 3), np.uint8), "must be positive"),
    (b"hello world", "start with b'hello wo'"),
    (12, "type int"),
])
def test_bad_images_say_what_was_received_and_expected(bad, says):
    with pytest.raises(ScoremapError) as caught:
        image_fields(bad)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert says in caught.value.message


def test_a_text_file_is_not_an_image(tmp_path):
    path = tmp_path / "notes.jpg"
    path.write_text("not a picture")
    with pytest.raises(ScoremapError, match="does not start with a JPEG"):
        image_fields(path)
    assert not looks_like_image(path.read_bytes())
    assert looks_like_image(png_bytes())


def test_open_photo_applies_exif_orientation_like_the_server(tmp_path):
    image = Image.new("RGB", (8, 4))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90°: the displayed photo is 4 wide, 8 high
    path = tmp_path / "rotated.jpg"
    image.save(path, exif=exif)
    assert open_photo(path).size == (4, 8)
    assert open_photo(path.read_bytes()).size == (4, 8)
