"""bench/bench_gpu.py works end to end without a GPU: its dry run on the CPU, and its refusal elsewhere."""

from __future__ import annotations

import onnxruntime
import pytest

from bench import bench_gpu

TINY = bench_gpu.Config(clients=(2,), level_seconds=0.1, batches=(1,), device_seconds=0.05, max_requests=20,
                        shape_rounds=2, warm_up=False)


def test_the_dry_run_measures_every_table_on_the_cpu():
    section = bench_gpu.run(dry_run=True, config=TINY)
    assert "DRY RUN" in section
    for scheme in ("grid", "à trous"):
        assert f"| {scheme}: batch 1 x " in section  # device-bound row
        for batching in ("on", "off"):
            for path in ("gRPC", "in-process"):
                # One row per level; its figures depend on this shared machine's load, so are not checked.
                assert f"| {scheme} | {batching} | {path} | 2 |" in section
    assert "device-bound plan >= 80%" in section
    assert "ms after a change" in section


@pytest.mark.skipif(bench_gpu.cuda_unavailable() is None, reason="CUDA runs here: bench-gpu would measure")
def test_without_cuda_make_bench_gpu_says_why_and_exits_0(capsys, tmp_path):
    out = tmp_path / "RESULTS.md"
    assert bench_gpu.main(["--out", str(out)]) == 0
    assert "bench-gpu: not run:" in capsys.readouterr().out
    assert not out.exists()
    with pytest.raises(RuntimeError):
        bench_gpu.run()
    assert onnxruntime.get_available_providers()  # the reason named them
