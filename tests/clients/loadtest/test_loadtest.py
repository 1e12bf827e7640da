import json
import math
import shutil
import subprocess
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from clients.api.options import ScoreOptions
from clients.loadtest.latency import Sample, format_table, stable, summarise, to_csv, to_json
from clients.loadtest.run import LevelPlan, LoadLimits, closed_loop, load_inputs, main, open_loop
from clients.loadtest.server_metrics import parse, server_split
from protos import scoring_pb2, scoring_pb2_grpc


def test_summary_counts_percentiles_and_errors_by_status():
    samples = [Sample(1.0, ms / 1000, "OK") for ms in range(1, 101)] + [Sample(1.5, 0.5, "RESOURCE_EXHAUSTED")] * 3
    report = summarise("open", 50.0, samples, sent=105, start_s=0.0, end_s=2.0, in_flight_at_end=2)
    assert (report.sent, report.completed, report.in_flight_at_end) == (105, 100, 2)
    assert report.throughput_rps == 50.0
    assert report.p50_ms == pytest.approx(50.5) and report.p99_ms == pytest.approx(99.01) and report.max_ms == 100
    assert report.errors == {"RESOURCE_EXHAUSTED": 3}
    assert "RESOURCE_EXHAUSTED=3" in format_table([report]) and "RESOURCE_EXHAUSTED=3" in to_csv([report])
    none_ok = summarise("closed", 1, [Sample(0.5, 1.0, "UNAVAILABLE")], sent=1, start_s=0.0, end_s=1.0)
    assert json.loads(to_json([none_ok]))[0]["p50_ms"] is None


def test_only_requests_completed_inside_the_window_count():
    samples = [Sample(0.5, 0.1, "OK"), Sample(1.5, 0.1, "OK"), Sample(2.5, 9.0, "OK"), Sample(3.5, 0.1, "UNAVAILABLE")]
    report = summarise("closed", 1, samples, sent=4, start_s=1.0, end_s=3.0)
    assert report.completed == 2 and report.throughput_rps == 1.0 and report.errors == {}
    assert report.max_ms == pytest.approx(9000)


def test_a_rate_is_stable_when_the_last_windows_agree():
    assert stable([10, 50, 100, 102, 98], count=3, tolerance=0.05)
    assert not stable([100, 102], count=3, tolerance=0.05)
    assert not stable([100, 120, 100], count=3, tolerance=0.05)
    assert not stable([0, 0, 0], count=3, tolerance=0.05)


def test_closed_loop_sweep_at_low_load_has_no_errors(server, tmp_path, capsys):
    report = tmp_path / "report.json"
    assert main(["--server", server, "--concurrency", "1,2", "--requests", "20", "--sizes", "64x96,96x64",
                 "--json", str(report), "--csv", str(tmp_path / "report.csv")]) == 0
    levels = json.loads(report.read_text())
    assert [level["level"] for level in levels] == [1, 2]
    assert levels[0]["completed"] == 20  # one caller: exactly the warm-up's 2 answered before the window
    for level in levels:
        # Each level's own warm-up (2 answered) comes first; requests in flight as the window opens
        # count in it when they complete inside it.
        assert level["sent"] == 22 and level["in_flight_at_end"] == 0 and level["errors"] == {}
        assert 18 <= level["completed"] <= 20
        assert 0 < level["p50_ms"] <= level["p90_ms"] <= level["p99_ms"] <= level["max_ms"]
    printed = capsys.readouterr()
    assert "rps" in printed.out and "p99_ms" in printed.out
    assert "closed 1: window 1" in printed.err and "closed 2: window 1" in printed.err  # a live line per level
    assert (tmp_path / "report.csv").read_text().count("\n") == 3


def test_open_loop_beyond_capacity_counts_resource_exhausted(start_server, tmp_path):
    _, port = start_server(queue_depth=1, max_batch=1)
    report = tmp_path / "report.json"
    assert main(["--server", f"127.0.0.1:{port}", "--rate", "400", "--requests", "200", "--sizes", "512x512",
                 "--scales", "512", "--warmup", "0", "--json", str(report)]) == 0
    level = json.loads(report.read_text())[0]
    assert level["mode"] == "open" and level["sent"] == 200 and level["in_flight_at_end"] == 0
    assert level["errors"].get("RESOURCE_EXHAUSTED", 0) > 0
    assert level["completed"] + sum(level["errors"].values()) == 200


def test_refuses_targets_that_are_not_loopback():
    with pytest.raises(SystemExit) as refused:
        main(["--server", "203.0.113.7:50051", "--requests", "1"])
    assert refused.value.code == 2


def test_bearer_token_from_the_environment(start_server, tmp_path, monkeypatch):
    _, port = start_server(token="s3cret")
    report = tmp_path / "report.json"
    arguments = ["--server", f"127.0.0.1:{port}", "--concurrency", "1", "--requests", "3", "--sizes", "64x64",
                 "--warmup", "0", "--json", str(report)]
    monkeypatch.setenv("SCOREMAP_TOKEN", "wrong")
    assert main(arguments) == 0
    assert json.loads(report.read_text())[0]["errors"] == {"UNAUTHENTICATED": 3}
    monkeypatch.setenv("SCOREMAP_TOKEN", "s3cret")
    assert main(arguments) == 0
    assert json.loads(report.read_text())[0]["completed"] == 3


class Gated(scoring_pb2_grpc.DenseScoringServicer):
    """Answers the first `free` requests at once, then holds every other one until `release` is set."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.release = threading.Event()
        self.lock = threading.Lock()

    def Score(self, request, context):
        with self.lock:
            self.free -= 1
            held = self.free < 0
        if held:
            self.release.wait(10)
        return scoring_pb2.ScoreResponse()


@pytest.fixture
def gated():
    servicer = Gated(free=0)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    scoring_pb2_grpc.add_DenseScoringServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield servicer, channel
    servicer.release.set()
    channel.close()
    server.stop(0)


def test_open_loop_ends_on_time_against_a_stalled_server(gated):
    _, stub = gated  # never answers within the level
    limits = LoadLimits(max_in_flight=2, drain_grace_s=0.2)
    # A timeout beyond the window: no slot frees while it sends, however slow the machine, so exactly two go.
    plan = LevelPlan(duration_s=0.5, max_requests=1000, timeout_s=2.0, warmup=0)
    started = time.monotonic()
    report = open_loop(stub, [scoring_pb2.ScoreRequest()], rate=40, plan=plan, limits=limits)
    elapsed = time.monotonic() - started
    assert elapsed < 0.5 + 2.0 + 0.2 + 2.0  # duration + timeout + drain grace, and slack: never the stalled server's
    assert report.sent == 2 and report.completed == 0 and report.in_flight_at_end == 2


def test_answers_after_the_window_are_reported_apart_not_counted(gated):
    servicer, stub = gated
    servicer.free = 2  # each caller's first request is answered, its second held past the window
    threading.Timer(1.5, servicer.release.set).start()
    plan = LevelPlan(duration_s=0.5, max_requests=1000, timeout_s=5, warmup=0)
    report = closed_loop(stub, [scoring_pb2.ScoreRequest()], concurrency=2, plan=plan, limits=LoadLimits())
    assert report.sent == 4 and report.completed == 2 and report.in_flight_at_end == 2
    assert report.throughput_rps == pytest.approx(2 / report.duration_s)


def test_each_level_warms_up_before_its_window(gated):
    servicer, stub = gated
    servicer.free = 3  # the warm-up's 3 answers, then the window sees only held requests
    threading.Timer(1.5, servicer.release.set).start()
    plan = LevelPlan(duration_s=0.3, max_requests=1000, timeout_s=5, warmup=3)
    report = closed_loop(stub, [scoring_pb2.ScoreRequest()], concurrency=1, plan=plan, limits=LoadLimits())
    assert report.sent == 4 and report.completed == 0 and report.in_flight_at_end == 1


def test_until_stable_runs_windows_until_the_rate_settles(server):
    channel = grpc.insecure_channel(server)
    try:
        plan = LevelPlan(duration_s=0.2, max_requests=100_000, timeout_s=5, warmup=2, until_stable=True,
                         stable_tolerance=0.9)
        report = closed_loop(channel, load_inputs(None, [(64, 64)],
                             ScoreOptions(), limits=LoadLimits()).requests, concurrency=1, plan=plan, limits=LoadLimits())
    finally:
        channel.close()
    assert report.stable is True and 3 <= report.windows <= LoadLimits().max_windows
    assert report.duration_s >= 3 * 0.2  # the report covers the last three windows
    assert report.completed > 0 and report.errors == {}


def test_server_side_split_from_the_servers_metrics(start_server, tmp_path):
    started, port = start_server(metrics_port=0)
    report = tmp_path / "report.json"
    assert main(["--server", f"127.0.0.1:{port}", "--concurrency", "2", "--requests", "10", "--sizes", "64x64",
                 "--metrics-url", f"http://127.0.0.1:{started.metrics_port}/metrics", "--json", str(report),
                 "--csv", str(tmp_path / "report.csv"), "--quiet"]) == 0
    [level] = json.loads(report.read_text())
    assert level["completed"] == 10
    for stage in ("queue", "preprocess", "inference", "postprocess"):
        assert level[f"server_{stage}_ms"] is not None and level[f"server_{stage}_ms"] >= 0
    assert level["server_inference_ms"] > 0 and level["server_batch_size"] >= 1
    assert "server_inference_ms" in (tmp_path / "report.csv").read_text().splitlines()[0]


def test_metrics_parse_and_split_by_stage_and_model():
    page = "\n".join([
        'scoremap_stage_seconds_sum{model="a",stage="inference"} 3.0',
        'scoremap_stage_seconds_count{model="a",stage="inference"} 4.0',
        'scoremap_stage_seconds_sum{model="b",stage="inference"} 100.0',
        'scoremap_stage_seconds_count{model="b",stage="inference"} 1.0',
        'scoremap_batch_size_sum{model="a"} 12.0',
        'scoremap_batch_size_count{model="a"} 4.0',
        'scoremap_dropped_total{model="a",reason="queue_time"} 2.0',
        'scoremap_dropped_total{model="a",reason="deadline"} 1.0',
        'scoremap_dropped_total{model="b",reason="queue_time"} 5.0',
        'scoremap_requests_total{code="OK",method="Score",model="a",process="front-0"} 6.0',
        'scoremap_requests_total{code="OK",method="Score",model="a",process="front-1"} 4.0',
        'scoremap_batch_cpu_seconds_total{model="a",process="engine"} 0.5',
    ]) + "\n"
    before = parse("", model="a")
    split = server_split(before, parse(page, model="a"))
    assert split["inference_ms"] == pytest.approx(750.0) and split["batch_size"] == 3.0
    assert math.isnan(split["queue_ms"])
    assert server_split(before, parse(page))["inference_ms"] == pytest.approx(103 / 5 * 1000)
    assert (parse(page, model="a").dropped, parse(page).dropped) == (3.0, 8.0)  # every reason
    assert (parse(page).answered, parse(page).batch_cpu_s) == (10.0, 0.5)  # every process's


def test_refuses_a_token_in_clear_text_to_a_remote_target(monkeypatch, caplog):
    from clients.loadtest.run import EXIT_REFUSED
    monkeypatch.setenv("SCOREMAP_TOKEN", "s3cret")
    assert main(["--server", "203.0.113.7:50051", "--allow-remote", "--requests", "1"]) == EXIT_REFUSED
    assert "clear text" in caplog.text


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a self-signed certificate")
def test_load_over_tls_with_a_token(start_server, tmp_path, monkeypatch):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    _, port = start_server(token="t0ken", tls=(cert.read_bytes(), key.read_bytes()))
    monkeypatch.setenv("SCOREMAP_TOKEN", "t0ken")
    report = tmp_path / "report.json"
    assert main(["--server", f"localhost:{port}", "--tls", "--root-cert", str(cert), "--concurrency", "1",
                 "--requests", "3", "--sizes", "64x64", "--warmup", "0", "--json", str(report)]) == 0
    assert json.loads(report.read_text())[0]["completed"] == 3


def test_defaults_come_from_the_client_settings():
    from clients.loadtest.run import build_parser
    from clients.batch.score_cli import build_parser as score_parser
    from clients.api.settings import BATCH_RETRY_BUDGET_S, ClientSettings
    assert build_parser().parse_args(["--server", "127.0.0.1:1"]).timeout == ClientSettings.timeout_s
    arguments = score_parser().parse_args(["x", "--out", "o", "--server", "127.0.0.1:1"])
    assert arguments.retry_for == BATCH_RETRY_BUDGET_S and arguments.timeout == ClientSettings.timeout_s


@pytest.mark.parametrize("argv, flag, says", [
    (["--server", "127.0.0.1:70000"], "--server", "port from 0 to 65535"),
    (["--concurrency", "0"], "--concurrency", "from 1 to 256"),
    (["--concurrency", "1,300"], "--concurrency", "from 1 to 256"),
    (["--rate", "0"], "--rate", "from 0.01 to 20000"),
    (["--duration", "-1"], "--duration", "from 0.001 to 600"),
    (["--requests", "0"], "--requests", "from 1 to 100000"),
    (["--stable-within", "0"], "--stable-within", "from 0.1 to 100"),
    (["--sizes", "224x0"], "--sizes", "positive sizes"),
    (["--scales", "0"], "--scales", ">= 1"),
    (["--stride", "-1"], "--stride", ">= 0"),
    (["--timeout", "-1"], "--timeout", ">= 0.001"),
    (["--warmup", "-1"], "--warmup", "from 0 to 100000"),
    (["--processes", "0"], "--processes", "from 1 to 64"),
    (["--processes", "many"], "--processes", "expected an integer from 1 to 64"),
    (["--connections", "0"], "--connections", "from 1 to 64"),
    (["--server-pid", "0"], "--server-pid", ">= 1"),
])
def test_every_numeric_flag_is_range_checked_before_anything_is_sent(capsys, argv, flag, says):
    """Exit 2 naming the flag, before the (unreachable) server is contacted."""
    from clients.loadtest.run import main as loadtest_main

    server = [] if argv[0] == "--server" else ["--server", "127.0.0.1:1"]
    with pytest.raises(SystemExit) as exited:
        loadtest_main([*server, *argv])
    error = capsys.readouterr().err
    assert exited.value.code == 2 and f"argument {flag}: " in error and says in error


def test_bad_files_in_images_are_skipped_counted_and_named(server, photos, tmp_path, caplog):
    """One bad file in a real photo folder is skipped and named; the run goes on with the others."""
    whole = sorted(photos.glob("*.jpg"))[0].read_bytes()
    (photos / "truncated.jpg").write_bytes(whole[:len(whole) // 3])
    (photos / "empty.png").write_bytes(b"")
    (photos / "text.jpg").write_text("not a photo")
    report = tmp_path / "report.json"
    assert main(["--server", server, "--concurrency", "1", "--requests", "12", "--images", str(photos),
                 "--json", str(report), "--quiet"]) == 0
    level = json.loads(report.read_text())[0]
    assert level["errors"] == {} and level["completed"] == 12  # nothing of the bad files was sent
    warning = " ".join(record.getMessage() for record in caplog.records)
    assert "skipped 3 of the files" in warning
    assert all(name in warning for name in ("truncated.jpg", "empty.png", "text.jpg"))
    inputs = load_inputs(str(photos), [], ScoreOptions(), limits=LoadLimits())
    assert len(inputs.requests) == 6 and sorted(Path(p).name for p, _ in inputs.skipped) == \
        ["empty.png", "text.jpg", "truncated.jpg"]


def test_a_server_pid_that_is_no_process_here_is_refused(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--server", "127.0.0.1:1", "--server-pid", str(2**22 + 1)])  # above Linux's largest pid
    assert exited.value.code == 2 and "no such process on this machine" in capsys.readouterr().err


def test_a_folder_of_only_bad_files_is_refused_naming_them(tmp_path, capsys):
    (tmp_path / "empty.png").write_bytes(b"")
    with pytest.raises(SystemExit) as exited:
        main(["--server", "127.0.0.1:1", "--images", str(tmp_path)])
    error = capsys.readouterr().err
    assert exited.value.code == 2 and "no usable images" in error and "empty.png" in error


def test_a_big_tiff_folder_is_usable(tmp_path):
    """BigTIFF files, which the server opens, are sent, not skipped as not images."""
    from PIL import Image

    Image.new("RGB", (40, 30), (10, 200, 30)).save(tmp_path / "big.tif", big_tiff=True)
    inputs = load_inputs(str(tmp_path), [], ScoreOptions(), limits=LoadLimits())
    assert inputs.skipped == [] and len(inputs.requests) == 1
    assert inputs.requests[0].encoded == (tmp_path / "big.tif").read_bytes()
