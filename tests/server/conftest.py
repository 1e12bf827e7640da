"""Fixtures for the server tests: tiny graphs on disk, and a real server with a stub on a real channel."""

from __future__ import annotations

import contextlib
import subprocess

import numpy as np
import onnx
import pytest

from tests.tiny_models import coordinate_image, coordinate_net, heavy_net, patch_net


@pytest.fixture(scope="session")
def certificate(tmp_path_factory) -> tuple[bytes, bytes]:
    """A self-signed certificate for localhost, made with the openssl CLI."""
    folder = tmp_path_factory.mktemp("tls")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
         "-keyout", str(folder / "key.pem"), "-out", str(folder / "cert.pem")],
        check=True, capture_output=True,
    )
    return (folder / "cert.pem").read_bytes(), (folder / "key.pem").read_bytes()


@pytest.fixture
def tiny_model_path(tmp_path) -> str:
    path = tmp_path / "tiny.onnx"
    onnx.save(patch_net(classes=10), path)
    return str(path)


@pytest.fixture
def coordinate_model_path(tmp_path) -> str:
    path = tmp_path / "coords.onnx"
    onnx.save(coordinate_net(), path)
    return str(path)


@pytest.fixture
def heavy_model_path(tmp_path) -> str:
    path = tmp_path / "heavy.onnx"
    onnx.save(heavy_net(), path)
    return str(path)


def raw_request(pixels: np.ndarray, **fields) -> "scoring_pb2.ScoreRequest":
    from protos import scoring_pb2

    height, width, channels = pixels.shape
    raw = scoring_pb2.RawImage(data=pixels.tobytes(), height=height, width=width, channels=channels)
    return scoring_pb2.ScoreRequest(raw=raw, **fields)


def decode_tensor(tensor) -> np.ndarray:
    return np.frombuffer(tensor.data, dtype=np.dtype(tensor.dtype).newbyteorder("<")).reshape(tuple(tensor.shape))


@contextlib.contextmanager
def serving(paths, *, token=None, tls=None, **settings):
    """A real server on 127.0.0.1 port 0 and a stub on a real channel; stopped on exit."""
    import dataclasses

    import grpc

    from protos import scoring_pb2_grpc
    from server.main import create_server
    from server.settings import Settings

    options = dict(intra_op_threads=1, warm_up=False, grpc_workers=24)
    options.update(settings)
    models = paths if isinstance(paths, dict) else list(paths)
    server, port = create_server(models, settings=dataclasses.replace(Settings(), **options), token=token, tls=tls)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 64 << 20)])
    try:
        yield server, port, scoring_pb2_grpc.DenseScoringStub(channel)
    finally:
        channel.close()
        server.stop(0).wait(10)


@pytest.fixture
def kit():
    """The helpers above, for test modules (pytest's importlib mode cannot import conftest)."""
    import types

    return types.SimpleNamespace(
        serving=serving, coordinate_net=coordinate_net, raw_request=raw_request, decode_tensor=decode_tensor,
        coordinate_image=coordinate_image, patch_net=patch_net, heavy_net=heavy_net,
    )
