"""`python -m convert.demo MODEL.onnx PHOTO...`: dense top-5 labels and the score-map shape per photo.

An interim `make demo`: the converted graph run in-process with onnxruntime, the photo's shorter
side resized to the card's default scale (the other side rounded to the card's size multiple).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import onnx
from PIL import Image

from convert.card import ModelCard, read_card
from convert.verify import preprocess, run, session

# How many labels the demo prints per photo.
TOP = 5


def scaled_size(width: int, height: int, *, scale: int, multiple: int) -> tuple[int, int]:
    """(width, height) with the shorter side at `scale`, both rounded to `multiple` (when non-zero)."""
    factor = scale / min(width, height)
    step = multiple or 1
    return max(step, round(width * factor / step) * step), max(step, round(height * factor / step) * step)


def probabilities(scores: np.ndarray, card: ModelCard) -> np.ndarray:
    """Per-cell class probabilities [K, h, w] from one image's scores."""
    if card.output_kind == "probabilities":
        return scores
    shifted = np.exp(scores - scores.max(axis=0, keepdims=True))
    return shifted / shifted.sum(axis=0, keepdims=True)


def describe_photo(path: str, card: ModelCard, runner) -> str:
    with Image.open(path) as image:
        rgb = image.convert("RGB")
        size = scaled_size(*rgb.size, scale=card.default_scale, multiple=card.size_multiple)
        pixels = np.asarray(rgb.resize(size, Image.Resampling.BILINEAR), np.float32)
    scores = run(runner, preprocess(pixels[None], card.preprocessing))[0]
    mean = probabilities(scores, card).mean(axis=(1, 2))
    top = np.argsort(mean)[::-1][:TOP]
    labels = ", ".join(f"{card.labels[k]} {mean[k]:.2f}" for k in top)
    return f"{path}: input {size[0]}x{size[1]}, score map {list(scores.shape)} (K, h, w); top-{TOP}: {labels}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m convert.demo", description=__doc__)
    p.add_argument("model", help="a converted .onnx (scoremap-convert)")
    p.add_argument("photos", nargs="+")
    args = p.parse_args(argv)
    card = read_card(args.model)
    runner = session(onnx.load(args.model))
    for photo in args.photos:
        sys.stdout.write(describe_photo(photo, card, runner) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
