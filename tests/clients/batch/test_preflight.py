import grpc
import onnx
import pytest

from clients.api.options import ScoreOptions
from clients.batch.files import read_records
from clients.batch.preflight import RunRefused, check_run
from clients.batch.score_cli import EXIT_REFUSED, EXIT_USAGE, main
from protos import scoring_pb2
from server.main import create_server
from server.settings import Settings
from tests.tiny_models import patch_net


def summary(name: str = "tiny", **fields) -> scoring_pb2.ModelSummary:
    return scoring_pb2.ModelSummary(name=name, classes=10, **fields)


def test_the_servers_defaults_are_made_explicit():
    model = summary(output_strides=[32, 16], min_scale=32, max_scale=1024, default_scale=64)
    resolved = check_run([model], ScoreOptions())
    assert (resolved.model, resolved.stride, tuple(resolved.scales)) == ("tiny", 32, (64,))
    assert check_run([model], ScoreOptions(stride=16, scales=(96, 128))).scales == (96, 128)
    assert check_run([summary()], ScoreOptions()).stride == 0  # a server that does not tell: nothing assumed
    uncapped = summary(output_strides=[32], min_scale=32, default_scale=64)  # max_scale 0: no cap
    assert check_run([uncapped], ScoreOptions(scales=(6048,))).scales == (6048,)
    with pytest.raises(RunRefused, match="--scales 16: model 'tiny' takes scales from 32"):
        check_run([uncapped], ScoreOptions(scales=(16, 64)))


@pytest.mark.parametrize("options, code, words", [
    (ScoreOptions(stride=8), grpc.StatusCode.INVALID_ARGUMENT, "gives strides 32, 16"),
    (ScoreOptions(scales=(64, 4096)), grpc.StatusCode.INVALID_ARGUMENT, "--scales 4096: model 'tiny' takes scales 32 to 1024"),
    (ScoreOptions(model="other"), grpc.StatusCode.NOT_FOUND, "no model named 'other'; loaded: tiny"),
])
def test_run_wide_mistakes_are_named_once(options, code, words):
    model = summary(output_strides=[32, 16], min_scale=32, max_scale=1024, default_scale=64)
    with pytest.raises(RunRefused) as refused:
        check_run([model], options)
    assert refused.value.code == code and words in refused.value.message


def test_two_models_and_no_model_named():
    with pytest.raises(RunRefused, match=r"2 models loaded \(a, b\); choose one with --model"):
        check_run([summary("a"), summary("b")], ScoreOptions())
    assert check_run([summary("a"), summary("b")], ScoreOptions(model="b")).model == "b"


@pytest.fixture
def two_models(tmp_path):
    paths = []
    for name in ("tiny", "tiny2"):
        paths.append(str(tmp_path / f"{name}.onnx"))
        onnx.save(patch_net(classes=10, name=name), paths[-1])
    started, port = create_server(paths, settings=Settings(warm_up=False))
    yield f"127.0.0.1:{port}"
    started.stop(0).wait(10)


def test_a_run_wide_mistake_stops_the_run_before_any_record(two_models, photos, tmp_path, caplog):
    out = tmp_path / "out"
    assert main([str(photos), "--out", str(out), "--server", two_models, "--no-progress"]) == EXIT_USAGE
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "choose one with --model" in errors[0].getMessage()
    assert not read_records(out / "results.jsonl")
    caplog.clear()
    assert main([str(photos), "--out", str(out), "--server", two_models, "--model", "nope",
                 "--no-progress"]) == EXIT_REFUSED
    assert "no model named 'nope'" in caplog.text and "re-run the same command" not in caplog.text
    assert not read_records(out / "results.jsonl")
    assert main([str(photos), "--out", str(out), "--server", two_models, "--model", "tiny2", "--no-progress"]) == 0
    assert {r["model"] for r in read_records(out / "results.jsonl").values()} == {"tiny2"}


@pytest.mark.parametrize("option, value, words", [("--stride", "8", "gives strides"), ("--scales", "16", "takes scales from 32")])
def test_a_stride_or_scale_the_model_cannot_take_is_one_message(server, photos, tmp_path, caplog, option, value, words):
    out = tmp_path / "out"
    assert main([str(photos), "--out", str(out), "--server", server, option, value, "--no-progress"]) == EXIT_USAGE
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and words in errors[0], errors
    assert not read_records(out / "results.jsonl")
