"""The range each number of a request takes, and the one refusal of a value outside it.

A number is checked where it enters: a ScoreRequest field by admission, an HTTP query option or a
KServe v2 parameter or shape by its edge before it is put in a ScoreRequest (whose int32 fields
could not hold it). Both refuse with `out_of_range`, so a value out of range gets the same words over
every transport: the field as the caller named it, the value received, and the range it takes.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.errors import ScoringError, invalid

__all__ = ["INT32_MAX", "MAX_TIMEOUT_MS", "RANGES", "Range", "checked", "out_of_range", "outside"]

INT32_MAX = 2**31 - 1  # protobuf's int32: ScoreRequest's numbers, and RawImage's sides
# The longest timeout a call may give, in milliseconds: gRPC's own deadlines are milliseconds in a C int (24 days).
MAX_TIMEOUT_MS = INT32_MAX


@dataclass(frozen=True)
class Range:
    """The values a number takes, `least` to `most` (`least` itself excluded when `above`), and what it is."""

    least: int | float
    most: int | float
    meaning: str
    above: bool = False

    def holds(self, value: int | float) -> bool:
        low = value > self.least if self.above else value >= self.least
        return low and value <= self.most  # NaN holds neither

    def __str__(self) -> str:
        return f"above {self.least}, at most {self.most}" if self.above else f"{self.least}..{self.most}"


# By ScoreRequest field (and the timeouts the HTTP edge reads); the edges name them as their callers do.
RANGES = {
    "scales": Range(1, INT32_MAX, "a target shorter side in pixels"),
    "output_stride": Range(0, INT32_MAX, "the output stride in pixels; 0: the model's own"),
    "top_k": Range(0, INT32_MAX, "how many labels the answer ranks; 0: the server's default"),
    "cell_top_k": Range(0, INT32_MAX, "how many classes each map cell ranks; 0: none"),
    "classes": Range(0, INT32_MAX, "a class index"),
    "height": Range(1, INT32_MAX, "the image's height in pixels"),
    "width": Range(1, INT32_MAX, "the image's width in pixels"),
    "timeout_ms": Range(0, MAX_TIMEOUT_MS, "milliseconds", above=True),
    "timeout_us": Range(0, MAX_TIMEOUT_MS * 1000, "microseconds", above=True),
}


def out_of_range(name: str, value: object, field: str) -> ScoringError:
    """INVALID_ARGUMENT naming the field as the caller named it (`name`), the value and the range of `field`."""
    bounds = RANGES[field]
    return invalid(f"{name} {value} is out of range: it takes {bounds} ({bounds.meaning})")


def outside(name: str, value: int | float, field: str) -> ScoringError | None:
    """The refusal of `value` when it is outside the range of `field` (None: inside)."""
    return None if RANGES[field].holds(value) else out_of_range(name, value, field)


def checked(name: str, value: int | float, field: str) -> int | float:
    """`value` when it is inside the range of `field`; else its refusal raised."""
    refused = outside(name, value, field)
    if refused is not None:
        raise refused
    return value
