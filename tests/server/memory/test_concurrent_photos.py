"""Eight 48 Mpx photos at their own size at once are refused or queued, never more than memory holds.

With no size cap, what keeps a burst of large photos from taking the host down is the in-flight host budget
(--host-memory-budget): each request holds its own estimate, and one that would pass the budget is refused
with a retry hint, which the Python client follows (queued). A real scoremap-serve over a socket, its
resident set read from /proc: it stays within the budget and the server lives. Then the default sizing on a
24 GiB machine, with the default model's own estimate of such a photo.
"""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import sys
import threading
import time

import grpc
import onnx

from clients import ClientSettings, ScoremapClient
from convert import convert_classifier
from protos import RETRY_AFTER_KEY, scoring_pb2, scoring_pb2_grpc
from tests.clients.slides.nets import UNIT, tiny_classifier
from tests.server.scoring.test_own_size import photo_jpeg

MiB, GiB = 2**20, 2**30
BUDGET = 2 * GiB
CALLS = 8
QUEUED = 4  # calls that retry until answered: twice what the budget holds at once, and half the CPU of eight
SIDE = 6048  # 8064x6048: a 48 Mpx camera photo, under the 50 Mpx decode guard


def memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (the peak) of a process, in bytes."""
    with open(f"/proc/{pid}/status") as status:
        return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in status
                if line.startswith(("VmRSS", "VmHWM"))}


@contextlib.contextmanager
def served(path: str, *flags: str):
    """`scoremap-serve PATH --port 0 FLAGS` in its own process, until SERVING; yields (process, address)."""
    from clients.batch.demo import stop_server, wait_until_serving

    process = subprocess.Popen([sys.executable, "-m", "server.main", path, "--port", "0", *flags],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = process.stdout.readline()
        assert "listening on" in line, f"scoremap-serve did not start: {line!r}"
        address = line.rsplit(" ", 1)[1].strip()
        wait_until_serving(address, timeout_s=120)
        yield process, address
    finally:
        stop_server(process)


def test_eight_concurrent_48_megapixel_photos_are_refused_or_queued_within_the_host_budget(tmp_path):
    path = str(tmp_path / "tiny.onnx")
    onnx.save(convert_classifier(tiny_classifier(padded=True, nhwc=False, size=64), preprocessing=UNIT), path)
    data = photo_jpeg(SIDE, 8064, seed=7)
    request = scoring_pb2.ScoreRequest(encoded=data, scales=[SIDE], output_stride=32, top_k=5)
    # A queue that never refuses on time (--max-queue-ms): the host budget alone decides who waits.
    with served(path, "--host-memory-budget", f"{BUDGET // MiB}MiB", "--max-queue-ms", "600000") as (process, address):
        before = memory(process.pid)["VmRSS"]
        peak, done = [before], threading.Event()

        def sample() -> None:
            while not done.wait(0.02):
                peak[0] = max(peak[0], memory(process.pid)["VmRSS"])

        sampler = threading.Thread(target=sample)
        sampler.start()
        channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 * MiB)])
        stub = scoring_pb2_grpc.DenseScoringStub(channel)
        outcomes: list[grpc.RpcError | scoring_pb2.ScoreResponse] = []

        def once() -> None:  # no retry: the refusals show
            try:
                outcomes.append(stub.Score(request, timeout=300))
            except grpc.RpcError as error:
                outcomes.append(error)

        def retried(client: ScoremapClient) -> None:  # the client's retry policy follows the hint: queued
            outcomes.append(client.score(data, scales=[SIDE], stride=32, top_k=5, return_maps=False))

        try:
            threads = [threading.Thread(target=once) for _ in range(CALLS)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            refused = [o for o in outcomes if isinstance(o, grpc.RpcError)]
            answered = len(outcomes) - len(refused)
            first = len(outcomes)
            settings = ClientSettings(timeout_s=300, retry_budget_s=300, backoff_max_s=1.0)
            with ScoremapClient(address, settings=settings) as client:
                threads = [threading.Thread(target=retried, args=(client,)) for _ in range(QUEUED)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
        finally:
            done.set()
            sampler.join()
            channel.close()
        assert process.poll() is None, "the server died"
        high_water = memory(process.pid)["VmHWM"]
    assert first == CALLS and answered >= 1 and refused, f"{answered} answered of {CALLS}, none refused"
    for error in refused:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--host-memory-budget" in error.details()
        assert any(key == RETRY_AFTER_KEY for key, _value in error.trailing_metadata())  # transient: retry
    assert len(outcomes) == CALLS + QUEUED and all(len(o.top_k) == 3 for o in outcomes[first:])  # queued, answered
    # What the requests held beyond the idle server stays within the budget, give or take the calls' messages
    # gRPC holds before admission (each photo is ~7 MB).
    slack = 2 * CALLS * len(data) + 256 * MiB
    assert max(peak[0], high_water) - before <= BUDGET + slack, (before, peak[0], high_water)


def test_on_a_24_gib_machine_the_default_budgets_hold_eight_48_megapixel_photos_in_memory(default_model_path,
                                                                                          monkeypatch):
    """The default model's own estimate of a 48 Mpx photo at its own size (stride 32, top-5: 1.6 GiB), eight at
    once against the defaults sized for 22 GiB available: the queue (--queue-depth, 48 tiles each) and the host
    budget (a quarter of it) admit a few, the rest are refused with a retry hint; what they hold and every plan
    (half of it, --memory-budget) stay below 24 GiB."""
    import io

    from PIL import Image

    from server.errors import ScoringError
    from server.memory import host_budget
    from server.scoring import admission
    from server.scoring.pipeline import Pipeline
    from server.settings import Settings

    available = 22 * GiB
    monkeypatch.setattr(host_budget, "available_memory_bytes", lambda: available)
    header = io.BytesIO()
    Image.new("RGB", (8064, SIDE)).save(header, format="PNG")  # admission reads the header only
    request = scoring_pb2.ScoreRequest(encoded=header.getvalue(), scales=[SIDE], top_k=5)
    pipeline = Pipeline([default_model_path], settings=dataclasses.replace(Settings(), warm_up=False))
    model = pipeline._model("")
    try:
        with contextlib.ExitStack() as held:
            admitted, refusals = [], []
            for _ in range(CALLS):
                try:
                    ticket = admission.admit(request, model, engine=pipeline.engine, deadline=time.monotonic() + 600)
                    admitted.append(held.enter_context(ticket))
                except ScoringError as error:
                    refusals.append(error)
            in_flight = model.host_budget.in_flight_bytes()
            assert admitted and refusals and all(e.retry_after_seconds for e in refusals), refusals
            assert 1.5 * GiB < admitted[0].host.total < 2 * GiB, admitted[0].host.describe()
            assert in_flight <= model.host_budget.total_bytes == available // 4
        assert model.host_budget.total_bytes + pipeline.engine.budget.total_bytes < 24 * GiB  # requests and plans at most
    finally:
        pipeline.close()
