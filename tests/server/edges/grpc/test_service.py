"""End to end: a real server on an ephemeral port, a real channel, real onnxruntime sessions."""

import io
import threading
import time
import urllib.request

import grpc
import numpy as np
import onnx
import onnxruntime
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image
from prometheus_client import generate_latest

from protos import RETRY_AFTER_KEY, scoring_pb2
from protos.model_card_pb2 import OutputKind
from server.scoring import imaging
from server.scoring.request import ItemKey, ScaleJob
from tests.tiny_models import tolerance

RNG = np.random.default_rng(7)


def direct_scores(path: str, pixels: np.ndarray) -> np.ndarray:
    """The graph run by hand on [H, W, 3] uint8 pixels (the tiny cards use mean 0, std 1)."""
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    batch = pixels.astype(np.float32).transpose(2, 0, 1)[None]
    return session.run(None, {"image": batch})[0][0]


def test_maps_equal_a_direct_run_of_the_graph(kit, layout, tiny_model_path):
    pixels = RNG.integers(0, 256, (64, 96, 3), dtype=np.uint8)
    with kit.serving_in(layout)([tiny_model_path]) as (_server, _port, stub):
        response = stub.Score(kit.raw_request(pixels, scales=[64], return_maps=True, top_k=3))
    (scale_map,) = response.maps
    scores = kit.decode_tensor(scale_map.scores)
    np.testing.assert_allclose(scores, direct_scores(tiny_model_path, pixels), **tolerance(response.execution_provider))
    assert (scale_map.height, scale_map.width) == (2, 3) and response.output_stride == 32
    assert response.execution_provider in ("CPUExecutionProvider", "CUDAExecutionProvider")
    assert response.shift == scoring_pb2.SHIFT_NONE
    assert [label.label for label in response.top_k] == [f"class{label.index}" for label in response.top_k]
    timings = response.timings
    assert timings.total_ms >= timings.inference_ms > 0 and timings.preprocess_ms > 0


def test_encoded_images_are_resized_with_the_card_filter(kit, tiny_model_path):
    source = Image.fromarray(RNG.integers(0, 256, (50, 75, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    source.save(buffer, format="PNG")
    with kit.serving([tiny_model_path]) as (_server, _port, stub):
        response = stub.Score(scoring_pb2.ScoreRequest(encoded=buffer.getvalue(), scales=[64], return_maps=True))
    resized = np.asarray(source.resize((96, 64), Image.Resampling.BILINEAR))
    (scale_map,) = response.maps
    np.testing.assert_allclose(kit.decode_tensor(scale_map.scores), direct_scores(tiny_model_path, resized),
                               **tolerance(response.execution_provider))
    geometry = scale_map.geometry
    assert (geometry.resized_height, geometry.resized_width) == (64, 96)
    assert geometry.scale_factor == pytest.approx(64 / 50)
    assert geometry.stride_x == pytest.approx(32 * 75 / 96)


def test_an_enlarged_jpeg_is_scored_within_one_grey_level_of_pils_resize(kit, tiny_model_path):
    """An upright colour JPEG that a scale enlarges is decoded by libjpeg-turbo and resized by OpenCV's
    bilinear. Its maps are the graph's on the server's own canvas, to the usual float tolerance; against PIL's
    bilinear, which defines the card's filter, that canvas is at most one grey level off, so each logit of this
    linear net is within the sum of its |weights| (the most one level everywhere can move it) of PIL's."""
    source = Image.fromarray(RNG.integers(0, 256, (50, 75, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    source.save(buffer, format="JPEG", quality=100, subsampling=0)
    encoded = buffer.getvalue()
    with kit.serving([tiny_model_path]) as (_server, _port, stub):
        response = stub.Score(scoring_pb2.ScoreRequest(encoded=encoded, scales=[64], return_maps=True))
    scores = kit.decode_tensor(response.maps[0].scores)
    job = ScaleJob(scale=64, resized=(64, 96), canvas=(64, 96), cells=(2, 3), items_per_batch=1)
    opened = imaging.open_image(encoded, max_pixels=1 << 20)
    served = imaging.canvases(opened, [job], (False,), fill=np.zeros(3, np.uint8), resize_filter="bilinear")
    own = served[ItemKey(0, False, 0)]
    np.testing.assert_allclose(scores, direct_scores(tiny_model_path, own), **tolerance(response.execution_provider))
    pil = np.asarray(Image.open(io.BytesIO(encoded)).resize((96, 64), Image.Resampling.BILINEAR))
    assert np.abs(own.astype(int) - pil).max() == 1  # OpenCV's rounding, not PIL's: one level apart at most
    weights = next(onnx.numpy_helper.to_array(tensor) for tensor in onnx.load(tiny_model_path).graph.initializer
                   if tensor.name == "w")
    per_level = np.abs(weights).sum(axis=(1, 2, 3))[:, None, None]
    expected = direct_scores(tiny_model_path, pil)
    allowed = tolerance(response.execution_provider, expected)
    assert (np.abs(scores - expected) <= per_level + allowed["atol"] + allowed["rtol"] * np.abs(expected)).all()


def kit_decode(tensor) -> np.ndarray:
    return np.frombuffer(tensor.data, dtype=np.dtype(tensor.dtype).newbyteorder("<")).reshape(tuple(tensor.shape))


def test_flip_averages_with_the_mirrored_image(kit, layout, tiny_model_path):
    pixels = RNG.integers(0, 256, (64, 128, 3), dtype=np.uint8)
    with kit.serving_in(layout)([tiny_model_path]) as (_server, _port, stub):
        response = stub.Score(kit.raw_request(pixels, scales=[64], flip=True, return_maps=True))
    plain = direct_scores(tiny_model_path, pixels)
    mirrored = direct_scores(tiny_model_path, np.ascontiguousarray(pixels[:, ::-1]))[:, :, ::-1]
    np.testing.assert_allclose(kit_decode(response.maps[0].scores), (plain + mirrored) / 2,
                               **tolerance(response.execution_provider))


def test_class_subsets_float16_cell_top_k_and_multiple_scales(kit, layout, tiny_model_path):
    pixels = RNG.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    with kit.serving_in(layout)([tiny_model_path]) as (_server, _port, stub):
        response = stub.Score(kit.raw_request(
            pixels, scales=[64, 128], return_maps=True, classes=[7, 2], map_dtype=scoring_pb2.FLOAT16,
            cell_top_k=3, top_k=4, request_id="r1",
        ))
    assert response.request_id == "r1" and [m.scale for m in response.maps] == [64, 128]
    small, large = response.maps
    assert (large.height, large.width) == (4, 4) and list(small.classes) == [7, 2]
    full = direct_scores(tiny_model_path, pixels)
    assert small.scores.dtype == "float16"
    np.testing.assert_allclose(kit_decode(small.scores).astype(np.float32), full[[7, 2]], rtol=2e-3, atol=2e-3)
    np.testing.assert_array_equal(kit_decode(small.cell_top_k_indices), np.argsort(-full, axis=0)[:3])
    assert len(response.top_k) == 4
    probabilities = [label.probability for label in response.top_k]
    assert probabilities == sorted(probabilities, reverse=True) and 0 < sum(probabilities) <= 1 + 1e-6


def test_models_cards_health_reflection_and_streams(kit, layout, tiny_model_path, coordinate_model_path):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    pixels = RNG.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    # no queue-time limit: the stream's plans, made on demand, outlast the default 1 s on a loaded machine
    with kit.serving_in(layout)([tiny_model_path, coordinate_model_path], max_queue_ms=600_000) as (_server, port, stub):
        listed = stub.ListModels(scoring_pb2.ListModelsRequest()).models
        assert [(m.name, m.classes, m.output_stride) for m in listed] == [("tiny", 10, 32), ("coords", 2, 32)]
        assert stub.GetModel(scoring_pb2.GetModelRequest(name="coords")).output_kind == OutputKind.OUTPUT_KIND_PROBABILITIES
        with pytest.raises(grpc.RpcError) as caught:
            stub.GetModel(scoring_pb2.GetModelRequest(name="nope"))
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND and "loaded: tiny, coords" in caught.value.details()
        with pytest.raises(grpc.RpcError) as caught:
            stub.Score(kit.raw_request(pixels))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "name one" in caught.value.details()

        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "scoremap.v1.DenseScoring"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        reflected = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = {s.name for s in next(reflected).list_services_response.service}
        assert {"scoremap.v1.DenseScoring", "grpc.health.v1.Health"} <= names
        channel.close()

        requests = [kit.raw_request(pixels, model="tiny", scales=[32 * (1 + i % 3)], request_id=f"id{i}") for i in range(7)]
        responses = list(stub.ScoreStream(iter(requests)))
        assert [r.request_id for r in responses] == [f"id{i}" for i in range(7)]
        assert [r.maps[0].scale for r in responses] == [32 * (1 + i % 3) for i in range(7)]
        bad = requests[:2] + [scoring_pb2.ScoreRequest(model="tiny", request_id="broken", encoded=b"junk")]
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.ScoreStream(iter(bad)))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'broken'" in caught.value.details()


def encoded(size=(40, 30), fmt="PNG") -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (10, 20, 30)).save(buffer, format=fmt)
    return buffer.getvalue()


def bomb() -> bytes:
    buffer = io.BytesIO()
    Image.new("L", (6000, 6000)).save(buffer, format="PNG")
    return buffer.getvalue()


def raw(height, width, channels, length=None) -> scoring_pb2.RawImage:
    size = height * width * channels if length is None else length
    return scoring_pb2.RawImage(data=bytes(size), height=height, width=width, channels=channels)


BAD_REQUESTS = {
    "no image": (scoring_pb2.ScoreRequest(), "has no image"),
    "empty bytes": (scoring_pb2.ScoreRequest(encoded=b""), "the image is empty (0 bytes)"),
    "non-image bytes": (scoring_pb2.ScoreRequest(encoded=b"%PDF-1.7 no-thanks"), "not an image this server reads"),
    "a GIF header only": (scoring_pb2.ScoreRequest(encoded=b"GIF89a-no-thanks"), "cannot decode the GIF image"),
    "truncated": (scoring_pb2.ScoreRequest(encoded=encoded((300, 300))[:200]), "cannot decode"),
    "bomb": (scoring_pb2.ScoreRequest(encoded=bomb()), "exceeds the limit of 20000000 pixels"),
    "zero scale": (scoring_pb2.ScoreRequest(encoded=encoded(), scales=[0]), "scale 0 is below 32"),
    "too many scales": (scoring_pb2.ScoreRequest(encoded=encoded(), scales=list(range(32, 352, 32))), "10 scales"),
    "raw shape": (scoring_pb2.ScoreRequest(raw=raw(4, 4, 3, length=47)), "has 47 bytes"),
    "raw channels": (scoring_pb2.ScoreRequest(raw=raw(4, 4, 2)), "channels must be 1, 3 or 4"),
    "stride": (scoring_pb2.ScoreRequest(encoded=encoded(), output_stride=8), "output_stride 8 is not supported"),
    "atrous on a stride-32 model": (
        scoring_pb2.ScoreRequest(encoded=encoded(), output_stride=16, shift=scoring_pb2.SHIFT_ATROUS), "--output-stride"
    ),
    "classes": (scoring_pb2.ScoreRequest(encoded=encoded(), classes=[3, 10]), "classes [10] are out of range"),
    "negative top-k": (scoring_pb2.ScoreRequest(encoded=encoded(), top_k=-1), "top_k -1 is out of range: it takes 0.."),
}
# No size cap by default: a scale too large for one request's host memory is refused as too large,
# naming the largest that fits, before its tiles are planned.
TOO_LARGE = {
    "absurd scale": scoring_pb2.ScoreRequest(encoded=encoded(), scales=[10**6]),
    "huge resize": scoring_pb2.ScoreRequest(raw=raw(1, 2000, 1), scales=[1024]),
}


def test_every_bad_input_is_invalid_argument_and_the_server_stays_up(kit, layout, tiny_model_path):
    with kit.serving_in(layout)([tiny_model_path], max_image_pixels=20_000_000) as (server, _port, stub):
        for name, (request, words) in BAD_REQUESTS.items():
            with pytest.raises(grpc.RpcError) as caught:
                stub.Score(request)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            assert words in caught.value.details(), (name, caught.value.details())
        with pytest.raises(grpc.RpcError) as caught:
            stub.Score(scoring_pb2.ScoreRequest(encoded=encoded(), model="absent"))
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        assert stub.Score(scoring_pb2.ScoreRequest(encoded=encoded(), model="tiny")).top_k
        counted = server.metrics.registry.get_sample_value
        # The one model is the label even when a request leaves `model` empty; an unknown name is never one.
        assert counted("scoremap_requests_total", {"method": "Score", "code": "INVALID_ARGUMENT", "model": "tiny"}) == len(BAD_REQUESTS)
        assert counted("scoremap_requests_total", {"method": "Score", "code": "NOT_FOUND", "model": ""}) == 1
        assert counted("scoremap_requests_total", {"method": "Score", "code": "OK", "model": "tiny"}) == 1


def test_a_scale_too_large_for_host_memory_is_resource_exhausted_naming_one_that_fits(kit, tiny_model_path):
    with kit.serving([tiny_model_path]) as (_server, _port, stub):
        for name, request in TOO_LARGE.items():
            with pytest.raises(grpc.RpcError) as caught:
                stub.Score(request)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, name
            details = caught.value.details()
            assert "whose RGB copy alone" in details and "--max-request-host-bytes" in details, details
            assert "it would fit with a scale of at most" in details or "no smaller scale" in details, details
            assert RETRY_AFTER_KEY not in dict(caught.value.trailing_metadata() or ()), name


def test_a_request_over_the_message_limit_names_the_flag_that_raises_it(kit, tiny_model_path):
    five_megabytes = b"\xff\xd8" + bytes(5 << 20)  # above gRPC's 4 MB default; reaches the decoder
    with kit.serving([tiny_model_path]) as (_server, _port, stub):
        with pytest.raises(grpc.RpcError) as caught:
            stub.Score(scoring_pb2.ScoreRequest(encoded=five_megabytes))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    over = scoring_pb2.ScoreRequest(encoded=b"\xff\xd8" + bytes(3 << 19))  # 1.5 MiB
    with kit.serving([tiny_model_path], max_message_bytes=1 << 20) as (_server, _port, stub):
        with pytest.raises(grpc.RpcError) as caught:
            stub.Score(over)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"is {over.ByteSize()} bytes" in caught.value.details()
        assert "--max-message-bytes" in caught.value.details() and "1048576" in caught.value.details()
        with pytest.raises(grpc.RpcError) as caught:  # in a stream too, named by its request_id
            list(stub.ScoreStream(iter([scoring_pb2.ScoreRequest(encoded=encoded()), over]), timeout=30))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-message-bytes" in caught.value.details()
        with pytest.raises(grpc.RpcError) as caught:  # beyond twice the limit gRPC cuts it off itself
            stub.Score(scoring_pb2.ScoreRequest(encoded=five_megabytes))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in caught.value.details()
        assert stub.Score(scoring_pb2.ScoreRequest(encoded=encoded())).top_k


def test_a_12_megapixel_jpeg_fits_the_default_limits(kit, layout, tiny_model_path):
    noise = np.random.default_rng(3).integers(0, 256, (3000, 4000, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(noise).save(buffer, format="JPEG", quality=92)
    assert len(buffer.getvalue()) > 4 * 2**20  # over gRPC's default message limit
    with kit.serving_in(layout)([tiny_model_path]) as (_server, _port, stub):
        response = stub.Score(scoring_pb2.ScoreRequest(encoded=buffer.getvalue(), scales=[96]))
    assert (response.image_height, response.image_width) == (3000, 4000)
    assert (response.maps[0].height, response.maps[0].width) == (3, 4)


def metric_samples(port: int, *, also=None) -> dict[str, float]:
    """The server's metrics by series; `also`: a registry whose series count too (an engine process's)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    if also is not None:
        text += generate_latest(also).decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_concurrent_clients_are_batched(kit, layout, tiny_model_path):
    pixels = RNG.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    with kit.serving_in(layout)([tiny_model_path], metrics_port=0, max_batch=8, max_queue_delay_ms=200) as (server, _port, stub):
        barrier = threading.Barrier(8)
        results = []

        def client():
            barrier.wait()
            results.append(stub.Score(kit.raw_request(pixels, scales=[64], return_maps=True)))

        threads = [threading.Thread(target=client) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        engine = getattr(server.pipeline.engine, "engine_metrics", None)  # the split's: the engine's own series
        samples = metric_samples(server.metrics_port, also=engine and engine.registry)
    assert len(results) == 8
    expected = direct_scores(tiny_model_path, pixels)
    for response in results:  # batching does not change the numbers
        np.testing.assert_allclose(kit_decode(response.maps[0].scores), expected, **tolerance(response.execution_provider))
    batches = samples['scoremap_batch_size_count{model="tiny"}']
    passes = samples['scoremap_batch_size_sum{model="tiny"}']
    assert passes == 8 and batches < 8, samples  # some batch held more than one request
    assert samples['scoremap_requests_total{code="OK",method="Score",model="tiny"}'] == 8
    assert samples['scoremap_stage_seconds_count{model="tiny",stage="inference"}'] == 8
    assert samples['scoremap_batch_predicted_bytes_count{model="tiny"}'] == batches
    assert 'scoremap_queue_depth{model="tiny"}' in samples and "scoremap_in_flight" in samples


def test_metrics_tell_models_apart_and_leave_out_the_warm_up(kit, tiny_model_path, tmp_path):
    other = tmp_path / "other.onnx"
    onnx.save(kit.patch_net(classes=3, name="other"), other)
    pixels = RNG.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    with kit.serving([tiny_model_path, str(other)], warm_up=True) as (server, _port, stub):
        counted = server.metrics.registry.get_sample_value
        for model in ("tiny", "other"):  # warmed up, yet nothing counted
            assert counted("scoremap_stage_seconds_count", {"stage": "inference", "model": model}) is None
            assert counted("scoremap_batch_size_count", {"model": model}) is None
        for _ in range(2):
            stub.Score(kit.raw_request(pixels, model="other", scales=[64]))
        stub.Score(kit.raw_request(pixels, model="tiny", scales=[64]))
        assert counted("scoremap_stage_seconds_count", {"stage": "inference", "model": "other"}) == 2
        assert counted("scoremap_stage_seconds_count", {"stage": "inference", "model": "tiny"}) == 1
        assert counted("scoremap_requests_total", {"method": "Score", "code": "OK", "model": "other"}) == 2
        assert len(list(stub.ScoreStream(iter([kit.raw_request(pixels, model="other", scales=[64])] * 2)))) == 2
        assert counted("scoremap_requests_total", {"method": "ScoreStream", "code": "OK", "model": "other"}) == 1
        assert counted("scoremap_batch_size_count", {"model": "tiny"}) >= 1
        assert counted("scoremap_queue_depth", {"model": "other"}) == 0


def test_a_full_queue_is_resource_exhausted_with_a_retry_hint(kit, layout, tiny_model_path):
    """No room at all (--queue-depth 0): deterministic on any device, however fast the model."""
    from server.errors import RETRY_AFTER_KEY

    pixels = RNG.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    with kit.serving_in(layout)([tiny_model_path], queue_depth=0) as (_server, _port, stub):
        with pytest.raises(grpc.RpcError) as caught:
            stub.Score(kit.raw_request(pixels, scales=[64]))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--queue-depth" in caught.value.details()
        hint = dict(caught.value.trailing_metadata())[RETRY_AFTER_KEY]
        assert int(hint) > 0
        with pytest.raises(grpc.RpcError) as caught:  # a stream's request carries its hint too
            list(stub.ScoreStream(iter([kit.raw_request(pixels, scales=[64], request_id="r7")]), timeout=30))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "'r7'" in caught.value.details()
        assert int(dict(caught.value.trailing_metadata())[RETRY_AFTER_KEY]) > 0
        with pytest.raises(grpc.RpcError) as caught:  # a refusal that is not transient (from the fields) has none
            stub.Score(kit.raw_request(pixels, scales=[16]))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert RETRY_AFTER_KEY not in dict(caught.value.trailing_metadata() or ())


def test_a_lockstep_stream_gets_each_answer_before_sending_the_next(kit, layout, tiny_model_path):
    import queue

    pixels = RNG.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    outbox: queue.Queue = queue.Queue()

    def requests():
        while (request := outbox.get(timeout=30)) is not None:
            yield request

    with kit.serving_in(layout)([tiny_model_path], stream_window=4) as (_server, _port, stub):
        answers = stub.ScoreStream(requests(), timeout=20)
        for i in range(3):  # fewer than the window: answers must not wait for it to fill
            outbox.put(kit.raw_request(pixels, scales=[64], request_id=f"id{i}"))
            assert next(answers).request_id == f"id{i}"
        outbox.put(None)
        assert list(answers) == []


def test_a_stream_the_client_abandons_is_counted_cancelled_or_expired_not_a_bug(kit, tiny_model_path, caplog):
    import queue

    pixels = RNG.integers(0, 256, (64, 64, 3), dtype=np.uint8)

    def lockstep(outbox):
        while (request := outbox.get(timeout=30)) is not None:
            yield request

    with kit.serving([tiny_model_path]) as (server, _port, stub):
        counted = server.metrics.registry.get_sample_value
        for timeout, expected in ((None, "CANCELLED"), (1.0, "DEADLINE_EXCEEDED")):
            labels = {"method": "ScoreStream", "code": expected, "model": "tiny"}  # its requests' model
            outbox: queue.Queue = queue.Queue()
            answers = stub.ScoreStream(lockstep(outbox), timeout=timeout)
            outbox.put(kit.raw_request(pixels, scales=[64]))
            assert next(answers).maps  # the server now waits for the next request
            if timeout is None:
                answers.cancel()
            deadline = time.monotonic() + 10
            while not counted("scoremap_requests_total", labels):
                assert time.monotonic() < deadline, f"no {expected} counted"
                time.sleep(0.02)
            outbox.put(None)
        assert counted("scoremap_requests_total", {"method": "ScoreStream", "code": "UNKNOWN", "model": "tiny"}) is None
    assert "ScoreStream failed" not in caplog.text


def test_a_cancelled_lockstep_stream_releases_its_handler(kit, tiny_model_path):
    import queue

    pixels = RNG.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    outbox: queue.Queue = queue.Queue()

    def requests():
        while (request := outbox.get(timeout=30)) is not None:
            yield request

    with kit.serving([tiny_model_path]) as (server, _port, stub):
        answers = stub.ScoreStream(requests())
        outbox.put(kit.raw_request(pixels, scales=[64]))
        assert next(answers).maps  # the server now waits for the next request
        answers.cancel()
        assert server.front.wait_idle(5), "the handler still waits for an answer that cannot come"
        outbox.put(None)


@pytest.mark.parametrize("flag, lowest", [(None, 32), (96, 96)])  # the tiny model's training size is 32
def test_the_smallest_scale_is_the_model_s_or_min_scale_and_is_told(kit, tiny_model_path, flag, lowest):
    pixels = np.zeros((128, 128, 3), dtype=np.uint8)
    with kit.serving([tiny_model_path], **({"min_scale": flag} if flag else {})) as (_server, _port, stub):
        (summary,) = stub.ListModels(scoring_pb2.ListModelsRequest()).models
        assert summary.min_scale == lowest
        assert stub.Score(kit.raw_request(pixels, scales=[lowest])).maps
        with pytest.raises(grpc.RpcError) as caught:
            stub.Score(kit.raw_request(pixels, scales=[lowest - 1]))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"is below {lowest}, the smallest" in caught.value.details() and "training size 32" in caught.value.details()
