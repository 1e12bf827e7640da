from clients.batch.demo import main


def test_demo_serves_scores_prints_and_stops(tiny_model, photos, tmp_path, capsys):
    out = tmp_path / "demo"
    assert main([str(photos), "--model", tiny_model, "--out", str(out), "--stride", "16"]) == 0
    printed = capsys.readouterr().out
    assert "is SERVING on 127.0.0.1:" in printed
    assert printed.count("heatmap: ") == 6 and "class" in printed
    assert "server stopped (exit status 0)" in printed  # SIGTERM drained it cleanly
    assert len(list((out / "heatmaps").rglob("*.png"))) == 6


def test_a_negative_stride_exits_2_before_the_model_is_converted(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit) as exited:
        main(["--model", str(tmp_path / "missing.onnx"), "--stride", "-16"])
    assert exited.value.code == 2 and "argument --stride: got '-16'" in capsys.readouterr().err
    assert not (tmp_path / "missing.onnx").exists()
