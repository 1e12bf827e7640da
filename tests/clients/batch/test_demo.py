from clients.batch.demo import main


def test_demo_serves_scores_prints_and_stops(tiny_model, photos, tmp_path, capsys):
    out = tmp_path / "demo"
    assert main([str(photos), "--model", tiny_model, "--out", str(out), "--stride", "16"]) == 0
    printed = capsys.readouterr().out
    assert "is SERVING on 127.0.0.1:" in printed
    assert printed.count("heatmap: ") == 6 and "class" in printed
    assert "server stopped (exit status 0)" in printed  # SIGTERM drained it cleanly
    assert len(list((out / "heatmaps").rglob("*.png"))) == 6
