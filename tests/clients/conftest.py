"""Fixtures for the client tests: a tiny model with a card, small photos, a real server on port 0."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import pytest
from PIL import Image

from server.main import create_server
from server.settings import Settings
from tests.tiny_models import patch_net

CLASSES = 10


def write_photos(folder: Path, count: int, *, seed: int = 0) -> list[Path]:
    """`count` small photos (smooth random colour fields, JPEG and PNG, some in a subfolder)."""
    rng = np.random.default_rng(seed)
    paths = []
    for n in range(count):
        height, width = int(rng.integers(64, 128)), int(rng.integers(64, 160))
        coarse = rng.integers(0, 256, (4, 5, 3), dtype=np.uint8)
        photo = Image.fromarray(coarse).resize((width, height), Image.Resampling.BILINEAR)
        sub = folder / ("nested" if n % 3 == 2 else "")
        sub.mkdir(parents=True, exist_ok=True)
        path = sub / f"photo{n:03d}.{'png' if n % 2 else 'jpg'}"
        photo.save(path)
        paths.append(path)
    return paths


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("model") / "tiny.onnx"
    onnx.save(patch_net(classes=CLASSES), path)
    return str(path)


@pytest.fixture
def make_photos():
    """write_photos, for tests that need more or other photos than `photos`."""
    return write_photos


@pytest.fixture
def photos(tmp_path) -> Path:
    folder = tmp_path / "photos"
    write_photos(folder, 6)
    (folder / "notes.txt").write_text("not an image, skipped by content")
    return folder


SERVER_SETTINGS = Settings(warm_up=False)


@pytest.fixture
def server(tiny_model):
    """A real scoremap server on an ephemeral loopback port; yields 'HOST:PORT'."""
    started, port = create_server([tiny_model], settings=SERVER_SETTINGS)
    yield f"127.0.0.1:{port}"
    started.stop(0).wait(10)


@pytest.fixture
def start_server(tiny_model):
    """Factory for servers with custom settings or a fixed address; all stopped at teardown."""
    running = []

    def start(*, address: str = "127.0.0.1:0", token: str | None = None, tls: tuple[bytes, bytes] | None = None,
              **overrides):
        settings = dataclasses.replace(SERVER_SETTINGS, **overrides)
        started, port = create_server([tiny_model], address=address, settings=settings, token=token, tls=tls)
        running.append(started)
        return started, port

    yield start
    for started in running:
        started.stop(0).wait(10)


@pytest.fixture(scope="session")
def default_server(default_model_path):
    """A real server of the default model (EfficientNet-Lite0), for answers that must mean something."""
    started, port = create_server([default_model_path], settings=SERVER_SETTINGS)
    yield f"127.0.0.1:{port}"
    started.stop(0).wait(10)
