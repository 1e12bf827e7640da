"""Fixtures for the client tests: a tiny model with a card, small photos, a real server on port 0."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

from convert.card import ModelCard, Preprocessing, ReceptiveField, write_card
from server.main import create_server
from server.settings import Settings

STRIDE = 32
CLASSES = 10


def tiny_scorer(*, classes: int = CLASSES, stride: int = STRIDE) -> onnx.ModelProto:
    """A one-Conv fully-convolutional 'classifier': one cell per stride x stride patch, logits out."""
    weights = np.random.default_rng(0).normal(0, 0.05, (classes, 3, stride, stride)).astype(np.float32)
    conv = helper.make_node("Conv", ["image", "w", "b"], ["scores"], kernel_shape=[stride, stride],
                            strides=[stride, stride])
    graph = helper.make_graph(
        [conv], "tiny",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, "H", "W"])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", classes, "h", "w"])],
        initializer=[numpy_helper.from_array(weights, "w"),
                     numpy_helper.from_array(np.linspace(-0.1, 0.1, classes).astype(np.float32), "b")],
    )
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])
    card = ModelCard(
        name="tiny", labels=[f"class{i}" for i in range(classes)],
        preprocessing=Preprocessing(input_name="image", layout="NCHW", dtype="float32", channel_order="RGB",
                                    pixel_scale=1 / 255, mean=[0.5] * 3, std=[0.25] * 3, resize_filter="bilinear"),
        training_height=stride, training_width=stride, output_stride=stride,
        receptive_field=ReceptiveField(size=stride, center_y=(stride - 1) / 2, center_x=(stride - 1) / 2),
        scores_name="scores", output_kind="logits", precision="fp32", default_scale=64, size_multiple=stride,
    )
    return write_card(model, card)


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
    onnx.save(tiny_scorer(), path)
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

    def start(*, address: str = "127.0.0.1:0", token: str | None = None, **overrides):
        settings = dataclasses.replace(SERVER_SETTINGS, **overrides)
        started, port = create_server([tiny_model], address=address, settings=settings, token=token)
        running.append(started)
        return started, port

    yield start
    for started in running:
        started.stop(0).wait(10)
