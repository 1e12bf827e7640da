"""`make bench`: run every bench/bench_*.py module's `run()` and write bench/RESULTS.md.

Each module measures ratios within one run (never absolute timings against a fixed bar) and
returns a Markdown section; this runner adds the machine it ran on. Running a subset replaces
only those modules' sections, each stamped with its own machine line.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import pathlib
import platform
import re

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


def read_sections(path: pathlib.Path) -> dict[str, str]:
    """The sections of an existing results file, keyed by bench module name."""
    if not path.exists():
        return {}
    parts = re.split(r"^<!-- (bench_\w+) -->\n", path.read_text(), flags=re.MULTILINE)
    return {name: body.strip() for name, body in zip(parts[1::2], parts[2::2])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("names", nargs="*", help="bench modules to run (default: all), e.g. bench_dense")
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = parser.parse_args()
    names = args.names or sorted(p.stem for p in HERE.glob("bench_*.py"))
    out = pathlib.Path(args.out)
    sections = read_sections(out)
    for name in names:
        print(f"running {name} ...", flush=True)
        section = importlib.import_module(f"bench.{name}").run()
        print(section, flush=True)
        sections[name] = f"{section.strip()}\n\nMachine: {machine_line()}"
    body = "\n\n".join(f"<!-- {name} -->\n{sections[name]}" for name in sorted(sections))
    out.write_text("# Benchmark results\n\n" + body + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
