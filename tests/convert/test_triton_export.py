"""scoremap-export triton: a repository whose config is Triton's own ModelConfig, sized by the memory profile."""

import os
import subprocess

import onnx
import pytest
from google.protobuf import text_format

from convert.card import Precision, read_card, write_card
from convert.memory_model import Device
from convert.profile import largest_batch
from convert.triton_export import MAX_TRITON_BATCH, main
from tests.tiny_models import heavy_net, patch_net

model_config_pb2 = pytest.importorskip(
    "tritonclient.grpc.model_config_pb2", reason="Triton's ModelConfig comes with the `triton` extra: "
                                                "pip install -e '.[triton]'")


def exported(tmp_path, model: onnx.ModelProto, *args: str):
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    assert main(["triton", str(path), str(tmp_path / "repo"), *args]) == 0
    folder = tmp_path / "repo" / read_card(model).name
    config = text_format.Parse((folder / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    return folder, config


def test_config_parses_as_triton_model_config_with_the_cards_facts(tmp_path):
    folder, config = exported(tmp_path, patch_net(classes=10), "--scales", "64", "96", "--instances", "2")
    assert config.platform == "onnxruntime_onnx" and config.name == "tiny"
    (image,) = config.input
    assert (image.name, list(image.dims)) == ("image", [3, -1, -1])
    assert image.format == model_config_pb2.ModelInput.FORMAT_NCHW
    (scores,) = config.output
    assert list(scores.dims) == [10, -1, -1] and scores.label_filename == "labels.txt"
    assert (folder / "labels.txt").read_text().splitlines() == [f"class{i}" for i in range(10)]
    assert (folder / "1" / "model.onnx").stat().st_size > 0
    assert config.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_GPU
    assert config.instance_group[0].count == 2
    assert [list(w.inputs["image"].dims) for w in config.model_warmup] == [[3, 64, 96], [3, 96, 128]]
    (cuda,) = config.optimization.execution_accelerators.gpu_execution_accelerator
    assert cuda.name == "cuda" and cuda.parameters["cudnn_conv_algo_search"] == "HEURISTIC"


def test_max_batch_size_is_what_the_memory_profile_fits(tmp_path):
    model = heavy_net()
    folder, config = exported(tmp_path, model, "--gpu-memory", "512MiB", "--scales", "224")
    expected = largest_batch(model, height=224, width=320, budget_bytes=512 * 2**20, device=Device.CUDA)
    assert 1 <= expected < MAX_TRITON_BATCH and config.max_batch_size == expected
    assert max(config.dynamic_batching.preferred_batch_size) <= expected


def test_fp16_cards_get_fp16_tensorrt(tmp_path):
    model = patch_net(classes=4)
    card = read_card(model)
    card.precision = Precision.PRECISION_FP16
    _, config = exported(tmp_path, write_card(model, card), "--tensorrt")
    tensorrt, cuda = config.optimization.execution_accelerators.gpu_execution_accelerator
    assert (tensorrt.name, cuda.name) == ("tensorrt", "cuda") and tensorrt.parameters["precision_mode"] == "FP16"


def test_a_pass_larger_than_the_gpu_is_refused(tmp_path, capsys):
    path = tmp_path / "heavy.onnx"
    onnx.save(heavy_net(), path)
    assert main(["triton", str(path), str(tmp_path / "repo"), "--gpu-memory", "1MiB"]) == 1
    assert "more --gpu-memory" in capsys.readouterr().err


def test_files_that_are_not_converted_graphs_are_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "notes.onnx").write_text("not a graph")
    card_less = patch_net(classes=2)
    del card_less.metadata_props[:]
    onnx.save(card_less, tmp_path / "plain.onnx")
    for name, words in (("notes.onnx", "is not an ONNX file"), ("plain.onnx", "no model card")):
        assert main(["triton", str(tmp_path / name), str(tmp_path / "repo")]) == 1
        assert words in capsys.readouterr().err
    assert not (tmp_path / "repo").exists()


def test_real_triton_accepts_the_config(tmp_path):
    """The tritonserver of the nvidia-pytriton wheel parses the config; only the onnxruntime backend is missing."""
    distribution = pytest.importorskip("pytriton.utils.distribution",
                                       reason="tritonserver comes with the `triton` extra: pip install -e '.[triton]'")
    folder, _ = exported(tmp_path, patch_net(classes=10))
    binary = distribution.get_root_module_path() / "tritonserver" / "bin" / "tritonserver"
    environment = dict(os.environ, LD_LIBRARY_PATH=str(distribution.get_libs_path()))
    (tmp_path / "backends").mkdir()

    def load() -> str:
        finished = subprocess.run(
            [str(binary), f"--model-repository={folder.parent}", f"--backend-directory={tmp_path / 'backends'}",
             "--allow-http=false", "--allow-metrics=false", "--grpc-address=127.0.0.1", "--grpc-port=0"],
            env=environment, capture_output=True, text=True, timeout=60)
        return finished.stdout + finished.stderr

    log = load()
    assert "unable to find backend library for backend 'onnxruntime'" in log, log
    config = folder / "config.pbtxt"
    config.write_text(config.read_text().replace("TYPE_FP32", "TYPE_FP33"))
    log = load()
    assert "TYPE_FP33" in log and "unable to find backend library" not in log  # Triton parsed it: a typo is refused


@pytest.mark.parametrize("argv, flag, says", [
    (["--instances", "0"], "argument --instances: ", ">= 1"),
    (["--scales", "384", "0"], "argument --scales: ", ">= 1"),
    (["--max-queue-delay-us", "-1"], "argument --max-queue-delay-us: ", ">= 0"),
    (["--gpu-memory", "0"], "--gpu-memory: ", "above zero"),
])
def test_every_numeric_flag_is_range_checked_before_the_model_is_read(tmp_path, capsys, argv, flag, says):
    """Exit 2 naming the flag; the model does not exist, so nothing could have been read."""
    with pytest.raises(SystemExit) as exited:
        main(["triton", str(tmp_path / "missing.onnx"), str(tmp_path / "repo"), *argv])
    error = capsys.readouterr().err
    assert exited.value.code == 2 and flag in error and says in error
    assert not (tmp_path / "repo").exists()


def test_version():
    import sys

    from protos import version

    shown = subprocess.run([sys.executable, "-m", "convert.triton_export", "--version"], capture_output=True, text=True)
    assert shown.returncode == 0 and shown.stdout.strip() == f"scoremap-export {version()}"
