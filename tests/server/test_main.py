"""`scoremap-serve` as users run it: a subprocess, --port 0, SIGTERM drains; refusals before models load."""

import os
import pathlib
import queue
import re
import shutil
import signal
import socket
import subprocess
import time
import sys
import threading
import urllib.request

import grpc
import numpy as np
import onnx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import scoring_pb2, scoring_pb2_grpc
from server.main import StartRefused, main, model_sources, parse_args, settings_from
from tests.server.conftest import raw_request
from tests.signal_threads import TGKILL, signal_another_thread
from tests.tiny_models import heavy_net

PIXELS = np.random.default_rng(5).integers(0, 256, (64, 64, 3), dtype=np.uint8)


def serve_command() -> list[str]:
    script = shutil.which("scoremap-serve", path=os.path.dirname(sys.executable))
    return [script] if script else [sys.executable, "-m", "server.main"]


def in_flight_calls(metrics_url: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith("scoremap_in_flight "))


def test_flags_become_settings():
    settings = settings_from(parse_args(["m.onnx", "--memory-budget", "2GiB", "--max-batch", "1", "--no-warm-up",
                                         "--warm-up-scales", "224", "384", "--max-image-pixels", "1000",
                                         "--stream-idle-seconds", "5", "--max-calls-per-peer", "3", "--expose-paths",
                                         "--shape-buckets", "384x512,512x384", "--max-request-host-bytes", "1GiB"]))
    assert settings.memory_budget_bytes == 2 * 2**30 and settings.max_batch == 1 and not settings.warm_up
    assert settings.warm_up_scales == (224, 384) and settings.max_image_pixels == 1000
    assert settings.stream_idle_seconds == 5 and settings.max_calls_per_peer == 3 and settings.expose_paths
    assert settings.shape_buckets == ((384, 512), (512, 384)) and settings.max_request_host_bytes == 2**30
    assert parse_args(["m.onnx"]).host == "127.0.0.1"
    for wait in ("0", "-5"):
        with pytest.raises(StartRefused, match="--max-queue-ms must be above 0"):
            settings_from(parse_args(["m.onnx", "--max-queue-ms", wait]))
    with pytest.raises(StartRefused, match="--reserved-workers 4 leaves none of the 4 --grpc-workers"):
        settings_from(parse_args(["m.onnx", "--grpc-workers", "4", "--reserved-workers", "4"]))
    with pytest.raises(StartRefused, match="--max-calls-per-peer 16 lets one client address hold all 6 workers"):
        settings_from(parse_args(["m.onnx", "--grpc-workers", "8"]))  # the default per-peer limit, fewer workers
    assert settings_from(parse_args(["m.onnx", "--grpc-workers", "8", "--max-calls-per-peer", "5"])).grpc_workers == 8
    assert settings_from(parse_args(["m.onnx", "--grpc-workers", "8", "--max-calls-per-peer", "0"])).grpc_workers == 8


@pytest.mark.parametrize("flag", ["--memory-budget", "--max-request-host-bytes", "--host-memory-budget"])
def test_a_memory_size_of_zero_exits_2_naming_the_flag_before_any_model_loads(flag, capsys):
    with pytest.raises(SystemExit) as exited:
        parse_args(["m.onnx", flag, "0"])
    assert exited.value.code == 2 and f"argument {flag}: got '0'; expected a memory size above zero" in \
        capsys.readouterr().err


def test_models_are_paths_or_all_named(tmp_path, capsys):
    assert model_sources(["a.onnx", "b.onnx"]) == ["a.onnx", "b.onnx"]
    assert model_sources(["s32=a.onnx", "s16=dir/a=b.onnx"]) == {"s32": "a.onnx", "s16": "dir/a=b.onnx"}
    odd = tmp_path / "x=y.onnx"
    odd.write_bytes(b"")
    assert model_sources([str(odd)]) == [str(odd)]  # an existing file is a path, whatever its name
    for models, words in ((["a=x.onnx", "y.onnx"], "name every model or none"),
                          (["a=x.onnx", "a=y.onnx"], "two models are named 'a'")):
        with pytest.raises(SystemExit) as exited:
            parse_args(models)
        assert exited.value.code == 2 and words in capsys.readouterr().err


def test_two_versions_of_one_model_are_served_under_their_names(kit, tiny_model_path):
    from server.main import create_server
    from server.settings import Settings

    args = parse_args([f"plain={tiny_model_path}", f"other={tiny_model_path}"])
    server, port = create_server(args.models, settings=Settings(warm_up=False, intra_op_threads=1))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = scoring_pb2_grpc.DenseScoringStub(channel)
            assert [m.name for m in stub.ListModels(scoring_pb2.ListModelsRequest()).models] == ["plain", "other"]
            assert stub.Score(kit.raw_request(PIXELS, model="other", scales=[64])).model == "other"
    finally:
        server.stop(0).wait(10)


def test_help_and_version_import_nothing_heavy():
    probe = ("import sys\nfrom server.main import parse_args\n"
             "for flag in ('--help', '--version'):\n"
             "    try:\n        parse_args([flag])\n    except SystemExit:\n        pass\n"
             "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'grpc', 'onnx', 'onnxruntime', 'torch', 'numpy', 'PIL'})\n"
             "print('HEAVY', heavy)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=os.getcwd())
    assert result.stdout.strip().endswith("HEAVY []"), result.stdout + result.stderr
    assert "scoremap-serve 0." in result.stdout  # --version
    text = result.stdout
    assert "(default: None)" not in text and not re.search(r"\btests?\b|factor", text.lower())
    for line in text.splitlines():
        assert line.count("(default:") <= 1, line
    from server.main import build_parser

    assert [action.dest for action in build_parser()._actions if not action.help] == []  # every flag explained


@pytest.mark.skipif(TGKILL is None, reason="tgkill's syscall number is not known on this machine")
def test_a_sigterm_the_kernel_hands_to_another_thread_still_drains_and_exits_zero(tiny_model_path):
    """Python runs a signal's handler in the main thread only, once its wait returns: an idle server's main thread
    (waiting for its stop, with no timeout, once SERVING) must wake for a SIGTERM that another of its threads (gRPC's,
    the batcher's) received."""
    served = Served([tiny_model_path, "--port", "0", "--intra-op-threads", "1", "--log-level", "INFO"])
    process = served.process
    try:
        served.wait_for("ready: health SERVING")
        time.sleep(0.5)  # the main thread's last look at the warm-up is over: it waits for its stop alone
        signal_another_thread(process.pid, signal.SIGTERM)
        try:
            code = process.wait(60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running 60 s after SIGTERM: {served.log}") from None
        assert code == 0 and "draining" in served.log, served.log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_sigterm_drains_in_flight_calls_refuses_new_ones_and_exits_zero(kit, tiny_model_path, tmp_path):
    """The in-flight call is an open stream: it keeps working through the drain, whatever the device."""
    log = tmp_path / "serve.log"
    process = subprocess.Popen(
        serve_command() + [tiny_model_path, "--port", "0", "--grace-seconds", "60", "--intra-op-threads", "1",
                           "--metrics-port", "0"],
        stdout=subprocess.PIPE, stderr=log.open("w"), text=True,
    )
    try:
        line = process.stdout.readline()
        assert line.startswith("scoremap-serve listening on 127.0.0.1:"), (line, log.read_text())
        port = int(line.rsplit(":", 1)[1])
        metrics_url = process.stdout.readline().split()[-1]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while health.Check(health_pb2.HealthCheckRequest(), timeout=10).status != health_pb2.HealthCheckResponse.SERVING:
                time.sleep(0.05)  # scoring is refused (UNAVAILABLE) until the warm-up is done
            stub = scoring_pb2_grpc.DenseScoringStub(channel)
            outbox: queue.Queue = queue.Queue()
            answers = stub.ScoreStream(iter(outbox.get, None), timeout=120)
            outbox.put(kit.raw_request(PIXELS, scales=[64], request_id="before"))
            assert next(answers).request_id == "before"
            assert in_flight_calls(metrics_url) == 1
            process.send_signal(signal.SIGTERM)
            refused, ends = None, time.monotonic() + 60
            while refused is None:
                assert time.monotonic() < ends, f"still serving 60 s after SIGTERM: {log.read_text()}"
                try:
                    stub.ListModels(scoring_pb2.ListModelsRequest(), timeout=10)
                except grpc.RpcError as error:
                    refused = error
            assert refused.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.details()
            outbox.put(kit.raw_request(PIXELS, scales=[64], request_id="during"))
            assert next(answers).request_id == "during"  # the in-flight call goes on during the grace period
            assert process.poll() is None
            outbox.put(None)
            assert list(answers) == []
        assert process.wait(60) == 0 and "draining" in log.read_text()
    finally:
        if channel is not None:
            channel.close()
        if process.poll() is None:
            process.kill()
            process.wait()


def refusal(argv, capsys, environ=None) -> str:
    """`scoremap-serve argv` in this process: it must refuse with exit status 2 and one line on stderr."""
    previous = dict(os.environ)
    os.environ.pop("SCOREMAP_TOKEN", None)
    os.environ.update(environ or {})
    try:
        assert main(argv) == 2
    finally:
        os.environ.clear()
        os.environ.update(previous)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_an_empty_blank_or_unreadable_token_refuses_to_start(tmp_path, capsys):
    """Checked before any model loads: the model named here does not even exist."""
    model = str(tmp_path / "never-loaded.onnx")
    empty, blank = tmp_path / "empty", tmp_path / "blank"
    empty.write_text("")
    blank.write_text(" \n\t\n")
    for token_file in (empty, blank):
        message = refusal([model, "--token-file", str(token_file)], capsys)
        assert str(token_file) in message and "empty" in message
    message = refusal([model, "--token-file", str(tmp_path / "absent")], capsys)
    assert "absent" in message and "cannot read" in message
    message = refusal([model], capsys, environ={"SCOREMAP_TOKEN": "  "})
    assert "$SCOREMAP_TOKEN" in message and "empty" in message
    two_lines = tmp_path / "two"
    two_lines.write_text("abc\ndef\n")
    assert "one word" in refusal([model, "--token-file", str(two_lines)], capsys)


def test_binding_beyond_loopback_wants_tls_a_token_or_insecure(tmp_path, capsys):
    model = str(tmp_path / "never-loaded.onnx")
    message = refusal([model, "--host", "0.0.0.0", "--port", "0"], capsys)
    assert "--host 0.0.0.0" in message and "--insecure" in message and "--token-file" in message
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    message = refusal([model, "--host", "0.0.0.0", "--port", "0", "--token-file", str(token)], capsys)
    assert "clear text" in message and "--tls-cert" in message  # a token without TLS could be read and replayed
    for extra in (["--insecure"], ["--insecure", "--token-file", str(token)]):  # allowed: it gets as far as loading
        message = refusal([model, "--host", "0.0.0.0", "--port", "0", *extra], capsys)
        assert "never-loaded.onnx" in message and "cannot start" in message


def test_numeric_flags_out_of_range_exit_2_naming_the_flag_before_models_load(tmp_path, capsys):
    """Each bad value exits 2 naming its own flag before any model loads: unchecked, --port 70000 would listen
    on 4464, --port -5 blame --host, --metrics-port 70000 die of an OverflowError after loading, --max-batch 0
    fail only in warm-up."""
    model = str(tmp_path / "never-loaded.onnx")
    for flag, value in (("--port", "70000"), ("--port", "-5"), ("--metrics-port", "70000"), ("--max-batch", "0"),
                        ("--queue-depth", "0"), ("--max-message-bytes", str(2**31)), ("--max-scales", "x"),
                        ("--keepalive-seconds", "nan"), ("--warm-up-scales", "0"), ("--host-memory-fraction", "2")):
        with pytest.raises(SystemExit) as exited:
            main([model, flag, value])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and f"argument {flag}: got '{value}'" in err, err
        assert "never-loaded" not in err and "Traceback" not in err


def test_every_setting_is_a_flag_with_its_default_and_the_reference_table_is_made_from_them():
    import dataclasses
    import pathlib

    from server import settings as declared
    from server.settings import Settings

    assert settings_from(parse_args(["m.onnx"])) == Settings()  # each flag's default is its setting's
    names = [field.name for field in dataclasses.fields(Settings)]
    grouped = [field.name for group in declared.GROUPS.values() for field in dataclasses.fields(group)]
    assert sorted(names) == sorted(grouped) and len(set(grouped)) == len(grouped)  # each in exactly one group
    page = (pathlib.Path(__file__).parents[2] / "docs" / "reference.md").read_text()
    start = page.index("<!-- settings table")
    table = page[page.index("\n", start) + 1:page.index("<!-- end of settings table -->")]
    assert table == declared.markdown_table(), "regenerate it: python -m docs.reference"


def test_metrics_beyond_loopback_are_warned_of(tmp_path, capsys, caplog):
    model = str(tmp_path / "never-loaded.onnx")
    for address, warned in (("127.0.0.1", False), ("0.0.0.0", True)):
        caplog.clear()
        refusal([model, "--port", "0", "--metrics-port", "0", "--metrics-address", address], capsys)
        assert any("metrics on 0.0.0.0 are open to anyone" in r.getMessage() for r in caplog.records) == warned


def test_a_busy_port_is_one_line_and_exit_2_before_models_load(tmp_path, capsys):
    model = str(tmp_path / "never-loaded.onnx")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        message = refusal([model, "--port", str(taken)], capsys)
        assert f"--port {taken}" in message and "in use" in message
        message = refusal([model, "--port", "0", "--metrics-port", str(taken)], capsys)
        assert f"--metrics-port {taken}" in message and "in use" in message
        result = subprocess.run(serve_command() + [model, "--port", str(taken)], capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
        assert "add_port" not in result.stderr and "Traceback" not in result.stderr


def test_missing_model_file_fails_to_start_with_a_clear_message(tmp_path, capsys):
    message = refusal([str(tmp_path / "absent.onnx"), "--port", "0"], capsys)
    assert "absent.onnx" in message


def test_a_port_in_use_is_refused_by_create_server_too(tiny_model_path):
    from server.errors import ScoringError
    from server.main import create_server
    from server.settings import Settings

    settings = Settings(warm_up=False, intra_op_threads=1)
    first, port = create_server([tiny_model_path], settings=settings)
    try:
        with pytest.raises(ScoringError, match=f"could not bind 127.0.0.1:{port}"):
            create_server([tiny_model_path], address=f"127.0.0.1:{port}", settings=settings)
    finally:
        first.stop(0).wait(10)


def watch_health(port: int) -> list:
    """Health statuses of the scoring service as Watch reports them, until SERVING or the stream ends."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        check = health_pb2.HealthCheckRequest(service="scoremap.v1.DenseScoring")
        statuses = [health.Check(check).status]
        watch = health.Watch(check, timeout=60)
        for answer in watch:
            statuses.append(answer.status)
            if answer.status == health_pb2.HealthCheckResponse.SERVING:
                break
        watch.cancel()
        return statuses


def test_health_says_not_serving_until_warm_up_is_done(tiny_model_path):
    from server.main import create_server
    from server.settings import Settings

    server, port = create_server([tiny_model_path], settings=Settings(intra_op_threads=1), wait_until_ready=False)
    try:
        statuses = watch_health(port)
        assert statuses[0] == health_pb2.HealthCheckResponse.NOT_SERVING
        assert statuses[-1] == health_pb2.HealthCheckResponse.SERVING and server.warm_up_error is None
    finally:
        server.stop(0).wait(10)


def test_the_tile_canvas_is_made_once_serving_not_before(tiny_model_path, caplog):
    """The tile canvas only images larger than every bucket use is made after health says SERVING (2 s of the
    default model's start-up on 2 cores: docs/design.md), and made all the same: a photo arriving later makes no plan."""
    import logging

    from server.main import create_server
    from server.scoring.loading import tiled_plans
    from server.settings import Settings

    caplog.set_level(logging.INFO)
    server, _port = create_server([tiny_model_path], settings=Settings(intra_op_threads=1, tile_canvas=(256, 256)))
    try:
        model = server.pipeline._model("")
        [tile_plan] = tiled_plans(model)
        assert tile_plan in {record.key for record in server.pipeline.engine.budget.plans()}
        said = [record.getMessage() for record in caplog.records]
        ready = said.index("ready: health SERVING")
        made = next(i for i, line in enumerate(said) if f"planned {tile_plan}" in line)
        assert made > ready, said
    finally:
        server.stop(0).wait(10)


def wrong_layout_net(path: str) -> str:
    """The tiny net with a card claiming NHWC input: it loads, and every pass it runs fails (a Keras-style mix-up)."""
    from convert.card import read_card, write_card
    from protos import model_card_pb2

    model = onnx.load(path)
    card = read_card(model)
    card.preprocessing.layout = model_card_pb2.LAYOUT_NHWC
    broken = path.replace(".onnx", "-nhwc.onnx")
    onnx.save(write_card(model, card), broken)
    return broken


def test_a_failed_warm_up_keeps_health_not_serving(tiny_model_path, caplog):
    from server.main import create_server
    from server.settings import Settings

    server, port = create_server([wrong_layout_net(tiny_model_path)], settings=Settings(intra_op_threads=1))
    try:
        assert server.warm_up_error is not None and "warm-up failed" in caplog.text
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            for service in ("", "scoremap.v1.DenseScoring"):
                check = health_pb2.HealthCheckRequest(service=service)
                status = health_pb2_grpc.HealthStub(channel).Check(check).status
                assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        server.stop(0).wait(10)


def test_scoremap_serve_exits_3_when_warm_up_fails(tiny_model_path):
    result = subprocess.run(serve_command() + [wrong_layout_net(tiny_model_path), "--port", "0", "--intra-op-threads", "1"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr
    assert "warm-up failed" in result.stderr.splitlines()[-1]


def test_create_server_refuses_a_busy_metrics_port_with_its_error_type(tiny_model_path):
    from server.errors import ScoringError
    from server.main import create_server
    from server.settings import Settings

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        settings = Settings(warm_up=False, intra_op_threads=1, metrics_port=busy.getsockname()[1])
        with pytest.raises(ScoringError, match="--metrics-port"):
            create_server([tiny_model_path], settings=settings)


def test_a_name_counts_as_loopback_for_the_server_binding_it_never_for_a_client_sending_a_token(monkeypatch):
    """One is_loopback, two deliberate behaviours: the server resolves the name it binds; a client about to
    send a token in clear text trusts only a literal loopback address (a name's resolution can change)."""
    from protos import is_loopback

    for literal in ("127.0.0.1", "127.0.0.1:5", "[::1]:5", "[::1]", "::1", "localhost:5"):
        assert is_loopback(literal) and is_loopback(literal, resolve=True), literal
    for remote in ("10.0.0.1:5", "[2001:db8::1]:5", "0.0.0.0"):
        assert not is_loopback(remote) and not is_loopback(remote, resolve=True), remote
    answers = {"inside.example": "127.0.0.2", "outside.example": "192.0.2.1"}
    monkeypatch.setattr(socket, "getaddrinfo",
                        lambda host, *_args, **_kw: [(0, 0, 0, "", (answers[host], 0))] if host in answers
                        else (_ for _ in ()).throw(socket.gaierror(-2, "Name or service not known")))
    assert is_loopback("inside.example", resolve=True) and is_loopback("inside.example:5", resolve=True)
    assert not is_loopback("inside.example:5")  # a client never sends a token in clear on a name's word
    assert not is_loopback("outside.example", resolve=True) and not is_loopback("nowhere.example", resolve=True)


def test_a_no_flag_reads_as_turning_its_setting_off():
    """The reference row of `--no-warm-up` says what the flag turns off, never what the setting does when on."""
    from server import settings as declared

    row = next(line for line in declared.markdown_table().splitlines() if line.startswith("| `--no-warm-up`"))
    assert row == ("| `--no-warm-up` | warm-up on | turn warm-up off (on by default: run every warm-up scale and "
                   "stride once before reporting SERVING, and the tile canvas of images larger than every bucket "
                   "once SERVING) |")
    from server.main import build_parser

    assert "turn warm-up off" in " ".join(build_parser().format_help().split())


@pytest.mark.parametrize("flags, words", [
    (["--min-scale", "1000", "--max-scale", "500"], "--min-scale 1000 is above --max-scale 500"),
    (["--min-scale", "500", "--max-scale", "2048", "--warm-up-scales", "384"],
     "--warm-up-scales 384 outside [500, 2048] (--min-scale, --max-scale)"),
    (["--max-scale", "2048", "--warm-up-scales", "5000"], "--warm-up-scales 5000 outside [1, 2048]"),
])
def test_scale_flags_that_contradict_exit_2_naming_them_before_models_load(tmp_path, capsys, flags, words):
    """Contradicting scale flags are refused before any model is loaded or warmed up, naming the flags."""
    message = refusal([str(tmp_path / "never-loaded.onnx"), "--port", "0", *flags], capsys)
    assert words in message, message


def test_an_http_port_the_same_as_the_grpc_port_exits_2_before_models_load(tmp_path, capsys):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    message = refusal([str(tmp_path / "never-loaded.onnx"), "--port", port, "--http-port", port], capsys)
    assert f"--http-port {port} is the same as --port" in message, message


@pytest.mark.parametrize("flags, words", [
    (["--warm-up-scales", "100"], "--warm-up-scales 100 is below efficientnet-lite0's training size 224"),
    (["--min-scale", "500"], "default scale 384 (the warm-up scale without --warm-up-scales) is outside the scales"),
    (["--warm-up-scales", "1024", "--memory-budget", "64MiB"],
     "beyond the memory budget of 64.0 MiB: give a smaller --warm-up-scales, or a larger --memory-budget"),
    (["--memory-budget", "512MiB", "--cpu-runners", "4"],  # one runner's warm-up plans fit it
     "running at once (--cpu-runners), beyond the memory budget of 512.0 MiB it may use: give a smaller "
     "--warm-up-scales, fewer --cpu-runners, or a larger --memory-budget"),
])
def test_a_warm_up_scale_the_model_cannot_serve_exits_2_naming_the_flag(default_model_path, flags, words):
    """Checked once the model is loaded, before warm-up: a bad command line (2), not a warm-up failure (3)."""
    result = subprocess.run(serve_command() + [default_model_path, "--port", "0", "--intra-op-threads", "1", *flags],
                            capture_output=True, text=True, timeout=120)
    last = result.stderr.splitlines()[-1]
    assert result.returncode == 2 and "cannot start" in last and words in last, result.stderr


@pytest.mark.parametrize("content", [pathlib.Path(__file__).parents[2].joinpath("samples", "cat.jpg").read_bytes(),
                                     b"a text file, not a model\n", b""])
def test_a_file_that_is_not_onnx_is_named_with_the_fix(tmp_path, capsys, content):
    """Named with the fix, never protobuf's `Error parsing message with type 'onnx.ModelProto': Wire format was
    corrupt`."""
    path = tmp_path / "photo.onnx"
    path.write_bytes(content)
    message = refusal([str(path), "--port", "0", "--no-warm-up"], capsys)
    assert f"{path} is not an ONNX file" in message and "scoremap-convert" in message, message
    assert "Wire format" not in message


class Served:
    """`scoremap-serve` in a subprocess with its stderr read as it comes, so a test can act at a moment it names."""

    def __init__(self, argv: list[str]) -> None:
        self.process = subprocess.Popen(serve_command() + argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True)
        self.lines: list[str] = []
        self._said = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stderr:
            with self._said:
                self.lines.append(line)
                self._said.notify_all()
        with self._said:
            self.lines.append("")  # the end of stderr
            self._said.notify_all()

    def wait_for(self, words: str) -> None:
        """Until stderr says `words` (the process ending first fails the test)."""
        with self._said:
            self._said.wait_for(lambda: any(words in line for line in self.lines) or "" in self.lines, timeout=300)
            assert any(words in line for line in self.lines), "".join(self.lines)

    @property
    def log(self) -> str:
        with self._said:
            return "".join(self.lines)


def slow_tile_canvas_net(path) -> str:
    """A net whose 1024x1024 tile canvas plan takes a while to make (two runs of full-resolution 3x3 convolutions)
    while its 64 px warm-up plans take little: background planning is still under way once SERVING."""
    onnx.save(heavy_net(width=16, depth=2), path)
    return str(path)


@pytest.mark.parametrize("moment", ["loading", "warming up", "planning in the background", "under load", "draining"])
def test_sigterm_at_any_moment_ends_in_a_clean_exit_0(tmp_path, moment):
    """SIGTERM while the models load, during the warm-up, just after SERVING while the tile canvas plan is made in
    the background, with calls in flight, or again during the drain once its grace is over with batches running:
    exit status 0 each time, never 134 (a thread left inside onnxruntime as the process exits aborts it)."""
    grace = "0.2" if moment == "draining" else "10"
    served = Served([slow_tile_canvas_net(tmp_path / "heavy.onnx"), "--port", "0", "--metrics-port", "0",
                     "--intra-op-threads", "1", "--warm-up-scales", "64", "--tile-canvas", "1024x1024",
                     "--grace-seconds", grace])
    process, calls, channel = served.process, [], None
    try:
        if moment == "loading":
            served.wait_for("starting: loading")
        else:
            line = process.stdout.readline()
            assert "listening on" in line, served.log
            port, metrics_url = int(line.rsplit(":", 1)[1]), process.stdout.readline().split()[-1]
            if moment == "warming up":
                served.wait_for("planned")  # the first warm-up plan is made; others follow
            else:
                served.wait_for("ready: health SERVING")  # the tile canvas plan is being made in the background
        if moment in ("under load", "draining"):
            channel = grpc.insecure_channel(f"127.0.0.1:{port}")
            stub = scoring_pb2_grpc.DenseScoringStub(channel)
            pixels = np.random.default_rng(7).integers(0, 256, (512, 512, 3), dtype=np.uint8)
            calls = [stub.Score.future(raw_request(pixels, scales=[512], request_id=str(n)), timeout=120)
                     for n in range(3)]
            while in_flight_calls(metrics_url) < 1:
                time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        if moment == "draining":
            served.wait_for("draining")
            process.send_signal(signal.SIGTERM)  # impatient: a second one changes nothing
        assert process.wait(300) == 0, served.log
        for call in calls:  # answered, scored or refused, never failed inside the server
            assert call.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), call.details()
        assert "Traceback" not in served.log and "terminate called" not in served.log, served.log
        assert "stopped" in served.log.splitlines()[-1], served.log
    finally:
        if channel is not None:
            channel.close()
        if process.poll() is None:
            process.kill()
            process.wait()
