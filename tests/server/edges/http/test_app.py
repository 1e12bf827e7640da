"""The HTTP face on a real server over real sockets: tritonclient.http, curl, and the limits gRPC has.

Every answer is compared with `Score` on the same server's gRPC port; refusals are checked for
their status, message and metrics, and the server is checked to answer afterwards.
"""

import base64
import gzip
import http.client
import io
import json
import os
import select
import signal
import socket
import ssl
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from PIL import Image
from tritonclient.utils import InferenceServerException

from protos import scoring_pb2

RNG = np.random.default_rng(21)
PIXELS = RNG.integers(0, 256, (50, 75, 3), dtype=np.uint8)
CAT = os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "samples", "cat.jpg")


def png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def counted(server, method: str, code: str, model: str = "tiny") -> float | None:
    return server.metrics.registry.get_sample_value("scoremap_requests_total",
                                                    {"method": method, "code": code, "model": model})


def test_tritonclient_http_is_answered_as_score_answers(kit, layout, tiny_model_path):
    with kit.serving_in(layout)([tiny_model_path], http_port=0) as (server, _port, stub):
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http.port}")
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("tiny")
        assert not client.is_model_ready("absent")
        assert client.get_server_metadata()["name"] == "scoremap"
        assert [o["name"] for o in client.get_model_metadata("tiny")["outputs"]][:3] == [
            "TOP_K_INDICES", "TOP_K_PROBABILITIES", "TOP_K_LABELS"]
        assert client.get_model_config("tiny")["input"][0]["name"] == "IMAGE"

        image = httpclient.InferInput("IMAGE", [1], "BYTES")
        image.set_data_from_numpy(np.array([png(PIXELS)], dtype=np.object_))  # binary data, as by default
        result = client.infer("tiny", [image], parameters={"scales": "64,96", "flip": True, "top_k": 3,
                                                            "cell_top_k": 2})
        expected = stub.Score(scoring_pb2.ScoreRequest(encoded=png(PIXELS), scales=[64, 96], flip=True, top_k=3,
                                                       cell_top_k=2, return_maps=True))
        assert result.as_numpy("TOP_K_INDICES").tolist() == [label.index for label in expected.top_k]
        assert result.as_numpy("TOP_K_PROBABILITIES").tolist() == [label.probability for label in expected.top_k]
        assert [text.decode() for text in result.as_numpy("TOP_K_LABELS")] == [label.label for label in expected.top_k]
        for scale_map in expected.maps:
            for prefix, tensor in (("SCORES_", scale_map.scores), ("CELL_TOP_K_INDICES_", scale_map.cell_top_k_indices)):
                np.testing.assert_array_equal(result.as_numpy(f"{prefix}{scale_map.scale}").reshape(tensor.shape),
                                              kit.decode_tensor(tensor))
        expected_first = expected
        maps = json.loads(result.get_response()["parameters"]["maps"])
        assert [(m["scale"], m["height"], m["width"]) for m in maps] == [(m.scale, m.height, m.width)
                                                                         for m in expected.maps]

        # Pixels as JSON data, an output as JSON: the other half of the protocol's encodings.
        pixels = httpclient.InferInput("PIXELS", list(PIXELS.shape), "UINT8")
        pixels.set_data_from_numpy(PIXELS, binary_data=False)
        result = client.infer("tiny", [pixels], parameters={"scales": 64},
                              outputs=[httpclient.InferRequestedOutput("TOP_K_LABELS", binary_data=False)])
        expected = stub.Score(kit.raw_request(PIXELS, scales=[64]))
        assert [o["name"] for o in result.get_response()["outputs"]] == ["TOP_K_LABELS"]
        assert result.get_response()["outputs"][0]["data"] == [label.label for label in expected.top_k]  # JSON text

        compressed = client.infer("tiny", [image], parameters={"scales": "64,96", "flip": True, "top_k": 3},
                                  request_compression_algorithm="gzip", response_compression_algorithm="gzip")
        assert compressed.as_numpy("TOP_K_INDICES").tolist() == [label.index for label in expected_first.top_k]

        with pytest.raises(InferenceServerException) as refused:
            client.infer("tiny", [image], parameters={"scale": 64})
        assert refused.value.status() == "400" and "unknown parameter 'scale'" in refused.value.message()
        with pytest.raises(InferenceServerException) as refused:
            client.infer("absent", [image])
        assert refused.value.status() == "404" and "'absent'" in refused.value.message()
        assert counted(server, "http/ModelInfer", "OK") == 3
        assert counted(server, "http/ModelInfer", "INVALID_ARGUMENT") == 1


def test_refusals_have_score_s_messages_and_their_http_status(kit, layout, tiny_model_path):
    limit = 300_000
    with kit.serving_in(layout)([tiny_model_path], http_port=0, max_message_bytes=limit) as (server, _port, stub):
        base = f"http://127.0.0.1:{server.http.port}"

        def score(image: bytes, query: str = "scales=64", model: str = "tiny") -> httpx.Response:
            return httpx.post(f"{base}/v1/models/{model}/score?{query}", files={"image": ("photo", image)})

        answer = score(b"%PDF-1.7 is not an image")
        with pytest.raises(Exception) as grpc_refusal:
            stub.Score(scoring_pb2.ScoreRequest(encoded=b"%PDF-1.7 is not an image", scales=[64]))
        assert answer.status_code == 400 and answer.json() == {"error": grpc_refusal.value.details(),
                                                               "code": "INVALID_ARGUMENT"}
        assert score(png(PIXELS), model="absent").status_code == 404
        assert score(png(PIXELS), query="scales=64&stride=seven").status_code == 400
        declared = {parameter["name"] for parameter in httpx.get(f"{base}/openapi.json").json()["paths"][
            "/v1/models/{name}/score"]["post"]["parameters"] if parameter["in"] == "query"}
        for unknown in ("scale=512", "topk=2", "bogus=1"):  # refused, never answered at the default scale
            answer = score(png(PIXELS), query=f"scales=64&{unknown}")
            assert answer.status_code == 400 and answer.json()["code"] == "INVALID_ARGUMENT", answer.text
            message = answer.json()["error"]
            assert f"'{unknown.split('=')[0]}'" in message and all(name in message for name in declared), message
        missing = httpx.post(f"{base}/v1/models/tiny/score", files={"photo": ("a.png", png(PIXELS))})
        assert missing.status_code == 400 and "-F image=@photo.jpg" in missing.json()["error"]

        bomb = io.BytesIO()
        Image.new("1", (10_000, 10_000)).save(bomb, format="PNG")  # 100 megapixels in a few kilobytes
        assert len(bomb.getvalue()) < limit
        answer = score(bomb.getvalue())
        assert answer.status_code == 400 and "pixels" in answer.json()["error"], answer.text

        deflated = httpx.post(f"{base}/v2/models/tiny/infer", content=gzip.compress(b" " * 50 * limit),
                              headers={"Content-Encoding": "gzip"})  # 15 MB of spaces in 15 kB
        assert deflated.status_code == 413 and "once inflated" in deflated.json()["error"]

        # Declared too large: refused from the headers, before a byte of the body is sent.
        connection = http.client.HTTPConnection("127.0.0.1", server.http.port, timeout=30)
        connection.putrequest("POST", "/v1/models/tiny/score")
        connection.putheader("Content-Type", "image/png")
        connection.putheader("Content-Length", str(50 * limit))
        connection.endheaders()
        answer = connection.getresponse()
        assert answer.status == 413 and "--max-message-bytes" in json.loads(answer.read())["error"]
        connection.close()
        # Sent without a length: refused once the bytes received pass the limit, before the body ends.
        with socket.create_connection(("127.0.0.1", server.http.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/models/tiny/score HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            chunk, sent = b"\0" * 65536, 0
            while not select.select([sock], [], [], 0.01)[0]:  # until the server answers
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
                assert sent < 50 * limit, "no answer yet: the server is reading the body whole"
            assert sock.recv(65536).startswith(b"HTTP/1.1 413 ")

        good = score(png(PIXELS))
        assert good.status_code == 200 and good.json()["top_k"]  # still up
        assert counted(server, "http/Score", "INVALID_ARGUMENT") == 6  # 3 above, 3 unknown query options
        assert counted(server, "http/Score", "RESOURCE_EXHAUSTED") == 2


def hold(port: int) -> socket.socket:
    """A scoring call that has sent its headers and not its body: it holds its call slot."""
    held = socket.create_connection(("127.0.0.1", port))
    held.sendall(b"POST /v1/models/tiny/score HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                 b"Content-Length: 1000\r\n\r\n")
    return held


def test_a_flood_from_one_address_gets_429_and_the_server_stays_up(kit, tiny_model_path):
    with kit.serving([tiny_model_path], http_port=0, max_calls_per_peer=2) as (server, _port, stub):
        base = f"http://127.0.0.1:{server.http.port}"
        held = [hold(server.http.port) for _ in range(2)]
        while server.metrics.in_flight._value.get() < 2:
            time.sleep(0.01)
        refused = httpx.post(f"{base}/v1/models/tiny/score", files={"image": ("a.png", png(PIXELS))})
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
        assert "--max-calls-per-peer" in refused.json()["error"]
        assert httpx.get(f"{base}/v2/health/ready").status_code == 200  # probes are exempt, as gRPC's
        assert stub.ListModels(scoring_pb2.ListModelsRequest()).models  # gRPC is not held by HTTP's calls
        for sock in held:
            sock.close()
        while server.metrics.in_flight._value.get() > 0:
            time.sleep(0.01)
        assert httpx.post(f"{base}/v1/models/tiny/score", files={"image": ("a.png", png(PIXELS))}).status_code == 200
        assert counted(server, "http/Score", "RESOURCE_EXHAUSTED") == 1


def test_tls_and_token_are_the_grpc_port_s(kit, tiny_model_path, certificate, tmp_path):
    cert, key = certificate
    (tmp_path / "cert.pem").write_bytes(cert)
    with kit.serving([tiny_model_path], http_port=0, token="s3cret", tls=(cert, key)) as (server, _port, _stub):
        base = f"https://localhost:{server.http.port}"
        with httpx.Client(verify=ssl.create_default_context(cafile=tmp_path / "cert.pem")) as client:
            assert client.get(f"{base}/v2/health/ready").status_code == 200  # probes need no token
            refused = client.get(f"{base}/v1/models")
            assert refused.status_code == 401 and refused.headers["WWW-Authenticate"] == "Bearer"
            assert client.get(f"{base}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
            models = client.get(f"{base}/v1/models", headers={"Authorization": "Bearer s3cret"}).json()["models"]
            assert models[0]["name"] == "tiny" and models[0]["card"]["labels"]
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://localhost:{server.http.port}/v2/health/ready")  # no clear text on a TLS port
        assert counted(server, "http/ListModels", "UNAUTHENTICATED", model="") == 2


def test_openapi_and_the_viewer_are_served_without_a_cdn(kit, tiny_model_path):
    with kit.serving([tiny_model_path], http_port=0) as (server, _port, _stub):
        base = f"http://127.0.0.1:{server.http.port}"
        paths = httpx.get(f"{base}/openapi.json").json()["paths"]
        assert {"/v1/models", "/v1/models/{name}/score", "/v2/models/{name}/infer"} <= set(paths)
        responses = paths["/v1/models/{name}/score"]["post"]["responses"]
        assert {"200", "400", "401", "404", "413", "429", "503", "504"} == set(responses)  # as answered: no 422
        for path in ("/docs", "/no/such/route"):  # Swagger UI would load from a CDN
            answer = httpx.get(f"{base}{path}")
            assert answer.status_code == 404 and answer.json() == {
                "error": f"no route GET {path}: the routes are listed in /openapi.json", "code": "NOT_FOUND"}
        answer = httpx.delete(f"{base}/v1/models")
        assert answer.status_code == 405 and set(answer.json()) == {"error", "code"}
        page = httpx.get(f"{base}/")
        assert page.status_code == 200 and "viewer.js" in page.text
        for name in ("viewer.js", "viewer.css"):
            assert httpx.get(f"{base}/{name}").status_code == 200


def test_scoremap_serve_http_port_scores_with_the_documented_curl_command(default_model_path, tmp_path):
    """`curl -F image=@samples/cat.jpg 'http://HOST:PORT/v1/models/NAME/score?scales=384&stride=16&top_k=5'`."""
    log = tmp_path / "serve.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "server.main", f"default={default_model_path}", "--port", "0", "--http-port", "0",
         "--no-warm-up", "--intra-op-threads", "1"],
        stdout=subprocess.PIPE, stderr=log.open("w"), text=True, env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        grpc_line, http_line = process.stdout.readline(), process.stdout.readline()
        assert http_line.startswith("scoremap-serve HTTP on http://127.0.0.1:"), (grpc_line, http_line, log.read_text())
        base = http_line.split()[-1].rstrip("/")
        url = f"{base}/v1/models/default/score?scales=384&stride=16&top_k=5"
        answer = json.loads(subprocess.run(["curl", "-sS", "-F", f"image=@{CAT}", url], capture_output=True,
                                           check=True, timeout=120).stdout)
        assert len(answer["top_k"]) == 5 and "scores" not in answer["maps"][0]  # maps only with maps=true
        geometry = answer["maps"][0]["geometry"]  # in the original image's pixels
        assert answer["output_stride"] == 16 and geometry["stride_x"] * geometry["scale_factor"] == pytest.approx(16, rel=0.01)

        import grpc

        from protos import scoring_pb2_grpc

        with grpc.insecure_channel(grpc_line.split()[-1]) as channel:
            expected = scoring_pb2_grpc.DenseScoringStub(channel).Score(scoring_pb2.ScoreRequest(
                model="default", encoded=open(CAT, "rb").read(), scales=[384], output_stride=16, top_k=5,
                return_maps=True, map_dtype=scoring_pb2.FLOAT16))
        assert [(t["index"], t["label"]) for t in answer["top_k"]] == [(t.index, t.label) for t in expected.top_k]
        with_maps = json.loads(subprocess.run(["curl", "-sS", "-F", f"image=@{CAT}", url + "&maps=true"],
                                              capture_output=True, check=True, timeout=120).stdout)
        scores = with_maps["maps"][0]["scores"]
        assert scores["dtype"] == "float16" and base64.b64decode(scores["data"]) == expected.maps[0].scores.data
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{base}/v2/health/live")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_drain_lets_an_http_call_in_flight_finish_and_refuses_new_ones(tiny_model_path):
    import dataclasses

    from server.main import create_server
    from server.settings import Settings

    image = png(PIXELS)
    server, _port = create_server([tiny_model_path], settings=dataclasses.replace(
        Settings(), http_port=0, warm_up=False, intra_op_threads=1))
    port = server.http.port
    with socket.create_connection(("127.0.0.1", port), timeout=60) as held:
        held.sendall(b"POST /v1/models/tiny/score?scales=64 HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(image), image[:100]))
        while server.metrics.in_flight._value.get() < 1:
            time.sleep(0.01)
        stopped = server.stop(30)
        try:  # a new call: 503 while the port is still open (stop() set draining), then no connection at all
            assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 503
        except httpx.ConnectError:
            pass
        held.sendall(image[100:])  # the call in flight goes on during the grace period
        assert held.recv(65536).startswith(b"HTTP/1.1 200 ")
    assert stopped.wait(30)


def test_a_client_that_hangs_up_cancels_its_call(kit, layout, tiny_model_path):
    """The pipeline is held until the call's `cancelled` is set: only the client's hanging up sets it."""
    import threading

    with kit.serving_in(layout)([tiny_model_path], http_port=0) as (server, _port, _stub):
        score, entered, seen = server.pipeline.score, threading.Event(), []

        def held(request, *, deadline=None, cancelled=None):
            entered.set()
            seen.append(cancelled.wait(30))
            return score(request, deadline=deadline, cancelled=cancelled)

        server.pipeline.score = held
        image = png(PIXELS)
        with socket.create_connection(("127.0.0.1", server.http.port)) as sock:
            sock.sendall(b"POST /v1/models/tiny/score?scales=64 HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(image), image))
            assert entered.wait(30)
        while counted(server, "http/Score", "CANCELLED") is None:
            time.sleep(0.01)
        assert seen == [True]


SHORT_BINARY = b'{"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 9}}]}'


@pytest.mark.parametrize("body, headers, expected", [
    (b"not json", {}, "is not JSON"),
    (b'{"inputs": 3}', {}, "no `inputs` list"),
    (b'{"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": [7]}]}', {}, "BYTES data in JSON"),
    (b'{"inputs": [{"name": "PIXELS", "datatype": "UINT8", "shape": [1, 2, 1], "data": [[1], [2, 3]]}]}', {},
     "evenly nested"),
    (b'{"inputs": [{"name": "PIXELS", "datatype": "UINT8", "shape": [1, 1, 1], "data": [300]}]}', {}, "0..255"),
    (SHORT_BINARY + b"xy", {"Inference-Header-Content-Length": str(len(SHORT_BINARY))}, "binary bytes left"),
    (b'{}', {"Inference-Header-Content-Length": "99"}, "at most the body's"),
    (b'{"inputs": [], "parameters": {"timeout": "soon"}}', {}, "microseconds"),
])
def test_malformed_kserve_rest_requests_are_400_saying_what_is_wrong(kit, tiny_model_path, body, headers, expected):
    with kit.serving([tiny_model_path], http_port=0) as (server, _port, _stub):
        answer = httpx.post(f"http://127.0.0.1:{server.http.port}/v2/models/tiny/infer", content=body, headers=headers)
        assert answer.status_code == 400 and expected in answer.json()["error"], answer.text
        assert httpx.get(f"http://127.0.0.1:{server.http.port}/v2/health/ready").status_code == 200


def test_a_busy_http_port_is_refused_naming_the_flag(tiny_model_path):
    import dataclasses

    from server.errors import ScoringError
    from server.main import create_server
    from server.settings import Settings

    with socket.create_server(("127.0.0.1", 0)) as taken:
        busy = taken.getsockname()[1]
        with pytest.raises(ScoringError) as refused:
            create_server([tiny_model_path], settings=dataclasses.replace(Settings(), http_port=busy, warm_up=False))
        assert "--http-port" in refused.value.message
        result = subprocess.run([sys.executable, "-m", "server.main", tiny_model_path, "--port", "0", "--http-port",
                                 str(busy)], capture_output=True, text=True, timeout=120,
                                env={**os.environ, "PYTHONPATH": os.getcwd()})
        assert result.returncode == 2 and "--http-port" in result.stderr and "in use" in result.stderr, result.stderr


def test_a_body_that_stops_arriving_gets_408_and_gives_its_slot_back(kit, tiny_model_path):
    with kit.serving([tiny_model_path], http_port=0, max_calls_per_peer=1, http_body_idle_seconds=0.5) as (
            server, _port, _stub):
        with hold(server.http.port) as held:  # its Content-Length promises bytes that never come
            assert held.recv(65536).startswith(b"HTTP/1.1 408 ")
        answer = httpx.post(f"http://127.0.0.1:{server.http.port}/v1/models/tiny/score?scales=64",
                            files={"image": ("a.png", png(PIXELS))})
        assert answer.status_code == 200  # the slow sender's slot (one per peer here) was given back
        assert counted(server, "http/Score", "DEADLINE_EXCEEDED") == 1
