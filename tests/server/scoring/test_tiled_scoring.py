"""Server-side tiling: an image larger than every canvas bucket is tiled onto one.

Each answer is compared with the same request to a server whose one bucket is the canvas one pass over
the whole image has (image + slack, rounded up): the map, its geometry and the image-level top-k agree to
1e-5, the tiled map states its tiling, and no plan outside the configured buckets is ever made.
"""

from __future__ import annotations

import dataclasses
import io
import json
import pathlib
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import onnx
import pytest
import tritonclient.http as httpclient
from PIL import Image

from clients.api.results import result_from_response
from convert import convert_classifier
from convert.card import read_card
from protos import scoring_pb2
from protos.scoring_pb2 import SHIFT_DIAGONAL, SHIFT_GRID, SHIFT_NONE
from server.geometry import buckets, dense, tiling
from server.errors import ScoringError
from server.scoring.pipeline import Pipeline
from server.engine.plans import PlanKey
from server.settings import Settings
from tests.clients.slides.nets import UNIT, tiny_classifier

SAMPLES = pathlib.Path(__file__).parents[3] / "samples"
TOLERANCE = 1e-5  # float32 on the CPU: |difference| per cell (logits)
PROBABILITY_RTOL = 1e-4  # the image-level probabilities, relative (an unweighted mean of the tiles is off by ~30%)
SETTINGS = Settings(warm_up=False, intra_op_threads=1, strict_shapes=True)  # a plan outside the buckets: refused
SMALL = ((256, 288), (320, 288))  # the tiny net's receptive field (~190 px) fits, an image of 617x541 does not
SCHEMES = {
    "stride 32": dict(output_stride=32, shift=SHIFT_NONE),
    "grid": dict(output_stride=16, shift=SHIFT_GRID),
    "diagonal": dict(output_stride=16, shift=SHIFT_DIAGONAL),
}


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    """The tiny stride-32 classifier of the tiling tests, padded and pad-free, converted by the real converter."""
    folder, paths = tmp_path_factory.mktemp("tiny_tiled"), {}
    for padded in (True, False):
        paths[padded] = str(folder / f"tiny-{'pad' if padded else 'valid'}.onnx")
        source = tiny_classifier(padded=padded, nhwc=False, size=64 if padded else 96)
        onnx.save(convert_classifier(source, preprocessing=UNIT), paths[padded])
    return paths


def image(height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def request_of(pixels: np.ndarray, **fields) -> scoring_pb2.ScoreRequest:
    height, width = pixels.shape[:2]
    fields.setdefault("scales", [min(height, width)])  # its own size: no resize
    fields.setdefault("return_maps", True)
    return scoring_pb2.ScoreRequest(
        raw=scoring_pb2.RawImage(data=pixels.tobytes(), height=height, width=width, channels=3), top_k=3, **fields)


def one_pass_bucket(pixels: np.ndarray, *, native_stride: int, output_stride: int, shift: int,
                    multiple: int) -> tuple[int, int]:
    """The canvas one pass over the whole image has: the reference server's only bucket."""
    passes = dense.passes_for(native_stride=native_stride, output_stride=output_stride, shift=shift)
    return buckets.on_demand_canvas(*pixels.shape[:2], slack=passes.slack, multiple=multiple)


def decode(tensor) -> np.ndarray:
    return np.frombuffer(tensor.data, dtype=np.dtype(tensor.dtype).newbyteorder("<")).reshape(tuple(tensor.shape))


def assert_same_answer(tiled: scoring_pb2.ScoreResponse, whole: scoring_pb2.ScoreResponse) -> None:
    """The tiled answer is the one pass's: every map cell, its holes, its geometry and the image-level top-k."""
    for ours, theirs in zip(tiled.maps, whole.maps, strict=True):
        mine, reference = decode(ours.scores), decode(theirs.scores)
        assert mine.shape == reference.shape and (ours.height, ours.width) == (theirs.height, theirs.width)
        assert np.array_equal(np.isnan(mine), np.isnan(reference)), "the same cells are unscored (diagonal)"
        difference = np.nanmax(np.abs(mine - reference))
        assert difference <= TOLERANCE, f"max |tiled - one pass| = {difference:.3g} ({ours.tiling})"
        assert ours.geometry == theirs.geometry
        assert not theirs.HasField("tiling")  # one pass: no tiling stated
    assert [label.index for label in tiled.top_k] == [label.index for label in whole.top_k]
    # Relative: the tiny nets' runner-up classes have probabilities of 1e-6 (float32 sums, another order).
    np.testing.assert_allclose([label.probability for label in tiled.top_k],
                               [label.probability for label in whole.top_k], rtol=PROBABILITY_RTOL, atol=1e-9)


def plan_shapes(pipeline: Pipeline) -> set[tuple[int, int]]:
    return {(key.height, key.width) for key in pipeline.engine.served(pipeline._model("").name).plans._plans}


@pytest.mark.parametrize("flip", [False, True], ids=["plain", "flip"])
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "pad-free"])
def test_an_image_larger_than_every_bucket_is_tiled_to_the_one_pass_answer(tiny_paths, scheme, padded, flip):
    path, fields = tiny_paths[padded], dict(SCHEMES[scheme], flip=flip)
    pixels = image(617, 541)  # no multiple of the tile nor of the stride
    whole_bucket = one_pass_bucket(pixels, native_stride=32, output_stride=fields["output_stride"],
                                   shift=fields["shift"], multiple=32)
    small = Pipeline([path], settings=dataclasses.replace(SETTINGS, shape_buckets=SMALL))
    whole = Pipeline([path], settings=dataclasses.replace(SETTINGS, shape_buckets=(whole_bucket,)))
    try:
        tiled, reference = small.score(request_of(pixels, **fields)), whole.score(request_of(pixels, **fields))
        assert plan_shapes(small) <= set(SMALL) and plan_shapes(whole) == {whole_bucket}
    finally:
        small.close()
        whole.close()
    stated = tiled.maps[0].tiling
    field = read_card(path).receptive_field
    assert stated.tiles >= 4 and stated.exact and stated.halo_px == tiling.exact_halo(field.size)
    assert (stated.canvas_height, stated.canvas_width) in SMALL
    assert_same_answer(tiled, reference)


def test_a_halo_below_the_receptive_field_is_stated_and_the_seams_show(tiny_paths):
    """The comparison can fail: with --halo below the exact one the answer says so, and differs."""
    pixels, fields = image(617, 541), dict(SCHEMES["grid"])
    whole_bucket = one_pass_bucket(pixels, native_stride=32, output_stride=16, shift=SHIFT_GRID, multiple=32)
    small = Pipeline([tiny_paths[True]], settings=dataclasses.replace(SETTINGS, shape_buckets=SMALL, halo=8))
    whole = Pipeline([tiny_paths[True]], settings=dataclasses.replace(SETTINGS, shape_buckets=(whole_bucket,)))
    try:
        tiled, reference = small.score(request_of(pixels, **fields)), whole.score(request_of(pixels, **fields))
    finally:
        small.close()
        whole.close()
    assert tiled.maps[0].tiling.halo_px == 8 and not tiled.maps[0].tiling.exact
    assert json_tiling(tiled.maps[0].tiling)["exact"] is False  # stated in JSON too, not left out as a default
    assert np.nanmax(np.abs(decode(tiled.maps[0].scores) - decode(reference.maps[0].scores))) > 100 * TOLERANCE


def test_a_halo_no_canvas_holds_is_refused_and_an_image_within_the_tile_canvas_is_planned_on_demand(tiny_paths):
    pixels = image(617, 541)
    tight = ((96, 96),)  # less than the tiny net's exact halo (~95 px) each side
    refusing = Pipeline([tiny_paths[True]], settings=dataclasses.replace(SETTINGS, shape_buckets=tight,
                                                                        tile_canvas=(128, 128)))
    lenient = Pipeline([tiny_paths[True]], settings=dataclasses.replace(SETTINGS, shape_buckets=tight,
                                                                       strict_shapes=False))
    try:
        with pytest.raises(ScoringError, match="nor can it be tiled onto one or onto --tile-canvas 128x128: a tile "
                                               "of .* use tiles of at least"):
            refusing.score(request_of(pixels))
        answer = lenient.score(request_of(pixels))
        assert not answer.maps[0].HasField("tiling") and plan_shapes(lenient) == {(640, 544)}  # one pass
    finally:
        refusing.close()
        lenient.close()


def test_beyond_the_tile_canvas_an_image_is_tiled_onto_it_and_within_it_strict_shapes_pads_onto_it(tiny_paths):
    """The halo fits no bucket: the image is tiled onto --tile-canvas, the one shape made; under
    --strict-shapes an image that fits the tile canvas is padded onto it rather than planned on demand."""
    tight, tile = ((96, 96),), (320, 288)
    large, medium = image(617, 541), image(300, 250, seed=1)
    whole = Pipeline([tiny_paths[True]], settings=dataclasses.replace(SETTINGS, shape_buckets=((640, 544),)))
    tiled = Pipeline([tiny_paths[True]], settings=dataclasses.replace(SETTINGS, shape_buckets=tight, tile_canvas=tile))
    try:
        answer, reference = tiled.score(request_of(large)), whole.score(request_of(large))
        padded = tiled.score(request_of(medium))
        assert plan_shapes(tiled) == {tile}
    finally:
        whole.close()
        tiled.close()
    assert answer.maps[0].tiling.tiles >= 4 and answer.maps[0].tiling.exact
    assert_same_answer(answer, reference)
    assert not padded.maps[0].HasField("tiling")  # one pass, on the tile canvas: plan_shapes above holds no other


def test_a_strip_beyond_the_tile_canvas_is_tiled_along_its_length_only(tiny_paths):
    """A panorama's strip fits the tile canvas across: its tiles are cut to what one pass needs there."""
    tile, strip = (320, 288), image(200, 1200, seed=2)  # 224x1216 on one pass: more pixels than the tile canvas
    whole = Pipeline([tiny_paths[True]], settings=dataclasses.replace(SETTINGS, shape_buckets=((224, 1216),)))
    tiled = Pipeline([tiny_paths[True]], settings=dataclasses.replace(
        SETTINGS, shape_buckets=((96, 96),), tile_canvas=tile, strict_shapes=False))
    try:
        answer, reference = tiled.score(request_of(strip)), whole.score(request_of(strip))
        assert plan_shapes(tiled) == {(224, 288)}
    finally:
        whole.close()
        tiled.close()
    assert answer.maps[0].tiling.tiles >= 3
    assert_same_answer(answer, reference)


def test_the_default_model_is_tiled_to_its_one_pass_answer(default_model_path):
    # Receptive field 1043 px (an exact halo of 521 px each side): two tiles a side on a 1536-px canvas.
    pixels = np.asarray(Image.open(SAMPLES / "cat.jpg").convert("RGB").resize((1600, 1600)))
    fields = dict(output_stride=32, flip=True)
    small = Pipeline([default_model_path], settings=dataclasses.replace(SETTINGS, shape_buckets=((1536, 1536),)))
    whole = Pipeline([default_model_path], settings=dataclasses.replace(SETTINGS, shape_buckets=((1600, 1600),)))
    try:
        tiled, reference = small.score(request_of(pixels, **fields)), whole.score(request_of(pixels, **fields))
        assert plan_shapes(small) == {(1536, 1536)}
    finally:
        small.close()
        whole.close()
    assert tiled.maps[0].tiling.tiles >= 4 and tiled.maps[0].tiling.exact
    assert tiled.maps[0].tiling.halo_px == 521
    assert_same_answer(tiled, reference)


def test_over_grpc_kserve_and_http_the_tiled_answer_is_the_one_pass_s_and_says_so(kit, tiny_paths):
    pixels = image(617, 541, seed=3)
    encoded = io.BytesIO()
    Image.fromarray(pixels).save(encoded, format="PNG")
    fields = dict(SCHEMES["grid"], flip=True)
    whole_bucket = one_pass_bucket(pixels, native_stride=32, output_stride=16, shift=SHIFT_GRID, multiple=32)
    path = tiny_paths[True]
    options = dict(strict_shapes=True, http_port=0)
    with kit.serving([path], shape_buckets=SMALL, **options) as (server, _port, stub), \
            kit.serving([path], shape_buckets=(whole_bucket,), strict_shapes=True) as (_other, _p, reference_stub):
        tiled = stub.Score(request_of(pixels, **fields))
        assert_same_answer(tiled, reference_stub.Score(request_of(pixels, **fields)))
        stated = json_tiling(tiled.maps[0].tiling)
        assert stated["exact"] and stated["tiles"] >= 4
        record = result_from_response(tiled).to_record()  # the Python API, and the batch CLI's results.jsonl
        assert record["maps"][0]["tiling"] == stated
        name = stub.ListModels(scoring_pb2.ListModelsRequest()).models[0].name

        base = f"http://127.0.0.1:{server.http.port}"
        query = "scales=541&stride=16&shift=grid&flip=true&maps=true"
        answer = httpx.post(f"{base}/v1/models/{name}/score?{query}",
                            files={"image": ("a.png", encoded.getvalue())}, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["maps"][0]["tiling"] == stated

        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http.port}", network_timeout=60)
        image_input = httpclient.InferInput("IMAGE", [1], "BYTES")
        image_input.set_data_from_numpy(np.array([encoded.getvalue()], dtype=np.object_))
        result = client.infer(name, [image_input], parameters={"scales": "541", "stride": 16, "shift": "grid",
                                                               "flip": True})
        assert json.loads(result.get_response()["parameters"]["maps"])[0]["tiling"] == stated


def json_tiling(message: scoring_pb2.Tiling) -> dict:
    from google.protobuf import json_format

    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def test_mixed_traffic_from_224_to_8000_px_runs_only_the_configured_plan_shapes(tiny_paths):
    """Every plan any request makes, tiled or not, is one of the buckets' shapes (docs/design.md: one session per
    shape)."""
    configured = ((320, 320), (320, 416), (416, 320))
    settings = dataclasses.replace(SETTINGS, shape_buckets=configured, max_batch=4, max_scale=8000,
                                   max_resized_pixels=8000 * 1200, max_image_pixels=10**8, queue_depth=4096,
                                   max_queue_ms=600_000)  # the large requests' tiles are a long queue
    pipeline = Pipeline([tiny_paths[True]], settings=settings)
    made: list[PlanKey] = []
    plans = pipeline.engine.served(pipeline._model("").name).plans
    get = plans.get

    def recorded(key: PlanKey, **options):
        made.append(key)
        return get(key, **options)

    plans.get = recorded
    sizes = [(224, 224), (300, 500), (480, 640), (1200, 900), (2000, 3000), (1200, 8000), (8000, 700)]
    requests = [request_of(image(*size, seed=index), return_maps=False, flip=index % 2 == 1,
                           **SCHEMES[sorted(SCHEMES)[index % 3]])
                for index, size in enumerate(sizes)]
    try:
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(pipeline.score, requests))
    finally:
        pipeline.close()
    assert [answer.image_width for answer in answers] == [width for _height, width in sizes]
    assert sum(answer.maps[0].HasField("tiling") for answer in answers) >= 4  # the large ones were tiled
    assert made and {(key.height, key.width) for key in made} <= set(configured)
    assert {key.batch for key in made} <= {1, 2, 4}


def test_admission_counts_a_tiled_request_s_tiles_in_its_queue_places_host_bytes_and_response_size(tiny_paths):
    from server.scoring import admission, footprint

    pixels, fields = image(617, 541), dict(SCHEMES["grid"], flip=True, cell_top_k=2)
    pipeline = Pipeline([tiny_paths[True]], settings=dataclasses.replace(SETTINGS, shape_buckets=SMALL))
    model = pipeline._model("")
    try:
        with admission.admit(request_of(pixels, **fields), model, engine=pipeline.engine, deadline=None) as ticket:
            job = ticket.jobs[0]
            items = 2 * len(job.tiles)  # each tile and its mirror
            assert job.tiling is not None and ticket.places.items == items and pipeline.engine.served(model.name).batcher.depth() == items
            canvases = items * job.canvas[0] * job.canvas[1] * 3
            assert ticket.host.inputs >= canvases and ticket.host.resized >= 617 * 541 * 3
            expected = footprint.response_bytes(ticket.request, model, ticket.jobs)
        assert pipeline.engine.served(model.name).batcher.depth() == 0 and model.host_budget.in_flight_bytes() == 0  # given back
        answer = pipeline.score(request_of(pixels, **fields))
        assert answer.ByteSize() <= expected
    finally:
        pipeline.close()
    small_queue = Pipeline([tiny_paths[True]], settings=dataclasses.replace(SETTINGS, shape_buckets=SMALL,
                                                                           queue_depth=items - 1))
    try:
        with pytest.raises(ScoringError, match=rf"this request is {items} items .* --queue-depth\): it never fits") \
                as caught:
            small_queue.score(request_of(pixels, **fields))
        assert caught.value.refusal.name == "RESOURCE_EXHAUSTED" and caught.value.retry_after_seconds is None
    finally:
        small_queue.close()
    tight = Pipeline([tiny_paths[True]], settings=dataclasses.replace(SETTINGS, shape_buckets=SMALL,
                                                                     max_request_host_bytes=ticket.host.total - 1))
    try:
        with pytest.raises(ScoringError, match="--max-request-host-bytes"):
            tight.score(request_of(pixels, **fields))
    finally:
        tight.close()
