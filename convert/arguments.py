"""Option values the convert package accepts, and argparse types for them (light: `--help` imports only this)."""

from __future__ import annotations

import argparse

__all__ = ["DEFAULT_OUTPUT_STRIDE", "PORT", "SUPPORTED_OUTPUT_STRIDES", "host_port", "memory_size", "number_in",
           "number_list", "size_pair"]

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

    A bad value exits 2 with the flag named, before anything is loaded: unchecked, `--port 70000` would
    listen on 4464 and `--max-batch 0` fail only in warm-up."""
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


def memory_size(text: str) -> int:
    """An argparse type: a memory size above zero, such as 2GiB (convert.profile's units), in bytes."""
    from convert.profile import ProfileError, parse_bytes  # imports onnx: only when a size is given

    try:
        value = parse_bytes(text)
    except ProfileError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected a memory size above zero, such as 2GiB")
    return value


def number_list(kind: type[int] | type[float], low: float | None = None, high: float | None = None):
    """An argparse type: comma-separated `kind` values, each within [low, high], at least one."""
    item = number_in(kind, low, high)

    def parse(text: str) -> list:
        parts = [part for part in text.split(",") if part.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"got {text!r}; expected comma-separated values such as 1,4,16")
        return [item(part.strip()) for part in parts]

    parse.__name__ = f"{kind.__name__} list"
    return parse


def host_port(text: str) -> str:
    """An argparse type: HOST:PORT (IPv6 hosts in brackets), the port within PORT's range."""
    host, colon, port = text.rpartition(":")
    if not colon or not host or host.endswith(":"):
        raise argparse.ArgumentTypeError(f"got {text!r}; expected HOST:PORT, e.g. 127.0.0.1:50051 or [::1]:50051")
    try:
        PORT(port)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected HOST:PORT with a port from 0 to 65535") from None
    return text


def format_bytes(count: float) -> str:
    """A byte count as people read it (the inverse of `memory_size`'s units): 512 B, 17.7 MiB, 4.0 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1024
    return f"{count:.1f} GiB"
