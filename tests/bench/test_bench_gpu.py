"""bench/bench_gpu.py works end to end without a GPU: its dry run on the CPU, and its refusal elsewhere."""

from __future__ import annotations

import re

import onnxruntime
import pytest

from bench import bench_gpu
from clients.loadtest.latency import LevelReport

SPLIT = bench_gpu.Split(1, "auto")
TINY = bench_gpu.Config(clients=(1, 2), level_seconds=0.1, batches=(1,), device_seconds=0.05, max_requests=20,
                        shape_rounds=2, warm_up=False, splits=(SPLIT,))


def test_the_dry_run_measures_every_table_on_the_cpu():
    section = bench_gpu.run(dry_run=True, config=TINY)
    assert "DRY RUN" in section
    for scheme in ("grid", "à trous"):
        assert f"| {scheme}: batch 1 x " in section  # device-bound row
        for batching in ("on", "off"):
            for path in ("gRPC", "in-process"):
                # One row per level; its figures depend on this shared machine's load, so are not checked.
                assert f"| {scheme} | {batching} | {path} | 2 |" in section
        assert f"| {scheme} | {SPLIT.label} | 2 |" in section  # a real --fronts server, its CPU from /proc
        for target in ("the batch-1 plan's run + 3 ms", "one process's + 0.3 ms"):  # judged on this CPU's figures
            assert re.search(rf"- {scheme}, {re.escape(SPLIT.label)}: p50 at 1 client <= {re.escape(target)}.*: "
                             "(met|missed)$", section, re.MULTILINE)
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


def test_each_table_is_written_as_soon_as_it_is_measured(tmp_path, monkeypatch):
    """A run stopped part-way (a time limit, a kill, a failure) keeps every table it finished."""
    def broken(*_args, **_kwargs):
        raise RuntimeError("the server died")

    monkeypatch.setattr(bench_gpu, "served", broken)
    with pytest.raises(RuntimeError, match="the server died"):
        bench_gpu.run(dry_run=True, config=TINY, out_dir=tmp_path)
    written = (tmp_path / bench_gpu.REPORT_FILE).read_text()
    assert written.startswith("## GPU engine (bench_gpu)") and "ms after a change" in written
    assert "| grid: batch 1 x " in written and "| à trous: batch 1 x " in written  # the device-bound table
    assert "Closed loop" not in written


def test_a_time_limit_keeps_what_was_measured_and_says_what_was_not(tmp_path, capsys):
    section = bench_gpu.run(dry_run=True, config=TINY, out_dir=tmp_path, time_limit_s=0, echo=True)
    assert "Not measured, the time limit of 0 s having passed: the cost of a change of shape, device-bound" in section
    assert "closed loop grid batching on" in section and "memory on the CUDA provider" in section
    assert "Targets, on what was measured:" in section and "| grid |" not in section
    assert (tmp_path / bench_gpu.REPORT_FILE).read_text() == section + "\n\n"
    assert section in capsys.readouterr().out.replace("\n\n\n", "\n\n")


def test_quick_measures_less_within_its_limit_and_updates_no_results_file(tmp_path, monkeypatch):
    full, quick = bench_gpu.Config(), bench_gpu.QUICK
    assert set(quick.clients) < set(full.clients) and quick.level_seconds < full.level_seconds
    assert quick.device_seconds < full.device_seconds and len(quick.batches) < len(full.batches)
    assert all(set(cases) <= set(bench_gpu.GPU_CASES[model]) for model, cases in quick.memory_cases.items())
    calls = []
    monkeypatch.setattr(bench_gpu, "cuda_unavailable", lambda: None)
    monkeypatch.setattr(bench_gpu, "run", lambda **kwargs: calls.append(kwargs) or "## GPU engine (bench_gpu)")
    monkeypatch.setattr(bench_gpu, "record", lambda *_: pytest.fail("--quick updated a results file"))
    monkeypatch.setenv("OUT", str(tmp_path))
    assert bench_gpu.main(["--quick"]) == 0
    assert calls == [dict(dry_run=False, config=quick, out_dir=str(tmp_path), time_limit_s=bench_gpu.QUICK_TIME_LIMIT_S,
                          echo=True)]
    recorded = []
    monkeypatch.setattr(bench_gpu, "record", lambda sections, out: recorded.append((sections, out)))
    assert bench_gpu.main(["--quick", "--time-limit", "50", "--out", str(tmp_path / "RESULTS.md")]) == 0
    assert calls[-1]["time_limit_s"] == 50 and recorded[0][1] == tmp_path / "RESULTS.md"


def level(clients: int, rps: float, *, p50_ms: float = 5.0, max_ms: float = 50.0) -> LevelReport:
    return LevelReport(mode="closed", level=clients, sent=100, completed=100, duration_s=1.0, throughput_rps=rps,
                       p50_ms=p50_ms, p90_ms=p50_ms, p95_ms=p50_ms, p99_ms=max_ms, max_ms=max_ms)


def test_the_verdicts_judge_the_targets_and_say_what_was_not_measured():
    device = [bench_gpu.DeviceRate("grid", 1, "grid: batch 1", plan=400.0, bare=410.0),  # a run of 2.5 ms
              bench_gpu.DeviceRate("grid", 8, "grid: batch 8", plan=500.0, bare=520.0)]
    results = {("grid", "on"): [level(1, 150, p50_ms=5.4), level(16, 410), level(64, 405)],
               ("grid", "off"): [level(1, 140), level(16, 300, max_ms=120.0)]}
    lines = bench_gpu.verdicts(device, results)
    assert "- device-bound plan >= 80% of the bare loop (worst 96%): met" in lines
    assert "- grid: gRPC at 16 clients >= 80% of the batch-8 plan's device-bound img/s (410 req/s against 500 img/s): met" in lines
    assert "- grid: 64 clients no slower than 16 (405 against 410 req/s): missed" in lines
    assert "- grid: p50 at 1 client <= the batch-1 plan's run + 3 ms (5.4 against 5.5 ms): met" in lines
    assert "- grid: no request over 100 ms at 16 clients, batching on and off (longest 120.0 ms): missed" in lines
    assert "- grid: batching on never slower than off (2 levels; slower at clients: none): met" in lines
    # A run that left out the batch-8 plan, the 64-client level and batching off judges none of their targets.
    lines = bench_gpu.verdicts(device[:1], {("grid", "on"): results[("grid", "on")][:2]})
    assert "- grid: gRPC at 16 clients >= 80% of the batch-8 plan's device-bound img/s: not measured" in lines
    assert "- grid: 64 clients no slower than 16: not measured" in lines
    assert "- grid: no request over 100 ms at 16 clients, batching on and off: not measured" in lines
    assert "- grid: batching on never slower than off: not measured" in lines
    # A --fronts layout is judged on its own levels, against the same plans.
    split = bench_gpu.Split(6, "spin")
    lines = bench_gpu.verdicts(device, results, {("grid", split): [
        bench_gpu.SplitLevel(level(1, 160, p50_ms=6.0), 0.3, 2.0), bench_gpu.SplitLevel(level(16, 420), 0.2, 1.5)]})
    assert ("- grid, --fronts 6, --cuda-sync spin: gRPC at 16 clients >= 80% of the batch-8 plan's device-bound img/s "
            "(420 req/s against 500 img/s): met") in lines
    assert "- grid, --fronts 6, --cuda-sync spin: p50 at 1 client <= the batch-1 plan's run + 3 ms (6.0 against 5.5 ms): missed" in lines
    assert "- grid, --fronts 6, --cuda-sync spin: 64 clients no slower than 16: not measured" in lines
    assert "- grid, --fronts 6, --cuda-sync spin: no request over 100 ms at 16 clients, batching on (longest 50.0 ms): met" in lines
    # Stopped before any closed loop: each scheme's targets are still listed, as not measured.
    assert "- grid: p50 at 1 client <= the batch-1 plan's run + 3 ms: not measured" in bench_gpu.verdicts(device, {})


def test_blocking_and_spinning_are_compared_where_both_ran():
    spin, block, alone = bench_gpu.Split(6, "spin"), bench_gpu.Split(6, "block"), bench_gpu.Split(2, "spin")
    levels = {
        ("grid", spin): [bench_gpu.SplitLevel(level(1, 200, p50_ms=4.0), 0.9, 3.0),
                         bench_gpu.SplitLevel(level(16, 900, p50_ms=17.0), 0.5, 2.0)],
        ("grid", block): [bench_gpu.SplitLevel(level(1, 190, p50_ms=4.3), 0.2, 2.2),
                          bench_gpu.SplitLevel(level(16, 950, p50_ms=16.0), 0.1, 1.6)],
        ("grid", alone): [bench_gpu.SplitLevel(level(1, 100), 1.0, 3.0)],
    }
    assert bench_gpu.sync_comparison(levels) == [
        "- grid, --fronts 6, block against spin: p50 at 1 client(s) 4.30 against 4.00 ms; at 16 clients 950 against "
        "900 req/s, the engine's CPU 0.10 against 0.50 ms per request"]
