"""A request too large for a limit is refused naming what would fit, and what it names is admitted.

No size cap by default: the request's own host memory estimate and response size decide. Each refusal here
is checked both ways: the largest scale, class count or cell top-k it names is admitted, one step more is not.
"""

from __future__ import annotations

import dataclasses
import io
import re
import time

import onnx
import pytest
from PIL import Image

from protos import scoring_pb2
from server.errors import Refusal, ScoringError
from server.scoring import admission
from server.scoring.pipeline import Pipeline
from server.settings import Settings
from tests.tiny_models import patch_net

SETTINGS = Settings(warm_up=False, intra_op_threads=1)
MiB = 2**20


@pytest.fixture(scope="module")
def photo() -> bytes:
    """A 3008x4000 PNG of one colour: a phone photo's size, cheap to make (admission reads its header only)."""
    buffer = io.BytesIO()
    Image.new("RGB", (4000, 3008), (90, 120, 150)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("footprint") / "classes1000.onnx"
    onnx.save(patch_net(classes=1000), path)
    return str(path)


@pytest.fixture
def pipeline_of(model_path):
    made = []

    def make(**settings) -> Pipeline:
        made.append(Pipeline([model_path], settings=dataclasses.replace(SETTINGS, **settings)))
        return made[-1]

    yield make
    for pipeline in made:
        pipeline.close()


def admitted(pipeline: Pipeline, request: scoring_pb2.ScoreRequest) -> bool:
    """Whether admission takes the request (nothing is decoded or run); its refusal is raised unless it is about
    a size limit."""
    try:
        with admission.admit(request, pipeline._model(""), engine=pipeline.engine, deadline=None):
            return True
    except ScoringError as error:
        if error.refusal is not Refusal.RESOURCE_EXHAUSTED:
            raise
        return False


def refusal(pipeline: Pipeline, request: scoring_pb2.ScoreRequest) -> str:
    with pytest.raises(ScoringError) as caught:
        with admission.admit(request, pipeline._model(""), engine=pipeline.engine, deadline=None):
            pass
    assert caught.value.refusal is Refusal.RESOURCE_EXHAUSTED and caught.value.retry_after_seconds is None
    return caught.value.message


def named(pattern: str, message: str) -> int:
    found = re.search(pattern, message)
    assert found, f"{pattern!r} not in: {message}"
    return int(found.group(1))


def test_a_photo_at_its_own_size_is_admitted_by_default(pipeline_of, photo):
    """A phone photo at its own size: 4000x3008 at scale 3008, stride 32, float32 maps (here of 1000 classes)."""
    pipeline = pipeline_of()
    request = scoring_pb2.ScoreRequest(encoded=photo, scales=[3008], return_maps=True, top_k=5)
    with admission.admit(request, pipeline._model(""), engine=pipeline.engine, deadline=None) as ticket:
        assert ticket.jobs[0].resized == (3008, 4000) and ticket.host.total < 2**30
    assert admitted(pipeline, scoring_pb2.ScoreRequest(encoded=photo, scales=[4512], top_k=5))  # and beyond


def test_a_response_beyond_max_message_bytes_names_the_classes_dtype_and_cell_top_k_that_fit(pipeline_of, photo):
    pipeline = pipeline_of(max_message_bytes=16 * MiB)
    request = scoring_pb2.ScoreRequest(encoded=photo, scales=[3008], return_maps=True, top_k=5)  # 47 MB of maps
    message = refusal(pipeline, request)
    assert "--max-message-bytes" in message and "`scoremap-score --tiled`" in message
    for dtype, name in ((scoring_pb2.FLOAT32, "float32"), (scoring_pb2.FLOAT16, "float16")):
        most = named(rf"maps of at most (\d+) `classes` in {name}", message)
        fewer = scoring_pb2.ScoreRequest(encoded=photo, scales=[3008], return_maps=True, map_dtype=dtype, top_k=5)
        fewer.classes.extend(range(most))
        assert admitted(pipeline, fewer)
        fewer.classes.append(most)
        assert not admitted(pipeline, fewer)
    top = named(r"`cell_top_k` (\d+)\)", message)
    assert admitted(pipeline, scoring_pb2.ScoreRequest(encoded=photo, scales=[3008], cell_top_k=top))
    assert not admitted(pipeline, scoring_pb2.ScoreRequest(encoded=photo, scales=[3008], cell_top_k=top + 1))
    scale = named(r"a scale of at most (\d+) \(`scales`\)", message)
    assert admitted(pipeline, scoring_pb2.ScoreRequest(encoded=photo, scales=[scale], return_maps=True))
    assert not admitted(pipeline, scoring_pb2.ScoreRequest(encoded=photo, scales=[scale + 32], return_maps=True))


def test_host_memory_beyond_the_limit_names_the_scale_stride_flip_and_maps_that_fit(pipeline_of, photo):
    request = scoring_pb2.ScoreRequest(encoded=photo, scales=[3008], output_stride=16, flip=True,
                                       return_maps=True, map_dtype=scoring_pb2.FLOAT16, top_k=5)
    pipeline = pipeline_of(max_message_bytes=2**30 - 1)  # the response is no limit here
    with admission.admit(request, pipeline._model(""), engine=pipeline.engine, deadline=None) as ticket:
        needed = ticket.host.total
    pipeline = pipeline_of(max_message_bytes=2**30 - 1, max_request_host_bytes=int(needed * 0.8))
    message = refusal(pipeline, request)
    assert f"needs an estimated {needed} bytes of host memory" in message and "--max-request-host-bytes" in message
    assert f"a --max-request-host-bytes of at least {-(-needed // MiB)}MiB" in message
    scale = named(r"a scale of at most (\d+) \(`scales`\)", message)
    smaller = scoring_pb2.ScoreRequest()
    smaller.CopyFrom(request)
    smaller.scales[:] = [scale]
    assert admitted(pipeline, smaller)
    smaller.scales[:] = [scale + 32]
    assert not admitted(pipeline, smaller)
    assert "the model's own stride 32 (`stride`, output_stride)" in message
    assert "no flip (`flip` false)" in message and "(`return_maps` false" in message
    for change in (dict(output_stride=32), dict(flip=False), dict(return_maps=False)):
        changed = scoring_pb2.ScoreRequest()
        changed.CopyFrom(request)
        for field, value in change.items():
            setattr(changed, field, value)
        assert admitted(pipeline, changed), change


def test_a_huge_scale_is_refused_before_its_tiles_are_planned_naming_one_that_fits(pipeline_of, photo):
    pipeline = pipeline_of()
    started = time.monotonic()
    message = refusal(pipeline, scoring_pb2.ScoreRequest(encoded=photo, scales=[10**6]))
    assert time.monotonic() - started < 5  # a million-pixel side would have millions of tiles
    assert "whose RGB copy alone" in message and "--max-request-host-bytes" in message
    scale = named(r"a scale of at most (\d+) \(`scales`\)", message)
    assert admitted(pipeline, scoring_pb2.ScoreRequest(encoded=photo, scales=[scale]))


def test_a_request_of_more_tiles_than_the_queue_holds_names_the_scale_that_fits(pipeline_of, photo):
    pipeline = pipeline_of(queue_depth=3)  # the 3008x4000 image is 4 tiles of 2048x2048
    message = refusal(pipeline, scoring_pb2.ScoreRequest(encoded=photo, scales=[3008]))
    assert "more than the queue holds (3, --queue-depth): it never fits" in message
    scale = named(r"a scale of at most (\d+) \(`scales`\)", message)
    assert admitted(pipeline, scoring_pb2.ScoreRequest(encoded=photo, scales=[scale]))
    assert not admitted(pipeline, scoring_pb2.ScoreRequest(encoded=photo, scales=[scale + 32]))


@pytest.mark.parametrize("settings, words", [
    (dict(max_resized_pixels=4_000_000), "above the server's --max-resized-pixels 4000000: ask for a scale of at "
                                         "most 1728, or restart the server with a larger --max-resized-pixels or "
                                         "without it"),
    (dict(max_scale=2048), "scale 3008 is above the server's --max-scale 2048 (the target shorter side in pixels): "
                           "ask for a smaller scale, or restart the server with a larger --max-scale or without it"),
])
def test_an_explicit_size_cap_still_refuses_naming_itself(pipeline_of, photo, settings, words):
    pipeline = pipeline_of(**settings)
    with pytest.raises(ScoringError) as caught:
        pipeline.score(scoring_pb2.ScoreRequest(encoded=photo, scales=[3008]))
    assert caught.value.refusal is Refusal.INVALID_ARGUMENT and words in caught.value.message
    if "max_resized_pixels" in settings:
        assert admitted(pipeline, scoring_pb2.ScoreRequest(encoded=photo, scales=[1728]))
        with pytest.raises(ScoringError, match="--max-resized-pixels"):
            admitted(pipeline, scoring_pb2.ScoreRequest(encoded=photo, scales=[1760]))


def test_maps_of_a_few_classes_keep_only_those_on_the_host_and_are_the_full_maps_channels(tmp_path):
    """The host keeps a lattice's asked classes as it comes back (tile by tile), so `classes` lowers the host
    estimate too, not only the response: the answer is the full maps' channels, stitched the same."""
    import numpy as np

    path = tmp_path / "classes50.onnx"
    onnx.save(patch_net(classes=50), path)
    pipeline = Pipeline([str(path)], settings=dataclasses.replace(SETTINGS, tile_canvas=(256, 256)))
    pixels = np.random.default_rng(3).integers(0, 256, (600, 500, 3), dtype=np.uint8)
    fields = dict(raw=scoring_pb2.RawImage(data=pixels.tobytes(), height=600, width=500, channels=3), scales=[500],
                  return_maps=True, flip=True, output_stride=16)
    try:
        full = pipeline.score(scoring_pb2.ScoreRequest(**fields))
        few = pipeline.score(scoring_pb2.ScoreRequest(classes=[7, 3, 41], **fields))
        model = pipeline._model("")
        with admission.admit(scoring_pb2.ScoreRequest(**fields), model, engine=pipeline.engine, deadline=None) as whole, \
                admission.admit(scoring_pb2.ScoreRequest(classes=[7, 3, 41], **fields), model, engine=pipeline.engine, deadline=None) as part:
            assert part.host.maps < whole.host.maps / 4 and whole.jobs[0].tiling is not None
    finally:
        pipeline.close()

    def decoded(scale_map):
        tensor = scale_map.scores
        return np.frombuffer(tensor.data, dtype=np.float32).reshape(tuple(tensor.shape))

    assert full.maps[0].tiling.tiles > 1 and list(few.maps[0].classes) == [7, 3, 41]
    np.testing.assert_array_equal(decoded(few.maps[0]), decoded(full.maps[0])[[7, 3, 41]])
    assert [label.index for label in few.top_k] == [label.index for label in full.top_k]
