"""`make demo`: the whole path a user takes, end to end, on the sample photos.

Converts the default model if it is missing, starts `scoremap-serve` on a free loopback port,
waits for health SERVING, scores the photos with `scoremap-score --stride 16 --heatmaps`, prints
each photo's top-5 labels and where its heatmap is, and stops the server cleanly (SIGTERM, which
drains in-flight calls, then a wait).
"""

from __future__ import annotations

import argparse
import logging
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

from clients.api.client import ScoremapClient
from clients.api.errors import ScoremapError
from clients.batch.files import find_images, read_records
from clients.batch.run import RESULTS_NAME
from clients.batch.score_cli import main as score_main
from convert.arguments import number_in

__all__ = ["main", "start_server", "wait_until_serving", "stop_server"]

log = logging.getLogger("scoremap-demo")

# Loading and warming up EfficientNet-Lite0 at two strides takes seconds on a CPU; allow ample time.
SERVER_START_TIMEOUT_S = 300.0
# How long the drained server gets to exit after SIGTERM before it is killed.
SERVER_STOP_TIMEOUT_S = 30.0
LISTENING = re.compile(r"scoremap-serve listening on (\S+:\d+)")


class DemoError(RuntimeError):
    """A demo step failed; the message says which and what to try."""


def start_server(model: Path, *, timeout_s: float = SERVER_START_TIMEOUT_S) -> tuple[subprocess.Popen, str]:
    """`scoremap-serve MODEL --port 0` as a child process; (process, "HOST:PORT") once it listens."""
    process = subprocess.Popen([sys.executable, "-m", "server.main", str(model), "--port", "0"],
                               stdout=subprocess.PIPE, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, name="scoremap-serve-stdout", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            raise DemoError(f"scoremap-serve exited with status {process.wait()} before listening (see its log above)")
        if (match := LISTENING.search(line)):
            return process, match.group(1)
    stop_server(process)
    raise DemoError(f"scoremap-serve did not report a port within {timeout_s:g} s")


def wait_until_serving(target: str, *, timeout_s: float = SERVER_START_TIMEOUT_S) -> None:
    """Poll the health service until it reports SERVING (the models are loaded and warm)."""
    deadline = time.monotonic() + timeout_s
    with ScoremapClient(target) as client:
        while True:
            try:
                if client.health(timeout=5.0) == "SERVING":
                    return
            except ScoremapError as error:
                if time.monotonic() > deadline:
                    raise DemoError(f"{target} never became healthy: {error}") from error
            if time.monotonic() > deadline:
                raise DemoError(f"{target} did not report SERVING within {timeout_s:g} s")
            time.sleep(0.2)


def stop_server(process: subprocess.Popen, *, timeout_s: float = SERVER_STOP_TIMEOUT_S) -> int:
    """SIGTERM (the server drains), wait; SIGKILL only if it overstays `timeout_s`."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("scoremap-serve ignored SIGTERM for %g s; killing it", timeout_s)
            process.kill()
    return process.wait()


def ensure_model(model: Path) -> None:
    """Convert the default model to `model` unless it is already there."""
    if model.exists():
        return
    from convert.convert_cli import main as convert_main  # only needed on a fresh machine
    sys.stdout.write(f"converting the default model to {model} (once)\n")
    sys.stdout.flush()
    model.parent.mkdir(parents=True, exist_ok=True)
    if convert_main(["default", "-o", str(model)]) != 0:
        raise DemoError(f"scoremap-convert default -o {model} failed (see above)")


def report(paths: Sequence[str], out: Path) -> str:
    """Each photo's top-5 labels and its heatmap, from OUT/results.jsonl."""
    records = read_records(out / RESULTS_NAME)
    blocks = []
    for image in find_images(paths):
        record = records.get(image.key)
        if record is None:
            blocks.append(f"{image.path}: not scored")
        elif record["status"] != "OK":
            blocks.append(f"{image.path}: failed ({record['status']}: {record.get('error', '')})")
        else:
            top = "\n".join(f"  {p['probability']:6.1%}  {p['label']}" for p in record["top_k"][:5])
            blocks.append(f"{image.path}  ({record['image_size'][1]}x{record['image_size'][0]}, "
                          f"maps {', '.join('x'.join(map(str, m['cells'])) for m in record['maps'])})\n"
                          f"{top}\n  heatmap: {out / record['heatmap_file']}")
    return "\n\n".join(blocks)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clients.batch.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", default=["samples"], help="photos or folders (default: samples)")
    parser.add_argument("--model", type=Path, default=Path("models/default.onnx"))
    parser.add_argument("--out", type=Path, default=Path("out/demo"))
    parser.add_argument("--stride", type=number_in(int, 0), default=16, help="output stride in pixels (0: native)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="scoremap-demo: %(message)s")
    try:
        ensure_model(args.model)
        process, target = start_server(args.model)
        try:
            wait_until_serving(target)
            sys.stdout.write(f"scoremap-serve is SERVING on {target}; scoring {' '.join(args.paths)}\n")
            sys.stdout.flush()
            code = score_main([*args.paths, "--out", str(args.out), "--server", target,
                               "--stride", str(args.stride), "--heatmaps"])
        finally:
            stopped = stop_server(process)
    except DemoError as error:
        log.error("%s", error)
        return 1
    sys.stdout.write("\n" + report(args.paths, args.out) + "\n\n")
    sys.stdout.write(f"server stopped (exit status {stopped}); results in {args.out / RESULTS_NAME}\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
