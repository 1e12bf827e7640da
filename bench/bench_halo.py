"""The halo as a trade-off: difference from one pass, and compute, against the tile halo.

Each sample is resized (shorter side `side`, sides multiples of 32) and scored once whole and then
tile by tile through the in-process Pipeline (`scoremap-score --local`'s path) at stride 32, with
canvases just large enough for interior tiles to own `step` px each at that halo (the cost of a
halo is the pixels its tiles read: `overhead` = tile pixels / image pixels). Logits are the maps;
probabilities their softmax over the classes per cell.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import tempfile

import numpy as np
from PIL import Image

from bench.models import converted, vgg_model
from clients.slides.tiles import TileOptions, plan_for, score_map, score_tiled
from convert.card import read_card
from server.geometry import dense, tiling
from server.scoring.pipeline import Pipeline
from server.settings import Settings

ROOT = pathlib.Path(__file__).resolve().parents[1]
LARGE_CANVAS = 2048  # the canvas of the large-image overhead column (scoremap-score --tiled's default)
HALO_SHARES = (0.0, 0.125, 0.25, 0.5, 0.75, 1.0)  # of the exact halo (half the receptive field)
# Every canvas planned on demand, as the one pass's is: no bucket holds a tile.
SETTINGS = Settings(warm_up=False, shape_buckets=((32, 32),), max_queue_ms=600_000.0)


@dataclasses.dataclass(frozen=True)
class Case:
    model: str  # "default" or "vgg"
    side: int  # the samples' shorter side: large enough for several tiles at the exact halo
    step: int  # pixels an interior tile owns per axis
    samples: tuple[str, ...]


FULL = (Case("vgg", 768, 256, ("astronaut.jpg", "cat.jpg", "coffee.jpg", "rocket.jpg")),
        Case("default", 1536, 512, ("cat.jpg", "astronaut.jpg")))
QUICK = (Case("vgg", 384, 128, ("cat.jpg",)), Case("default", 768, 128, ("cat.jpg",)))


@dataclasses.dataclass
class Row:
    model: str
    halo: int
    exact: bool
    tiles: int = 0
    overhead: float = 0.0
    large_overhead: float = 0.0
    logit_max: float = 0.0
    logit_mean: list[float] = dataclasses.field(default_factory=list)
    probability_max: float = 0.0
    probability_mean: list[float] = dataclasses.field(default_factory=list)


def large_image_overhead(lattice: tiling.Lattice, halo: int, canvas: int = LARGE_CANVAS) -> float:
    """Pixels read per pixel owned by an interior tile on `canvas`: the cost of `halo` on an image of many tiles."""
    lead, trail = lattice.context(halo, length=canvas * 64)
    net = lattice.net_stride
    step = (canvas - lattice.fill(canvas * 64) - lead - trail) // net * net
    return (canvas / step) ** 2 if step > 0 else float("inf")


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=0, keepdims=True))
    return shifted / shifted.sum(axis=0, keepdims=True)


def sample(name: str, side: int) -> np.ndarray:
    image = Image.open(ROOT / "samples" / name).convert("RGB")
    height, width = dense.resized_size(image.height, image.width, scale=side, multiple=32)
    return np.asarray(image.resize((width, height), Image.Resampling.BILINEAR))


def measure(folder: str, cases: tuple[Case, ...]) -> list[Row]:
    rows = []
    for case in cases:
        path = converted(folder) if case.model == "default" else vgg_model(folder)
        card = read_card(path)
        exact = tiling.exact_halo(card.receptive_field.size)
        options = TileOptions()
        lattice = tiling.Lattice.of(field_center=card.receptive_field.center_y,
                                    training=card.training_height,
                                    passes=dense.passes_for(native_stride=card.output_stride, output_stride=0, shift=0))
        pipeline = Pipeline([path], settings=SETTINGS)
        try:
            for share in HALO_SHARES:
                halo = int(round(exact * share))
                row = Row(case.model, halo, halo >= exact, large_overhead=large_image_overhead(lattice, halo))
                for name in case.samples:
                    pixels = sample(name, case.side)
                    whole = score_map(pipeline.score, pixels, options)
                    side = lattice.least_canvas(halo, length=max(pixels.shape[:2]), step=case.step)
                    plan = plan_for(card, pixels.shape[:2], (side, side), options=options, halo=halo)
                    tiled = score_tiled(pipeline.score, pixels, plan, options)
                    logits = np.abs(tiled - whole)
                    probabilities = np.abs(softmax(tiled) - softmax(whole))
                    row.tiles += len(plan)
                    row.overhead += sum(t.y.length * t.x.length for t in plan) / pixels[..., 0].size / len(case.samples)
                    row.logit_max = max(row.logit_max, float(logits.max()))
                    row.logit_mean.append(float(logits.mean()))
                    row.probability_max = max(row.probability_max, float(probabilities.max()))
                    row.probability_mean.append(float(probabilities.mean()))
                rows.append(row)
                print(f"{case.model} halo {halo}: max |logit| {row.logit_max:.3g}, overhead {row.overhead:.2f}x", flush=True)
        finally:
            pipeline.close()
    return rows


def run(quick: bool = False) -> str:
    cases = QUICK if quick else FULL
    with tempfile.TemporaryDirectory() as folder:
        rows = measure(folder, cases)
    lines = [
        "## Tile halo against one pass (bench_halo)",
        "",
        "Stride 32, each tile on the least canvas for its halo. "
        + "; ".join(f"{c.model}: {', '.join(c.samples)} at shorter side {c.side}, interior tiles owning {c.step} px "
                    "per axis" for c in cases)
        + ". The exact halo is half the receptive field (default model 1043 px: 521; VGG-width 244 px: 122). "
        "Differences over every cell of every sample: max, and mean of the per-sample means; overhead: pixels the "
        f"tiles read / image pixels; on a large image: pixels an interior tile on a {LARGE_CANVAS}-px canvas reads per "
        "pixel it owns.",
        "",
        "| model | halo px | exact | tiles | overhead | on a large image | max abs logit | mean abs logit | max abs prob | mean abs prob |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {r.model} | {r.halo} | {'yes' if r.exact else 'no'} | {r.tiles} | {r.overhead:.2f}x | {r.large_overhead:.2f}x | {r.logit_max:.2e} | "
              f"{np.mean(r.logit_mean):.2e} | {r.probability_max:.2e} | {np.mean(r.probability_mean):.2e} |" for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one small sample per model (a smoke run)")
    print(run(quick=parser.parse_args().quick))
