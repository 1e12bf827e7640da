"""gRPC's worker pool guarded on a real server: idle streams, call limits (server/edges/grpc/interceptors.py
`CallLimits`), connection lifetimes and calls that wait for a worker.

Workers are held by open ScoreStreams that send nothing: deterministic on any device, however fast
the model, since nothing here waits for a model to be slow.
"""

import queue
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import scoring_pb2_grpc
from server.errors import RETRY_AFTER_KEY

PIXELS = np.random.default_rng(11).integers(0, 256, (64, 64, 3), dtype=np.uint8)


class HeldStream:
    """A ScoreStream that sends what it is given, and nothing until then: while open it holds a worker."""

    def __init__(self, stub, *, timeout: float = 60):
        self._outbox: queue.Queue = queue.Queue()
        self.answers = stub.ScoreStream(iter(self._outbox.get, None), timeout=timeout)  # a failing test ends

    def send(self, request):
        self._outbox.put(request)
        return next(self.answers)

    def close(self):
        """End the stream; returns its remaining answers, or the error that ended it."""
        self._outbox.put(None)
        try:
            return list(self.answers)
        except grpc.RpcError as error:
            return error


def hold(server, stub, count: int) -> list[HeldStream]:
    """`count` streams running in the servicer."""
    streams = [HeldStream(stub) for _ in range(count)]
    while server.front.active < count:
        time.sleep(0.01)
    return streams


def test_health_is_answered_while_streams_hold_every_worker_scoring_may_use(kit, tiny_model_path):
    with kit.serving([tiny_model_path], grpc_workers=3, reserved_workers=1, max_calls_per_peer=0) as (server, port, stub):
        held = hold(server, stub, 2)
        extra = HeldStream(stub)
        with pytest.raises(grpc.RpcError) as caught:
            next(extra.answers)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--reserved-workers" in caught.value.details()
        assert int(dict(caught.value.trailing_metadata())[RETRY_AFTER_KEY]) > 0
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for _ in range(3):  # the reserved worker answers, again and again
                assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
                    health_pb2.HealthCheckResponse.SERVING
        assert held[0].send(kit.raw_request(PIXELS, scales=[64])).maps  # held streams still work
        for stream in held + [extra]:
            stream.close()
        counted = server.metrics.registry.get_sample_value
        assert counted("scoremap_requests_total", {"method": "ScoreStream", "code": "RESOURCE_EXHAUSTED", "model": ""}) == 1


def test_one_client_address_cannot_hold_every_worker(kit, tiny_model_path):
    with kit.serving([tiny_model_path], max_calls_per_peer=2) as (server, _port, stub):
        held = hold(server, stub, 2)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Score(kit.raw_request(PIXELS, scales=[64]), timeout=10)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "127.0.0.1 already has 2 calls running" in caught.value.details()
        assert "--max-calls-per-peer" in caught.value.details()
        assert int(dict(caught.value.trailing_metadata())[RETRY_AFTER_KEY]) > 0
        held[0].close()
        assert stub.Score(kit.raw_request(PIXELS, scales=[64]), timeout=10).maps
        held[1].close()


def test_an_idle_stream_is_ended_and_gives_its_worker_back(kit, tiny_model_path):
    with kit.serving([tiny_model_path], stream_idle_seconds=0.3) as (server, _port, stub):
        for sends in (0, 2):  # idle from the start, or after answers were sent
            stream = HeldStream(stub)
            for i in range(sends):
                assert stream.send(kit.raw_request(PIXELS, scales=[64], request_id=f"r{i}")).request_id == f"r{i}"
            with pytest.raises(grpc.RpcError) as caught:
                next(stream.answers)
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "--stream-idle-seconds" in caught.value.details()
            assert server.front.wait_idle(5)
            stream.close()


def test_calls_beyond_max_concurrent_rpcs_get_resource_exhausted_then_recover(kit, tiny_model_path):
    from server.main import parse_args, settings_from

    assert settings_from(parse_args(["m.onnx", "--max-concurrent-rpcs", "5"])).max_concurrent_rpcs == 5
    request = kit.raw_request(PIXELS, scales=[64])
    # No threads for held refusals beyond the one worker (--max-held-refusals 0): a call waits for it.
    with kit.serving([tiny_model_path], grpc_workers=1, reserved_workers=0, max_calls_per_peer=0,
                     max_concurrent_rpcs=2, max_held_refusals=0) as (server, _p, stub):
        (held,) = hold(server, stub, 1)  # one call running on the only worker
        calls = [stub.Score.future(request, timeout=60) for _ in range(2)]  # one waits for it, one is too many
        finished: queue.Queue = queue.Queue()
        for call in calls:
            call.add_done_callback(finished.put)
        refused = finished.get(timeout=60)  # the waiting one cannot finish while the worker is held
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        held.close()
        assert sum(call.exception(timeout=60) is None for call in calls) == 1
        assert stub.Score(request, timeout=60).maps  # still serving


def test_calls_that_expire_or_are_cancelled_while_waiting_for_a_worker_cost_no_compute(kit, tiny_model_path):
    request = kit.raw_request(PIXELS, scales=[64])
    with kit.serving([tiny_model_path], grpc_workers=1, reserved_workers=0, max_calls_per_peer=0,
                     max_held_refusals=0) as (server, _port, stub):
        counted = server.metrics.registry.get_sample_value
        assert stub.Score(request, timeout=60).maps
        one_request = counted("scoremap_batch_size_sum", {"model": "tiny"})
        (held,) = hold(server, stub, 1)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Score(request, timeout=0.5)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        cancelled = stub.Score.future(request, timeout=60)
        cancelled.cancel()
        held.close()
        assert stub.Score(request, timeout=60).maps  # behind both in the worker's queue
        assert counted("scoremap_batch_size_sum", {"model": "tiny"}) == 2 * one_request


def connection_lost(channel: grpc.Channel, stub, request, *, within: float, keep_calling: bool) -> bool:
    """Whether the channel's READY connection is closed by the server within `within` seconds (calling
    every 0.1 s meanwhile when `keep_calling`, each call answered)."""
    states: list[grpc.ChannelConnectivity] = []
    channel.subscribe(states.append)
    assert stub.Score(request, timeout=10).top_k
    until = time.monotonic() + within
    while time.monotonic() < until:
        ready = [n for n, state in enumerate(states) if state == grpc.ChannelConnectivity.READY]
        if ready and grpc.ChannelConnectivity.IDLE in states[ready[0]:]:
            return True
        if keep_calling:
            assert stub.Score(request, timeout=10).top_k
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("limits, keep_calling", [
    ({"connection_idle_seconds": 0.5}, False),  # an idle client's connection is closed
    # a busy one's is recycled; the grace outlasts a call on a loaded machine (at 0.5 s one was cut there)
    ({"connection_age_seconds": 0.5, "connection_age_grace_seconds": 5.0}, True),
])
def test_connections_are_closed_when_idle_and_recycled_when_old(kit, tiny_model_path, limits, keep_calling):
    request = kit.raw_request(PIXELS, scales=[64])
    with kit.serving([tiny_model_path], **limits) as (_server, port, _stub):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = scoring_pb2_grpc.DenseScoringStub(channel)
            assert connection_lost(channel, stub, request, within=10, keep_calling=keep_calling)
    with kit.serving([tiny_model_path]) as (_server, port, _stub):  # the defaults keep it well past that
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = scoring_pb2_grpc.DenseScoringStub(channel)
            assert not connection_lost(channel, stub, request, within=2, keep_calling=keep_calling)
