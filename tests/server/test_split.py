"""`scoremap-serve --fronts N`: one engine process, N front processes, real sockets and shared memory.

Each test starts the real command; the single process (`--fronts 0`) is run beside it where the answer must be
the same whatever the layout."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

from protos import RETRY_AFTER_KEY, scoring_pb2, scoring_pb2_grpc
from tests.server.test_main import serve_command, wrong_layout_net
from tests.server.test_workers import alive, children, once_warm, supervised

FRONTS = 2
PIXELS = np.random.default_rng(11).integers(0, 256, (96, 128, 3), dtype=np.uint8)
SHM = Path("/dev/shm")


def titles(pid: int) -> dict[int, str]:
    """The supervisor's children by their process title (what `ps` shows); one reaped meanwhile is left out."""
    found = {}
    for child in children(pid):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            found[child] = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0].decode()
    return found


def regions(supervisor: int) -> list[str]:
    return [path.name for path in SHM.glob(f"scoremap-{supervisor}-*")]


def wait_until(condition, seconds: float = 60.0) -> bool:
    until = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > until:
            return False
        time.sleep(0.05)
    return True


@contextlib.contextmanager
def server(tmp_path, model_path: str, *flags: str, fronts: int = FRONTS) -> Iterator[tuple[subprocess.Popen, int]]:
    """`scoremap-serve` (with `--fronts`, unless 0) until the block ends; every process killed if still running,
    and the fronts' shared memory removed."""
    arguments = [model_path, "--port", "0", "--fronts", str(fronts), "--intra-op-threads", "1", *flags]
    supervisor = None
    try:
        with supervised(tmp_path / f"serve-{fronts}.log", arguments) as (process, port):
            supervisor = process.pid
            yield process, port
    finally:
        for name in regions(supervisor) if supervisor is not None else ():
            (SHM / name).unlink(missing_ok=True)


def score(port: int, request: scoring_pb2.ScoreRequest, timeout: float = 60) -> scoring_pb2.ScoreResponse:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return once_warm(lambda: scoring_pb2_grpc.DenseScoringStub(channel).Score(request, timeout=timeout),
                         warming=lambda error: isinstance(error, grpc.RpcError)
                         and error.code() == grpc.StatusCode.UNAVAILABLE)


def health(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def test_fronts_answer_as_one_process_does_and_show_their_roles(kit, tiny_model_path, tmp_path):
    """The same requests (two scales and their mirrors, float32 and float16 maps, a few classes, a tiled scale)
    get the same answers from the split server as from one process: the canvases and lattices cross through
    shared memory, the rest in messages. Each process names its role in `ps`, and no front loads onnxruntime."""
    requests = [
        kit.raw_request(PIXELS, scales=[96, 128], flip=True, return_maps=True, top_k=3),
        kit.raw_request(PIXELS, scales=[96], return_maps=True, map_dtype=scoring_pb2.FLOAT16, classes=[1, 4]),
        kit.raw_request(PIXELS, scales=[2560], return_maps=True, classes=[0]),  # beyond the tile canvas: tiled
        scoring_pb2.ScoreRequest(encoded=png(PIXELS), scales=[160], cell_top_k=2),
    ]
    answers = {}
    for fronts in (0, FRONTS):
        with server(tmp_path, tiny_model_path, fronts=fronts) as (process, port):
            answers[fronts] = [score(port, request) for request in requests]
            if fronts:
                named = sorted(titles(process.pid).values())
                assert named == ["scoremap-serve: engine", *(f"scoremap-serve: front {i}" for i in range(fronts))]
                for pid, title in titles(process.pid).items():
                    loaded = Path(f"/proc/{pid}/maps").read_text()
                    assert ("onnxruntime" in loaded) == (title.endswith("engine")), title
                assert len(regions(process.pid)) == fronts
            process.send_signal(signal.SIGTERM)
            assert process.wait(60) == 0
        assert not regions(process.pid)  # every front unlinked its shared memory
    for single, split in zip(answers[0], answers[FRONTS]):
        assert [(p.index, p.probability) for p in split.top_k] == [(p.index, p.probability) for p in single.top_k]
        assert len(split.maps) == len(single.maps)
        for one, other in zip(single.maps, split.maps):
            assert one.height == other.height and one.width == other.width and one.scale == other.scale
            for tensor in ("scores", "cell_top_k_indices", "cell_top_k_scores"):  # the same plans: the same bits
                assert one.HasField(tensor) == other.HasField(tensor)
                if one.HasField(tensor):
                    np.testing.assert_array_equal(kit.decode_tensor(getattr(other, tensor)),
                                                  kit.decode_tensor(getattr(one, tensor)))


def test_a_killed_engine_is_refused_at_once_then_started_again(kit, tiny_model_path, tmp_path):
    """SIGKILL to the engine: the fronts answer UNAVAILABLE with a retry hint (no call waits out its deadline) and
    health says NOT_SERVING; the supervisor starts a new engine, and once it has warmed health says SERVING and
    requests are answered again."""
    request = kit.raw_request(PIXELS, scales=[96])
    with server(tmp_path, tiny_model_path) as (process, port):
        assert score(port, request).top_k
        (engine,) = [pid for pid, title in titles(process.pid).items() if title.endswith("engine")]
        os.kill(engine, signal.SIGKILL)
        assert wait_until(lambda: health(port) == health_pb2.HealthCheckResponse.NOT_SERVING, 10)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as refused:
                scoring_pb2_grpc.DenseScoringStub(channel).Score(request, timeout=30)
            assert time.monotonic() - started < 30  # refused, not left to its deadline
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
        assert RETRY_AFTER_KEY in dict(refused.value.trailing_metadata() or ())
        assert wait_until(lambda: health(port) == health_pb2.HealthCheckResponse.SERVING, 120)
        assert score(port, request).top_k
        assert engine not in titles(process.pid)
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0


def test_http_readiness_follows_the_engine_as_grpc_health_does(tiny_model_path, tmp_path):
    """/v2/health/ready (a Kubernetes readiness probe's) says 503 while the engine is gone, as gRPC health says
    NOT_SERVING, and 200 again once a new engine is warm: no probe keeps sending traffic that is refused."""
    import urllib.error
    import urllib.request

    def ready(base: str) -> int:
        try:
            return urllib.request.urlopen(f"{base}v2/health/ready", timeout=10).status
        except urllib.error.HTTPError as error:
            return error.code

    with server(tmp_path, tiny_model_path, "--http-port", "0") as (process, port):
        line = process.stdout.readline()
        assert " HTTP on " in line, line
        base = line.split()[-1]
        assert ready(base) == 200
        (engine,) = [pid for pid, title in titles(process.pid).items() if title.endswith("engine")]
        os.kill(engine, signal.SIGKILL)
        assert wait_until(lambda: health(port) == health_pb2.HealthCheckResponse.NOT_SERVING, 10)
        assert wait_until(lambda: ready(base) == 503, 10), "HTTP readiness said ready with the engine gone"
        assert wait_until(lambda: health(port) == health_pb2.HealthCheckResponse.SERVING, 120)
        assert wait_until(lambda: ready(base) == 200, 10)
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0


def test_a_killed_front_is_replaced_and_the_others_answer_meanwhile(kit, tiny_model_path, tmp_path):
    """SIGKILL to a front: the supervisor starts another in its place (removing the dead one's shared memory), and
    calls go on being answered by the front that lived and then by both."""
    request = kit.raw_request(PIXELS, scales=[96])
    with server(tmp_path, tiny_model_path) as (process, port):
        assert score(port, request).top_k
        front = next(pid for pid, title in titles(process.pid).items() if title.endswith("front 0"))
        os.kill(front, signal.SIGKILL)
        for _ in range(10):  # new connections: the kernel gives them to the living front while the other is away
            assert score(port, request).top_k
        assert wait_until(lambda: any(title.endswith("front 0") for pid, title in titles(process.pid).items()
                                      if pid != front))
        assert wait_until(lambda: len(regions(process.pid)) == FRONTS)
        assert not [name for name in regions(process.pid) if name.endswith(f"-{front}")]
        for _ in range(10):
            assert score(port, request).top_k
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0


def test_the_port_stays_the_server_s_while_every_front_is_started_again(kit, tiny_model_path, tmp_path):
    """Every front killed at once (a request that crashes the decoder, retried): while none listens, the supervisor
    still holds the port, so no other process takes it and the new fronts bind it again."""
    import socket

    with server(tmp_path, tiny_model_path) as (process, port):
        fronts = [pid for pid, title in titles(process.pid).items() if " front " in title]
        for front in fronts:
            os.kill(front, signal.SIGKILL)
        assert wait_until(lambda: not any(map(alive, fronts)), 10)

        def taken() -> bool:  # by another process, which a bind would be
            with socket.socket() as other:
                try:
                    other.bind(("127.0.0.1", port))
                except OSError:
                    return False
                return True

        assert not wait_until(taken, 3), "the port was free while the fronts were started again"
        assert score(port, kit.raw_request(PIXELS, scales=[96])).top_k
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0


def test_nothing_of_the_server_outlives_its_killed_supervisor(tiny_model_path, tmp_path):
    """SIGKILL leaves the supervisor no time to act: the kernel sends each process SIGTERM; the fronts unlink their
    shared memory, and every process ends."""
    with server(tmp_path, tiny_model_path, "--grace-seconds", "1") as (process, _port):
        pids = children(process.pid)
        assert len(pids) == FRONTS + 1 and len(regions(process.pid)) == FRONTS
        process.kill()
        process.wait()
        assert wait_until(lambda: not any(map(alive, pids))), [pid for pid in pids if alive(pid)]
        assert not regions(process.pid)
        assert not list(Path(tempfile.gettempdir()).glob(f"scoremap-{process.pid}-*"))  # nor its run folder


def test_an_engine_crash_not_recovered_when_the_server_stops_ends_it_with_the_crash_s_status(tiny_model_path,
                                                                                              tmp_path):
    """SIGTERM just after the engine was killed, before it is started again: the drain cannot save the calls it held,
    and the server says so, exiting with the crash's status as a shell reports it (128 + 9), not 0."""
    with server(tmp_path, tiny_model_path) as (process, _port):
        (engine,) = [pid for pid, title in titles(process.pid).items() if title.endswith("engine")]
        os.kill(engine, signal.SIGKILL)
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 128 + signal.SIGKILL


def test_a_process_that_keeps_ending_soon_after_its_start_waits_longer_each_time():
    """A front that cannot start again (its model file gone, say) is not started every half second for good: each
    end soon after a new start doubles the pause, up to a limit; one that ran steadily starts again after the
    first pause."""
    from server.split import MAX_RESTART_PAUSE_SECONDS, RESTART_PAUSE_SECONDS, STEADY_SECONDS, Child

    child = Child("front:0", ["true"], {}, started=100.0)
    assert child.ended(3600.0) == RESTART_PAUSE_SECONDS and child.due == 3600.0 + RESTART_PAUSE_SECONDS
    pauses = []
    for _ in range(8):
        child.started = child.due
        pauses.append(child.ended(child.started + 1.0))
    assert pauses[:3] == [2 * RESTART_PAUSE_SECONDS, 4 * RESTART_PAUSE_SECONDS, 8 * RESTART_PAUSE_SECONDS]
    assert pauses[-1] == MAX_RESTART_PAUSE_SECONDS
    child.started = child.due
    assert child.ended(child.started + STEADY_SECONDS + 1.0) == RESTART_PAUSE_SECONDS


def test_a_run_folder_too_deep_for_the_engine_s_socket_is_refused_at_start(tiny_model_path, tmp_path):
    """A Unix socket's path holds 107 bytes: a TMPDIR deeper than that leaves is refused before anything starts,
    saying what to change, rather than failing in the engine with a traceback."""
    deep = tmp_path / ("t" * 100)
    deep.mkdir()
    finished = subprocess.run(serve_command() + [tiny_model_path, "--port", "0", "--fronts", str(FRONTS)],
                              env={**os.environ, "TMPDIR": str(deep)}, capture_output=True, text=True, timeout=60)
    assert finished.returncode == 2, finished.stderr
    assert "set TMPDIR to a shorter folder" in finished.stderr and "Traceback" not in finished.stderr
    assert not list(deep.iterdir())  # its run folder removed


@contextlib.contextmanager
def starting(tmp_path, model_path: str, *flags: str) -> Iterator[tuple[subprocess.Popen, set[int]]]:
    """`scoremap-serve --fronts` before it listens, and the set of its children's pids the caller fills
    (`all_started`); whatever of it is left at the end is killed and its regions removed."""
    process = subprocess.Popen(serve_command() + [model_path, "--port", "0", "--fronts", str(FRONTS),
                                                  "--intra-op-threads", "1", *flags],
                               stdout=subprocess.PIPE, stderr=(tmp_path / "serve.log").open("w"), text=True)
    pids: set[int] = set()
    try:
        yield process, pids
    finally:
        process.kill()
        for pid in filter(alive, pids):
            os.kill(pid, signal.SIGKILL)
        for name in regions(process.pid):
            (SHM / name).unlink(missing_ok=True)


def all_started(process: subprocess.Popen, pids: set[int]) -> bool:
    """Whether the engine and every front have started, their pids recorded in `pids`, within 30 s."""
    def counted() -> bool:
        pids.update(children(process.pid))
        return len(pids) == FRONTS + 1

    return wait_until(counted, 30)


def test_an_engine_that_cannot_warm_up_ends_the_server_with_its_status(tiny_model_path, tmp_path):
    """A warm-up that fails in the engine fails the start as it does in one process (3), before any front listens:
    the fronts waiting for the engine are stopped, and nothing is left running or in /dev/shm."""
    with starting(tmp_path, wrong_layout_net(tiny_model_path)) as (process, pids):
        assert all_started(process, pids)
        assert process.wait(30) == 3, (tmp_path / "serve.log").read_text()
        assert "the engine's warm-up failed" in (tmp_path / "serve.log").read_text()
        assert process.stdout.read() == ""  # it never said it listens
        assert not any(map(alive, pids)) and not regions(process.pid)


def test_an_engine_that_cannot_warm_up_when_started_again_ends_the_server(kit, tiny_model_path, tmp_path):
    """An engine started again after a crash whose warm-up fails (here the model file was replaced meanwhile) would
    fail alike at every start: the server ends with its status, as at the first start, instead of starting it again
    forever."""
    request = kit.raw_request(PIXELS, scales=[96])
    with server(tmp_path, tiny_model_path) as (process, port):
        assert score(port, request).top_k
        os.replace(wrong_layout_net(tiny_model_path), tiny_model_path)
        pids = children(process.pid)
        (engine,) = [pid for pid, title in titles(process.pid).items() if title.endswith("engine")]
        os.kill(engine, signal.SIGKILL)
        assert process.wait(30) == 3
        assert not any(map(alive, pids)) and not regions(process.pid)


def test_a_sigterm_before_the_engine_is_warm_stops_every_process(tiny_model_path, tmp_path):
    """SIGTERM before the fronts listen is passed on at once, as after: the fronts waiting for an engine not warm
    yet (held here by SIGSTOP) end without it, and the server exits 0 once the engine has stopped too."""
    with starting(tmp_path, tiny_model_path) as (process, pids):
        assert all_started(process, pids)
        (engine,) = [pid for pid in pids if b"--split-role\0engine" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        os.kill(engine, signal.SIGSTOP)
        process.send_signal(signal.SIGTERM)
        fronts = [pid for pid in pids if pid != engine]
        assert wait_until(lambda: not any(map(alive, fronts)), 20), (tmp_path / "serve.log").read_text()
        with contextlib.suppress(ProcessLookupError):  # a SIGTERM before its handler was set ends it even stopped
            os.kill(engine, signal.SIGCONT)
        assert process.wait(30) == 0
        assert not any(map(alive, pids)) and not regions(process.pid)


def test_a_dev_shm_too_small_for_the_fronts_is_refused_at_start(tiny_model_path):
    """Docker's 64 MB /dev/shm: refused before anything starts, with the size needed and how to give it."""
    shm = os.statvfs("/dev/shm")
    too_much = shm.f_blocks * shm.f_frsize // FRONTS + 2**20  # beyond its whole size, whatever others use of it
    finished = subprocess.run(serve_command() + [tiny_model_path, "--port", "0", "--fronts", str(FRONTS),
                                                 "--front-shm-bytes", str(too_much)],
                              capture_output=True, text=True, timeout=60)
    assert finished.returncode == 2, finished.stderr
    assert "--shm-size=" in finished.stderr and "/dev/shm has" in finished.stderr


def test_one_scrape_shows_the_engine_s_and_every_front_s_series(kit, tiny_model_path, tmp_path):
    """--metrics-port with --fronts: the supervisor's endpoint carries every process's series, each labelled with
    its process: the engine's batches, queue and plan memory beside each front's requests."""
    import urllib.request

    with server(tmp_path, tiny_model_path, "--metrics-port", "0") as (process, port):
        line = process.stdout.readline()
        assert " metrics on " in line, line
        for _ in range(6):
            assert score(port, kit.raw_request(PIXELS, scales=[96])).top_k

        def series() -> str:
            return urllib.request.urlopen(line.split()[-1], timeout=10).read().decode()

        assert wait_until(lambda: 'scoremap_batch_size_count{model="tiny",process="engine"}' in series())
        text = series()
        assert 'scoremap_plans_held_bytes{process="engine"}' in text
        assert 'scoremap_queue_depth{model="tiny",process="engine"}' in text
        (cpu,) = [float(row.split()[-1]) for row in text.splitlines()
                  if row.startswith('scoremap_batch_cpu_seconds_total{model="tiny",process="engine"}')]
        assert cpu > 0
        answered = [float(row.split()[-1]) for row in text.splitlines()
                    if row.startswith('scoremap_requests_total{code="OK",method="Score",model="tiny",process="front-')]
        assert sum(answered) == 6, text
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0


def test_fronts_and_workers_together_are_refused_naming_both(tiny_model_path):
    finished = subprocess.run(serve_command() + [tiny_model_path, "--port", "0", "--fronts", "2", "--workers", "2"],
                              capture_output=True, text=True, timeout=60)
    assert finished.returncode == 2
    assert "--fronts 2 and --workers 2 both split the server into processes: give one" in finished.stderr


def test_a_failed_start_ends_with_a_child_s_own_status_never_a_signal_s():
    """A child that exited with a status gives it (the engine's first); one that died by a signal gives none: 2."""
    from server.split import Child, failed_start_status

    def ended(script: str) -> Child:
        command = ["sh", "-c", script]
        child = Child("front:0", command, dict(os.environ), process=subprocess.Popen(command))
        child.process.wait(30)
        return child

    killed, warm_up_failed, stopped = ended("kill -9 $$"), ended("exit 3"), ended("kill -15 $$")
    assert failed_start_status([killed, warm_up_failed, stopped]) == 3
    assert failed_start_status([killed, stopped]) == 2
