"""The formats phones and browsers write, scored by a real server with the default model: a HEIC and an AVIF of
a photo score like its JPEG (the same top-1, maps within the JPEG's own re-encoding tolerance, measured here),
and a GIF's first frame is scored.

The files are made by their own encoders (pillow-heif's libheif, Pillow's libavif) from the photo's pixels, at
quality 75, the quality the JPEG is re-encoded at to measure its tolerance: how far the maps move when the same
photo is saved again as JPEG, which no user would call a different photo.
"""

import io
import pathlib

import httpx
import numpy as np
import pytest
from PIL import Image

from clients.api.results import decode_tensor
from protos import scoring_pb2

PHOTO = pathlib.Path(__file__).resolve().parents[3] / "samples" / "cat.jpg"
QUALITY = 75  # every lossy encoding here: the JPEG's re-encoding and the HEIC and AVIF alike


def encoded(pixels: Image.Image, fmt: str, **options) -> bytes:
    import pillow_heif

    pillow_heif.register_heif_opener()
    buffer = io.BytesIO()
    pixels.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def scored(stub, data: bytes) -> tuple[int, np.ndarray]:
    """Top-1 and the default scale's score maps."""
    response = stub.Score(scoring_pb2.ScoreRequest(encoded=data, return_maps=True, map_dtype=scoring_pb2.FLOAT32),
                          timeout=120)
    return response.top_k[0].index, decode_tensor(response.maps[0].scores)


def test_heic_and_avif_score_like_the_jpeg_within_its_own_reencoding_tolerance(kit, default_model_path):
    photo = PHOTO.read_bytes()
    pixels = Image.open(io.BytesIO(photo)).convert("RGB")
    with kit.serving([default_model_path], http_port=0) as (server, _port, stub):
        top, maps = scored(stub, photo)
        _, again = scored(stub, encoded(pixels, "JPEG", quality=QUALITY))
        tolerance = np.abs(again - maps).max()
        assert tolerance > 0  # re-encoding moves the maps: the bound below is a measured one
        for fmt in ("HEIF", "AVIF"):
            data = encoded(pixels, fmt, quality=QUALITY)
            assert data[4:8] == b"ftyp"  # the container its encoder writes, not a JPEG in disguise
            other_top, other_maps = scored(stub, data)
            assert other_top == top, fmt
            assert other_maps.shape == maps.shape
            assert np.abs(other_maps - maps).max() <= tolerance, (fmt, np.abs(other_maps - maps).max(), tolerance)
        heic = encoded(pixels, "HEIF", quality=QUALITY)
        name = server.pipeline.models()[0].name
        answer = httpx.post(f"http://127.0.0.1:{server.http.port}/v1/models/{name}/score",
                            files={"image": ("photo.heic", heic)}, timeout=120)
        assert answer.status_code == 200 and answer.json()["top_k"][0]["index"] == top, answer.text


def test_a_gif_is_scored_by_its_first_frame(kit, default_model_path):
    pixels = Image.open(PHOTO).convert("RGB")
    first = pixels.quantize(256)  # a GIF's palette: what the frame is once saved
    animation = encoded(first, "GIF", save_all=True, append_images=[Image.new("RGB", pixels.size, (0, 90, 0))])
    with kit.serving([default_model_path]) as (_server, _port, stub):
        frame_top, frame_maps = scored(stub, encoded(first.convert("RGB"), "PNG"))
        top, maps = scored(stub, animation)
    assert top == frame_top
    np.testing.assert_allclose(maps, frame_maps, atol=1e-4)


@pytest.mark.parametrize("fmt", ["HEIF", "AVIF"])
def test_a_turned_phone_photo_scores_as_the_upright_one(kit, default_model_path, fmt):
    """Stored as the sensor saw it, with EXIF orientation 6: scored upright, its maps the upright photo's shape."""
    upright = Image.open(PHOTO).convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = 6
    turned = encoded(upright.transpose(Image.Transpose.ROTATE_90), fmt, quality=90, exif=exif.tobytes())
    with kit.serving([default_model_path]) as (_server, _port, stub):
        top, maps = scored(stub, encoded(upright, fmt, quality=90))
        turned_top, turned_maps = scored(stub, turned)
    assert turned_top == top and turned_maps.shape == maps.shape
