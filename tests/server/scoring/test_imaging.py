import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from protos.scoring_pb2 import RawImage
from server.geometry.tiling import Span, Tile
from server.scoring import imaging
from server.scoring.request import ItemKey, ScaleJob, TileJob

LIMIT = 10_000_000


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def gradient(width: int = 40, height: int = 30) -> Image.Image:
    rows, cols = np.mgrid[0:height, 0:width]
    return Image.fromarray(np.stack([cols * 6, rows * 8, (cols + rows) * 3], -1).astype(np.uint8))


@pytest.mark.parametrize("fmt", ["PNG", "BMP", "TIFF", "WEBP", "JPEG"])
def test_every_format_decodes_to_the_same_rgb(fmt):
    source = gradient()
    options = {"lossless": True} if fmt == "WEBP" else {"quality": 95} if fmt == "JPEG" else {}
    decoded = imaging.decode(encode(source, fmt, **options), max_pixels=LIMIT)
    assert decoded.mode == "RGB" and decoded.size == source.size
    tolerance = 12 if fmt == "JPEG" else 0
    assert np.abs(np.asarray(decoded, int) - np.asarray(source, int)).max() <= tolerance


def test_exif_orientation_is_applied():
    source = gradient(40, 30)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    decoded = imaging.decode(encode(source, "JPEG", exif=exif, quality=95), max_pixels=LIMIT)
    assert decoded.size == (30, 40)


@pytest.mark.parametrize("fmt", ["HEIF", "AVIF"])
def test_heic_and_avif_decode_to_the_same_rgb_as_jpeg_within_its_loss(fmt):
    """Their own encoders (pillow-heif's libheif, Pillow's libavif) at quality 95, as JPEG's test: within the
    chroma subsampling's loss of the source."""
    source = gradient()
    decoded = imaging.decode(encode(source, fmt, quality=95), max_pixels=LIMIT)
    assert decoded.mode == "RGB" and decoded.size == source.size
    assert imaging.open_image(encode(source, fmt), max_pixels=LIMIT).image.format == fmt
    assert np.abs(np.asarray(decoded, int) - np.asarray(source, int)).max() <= 12


@pytest.mark.parametrize("fmt", ["JPEG", "HEIF", "AVIF"])
@pytest.mark.parametrize("orientation, turn", [(6, Image.Transpose.ROTATE_90), (8, Image.Transpose.ROTATE_270),
                                               (3, Image.Transpose.ROTATE_180)])
def test_a_stored_turned_photo_with_its_exif_orientation_opens_and_decodes_upright(fmt, orientation, turn):
    """A camera stores the sensor's pixels and an EXIF orientation: HEIC (whose container turns it, pillow-heif
    applying that) and AVIF (Pillow reads the container's turn as the EXIF orientation) open at the upright
    size before decoding, and decode upright, as JPEG."""
    upright = gradient(40, 30)
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encode(upright.transpose(turn), fmt, exif=exif.tobytes(), quality=95)
    opened = imaging.open_image(data, max_pixels=LIMIT)
    assert (opened.width, opened.height) == upright.size
    decoded = imaging.load(opened, largest=(opened.height, opened.width))
    assert decoded.size == upright.size
    assert np.abs(np.asarray(decoded, int) - np.asarray(upright, int)).mean() < 3


@pytest.mark.parametrize("fmt", ["JPEG", "HEIF", "AVIF"])
def test_an_icc_profile_leaves_the_pixels_as_stored_in_every_format(fmt):
    """The pixels are the ones stored, whatever profile comes with them: HEIC and AVIF as JPEG."""
    from PIL import ImageCms

    profile = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    plain, profiled = (encode(gradient(), fmt, quality=95, **options) for options in ({}, {"icc_profile": profile}))
    assert imaging.open_image(profiled, max_pixels=LIMIT).image.info.get("icc_profile")
    assert np.array_equal(np.asarray(imaging.decode(plain, max_pixels=LIMIT)),
                          np.asarray(imaging.decode(profiled, max_pixels=LIMIT)))


def test_a_gif_is_its_first_frame():
    frames = [Image.new("RGB", (20, 10), colour) for colour in ((200, 30, 30), (30, 200, 30))]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    decoded = imaging.decode(data, max_pixels=LIMIT)
    assert decoded.mode == "RGB" and decoded.size == (20, 10)
    assert (np.asarray(decoded) == (200, 30, 30)).all()


def test_a_format_not_taken_is_refused_naming_those_taken():
    with pytest.raises(imaging.ImageError) as refused:
        imaging.check_encoded(b"%PDF-1.7\n" + bytes(40))
    assert "it takes JPEG, PNG, WebP, BMP, TIFF, GIF, HEIC, AVIF" in str(refused.value)


@pytest.mark.parametrize("fmt", ["HEIF", "AVIF"])
def test_a_broken_heic_or_avif_says_cannot_decode(fmt):
    data = encode(gradient(96, 64), fmt)
    for cut in (data[:len(data) // 2], data[:40] + bytes(len(data) - 40)):
        with pytest.raises(imaging.ImageError, match="cannot decode"):
            imaging.decode(cut, max_pixels=LIMIT)


@pytest.mark.parametrize("mode", ["L", "LA", "P", "RGBA", "CMYK", "I;16"])
def test_any_mode_becomes_rgb(mode):
    if mode == "I;16":
        source = Image.fromarray(np.full((8, 8), 65535, dtype=np.uint16))
        assert source.mode.startswith("I;16")
    else:
        source = gradient().convert(mode)
    fmt = "TIFF" if mode in ("CMYK", "I;16") else "PNG"
    decoded = imaging.decode(encode(source, fmt), max_pixels=LIMIT)
    assert decoded.mode == "RGB"
    if mode == "I;16":  # scaled to 8 bits, not clipped to 255 from the low byte
        assert (np.asarray(decoded) == 255).all()


@pytest.mark.parametrize("data, words", [
    (b"", "empty"),
    (b"this is not an image at all", "not an image this server reads: it takes JPEG, PNG"),
])
def test_bad_bytes_say_what_was_received(data, words):
    with pytest.raises(imaging.ImageError, match=words):
        imaging.decode(data, max_pixels=LIMIT)


def test_truncated_image_is_refused():
    data = encode(gradient(200, 200), "PNG")
    with pytest.raises(imaging.ImageError, match="cannot decode the PNG image"):
        imaging.decode(data[: len(data) // 2], max_pixels=LIMIT)


def test_decompression_bomb_is_refused_before_decoding():
    bomb = encode(Image.new("L", (4000, 4000)), "PNG")  # a few KB that decode to 16 Mpx
    assert len(bomb) < 100_000
    with pytest.raises(imaging.ImageError, match="16000000 pixels exceeds the limit of 1000000"):
        imaging.decode(bomb, max_pixels=1_000_000)


def png_header(width: int, height: int) -> bytes:
    """A PNG's signature, size and an empty data chunk, its end: any size, in 57 bytes."""

    def chunk(kind: bytes, fields: bytes) -> bytes:
        return struct.pack(">I", len(fields)) + kind + fields + struct.pack(">I", zlib.crc32(kind + fields))

    size = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", size) + chunk(b"IDAT", b"") + chunk(b"IEND", b"")


@pytest.mark.parametrize("side", [10_000, 20_000])  # 100 and 400 Mpx: beyond PIL's own warning and error limits
def test_the_pixel_limit_is_the_flag_alone(side):
    opened = imaging.open_image(png_header(side, side), max_pixels=side * side)
    assert (opened.height, opened.width) == (side, side)
    with pytest.raises(imaging.ImageError, match=f"{side * side} pixels exceeds the limit .*--max-image-pixels"):
        imaging.open_image(png_header(side, side), max_pixels=side * side - 1)


def test_raw_pixels_are_checked_against_their_shape():
    pixels = np.arange(2 * 3 * 4, dtype=np.uint8)
    opened = imaging.from_raw(RawImage(data=pixels.tobytes(), height=2, width=3, channels=4), max_pixels=LIMIT)
    np.testing.assert_array_equal(np.asarray(opened.image), pixels.reshape(2, 3, 4)[:, :, :3])
    with pytest.raises(imaging.ImageError, match="has 24 bytes; shape \\[2, 3, 3\\] of uint8 needs 18"):
        imaging.from_raw(RawImage(data=pixels.tobytes(), height=2, width=3, channels=3), max_pixels=LIMIT)
    with pytest.raises(imaging.ImageError, match="channels must be 1, 3 or 4; received 2"):
        imaging.from_raw(RawImage(data=pixels.tobytes(), height=2, width=6, channels=2), max_pixels=LIMIT)
    with pytest.raises(imaging.ImageError, match="positive"):
        imaging.from_raw(RawImage(data=b"", height=0, width=3, channels=3), max_pixels=LIMIT)


@pytest.mark.parametrize("kind", ["JPEG", "PNG"])
def test_opening_reads_the_upright_size_without_decoding(kind):
    exif = Image.Exif()
    exif[0x0112] = 6  # stored 40 wide, shown 30 wide
    opened = imaging.open_image(encode(gradient(40, 30), kind, exif=exif), max_pixels=LIMIT)
    assert (opened.height, opened.width) == (40, 30)
    assert opened.image._im is None  # header only: no pixel decoded yet
    assert imaging.load(opened, largest=(40, 30)).size == (30, 40)
    plain = imaging.open_image(encode(gradient(40, 30), kind), max_pixels=LIMIT)  # no EXIF at all
    assert (plain.height, plain.width) == (30, 40) and plain.image._im is None


def test_a_large_jpeg_is_draft_decoded_no_smaller_than_needed():
    opened = imaging.open_image(encode(gradient(1600, 1200), "JPEG", quality=90), max_pixels=LIMIT)
    image = imaging.load(opened, largest=(300, 400))
    assert image.size == (400, 300)  # decoded at 1/4: the DCT scaling PIL offers, still >= what is needed
    full = imaging.load(imaging.open_image(encode(gradient(1600, 1200), "JPEG", quality=90), max_pixels=LIMIT),
                        largest=(1200, 1600))
    assert full.size == (1600, 1200)


def test_a_broken_image_of_a_known_format_says_cannot_decode():
    tiff = encode(gradient(64, 64), "TIFF")
    with pytest.raises(imaging.ImageError, match="cannot decode the TIFF image"):
        imaging.decode(tiff[:12] + b"\x00" * 40, max_pixels=LIMIT)


def test_resize_uses_the_named_filter():
    image = gradient(64, 64)
    nearest = imaging.resize(image, (32, 32), filter_name="nearest")
    np.testing.assert_array_equal(nearest, np.asarray(image.resize((32, 32), Image.Resampling.NEAREST)))
    with pytest.raises(imaging.ImageError, match="resize_filter 'sinc'"):
        imaging.resize(image, (32, 32), filter_name="sinc")


@pytest.mark.parametrize("orientation, turn", [(6, Image.Transpose.ROTATE_90), (8, Image.Transpose.ROTATE_270)])
def test_a_rotated_tiff_opens_at_the_size_it_decodes_to(orientation, turn):
    """Pillow's TIFF reader reports the upright size itself: the header size must not be swapped again."""
    upright = gradient(40, 30)
    exif = Image.Exif()
    exif[0x0112] = orientation
    opened = imaging.open_image(encode(upright.transpose(turn), "TIFF", exif=exif), max_pixels=LIMIT)
    assert (opened.height, opened.width) == (30, 40)
    decoded = imaging.load(opened, largest=(30, 40))
    assert decoded.size == (40, 30)
    np.testing.assert_array_equal(np.asarray(decoded), np.asarray(upright))


def photo(width: int, height: int) -> Image.Image:
    """A sample photo at width x height: real JPEG content, not a flat gradient."""
    import pathlib

    cat = pathlib.Path(__file__).resolve().parents[3] / "samples" / "cat.jpg"
    return Image.open(cat).convert("RGB").resize((width, height), Image.Resampling.BILINEAR)


def noise(height: int, width: int, *, seed: int = 0) -> Image.Image:
    """Random pixels: every rounding difference between two resizers shows on them."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def job(size: tuple[int, int], tiles: tuple[TileJob, ...] = ()) -> ScaleJob:
    canvas = (max(t.tile.y.length for t in tiles), max(t.tile.x.length for t in tiles)) if tiles else size
    return ScaleJob(scale=min(size), resized=size, canvas=(canvas[0] + 32, canvas[1] + 32), cells=(1, 1),
                    items_per_batch=1, tiles=tiles)


def canvases_both_ways(data: bytes, jobs: list[ScaleJob], *, resize_filter: str = "bilinear"
                       ) -> tuple[dict, dict, bool]:
    """The request's canvases for `jobs` (and their mirrors) as served, then through PIL alone; and whether the
    direct path (libjpeg-turbo, then OpenCV where a scale enlarges) ran. Each mirror is its canvas flipped."""
    fill = np.array([127, 63, 31], np.uint8)
    opened = imaging.open_image(data, max_pixels=LIMIT)
    direct = imaging.direct_path(opened, jobs, resize_filter=resize_filter)
    direct = direct and imaging.stored_pixels(opened) is not None
    served = imaging.canvases(opened, jobs, (False, True), fill=fill, resize_filter=resize_filter)
    through_pil = imaging.open_image(data, max_pixels=LIMIT)
    through_pil.encoded = None  # PIL decodes it, as every other image
    pil = imaging.canvases(through_pil, jobs, (False, True), fill=fill, resize_filter=resize_filter)
    assert served.keys() == pil.keys()
    for index, scale in enumerate(jobs):
        for part, tile in enumerate(scale.tiles or [None]):
            height, width = (tile.tile.y.length, tile.tile.x.length) if tile else scale.resized
            for canvases in (served, pil):
                plain, mirrored = canvases[ItemKey(index, False, part)], canvases[ItemKey(index, True, part)]
                np.testing.assert_array_equal(mirrored[:height, :width], plain[:height, :width][:, ::-1])
                for canvas in (plain, mirrored):
                    assert canvas.shape == (*scale.canvas, 3)
                    assert (canvas[height:] == fill).all() and (canvas[:height, width:] == fill).all()
    return served, pil, direct


@pytest.mark.parametrize("options", [dict(quality=90), dict(quality=95, subsampling=0), dict(quality=85, progressive=True)])
def test_a_jpeg_at_its_own_size_decodes_as_pil_does_bit_for_bit(options):
    """A JPEG sent at the size asked for (or scored at its own) is decoded by libjpeg-turbo straight into
    numpy, without PIL's GIL-holding copy; the canvases must be PIL's exactly, whatever the card's filter."""
    data = encode(photo(576, 384), "JPEG", **options)
    for resize_filter in ("bilinear", "lanczos"):
        served, through_pil, direct = canvases_both_ways(data, [job((384, 576))], resize_filter=resize_filter)
        assert direct
        for key in served:
            np.testing.assert_array_equal(served[key], through_pil[key])


# Full-resolution colour at the top quality: noise survives it, and with it every rounding difference (OpenCV's
# INTER_LINEAR_EXACT, for one, is 2 levels off PIL's bilinear on two of these sizes).
SHARPEST = dict(quality=100, subsampling=0)
ENLARGED = [  # stored (height, width) -> resized: odd sizes, 1-px images, huge factors, one axis kept
    ((300, 451), (384, 576)), ((301, 452), (302, 453)), ((45, 67), (333, 401)), ((1, 1), (64, 96)),
    ((1, 5), (7, 300)), ((2, 3), (512, 768)), ((3, 2), (1000, 7)), ((31, 17), (31, 45)), ((17, 31), (900, 31)),
]


@pytest.mark.parametrize("stored, resized", ENLARGED)
def test_an_enlarged_jpeg_is_within_one_grey_level_of_pils_bilinear(stored, resized):
    """An upright colour JPEG that every scale enlarges (or keeps) is decoded by libjpeg-turbo and resized
    by OpenCV's bilinear, not PIL's, which defines the card's filter: the two may differ by one grey level (their
    fixed-point rounding), never more."""
    data = encode(noise(*stored), "JPEG", **SHARPEST)
    served, through_pil, direct = canvases_both_ways(data, [job(resized), job(stored)])
    assert direct
    for key in served:
        assert np.abs(served[key].astype(int) - through_pil[key]).max() <= 1, key
    if min(stored) > 1:  # a 1-px image enlarges to its one colour either way
        assert any((served[key] != through_pil[key]).any() for key in served)  # OpenCV's, not PIL's


def test_a_tiled_enlarged_jpeg_cuts_its_tiles_from_opencvs_resize():
    """A scale larger than every canvas bucket is tiled: each tile (and its mirror) is a region of the one resize."""
    one_cell = (slice(0, 1), slice(0, 1))
    rows = Span(0, 384, 0, (0, None))
    halves = tuple(TileJob(Tile(0, column, rows, Span(start, start + 320, start // 32, (0, None))), cells=(1, 1),
                           kept=one_cell, kept_mirrored=one_cell) for column, start in enumerate((0, 256)))
    served, through_pil, direct = canvases_both_ways(encode(noise(300, 451), "JPEG", **SHARPEST),
                                                     [job((384, 576), halves)])
    assert direct and {key.part for key in served} == {0, 1}
    for key in served:
        assert np.abs(served[key].astype(int) - through_pil[key]).max() <= 1, key


def rotated(source: Image.Image) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6
    return encode(source, "JPEG", exif=exif)


PIL_CASES = {  # name: (encoded image, its scales' sizes, the card's filter)
    "shrunk": (lambda: encode(noise(384, 576), "JPEG"), [(192, 288)], "bilinear"),
    "draft-decoded": (lambda: encode(noise(800, 1200), "JPEG"), [(384, 576)], "bilinear"),
    "one axis shrunk": (lambda: encode(noise(300, 451), "JPEG"), [(384, 448)], "bilinear"),
    "one scale shrunk": (lambda: encode(noise(300, 451), "JPEG"), [(384, 576), (256, 384)], "bilinear"),
    **{filter_name: (lambda: encode(noise(300, 451), "JPEG"), [(384, 576)], filter_name)
       for filter_name in ("nearest", "bicubic", "lanczos", "box", "hamming")},
    "grey": (lambda: encode(noise(300, 451).convert("L"), "JPEG"), [(384, 576)], "bilinear"),
    "CMYK": (lambda: encode(noise(300, 451).convert("CMYK"), "JPEG"), [(384, 576)], "bilinear"),
    "rotated": (lambda: rotated(noise(300, 451)), [(576, 384)], "bilinear"),
    "PNG": (lambda: encode(noise(300, 451), "PNG"), [(384, 576)], "bilinear"),
}


@pytest.mark.parametrize("case", PIL_CASES)
def test_every_other_image_keeps_pils_path_bit_for_bit(case):
    """A scale that shrinks an axis (PIL's antialiased filter: OpenCV's differs by up to 40 levels), a filter other
    than bilinear, a grey, CMYK or rotated JPEG, or any other format: PIL's decode and resize, exactly."""
    make, sizes, resize_filter = PIL_CASES[case]
    served, through_pil, direct = canvases_both_ways(make(), [job(size) for size in sizes], resize_filter=resize_filter)
    assert not direct
    for key in served:
        np.testing.assert_array_equal(served[key], through_pil[key])


@pytest.mark.parametrize("size", [(300, 451), (384, 576)])
def test_a_jpeg_cut_short_is_refused_as_pil_refuses_it(size):
    """libjpeg-turbo would fill the missing rows with grey; PIL says the image is broken."""
    whole = encode(noise(300, 451), "JPEG")
    with pytest.raises(imaging.ImageError, match="cannot decode"):
        canvases_both_ways(whole[: len(whole) // 2], [job(size)])
