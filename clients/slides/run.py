"""Score a large image tile by tile into a chunked Zarr map on disk, resumably, in bounded memory.

Outputs, in OUT for an image STEM:
- STEM.zarr: a Zarr group with `scores` [K, H, W] (float16 by default; the classes asked, or all) or,
  with `cell_top_k`, `top_k_indices` and `top_k_scores` [k, H, W]; its attributes (`scoremap`) hold
  the image, level, options, halo, whether exact, and the cell geometry in level-0 pixels; its
  `scoremap_status` whether every tile is stored, and the tiles that could not be read;
- STEM.tiles.jsonl: one line per tile stored, appended (and synced) once its cells are written, and
  one per tile that could not be read, with the error (its cells stay NaN; retried on request);
- STEM.png: a downsampled heatmap preview, written when every tile is stored.

A tile is recorded after its cells are written; Zarr writes each chunk whole (a temporary file
renamed), so after a kill a run resumes with the tiles not recorded, writing their cells again,
and every tile is recorded once. Memory holds the tiles in flight, never the image or its map.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from clients.api.heatmap import colormap
from clients.api.interrupts import first_done
from clients.slides import DEFAULT_CANVAS, DEFAULT_MAX_SLIDE_PIXELS
from clients.slides.errors import SlideError, TileError
from clients.slides.readers import Reader
from clients.slides.tiles import Scorer, TileOptions, plan_for, score_map
from protos import model_card_pb2, scoring_pb2
from server.geometry import dense, tiling

log = logging.getLogger(__name__)

# Classes per chunk. A tile's owned cells rarely fall on the chunk grid (the first tile owns more), so its
# write reads and rewrites the chunks it touches: per chunk, not per byte, is what that costs (a 1000-class
# tile of 31x31 cells: 68 ms with 64 classes a chunk, 39 ms with 256, 16 ms aligned).
CHUNK_CLASSES = 256
SINGLE_TILE_CHUNK = 256  # map cells per chunk side along an axis one tile covers
PREVIEW_BAND = 64  # map rows the preview reads at a time (with CHUNK_CLASSES classes: bounded memory)
PREVIEW_SIDE = 2048  # the preview's longer side at most, in pixels
LEDGER_SUFFIX = ".tiles.jsonl"
ATTRIBUTES = "scoremap"
STATUS = "scoremap_status"  # the map's attribute saying whether every tile is stored, and which failed
FAILED_LISTED = 100  # failed tiles the status attribute lists (the ledger has them all)


class RunError(Exception):
    """The run cannot go on as asked (other options than the stored map's, a map it cannot hold)."""


@dataclass(frozen=True)
class SlideOptions:
    """How a large image is scored and stored; the stored map records them and a resumed run must match."""

    tile: TileOptions = field(default_factory=TileOptions)
    canvas: int = DEFAULT_CANVAS  # the canvas side each tile is scored on (its pixels plus the halo and the passes' slack)
    halo: int | None = None  # None: exact (half the receptive field)
    cell_top_k: int = 0  # 0: store scores of the classes asked (all when none); k: the k best classes per cell
    dtype: str = "float16"
    concurrency: int = 1  # tiles in flight


@dataclass
class SlideSummary:
    """A slide's run: `skipped` tiles were stored before it, `scored` by it; `failed` could not be read (this run
    or an earlier one), by (row, column), with the error: the map is complete only without them."""

    tiles: int
    skipped: int
    scored: int
    map_path: Path
    preview_path: Path | None
    halo: int
    exact: bool
    failed: dict[tuple[int, int], str] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return not self.failed


class Ledger:
    """The tiles stored so far, one JSON line each, appended and synced after the tile's cells are written; and
    the tiles that could not be read, a line each with the error, until a later line stores them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done: set[tuple[int, int]] = set()
        self.failed: dict[tuple[int, int], str] = {}
        if path.exists():
            data = path.read_bytes()
            if data and not data.endswith(b"\n"):  # a line cut by a kill: its tile is not recorded
                data = data[:data.rfind(b"\n") + 1]
                with open(path, "r+b") as handle:
                    handle.truncate(len(data))
            for line in data.decode().splitlines():
                record = json.loads(line)
                key = (record["row"], record["column"])
                if "failed" in record:
                    self.failed[key] = record["failed"]
                else:
                    self.done.add(key)
                    self.failed.pop(key, None)
        self._handle = open(path, "a")

    def record(self, tile: tiling.Tile, *, failed: str | None = None) -> None:
        line = {"row": tile.row, "column": tile.column} | ({"failed": failed} if failed is not None else {})
        self._handle.write(json.dumps(line) + "\n")
        self._handle.flush()
        os.fsync(self._handle.fileno())
        if failed is None:
            self.done.add((tile.row, tile.column))
            self.failed.pop((tile.row, tile.column), None)
        else:
            self.failed[(tile.row, tile.column)] = failed

    def close(self) -> None:
        self._handle.close()


def run_attributes(reader: Reader, card: model_card_pb2.ModelCard, plan: tiling.TilePlan, options: SlideOptions,
                   model: str) -> dict:
    """What the stored map says of itself: enough to map a cell to level-0 pixels and to resume."""
    lattice_y, lattice_x = plan.lattices
    downsample = reader.level.downsample
    return {
        "image": str(reader.path), "level": reader.level.index, "level_size": [reader.level.height, reader.level.width],
        "scored_size": list(plan.image),  # the level less the rows and columns past the model's size multiple
        "level_downsample": downsample, "model": model, "classes": list(options.tile.classes),
        "output_stride": lattice_y.stride, "shift": scoring_pb2.Shift.Name(options.tile.shift),
        "flip": options.tile.flip, "canvas": options.canvas, "halo": plan.halo, "exact": plan.exact,
        "cell_top_k": options.cell_top_k, "dtype": options.dtype,
        "output_kind": model_card_pb2.OutputKind.Name(card.output_kind),
        "tiles": [len(plan.rows), len(plan.columns)],
        # Cell (i, j) is centred at (center_y + i * stride, center_x + j * stride) in level-0 pixels.
        "geometry": {"stride_y": lattice_y.stride * downsample, "stride_x": lattice_x.stride * downsample,
                     "center_y": (lattice_y.first + 0.5) * downsample - 0.5,
                     "center_x": (lattice_x.first + 0.5) * downsample - 0.5,
                     "box_height": card.receptive_field.size * downsample,
                     "box_width": card.receptive_field.size * downsample},
    }


def open_map(path: Path, attributes: dict, cells: tuple[int, int], depth: int, options: SlideOptions,
             chunk: tuple[int, int] = (1, 1)):
    """The stored map's arrays, created on the first run; a resumed run must have asked the same."""
    import zarr

    stored = zarr.open_group(path, mode="r+").attrs.get(ATTRIBUTES) if path.exists() else None
    if stored is not None:  # else none made, or killed while making it: no tile is recorded in it
        group = zarr.open_group(path, mode="r+")
        if stored != attributes:
            changed = sorted(k for k in set(attributes) | set(stored) if stored.get(k) != attributes.get(k))
            raise RunError(f"{path} was scored with other options ({', '.join(changed)} differ); "
                           "run with the same options to resume, or give another --out")
        return group
    group = zarr.open_group(path, mode="w")
    chunks = (min(depth, CHUNK_CLASSES), *chunk)  # a chunk per tile's owned cells: each write touches at most 4
    if options.cell_top_k:
        group.create_array("top_k_indices", shape=(depth, *cells), chunks=chunks, dtype="int32", fill_value=-1)
        group.create_array("top_k_scores", shape=(depth, *cells), chunks=chunks, dtype=options.dtype,
                           fill_value=np.nan)
    else:
        group.create_array("scores", shape=(depth, *cells), chunks=chunks, dtype=options.dtype, fill_value=np.nan)
    group.attrs[ATTRIBUTES] = attributes  # last: a map without its attributes is not one to resume
    return group


def owned_cells(plan: tiling.TilePlan) -> tuple[int, int]:
    """Cells (rows, columns) a tile owns, the stored map's chunk, so a tile's write touches at most 4 chunks
    (one tile along an axis: SINGLE_TILE_CHUNK cells)."""
    def axis(spans: tuple[tiling.Span, ...]) -> int:
        if len(spans) == 1:
            return SINGLE_TILE_CHUNK
        begin, end = spans[1 if len(spans) > 2 else 0].owned
        return end - begin
    return axis(plan.rows), axis(plan.columns)


def store_tile(group, tile: tiling.Tile, tile_map: np.ndarray, options: SlideOptions) -> None:
    """Write a tile's owned cells: its scores, or its cells' best classes."""
    rows, columns = tile.owned(tile_map.shape[1:])
    if options.cell_top_k:
        owned = tile_map[:, rows, columns]
        indices, scores = dense.cell_top_k(owned, options.cell_top_k)
        classes = np.asarray(options.tile.classes, np.int32)
        if classes.size:  # ranks among the classes asked: store the classes' own indices
            indices = np.where(indices >= 0, classes[np.maximum(indices, 0)], -1)
        for name, values in (("top_k_indices", indices), ("top_k_scores", scores)):
            padded = np.zeros((len(values), *tile_map.shape[1:]), values.dtype)
            padded[:, rows, columns] = values
            tiling.stitch_into(group[name], tile, padded)
    else:
        tiling.stitch_into(group["scores"], tile, tile_map.astype(options.dtype))


def write_preview(group, path: Path, *, options: SlideOptions) -> Path:
    """A PNG heatmap of the best stored score per cell (the first class asked, or the top class), at most
    PREVIEW_SIDE px a side, read from the map a band of rows and CHUNK_CLASSES classes at a time."""
    array = group["top_k_scores"] if options.cell_top_k else group["scores"]
    depth, height, width = array.shape
    depth = 1 if options.cell_top_k or options.tile.classes else depth
    step = max(1, -(-max(height, width) // PREVIEW_SIDE))
    band = PREVIEW_BAND - PREVIEW_BAND % step or step
    values = np.full((-(-height // step), -(-width // step)), np.nan, np.float32)
    for start in range(0, height, band):
        rows = slice(start // step, (start + band) // step + 1)
        for first in range(0, depth, CHUNK_CLASSES):
            block = np.asarray(array[first:first + CHUNK_CLASSES, start:start + band:step, ::step], np.float32)
            values[rows][:block.shape[1]] = np.fmax(values[rows][:block.shape[1]], np.fmax.reduce(block, axis=0))
    finite = values[np.isfinite(values)]
    low, high = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    scaled = np.nan_to_num((values - low) / (high - low or 1.0), nan=0.0)
    Image.fromarray(colormap(scaled)).save(path)
    return path


def write_status(group, plan: tiling.TilePlan, ledger: Ledger) -> None:
    """The map's own word on whether it is complete: a tile that could not be read leaves its cells NaN."""
    failed = sorted(ledger.failed.items())
    group.attrs[STATUS] = {
        "complete": not failed, "tiles": len(plan), "stored": len(ledger.done), "failed": len(failed),
        "failed_tiles": [{"row": row, "column": column, "error": error}
                         for (row, column), error in failed[:FAILED_LISTED]],
        "ledger": ledger.path.name,
    }


def score_slide(reader: Reader, score: Scorer, card: model_card_pb2.ModelCard, out: Path, *,
                options: SlideOptions, model: str = "", stem: str | None = None, retry_failed: bool = False,
                on_start: Callable[[int, int], None] | None = None,
                on_tile: Callable[[tiling.Tile], None] | None = None) -> SlideSummary:
    """Score `reader`'s level tile by tile with `score` into OUT/STEM.zarr; resumes a run stopped part-way.

    A tile the reader cannot read is recorded as failed and the others go on; a re-run skips it unless
    `retry_failed`. `on_start(total, done)` once the plan is known; `on_tile(tile)` after each tile is recorded."""
    stem = stem or reader.path.name.split(".")[0]
    out.mkdir(parents=True, exist_ok=True)
    # A model with a size multiple resizes other sizes: the ragged last pixels (fewer than it) are left out.
    multiple = max(card.size_multiple, 1)
    size = (reader.level.height // multiple * multiple, reader.level.width // multiple * multiple)
    plan = plan_for(card, size, (options.canvas, options.canvas), options=options.tile, halo=options.halo)
    attributes = run_attributes(reader, card, plan, options, model)
    map_path = out / f"{stem}.zarr"
    ledger = Ledger(out / f"{stem}{LEDGER_SUFFIX}")
    try:
        skip = ledger.done if retry_failed else ledger.done | set(ledger.failed)
        tiles = [tile for tile in plan if (tile.row, tile.column) not in skip]
        skipped = len(plan) - len(tiles) - (0 if retry_failed else len(ledger.failed))
        if on_start:
            on_start(len(plan), len(plan) - len(tiles))
        group, scored = None, 0
        if ledger.done:  # the map was made with the first tile recorded
            if not map_path.exists():
                raise RunError(f"{ledger.path} records {len(ledger.done)} tiles but {map_path} is gone; "
                               "delete the ledger to start again")
            group = open_map(map_path, attributes, (0, 0), 0, options)
        if tiles and group is None:  # the last tile's map gives the image map's size: score it first
            last = plan.last
            try:
                pixels = reader.read(*last.region)
            except TileError as error:
                raise SlideError(f"{error}; the map's size is taken from this tile, the last, so nothing is "
                                 "scored") from error
            first_map = score_map(score, pixels, options.tile)
            if options.cell_top_k > first_map.shape[0]:
                raise RunError(f"cell_top_k {options.cell_top_k} is more than the {first_map.shape[0]} classes scored")
            group = open_map(map_path, attributes, plan.map_cells(first_map.shape[1:]),
                             options.cell_top_k or first_map.shape[0], options, chunk=owned_cells(plan))
            store_tile(group, last, first_map, options)
            ledger.record(last)
            scored += 1
            if on_tile:
                on_tile(last)
            tiles = [tile for tile in tiles if tile != last]
        scored += _score_tiles(reader, score, group, tiles, ledger, options, on_tile)
        preview = None
        if group is not None:
            write_status(group, plan, ledger)
            if not ledger.failed:  # a preview says the map is whole
                preview = write_preview(group, out / f"{stem}.png", options=options)
        failed = dict(ledger.failed)
    finally:
        ledger.close()
    return SlideSummary(len(plan), skipped, scored, map_path, preview, plan.halo, plan.exact, failed)


def _score_tiles(reader: Reader, score: Scorer, group, tiles: list[tiling.Tile], ledger: Ledger,
                 options: SlideOptions, on_tile: Callable[[tiling.Tile], None] | None) -> int:
    """Read tiles here (readers are not thread-safe), score up to `concurrency` at once, store and record each;
    a tile that cannot be read is recorded as failed, with a warning, and never scored."""
    done = 0
    pending: dict[Future, tiling.Tile] = {}
    queue = iter(tiles)
    pool = ThreadPoolExecutor(max(1, options.concurrency), thread_name_prefix="tile")
    try:
        while True:
            while len(pending) < max(1, options.concurrency):
                tile = next(queue, None)
                if tile is None:
                    break
                try:
                    pixels = reader.read(*tile.region)
                except TileError as error:
                    log.warning("tile (%d, %d) failed: %s", tile.row, tile.column, error)
                    ledger.record(tile, failed=str(error))
                    if on_tile:
                        on_tile(tile)
                    continue
                pending[pool.submit(score_map, score, pixels, options.tile)] = tile
            if not pending:
                return done
            for future in first_done(pending):
                tile = pending.pop(future)
                store_tile(group, tile, future.result(), options)
                ledger.record(tile)
                done += 1
                if on_tile:
                    on_tile(tile)
    finally:
        # Not waiting on tiles in flight: on Ctrl-C the caller interrupts its scorer, which ends them.
        pool.shutdown(wait=not pending, cancel_futures=True)


def score_file(path: str | Path, scorer, out: str | Path, *, level: int = 0,
               options: SlideOptions | None = None, max_pixels: int = DEFAULT_MAX_SLIDE_PIXELS,
               retry_failed: bool = False, **callbacks) -> SlideSummary:
    """The Python API of `scoremap-score --tiled`: score `level` of the image at `path` with `scorer` (a
    ScoremapClient or LocalScorer) into OUT/<name>.zarr and OUT/<name>.png, resuming a run stopped part-way.
    The slide is checked, and refused over `max_pixels`, before anything is written."""
    from clients.slides.readers import open_image

    options = options or SlideOptions()
    with open_image(path, level=level, max_pixels=max_pixels) as reader:
        return score_slide(reader, scorer.score_request, scorer.model(options.tile.model), Path(out),
                           options=options, model=options.tile.model, retry_failed=retry_failed, **callbacks)

