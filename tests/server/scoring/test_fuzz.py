"""Fuzzing a real server: request fields and mutated real JPEG/PNG bytes (samples/), Score and ScoreStream.

Whatever arrives, the answer is a response with finite numbers or a deliberate status: never UNKNOWN
or INTERNAL (a bug's traceback); the server stays up, and its memory does not grow with the traffic.
Examples are derandomized, so a failure reproduces run after run.
"""

import gc
import io
import math
import pathlib

import grpc
import numpy as np
import onnx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from clients.api.results import decode_tensor
from protos import scoring_pb2
from tests.fuzzing import mutate

SAMPLES = pathlib.Path(__file__).resolve().parents[3] / "samples"
BUGS = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
EXAMPLES = 300
MEMORY_GROWTH_LIMIT = 256 * 2**20  # bytes of RSS the whole run may add (decoder and arena churn, no leak)


def seeds() -> list[bytes]:
    """The samples' own JPEG bytes, and a PNG and a progressive JPEG of each, made small."""
    found = []
    for path in sorted(SAMPLES.glob("*.jpg")):
        found.append(path.read_bytes())
        image = Image.open(path).convert("RGB")
        image.thumbnail((96, 96))
        for fmt, options in (("PNG", {}), ("JPEG", {"progressive": True, "quality": 70})):
            buffer = io.BytesIO()
            image.save(buffer, format=fmt, **options)
            found.append(buffer.getvalue())
    return found


SEEDS = seeds()


@st.composite
def mutated(draw) -> bytes:
    """A seed with some bytes overwritten, a slice cut out or repeated, or its tail cut off."""
    return mutate(draw, bytearray(draw(st.sampled_from(SEEDS))), draw(st.integers(0, 4)))


def raw_images():
    consistent = st.tuples(st.integers(1, 96), st.integers(1, 96), st.sampled_from([1, 3, 4])).map(
        lambda hwc: scoring_pb2.RawImage(height=hwc[0], width=hwc[1], channels=hwc[2], data=bytes((7 * i) % 256 for i in range(hwc[0] * hwc[1] * hwc[2])))
    )
    arbitrary = st.builds(
        scoring_pb2.RawImage,
        height=st.integers(-2, 200), width=st.integers(-2, 200), channels=st.integers(-1, 5), data=st.binary(max_size=64),
    )
    return st.one_of(consistent, arbitrary)


# Per field: (valid values, anything). A request breaks at most one field, so most get far enough
# to be scored, and each broken field is met on its own.
FIELDS = {
    "model": (st.sampled_from(["", "fuzz"]), st.sampled_from(["absent", "fuzz\x00", "é" * 3])),
    "scales": (st.lists(st.sampled_from([32, 64, 96, 160]), max_size=2, unique=True),
               st.lists(st.one_of(st.integers(-40, 600), st.just(2**31 - 1)), max_size=9)),
    "stride_shift": (st.sampled_from([(0, 0), (32, 1), (16, 0), (16, 2), (16, 3)]),  # the enum's values and beyond
                     st.tuples(st.sampled_from([-16, 0, 1, 8, 16, 32, 64, 2**31 - 1]), st.integers(-2, 100))),
    "map_dtype": (st.integers(0, 2), st.integers(-1, 9)),
    "classes": (st.lists(st.integers(0, 9), max_size=3, unique=True), st.lists(st.integers(-3, 40), max_size=5)),
    "cell_top_k": (st.integers(0, 10), st.integers(-3, 40)),
    "top_k": (st.integers(0, 10), st.integers(-3, 40)),
}


@st.composite
def requests(draw) -> scoring_pb2.ScoreRequest:
    broken = draw(st.sampled_from([None, None, None, *FIELDS]))
    fields = {name: draw(anything if name == broken else valid) for name, (valid, anything) in FIELDS.items()}
    fields["output_stride"], fields["shift"] = fields.pop("stride_shift")
    request = scoring_pb2.ScoreRequest(flip=draw(st.booleans()), return_maps=draw(st.booleans()),
                                       request_id=draw(st.text(max_size=8)), **fields)
    image = draw(st.sampled_from(["encoded", "encoded", "raw", "none"]))
    if image == "encoded":
        request.encoded = draw(mutated())
    elif image == "raw":
        request.raw.CopyFrom(draw(raw_images()))
    return request


def check(response: scoring_pb2.ScoreResponse, request: scoring_pb2.ScoreRequest) -> None:
    """Finite or an error: the top-k, and the maps save the cells a diagonal shift
    leaves unscored, NaN by contract."""
    assert all(math.isfinite(label.probability) for label in response.top_k), response.top_k
    holes = request.shift == scoring_pb2.SHIFT_DIAGONAL
    for scale_map in response.maps:
        for tensor in (scale_map.scores, scale_map.cell_top_k_scores):
            values = decode_tensor(tensor)
            if values is not None:
                assert np.isfinite(values[~np.isnan(values)] if holes else values).all(), (scale_map.scale, request)


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    """One real server for every example: a tiny model, limits small enough that no example is slow."""
    import dataclasses

    from tests.tiny_models import patch_net

    from server.main import create_server
    from server.settings import Settings

    path = tmp_path_factory.mktemp("fuzz") / "fuzz.onnx"
    onnx.save(patch_net(classes=10, name="fuzz"), path)
    options = dict(warm_up=False, intra_op_threads=1, max_scale=512, max_image_pixels=4_000_000,
                   max_resized_pixels=1_000_000, max_message_bytes=1 << 20)
    server, port = create_server([str(path)], settings=dataclasses.replace(Settings(), **options))
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    from protos import scoring_pb2_grpc

    yield server, channel, scoring_pb2_grpc.DenseScoringStub(channel)
    channel.close()
    server.stop(0).wait(10)


def test_fuzzed_requests_get_answers_or_deliberate_statuses(fuzzed):
    server, channel, stub = fuzzed
    codes: dict[str, int] = {}

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(batch=st.lists(requests(), min_size=1, max_size=3), streamed=st.booleans())
    def exchange(batch, streamed):
        try:
            if streamed:
                for response, request in zip(stub.ScoreStream(iter(batch), timeout=30), batch):  # in order
                    check(response, request)
            else:
                check(stub.Score(batch[0], timeout=30), batch[0])
            codes["OK"] = codes.get("OK", 0) + 1
        except grpc.RpcError as error:
            assert error.code() not in BUGS, (error.code(), error.details(), batch)
            codes[error.code().name] = codes.get(error.code().name, 0) + 1

    exchange()  # a first pass warms the decoders and arenas, so the memory check sees growth, not set-up
    gc.collect()
    before = resident_bytes()
    exchange()
    gc.collect()
    assert resident_bytes() - before < MEMORY_GROWTH_LIMIT
    assert codes.get("OK") and codes.get("INVALID_ARGUMENT"), codes  # the fuzz reached both sides
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    pixels = np.zeros((64, 64, 3), dtype=np.uint8)
    raw = scoring_pb2.RawImage(data=pixels.tobytes(), height=64, width=64, channels=3)
    assert stub.Score(scoring_pb2.ScoreRequest(raw=raw), timeout=30).top_k
    assert server.front.active == 0
