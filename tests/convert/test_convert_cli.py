"""scoremap-convert: exit codes, nothing written on failure, the --report comparison, preprocessing choices,
labels, factories from the current folder, a quiet output, file modes and a fast --help."""

import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

from convert.card import ChannelOrder, read_card
from convert.convert_cli import EXIT_CONVERSION, EXIT_OK, EXIT_USAGE, main
from tests.processes import with_umask_022

rng = np.random.default_rng(0)


ROOT = pathlib.Path(__file__).resolve().parents[2]
CONVERT = pathlib.Path(sys.executable).with_name("scoremap-convert")


def small_classifier(*, squeeze_excite: bool = False, classes: int = 3) -> onnx.ModelProto:
    """Pad-free conv → (optional global gate) → conv → flatten → Gemm at 12x12."""
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"], kernel_shape=[3, 3], strides=[2, 2])]
    body = "c0"
    if squeeze_excite:
        nodes += [helper.make_node("GlobalAveragePool", ["c0"], ["gate"]), helper.make_node("Mul", ["c0", "gate"], ["gated"])]
        body = "gated"
    nodes += [helper.make_node("Relu", [body], ["r0"]), helper.make_node("Flatten", ["r0"], ["flat"]),
              helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["out"], transB=1)]
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.01).astype(np.float32), n)
             for n, s in [("w0", (4, 3, 3, 3)), ("fc_w", (classes, 4 * 5 * 5)), ("fc_b", (classes,))]]
    graph = helper.make_graph(nodes, "small", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 12, 12])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, classes])], inits)
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])


def test_converts_and_writes_with_card(tmp_path, capsys):
    source, out = tmp_path / "small.onnx", tmp_path / "out" / "dense.onnx"
    onnx.save(small_classifier(), source)
    (tmp_path / "labels.txt").write_text("a\nb\nc\n")
    code = main([str(source), "-o", str(out), "--labels", str(tmp_path / "labels.txt"), "--mean", "127.5,127.5,127.5",
                 "--std", "127.5,127.5,127.5"])
    assert code == EXIT_OK
    card = read_card(str(out))
    assert list(card.labels) == ["a", "b", "c"] and card.output_stride == 2 and list(card.preprocessing.std) == [127.5] * 3
    assert "wrote" in capsys.readouterr().out


def test_refusal_exits_non_zero_and_writes_nothing(tmp_path, capsys):
    source, out = tmp_path / "se.onnx", tmp_path / "dense.onnx"
    onnx.save(small_classifier(squeeze_excite=True), source)
    assert main([str(source), "-o", str(out), "--preprocessing", "raw"]) == EXIT_CONVERSION
    assert "GlobalAveragePool" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [source]


def test_missing_source_is_a_usage_error(tmp_path, capsys):
    assert main([str(tmp_path / "missing.onnx"), "-o", str(tmp_path / "out.onnx")]) == EXIT_USAGE
    assert "no such file" in capsys.readouterr().err
    assert not (tmp_path / "out.onnx").exists()


def test_bad_usage_exits_with_usage_code(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["default", "-o", str(tmp_path / "x.onnx"), "--output-stride", "5"])
    assert exit_info.value.code == EXIT_USAGE


def test_report_compares_dense_cells_with_crops(tmp_path, capsys):
    source, out, photo = tmp_path / "small.onnx", tmp_path / "dense.onnx", tmp_path / "photo.png"
    onnx.save(small_classifier(), source)
    Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(photo)
    assert main([str(source), "-o", str(out), "--report", str(photo), "--size", "20", "--preprocessing", "raw"]) == EXIT_OK
    text = capsys.readouterr().out
    # 20 px at stride 2 with a 12 px window: 5x5 cells; a pad-free net agrees everywhere.
    assert "25 cells (5x5)" in text and "argmax agreement 100.0%" in text


def test_unreadable_report_image_writes_nothing(tmp_path, capsys):
    source, out = tmp_path / "small.onnx", tmp_path / "dense.onnx"
    onnx.save(small_classifier(), source)
    (tmp_path / "broken.jpg").write_text("not an image")
    assert main([str(source), "-o", str(out), "--report", str(tmp_path / "broken.jpg"), "--preprocessing", "raw"]) == EXIT_CONVERSION
    assert not out.exists()


def test_a_bare_onnx_classifier_without_a_preprocessing_choice_is_refused(tmp_path, capsys):
    source, out = tmp_path / "small.onnx", tmp_path / "dense.onnx"
    onnx.save(small_classifier(), source)
    assert main([str(source), "-o", str(out)]) == EXIT_USAGE
    error = capsys.readouterr().err
    assert "choose a preprocessing" in error and "imagenet" in error and "--preprocessing raw" in error
    assert not out.exists()


@pytest.mark.parametrize("options, order, scale, mean, std", [
    (["--preprocessing", "imagenet"], "CHANNEL_ORDER_RGB", 1 / 255, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    (["--preprocessing", "inception"], "CHANNEL_ORDER_RGB", 1.0, [127.5] * 3, [127.5] * 3),
    (["--preprocessing", "caffe"], "CHANNEL_ORDER_BGR", 1.0, [103.939, 116.779, 123.68], [1.0] * 3),
    (["--mean", "127", "--std", "128"], "CHANNEL_ORDER_RGB", 1.0, [127.0] * 3, [128.0] * 3),
    (["--preprocessing", "imagenet", "--mean", "0.5", "--channel-order", "BGR"], "CHANNEL_ORDER_BGR", 1 / 255, [0.5] * 3,
     [0.229, 0.224, 0.225]),
], ids=["imagenet", "inception", "caffe-bgr-mean", "scalar-mean-and-std", "preset-with-overrides"])
def test_presets_and_explicit_values_reach_the_card(tmp_path, options, order, scale, mean, std):
    source, out = tmp_path / "small.onnx", tmp_path / "dense.onnx"
    onnx.save(small_classifier(), source)
    assert main([str(source), "-o", str(out), *options]) == EXIT_OK
    prep = read_card(str(out)).preprocessing
    assert prep.channel_order == ChannelOrder.Value(order)
    np.testing.assert_allclose([prep.pixel_scale, *prep.mean, *prep.std], [scale, *mean, *std], rtol=1e-6)


def test_a_mean_per_channel_of_the_wrong_length_is_a_usage_error(tmp_path, capsys):
    source = tmp_path / "small.onnx"
    onnx.save(small_classifier(), source)
    assert main([str(source), "-o", str(tmp_path / "d.onnx"), "--mean", "1,2"]) == EXIT_USAGE
    assert "mean has 2 values" in capsys.readouterr().err


def test_labels_imagenet_names_the_thousand_classes(tmp_path):
    source, out = tmp_path / "k.onnx", tmp_path / "dense.onnx"
    onnx.save(small_classifier(classes=1000), source)
    assert main([str(source), "-o", str(out), "--labels", "imagenet", "--preprocessing", "raw"]) == EXIT_OK
    labels = read_card(str(out)).labels
    assert len(labels) == 1000 and labels[0] == "tench" and labels[281] == "tabby"


def test_unknown_labels_file_is_a_usage_error(tmp_path, capsys):
    source = tmp_path / "small.onnx"
    onnx.save(small_classifier(), source)
    assert main([str(source), "-o", str(tmp_path / "d.onnx"), "--labels", "imagenett", "--preprocessing", "raw"]) == EXIT_USAGE
    assert "one of ['imagenet']" in capsys.readouterr().err


def test_version_and_a_help_that_imports_no_torch_nor_onnxruntime():
    version = subprocess.run([str(CONVERT), "--version"], capture_output=True, text=True, check=True)
    assert version.stdout.startswith("scoremap-convert ")
    probe = ("import sys; from convert.convert_cli import main\n"
             "try:\n    main(['--help'])\nexcept SystemExit as done:\n    assert done.code == 0\n"
             "heavy = sorted({'torch', 'onnxruntime', 'onnx', 'onnxscript'} & set(sys.modules))\n"
             "sys.stderr.write(repr(heavy))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stderr == "[]" and "--preprocessing" in result.stdout


@pytest.mark.parametrize("module, prog", [("convert.convert_cli", "scoremap-convert"),
                                          ("convert.inspect_cli", "scoremap-inspect"),
                                          ("convert.triton_export", "scoremap-export")])
def test_version_when_the_project_is_not_installed(module, prog):
    """Run from a checkout that pip never installed, `python -m convert.convert_cli` tells a version rather than
    die of PackageNotFoundError: every command reads the version through protos.version, as server.main does."""
    probe = ("import runpy, sys\nfrom importlib import metadata\nfound = metadata.version\n"
             "def version(name):\n"
             "    if name == 'scoremap':\n        raise metadata.PackageNotFoundError(name)\n"
             "    return found(name)\n"
             f"metadata.version = version\nsys.argv = [{prog!r}, '--version']\n"
             f"runpy.run_module({module!r}, run_name='__main__')")
    shown = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == f"{prog} unknown (not installed)"


def test_import_convert_and_the_server_do_not_import_torch():
    probe = "import sys, convert, server.main; sys.stdout.write(str('torch' in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout == "False"


def test_an_onnx_conversion_does_not_import_torch_and_its_file_follows_the_umask(tmp_path):
    source, out = tmp_path / "small.onnx", tmp_path / "dense.onnx"
    onnx.save(small_classifier(), source)
    probe = ("import sys; from convert.convert_cli import main\n"
             f"code = main([{str(source)!r}, '-o', {str(out)!r}, '--preprocessing', 'raw'])\n"
             "sys.stderr.write(repr((code, 'torch' in sys.modules)))")
    result = subprocess.run(with_umask_022([sys.executable, "-c", probe]), capture_output=True, text=True, cwd=ROOT)
    assert result.stderr.endswith("(0, False)")
    assert out.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense.onnx", "small.onnx"]  # no temporary file left


def test_a_factory_in_the_current_folder_converts_quietly(tmp_path):
    """`scoremap-convert mynets:tiny` from the folder holding mynets.py, as `python -m` would import it;
    torch's exporter warnings (FutureWarning, "torchvision is not installed") stay out of the output."""
    (tmp_path / "mynets.py").write_text(textwrap.dedent("""
        import torch.nn as nn

        def tiny():
            return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    """))
    result = subprocess.run(with_umask_022([str(CONVERT), "mynets:tiny", "-o", "tiny.onnx", "--training-size", "8",
                                            "--preprocessing", "unit"]), capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == EXIT_OK, result.stderr
    assert result.stderr == "" and result.stdout.startswith("wrote tiny.onnx")
    assert (tmp_path / "tiny.onnx").stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("argv, flag, says", [
    (["--std", "0"], "--std", "from 1e-06"),
    (["--std", "58,0,57"], "--std", "from 1e-06"),
    (["--mean", "1e9"], "--mean", "from -1000000.0 to 1000000.0"),
    (["--pixel-scale", "-1"], "--pixel-scale", "from 1e-06"),
    (["--size", "0"], "--size", "from 1 to 2048"),
    (["--training-size", "0"], "--training-size", "positive sizes"),
    (["--output-stride", "4"], "--output-stride", "invalid choice"),
])
def test_every_numeric_flag_is_range_checked_before_anything_loads(tmp_path, capsys, argv, flag, says):
    """Exit 2 naming the flag; the source does not exist, so nothing could have loaded."""
    with pytest.raises(SystemExit) as exited:
        main([str(tmp_path / "missing.onnx"), "-o", str(tmp_path / "out.onnx"), *argv])
    error = capsys.readouterr().err
    assert exited.value.code == EXIT_USAGE and f"argument {flag}: " in error and says in error


def test_a_truncated_report_image_fails_before_anything_is_converted(tmp_path, capsys, monkeypatch):
    """`--report truncated.jpg` fails at once, not after a conversion of 15 s."""
    import convert.pipeline

    def never(*_args, **_kwargs):
        raise AssertionError("converted before the report image was checked")

    monkeypatch.setattr(convert.pipeline, "convert_classifier", never)
    whole = (ROOT / "samples" / "cat.jpg").read_bytes()
    (tmp_path / "truncated.jpg").write_bytes(whole[:len(whole) // 2])
    out = tmp_path / "dense.onnx"
    assert main(["default", "-o", str(out), "--report", str(tmp_path / "truncated.jpg")]) == EXIT_CONVERSION
    assert "cannot read report image" in capsys.readouterr().err and not out.exists()


def test_an_already_converted_model_is_refused_as_such(tmp_path, capsys):
    """Converting a converted graph is refused as such, not asked for the --training-size its card records."""
    source, dense = tmp_path / "small.onnx", tmp_path / "dense.onnx"
    onnx.save(small_classifier(), source)
    assert main([str(source), "-o", str(dense), "--preprocessing", "raw"]) == EXIT_OK
    capsys.readouterr()
    assert main([str(dense), "-o", str(tmp_path / "again.onnx"), "--preprocessing", "raw"]) == EXIT_USAGE
    error = capsys.readouterr().err
    assert "is already converted" in error and "training" not in error
    assert not (tmp_path / "again.onnx").exists()


def test_size_without_report_is_refused(tmp_path, capsys):
    """`--size` without `--report` is refused, not silently ignored."""
    with pytest.raises(SystemExit) as exited:
        main(["default", "-o", str(tmp_path / "dense.onnx"), "--size", "384"])
    assert exited.value.code == EXIT_USAGE and "--size is the side of the --report image" in capsys.readouterr().err


def test_a_source_that_is_not_onnx_is_a_usage_error(tmp_path, capsys):
    """A text file named .onnx is a usage error, not a DecodeError traceback."""
    source = tmp_path / "notes.onnx"
    source.write_text("not a model")
    assert main([str(source), "-o", str(tmp_path / "out.onnx"), "--preprocessing", "raw"]) == 2
    error = capsys.readouterr().err
    assert f"scoremap-convert: '{source}' is not an ONNX file" in error
    assert not (tmp_path / "out.onnx").exists()
