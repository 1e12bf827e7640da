"""Values out of range and malformed bodies at every entrance, over real sockets: each is the caller's error
(INVALID_ARGUMENT / 400) naming the field, the value and its range, in the same words over gRPC and HTTP,
with no traceback in the log; and HTTP's accepted connections send without Nagle's delay."""

import io
import logging
import os
import socket

import grpc
import httpx
import numpy as np
import pytest
from PIL import Image

from protos import scoring_pb2

PIXELS = np.random.default_rng(42).integers(0, 256, (64, 64, 3), dtype=np.uint8)
INFER_PIXELS = {"inputs": [{"name": "PIXELS", "datatype": "UINT8", "shape": [1, 1, 3], "data": [1, 2, 3]}]}


def png(pixels: np.ndarray = PIXELS) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture
def log_without_tracebacks(caplog):
    """The server's log, checked after the test: no record with a traceback, nothing logged as an error."""
    caplog.set_level(logging.INFO)
    yield caplog
    failures = [record for record in caplog.records if record.exc_info or record.levelno >= logging.ERROR]
    assert not failures, [record.getMessage() for record in failures]


# Three values that must never be a 500, then their siblings: each (query or body, the words expected).
QUERIES = {
    "stride=99999999999999999999": "stride 99999999999999999999 is out of range: it takes 0..2147483647",
    "scales=99999999999": "scales 99999999999 is out of range: it takes 1..2147483647",
    "scales=64&classes=1,99999999999": "classes 99999999999 is out of range: it takes 0..2147483647",
    "scales=64&top_k=2147483648": "top_k 2147483648 is out of range: it takes 0..2147483647",
    "scales=64&cell_top_k=-1": "cell_top_k -1 is out of range: it takes 0..2147483647",
    "scales=64&timeout_ms=inf": "timeout_ms inf is out of range: it takes above 0, at most 2147483647",
    "scales=64&timeout_ms=nan": "timeout_ms nan is out of range",
    "scales=64&timeout_ms=1e300": "timeout_ms 1e+300 is out of range",
}


def test_http_query_values_out_of_range_are_400_naming_field_value_and_range(kit, tiny_model_path,
                                                                                log_without_tracebacks):
    with kit.serving([tiny_model_path], http_port=0) as (server, _port, _stub):
        url = f"http://127.0.0.1:{server.http.port}/v1/models/tiny/score"
        for query, words in QUERIES.items():
            answer = httpx.post(f"{url}?{query}", files={"image": ("a.png", png())})
            assert answer.status_code == 400 and answer.json()["code"] == "INVALID_ARGUMENT", (query, answer.text)
            assert words in answer.json()["error"], (query, answer.text)
        assert httpx.post(f"{url}?scales=64", files={"image": ("a.png", png())}).status_code == 200


BODIES = {
    "nested 5000 deep": (b"[" * 5000 + b"]" * 5000, "nested 5000 deep, beyond this server's limit of 32"),
    "stride beyond int32": ({**INFER_PIXELS, "parameters": {"stride": 2**40}}, "stride 1099511627776 is out of range"),
    "scales beyond int32": ({**INFER_PIXELS, "parameters": {"scales": "64,99999999999"}},
                            "scales 99999999999 is out of range"),
    "pixels' height beyond int32": ({"inputs": [{"name": "PIXELS", "datatype": "UINT8", "shape": [2**40, 1, 1],
                                                 "data": [1]}]}, "PIXELS's height 1099511627776 is out of range"),
    "pixels' channels": ({"inputs": [{"name": "PIXELS", "datatype": "UINT8", "shape": [1, 1, 2**40],
                                      "data": [1]}]}, "with C 1, 3 or 4"),
    "a shift that is a list": ({**INFER_PIXELS, "parameters": {"shift": []}}, "expected one of auto"),
    "timeout beyond gRPC's": ({**INFER_PIXELS, "parameters": {"timeout": 10**30}}, "timeout 10000000000"),
    "an id with a lone surrogate": (b'{"id": "\\ud800", "inputs": []}', "text UTF-8 can hold"),
    "a lone surrogate": (b'{"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": ["\\ud800"]}]}',
                         "not text UTF-8 can hold"),
}


@pytest.mark.parametrize("name", BODIES)
def test_kserve_rest_bodies_out_of_bounds_are_400(kit, tiny_model_path, log_without_tracebacks, name):
    body, words = BODIES[name]
    with kit.serving([tiny_model_path], http_port=0) as (server, _port, _stub):
        url = f"http://127.0.0.1:{server.http.port}/v2/models/tiny/infer"
        answer = httpx.post(url, content=body) if isinstance(body, bytes) else httpx.post(url, json=body)
        assert answer.status_code == 400 and words in answer.json()["error"], answer.text
        assert httpx.post(url, json=INFER_PIXELS).status_code == 200


def test_a_header_length_of_unicode_digits_is_400(kit, tiny_model_path, log_without_tracebacks):
    with kit.serving([tiny_model_path], http_port=0) as (server, _port, _stub):
        with socket.create_connection(("127.0.0.1", server.http.port)) as sock:
            sock.sendall(b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                         b"Inference-Header-Content-Length: \xb2\r\n\r\n{}")  # "²" in latin-1: a digit int() cannot read
            assert sock.recv(65536).startswith(b"HTTP/1.1 400 ")


def test_the_json_depth_bound_is_the_setting(kit, tiny_model_path, log_without_tracebacks):
    deep = {**INFER_PIXELS, "inputs": [{**INFER_PIXELS["inputs"][0], "shape": [1, 1, 3], "data": [[[1, 2, 3]]]}]}
    with kit.serving([tiny_model_path], http_port=0, http_max_json_depth=5) as (server, _port, _stub):
        url = f"http://127.0.0.1:{server.http.port}/v2/models/tiny/infer"
        answer = httpx.post(url, json=deep)
        assert answer.status_code == 400 and "nested 6 deep" in answer.json()["error"], answer.text
        assert "--http-max-json-depth" in answer.json()["error"]
        assert httpx.post(url, json=INFER_PIXELS).status_code == 200


def test_forms_with_two_images_or_too_many_parts_are_400(kit, tiny_model_path, log_without_tracebacks):
    with kit.serving([tiny_model_path], http_port=0, http_max_form_parts=3) as (server, _port, _stub):
        url = f"http://127.0.0.1:{server.http.port}/v1/models/tiny/score?scales=64"
        answer = httpx.post(url, files=[("image", ("a.png", png())), ("image", ("b.png", png()))])
        assert answer.status_code == 400 and "one file, in the field 'image'" in answer.json()["error"], answer.text
        answer = httpx.post(url, files={"image": ("a.png", png())}, data={f"note{i}": "x" for i in range(3)})
        assert answer.status_code == 400 and "--http-max-form-parts" in answer.json()["error"], answer.text
        answer = httpx.post(url, files={"image": ("a.png", png())}, data={"note": "x"})
        assert answer.status_code == 200, answer.text
        malformed = httpx.post(url, content=b"--x\r\nnot a part", headers={
            "Content-Type": "multipart/form-data; boundary=x"})
        assert malformed.status_code == 400, malformed.text


def test_headers_beyond_the_limit_are_refused_before_any_route(kit, tiny_model_path, log_without_tracebacks):
    with kit.serving([tiny_model_path], http_port=0, http_max_header_bytes=4096) as (server, _port, _stub):
        url = f"http://127.0.0.1:{server.http.port}/v2/health/ready"
        assert httpx.get(url, headers={"X-Note": "a" * 3000}).status_code == 200
        answer = httpx.get(url, headers={"X-Note": "a" * 5000})  # whole in one read: measured by the app
        assert answer.status_code == 431 and "--http-max-header-bytes" in answer.json()["error"], answer.text
        with socket.create_connection(("127.0.0.1", server.http.port)) as sock:  # a head still arriving: h11's bound
            sock.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n" + b"X-Note: a\r\n" * 500)  # no end
            assert sock.recv(65536).startswith(b"HTTP/1.1 400 ")
        assert httpx.get(url).status_code == 200


def test_grpc_and_http_refuse_a_value_in_the_same_words(kit, tiny_model_path, log_without_tracebacks):
    with kit.serving([tiny_model_path], http_port=0) as (server, _port, stub):
        url = f"http://127.0.0.1:{server.http.port}/v1/models/tiny/score"
        for field, value in (("top_k", -1), ("cell_top_k", -3)):
            with pytest.raises(grpc.RpcError) as refused:
                stub.Score(scoring_pb2.ScoreRequest(encoded=png(), scales=[64], **{field: value}))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            answer = httpx.post(f"{url}?scales=64&{field}={value}", files={"image": ("a.png", png())})
            assert answer.json()["error"] == refused.value.details()
        with pytest.raises(grpc.RpcError) as refused:  # the query names it `stride`, the field `output_stride`
            stub.Score(scoring_pb2.ScoreRequest(encoded=png(), scales=[64], output_stride=-16))
        answer = httpx.post(f"{url}?scales=64&stride=-16", files={"image": ("a.png", png())})
        assert answer.json()["error"] == refused.value.details().replace("output_stride", "stride")


def test_kserve_over_grpc_and_rest_refuse_int64_parameters_alike(kit, tiny_model_path, log_without_tracebacks):
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import InferenceServerException

    with kit.serving([tiny_model_path], http_port=0) as (server, port, _stub):
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        pixels = grpcclient.InferInput("PIXELS", [1, 1, 3], "UINT8")
        pixels.set_data_from_numpy(np.array([[[1, 2, 3]]], np.uint8))
        with pytest.raises(InferenceServerException) as refused:
            client.infer("tiny", [pixels], parameters={"stride": 2**40})
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
        answer = httpx.post(f"http://127.0.0.1:{server.http.port}/v2/models/tiny/infer",
                            json={**INFER_PIXELS, "parameters": {"stride": 2**40}})
        assert answer.status_code == 400 and answer.json()["error"] == refused.value.message()


def accepted_socket(client: socket.socket) -> socket.socket:
    """This process's accepted end of `client`'s connection (the server runs in the test's process)."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            candidate = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        try:
            if candidate.type == socket.SOCK_STREAM and candidate.getsockname() == client.getpeername() \
                    and candidate.getpeername() == client.getsockname():
                return candidate
        except OSError:
            pass
        candidate.close()
    raise AssertionError("no accepted socket for the client's connection")


def test_accepted_http_connections_have_nagle_off(kit, tiny_model_path):
    with kit.serving([tiny_model_path], http_port=0) as (server, _port, _stub):
        with socket.create_connection(("127.0.0.1", server.http.port)) as client:
            client.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            assert client.recv(65536).startswith(b"HTTP/1.1 200 ")  # accepted and answered
            with accepted_socket(client) as accepted:
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
