import shutil
import subprocess
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from PIL import Image

from clients import ClientSettings, ScoremapClient, ScoremapError, ScoreOptions
from clients.api.client import is_loopback
from tests.tiny_models import assert_same_top_k


def test_scores_paths_bytes_pil_and_arrays_alike(server, photos):
    path = sorted(photos.glob("*.png"))[0]
    with ScoremapClient(server) as client:
        from_path = client.score(path, stride=32)
        from_bytes = client.score(path.read_bytes(), stride=32)
        from_pil = client.score(Image.open(path), stride=32)
        from_array = client.score(np.asarray(Image.open(path).convert("RGB")), stride=32)
    assert from_path.top_k[0].label.startswith("class")
    assert [p.probability for p in from_path.top_k] == sorted((p.probability for p in from_path.top_k), reverse=True)
    for other in (from_bytes, from_pil, from_array):
        assert [p.index for p in other.top_k] == [p.index for p in from_path.top_k]
        np.testing.assert_allclose(other.maps[0].scores, from_path.maps[0].scores, atol=1e-6)
    scale = from_path.maps[0]
    assert scale.scores.shape == (10, scale.height, scale.width)
    assert scale.geometry.stride_x > 0 and from_path.image_width == Image.open(path).width


def phone_formats(folder: Path, path: Path) -> dict[str, Path]:
    """The photo at `path` as HEIC, AVIF and GIF files, made by their encoders, and the PNG of each file's own
    decoded pixels (what the server should see), by suffix."""
    import pillow_heif

    pillow_heif.register_heif_opener()
    pixels = Image.open(path).convert("RGB")
    made = {}
    for suffix, fmt in ((".heic", "HEIF"), (".avif", "AVIF"), (".gif", "GIF")):
        made[suffix] = folder / f"photo{suffix}"
        pixels.save(made[suffix], format=fmt)
        decoded = Image.open(made[suffix]).convert("RGB")
        decoded.save(folder / f"photo{suffix}.png")
    return made


def test_heic_avif_and_gif_files_score_as_their_decoded_pixels(server, photos, tmp_path):
    made = phone_formats(tmp_path, sorted(photos.glob("*.jpg"))[0])
    with ScoremapClient(server) as client:
        for suffix, path in made.items():
            scored = client.score(path, stride=32)
            expected = client.score(path.with_name(path.name + ".png"), stride=32)
            assert [p.index for p in scored.top_k] == [p.index for p in expected.top_k], suffix
            np.testing.assert_allclose(scored.maps[0].scores, expected.maps[0].scores, atol=1e-6)
            assert client.score(path.read_bytes(), stride=32).top_k[0].index == scored.top_k[0].index


def test_models_card_health_and_stream(server, photos):
    images = sorted(photos.rglob("photo*"))
    with ScoremapClient(server) as client:
        assert client.health() == "SERVING"
        assert [m.name for m in client.models()] == ["tiny"]
        assert client.model("tiny").labels[3] == "class3"
        streamed = list(client.score_many(images, options=ScoreOptions(return_maps=True)))
        singles = [client.score(image) for image in images]
    assert [r.request_id for r in streamed] == [str(n) for n in range(len(images))]
    for one, other in zip(streamed, singles):
        assert (one.image_height, one.image_width) == (other.image_height, other.image_width)
        # Streamed images may run batched, singles run alone: the same ranking, up to near ties under TF32.
        assert one.execution_provider == other.execution_provider
        assert_same_top_k(one.top_k, other.top_k, one.execution_provider)


def test_server_errors_carry_status_and_message(server):
    with ScoremapClient(server) as client:
        with pytest.raises(ScoremapError) as unknown:
            client.score(np.zeros((64, 64, 3), np.uint8), model="nope")
        with pytest.raises(ScoremapError) as corrupt:
            client.score(b"\xff\xd8\xff" + b"\0" * 50)
    assert unknown.value.code == grpc.StatusCode.NOT_FOUND and "nope" in unknown.value.message
    assert corrupt.value.code == grpc.StatusCode.INVALID_ARGUMENT and "53 bytes" in corrupt.value.message


def test_unavailable_is_retried_until_the_server_comes_up(start_server, tiny_model):
    server, port = start_server()
    server.stop(0).wait(10)  # the port is now free and known

    def start_later() -> None:
        time.sleep(1.0)
        start_server(address=f"127.0.0.1:{port}")

    thread = threading.Thread(target=start_later)
    thread.start()
    settings = ClientSettings(retry_budget_s=20, backoff_max_s=0.5)
    with ScoremapClient(f"127.0.0.1:{port}", settings=settings) as client:
        result = client.score(np.zeros((64, 64, 3), np.uint8))
    thread.join()
    assert len(result.top_k) == 5


def test_a_stream_opened_before_the_server_is_up_loses_nothing(start_server, photos):
    server, port = start_server()
    server.stop(0).wait(10)
    thread = threading.Thread(target=lambda: (time.sleep(1.0), start_server(address=f"127.0.0.1:{port}")))
    thread.start()
    images = sorted(photos.rglob("photo*"))
    settings = ClientSettings(retry_budget_s=20, backoff_max_s=0.5)
    with ScoremapClient(f"127.0.0.1:{port}", settings=settings) as client:
        results = list(client.score_many(images))
    thread.join()
    assert [r.request_id for r in results] == [str(n) for n in range(len(images))]


def test_the_retry_budget_ends_retries():
    settings = ClientSettings(retry_budget_s=0.5, backoff_initial_s=0.05, backoff_max_s=0.1)
    with ScoremapClient("127.0.0.1:1", settings=settings) as client:  # nothing listens on port 1
        began = time.monotonic()
        with pytest.raises(ScoremapError) as caught:
            client.health()
        waited = time.monotonic() - began
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    assert 0.2 < waited < 5  # retried for about the budget


def test_bearer_token(start_server):
    _, port = start_server(token="s3cret")
    target = f"127.0.0.1:{port}"
    image = np.zeros((64, 64, 3), np.uint8)
    with ScoremapClient(target, token="s3cret") as client:
        assert client.score(image).top_k
    with ScoremapClient(target, token="wrong") as client, pytest.raises(ScoremapError) as caught:
        client.score(image)
    assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a self-signed certificate")
def test_tls_with_a_token(tiny_model, tmp_path):
    from server.main import create_server
    from server.settings import Settings

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    server, port = create_server([tiny_model], settings=Settings(warm_up=False), token="t0ken",
                                 tls=(cert.read_bytes(), key.read_bytes()))
    try:
        with ScoremapClient(f"localhost:{port}", tls=True, root_certificates=cert.read_bytes(), token="t0ken") as client:
            assert client.score(np.zeros((64, 64, 3), np.uint8)).top_k
        with ScoremapClient(f"localhost:{port}", settings=ClientSettings(retry_budget_s=0.2)) as plain:
            with pytest.raises(ScoremapError):
                plain.health()  # clear text to a TLS port fails
    finally:
        server.stop(0).wait(10)


def test_a_token_is_never_sent_in_clear_text_off_this_machine():
    with pytest.raises(ScoremapError, match="clear text"):
        ScoremapClient("scoring.example.com:443", token="t")
    assert is_loopback("127.0.0.1:5") and is_loopback("[::1]:5") and is_loopback("localhost:5")
    assert not is_loopback("10.0.0.1:5") and not is_loopback("example.com:5")


def test_every_call_has_a_deadline(start_server):
    _, port = start_server()
    big = np.zeros((2048, 2048, 3), np.uint8)
    with ScoremapClient(f"127.0.0.1:{port}", timeout=0.001) as client, pytest.raises(ScoremapError) as caught:
        client.score(big, scales=[1024])
    assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_bad_image_in_a_stream_raises_invalid_argument_after_the_earlier_answers(server, photos):
    good = sorted(photos.rglob("photo*"))[:2]
    answered = []
    with ScoremapClient(server) as client:
        with pytest.raises(ScoremapError) as bad:
            for result in client.score_many([*good, photos / "missing.jpg", good[0]]):
                answered.append(result.request_id)
    assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT and "missing.jpg" in bad.value.message
    assert answered == ["0", "1"]


def test_a_server_never_reached_gets_the_connect_budget_not_the_whole_budget():
    settings = ClientSettings(retry_budget_s=60, connect_budget_s=0.3, backoff_initial_s=0.02, backoff_max_s=0.05)
    started = time.monotonic()
    with ScoremapClient("127.0.0.1:1", settings=settings) as client, pytest.raises(ScoremapError) as caught:
        client.models()
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - started < 30  # far below the 60 s budget


def test_interrupt_ends_a_retry_wait_at_once():
    settings = ClientSettings(retry_budget_s=60, connect_budget_s=60)
    outcome = {}
    with ScoremapClient("127.0.0.1:1", settings=settings) as client:
        def call() -> None:
            try:
                client.models()
            except ScoremapError as error:
                outcome["error"] = error
        thread = threading.Thread(target=call)
        thread.start()
        time.sleep(0.3)
        client.interrupt()
        thread.join(10)
    assert not thread.is_alive()
    assert type(outcome["error"]).__name__ == "Interrupted" and outcome["error"].code == grpc.StatusCode.CANCELLED


@pytest.mark.parametrize("side, warned", [(100, True), (128, False), (384, False)])
def test_a_small_image_far_below_the_training_size_is_scored_with_a_warning(default_server, side, warned):
    """100x100 at the default scale 384 (3.84x, shorter side below the training size 224) is warned about;
    128x128 (3x) and an image at the scale itself are not."""
    photo = Image.open(Path(__file__).resolve().parents[3] / "samples" / "cat.jpg").convert("RGB").resize((side, side))
    with ScoremapClient(default_server) as client:
        result = client.score(photo, scales=[384], return_maps=False)
    assert any("far below" in warning for warning in result.warnings) == warned, result.warnings
