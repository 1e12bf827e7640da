"""argparse value types shared by the convert package's command lines."""

from __future__ import annotations

import argparse

__all__ = ["size_pair"]


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
