import json
import pathlib
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from convert.inspect_cli import main
from convert.precision import fp16_graph
from convert.profile import largest_batch, largest_square_size, parse_bytes, profile_model

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROFILE_KEYS = {"layers", "weights_bytes", "naive_activation_bytes", "peak_activation_bytes", "allowance_bytes",
              "predicted_peak_bytes"}
LAYER_KEYS = {"name", "op", "output_shape", "activations", "params", "macs", "bytes"}


@pytest.fixture(scope="module")
def small_model_path(tmp_path_factory) -> str:
    """Two convolutions, a ReLU and a 1x1 classifier over symbolic N, H, W; no model card."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
               for name, shape in (("w1", (16, 3, 3, 3)), ("w2", (10, 16, 1, 1)))]
    nodes = [helper.make_node("Conv", ["image", "w1"], ["c1"], strides=[2, 2], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2"], ["scores"], name="classifier")]
    graph = helper.make_graph(nodes, "small", [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, "H", "W"])],
                              [helper.make_tensor_value_info("scores", TensorProto.FLOAT, None)], weights)
    path = tmp_path_factory.mktemp("inspect") / "small.onnx"
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)]), path)
    return str(path)


def test_table_lists_every_layer_and_every_term(small_model_path, capsys):
    assert main([small_model_path, "--size", "64x96", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "no model card" in out
    for text in ("conv1", "relu1", "classifier", "2x16x32x48", "total", "weights", "naive sum", "live peak",
                 "weight copies", "session state", "run workspace", "1.1 x live peak", "predicted peak",
                 "memory planning saves", "Predicted peak on cpu"):
        assert text in out, text
    profile = profile_model(small_model_path, height=64, width=96, batch=2)
    assert f"{profile.macs:,}" in out and f"{profile.params:,}" in out


def test_json_has_the_profile_keys_and_the_budget_answers(small_model_path, capsys):
    assert main([small_model_path, "--size", "128", "--budget", "64MiB", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert PROFILE_KEYS <= document.keys()
    assert all(LAYER_KEYS == layer.keys() for layer in document["layers"])
    assert document["layers"][0]["output_shape"] == [1, 16, 64, 64]
    assert document["predicted_peak_bytes"] == (document["weights_bytes"] + document["peak_activation_bytes"]
                                                + document["allowance_bytes"])
    budget = parse_bytes("64MiB")
    assert document["largest_batch"] == largest_batch(small_model_path, height=128, width=128, budget_bytes=budget) > 1
    assert document["largest_square_size"] == largest_square_size(small_model_path, budget_bytes=budget) > 128


def test_dtype_fp16_sizes_the_half_precision_graph(small_model_path, capsys):
    main([small_model_path, "--size", "128", "--json"])
    full = json.loads(capsys.readouterr().out)
    main([small_model_path, "--size", "128", "--json", "--dtype", "fp16"])
    half = json.loads(capsys.readouterr().out)
    assert (full["dtype"], half["dtype"]) == ("fp32", "fp16")
    assert half["weights_bytes"] * 2 == full["weights_bytes"]


@pytest.mark.parametrize("argv, status, message", [
    (["--size", "64y64"], 2, "expected N or HxW"),
    (["--size", "64", "--budget", "lots"], 2, "cannot read 'lots' as a memory size"),
    (["--size", "64", "--batch", "0"], 2, "argument --batch: got '0'; expected an integer >= 1"),
    ([], 2, "has no model card naming a size: give --size HxW"),
])
def test_bad_requests_say_what_was_expected(small_model_path, capsys, argv, status, message):
    with pytest.raises(SystemExit) as exit_info:
        main([small_model_path, *argv])
    assert exit_info.value.code == status
    assert message in capsys.readouterr().err


def test_an_unprofilable_request_exits_1(small_model_path, tmp_path, capsys):
    half = tmp_path / "half.onnx"
    onnx.save(fp16_graph(onnx.load(small_model_path)), half)
    assert main([str(half), "--size", "64", "--dtype", "fp32"]) == 1
    assert "--dtype fp32 of a fp16 graph is not supported" in capsys.readouterr().err


@pytest.mark.parametrize("name, content, says", [
    ("nosuch.onnx", None, "'{path}': no such file; expected a converted .onnx file"),
    ("folder", "", "'{path}' is a folder; expected a converted .onnx file"),
    ("notes.onnx", b"not a model", "'{path}' is not an ONNX file"),
    ("empty.onnx", b"", "'{path}' is not an ONNX file"),
])
def test_a_model_path_that_is_no_onnx_file_is_a_usage_error(tmp_path, capsys, name, content, says):
    """`scoremap-inspect nosuch.onnx` exits 2 saying what is wrong, as scoremap-convert does, never 1 with a raw
    `[Errno 2]`."""
    path = tmp_path / name
    if content == "":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    assert main([str(path), "--size", "224"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("scoremap-inspect: ") and says.format(path=path) in error and "Errno" not in error
    assert "scoremap-convert" in error  # how to make one


def test_console_script_on_the_converted_default_model(default_model_path):
    done = subprocess.run([sys.executable, "-m", "convert.inspect_cli", default_model_path, "--size", "384x512",
                           "--batch", "2", "--budget", "2GiB"], capture_output=True, text=True, check=True)
    assert "Model 'efficientnet-lite0': 1000 classes" in done.stdout
    assert "Activations of batch 2 at 384x512 (fp32)" in done.stdout
    assert "Budget 2,048.0 MiB on cpu: largest batch at 384x512 = " in done.stdout


def test_without_size_the_card_and_its_default_scale_are_shown(default_model_path, capsys):
    assert main([default_model_path]) == 0
    out = capsys.readouterr().out
    assert "labels: tench, goldfish" in out and "input 'image': NCHW float32 RGB" in out
    assert "training size 224x224, default scale 384" in out
    assert "Activations of batch 1 at 384x384 (fp32)" in out


def test_device_cuda_prints_the_cuda_terms(small_model_path, capsys):
    from convert.memory_model import PROVIDER_TERMS, Device

    assert main([small_model_path, "--size", "128", "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "Predicted peak on cuda (one session):" in out and "0.8 x weights" in out and "2 x live peak" in out
    main([small_model_path, "--size", "128", "--device", "cuda", "--json"])
    document = json.loads(capsys.readouterr().out)
    cuda = PROVIDER_TERMS[Device.CUDA]
    assert document["device"] == "cuda"
    assert document["terms"]["session_state"] == cuda.session_bytes
    assert document["terms"]["run_workspace"] == cuda.workspace_bytes
    assert document["predicted_peak_bytes"] == profile_model(small_model_path, height=128, width=128,
                                                             device=Device.CUDA).predicted_peak_bytes


def test_the_converted_keras_nhwc_graph_is_inspected(tmp_path, capsys):
    from convert import convert_classifier
    from tests.convert.test_onnx_families import UNIT_RANGE, tf2onnx_classifier

    path = tmp_path / "keras.onnx"
    onnx.save(convert_classifier(tf2onnx_classifier(), preprocessing=UNIT_RANGE), path)
    assert main([str(path), "--size", "34x30", "--batch", "2", "--budget", "64MiB"]) == 0
    out = capsys.readouterr().out
    assert "input 'input_1': NHWC float32 RGB" in out
    assert "2x4x32x28" in out  # the first conv after the Transpose, NCHW inside the graph
    assert "largest batch at 34x30 = " in out


def test_a_graph_without_card_takes_its_layout_from_the_command_line(tmp_path, capsys):
    image = helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", "H", "W", 3])
    graph = helper.make_graph([helper.make_node("Transpose", ["image"], ["nchw"], perm=[0, 3, 1, 2], name="t"),
                               helper.make_node("Relu", ["nchw"], ["y"], name="relu")], "g", [image],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    path = tmp_path / "nhwc.onnx"
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)]), path)
    assert main([str(path), "--size", "8x6", "--layout", "NHWC"]) == 0
    assert "1x3x8x6" in capsys.readouterr().out


@pytest.mark.parametrize("argv, flag, says", [
    (["--batch", "0"], "--batch", ">= 1"),
    (["--size", "0x384"], "--size", "positive sizes"),
    (["--budget", "0"], "--budget", "above zero"),
])
def test_every_numeric_flag_is_range_checked_before_the_model_is_read(tmp_path, capsys, argv, flag, says):
    """Exit 2 naming the flag; the model does not exist, so nothing could have been read."""
    with pytest.raises(SystemExit) as exited:
        main([str(tmp_path / "missing.onnx"), *argv])
    error = capsys.readouterr().err
    assert exited.value.code == 2 and f"argument {flag}: " in error and says in error


def test_device_cuda_says_when_no_gpu_is_visible(small_model_path, capsys, monkeypatch):
    """`--device cuda` on a machine without a GPU says its figures are for a GPU it cannot see. Checked for real
    on either machine, in the command's own process: CUDA_VISIBLE_DEVICES='' hides
    every GPU (the runtime then sees no device), and on a GPU machine the plain command says nothing."""
    import os

    from convert.inspect_cli import cuda_visible

    def inspect(device: str, **env: str) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-m", "convert.inspect_cli", small_model_path, "--size", "128",
                               "--device", device], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(ROOT), **env})
        assert done.returncode == 0, done.stderr
        assert f"Predicted peak on {device}" in done.stdout
        return done

    assert "no CUDA device is visible" in inspect("cuda", CUDA_VISIBLE_DEVICES="").stderr
    assert "no CUDA device is visible" not in inspect("cpu").stderr
    if cuda_visible():
        assert "no CUDA device is visible" not in inspect("cuda").stderr
    else:  # the silent branch as a GPU machine takes it
        import convert.inspect_cli

        monkeypatch.setattr(convert.inspect_cli, "cuda_visible", lambda: True)
        assert main([small_model_path, "--size", "128", "--device", "cuda"]) == 0
        assert "no CUDA device is visible" not in capsys.readouterr().err


def test_version():
    from protos import version

    shown = subprocess.run([sys.executable, "-m", "convert.inspect_cli", "--version"], capture_output=True, text=True)
    assert shown.returncode == 0 and shown.stdout.strip() == f"scoremap-inspect {version()}"
