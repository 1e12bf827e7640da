"""bench.sizing: rates read from a results file, units rounded up, memory rows from the profile."""

import onnx
import pytest

from bench.sizing import main, parse_count, rates, units_needed
from convert.memory_model import Device
from convert.profile import profile_model
from tests.tiny_models import patch_net

RESULTS = """# Benchmark results

<!-- bench_gpu -->
## GPU

| scheme | batching | path | clients | req/s | p50 ms | p99 ms | max ms | errors |
|---|---|---|---|---|---|---|---|---|
| grid | on | gRPC | 1 | 120.0 | 8.0 | 9.0 | 10.0 | - |
| grid | on | gRPC | 16 | 610.5 | 20.0 | 40.0 | 60.0 | - |
| grid | on | in-process | 16 | 700.0 | 20.0 | 40.0 | 60.0 | - |
| atrous | off | gRPC | 16 | 900.0 | 15.0 | 30.0 | 50.0 | - |

Machine: 2026-11-23, 16 cores (AMD EPYC), 128 GiB

<!-- bench_server -->
## Server (bench_server)

| clients | batching on: req/s | passes/batch | batching off: req/s | passes/batch | on/off |
|---|---|---|---|---|---|
| 1 | 4.91 | 4.0 | 6.15 | 1.0 | 0.80x |
| 4 | 4.08 | 8.0 | 6.40 | 1.0 | 0.65x |

Machine: 2026-11-22, 2 cores (Intel(R) Xeon(R) Processor), 24 GiB
"""


def test_rates_are_the_best_measured_levels_per_unit(tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text(RESULTS)
    from bench.__main__ import read_sections

    found = {rate.route: rate for rate in rates(read_sections(path))}
    assert found["GPU gRPC: grid"].per_unit == 610.5 and found["GPU gRPC: atrous"].per_unit == 900.0
    (cpu,) = [rate for rate in found.values() if rate.unit == "core"]
    assert cpu.per_unit == pytest.approx(6.40 / 2)


def test_the_gpu_rate_is_the_best_level_over_every_closed_loop_table(tmp_path):
    """bench_gpu writes a closed-loop table per scheme and batching mode, each as soon as it is measured."""
    split = RESULTS.replace("| grid | on | in-process | 16 |", "\n| scheme | batching | path | clients | req/s | "
                            "p50 ms | p99 ms | max ms | errors |\n|---|---|---|---|---|---|---|---|---|\n"
                            "| grid | off | gRPC | 16 | 650.0 | 20.0 | 40.0 | 60.0 | - |\n| grid | on | in-process | 16 |")
    path = tmp_path / "RESULTS.md"
    path.write_text(split)
    from bench.__main__ import read_sections

    found = [rate for rate in rates(read_sections(path)) if rate.unit == "GPU"]
    assert sorted((rate.route, rate.per_unit) for rate in found) == [("GPU gRPC: atrous", 900.0),
                                                                     ("GPU gRPC: grid", 650.0)]


def test_units_round_up_to_meet_the_deadline():
    assert units_needed(10_000_000, 8, 610.5) == 1  # 17.6 M images in 8 h on one GPU
    assert units_needed(100_000_000, 8, 610.5) == 6  # 5.69 -> 6
    assert parse_count("10M") == 10_000_000 and parse_count("1.5B") == 1_500_000_000


def test_the_command_prints_units_and_memory_per_plan(tmp_path, capsys):
    (tmp_path / "RESULTS.md").write_text(RESULTS)
    onnx.save(patch_net(classes=10), tmp_path / "tiny.onnx")
    assert main(["--images", "100M", "--hours", "8", "--results", str(tmp_path / "RESULTS.md"),
                 "--model", str(tmp_path / "tiny.onnx"), "--scale", "64"]) == 0
    out = capsys.readouterr().out
    assert "| GPU gRPC: grid | 610.50 | GPU | 6 |" in out
    cpu_mib = profile_model(str(tmp_path / "tiny.onnx"), height=64, width=96, batch=1, device=Device.CPU)
    assert f"| 64x96 | stride 32, batch 1 | {cpu_mib.predicted_peak_bytes / 2**20:,.0f} |" in out


def test_the_repositorys_own_results_give_every_cpu_rate():
    """The sections bench/RESULTS.md holds now are read, whatever their modules last wrote: a core feeds
    1000 / (its host path in ms) requests per second."""
    from bench.__main__ import HERE, read_sections
    from bench.bench_host import HOST_COLUMN
    from bench.sizing import tables

    sections = read_sections(HERE / "RESULTS.md")
    found = {rate.route: rate for rate in rates(sections)}
    for row in tables(sections["bench_host"])[0]:
        rate = found[f"host path, the most a core feeds a GPU (null model): {row['request']}"]
        assert rate.per_unit == pytest.approx(1000 / float(row[HOST_COLUMN]))
    assert any(rate.source == "bench_server best level" and rate.per_unit > 0 for rate in found.values())


@pytest.mark.parametrize("argv, flag, says", [
    (["--hours", "nan"], "--hours", "got 'nan'"),
    (["--hours", "0"], "--hours", "got '0'"),
    (["--scale", "0"], "--scale", ">= 1"),
    (["--scale", "-384"], "--scale", ">= 1"),
    (["--images", "0"], "--images", "at least 1"),
    (["--gpu-memory", "lots"], "--gpu-memory", "cannot read 'lots' as a memory size"),
    (["--gpu-memory", "0"], "--gpu-memory", "above zero"),
])
def test_every_numeric_flag_is_range_checked_before_anything_loads(tmp_path, capsys, argv, flag, says):
    """Every numeric flag of every command: exit 2 naming the flag; the model and the
    results file do not exist, so nothing could have been read."""
    defaults = {"--images": "10M", "--hours": "8"}
    given = [word for pair in defaults.items() if pair[0] not in argv for word in pair]
    with pytest.raises(SystemExit) as exited:
        main([*given, *argv, "--model", str(tmp_path / "missing.onnx"), "--results", str(tmp_path / "missing.md")])
    error = capsys.readouterr().err
    assert exited.value.code == 2 and f"argument {flag}: " in error and says in error
