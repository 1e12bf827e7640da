"""KServe v2 on scoremap's port, called with the unmodified tritonclient, compared with Score's answer."""

import io
import json
import logging
import queue
import urllib.request

import numpy as np
import pytest
from PIL import Image

from protos import scoring_pb2

grpcclient = pytest.importorskip("tritonclient.grpc", reason="the KServe v2 service needs the `triton` extra: "
                                                             "pip install -e '.[triton]'")
from tritonclient.utils import InferenceServerException  # noqa: E402

RNG = np.random.default_rng(11)


def png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def image_input(data: bytes) -> "grpcclient.InferInput":
    tensor = grpcclient.InferInput("IMAGE", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([data], dtype=np.object_))
    return tensor


def pixels_input(pixels: np.ndarray) -> "grpcclient.InferInput":
    tensor = grpcclient.InferInput("PIXELS", list(pixels.shape), "UINT8")
    tensor.set_data_from_numpy(pixels)
    return tensor


def assert_same_answer(result, response: scoring_pb2.ScoreResponse, kit) -> None:
    assert result.as_numpy("TOP_K_INDICES").tolist() == [label.index for label in response.top_k]
    np.testing.assert_array_equal(result.as_numpy("TOP_K_PROBABILITIES"),
                                  np.array([label.probability for label in response.top_k], np.float32))
    assert [label.decode() for label in result.as_numpy("TOP_K_LABELS")] == [label.label for label in response.top_k]
    for scale_map in response.maps:
        np.testing.assert_array_equal(result.as_numpy(f"SCORES_{scale_map.scale}"), kit.decode_tensor(scale_map.scores))
    maps = json.loads(result.get_response().parameters["maps"].string_param)
    assert [(m["scale"], m["height"], m["width"]) for m in maps] == [
        (m.scale, m.height, m.width) for m in response.maps]
    assert maps[0]["geometry"]["stride_x"] == pytest.approx(response.maps[0].geometry.stride_x)


def test_infer_answers_as_score_does_for_encoded_images_and_pixels(kit, tiny_model_path):
    pixels = RNG.integers(0, 256, (50, 75, 3), dtype=np.uint8)
    with kit.serving([tiny_model_path]) as (_server, port, stub):
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("tiny")
        assert not client.is_model_ready("absent")
        parameters = {"scales": "64,96", "flip": True, "top_k": 3, "cell_top_k": 2}
        result = client.infer("tiny", [image_input(png(pixels))], parameters=parameters)
        response = stub.Score(scoring_pb2.ScoreRequest(encoded=png(pixels), scales=[64, 96], flip=True, top_k=3,
                                                       cell_top_k=2, return_maps=True))
        assert_same_answer(result, response, kit)
        np.testing.assert_array_equal(result.as_numpy("CELL_TOP_K_INDICES_96"),
                                      kit.decode_tensor(response.maps[1].cell_top_k_indices))

        result = client.infer("tiny", [pixels_input(pixels)], parameters={"scales": 64},
                              outputs=[grpcclient.InferRequestedOutput("TOP_K_LABELS")])
        response = stub.Score(kit.raw_request(pixels, scales=[64]))
        assert [o.name for o in result.get_response().outputs] == ["TOP_K_LABELS"]
        labels = [label.decode() for label in result.as_numpy("TOP_K_LABELS")]
        assert labels == [label.label for label in response.top_k]


def test_async_and_streaming_calls_answer_each_request(kit, tiny_model_path):
    images = [RNG.integers(0, 256, (64, 64 + 32 * i, 3), dtype=np.uint8) for i in range(3)]
    with kit.serving([tiny_model_path]) as (_server, port, stub):
        expected = [stub.Score(kit.raw_request(pixels, scales=[64], return_maps=True)) for pixels in images]
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        answers: queue.Queue = queue.Queue()
        for pixels in images:
            client.async_infer("tiny", [pixels_input(pixels)], lambda result, error: answers.put((result, error)),
                               parameters={"scales": 64})
        results = [answers.get(timeout=30) for _ in images]
        assert all(error is None for _, error in results)
        by_width = {result.as_numpy("SCORES_64").shape[2]: result for result, _ in results}
        for response in expected:
            assert_same_answer(by_width[response.maps[0].width], response, kit)

        client.start_stream(lambda result, error: answers.put((result, error)))
        for index, pixels in enumerate(images):
            client.async_stream_infer("tiny", [pixels_input(pixels)], request_id=str(index), parameters={"scales": 64})
        client.async_stream_infer("tiny", [pixels_input(images[0])], request_id="bad", parameters={"scales": 0})
        client.stop_stream()
        streamed = [answers.get(timeout=30) for _ in range(len(images) + 1)]
    for (result, error), response, index in zip(streamed, expected, "012"):
        assert error is None and result.get_response().id == index
        assert_same_answer(result, response, kit)
    _, error = streamed[-1]
    assert isinstance(error, InferenceServerException) and "INVALID_ARGUMENT" in str(error)


def test_metadata_and_config_describe_the_model(kit, tiny_model_path):
    with kit.serving([tiny_model_path]) as (_server, port, _stub):
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        assert client.get_server_metadata().name == "scoremap"
        metadata = client.get_model_metadata("tiny")
        assert [t.name for t in metadata.inputs] == ["IMAGE", "PIXELS"]
        scores = metadata.outputs[3]
        assert scores.name.startswith("SCORES_") and list(scores.shape) == [10, -1, -1]
        config = client.get_model_config("tiny").config
        assert config.max_batch_size == 0 and config.output[3].dims[0] == 10
        with pytest.raises(InferenceServerException, match="NOT_FOUND|no model"):
            client.get_model_metadata("absent")


@pytest.mark.parametrize("inputs, parameters, words", [
    (lambda: [image_input(b"not an image")], {}, "INVALID_ARGUMENT"),
    (lambda: [pixels_input(np.zeros((8, 8, 3), np.uint8))], {"scales": "a,b"}, "integers separated by commas"),
    (lambda: [pixels_input(np.zeros((8, 8, 3), np.uint8))], {"speed": 3}, "unknown parameter 'speed'"),
    (lambda: [pixels_input(np.zeros((8, 8, 3), np.uint8))], {"shift": "sideways"}, "expected one of"),
    (lambda: [], {}, "expected exactly one"),
])
def test_bad_requests_are_invalid_argument_and_counted(kit, tiny_model_path, inputs, parameters, words):
    with kit.serving([tiny_model_path], metrics_port=0) as (server, port, _stub):
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        with pytest.raises(InferenceServerException, match=words) as raised:
            client.infer("tiny", inputs(), parameters=parameters)
        assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    assert 'scoremap_requests_total{code="INVALID_ARGUMENT",method="ModelInfer",model="tiny"} 1.0' in text


def test_token_and_readiness_are_the_servers(kit, tiny_model_path):
    with kit.serving([tiny_model_path], token="s3cret") as (server, port, _stub):
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        with pytest.raises(InferenceServerException, match="UNAUTHENTICATED"):
            client.is_server_ready()
        headers = {"authorization": "Bearer s3cret"}
        assert client.is_server_ready(headers=headers)
        server.health.enter_graceful_shutdown()
        assert not client.is_server_ready(headers=headers)
        assert not client.is_model_ready("tiny", headers=headers)


def test_without_the_extra_the_server_runs_without_kserve_and_says_so(kit, tiny_model_path, monkeypatch, caplog):
    from server.edges.grpc import kserve

    monkeypatch.setattr(kserve, "MISSING_EXTRA", ModuleNotFoundError("No module named 'tritonclient'"))
    caplog.set_level(logging.INFO, logger=kserve.LOG.name)
    with kit.serving([tiny_model_path]) as (_server, port, stub):
        assert stub.Score(kit.raw_request(np.zeros((64, 64, 3), np.uint8), scales=[64])).top_k
        with pytest.raises(InferenceServerException, match="UNIMPLEMENTED"):
            grpcclient.InferenceServerClient(f"127.0.0.1:{port}").is_server_live()
    assert [r.getMessage() for r in caplog.records if "KServe" in r.getMessage()] == [
        "Open Inference Protocol (KServe v2) off: No module named 'tritonclient'; "
        "pip install 'scoremap[triton]' turns it on"]


def test_the_servers_message_limit_applies(kit, tiny_model_path):
    with kit.serving([tiny_model_path], max_message_bytes=10_000) as (_server, port, _stub):
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        with pytest.raises(InferenceServerException, match="--max-message-bytes") as raised:
            client.infer("tiny", [pixels_input(np.zeros((50, 100, 3), np.uint8))])  # 15 000 bytes
        assert raised.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
