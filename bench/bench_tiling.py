"""Gigapixel tiling on the CPU, or on the GPU with `--provider cuda`: throughput,
memory against size, and exact vs overlap-averaged tiles.

A synthetic tiled BigTIFF mosaic is written from the samples (JPEG tiles from a generator: bounded
memory, seconds per gigapixel) at two sizes and scored at stride 32 with the default model, exact
halo, `scoremap-score --tiled --local`'s path (clients.slides.run.score_slide over the in-process
Pipeline), each size in its own process so its peak RSS is its own. Against it:
- a bare onnxruntime loop over the same tiles (read from the same TIFF, normalised, one session
  run each, nothing stored) on the same provider, through the server's Engine: the pipeline's
  throughput as a share of it;
- on a crop small enough for one pass: exact tiling and the anchors' scheme (MONAI's
  `overlap=0.25`, overlapping predictions averaged) on the same canvas, in pixels scored (the
  compute) and in max |logit| difference from one pass.

`python -m bench.bench_tiling --small` runs 4 and 16 Mpx in about a minute (a smoke run); `make bench`
runs 67 and 268 Mpx on the default model (about half an hour on 2 cores) and the memory rows at 0.27 and
1.07 Gpx on the null model (`--memory-only` runs those alone, a few minutes). `--provider` takes the server's
own choices (cpu, the default; cuda; auto): every process of a run, the pipeline's and the bare loop's, uses
the one it settles on, and the section says which. `--provider cuda` where CUDA does not really load says
why and measures nothing. It prints the section; only `make bench` (the CPU) records it in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np
import tifffile
from PIL import Image

from bench.models import converted, null_model
from server.geometry.tiling import TilePlan
from server.settings import EngineOptions, Settings

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIFF_TILE = 512  # the mosaic's TIFF tile side
CANVAS = 2048  # the canvas each scoring tile runs on
# The default model scores about 1 Mpx/s on 2 cores: 67 and 268 Mpx keep `make bench` within the half hour; the
# memory rows (null model) go to 0.27 and 1.07 Gpx.
FULL_SIDES = (8192, 16384)  # 67 and 268 Mpx
MEMORY_SIDES = (16384, 32768)  # 0.27 and 1.07 Gpx
SMALL_SIDES = (2048, 4096)  # 4 and 16 Mpx
COMPARE_SIDE = 1536  # the crop scored in one pass, for exact vs overlap-averaged tiles
COMPARE_CANVAS = 1280
OVERLAP = 0.25  # MONAI SlidingWindowInferer's default
REPEATS = 2  # runs of each, alternated; the fastest counts
CONCURRENCY = 2  # tiles in flight: a tile is stored while the next is scored (scoremap-score's --concurrency)
PROVIDER_FIELD = next(declared for declared in dataclasses.fields(EngineOptions) if declared.name == "provider")
# Not run: --provider cuda where CUDA does not load. 2, not bench_gpu's 0: `make bench-gpu` is a target meant
# to be harmless anywhere, while here CUDA was asked for by name, and a script on a lent GPU machine must not
# read a run that measured nothing as a success.
NOT_RUN = 2


def mosaic_tiles(side: int):
    """The mosaic's TIFF tiles, row by row: the samples cut to tiles and cycled, a few decoded images in memory."""
    patches = []
    for path in sorted((ROOT / "samples").glob("*.jpg")):
        image = Image.open(path).convert("RGB").resize((TIFF_TILE * 2, TIFF_TILE * 2), Image.Resampling.BILINEAR)
        pixels = np.asarray(image)
        patches += [pixels[y:y + TIFF_TILE, x:x + TIFF_TILE] for y in (0, TIFF_TILE) for x in (0, TIFF_TILE)]
    count = side // TIFF_TILE
    for row in range(count):
        for column in range(count):
            yield patches[(row * 7 + column * 3) % len(patches)]


def write_mosaic(path: pathlib.Path, side: int) -> pathlib.Path:
    with tifffile.TiffWriter(path, bigtiff=True) as tiff:
        tiff.write(mosaic_tiles(side), shape=(side, side, 3), dtype=np.uint8, tile=(TIFF_TILE, TIFF_TILE),
                   compression="jpeg", compressionargs={"level": 90}, photometric="rgb")
    return path


def peak_rss_mib() -> float:
    """This process's own peak resident set (VmHWM): ru_maxrss would carry the parent's across exec on Linux."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("/proc/self/status has no VmHWM line")


def server_settings(provider: str, *, one_pass_per_tile: bool = False) -> Settings:
    """The server's settings on `provider` (cpu or cuda), plans made on first use, no queue limit; on CUDA one
    that does not really load is an error (--require-gpu), never a CPU run measured as the GPU's.

    `one_pass_per_tile`: the scoring canvas is the server's only bucket, for the null model's memory rows: its
    own buckets (from its 32-px training size) reach 160 px, so the server would tile each 2048-px tile onto
    them, 1,302 passes, past --queue-depth, and refuse it."""
    return Settings(warm_up=False, max_queue_ms=3_600_000.0, provider=provider, require_gpu=provider == "cuda",
                    shape_buckets=((CANVAS, CANVAS),) if one_pass_per_tile else ())


def tile_shapes(plan: TilePlan) -> set[tuple[int, int]]:
    """Each tile shape of a plan once (full, last row, last column, corner): each is run once untimed, as a
    server runs warm plans."""
    return {(tile.y.length, tile.x.length) for tile in plan}


def child_pipeline(tiff: str, model: str, out: str, *, provider: str, one_pass_per_tile: bool = False) -> dict:
    """Score the TIFF as `scoremap-score --tiled --local` does; seconds, tiles and this process's peak RSS."""
    from clients.batch.local import LocalScorer
    from clients.slides.readers import open_image
    from clients.slides.run import SlideOptions, score_slide
    from clients.slides.tiles import TileOptions, plan_for, score_map

    settings = server_settings(provider, one_pass_per_tile=one_pass_per_tile)
    with LocalScorer([model], settings=settings) as scorer, open_image(tiff) as reader:
        card = scorer.model()
        plan = plan_for(card, (reader.level.height, reader.level.width), (CANVAS, CANVAS), options=TileOptions())
        for shape in tile_shapes(plan):
            score_map(scorer.score_request, np.zeros((*shape, 3), np.uint8), TileOptions())
        started = time.perf_counter()
        summary = score_slide(reader, scorer.score_request, card, pathlib.Path(out),
                              options=SlideOptions(canvas=CANVAS, concurrency=CONCURRENCY))
        seconds = time.perf_counter() - started
    return {"seconds": seconds, "tiles": summary.tiles, "halo": summary.halo, "rss_mib": peak_rss_mib()}


def child_bare(tiff: str, model: str, *, provider: str) -> dict:
    """The same tiles, read and normalised, through one onnxruntime session of the converted model: nothing else.

    The server's Engine makes the session (its session options and providers), so the comparison is of what
    tiling and the pipeline add, not of onnxruntime's settings. On CUDA a plain `session.run`, numpy in and out:
    the host copies are counted here as the pipeline's plans count theirs (canvases in, maps out)."""
    from clients.slides.readers import open_image
    from clients.slides.tiles import TileOptions, plan_for
    from convert.card import ImageInput, read_card
    from convert.preprocessing import to_input
    from server.engine.providers import Engine

    card = read_card(model)
    image = ImageInput.of(card)
    session = Engine(server_settings(provider)).session(pathlib.Path(model).read_bytes())
    name = session.get_inputs()[0].name
    with open_image(tiff) as reader:
        plan = plan_for(card, (reader.level.height, reader.level.width), (CANVAS, CANVAS), options=TileOptions())
        for shape in tile_shapes(plan):
            session.run(None, {name: to_input(np.zeros((1, *shape, 3), np.uint8), image)})
        started = time.perf_counter()
        for tile in plan:
            session.run(None, {name: to_input(reader.read(*tile.region)[None], image)})
        seconds = time.perf_counter() - started
    return {"seconds": seconds, "tiles": len(plan), "rss_mib": peak_rss_mib(), "provider": session.get_providers()[0]}


def in_child(*arguments: str, provider: str, one_pass_per_tile: bool = False) -> dict:
    """Run this module's child mode in a fresh process on `provider` and return what it reports; a child that
    fails raises with its own last word, since a run on a lent machine has one try."""
    flags = ["--provider", provider, *(["--one-pass-per-tile"] if one_pass_per_tile else [])]
    done = subprocess.run([sys.executable, "-m", "bench.bench_tiling", *flags, "--child", *arguments],
                          capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        said = done.stderr.strip().splitlines() or ["(nothing on stderr)"]
        raise RuntimeError(f"bench_tiling's {arguments[0]} child failed (status {done.returncode}): {said[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare_schemes(tiff: pathlib.Path, model: str, *, provider: str) -> dict:
    """On a crop one pass can score: exact tiles and overlap-averaged ones on the same canvas, against one pass."""
    from clients.batch.local import LocalScorer
    from clients.slides.readers import open_image
    from clients.slides.tiles import TileOptions, plan_for, score_map, score_tiled

    options = TileOptions()
    with open_image(tiff) as reader:
        pixels = reader.read(slice(0, COMPARE_SIDE), slice(0, COMPARE_SIDE))
    with LocalScorer([model], settings=server_settings(provider)) as scorer:
        card = scorer.model()
        whole = score_map(scorer.score_request, pixels, options)
        plan = plan_for(card, pixels.shape[:2], (COMPARE_CANVAS, COMPARE_CANVAS), options=options)
        exact = score_tiled(scorer.score_request, pixels, plan, options)
        exact_pixels = sum(t.y.length * t.x.length for t in plan)
        # The anchors: tiles of the canvas (less the one pass's fill) at 75% steps, overlapping cells averaged.
        side = COMPARE_CANVAS - plan.lattices[0].fill(COMPARE_SIDE)
        step = int(side * (1 - OVERLAP)) // card.output_stride * card.output_stride
        starts = sorted({min(s, COMPARE_SIDE - side) // card.output_stride * card.output_stride
                         for s in range(0, COMPARE_SIDE - side + step, step)})
        total, count = np.zeros_like(whole), np.zeros(whole.shape[1:])
        naive_pixels = 0
        for y in starts:
            for x in starts:
                tile = score_map(scorer.score_request, pixels[y:y + side, x:x + side], options)
                row, column = y // card.output_stride, x // card.output_stride
                rows = min(tile.shape[1], whole.shape[1] - row)
                columns = min(tile.shape[2], whole.shape[2] - column)
                total[:, row:row + rows, column:column + columns] += tile[:, :rows, :columns]
                count[row:row + rows, column:column + columns] += 1
                naive_pixels += side * side
        naive = total / np.maximum(count, 1)
    image_pixels = COMPARE_SIDE**2
    return {"exact_overhead": exact_pixels / image_pixels, "exact_max": float(np.abs(exact - whole).max()),
            "naive_overhead": naive_pixels / image_pixels, "naive_max": float(np.abs(naive - whole).max()),
            "naive_mean": float(np.abs(naive - whole).mean()), "tiles": len(plan), "naive_tiles": len(starts) ** 2}


def memory_against_size(sides: tuple[int, ...], *, provider: str = "cpu") -> list[str]:
    """Peak RSS against size with the null model (a converted net that costs next to nothing), so the
    gigapixel sizes finish on a CPU: reading the TIFF region by region, stitching and storing the Zarr map
    alone, each size in its own process; the resident set must not grow with the image."""
    lines = ["| image (null model) | tiles | seconds | Mpx/s | peak RSS |", "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as folder:
        folder = pathlib.Path(folder)
        model = null_model(folder)
        for side in sides:
            tiff = write_mosaic(folder / f"mosaic{side}.tif", side)
            result = in_child("pipeline", str(tiff), model, str(folder / f"null{side}"), provider=provider,
                              one_pass_per_tile=True)
            mpx = side * side / 1e6
            lines.append(f"| {side}x{side} ({mpx:,.0f} Mpx) | {result['tiles']} | {result['seconds']:.0f} | "
                         f"{mpx / result['seconds']:.1f} | {result['rss_mib']:.0f} MiB |")
            print(lines[-1], flush=True)
            tiff.unlink()
    return lines


def run(small: bool = False, *, provider: str = "cpu") -> str:
    """The section, every process on `provider` (cpu or cuda: main settles auto)."""
    sides = SMALL_SIDES if small else FULL_SIDES
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        folder = pathlib.Path(folder)
        model = converted(folder)
        comparison = None
        for side in sides:
            started = time.perf_counter()
            tiff = write_mosaic(folder / f"mosaic{side}.tif", side)
            written = time.perf_counter() - started
            print(f"wrote a {side}x{side} mosaic ({tiff.stat().st_size / 2**20:.0f} MiB) in {written:.1f} s", flush=True)
            # Alternated and repeated, the fastest of each kept: the two share the machine with whatever else runs.
            pipelines, bares = [], []
            for repeat in range(REPEATS):
                pipelines.append(in_child("pipeline", str(tiff), model, str(folder / f"out{side}-{repeat}"),
                                          provider=provider))
                bares.append(in_child("bare", str(tiff), model, provider=provider))
            pipeline = min(pipelines, key=lambda result: result["seconds"])
            bare = min(bares, key=lambda result: result["seconds"])
            pipeline["rss_mib"] = max(result["rss_mib"] for result in pipelines)
            bare["rss_mib"] = max(result["rss_mib"] for result in bares)
            if comparison is None:
                comparison = compare_schemes(tiff, model, provider=provider)
            rows.append((side, written, pipeline, bare))
            tiff.unlink()
    on_gpu = provider == "cuda"
    if on_gpu:
        from bench.bench_gpu import machine  # not at the top: see main
    lines = [
        f"## Gigapixel tiling on {'CUDA' if on_gpu else 'the CPU'} (bench_tiling)",
        "",
        *([machine(), ""] if on_gpu else []),
        f"Default model, stride 32, exact halo, {CANVAS}-px canvases, a JPEG-tiled BigTIFF mosaic of the samples; "
        f"each run in its own process (peak RSS its own), {CONCURRENCY} tiles in flight, the fastest of {REPEATS} "
        "alternated runs. Bare: the same tiles read and normalised, one onnxruntime run each (the server's session "
        "options and providers), nothing stored.",
        "",
        "| image | written in | tiles | halo | pipeline Mpx/s | bare Mpx/s | pipeline / bare | peak RSS pipeline | peak RSS bare |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for side, written, pipeline, bare in rows:
        mpx = side * side / 1e6
        lines.append(f"| {side}x{side} ({mpx:.0f} Mpx) | {written:.1f} s | {pipeline['tiles']} | {pipeline['halo']} | "
                     f"{mpx / pipeline['seconds']:.2f} | {mpx / bare['seconds']:.2f} | "
                     f"{bare['seconds'] / pipeline['seconds']:.0%} | {pipeline['rss_mib']:.0f} MiB | {bare['rss_mib']:.0f} MiB |")
    c = comparison
    lines += [
        "",
        f"Exact tiles against the anchors' overlap-averaging ({OVERLAP:.0%} overlap, MONAI's default), both on "
        f"{COMPARE_CANVAS}-px canvases, on a {COMPARE_SIDE}x{COMPARE_SIDE} crop scored also in one pass:",
        "",
        "| scheme | tiles | pixels scored / image pixels | max abs logit vs one pass |",
        "|---|---|---|---|",
        f"| exact (halo from the receptive field) | {c['tiles']} | {c['exact_overhead']:.2f}x | {c['exact_max']:.1e} |",
        f"| overlap-averaged | {c['naive_tiles']} | {c['naive_overhead']:.2f}x | {c['naive_max']:.2f} "
        f"(mean {c['naive_mean']:.3f}) |",
    ]
    lines += ["", "Memory against size, the null model at the same sizes (the path around the net alone):", "",
              *memory_against_size(SMALL_SIDES if small else MEMORY_SIDES, provider=provider)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="4 and 16 Mpx instead of 0.27 and 1.07 Gpx (a smoke run)")
    parser.add_argument("--provider", choices=PROVIDER_FIELD.metadata["choices"], default="cpu",
                        help=f"the server's --provider ({PROVIDER_FIELD.metadata['help']}), for the pipeline and the bare "
                             "loop alike (default: cpu, as `make bench` runs)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--one-pass-per-tile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--memory-only", action="store_true", help="only the null model's memory against size")
    args = parser.parse_args(argv)
    if args.child:  # the parent settled the provider
        mode, *rest = args.child
        print(json.dumps(child_pipeline(*rest, provider=args.provider, one_pass_per_tile=args.one_pass_per_tile)
                         if mode == "pipeline" else child_bare(*rest, provider=args.provider)))
        return 0
    provider = args.provider
    if provider != "cpu":
        # Not at the top: bench_gpu pulls in gRPC and the server, which each child's peak RSS would count.
        from bench.bench_gpu import cuda_unavailable

        reason = cuda_unavailable()
        if reason and provider == "cuda":
            print(f"bench_tiling: not run: --provider cuda, but {reason}", file=sys.stderr)
            return NOT_RUN
        provider = "cpu" if reason else "cuda"  # auto, settled once, so every process and the title agree
    if args.memory_only:
        print("\n".join(memory_against_size(SMALL_SIDES if args.small else MEMORY_SIDES, provider=provider)))
    else:
        print(run(small=args.small, provider=provider))
    return 0


if __name__ == "__main__":
    sys.exit(main())
