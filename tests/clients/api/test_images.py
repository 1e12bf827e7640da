import io
from pathlib import Path

import grpc
import numpy as np
import pytest
from PIL import Image

from clients.api.errors import ScoremapError
from clients.api.images import image_fields, looks_like_image, open_photo

SAMPLES = Path(__file__).resolve().parents[3] / "samples"


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
    (np.zeros((4, 4, 2), np.uint8), "shape (4, 4, 2); expected"),
    (np.zeros((2, 4, 4, 3), np.uint8), "shape (2, 4, 4, 3)"),
    (np.zeros((0, 4, 3), np.uint8), "must be positive"),
    (b"hello world", "starting b'hello wo' are not an image this server reads: it takes JPEG, PNG, WebP, BMP, TIFF, GIF, HEIC, AVIF"),
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
    with pytest.raises(ScoremapError, match=r"notes.jpg'?: 13 bytes starting b'not a pi' are not an image"):
        image_fields(path)
    assert not looks_like_image(path.read_bytes())
    assert looks_like_image(png_bytes())


def _big_tiff() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (20, 10), (10, 20, 30)).save(buffer, format="TIFF", big_tiff=True)
    return buffer.getvalue()


def test_the_client_recognises_images_as_the_server_does(tmp_path):
    """BigTIFF (`II+\\x00`), which the server opens, is an image to the client too: the client asks the server's
    own test (server/scoring/imaging.py `check_encoded`, PIL's plugins)."""
    from server.scoring import imaging

    data = _big_tiff()
    assert data[:4] == b"II+\x00" and imaging.signature(data) == "TIFF"
    path = tmp_path / "big.tif"
    path.write_bytes(data)
    assert looks_like_image(data)
    assert image_fields(path) == {"encoded": data} and image_fields(data) == {"encoded": data}


@pytest.mark.parametrize("data", [b"", b"hello world"])
def test_a_refused_file_reads_as_the_server_says_it(tmp_path, data):
    """One wording: the client's refusal of a file is the server's refusal of its bytes, named by path."""
    from server.scoring import imaging

    with pytest.raises(imaging.ImageError) as server_says:
        imaging.check_encoded(data)
    path = tmp_path / "photo.jpg"
    path.write_bytes(data)
    with pytest.raises(ScoremapError) as client_says:
        image_fields(path)
    assert client_says.value.message == f"{str(path)!r}: {server_says.value}"
    with pytest.raises(ScoremapError) as client_says:
        image_fields(data)
    assert client_says.value.message == str(server_says.value)


def test_open_photo_applies_exif_orientation_like_the_server(tmp_path):
    image = Image.new("RGB", (8, 4))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90°: the displayed photo is 4 wide, 8 high
    path = tmp_path / "rotated.jpg"
    image.save(path, exif=exif)
    assert open_photo(path).size == (4, 8)
    assert open_photo(path.read_bytes()).size == (4, 8)


# Every image type the client accepts scores as its file does (through the default model on a
# real server), and what has no faithful conversion is refused naming its mode or dtype.

def _astronaut_grey16() -> np.ndarray:
    """samples/astronaut.jpg as 16-bit grey, with detail in the low byte (not a copy of 8-bit values)."""
    grey = np.asarray(Image.open(SAMPLES / "astronaut.jpg").convert("L").resize((160, 160)), dtype=np.float64)
    return np.round(grey / 255.0 * 65535.0 * 0.9 + 1234.0).astype(np.uint16)


def _astronaut_rgb() -> np.ndarray:
    return np.asarray(Image.open(SAMPLES / "astronaut.jpg").convert("RGB").resize((160, 160)))


def _saved(folder, name: str, image: Image.Image, **options) -> str:
    path = folder / name
    image.save(path, **options)
    return str(path)


def _written(folder, name: str, data: bytes) -> str:
    path = folder / name
    path.write_bytes(data)
    return str(path)


def _cases(folder):
    """(what, the object a user holds, the file of the same image)."""
    import imagecodecs

    grey16 = _astronaut_grey16()
    rgb = _astronaut_rgb()
    alpha = np.linspace(0, 255, rgb.shape[1], dtype=np.uint8)[None, :].repeat(rgb.shape[0], axis=0)
    rgba = np.dstack([rgb, alpha])
    png16 = _saved(folder, "astro16.png", Image.fromarray(grey16))
    yield "PIL I;16 opened from its file", Image.open(png16), png16
    big_endian = Image.frombytes("I;16B", (160, 160), grey16.astype(">u2").tobytes())
    yield "PIL I;16B", big_endian, png16
    int32 = grey16.astype(np.int32)
    yield "PIL I", Image.fromarray(int32), _saved(folder, "astro32.tif", Image.fromarray(int32))
    floats = grey16.astype(np.float32) / 257.0
    yield "PIL F", Image.fromarray(floats), _saved(folder, "astroF.tif", Image.fromarray(floats))
    palette = Image.fromarray(rgb).quantize(colors=64)
    yield "PIL P", palette, _saved(folder, "astroP.png", palette)
    la = Image.fromarray(rgb).convert("LA")
    la.putalpha(Image.fromarray(alpha))
    yield "PIL LA", la, _saved(folder, "astroLA.png", la)
    yield "PIL RGBA", Image.fromarray(rgba), _saved(folder, "astroRGBA.png", Image.fromarray(rgba))
    cmyk = Image.fromarray(rgb).convert("CMYK")
    yield "PIL CMYK", cmyk, _saved(folder, "astroCMYK.tif", cmyk)
    bilevel = Image.fromarray(rgb).convert("1")
    yield "PIL 1", bilevel, _saved(folder, "astro1.png", bilevel)
    grey = Image.fromarray(rgb).convert("L")
    yield "PIL L", grey, _saved(folder, "astroL.png", grey)
    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways, displayed upright
    sideways = _saved(folder, "sideways.jpg", Image.fromarray(rgb[:, :120]).transpose(Image.Transpose.ROTATE_90),
                      exif=exif)
    yield "PIL RGB with an EXIF rotation, opened from its file", Image.open(sideways), sideways
    yield "uint16 array", grey16, png16
    rgb16 = rgb.astype(np.uint16) * 257 + 100
    yield "uint16 colour array", rgb16, _written(folder, "astro48.png", imagecodecs.png_encode(rgb16))
    yield "float32 array", floats, str(folder / "astroF.tif")
    yield "float64 colour array of whole values", rgb.astype(np.float64), _saved(folder, "astroRGB.png", Image.fromarray(rgb))
    yield "bool array", np.asarray(bilevel), str(folder / "astro1.png")
    yield "int64 array", grey16.astype(np.int64), str(folder / "astro32.tif")
    yield "int16 colour array of 0..255", rgb.astype(np.int16), str(folder / "astroRGB.png")


def test_every_image_type_scores_as_its_file(default_server, tmp_path):
    from clients import ScoremapClient

    failures = []
    with ScoremapClient(default_server) as client:
        for what, held, path in _cases(tmp_path):
            from_object = client.score(held, return_maps=False)
            from_file = client.score(path, return_maps=False)
            got = [(p.label, round(p.probability, 4)) for p in from_object.top_k]
            expected = [(p.label, round(p.probability, 4)) for p in from_file.top_k]
            if got != expected:
                failures.append(f"{what}: object {got[:2]} but file {expected[:2]}")
    assert not failures, "\n".join(failures)


def test_a_16_bit_image_scores_like_its_8_bit_copy(default_server, tmp_path):
    """A 16-bit PNG object reads as the photo it is, not as noise."""
    from clients import ScoremapClient

    grey16 = _astronaut_grey16()
    eight_bit = np.round(grey16 / 65535.0 * 255.0).astype(np.uint8)
    with ScoremapClient(default_server) as client:
        sixteen = client.score(Image.open(_saved(tmp_path, "a16.png", Image.fromarray(grey16))), return_maps=False)
        eight = client.score(eight_bit, return_maps=False)
    assert [p.label for p in sixteen.top_k] == [p.label for p in eight.top_k]
    np.testing.assert_allclose([p.probability for p in sixteen.top_k], [p.probability for p in eight.top_k], atol=1e-4)


@pytest.mark.parametrize("held, says", [
    (np.full((4, 4, 3), 0.5, np.float32), "3-channel image array of dtype float32"),
    (np.full((4, 4, 3), 300, np.int32), "3-channel image array of dtype int32"),
    (np.zeros((4, 4), np.complex64), "dtype complex64"),
    (np.zeros((4, 4, 3), bool), "3-channel image array of dtype bool"),
    (np.zeros((4, 4), "U1"), "dtype <U1"),
    (Image.new("La", (4, 4)), "mode La"),
])
def test_what_has_no_faithful_conversion_is_refused_naming_it(held, says):
    with pytest.raises(ScoremapError) as caught:
        image_fields(held)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert says in caught.value.message and "convert it to 8-bit RGB" in caught.value.message


# The server decodes a large JPEG file in draft mode (DCT scaling) down to the size the
# scales need; an image object opened from such a file must score as the file does, not as its full pixels.

def _large_jpeg(folder, size: tuple[int, int]) -> str:
    """samples/coffee.jpg upscaled to `size` (width, height), saved as a JPEG photo would be."""
    return _saved(folder, f"large{size[0]}x{size[1]}.jpg",
                  Image.open(SAMPLES / "coffee.jpg").convert("RGB").resize(size, Image.Resampling.BICUBIC), quality=90)


@pytest.mark.parametrize("size", [(4000, 3000), (6000, 4000)])  # 6000x4000: 72 MB of raw pixels, over 64 MiB
def test_a_large_jpeg_object_scores_as_its_file(default_server, tmp_path, size):
    from clients import ScoremapClient

    path = _large_jpeg(tmp_path, size)
    with ScoremapClient(default_server) as client:
        from_object = client.score(Image.open(path), return_maps=False)
        from_file = client.score(path, return_maps=False)
    assert [(p.label, round(p.probability, 4)) for p in from_object.top_k] == \
        [(p.label, round(p.probability, 4)) for p in from_file.top_k]


def _opened(path: str) -> Image.Image:
    return Image.open(path)


def _edited(path: str) -> Image.Image:
    image = Image.open(path)
    image.putpixel((0, 0), (255, 0, 0))
    return image


def _drafted(path: str) -> Image.Image:
    image = Image.open(path)
    image.draft("RGB", (100, 75))
    return image


def _loaded(path: str) -> Image.Image:
    image = Image.open(path)
    image.load()
    return image


def _second_frame(folder) -> Image.Image:
    path = folder / "frames.tif"
    Image.new("RGB", (40, 30), (200, 0, 0)).save(path, save_all=True, append_images=[Image.new("RGB", (40, 30))])
    image = Image.open(path)
    image.seek(1)
    return image


def test_only_an_image_pil_has_not_decoded_travels_as_its_file(tmp_path):
    """Encoded bytes stand for the object only while PIL still holds its file undecoded: every pixel edit
    decodes first, and draft mode, another frame or loaded pixels are what the user chose to send."""
    path = _large_jpeg(tmp_path, (400, 300))
    data = Path(path).read_bytes()
    assert image_fields(_opened(path)) == {"encoded": data}
    with open(path, "rb") as handle:
        assert image_fields(Image.open(handle)) == {"encoded": data}
    assert image_fields(Image.open(io.BytesIO(data))) == {"encoded": data}
    for image in (_edited(path), _drafted(path), _loaded(path), _second_frame(tmp_path)):
        sent = image_fields(image)
        assert "raw" in sent
        assert (sent["raw"].width, sent["raw"].height) == image.size
    edited = image_fields(_edited(path))["raw"]
    assert edited.data[:3] == bytes((255, 0, 0))


def test_reading_the_file_leaves_the_object_usable(tmp_path):
    path = _large_jpeg(tmp_path, (400, 300))
    image = Image.open(path)
    image_fields(image)
    assert np.array_equal(np.asarray(image), np.asarray(Image.open(path)))


def test_pixels_too_large_for_the_message_limit_say_how_to_send_them(start_server, tmp_path):
    """Raw pixels over the server's limit, or the client's own, are refused naming the fix (pass the path,
    or resize), not with gRPC's transport error alone."""
    from clients import ScoremapClient
    from clients.api.options import ScoreOptions
    from clients.api.settings import ClientSettings

    pixels = np.zeros((200, 200, 3), np.uint8)  # 120,000 bytes
    _, port = start_server(max_message_bytes=100_000)
    target = f"127.0.0.1:{port}"
    for settings, limit in ((None, "over this server's limit of 100000 bytes"),
                            (ClientSettings(max_message_bytes=50_000), "over this client's limit of 50000 bytes")):
        with ScoremapClient(target, settings=settings) as client:
            for call in (lambda: client.score(pixels), lambda: list(client.score_many([pixels], options=ScoreOptions()))):
                with pytest.raises(ScoremapError) as caught:
                    call()
                message = caught.value.message
                assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert limit in message and "200x200x3 raw pixels" in message and "pass the file's path" in message
