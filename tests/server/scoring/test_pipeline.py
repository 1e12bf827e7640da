"""The data path end to end on real onnxruntime sessions: plans of one shape each, canvases, passes, crops, flips."""

import dataclasses
import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import onnx
import pytest
from PIL import Image

from clients.api.results import decode_tensor
from protos import scoring_pb2
from server.engine import plans
from server.scoring import admission, footprint
from server.errors import Refusal, ScoringError
from server.metrics import Metrics
from server.scoring.pipeline import Pipeline
from server.settings import Settings
from tests.tiny_models import coordinate_image, coordinate_net, heavy_net, patch_net, tolerance

SETTINGS = Settings(warm_up=False, intra_op_threads=1)


def decode(tensor) -> np.ndarray:
    return np.frombuffer(tensor.data, dtype=np.dtype(tensor.dtype).newbyteorder("<")).reshape(tuple(tensor.shape))


def raw(pixels: np.ndarray, **fields) -> scoring_pb2.ScoreRequest:
    height, width, channels = pixels.shape
    image = scoring_pb2.RawImage(data=pixels.tobytes(), height=height, width=width, channels=channels)
    return scoring_pb2.ScoreRequest(raw=image, **fields)


@pytest.fixture
def pipeline_of(tmp_path):
    made = []

    def make(net: onnx.ModelProto, metrics: Metrics | None = None, **settings) -> Pipeline:
        path = tmp_path / f"model{len(made)}.onnx"
        onnx.save(net, path)
        pipeline = Pipeline([str(path)], settings=dataclasses.replace(SETTINGS, **settings), metrics=metrics)
        made.append(pipeline)
        return pipeline

    yield make
    for pipeline in made:
        pipeline.close()


def test_grid_passes_see_the_whole_image_and_interleave_on_the_stride_16_lattice(pipeline_of):
    """The coordinate net scores each cell with the mean x (channel 0) and y (channel 1) of its patch."""
    pipeline = pipeline_of(coordinate_net())
    response = pipeline.score(raw(coordinate_image(256), scales=[256], output_stride=16, return_maps=True))
    lattice = decode(response.maps[0].scores)
    assert response.shift == scoring_pb2.SHIFT_GRID and lattice.shape == (2, 16, 16)
    geometry = response.maps[0].geometry
    # Cell (m, n) lies at c - 16 + 16 (m, n): the first row and column come from the passes shifted by 16.
    assert (geometry.stride_x, geometry.center_x, geometry.box_width) == (16, -0.5, 32)
    centres = -0.5 + 16 * np.arange(16)
    np.testing.assert_allclose(lattice[0, 1:, 1:], np.broadcast_to(centres[1:], (15, 15)), **tolerance(pipeline))
    np.testing.assert_allclose(lattice[1, 1:, 1:], np.broadcast_to(centres[1:, None], (15, 15)), **tolerance(pipeline))
    # The shifted passes put the mean colour (0 here) where the image is not: half of cell (m, 0) is fill.
    np.testing.assert_allclose(lattice[0, 1:, 0], np.arange(16).sum() * 32 / 1024, **tolerance(pipeline))
    # No row bands: the last row reads the image's own last pixels, not replicated ones.
    np.testing.assert_allclose(lattice[1, 15, 1:], 239.5, **tolerance(pipeline))


def test_diagonal_shift_returns_a_quincunx(pipeline_of):
    pipeline = pipeline_of(coordinate_net())
    response = pipeline.score(raw(coordinate_image(128), scales=[128], output_stride=16,
                                  shift=scoring_pb2.SHIFT_DIAGONAL, return_maps=True, cell_top_k=1))
    lattice = decode(response.maps[0].scores)
    assert response.shift == scoring_pb2.SHIFT_DIAGONAL and lattice.shape == (2, 8, 8)
    scored = ~np.isnan(lattice[0])
    assert scored.sum() == 32 and (scored == ((np.add.outer(np.arange(8), np.arange(8)) % 2) == 0)).all()
    np.testing.assert_allclose(lattice[0, 2, 4], -0.5 + 16 * 4, **tolerance(pipeline))
    np.testing.assert_allclose(lattice[1, 3, 5], -0.5 + 16 * 3, **tolerance(pipeline))
    indices = decode(response.maps[0].cell_top_k_indices)
    assert (indices[0][~scored] == -1).all() and (indices[0][scored] >= 0).all()
    assert np.isfinite([label.probability for label in response.top_k]).all()


@pytest.mark.parametrize("stride", [32, 16])
def test_flip_averaging_lines_up_off_centre_receptive_fields(pipeline_of, stride):
    """Bottom/right-only padding ('SAME'): the mirrored map is a cell off until aligned; aligned, x reads true."""
    pipeline = pipeline_of(coordinate_net(end_pad=32))
    pixels = coordinate_image(128)
    plain = decode(pipeline.score(raw(pixels, scales=[128], output_stride=stride, return_maps=True)).maps[0].scores)
    flipped = decode(pipeline.score(raw(pixels, scales=[128], output_stride=stride, flip=True,
                                        return_maps=True)).maps[0].scores)
    assert plain.shape == flipped.shape == ((2, 5, 5) if stride == 32 else (2, 10, 10))
    interior = slice(1, 4) if stride == 32 else slice(2, 7)
    np.testing.assert_allclose(flipped[1, interior, interior], plain[1, interior, interior], atol=1e-3)
    # x of the mirrored image mirrored back: the mean of x and the mirror of 127 - x, which is x itself.
    np.testing.assert_allclose(flipped[0, interior, interior], plain[0, interior, interior], atol=1e-3)


def test_padding_to_a_canvas_keeps_the_unpadded_cells_and_reports_the_border(pipeline_of):
    """An image padded into a larger canvas: cells whose field stays inside the image equal the unpadded run."""
    net = heavy_net(classes=3, depth=2)  # two 3x3 convs: a cell's field is its 32-px patch plus 2 px around it
    unpadded = pipeline_of(net, shape_buckets=((96, 128),))
    padded = pipeline_of(net, shape_buckets=((160, 192),))
    pixels = np.random.default_rng(0).integers(0, 256, (96, 128, 3), dtype=np.uint8)
    request = raw(pixels, scales=[96], return_maps=True)
    a, b = unpadded.score(request), padded.score(request)
    first, second = decode(a.maps[0].scores), decode(b.maps[0].scores)
    assert first.shape == second.shape == (3, 3, 4)  # the padding's own cells are cropped
    assert (b.maps[0].geometry.padded_border_rows, b.maps[0].geometry.padded_border_cols) == (1, 1)
    assert (a.maps[0].geometry.padded_border_rows, a.maps[0].geometry.padded_border_cols) == (0, 0)
    np.testing.assert_allclose(second[:, :2, :3], first[:, :2, :3], **tolerance(padded, first))
    assert not np.allclose(second[:, 2, :], first[:, 2, :], atol=1e-6)  # the border row saw the canvas


def test_no_session_ever_sees_two_input_shapes_under_mixed_concurrent_traffic(pipeline_of, monkeypatch):
    seen: dict[object, set] = {}  # keyed by the session itself: kept alive, so no id is reused
    lock = threading.Lock()
    run = plans.Plan.run

    def recording(self, pixels, valid, *, lattice):
        with lock:
            seen.setdefault(self.session, set()).add((pixels.shape, valid.shape))
        return run(self, pixels, valid, lattice=lattice)

    monkeypatch.setattr(plans.Plan, "run", recording)
    # no queue-time limit: plans made and evicted in turn outlast the default 1 s on a loaded machine (it dropped
    # items there), and this test is about shapes
    pipeline = pipeline_of(patch_net(classes=5), max_batch=4, max_queue_delay_ms=20, max_plans=4, max_queue_ms=600_000)
    rng = np.random.default_rng(1)
    requests = []
    for index in range(24):
        height, width = [(64, 64), (64, 100), (90, 64), (70, 130)][index % 4]
        requests.append(raw(rng.integers(0, 256, (height, width, 3), dtype=np.uint8),
                            scales=[[64], [96], [64, 128]][index % 3], output_stride=[32, 16][index % 2],
                            flip=index % 5 == 0, return_maps=index % 2 == 0))
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(pipeline.score, requests))
    assert all(len(r.maps) == len(q.scales) for r, q in zip(responses, requests))
    assert len(seen) > 4  # plans were made, evicted (max_plans 4) and made again
    assert all(len(shapes) == 1 for shapes in seen.values()), seen


def test_cpu_runners_score_side_by_side_as_one_runner_does(kit, heavy_model_path, monkeypatch):
    """--cpu-runners 2 over gRPC: two plan runs at once (one runner: never), the budget told of both, and each answer
    equals one runner's (both run one onnxruntime thread per batch: the same kernels, in the same order)."""
    requests = [kit.raw_request(np.random.default_rng(seed).integers(0, 256, (96 + 32 * (seed % 3), 128, 3),
                                                                    dtype=np.uint8), scales=[96], top_k=4)
                for seed in range(12)]
    running, most = [0], {}
    lock, run = threading.Lock(), plans.Plan.run

    def counted(plan, *args, **kwargs):
        with lock:
            running[0] += 1
            most[runners] = max(most.get(runners, 0), running[0])
        try:
            return run(plan, *args, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(plans.Plan, "run", counted)
    answers = {}
    for runners in (1, 2):
        with kit.serving([heavy_model_path], cpu_runners=runners, intra_op_threads=1) as (server, _port, stub):
            with ThreadPoolExecutor(6) as pool:
                answers[runners] = list(pool.map(lambda request: stub.Score(request, timeout=60), requests))
            assert {record.owner.runners for record in server.pipeline.engine.budget.plans()} == {runners}
    assert most == {1: 1, 2: 2}
    for one, two in zip(answers[1], answers[2]):
        assert [label.index for label in one.top_k] == [label.index for label in two.top_k]
        np.testing.assert_allclose([label.probability for label in two.top_k],
                                   [label.probability for label in one.top_k], rtol=1e-5)


@pytest.mark.parametrize("side", [32, 33, 48, 64, 65, 96])
@pytest.mark.parametrize("stride, shift", [(32, 0), (16, scoring_pb2.SHIFT_GRID), (16, scoring_pb2.SHIFT_DIAGONAL)])
@pytest.mark.parametrize("flip", [False, True])
def test_every_response_is_finite_or_an_error(pipeline_of, side, stride, shift, flip):
    """Every number of every answer is finite, a one-cell-wide map with flip's top-k included."""
    pipeline = pipeline_of(patch_net(classes=4, end_pad=16))
    pixels = np.random.default_rng(side).integers(0, 256, (side, side + 7, 3), dtype=np.uint8)
    request = raw(pixels, scales=[32, 64], output_stride=stride, shift=shift, flip=flip, return_maps=True, cell_top_k=2)
    response = pipeline.score(request)
    assert np.isfinite([label.probability for label in response.top_k]).all()
    assert abs(sum(label.probability for label in response.top_k) - 1) < 1e-3  # 4 classes: top-5 holds all
    for scale_map in response.maps:
        scores = decode(scale_map.scores)
        holes = np.isnan(scores)
        if shift != scoring_pb2.SHIFT_DIAGONAL:
            assert not holes.any()
        assert np.isfinite(scores[~holes]).all()


@pytest.mark.parametrize("fields, code, words", [
    (dict(shift=99), grpc.StatusCode.INVALID_ARGUMENT, "use one of SHIFT_UNSPECIFIED"),
    (dict(shift=99, output_stride=16), grpc.StatusCode.INVALID_ARGUMENT, "use one of SHIFT_UNSPECIFIED"),
    (dict(map_dtype=7), grpc.StatusCode.INVALID_ARGUMENT, "use one of MAP_DTYPE_UNSPECIFIED, FLOAT32, FLOAT16"),
    (dict(scales=[16]), grpc.StatusCode.INVALID_ARGUMENT, "needs at least its training size 32"),
    (dict(scales=[2048], return_maps=True), grpc.StatusCode.RESOURCE_EXHAUSTED, "--max-message-bytes"),
])
def test_bad_requests_are_refused_before_any_compute(pipeline_of, fields, code, words):
    pipeline = pipeline_of(patch_net(classes=1000), max_message_bytes=4 << 20, max_resized_pixels=10**8)
    with pytest.raises(ScoringError, match=words) as caught:
        pipeline.score(raw(np.zeros((64, 64, 3), dtype=np.uint8), **fields))
    assert caught.value.refusal.name == code.name
    assert pipeline.engine.served(pipeline._model("").name).plans.made == 0  # refused before a plan was made or run


def hold_runs(pipeline, model) -> tuple[threading.Event, threading.Event]:
    """Make `model`'s batches wait for the first event (the gate); the second is set once one has started."""
    gate, entered = threading.Event(), threading.Event()
    run = pipeline.engine.served(model.name).batcher._run

    def held(works):
        entered.set()
        gate.wait(10)
        return run(works)

    pipeline.engine.served(model.name).batcher._run = held
    return gate, entered


def test_a_full_queue_is_refused_before_the_image_is_even_parsed(pipeline_of):
    pipeline = pipeline_of(patch_net(classes=3), queue_depth=1)
    model = pipeline._model("")
    gate, entered = hold_runs(pipeline, model)
    pixels = np.zeros((64, 64, 3), dtype=np.uint8)
    broken = scoring_pb2.ScoreRequest(encoded=b"\x89PNG\r\n\x1a\n" + b"\x00" * 64)  # its header cannot be read
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(pipeline.score, raw(pixels))
        assert entered.wait(10)
        second = pool.submit(pipeline.score, raw(pixels))  # holds the one place (--queue-depth 1)
        while pipeline.engine.served(model.name).batcher.depth() == 0:
            entered.wait(0.01)
        for request in (raw(pixels), broken):  # refused from the fields alone, with a retry hint
            with pytest.raises(ScoringError, match="queue full") as caught:
                pipeline.score(request)
            assert caught.value.refusal is Refusal.RESOURCE_EXHAUSTED and caught.value.retry_after_seconds > 0
        for request, words in ((scoring_pb2.ScoreRequest(), "no image"),  # what the fields show is never transient
                               (scoring_pb2.ScoreRequest(encoded=b"%PDF-1.7" + b"\x00" * 64), "are not an image")):
            with pytest.raises(ScoringError, match=words) as caught:
                pipeline.score(request)
            assert caught.value.refusal is Refusal.INVALID_ARGUMENT
        gate.set()
        assert first.result().top_k and second.result().top_k
    with pytest.raises(ScoringError, match="cannot decode"):  # with room, its header is read, and found broken
        pipeline.score(broken)
    assert pipeline.engine.served(model.name).batcher.depth() == 0 and pipeline.score(raw(pixels)).top_k  # the place it held is given back


def test_a_request_still_decoding_holds_its_place_in_the_queue_until_it_is_queued_or_fails(pipeline_of):
    pipeline = pipeline_of(patch_net(classes=3), queue_depth=1)
    model = pipeline._model("")
    gate, entered = threading.Event(), threading.Event()
    decode = pipeline._canvases

    def held(order):
        entered.set()
        gate.wait(10)
        return decode(order)

    pipeline._canvases = held
    pixels = np.zeros((64, 64, 3), dtype=np.uint8)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(pipeline.score, raw(pixels))
        assert entered.wait(10) and pipeline.engine.served(model.name).batcher.depth() == 1  # admitted and decoding: its place is held
        with pytest.raises(ScoringError, match="queue full"):
            pipeline.score(raw(pixels))  # its place is taken all the same
        gate.set()
        assert first.result().top_k
    pipeline._canvases = decode
    encoded = io.BytesIO()
    Image.fromarray(np.full((64, 64, 3), 9, np.uint8)).save(encoded, format="PNG")
    truncated = scoring_pb2.ScoreRequest(encoded=encoded.getvalue()[:60])  # a readable header, no pixels
    with pytest.raises(ScoringError, match="cannot decode"):
        pipeline.score(truncated)
    assert pipeline.score(raw(pixels)).top_k  # the failed request gave its place back


def test_a_call_cancelled_while_its_image_decodes_is_never_queued(pipeline_of):
    pipeline = pipeline_of(patch_net(classes=3), queue_depth=1)
    model = pipeline._model("")
    ran = []
    run = pipeline.engine.served(model.name).batcher._run
    pipeline.engine.served(model.name).batcher._run = lambda works: ran.append(works) or run(works)
    cancelled = threading.Event()
    decode = pipeline._canvases

    def decode_then_leave(order):
        canvases = decode(order)
        cancelled.set()  # the caller hangs up meanwhile
        return canvases

    pipeline._canvases = decode_then_leave
    with pytest.raises(ScoringError) as caught:
        pipeline.score(raw(np.zeros((64, 64, 3), dtype=np.uint8)), cancelled=cancelled)
    assert caught.value.refusal is Refusal.CANCELLED and not ran
    pipeline._canvases = decode
    assert pipeline.score(raw(np.zeros((64, 64, 3), dtype=np.uint8))).top_k  # its place was given back


def test_a_warm_up_failure_names_the_model_and_what_failed(tmp_path):
    net = patch_net(classes=3)  # its scores reshaped to one cell: it loads (32 x 32) but no larger plan runs
    net.graph.node[0].output[0] = "cells"
    net.graph.initializer.append(onnx.numpy_helper.from_array(np.array([1, 3, 1, 1], dtype=np.int64), "one_cell"))
    net.graph.node.append(onnx.helper.make_node("Reshape", ["cells", "one_cell"], ["scores"]))
    path = tmp_path / "broken.onnx"
    onnx.save(net, path)
    with pytest.raises(ScoringError, match="warm-up failed: tiny") as caught:
        Pipeline([str(path)], settings=dataclasses.replace(SETTINGS, warm_up=True))
    assert caught.value.refusal is Refusal.UNAVAILABLE


def test_float16_maps_come_back_from_the_device_as_float16(pipeline_of):
    pipeline = pipeline_of(patch_net(classes=6))
    pixels = np.random.default_rng(3).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    full = pipeline.score(raw(pixels, scales=[64], return_maps=True))
    half = pipeline.score(raw(pixels, scales=[64], return_maps=True, map_dtype=scoring_pb2.FLOAT16, flip=True))
    plain = pipeline.score(raw(pixels, scales=[64], return_maps=True, flip=True))
    assert half.maps[0].scores.dtype == "float16" and len(half.maps[0].scores.data) == len(full.maps[0].scores.data) // 2
    np.testing.assert_allclose(decode(half.maps[0].scores).astype(np.float32), decode(plain.maps[0].scores),
                               rtol=2e-3, atol=2e-3)


def test_a_shape_outside_the_warm_up_is_planned_once_and_its_cost_reported(tmp_path):
    from server.metrics import Metrics

    path = tmp_path / "tiny.onnx"
    onnx.save(patch_net(classes=3), path)
    metrics = Metrics()
    pipeline = Pipeline([str(path)], settings=dataclasses.replace(SETTINGS, warm_up=True, max_batch=4), metrics=metrics)
    try:
        pixels = np.zeros((64, 200, 3), dtype=np.uint8)  # 64x192: no warm-up canvas holds it
        first = pipeline.score(raw(pixels, scales=[64], flip=True))
        again = pipeline.score(raw(pixels, scales=[64], flip=True))
        assert first.timings.planning_ms > 0 and again.timings.planning_ms == 0
        assert metrics.registry.get_sample_value("scoremap_plans_made_total", {"model": "tiny"}) == 1
    finally:
        pipeline.close()


@pytest.mark.parametrize("fields", [
    {"top_k": 500},  # the image's top-k alone: labels of every class
    {"top_k": 3, "return_maps": True, "cell_top_k": 5},
    {"top_k": 500, "return_maps": True, "map_dtype": scoring_pb2.FLOAT16, "classes": [1, 2, 3]},
    {"request_id": "r" * 20_000},  # echoed back
    {},  # the default top-k
])
def test_the_response_size_estimate_holds_every_response(pipeline_of, fields):
    pipeline = pipeline_of(patch_net(classes=500))
    model = pipeline._model("")
    request = raw(np.zeros((96, 128, 3), dtype=np.uint8), **fields)
    with admission.admit(request, model, engine=pipeline.engine, deadline=None) as order:
        estimate = footprint.response_bytes(request, model, order.jobs)
    assert pipeline.score(request).ByteSize() <= estimate


def test_an_item_queued_past_max_queue_ms_is_dropped_before_compute(pipeline_of):
    metrics = Metrics()
    pipeline = pipeline_of(patch_net(classes=3), metrics=metrics, max_queue_ms=50)
    model = pipeline._model("")
    gate, entered = hold_runs(pipeline, model)
    pixels = np.zeros((64, 64, 3), dtype=np.uint8)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(pipeline.score, raw(pixels))
        assert entered.wait(10)
        second = pool.submit(pipeline.score, raw(pixels))  # admitted: nothing waits ahead of it yet
        while pipeline.engine.served(model.name).batcher.depth() == 0:
            entered.wait(0.01)
        time.sleep(0.2)  # it waits past the 50 ms limit behind the held run
        gate.set()
        assert first.result().top_k
        with pytest.raises(ScoringError, match=r"beyond --max-queue-ms \(50 ms\); dropped before compute") as caught:
            second.result()
    assert caught.value.refusal is Refusal.RESOURCE_EXHAUSTED and caught.value.retry_after_seconds > 0
    assert metrics.registry.get_sample_value("scoremap_dropped_total", {"model": "tiny", "reason": "queue_time"}) == 1


def test_float16_maps_beyond_its_range_are_an_error_not_infinities(pipeline_of):
    pipeline = pipeline_of(patch_net(classes=3, weights=np.full((3, 3, 32, 32), 100.0, dtype=np.float32)))
    request = raw(np.full((64, 64, 3), 255, dtype=np.uint8), return_maps=True)  # logits of about 8e6
    assert np.isfinite(decode_tensor(pipeline.score(request).maps[0].scores)).all()
    request.map_dtype = scoring_pb2.FLOAT16
    for cell_top_k in (0, 2):  # the device's half lattice; a float32 one (to rank cells) cast for sending
        request.cell_top_k = cell_top_k
        with pytest.raises(ScoringError, match="in float16 \\(ask for map_dtype FLOAT32\\)"):
            pipeline.score(request)


@pytest.mark.parametrize("orientation, turn", [(6, Image.Transpose.ROTATE_90), (8, Image.Transpose.ROTATE_270)])
def test_a_rotated_tiff_scores_as_its_upright_image(default_model_path, orientation, turn):
    """A TIFF tagged Orientation 6 or 8 is scored upright, not squashed into the transposed shape."""
    upright = Image.open("samples/cat.jpg").convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = orientation
    rotated, plain = io.BytesIO(), io.BytesIO()
    upright.transpose(turn).save(rotated, format="TIFF", exif=exif)
    upright.save(plain, format="TIFF")
    pipeline = Pipeline([default_model_path], settings=SETTINGS)
    try:
        expected, received = (pipeline.score(scoring_pb2.ScoreRequest(encoded=data.getvalue(), return_maps=True))
                              for data in (plain, rotated))
    finally:
        pipeline.close()
    assert (received.image_height, received.image_width) == (upright.height, upright.width)
    assert decode(received.maps[0].scores).shape == decode(expected.maps[0].scores).shape
    np.testing.assert_allclose(decode(received.maps[0].scores), decode(expected.maps[0].scores), atol=1e-5)
    assert [label.index for label in received.top_k] == [label.index for label in expected.top_k]
