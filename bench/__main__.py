"""`make bench`: run every bench/bench_*.py module's `run()` and write bench/RESULTS.md.

Each module measures ratios within one run (never absolute timings against a fixed bar) and
returns a Markdown section; this runner adds the machine it ran on.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import pathlib
import platform

import onnxruntime

HERE = pathlib.Path(__file__).resolve().parent


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        model_names = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")]
        cpu = model_names[0] if model_names else cpu
    except OSError:
        pass
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{datetime.date.today().isoformat()}, {os.cpu_count()} cores ({cpu}), {memory_gib:.0f} GiB, "
        f"Python {platform.python_version()}, onnxruntime {onnxruntime.__version__} "
        f"(providers available: {', '.join(onnxruntime.get_available_providers())})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("names", nargs="*", help="bench modules to run (default: all), e.g. bench_dense")
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = parser.parse_args()
    names = args.names or sorted(p.stem for p in HERE.glob("bench_*.py"))
    sections = []
    for name in names:
        print(f"running {name} ...", flush=True)
        section = importlib.import_module(f"bench.{name}").run()
        print(section, flush=True)
        sections.append(section)
    text = "# Benchmark results\n\nMachine: " + machine_line() + "\n\n" + "\n\n".join(sections) + "\n"
    pathlib.Path(args.out).write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
