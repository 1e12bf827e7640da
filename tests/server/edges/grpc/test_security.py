"""TLS and the bearer token, on a real server."""

from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import onnx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.api.client import ScoremapClient
from clients.api.errors import ScoremapError
from clients.api.settings import TOKEN_ENV, env_token
from protos import scoring_pb2, scoring_pb2_grpc
from server.edges.grpc.interceptors import CallLimits, TokenInterceptor
from server.edges.refusal_pace import RefusalPacer
from server.main import create_server, read_token
from server.metrics import Metrics
from server.settings import Settings
from tests.tiny_models import patch_net

PIXELS = np.zeros((32, 32, 3), dtype=np.uint8)


def request(kit) -> scoring_pb2.ScoreRequest:
    return kit.raw_request(PIXELS, scales=[32])


def test_tls_and_token(kit, tiny_model_path, certificate):
    cert, key = certificate
    server, port = create_server([tiny_model_path], settings=Settings(warm_up=False, intra_op_threads=1),
                                 token="s3cret", tls=(cert, key))
    try:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert)
        with grpc.secure_channel(f"localhost:{port}", credentials) as channel:
            stub = scoring_pb2_grpc.DenseScoringStub(channel)
            assert stub.Score(request(kit), metadata=[("authorization", "Bearer s3cret")]).top_k
            for metadata in ([], [("authorization", "Bearer wrong")], [("authorization", "s3cret")]):
                with pytest.raises(grpc.RpcError) as caught:
                    stub.Score(request(kit), metadata=metadata)
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "Bearer <token>" in caught.value.details()
            with pytest.raises(grpc.RpcError) as caught:  # streams are guarded too
                list(stub.ScoreStream(iter([request(kit)])))
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as caught:
                stub.ListModels(scoring_pb2.ListModelsRequest())
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # Health probes need no token.
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(f"127.0.0.1:{port}") as plain:  # plaintext never reaches the servicer
            with pytest.raises(grpc.RpcError) as caught:
                scoring_pb2_grpc.DenseScoringStub(plain).Score(request(kit), timeout=5,
                                                               metadata=[("authorization", "Bearer s3cret")])
            assert caught.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        server.stop(0).wait(10)


def test_list_models_tells_file_paths_only_with_expose_paths(kit, tiny_model_path, tmp_path):
    from server.main import parse_args, settings_from

    assert not settings_from(parse_args(["m.onnx"])).expose_paths
    with kit.serving([tiny_model_path]) as (_server, _port, stub):
        (summary,) = stub.ListModels(scoring_pb2.ListModelsRequest()).models
        assert summary.name == "tiny" and summary.path == ""
    with kit.serving([tiny_model_path], expose_paths=True) as (_server, _port, stub):
        (summary,) = stub.ListModels(scoring_pb2.ListModelsRequest()).models
        assert summary.path == tiny_model_path
    unnamed = tmp_path / "private" / "unnamed.onnx"  # a card without a name
    unnamed.parent.mkdir()
    onnx.save(patch_net(classes=3, name=""), unnamed)
    with kit.serving([str(unnamed)]) as (_server, _port, stub):
        (summary,) = stub.ListModels(scoring_pb2.ListModelsRequest()).models
        assert summary.name == "unnamed" and summary.path == ""  # named after its file, not its folders


def test_a_token_file_with_a_line_break_enforces_the_token_and_clients_strip_theirs(kit, tiny_model_path, tmp_path):
    (tmp_path / "token").write_text("s3cret\n")
    token = read_token(str(tmp_path / "token"), {})
    server, port = create_server([tiny_model_path], settings=Settings(warm_up=False, intra_op_threads=1), token=token)
    try:
        with ScoremapClient(f"127.0.0.1:{port}", token=env_token({TOKEN_ENV: " s3cret\n"})) as client:
            assert client.score_request(request(kit)).top_k
        with ScoremapClient(f"127.0.0.1:{port}", token=env_token({})) as anonymous:
            with pytest.raises(ScoremapError) as caught:
                anonymous.score_request(request(kit))
            assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop(0).wait(10)
    for bad, words in (("", "turn authentication off"), ("s3cret\n", "one word")):  # the Python API fails closed too
        with pytest.raises(ValueError, match=words):
            create_server([tiny_model_path], settings=Settings(warm_up=False), token=bad)
    with pytest.raises(ValueError, match="--max-calls-per-peer 16 lets one client address hold all 6 workers"):
        create_server([tiny_model_path], settings=Settings(warm_up=False, grpc_workers=8))


def test_the_call_limits_guard_each_handler_they_are_given_whatever_interceptor_comes_first():
    """CallLimits makes each method's guarded handler once (a share of each request's CPU otherwise); an interceptor before it that answers a
    call with another handler (here the token's, which denies a call without it) gets its own each time: a call
    denied first must not deny the calls after it, nor an allowed one let the next through."""
    limits = CallLimits(total=4, per_peer=0, metrics=Metrics(),
                        pacer=RefusalPacer(per_answer=0, floor=10, max_hold=0.5, max_held=4))
    server = grpc.server(ThreadPoolExecutor(4), interceptors=[limits, TokenInterceptor("secret")])
    echo = grpc.unary_unary_rpc_method_handler(lambda request, _context: request)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", {"Say": echo}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            say = channel.unary_unary("/test.Echo/Say")
            for token in (None, "secret", None, "wrong", "secret"):
                metadata = () if token is None else (("authorization", f"Bearer {token}"),)
                if token == "secret":
                    assert say(b"hi", metadata=metadata, timeout=10) == b"hi"
                else:
                    with pytest.raises(grpc.RpcError) as denied:
                        say(b"hi", metadata=metadata, timeout=10)
                    assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop(0).wait()
