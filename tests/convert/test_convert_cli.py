"""scoremap-convert: exit codes, nothing written on failure, the --report comparison."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

from convert.card import read_card
from convert.convert_cli import EXIT_CONVERSION, EXIT_OK, EXIT_USAGE, main

rng = np.random.default_rng(0)


def small_classifier(*, squeeze_excite: bool = False) -> onnx.ModelProto:
    """Pad-free conv → (optional global gate) → conv → flatten → Gemm at 12x12."""
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"], kernel_shape=[3, 3], strides=[2, 2])]
    body = "c0"
    if squeeze_excite:
        nodes += [helper.make_node("GlobalAveragePool", ["c0"], ["gate"]), helper.make_node("Mul", ["c0", "gate"], ["gated"])]
        body = "gated"
    nodes += [helper.make_node("Relu", [body], ["r0"]), helper.make_node("Flatten", ["r0"], ["flat"]),
              helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["out"], transB=1)]
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.01).astype(np.float32), n)
             for n, s in [("w0", (4, 3, 3, 3)), ("fc_w", (3, 4 * 5 * 5)), ("fc_b", (3,))]]
    graph = helper.make_graph(nodes, "small", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 12, 12])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 3])], inits)
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
    assert main([str(source), "-o", str(out)]) == EXIT_CONVERSION
    assert "GlobalAveragePool" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [source]


def test_missing_source_exits_non_zero(tmp_path, capsys):
    assert main([str(tmp_path / "missing.onnx"), "-o", str(tmp_path / "out.onnx")]) == EXIT_CONVERSION
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
    assert main([str(source), "-o", str(out), "--report", str(photo), "--size", "20"]) == EXIT_OK
    text = capsys.readouterr().out
    # 20 px at stride 2 with a 12 px window: 5x5 cells; a pad-free net agrees everywhere.
    assert "25 cells (5x5)" in text and "argmax agreement 100.0%" in text


def test_unreadable_report_image_writes_nothing(tmp_path, capsys):
    source, out = tmp_path / "small.onnx", tmp_path / "dense.onnx"
    onnx.save(small_classifier(), source)
    (tmp_path / "broken.jpg").write_text("not an image")
    assert main([str(source), "-o", str(out), "--report", str(tmp_path / "broken.jpg")]) == EXIT_CONVERSION
    assert not out.exists()
