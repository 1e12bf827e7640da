import json
import shutil
import subprocess
import threading
import time

import pytest

from clients.latency import Sample, format_table, summarise, to_csv, to_json
from clients.loadtest import main


def test_summary_counts_percentiles_and_errors_by_status():
    samples = [Sample(ms / 1000, "OK") for ms in range(1, 101)] + [Sample(0.5, "RESOURCE_EXHAUSTED")] * 3
    report = summarise("open", 50.0, samples, sent=105, duration_s=2.0)
    assert (report.sent, report.completed) == (105, 100)
    assert report.throughput_rps == 50.0
    assert report.p50_ms == pytest.approx(50.5) and report.p99_ms == pytest.approx(99.01) and report.max_ms == 100
    assert report.errors == {"RESOURCE_EXHAUSTED": 3}
    assert "RESOURCE_EXHAUSTED=3" in format_table([report]) and "RESOURCE_EXHAUSTED=3" in to_csv([report])
    none_ok = summarise("closed", 1, [Sample(1.0, "UNAVAILABLE")], sent=1, duration_s=1.0)
    assert json.loads(to_json([none_ok]))[0]["p50_ms"] is None


def test_closed_loop_sweep_at_low_load_has_no_errors(server, tmp_path, capsys):
    report = tmp_path / "report.json"
    assert main(["--server", server, "--concurrency", "1,2", "--requests", "20", "--sizes", "64x96,96x64",
                 "--json", str(report), "--csv", str(tmp_path / "report.csv")]) == 0
    levels = json.loads(report.read_text())
    assert [level["level"] for level in levels] == [1, 2]
    for level in levels:
        assert level["sent"] == level["completed"] == 20 and level["errors"] == {}
        assert 0 < level["p50_ms"] <= level["p90_ms"] <= level["p99_ms"] <= level["max_ms"]
    assert "throughput_rps" in capsys.readouterr().out
    assert (tmp_path / "report.csv").read_text().count("\n") == 3


def test_open_loop_beyond_capacity_counts_resource_exhausted(start_server, tmp_path):
    _, port = start_server(queue_depth=1, max_batch=1)
    report = tmp_path / "report.json"
    assert main(["--server", f"127.0.0.1:{port}", "--rate", "400", "--requests", "200", "--sizes", "512x512",
                 "--scales", "512", "--warmup", "0", "--json", str(report)]) == 0
    level = json.loads(report.read_text())[0]
    assert level["mode"] == "open" and level["sent"] == 200
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


def test_open_loop_ends_on_time_against_a_stalled_server():
    from concurrent import futures

    import grpc

    from clients.loadtest import LoadLimits, open_loop
    from protos import scoring_pb2, scoring_pb2_grpc

    release = threading.Event()

    class Stalled(scoring_pb2_grpc.DenseScoringServicer):
        def Score(self, request, context):
            release.wait(10)  # never answers within the level
            return scoring_pb2.ScoreResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    scoring_pb2_grpc.add_DenseScoringServicer_to_server(Stalled(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        limits = LoadLimits(max_in_flight=2, drain_grace_s=0.2)
        started = time.monotonic()
        report = open_loop(scoring_pb2_grpc.DenseScoringStub(channel), [scoring_pb2.ScoreRequest()], rate=40,
                           duration_s=0.5, max_requests=1000, timeout_s=0.5, limits=limits)
        elapsed = time.monotonic() - started
    finally:
        release.set()
        channel.close()
        server.stop(0)
    assert elapsed < 0.5 + 0.5 + 0.2 + 0.5  # duration + timeout + drain grace, and some slack
    assert report.sent == 2 and report.completed == 0


def test_refuses_a_token_in_clear_text_to_a_remote_target(monkeypatch, caplog):
    from clients.loadtest import EXIT_REFUSED
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
    from clients.loadtest import build_parser
    from clients.score_cli import build_parser as score_parser
    from clients.settings import BATCH_RETRY_BUDGET_S, ClientSettings
    assert build_parser().parse_args(["--server", "127.0.0.1:1"]).timeout == ClientSettings.timeout_s
    arguments = score_parser().parse_args(["x", "--out", "o", "--server", "127.0.0.1:1"])
    assert arguments.retry_for == BATCH_RETRY_BUDGET_S and arguments.timeout == ClientSettings.timeout_s
