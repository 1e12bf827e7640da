"""Fuzzing one real server over both transports: gRPC (Score, KServe v2 ModelInfer) and HTTP (/v1 score with
its query and multipart form, KServe v2 REST with JSON and binary bodies).

Each example is a request to one route, built from real encoded images (every format the server takes, made
by their encoders from samples/cat.jpg, then mutated: bytes overwritten, cut, repeated, truncated) and field
values from the valid to the absurd (int32 and int64 edges, 10**20, NaN and infinities, text where numbers go,
lists where text goes, duplicated and unknown fields and parts, JSON nested beyond its bound).

It fails on an INTERNAL or UNKNOWN status or an HTTP 5xx, on a non-finite number in an OK answer (save the
map cells a diagonal shift leaves unscored, NaN by contract), on a traceback or an error in the server's log
(or an exception escaping a thread), and on a server that stops answering (every call has a timeout, and a
health check and a valid request on each transport follow). Examples are derandomized (seeded), and their
number bounds the run time: about 10 s for the four routes on 2 cores.
"""

import base64
import io
import json
import logging
import math
import pathlib
import threading

import grpc
import httpx
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

SAMPLE = pathlib.Path(__file__).resolve().parents[3] / "samples" / "cat.jpg"
EXAMPLES = 150  # per route: four routes
CALL_SECONDS = 30  # a call unanswered this long is a server that stopped answering
# A bug's statuses, and DEADLINE_EXCEEDED: no example asks for a deadline shorter than CALL_SECONDS, so it means
# a call the server stopped answering (over HTTP a 504 is a 5xx, and the client's own timeout raises).
BUGS = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED}
MODEL = "fuzz"


def seeds() -> list[bytes]:
    """samples/cat.jpg itself, and a small copy in every format the server takes, an animated GIF among them."""
    import pillow_heif

    pillow_heif.register_heif_opener()
    photo = Image.open(SAMPLE).convert("RGB")
    small = photo.resize((96, 64))
    found = [SAMPLE.read_bytes()]
    for fmt, options in (("JPEG", {"quality": 80}), ("PNG", {}), ("WEBP", {}), ("BMP", {}), ("TIFF", {}),
                         ("GIF", {"save_all": True, "append_images": [small.rotate(90)]}), ("HEIF", {}), ("AVIF", {})):
        buffer = io.BytesIO()
        small.save(buffer, format=fmt, **options)
        found.append(buffer.getvalue())
    return found


SEEDS = seeds()
INT32 = 2**31
WILD_INTS = [-(2**63), -INT32 - 1, -INT32, -16, -1, 0, 1, 7, 16, 32, 64, 96, 5000, INT32 - 1, INT32, 2**63, 10**20]
VALID = {"scales": st.sampled_from(["64", "96", "64,96", ""]), "stride": st.sampled_from([0, 16, 32]),
         "shift": st.sampled_from(["auto", "none", "grid", "diagonal", "atrous"]), "flip": st.booleans(),
         "top_k": st.integers(0, 12), "cell_top_k": st.integers(0, 3), "classes": st.sampled_from(["", "1", "2,9"]),
         "map_dtype": st.sampled_from(["float32", "float16"])}
WILD_TEXT = st.one_of(st.sampled_from(["nan", "inf", "-inf", "1e3", "", " ", "0x10", "５", "٣", "1,,2", "[]", "\x00",
                                       "GRID", "true", "yes", "-0"]),
                      st.text(max_size=8), st.sampled_from(WILD_INTS).map(str))
WILD_JSON = st.one_of(st.sampled_from(WILD_INTS), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                      st.none(), WILD_TEXT, st.lists(st.integers(-3, 3), max_size=3), st.just({"a": [1]}))


@st.composite
def image_bytes(draw, *, mutated: bool = True) -> bytes:
    """A seed, `mutated` with some bytes overwritten, a slice cut out or repeated, or its tail cut off."""
    return mutate(draw, bytearray(draw(st.sampled_from(SEEDS))), draw(st.sampled_from([1, 2, 4])) if mutated else 0)


@st.composite
def options(draw, wild, *, broken: bool = True) -> dict:
    """The request's options by KServe v2 parameter name, each valid or absent but, when `broken`, one drawn by
    `wild` or an unknown name: so most requests get far enough to be scored, and each broken field is met on
    its own."""
    spoilt = draw(st.sampled_from([*VALID, "unknown"])) if broken else None
    chosen = {}
    for name, valid in VALID.items():
        if name == spoilt:
            chosen[name] = draw(wild)
        elif draw(st.booleans()):
            chosen[name] = draw(valid)
    if spoilt == "unknown":
        chosen[draw(st.sampled_from(["scale", "topk", "bogus"]))] = 1
    return chosen


def spoilt(draw, *parts: str) -> str | None:
    """Which part of a request is broken: none as often as any one of them."""
    return draw(st.sampled_from([None] * len(parts) + list(parts)))


def finite(values: np.ndarray, *, holes: bool) -> bool:
    return bool(np.isfinite(values[~np.isnan(values)] if holes else values).all())


def check_score_response(response: scoring_pb2.ScoreResponse, *, holes: bool) -> None:
    assert all(math.isfinite(label.probability) for label in response.top_k), response.top_k
    for scale_map in response.maps:
        for tensor in (scale_map.scores, scale_map.cell_top_k_scores):
            values = decode_tensor(tensor)
            if values is not None:
                assert finite(values, holes=holes), scale_map.scale


class LogFailures(logging.Handler):
    """Every record with a traceback or at ERROR and above, from any logger of the process."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.failures: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or record.levelno >= logging.ERROR or "Traceback" in record.getMessage():
            self.failures.append(f"{record.name}: {record.getMessage()}")


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    """One real server with both ports for every example: a tiny model, limits small enough that none is slow;
    its log, and exceptions escaping its threads, watched throughout."""
    import dataclasses

    from protos import scoring_pb2_grpc
    from server.main import create_server
    from server.settings import Settings
    from tests.tiny_models import patch_net

    path = tmp_path_factory.mktemp("fuzz") / "fuzz.onnx"
    onnx.save(patch_net(classes=10, name=MODEL), path)
    watcher = LogFailures()
    root = logging.getLogger()
    root.addHandler(watcher)
    escaped: list[str] = []
    previous_hook = threading.excepthook
    threading.excepthook = lambda hooked: escaped.append(f"{hooked.thread}: {hooked.exc_type.__name__}: "
                                                         f"{hooked.exc_value}")
    options = dict(warm_up=False, intra_op_threads=1, max_scale=512, max_image_pixels=4_000_000,
                   max_resized_pixels=1_000_000, max_message_bytes=1 << 20, http_port=0)
    server, port = create_server([str(path)], settings=dataclasses.replace(Settings(), **options))
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    http = httpx.Client(base_url=f"http://127.0.0.1:{server.http.port}", timeout=CALL_SECONDS)
    try:
        yield server, channel, scoring_pb2_grpc.DenseScoringStub(channel), http, watcher.failures, escaped
    finally:
        http.close()
        channel.close()
        server.stop(0).wait(10)
        threading.excepthook = previous_hook
        root.removeHandler(watcher)


# --- the routes: each takes one drawn example and checks its answer ------------------------------------
def grpc_score(stub, draw) -> str:
    """Score over gRPC: the ScoreRequest's own fields, within the int32s the client's protobuf can send."""
    int32 = st.sampled_from([value for value in WILD_INTS if -INT32 <= value < INT32])
    fields = {  # (valid, anything)
        "model": (st.sampled_from(["", MODEL]), st.sampled_from(["absent", "fuzz\x00", "é" * 3])),
        "scales": (st.lists(st.sampled_from([64, 96, 160]), max_size=2, unique=True), st.lists(int32, max_size=9)),
        "output_stride": (st.sampled_from([0, 16, 32]), int32),
        "shift": (st.integers(0, 4), st.integers(-1, 100)),
        "map_dtype": (st.integers(0, 2), st.integers(-1, 9)),
        "classes": (st.lists(st.integers(0, 9), max_size=3, unique=True), st.lists(int32, max_size=4)),
        "cell_top_k": (st.integers(0, 3), int32),
        "top_k": (st.integers(0, 9), int32),
    }
    broken = spoilt(draw, "image", *fields)
    request = scoring_pb2.ScoreRequest(flip=draw(st.booleans()), return_maps=draw(st.booleans()), **{
        name: draw(anything if name == broken else valid) for name, (valid, anything) in fields.items()})
    if broken != "image":
        request.encoded = draw(image_bytes(mutated=False))
    elif draw(st.booleans()):
        request.encoded = draw(image_bytes())
    else:
        side = st.integers(-2, 96) | int32
        request.raw.CopyFrom(scoring_pb2.RawImage(height=draw(side), width=draw(side), channels=draw(st.integers(-1, 5)),
                                                  data=draw(st.sampled_from([bytes(64 * 64 * 3), b"", bytes(7)]))))
    try:
        check_score_response(stub.Score(request, timeout=CALL_SECONDS), holes=request.shift == scoring_pb2.SHIFT_DIAGONAL)
        return "OK"
    except grpc.RpcError as error:
        assert error.code() not in BUGS, (error.code(), error.details(), request)
        return error.code().name


def kserve_grpc(kserve, draw) -> str:
    """KServe v2 ModelInfer over gRPC: int64 and double parameters, shapes and contents of any size; one part of
    the request broken at a time, at times."""
    from tritonclient.grpc import service_pb2

    broken = spoilt(draw, "model", "version", "options", "shape", "datatype", "contents", "outputs", "image")

    def pick(part: str, valid, anything):
        return draw(anything if part == broken else valid)

    request = service_pb2.ModelInferRequest(model_name=pick("model", st.just(MODEL), st.sampled_from(["absent", ""])),
                                            model_version=pick("version", st.sampled_from(["", "1"]),
                                                               st.sampled_from(["2", "-1", "x"])))
    wild = st.sampled_from(WILD_INTS) | st.floats() | WILD_TEXT | st.booleans()
    for name, value in draw(options(wild, broken=broken == "options")).items():
        parameter = request.parameters[name]
        if isinstance(value, bool):
            parameter.bool_param = value
        elif isinstance(value, int):
            if -(2**63) <= value < 2**63:
                parameter.int64_param = value
            else:
                parameter.string_param = str(value)
        elif isinstance(value, float):
            parameter.double_param = value
        else:
            parameter.string_param = value
    wild_shape = st.lists(st.sampled_from([-1, 0, 1, 3, 8, 2**40, 2**62]), min_size=0, max_size=4)
    if draw(st.booleans()):
        tensor = request.inputs.add(name="IMAGE", datatype=pick("datatype", st.just("BYTES"), st.just("UINT8")),
                                    shape=pick("shape", st.just([1]), wild_shape))
        encoded = draw(image_bytes(mutated=broken == "image"))
        if draw(st.booleans()):
            tensor.contents.bytes_contents.append(encoded)
        else:
            prefix = pick("contents", st.just(len(encoded)), st.sampled_from([0, len(encoded) + 9, 2**32 - 1]))
            request.raw_input_contents.append(prefix.to_bytes(4, "little") + encoded)
    else:
        tensor = request.inputs.add(name="PIXELS", datatype=pick("datatype", st.just("UINT8"), st.just("FP32")),
                                    shape=pick("shape", st.just([8, 8, 3]), wild_shape))
        tensor.contents.uint_contents.extend(pick("contents", st.just([7] * 192), st.sampled_from([[300] * 192,
                                                                                                   [1, 2]])))
    for name in pick("outputs", st.lists(st.sampled_from(["TOP_K_PROBABILITIES", "SCORES_64"]), max_size=1),
                     st.lists(st.sampled_from(["SCORES_x", "CELL_TOP_K_SCORES_64", "SCORES_99999999999"]), min_size=1,
                              max_size=2)):
        request.outputs.add(name=name)
    try:
        response = kserve.ModelInfer(request, timeout=CALL_SECONDS)
    except grpc.RpcError as error:
        assert error.code() not in BUGS, (error.code(), error.details(), request)
        return error.code().name
    holes = request.parameters["shift"].string_param == "diagonal"
    for output, raw in zip(response.outputs, response.raw_output_contents):
        if output.datatype in ("FP32", "FP16"):
            values = np.frombuffer(raw, np.float32 if output.datatype == "FP32" else np.float16)
            assert finite(values, holes=holes and output.name.startswith(("SCORES_", "CELL_"))), output.name
    return "OK"


def query_value(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def http_v1(http: httpx.Client, draw) -> str:
    """POST /v1/models/NAME/score: any query, the image as the multipart field `image` (or several parts, or
    another name), or as the body."""
    broken = spoilt(draw, "options", "maps", "timeout", "form", "model", "image")
    query = {name: query_value(value) for name, value in draw(options(WILD_TEXT, broken=broken == "options")).items()}
    if draw(st.booleans()):
        query["maps"] = draw(st.sampled_from(["maybe", "2"] if broken == "maps" else ["true", "false"]))
    if broken == "timeout" or draw(st.booleans()):
        query["timeout_ms"] = draw(st.sampled_from(["nan", "inf", "-1", "0", "1e300"] if broken == "timeout"
                                                   else ["30000", "0.5e5"]))
    image = draw(image_bytes(mutated=broken == "image"))
    form = draw(st.sampled_from(["two images", "other name", "extra fields", "malformed"] if broken == "form"
                                else ["image", "body"]))
    files: list = [("image", ("photo", image))]
    data = None
    if form == "two images":
        files.append(("image", ("again", image)))
    elif form == "other name":
        files = [("photo", ("photo", image))]
    elif form == "extra fields":
        data = {f"note{index}": "x" * draw(st.integers(0, 40)) for index in range(draw(st.integers(1, 12)))}
    url = f"/v1/models/{'absent' if broken == 'model' else MODEL}/score"
    if form == "body":
        answer = http.post(url, params=query, content=image, headers={"Content-Type": "image/jpeg"})
    elif form == "malformed":
        boundary = draw(st.sampled_from([b"x", b"", b"\xe9"]))
        answer = http.post(url, params=query, content=b"--x\r\n" + image[:64], headers={
            "Content-Type": b"multipart/form-data; boundary=" + boundary})
    else:
        answer = http.post(url, params=query, files=files, data=data)
    assert answer.status_code < 500, (answer.status_code, answer.text, query, form)
    if answer.status_code != 200:
        assert answer.json()["error"], answer.text
        return str(answer.status_code)
    body = answer.json()
    assert all(math.isfinite(label["probability"]) for label in body["top_k"]), body["top_k"]
    for scale_map in body.get("maps", []):
        for name in ("scores", "cell_top_k_scores"):
            tensor = scale_map.get(name)
            if tensor and tensor.get("data"):
                values = np.frombuffer(base64.b64decode(tensor["data"]), np.dtype(tensor["dtype"]).newbyteorder("<"))
                assert finite(values.astype(np.float32), holes=query.get("shift") == "diagonal"), name
    return "200"


def kserve_rest(http: httpx.Client, draw) -> str:
    """POST /v2/models/NAME/infer: JSON with the image as binary data or pixels as JSON, any parameters, and
    bodies that are not the protocol's (nested too deep, mutated, not JSON at all)."""
    broken = spoilt(draw, "options", "timeout", "input", "outputs", "model", "body", "image")
    parameters = draw(options(WILD_JSON, broken=broken == "options"))
    if broken == "timeout":
        parameters["timeout"] = draw(WILD_JSON)
    document: dict = {"parameters": parameters, "id": draw(st.text(max_size=4) | st.just("\ud800"))}
    binary = b""
    if draw(st.booleans()):
        image = draw(image_bytes(mutated=broken == "image"))
        binary = len(image).to_bytes(4, "little") + image
        bad = broken == "input"
        size = draw(st.sampled_from([0, len(binary) + 5, -1, 1e400] if bad else [len(binary)]))
        document["inputs"] = [{"name": "IMAGE", "datatype": "BYTES", "shape": draw(st.sampled_from(
            [[2**40], [], [-1, -1]] if bad else [[1]])), "parameters": {"binary_data_size": size}}]
    else:
        bad = broken == "input"
        height, width = draw(st.sampled_from([(2**40, 1), (0, 8)] if bad else [(8, 8)]))
        document["inputs"] = [{"name": "PIXELS", "datatype": "UINT8", "shape": [height, width, 3],
                               "data": draw(st.sampled_from([[1.5, "a"], [[1], [2, 3]]] if bad else
                                                            [[[[7, 8, 9]] * 8] * 8]))}]
    document["outputs"] = [{"name": name} for name in draw(st.lists(st.sampled_from(
        ["CELL_TOP_K_SCORES_64", "SCORES_99999999999999999999", "X"] if broken == "outputs" else
        ["TOP_K_PROBABILITIES", "TOP_K_LABELS", "SCORES_64"]), max_size=2))]
    model = "absent" if broken == "model" else MODEL
    header = json.dumps(document).encode()
    shape = draw(st.sampled_from(["deep", "mutated", "bad length"])) if broken == "body" else "as is"
    if shape == "deep":
        header = b'{"inputs": ' + b"[" * draw(st.sampled_from([40, 5000])) + b"]" * 5000 + b"}"
    elif shape == "mutated" and header:
        position = draw(st.integers(0, len(header) - 1))
        header = header[:position] + draw(st.binary(min_size=1, max_size=3)) + header[position + 3:]
    length = str(len(header)) if shape != "bad length" else draw(st.sampled_from(["-1", "x", "99999999999", "²"]))
    answer = http.post(f"/v2/models/{model}/infer", content=header + binary,
                       headers={"Inference-Header-Content-Length": length} if binary or shape == "bad length" else {})
    timeout = parameters.get("timeout")
    short = type(timeout) is int and 0 < timeout < CALL_SECONDS * 1_000_000  # microseconds: a 504 asked for
    assert answer.status_code < 500 or short and answer.status_code == 504, (answer.status_code, answer.text, document)
    if answer.status_code != 200:
        return str(answer.status_code)
    size = int(answer.headers.get("Inference-Header-Content-Length", len(answer.content)))
    body = json.loads(answer.content[:size])
    holes = parameters.get("shift") == "diagonal"
    for output in body["outputs"]:
        if output["datatype"] in ("FP32", "FP16") and "data" in output:
            values = np.array(output["data"], np.float64)
            assert finite(values, holes=holes and output["name"].startswith("SCORES_")), output["name"]
    return "200"


ROUTES = ("grpc_score", "kserve_grpc", "http_v1", "kserve_rest")


@pytest.mark.parametrize("route", ROUTES)
def test_fuzzed_calls_get_answers_or_deliberate_statuses(fuzzed, route):
    server, channel, stub, http, failures, escaped = fuzzed
    kserve = None
    if route == "kserve_grpc":
        pytest.importorskip("tritonclient.grpc", reason="KServe v2 over gRPC needs the `triton` extra")
        from tritonclient.grpc import service_pb2_grpc

        kserve = service_pb2_grpc.GRPCInferenceServiceStub(channel)  # the same port serves both services
    call = {"grpc_score": lambda draw: grpc_score(stub, draw), "kserve_grpc": lambda draw: kserve_grpc(kserve, draw),
            "http_v1": lambda draw: http_v1(http, draw), "kserve_rest": lambda draw: kserve_rest(http, draw)}[route]
    answers: dict[str, int] = {}

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.data())
    def exchange(data):
        answer = call(data.draw)
        answers[answer] = answers.get(answer, 0) + 1

    exchange()
    assert not failures, failures  # tracebacks or errors logged by the server
    assert not escaped, escaped
    assert len(answers) > 1 and ("OK" in answers or "200" in answers), answers  # the fuzz reached both sides
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=CALL_SECONDS)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    pixels = np.zeros((64, 64, 3), np.uint8)
    assert stub.Score(scoring_pb2.ScoreRequest(raw=scoring_pb2.RawImage(
        data=pixels.tobytes(), height=64, width=64, channels=3)), timeout=CALL_SECONDS).top_k
    assert http.post(f"/v1/models/{MODEL}/score", files={"image": ("a", SEEDS[2])}).status_code == 200
    assert server.front.active == 0
