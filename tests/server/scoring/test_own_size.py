"""A phone photo scored at its own size with default flags.

No size cap by default (a cap derived from the worst request the limits allow would be below 12 Mpx): the
request's own estimate decides. 4000x3008 and 2816x4096 photos are scored at their own size
over gRPC, HTTP (/v1 as the viewer asks, KServe REST) and the Python client; their maps are one onnxruntime
pass's over the whole image, to the tiling tests' tolerance; and they run on plans warm-up made. A 48 Mpx
photo at its own size, stride 32, top-5, is answered.

The numerics use the tiling tests' tiny converted classifier (its receptive field needs a halo, as the
default model's does): the default model takes ~30 s a 12 Mpx photo on two cores, and the README's own
block scores one with it over gRPC (tests/test_readme.py).
"""

from __future__ import annotations

import io
import json

import httpx
import numpy as np
import onnx
import pytest
import tritonclient.http as httpclient
from PIL import Image

from clients import ScoremapClient
from convert import convert_classifier
from protos import scoring_pb2
from server.geometry import buckets, dense
from server.scoring.pipeline import Pipeline
from server.settings import Settings
from tests.clients.slides.nets import UNIT, tiny_classifier
from tests.server.scoring.test_tiled_scoring import assert_same_answer

PHOTOS = {"4000x3008": (3008, 4000), "2816x4096": (4096, 2816)}  # width x height: (height, width)
STRIDE = 32


def photo_jpeg(height: int, width: int, *, seed: int = 0) -> bytes:
    """A photo-like JPEG (smooth colour, detail from a small random image enlarged), cheap at 48 Mpx."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(height // 24, 1), max(width // 24, 1), 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(small).resize((width, height), Image.BILINEAR).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    """The tiling tests' padded tiny classifier (receptive field ~190 px), converted by the real converter."""
    path = tmp_path_factory.mktemp("own_size") / "tiny.onnx"
    onnx.save(convert_classifier(tiny_classifier(padded=True, nhwc=False, size=64), preprocessing=UNIT), path)
    return str(path)


@pytest.fixture(scope="module")
def photos() -> dict[str, bytes]:
    return {name: photo_jpeg(*size, seed=index) for index, (name, size) in enumerate(PHOTOS.items())}


def own_size(name: str, **fields) -> scoring_pb2.ScoreRequest:
    return scoring_pb2.ScoreRequest(scales=[min(PHOTOS[name])], **fields)


def one_pass(path: str, name: str, encoded: bytes) -> scoring_pb2.ScoreResponse:
    """The answer of one onnxruntime pass over the whole photo: a server whose one bucket holds it whole."""
    passes = dense.passes_for(native_stride=STRIDE, output_stride=STRIDE, shift=0)
    whole = buckets.on_demand_canvas(*PHOTOS[name], slack=passes.slack, multiple=STRIDE)
    pipeline = Pipeline([path], settings=Settings(warm_up=False, intra_op_threads=1, shape_buckets=(whole,)))
    try:
        return pipeline.score(own_size(name, encoded=encoded, return_maps=True, top_k=3))
    finally:
        pipeline.close()


def test_phone_photos_at_their_own_size_equal_one_pass_on_plans_warm_up_made(kit, tiny_path, photos):
    defaults = {name: getattr(Settings(), name) for name in ("intra_op_threads", "warm_up", "grpc_workers")}
    with kit.serving([tiny_path], http_port=0, **defaults) as (server, port, stub):  # every flag its default
        plans = server.pipeline.engine.served(server.pipeline._model("").name).plans
        made = plans.made
        answers = {name: stub.Score(own_size(name, encoded=data, return_maps=True, top_k=3), timeout=120)
                   for name, data in photos.items()}
        assert plans.made == made, "a photo at its own size made a plan after warm-up"

        name = stub.ListModels(scoring_pb2.ListModelsRequest()).models[0].name
        base, data = f"http://127.0.0.1:{server.http.port}", photos["4000x3008"]
        top = [label.index for label in answers["4000x3008"].top_k]
        # /v1 as the viewer asks (viewer.js: float16 maps, each cell's top 5), at the photo's own size.
        query = "maps=true&map_dtype=float16&cell_top_k=5&top_k=3&stride=32&shift=auto&flip=false&scales=3008"
        viewed = httpx.post(f"{base}/v1/models/{name}/score?{query}", files={"image": ("photo.jpg", data)}, timeout=120)
        assert viewed.status_code == 200, viewed.text
        assert [entry["index"] for entry in viewed.json()["top_k"]] == top
        assert viewed.json()["maps"][0]["scores"]["shape"] == [3, *answers["4000x3008"].maps[0].scores.shape[1:]]

        kserve = httpclient.InferenceServerClient(f"127.0.0.1:{server.http.port}", network_timeout=120)
        image_input = httpclient.InferInput("IMAGE", [1], "BYTES")
        image_input.set_data_from_numpy(np.array([data], dtype=np.object_))
        result = kserve.infer(name, [image_input], parameters={"scales": "3008", "top_k": 3})
        assert json.loads(result.get_response()["parameters"]["maps"])[0]["tiling"]["tiles"] >= 2

        with ScoremapClient(f"127.0.0.1:{port}", timeout=120) as client:
            scored = client.score(data, scales=[3008], top_k=3)
        cells = (answers["4000x3008"].maps[0].height, answers["4000x3008"].maps[0].width)
        assert [p.index for p in scored.top_k] == top and scored.maps[0].scores.shape == (3, *cells)
        assert plans.made == made

    for name, answer in answers.items():
        stated = answer.maps[0].tiling
        assert (answer.image_height, answer.image_width) == PHOTOS[name]
        assert stated.tiles >= 2 and stated.exact and (stated.canvas_height, stated.canvas_width) == (2048, 2048)
        assert_same_answer(answer, one_pass(tiny_path, name, photos[name]))


def test_a_48_megapixel_photo_at_its_own_size_stride_32_top_5_is_answered(kit, tiny_path):
    data = photo_jpeg(6048, 8064, seed=5)
    with kit.serving([tiny_path]) as (_server, _port, stub):
        answer = stub.Score(scoring_pb2.ScoreRequest(encoded=data, scales=[6048], output_stride=32, top_k=5),
                            timeout=300)
    assert (answer.image_height, answer.image_width) == (6048, 8064) and len(answer.top_k) == 3  # 3 classes
    assert answer.maps[0].tiling.tiles >= 12 and answer.maps[0].width > 8064 // 33  # cells of 32 px
