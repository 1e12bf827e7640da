"""Option values the convert package accepts, and argparse types for them (light: `--help` imports only this)."""

from __future__ import annotations

import argparse

__all__ = ["DEFAULT_OUTPUT_STRIDE", "SUPPORTED_OUTPUT_STRIDES", "size_pair"]

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
