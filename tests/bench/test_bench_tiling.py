"""bench/bench_tiling.py's `--provider` reaches every process of a run, and `--provider cuda` without CUDA measures
nothing."""

from __future__ import annotations

import pytest

from bench import bench_gpu, bench_tiling
from bench.models import null_model

NO_CUDA = pytest.mark.skipif(bench_gpu.cuda_unavailable() is None, reason="CUDA runs here: the run would measure")


@pytest.fixture(scope="module")
def mosaic(tmp_path_factory) -> tuple[str, str]:
    """A 1024-px mosaic (one tile on the 2048-px canvas) and the null model: a child runs in seconds."""
    folder = tmp_path_factory.mktemp("tiling")
    return str(bench_tiling.write_mosaic(folder / "mosaic.tif", 1024)), null_model(folder)


def test_the_children_run_on_the_cpu_when_asked(mosaic, tmp_path):
    tiff, model = mosaic
    bare = bench_tiling.in_child("bare", tiff, model, provider="cpu")
    assert bare["tiles"] == 1 and bare["provider"] == "CPUExecutionProvider"
    # The memory rows' child: one pass per tile, not the 300 the null model's small buckets would make.
    assert bench_tiling.in_child("pipeline", tiff, model, str(tmp_path / "map"), provider="cpu",
                                 one_pass_per_tile=True)["tiles"] == 1


@NO_CUDA
@pytest.mark.parametrize("mode", ["bare", "pipeline"])
def test_a_child_asked_for_cuda_refuses_rather_than_measure_the_cpu(mode, mosaic, tmp_path):
    """The provider reaches the child's Engine: told cuda without CUDA, it fails instead of running on the CPU."""
    tiff, model = mosaic
    with pytest.raises(RuntimeError, match=f"{mode} child failed .*a GPU is required"):
        bench_tiling.in_child(mode, tiff, model, *([str(tmp_path / "map")] if mode == "pipeline" else []),
                              provider="cuda")


@NO_CUDA
def test_without_cuda_provider_cuda_says_why_and_exits_2(capsys):
    assert bench_tiling.main(["--provider", "cuda", "--small"]) == bench_tiling.NOT_RUN == 2
    captured = capsys.readouterr()
    assert "bench_tiling: not run: --provider cuda, but" in captured.err
    assert captured.out == ""  # no section
