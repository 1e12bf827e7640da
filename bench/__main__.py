"""`make bench`: run every bench/bench_*.py module's `run()` and write bench/RESULTS.md.

Each module measures ratios within one run (never absolute timings against a fixed bar) and
returns a Markdown section; this runner adds the machine it ran on. Running a subset replaces
only those modules' sections, each stamped with its own machine line. GPU-only modules run only
when named (`make bench-gpu`), so a CPU run never replaces their section.
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
GPU_ONLY = ("bench_gpu", "bench_workers")


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


def record(new_sections: dict[str, str], out: pathlib.Path) -> None:
    """Replace (or add) these modules' sections in `out`, each stamped with this machine."""
    sections = read_sections(out)
    for name, section in new_sections.items():
        sections[name] = f"{section.strip()}\n\nMachine: {machine_line()}"
    body = "\n\n".join(f"<!-- {name} -->\n{sections[name]}" for name in sorted(sections))
    out.write_text("# Benchmark results\n\n" + body + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("names", nargs="*", help="bench modules to run (default: all but GPU-only), e.g. bench_server")
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = parser.parse_args()
    names = args.names or sorted(p.stem for p in HERE.glob("bench_*.py") if p.stem not in GPU_ONLY)
    sections = {}
    for name in names:
        print(f"running {name} ...", flush=True)
        sections[name] = importlib.import_module(f"bench.{name}").run()
        print(sections[name], flush=True)
    record(sections, pathlib.Path(args.out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
