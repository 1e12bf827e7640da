"""scoremap-loadtest over several sending processes: shares, merged percentiles, its own CPU and its warning."""

import json
import os
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from clients.api.options import as_new_work
from clients.loadtest.latency import LevelReport, client_bound_warning, format_table
from clients.loadtest.run import EXIT_OK, LevelPlan, LoadLimits, calibrate, closed_loop, main
from clients.loadtest.settings import LoadLimits as Limits
from clients.loadtest.spread import LoadTester, Target, split
from clients.loadtest.traffic import Open, Payloads
from protos import scoring_pb2, scoring_pb2_grpc

SERVICE = scoring_pb2.DESCRIPTOR.services_by_name["DenseScoring"].full_name


def test_payloads_are_the_requests_sent_as_new_work():
    requests = [scoring_pb2.ScoreRequest(encoded=b"\xff\xd8 a photo", scales=[384], request_id="cat"),
                scoring_pb2.ScoreRequest(encoded=b"another", output_stride=16)]
    payloads = Payloads.of(requests)
    for n in (0, 1, 2, 7, 12345):
        assert scoring_pb2.ScoreRequest.FromString(payloads(n)) == as_new_work(requests[n % 2], n)


def test_a_level_is_split_in_whole_parts_that_add_up():
    assert split(10, [1, 1, 1]) == [4, 3, 3]
    assert split(22, [1, 1]) == [11, 11]
    assert split(7, [3, 1]) == [5, 2]
    assert split(2, [1, 1, 1, 1]) == [1, 1, 0, 0]
    assert sum(split(100_003, [5, 3, 2, 7])) == 100_003


def test_open_loop_shares_interleave_into_the_rate_asked():
    """Three processes at a total of 40/s: together they keep one schedule of arrival n at n / 40 s."""
    shares = [Open([], Payloads([b""]), rate=40.0, timeout_s=1, limits=Limits(), first=k, step=3) for k in range(3)]
    for share in shares:
        share.started = 100.0
    due = sorted(share.scheduled(index) for share in shares for index in range(10))
    assert due == pytest.approx([100.0 + n / 40 for n in range(30)])


class Sleeper(scoring_pb2_grpc.DenseScoringServicer):
    """Answers arrival n (its request_id's `#n`) after `slow_s` when n % 4 == 3, else after `fast_s`; keeps the ids."""

    def __init__(self, fast_s: float, slow_s: float) -> None:
        self.fast_s, self.slow_s = fast_s, slow_s
        self.ids: list[str] = []
        self.lock = threading.Lock()

    def Score(self, request, context):
        with self.lock:
            self.ids.append(request.request_id)
        number = int(request.request_id.rsplit("#", 1)[1])
        time.sleep(self.slow_s if number % 4 == 3 else self.fast_s)
        return scoring_pb2.ScoreResponse()


@pytest.fixture
def sleeper():
    """Starts a Sleeper on an ephemeral port: (servicer, 'HOST:PORT')."""
    running = []

    def start(*, fast_s: float, slow_s: float):
        servicer = Sleeper(fast_s, slow_s)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
        scoring_pb2_grpc.add_DenseScoringServicer_to_server(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)  # SERVING
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        running.append(server)
        return servicer, f"127.0.0.1:{port}"

    yield start
    for server in running:
        server.stop(0)


# A request's latency is the server's sleep plus its trip through gRPC on this machine: at least the sleep, and on
# a loaded shared machine at most this much more.
TOLERANCE_MS = 150.0


def test_merged_percentiles_match_the_known_latencies(sleeper, tmp_path):
    """Two processes, one sending even arrivals (all fast), the other odd ones (half slow): a quarter of all
    requests are slow. The merged p90 and p99 are the slow latency; an average of each process's p90 (fast and
    slow) would lie halfway."""
    fast_ms, slow_ms = 50.0, 500.0
    servicer, address = sleeper(fast_s=fast_ms / 1000, slow_s=slow_ms / 1000)
    report = tmp_path / "report.json"
    assert main(["--server", address, "--processes", "2", "--concurrency", "4", "--requests", "40", "--warmup", "0",
                 "--sizes", "32x32", "--json", str(report), "--quiet"]) == EXIT_OK
    [level] = json.loads(report.read_text())
    assert level["client_processes"] == 2 and level["sent"] == 40 and level["completed"] == 40
    assert sorted(servicer.ids, key=lambda rid: int(rid.rsplit("#", 1)[1])) == [f"#{n}" for n in range(40)]
    assert fast_ms <= level["p50_ms"] <= fast_ms + TOLERANCE_MS
    for slow in ("p90_ms", "p99_ms", "max_ms"):
        assert slow_ms <= level[slow] <= slow_ms + TOLERANCE_MS


def test_open_loop_over_processes_sends_every_arrival_once_at_the_known_latency(sleeper, tmp_path):
    fixed_ms = 100.0
    servicer, address = sleeper(fast_s=fixed_ms / 1000, slow_s=fixed_ms / 1000)
    report = tmp_path / "report.json"
    assert main(["--server", address, "--processes", "3", "--rate", "60", "--requests", "30", "--warmup", "0",
                 "--sizes", "32x32", "--json", str(report), "--quiet"]) == EXIT_OK
    [level] = json.loads(report.read_text())
    assert level["mode"] == "open" and level["client_processes"] == 3
    assert level["sent"] == 30 and level["completed"] == 30 and level["errors"] == {}
    assert sorted(int(rid.rsplit("#", 1)[1]) for rid in servicer.ids) == list(range(30))  # each arrival once
    for percentile in ("p50_ms", "p90_ms", "p99_ms"):
        assert fixed_ms <= level[percentile] <= fixed_ms + TOLERANCE_MS


def _environment(pid: int) -> dict[str, str]:
    """The environment process `pid` started with."""
    with open(f"/proc/{pid}/environ", "rb") as environ:
        return dict(entry.decode().split("=", 1) for entry in environ.read().split(b"\0") if b"=" in entry)


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/environ"), reason="reads /proc/PID/environ")
def test_sending_processes_start_with_the_grpc_experiments_of_the_limits(sleeper, monkeypatch):
    """Each sending process gets the limits' GRPC_EXPERIMENTS as it starts, and this process's environment is left
    as it was; one the user set is what every process gets."""
    _servicer, address = sleeper(fast_s=0.0, slow_s=0.0)
    monkeypatch.delenv("GRPC_EXPERIMENTS", raising=False)
    with LoadTester(Target(address), [b""], processes=2, limits=Limits()) as tester:
        assert [_environment(pid).get("GRPC_EXPERIMENTS") for pid in tester.pids] == [Limits().grpc_experiments] * 2
    assert "GRPC_EXPERIMENTS" not in os.environ
    with LoadTester(Target(address), [b""], processes=1, limits=Limits(grpc_experiments="")) as tester:
        assert "GRPC_EXPERIMENTS" not in _environment(tester.pids[0])
    monkeypatch.setenv("GRPC_EXPERIMENTS", "-event_engine_dns")
    with LoadTester(Target(address), [b""], processes=1, limits=Limits()) as tester:
        assert _environment(tester.pids[0])["GRPC_EXPERIMENTS"] == "-event_engine_dns"
    assert os.environ["GRPC_EXPERIMENTS"] == "-event_engine_dns"


FAST_SERVER = f"""
import asyncio, grpc
async def serve():
    async def score(request, context):
        return b""
    async def serving(request, context):
        return {health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING).SerializeToString()!r}
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        {SERVICE!r}, {{"Score": grpc.unary_unary_rpc_method_handler(score)}}), grpc.method_handlers_generic_handler(
        "grpc.health.v1.Health", {{"Check": grpc.unary_unary_rpc_method_handler(serving)}})))
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    await server.start()
    await server.wait_for_termination()
asyncio.run(serve())
"""


@pytest.fixture
def fast_server():
    """A server that answers every call at once, without parsing it, in a process of its own: (process, address)."""
    process = subprocess.Popen([sys.executable, "-c", FAST_SERVER], stdout=subprocess.PIPE, text=True)
    port = process.stdout.readline().strip()
    yield process, f"127.0.0.1:{port}"
    process.kill()
    process.wait()


def test_the_load_testers_cpu_leaves_out_its_reading_of_the_server(fast_server):
    """Reading the server's meters at a window's edges (here a metrics read that spends half a second of this
    process's CPU) is not the load tester's cost per request: its own meters are read around them."""
    _process, address = fast_server
    burn_s = 0.5

    def metrics():
        until = time.process_time() + burn_s
        while time.process_time() < until:
            pass
        return None

    plan = LevelPlan(duration_s=60.0, max_requests=20, timeout_s=10.0, warmup=0)
    with grpc.insecure_channel(address) as channel:
        report = closed_loop(channel, [scoring_pb2.ScoreRequest()], concurrency=1, plan=plan, limits=LoadLimits(),
                             metrics=metrics)
    assert report.completed == 20
    assert report.client_cpu_ms * report.completed < 1000 * burn_s / 2


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity")
def test_a_load_tester_given_one_core_against_a_fast_server_says_it_is_the_limit(fast_server, tmp_path):
    """Two sending processes on one core (at the lowest priority, so that on a shared machine the core's other
    work comes first, as it would on a busy client host) cannot keep up with a server that answers at once: the
    level is marked client-bound and the warning names the load tester. The server's own CPU is shown beside."""
    server, address = fast_server
    core = sorted(os.sched_getaffinity(0))[0]
    report = tmp_path / "report.json"

    ran = subprocess.run(["taskset", "-c", str(core), "nice", "-n", "19",  # one core, at the lowest priority
                          sys.executable, "-m", "clients.loadtest.run", "--server", address, "--processes", "2",
                          "--concurrency", "64", "--duration", "2", "--sizes", "32x32", "--server-pid",
                          str(server.pid), "--json", str(report), "--quiet"],
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == EXIT_OK, ran.stderr
    [level] = json.loads(report.read_text())
    assert level["client_processes"] == 2 and level["completed"] > 0
    assert level["client_busy"] > LoadLimits().client_busy_warning and level["client_bound"] is True
    assert "the load tester was" in ran.stderr and "may be its own limit" in ran.stderr
    assert level["client_cpu_cores"] > 0 and level["server_cpu_cores"] > 0


def test_no_warning_when_the_server_is_the_limit(sleeper, tmp_path, capsys):
    """Two callers of a server that takes half a second: the sending process waits (a few wakeups a second)."""
    _, address = sleeper(fast_s=0.5, slow_s=0.5)
    report = tmp_path / "report.json"
    assert main(["--server", address, "--processes", "1", "--concurrency", "2", "--requests", "8", "--sizes", "32x32",
                 "--json", str(report), "--quiet"]) == EXIT_OK
    [level] = json.loads(report.read_text())
    assert level["client_busy"] < LoadLimits().client_busy_warning and level["client_bound"] is False
    assert level["client_cpu_ms"] > 0
    printed = capsys.readouterr()
    assert "cli_busy" in printed.out and "may be its own limit" not in printed.err + printed.out


def report(busy: float, processes: int) -> LevelReport:
    return LevelReport(mode="closed", level=64, sent=1, completed=1, duration_s=1.0, throughput_rps=1.0, p50_ms=1.0,
                       p90_ms=1.0, p95_ms=1.0, p99_ms=1.0, max_ms=1.0, client_processes=processes, client_busy=busy,
                       client_cpu_cores=busy * processes, client_bound=busy > 0.8)


class GrowingTester:
    """Stands for a LoadTester whose processes each carry `work` cores of a level: its busy share falls as it grows."""

    def __init__(self, work: float) -> None:
        self.count, self.work, self.levels = 1, work, []

    def closed(self, concurrency, plan):
        self.levels.append(self.count)
        return report(self.work / self.count, self.count)

    def grow(self, processes):
        assert processes > self.count
        self.count = processes


@pytest.mark.parametrize("work, cores, chosen", [
    (0.3, 16, 1),   # one process has room to spare
    (0.9, 16, 2),   # busier than auto_busy: at least twice as many
    (3.0, 16, 5),   # as many as the measured share says at once: 3.0 / 0.6
    (3.0, 4, 4),    # no more than the cores
])
def test_auto_processes_grow_until_the_load_tester_has_room(monkeypatch, work, cores, chosen):
    monkeypatch.setattr("clients.loadtest.run.usable_cores", lambda: cores)
    tester = GrowingTester(work)
    plan = LevelPlan(duration_s=10, max_requests=100, timeout_s=5)
    assert calibrate(tester, "closed", 64, plan, limits=LoadLimits()) == chosen
    assert tester.levels[0] == 1 and tester.levels[-1] == chosen


def test_auto_processes_are_at_most_one_per_caller(monkeypatch):
    monkeypatch.setattr("clients.loadtest.run.usable_cores", lambda: 16)
    tester = GrowingTester(5.0)
    assert calibrate(tester, "closed", 3, LevelPlan(duration_s=1, max_requests=1, timeout_s=1),
                     limits=LoadLimits()) == 3


def test_the_warning_and_the_table_mark_a_client_bound_level():
    bound, fine = report(0.95, 2), report(0.2, 2)
    assert client_bound_warning(fine, busy_warning=0.8) is None
    warning = client_bound_warning(bound, busy_warning=0.8)
    assert "95% busy" in warning and "2 processes" in warning and "--processes" in warning
    table = format_table([bound, fine])
    assert "95%*" in table and "20%" in table and "may be its own limit" in table


def test_the_load_testers_share_is_its_time_running_or_waiting_over_its_capacity():
    from clients.loadtest.latency import Sample, summarise

    samples = [Sample(0.5 + n / 100, 0.01, "OK") for n in range(50)]
    common = dict(sent=50, start_s=0.0, end_s=1.0, processes=2, capacity_cores=2, busy_warning=0.8)
    idle = summarise("closed", 8, samples, client_cpu_s=0.5, client_busy_s=0.6, metered_s=1.25, **common)
    assert idle.client_cpu_cores == pytest.approx(0.4) and idle.client_busy == pytest.approx(0.24)
    assert idle.client_cpu_ms == pytest.approx(10.0) and not idle.client_bound  # 0.5 s over 50 answers
    starved = summarise("closed", 8, samples, client_cpu_s=0.5, client_busy_s=2.5, metered_s=1.25, **common)
    assert starved.client_busy == pytest.approx(1.0) and starved.client_bound  # waited for its cores
    unmetered = summarise("closed", 8, samples, **common)
    assert unmetered.client_busy != unmetered.client_busy and not unmetered.client_bound  # NaN: not measured
