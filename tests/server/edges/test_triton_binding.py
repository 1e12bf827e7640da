"""A real tritonserver (the nvidia-pytriton wheel's) serving scoremap's Pipeline answers as scoremap-serve does."""

import dataclasses
import io
import os
import socket
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("pytriton", reason="the real Triton comes with the `triton` extra: make setup "
                                       "(pip install -e '.[triton]' and nvidia-pytriton==0.7.0 --no-deps)")
import pytriton.server.triton_server  # noqa: E402
import tritonclient.grpc as grpcclient  # noqa: E402
from pytriton.triton import Triton, TritonConfig  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from server.scoring.pipeline import Pipeline  # noqa: E402
from server.settings import Settings  # noqa: E402
from server.edges.triton_binding import bind  # noqa: E402

# PyTriton 0.7.0's Python-backend stub is built against numpy 1.x: under numpy 2 its output tensors
# come back empty. `make setup` puts numpy<2 (and pyzmq) in a small environment of the same
# interpreter for the stub alone; the stub must also load that interpreter's own libpython.
STUB_ENVIRONMENT = Path(sys.prefix) / "triton-stub"
OUTPUTS = ["TOP_K_INDICES", "TOP_K_PROBABILITIES", "TOP_K_LABELS", "SCORES_64", "CELL_TOP_K_INDICES_64"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def stub_environment(monkeypatch):
    if not (STUB_ENVIRONMENT / "pyvenv.cfg").exists():
        pytest.skip(f"no {STUB_ENVIRONMENT} (numpy<2 for PyTriton's stub): run make setup")
    monkeypatch.setattr(pytriton.server.triton_server, "get_triton_python_backend_python_env", lambda: STUB_ENVIRONMENT)
    monkeypatch.setenv("LD_LIBRARY_PATH", os.pathsep.join(filter(None, [sysconfig.get_config_var("LIBDIR"),
                                                                       os.environ.get("LD_LIBRARY_PATH")])))


def png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def infer(port: int, data: bytes, parameters: dict) -> dict[str, np.ndarray]:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    image = grpcclient.InferInput("IMAGE", [1], "BYTES")
    image.set_data_from_numpy(np.array([data], dtype=np.object_))
    result = client.infer("tiny", [image], parameters=parameters,
                          outputs=[grpcclient.InferRequestedOutput(name) for name in OUTPUTS])
    return {name: result.as_numpy(name) for name in OUTPUTS}


def test_triton_with_the_pipeline_answers_as_scoremap_serve(kit, tiny_model_path, stub_environment):
    data = png(np.random.default_rng(3).integers(0, 256, (50, 75, 3), dtype=np.uint8))
    parameters = {"top_k": 3, "cell_top_k": 2, "flip": True}
    with kit.serving([tiny_model_path]) as (_server, port, _stub):
        expected = infer(port, data, {**parameters, "scales": "64"})
    pipeline = Pipeline([tiny_model_path], settings=dataclasses.replace(Settings(), intra_op_threads=1, warm_up=False))
    grpc_port = free_port()
    config = TritonConfig(grpc_address="127.0.0.1", grpc_port=grpc_port, allow_http=False, allow_metrics=False)
    try:
        with Triton(config=config) as triton:
            bind(triton, pipeline, model="tiny", scales=[64])
            triton.run()
            answer = infer(grpc_port, data, parameters)
            with pytest.raises(InferenceServerException, match="unknown parameter 'speed'"):
                infer(grpc_port, data, {"speed": 2})
    finally:
        pipeline.close()
    assert answer.keys() == expected.keys()
    for name in OUTPUTS:
        np.testing.assert_array_equal(answer[name], expected[name])
