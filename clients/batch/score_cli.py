"""scoremap-score: score folders of images into results.jsonl (+ maps, heatmaps), resumably.

    scoremap-score PATHS... --out DIR (--server HOST:PORT | --local MODEL.onnx) [options]

Exit status (documented in --help and docs/clients.md):
    0  every file found is scored (in this run or an earlier one)
    1  some files failed, in this run or an earlier one; each is recorded in results.jsonl with its status
    2  bad command line: no images found, options the model cannot take (checked once, before
       scoring), other options than the ones OUT was scored with (see --force-new-options)
    3  the server was never reached, or stayed unreachable beyond --retry-for; re-run to resume
    4  the run could not start or was refused (credentials, unknown model, model file, output folder)
  130  interrupted; re-run to resume
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback
from pathlib import Path
from typing import Sequence

import grpc
from tqdm import tqdm

from clients.api.errors import ScoremapError
from clients.api.options import MAP_DTYPES, SHIFTS, ScoreOptions
from clients.api.retry import Interrupted
from clients.api.settings import BATCH_RETRY_BUDGET_S, MIN_TIMEOUT_S, TOKEN_ENV, ClientSettings, env_token
from clients.batch.files import atomic_write, find_images
from clients.batch.preflight import RunRefused, check_run
from clients.batch.run import RESULTS_NAME, BatchSummary, ErrorKind, run_batch
from clients.batch.run_options import OptionsChanged
from clients.slides import cli as slides
from convert.arguments import host_port, number_in, number_list
from protos import version
from protos import image_formats

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_FAILURES", "EXIT_USAGE", "EXIT_UNAVAILABLE",
           "EXIT_REFUSED", "EXIT_INTERRUPTED"]

EXIT_OK = 0
EXIT_FAILURES = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3
EXIT_REFUSED = 4
EXIT_INTERRUPTED = 130

log = logging.getLogger("scoremap-score")
# Errors shown in the end-of-run summary, most frequent first; the rest are in --summary-json.
SUMMARY_ERROR_KINDS = 10

# What to do about an error that stops the run, by status: re-running helps only when the
# server was merely away.
ADVICE = {
    grpc.StatusCode.UNAVAILABLE: "re-run the same command to resume (files recorded are skipped)",
    grpc.StatusCode.UNAUTHENTICATED: f"set ${TOKEN_ENV} to the server's token (and use --tls off this machine)",
    grpc.StatusCode.PERMISSION_DENIED: f"set ${TOKEN_ENV} to a token the server accepts",
    grpc.StatusCode.NOT_FOUND: "check --model against the server's models (scoremap-serve prints them at start)",
    grpc.StatusCode.UNIMPLEMENTED: "check that --server names a scoremap-serve of this version",
    grpc.StatusCode.FAILED_PRECONDITION: "start the server with a model",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scoremap-score",
        description="Score image files and folders (walked recursively, images found by content) "
                    "into OUT/results.jsonl; re-running skips files already recorded.",
        epilog=(__doc__ or "").split("\n\n", 2)[-1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    parser.add_argument("paths", nargs="+", metavar="PATH", help="image files or folders")
    parser.add_argument("--out", required=True, type=Path, help="output folder (results.jsonl, maps/, heatmaps/)")
    backend = parser.add_mutually_exclusive_group(required=True)
    backend.add_argument("--server", metavar="HOST:PORT", type=host_port, help="a running scoremap-serve")
    backend.add_argument("--local", metavar="MODEL.onnx",
                         help="score in this process with the server's pipeline, no service needed")
    parser.add_argument("--engine", choices=("local", "server", "ray"),
                        help="where scoring runs: this process (--local), a scoremap-serve (--server), or Ray actors "
                             "running --local's model, spread over a cluster (default: as --server/--local say)")
    parser.add_argument("--ray-address", metavar="ADDR", help="the Ray cluster for --engine ray "
                        "(default: a Ray started on 127.0.0.1 for this run)")
    parser.add_argument("--model", default="", help="model name (optional when one is loaded)")
    parser.add_argument("--scales", type=number_list(int, 1), default=[], help="shorter sides, e.g. 224,448 (default: the card's)")
    parser.add_argument("--stride", type=number_in(int, 0), default=0, help="output stride in pixels, 32 or 16 (default: native)")
    parser.add_argument("--shift", choices=sorted(SHIFTS), default="auto", help="how stride 16 is reached")
    parser.add_argument("--flip", action="store_true", help="average with the mirrored image")
    parser.add_argument("--top-k", type=number_in(int, 0), default=5, help="image-level classes recorded (default 5)")
    parser.add_argument("--maps", action="store_true", help="write OUT/maps/<file>.npz score maps")
    parser.add_argument("--heatmaps", action="store_true", help="write OUT/heatmaps/<file>.png heatmaps")
    parser.add_argument("--map-dtype", choices=sorted(MAP_DTYPES), default="float32",
                        help="the dtype --maps are sent and written in: float16 halves their bytes, to about 3 "
                             "significant digits (default float32)")
    parser.add_argument("--concurrency", type=number_in(int, 1), default=4, help="requests in flight (default 4)")
    parser.add_argument("--timeout", type=number_in(float, MIN_TIMEOUT_S), default=ClientSettings.timeout_s,
                        help=f"deadline per image, seconds (default {ClientSettings.timeout_s:g})")
    parser.add_argument("--retry-for", type=number_in(float, 0), default=BATCH_RETRY_BUDGET_S,
                        help=f"keep retrying an unreachable server this many seconds (default {BATCH_RETRY_BUDGET_S:g})")
    parser.add_argument("--retry-failed", action="store_true", help="score again files (with --tiled: tiles) recorded as failed")
    parser.add_argument("--force-new-options", action="store_true",
                        help="OUT was scored with other options: score every file again with these")
    parser.add_argument("--summary-json", metavar="PATH", type=Path,
                        help="also write the end-of-run summary as JSON (counts, distinct errors with examples)")
    parser.add_argument("--tls", action="store_true", help="connect with TLS")
    parser.add_argument("--root-cert", type=Path, help="PEM root certificates for --tls")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--traceback", action="store_true", help="print the full traceback on errors")
    slides.add_arguments(parser)
    return parser


def _open_scorer(args: argparse.Namespace):
    # Bounded by time alone, so --retry-for is used up however short the backoff pauses are.
    settings = ClientSettings(timeout_s=args.timeout, retry_budget_s=args.retry_for)
    if args.local:
        from clients.batch.local import LocalScorer  # imports the server package: only for --local
        return LocalScorer([args.local], client_settings=settings)
    from clients.api.client import ScoremapClient
    root = args.root_cert.read_bytes() if args.root_cert else None
    return ScoremapClient(args.server, tls=args.tls, root_certificates=root,
                          token=env_token(), settings=settings)


def _kinds(table: dict[tuple[str, str], ErrorKind]) -> list[ErrorKind]:
    return sorted(table.values(), key=lambda kind: -kind.count)


def summary_table(summary: BatchSummary, results: Path) -> str:
    """The end-of-run table printed to stdout, then the distinct errors and warnings with an example each."""
    rows = [("found", str(summary.found)), ("skipped (already recorded)", str(summary.skipped)),
            ("scored", str(summary.scored)), ("failed", str(summary.failed))]
    rows += [(f"  {status}", str(count)) for status, count in sorted(summary.failures.items())]
    rows.append(("failed, all runs", str(summary.still_failed)))
    if summary.aborted is not None:
        rows.append(("not scored (run stopped)", str(summary.remaining)))
    rows += [("not images (skipped)", str(summary.not_images)), ("scored with warnings", str(summary.warned)),
             ("seconds", f"{summary.seconds:.1f}"), ("results", str(results))]
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    for title, table in (("errors", summary.errors), ("warnings", summary.warnings)):
        kinds = _kinds(table)
        if kinds:
            lines.append(f"{title} ({len(kinds)} distinct):")
            for kind in kinds[:SUMMARY_ERROR_KINDS]:
                lines.append(f"  {kind.count:>5} x {kind.status}: {kind.example}")
                lines.append(f"          e.g. {kind.example_path}")
            if len(kinds) > SUMMARY_ERROR_KINDS:
                lines.append(f"  ... {len(kinds) - SUMMARY_ERROR_KINDS} more kinds (see --summary-json)")
    return "\n".join(lines)


def _advice(error: ScoremapError) -> str:
    return f"{error.message}; {ADVICE[error.code]}" if error.code in ADVICE else error.message


def _path_error(error: OSError, args: argparse.Namespace) -> str:
    """An OSError of the run as one line naming the flag whose path failed, and the fix (a bare `[Errno 2]`
    names neither)."""
    failed = Path(error.filename) if error.filename else None
    reason = error.strerror or str(error)
    if failed is not None and (failed == args.out or failed in args.out.parents or args.out in failed.parents):
        inside = "" if failed == args.out else f" ({str(failed)!r})"
        return (f"--out {str(args.out)!r}: cannot make or write the folder{inside}: {reason}; give --out a folder "
                "you can write to (it is made if missing)")
    if args.root_cert is not None and failed == args.root_cert:
        return f"--root-cert {str(args.root_cert)!r}: {reason}; give a readable PEM file"
    return str(error)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="scoremap-score: %(message)s")
    if args.concurrency < 1:
        parser.error(f"--concurrency {args.concurrency} must be at least 1")
    if args.engine not in (None, "ray", "local" if args.local else "server") or (args.engine == "ray" and not args.local):
        parser.error(f"--engine {args.engine}: give --server for the server, --local MODEL.onnx for local or ray")
    if args.ray_address and args.engine != "ray":
        parser.error("--ray-address goes with --engine ray")
    if argv is None and args.local and args.engine != "ray":  # this process decodes: glibc's huge pages, as a server's
        from server.memory.huge_pages import restart_with_huge_pages

        restart_with_huge_pages()
    if args.tiled:
        return slides.main(args, _open_scorer)
    not_images: list[Path] = []
    try:
        options = ScoreOptions(model=args.model, scales=tuple(args.scales), stride=args.stride, shift=args.shift,
                               flip=args.flip, map_dtype=args.map_dtype, top_k=args.top_k)
        find = find_images
        if args.engine == "ray":
            from clients.batch.ray_engine import find_inputs as find  # pyarrow filesystem URIs: this engine reads them
        images = list(find(args.paths, on_skip=not_images.append))
    except (ScoremapError, FileNotFoundError) as error:
        parser.error(str(error))
    if not images:
        skipped = f" ({len(not_images)} other files skipped, e.g. {str(not_images[0])!r})" if not_images else ""
        log.error("no images (%s) found under %s%s; check the paths", image_formats.NAMES,
                  ", ".join(repr(p) for p in args.paths), skipped)
        return EXIT_USAGE
    target = args.local or args.server
    progress = None
    scorer = None
    try:
        scorer = _open_scorer(args)
        options = check_run(scorer.models(), options)
        progress = tqdm(total=0, unit="img", disable=True if args.no_progress else None,
                        dynamic_ncols=True, desc="scoring")
        failures = 0

        def on_start(count: int) -> None:
            progress.reset(total=count)

        def on_progress(record: dict) -> None:
            nonlocal failures
            failures += record["status"] != "OK"
            progress.set_postfix(failed=failures, refresh=False)
            progress.update(1)

        run = dict(options=options, concurrency=args.concurrency, maps=args.maps, heatmaps=args.heatmaps,
                   retry_failed=args.retry_failed, force_new_options=args.force_new_options, timeout=args.timeout,
                   on_progress=on_progress, on_start=on_start)
        if args.engine == "ray":
            from clients.batch.ray_engine import run_ray_batch  # imports ray only for this engine
            summary = run_ray_batch(images, args.local, args.out, address=args.ray_address,
                                    client_settings=scorer.client_settings, **run)
        else:
            summary = run_batch(images, scorer, args.out, **run)
    except (KeyboardInterrupt, Interrupted):
        log.warning("interrupted; re-run the same command to resume (files already recorded in %s are skipped)",
                    args.out / RESULTS_NAME)
        return EXIT_INTERRUPTED
    except OptionsChanged as error:
        log.error("%s", error)
        return EXIT_USAGE
    except RunRefused as error:
        log.error("%s", _advice(error) if error.code != grpc.StatusCode.INVALID_ARGUMENT else error.message)
        return EXIT_USAGE if error.code == grpc.StatusCode.INVALID_ARGUMENT else EXIT_REFUSED
    except ScoremapError as error:
        if args.traceback:
            traceback.print_exc()
        if error.code == grpc.StatusCode.UNAVAILABLE:
            log.error("cannot reach %s: %s; check --server and that scoremap-serve runs there", target, error.message)
            return EXIT_UNAVAILABLE
        log.error("%s", _advice(error))
        return EXIT_REFUSED
    except OSError as error:
        if args.traceback:
            traceback.print_exc()
        log.error("%s", _path_error(error, args))
        return EXIT_REFUSED
    finally:
        if progress is not None:
            progress.close()
        if scorer is not None:
            scorer.close()
    summary.not_images = len(not_images)
    sys.stdout.write(summary_table(summary, args.out / RESULTS_NAME) + "\n")
    if args.summary_json:
        atomic_write(args.summary_json, (json.dumps(summary.to_dict(), indent=2) + "\n").encode())
    if summary.aborted is not None:
        if args.traceback:
            log.error("run stopped by %r", summary.aborted)
        log.error("run stopped: %s", _advice(summary.aborted))
        return EXIT_UNAVAILABLE if summary.aborted.code == grpc.StatusCode.UNAVAILABLE else EXIT_REFUSED
    return EXIT_FAILURES if summary.still_failed else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
