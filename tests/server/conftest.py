"""Fixtures for the server tests: tiny graphs on disk, and a real server with a stub on a real channel."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator

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


LAYOUTS = ("single", "split")


@contextlib.contextmanager
def engine_process_in_this_one(models, settings) -> "Iterator[RemoteClient]":
    """The split's front-to-engine path inside the test's process: an engine loop serving an in-process engine on
    a Unix socket of a temporary folder, and a front's client of it with its shared-memory region; what crosses
    crosses as between the processes of `--fronts`."""
    import dataclasses
    import os
    import shutil
    import tempfile

    from server.engine.process import EngineLoop
    from server.engine.remote import RemoteClient
    from server.engine.shm import region_name
    from server.metrics import Metrics
    from server.scoring.pipeline import Pipeline
    from server.split import engine_address, run_name

    run = tempfile.mkdtemp(prefix="scoremap-test-")
    metrics = Metrics()
    engine = Pipeline(models, settings=dataclasses.replace(settings, warm_up=False), metrics=metrics)
    classes = {summary.name: summary.classes for summary in engine.models()}
    loop = EngineLoop(engine.engine, address=engine_address(run), classes=classes)
    loop.start()
    client = RemoteClient(front=0, engine_address=engine_address(run),
                          region_name=region_name(run_name(run), 0, os.getpid()), region_bytes=settings.front_shm_bytes)
    try:
        assert client.wait_for_engine(30), "the engine loop never said its facts"
        client.engine_loop, client.engine_metrics = loop, metrics  # what the tests look into
        yield client
    finally:
        client.close()
        loop.stop()
        engine.close()
        shutil.rmtree(run, ignore_errors=True)


@contextlib.contextmanager
def serving(paths, *, token=None, tls=None, layout="single", **settings):
    """A real server on 127.0.0.1 port 0 and a stub on a real channel; stopped on exit. `layout` "split": its
    engine reached as a front process reaches the engine process (`engine_process_in_this_one`)."""
    import dataclasses

    import grpc

    from protos import scoring_pb2_grpc
    from server.main import create_server
    from server.settings import Settings

    options = dict(intra_op_threads=1, warm_up=False, grpc_workers=24)
    options.update(settings)
    models = paths if isinstance(paths, dict) else list(paths)
    chosen = dataclasses.replace(Settings(), **options)
    with contextlib.ExitStack() as stack:
        engine = stack.enter_context(engine_process_in_this_one(models, chosen)) if layout == "split" else None
        server, port = create_server(models, settings=chosen, token=token, tls=tls, engine=engine)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 64 << 20)])
        try:
            yield server, port, scoring_pb2_grpc.DenseScoringStub(channel)
        finally:
            channel.close()
            server.stop(0).wait(10)


@pytest.fixture(params=LAYOUTS)
def layout(request) -> str:
    """One process, or the engine reached as the front processes of `--fronts` reach it."""
    return request.param


@pytest.fixture
def kit():
    """The helpers above, for test modules (pytest's importlib mode cannot import conftest)."""
    import functools
    import types

    return types.SimpleNamespace(
        serving=serving, serving_in=lambda layout: functools.partial(serving, layout=layout),
        coordinate_net=coordinate_net, raw_request=raw_request, decode_tensor=decode_tensor,
        coordinate_image=coordinate_image, patch_net=patch_net, heavy_net=heavy_net,
    )
