"""`scoremap-score IMAGE --tiled`: each large image scored tile by tile into OUT/STEM.zarr (+ STEM.png), resumably.

The exit statuses are scoremap-score's: 0 every slide complete; 2 bad options, or a slide that
cannot be read as asked: refused before its first tile (its header, its tile table, its size over
--max-slide-pixels, its level), or incomplete (tiles that could not be read are recorded as failed;
--retry-failed tries them again); each is named in the summary, and the other slides are scored;
3 the server unreachable, 4 refused, 130 interrupted (re-run the same command to resume).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import traceback
from collections.abc import Callable
from pathlib import Path

import grpc
from tqdm import tqdm

from clients.api.errors import ScoremapError
from clients.api.options import SHIFTS
from clients.api.retry import Interrupted
from clients.batch.files import atomic_write
from clients.slides.errors import SlideError
from convert.arguments import number_in, number_list
from clients.slides import DEFAULT_CANVAS, DEFAULT_MAX_SLIDE_PIXELS

log = logging.getLogger("scoremap-score")
EXIT_OK, EXIT_USAGE, EXIT_UNAVAILABLE, EXIT_REFUSED, EXIT_INTERRUPTED = 0, 2, 3, 4, 130


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of tiled scoring, in their own group of scoremap-score's --help."""
    group = parser.add_argument_group("large images (--tiled)")
    group.add_argument("--tiled", action="store_true",
                       help="score each PATH (a large TIFF, OME-TIFF, SVS, other slide, or any image) tile by tile "
                            "into OUT/<name>.zarr and OUT/<name>.png, in bounded memory, resumably")
    group.add_argument("--level", type=number_in(int, 0), default=0, help="pyramid level to score (0: full resolution)")
    group.add_argument("--halo", type=number_in(int, 0), default=None,
                       help="pixels of context each side of a tile's cells (default: exact, half the receptive field)")
    group.add_argument("--canvas", type=number_in(int, 32), default=DEFAULT_CANVAS,
                       help=f"canvas side each tile is scored on (default {DEFAULT_CANVAS})")
    group.add_argument("--classes", type=lambda text: tuple(number_list(int, 0)(text)), default=(),
                       help="store the maps of these classes only, e.g. 3,17 (default: all)")
    group.add_argument("--cell-top-k", type=number_in(int, 0), default=0, help="store the k best classes per cell instead of maps")
    group.add_argument("--zarr-dtype", choices=("float16", "float32"), default="float16",
                       help="scores stored as (default float16)")
    group.add_argument("--max-slide-pixels", type=number_in(int, 1), default=DEFAULT_MAX_SLIDE_PIXELS,
                       help="refuse, by its header, a slide whose largest level declares more pixels "
                            f"(default {DEFAULT_MAX_SLIDE_PIXELS:,}: about 100k x 100k)")


def open_ray_scorer(args: argparse.Namespace):
    """The actor pool of --engine ray, each actor taking --concurrency tiles at once."""
    from clients.api.settings import ClientSettings
    from clients.slides.ray_scorer import RayTileScorer  # imports ray only for this engine

    return RayTileScorer(str(Path(args.local).resolve()), address=args.ray_address, per_actor=args.concurrency,
                         client_settings=ClientSettings(timeout_s=args.timeout, retry_budget_s=args.retry_for))


def main(args: argparse.Namespace, open_scorer: Callable[[argparse.Namespace], object]) -> int:
    """Score every PATH in turn; `open_scorer` gives the server or in-process scorer, as for files. A slide
    that cannot be read is named and recorded as failed, and the next one is scored."""
    # Imported here: the geometry imports the model card's reader, which plain file scoring does not need.
    from clients.slides.report import RunReport
    from clients.slides.run import RunError, SlideOptions, score_file
    from clients.slides.tiles import TileOptions
    from server.geometry.tiling import TilingError

    tile = TileOptions(model=args.model, output_stride=args.stride, shift=SHIFTS[args.shift], flip=args.flip,
                       classes=args.classes)
    options = SlideOptions(tile=tile, canvas=args.canvas, halo=args.halo, cell_top_k=args.cell_top_k,
                           dtype=args.zarr_dtype, concurrency=args.concurrency)
    report = RunReport()
    paths = [path for path in args.paths if _readable(path, args, report)]  # in seconds, before the model loads
    scorer = None
    progress = None
    try:
        if paths and args.engine == "ray":  # the tiles go to Ray actors; reading, stitching and the journal stay here
            scorer = open_ray_scorer(args)
            options = dataclasses.replace(options, concurrency=scorer.in_flight)
        elif paths:
            scorer = open_scorer(args)
        for path in paths:
            progress = tqdm(total=0, unit="tile", desc=Path(path).name, dynamic_ncols=True,
                            disable=True if args.no_progress else None)
            try:
                summary = score_file(
                    path, scorer, args.out, level=args.level, options=options, max_pixels=args.max_slide_pixels,
                    retry_failed=args.retry_failed,
                    on_start=lambda total, done: (progress.reset(total=total), progress.update(done)),
                    on_tile=lambda _tile: progress.update(1))
            except SlideError as error:
                _log_error(args, error)
                report.failed(path, error)
                continue
            finally:
                progress.close()
            report.scored(path, summary)
            incomplete = "" if summary.complete else f"; INCOMPLETE: {len(summary.failed)} tiles could not be read"
            print(f"{path}: {summary.tiles} tiles ({summary.skipped} already stored), halo {summary.halo} px "
                  f"({'exact' if summary.exact else 'approximate'}); map {summary.map_path}, "
                  f"preview {summary.preview_path}{incomplete}")
    except (KeyboardInterrupt, Interrupted):
        log.error("interrupted; re-run the same command to resume (tiles already stored are kept)")
        return EXIT_INTERRUPTED
    except (RunError, TilingError) as error:
        _log_error(args, error)
        return EXIT_USAGE
    except ScoremapError as error:
        if args.traceback:
            traceback.print_exc()
        if error.code == grpc.StatusCode.UNAVAILABLE:
            log.error("cannot reach the server: %s", error.message)
            return EXIT_UNAVAILABLE
        log.error("%s", error.message)
        return EXIT_REFUSED if error.code != grpc.StatusCode.INVALID_ARGUMENT else EXIT_USAGE
    finally:
        if progress is not None:
            progress.close()
        if scorer is not None:
            scorer.close()
    print(report.table())
    if args.summary_json:
        atomic_write(args.summary_json, (json.dumps(report.to_dict(), indent=2) + "\n").encode())
    return EXIT_OK if report.all_complete else EXIT_USAGE


def _readable(path: str, args: argparse.Namespace, report) -> bool:
    """Whether the slide at `path` passes its reader's checks; one that fails is named and recorded as failed."""
    from clients.slides.readers import open_image  # imports tifffile: only for --tiled

    try:
        open_image(path, level=args.level, max_pixels=args.max_slide_pixels).close()
    except SlideError as error:
        _log_error(args, error)
        report.failed(path, error)
        return False
    return True


def _log_error(args: argparse.Namespace, error: Exception) -> None:
    """One line naming the file and the problem; the chain of causes too with --traceback."""
    if args.traceback:
        traceback.print_exception(error)
    log.error("%s", error)
