"""Option values the convert package accepts, and argparse types for them (light: `--help` imports only this)."""

from __future__ import annotations

import argparse

__all__ = ["DEFAULT_OUTPUT_STRIDE", "PORT", "SUPPORTED_OUTPUT_STRIDES", "number_in", "size_pair"]

# Native stride when a caller asks for none finer: one cell per 32 px, the classic dense evaluation.
DEFAULT_OUTPUT_STRIDE = 32
# The strides the à trous rewrite can produce (each halving dilates everything after it by 2).
SUPPORTED_OUTPUT_STRIDES = (32, 16, 8)


def size_pair(text: str) -> tuple[int, int]:
    """'224' or '224x192' (height x width)."""
    parts = text.lower().split("x")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected N or HxW, e.g. 224 or 224x192") from None
    if len(values) not in (1, 2) or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected N or HxW with positive sizes")
    return (values[0], values[-1])


def number_in(kind: type[int] | type[float], low: float | None = None, high: float | None = None):
    """An argparse type: `kind` (int or float) within [low, high] (None: unbounded on that side).

    A bad value exits 2 with the flag named, before anything is loaded (issue 24: `--port 70000`
    listened on 4464, `--max-batch 0` failed only in warm-up)."""
    word = "an integer" if kind is int else "a number"
    bounds = ("" if low is None and high is None else f" from {low} to {high}" if low is not None and high is not None
              else f" >= {low}" if low is not None else f" <= {high}")

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"got {text!r}; expected {word}{bounds}") from None
        if value != value or (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"got {text!r}; expected {word}{bounds}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


PORT = number_in(int, 0, 65535)  # 0: any free port
