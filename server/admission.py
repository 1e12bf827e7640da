"""Memory admission: predict a batch's peak memory before running it, against a budget.

The prediction is `convert.profile`'s, the one `scoremap-inspect` prints, so what users are shown
is what the server enforces. Batches are cut to the largest size that fits; a pass that cannot
fit even alone is refused with the numbers and the largest scale that would fit.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable

import grpc
import onnx

from convert.profile import ProfileError, Skeleton, largest_batch, load_skeleton, profile_model
from server.errors import ScoringError

LOG = logging.getLogger(__name__)
PROFILE_CACHE_SIZE = 1024  # input sizes (and batch sizes) whose predictions each model remembers


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), or None."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1024
    return f"{count:.1f} GiB"


class Admission:
    """The memory check for one model: batch limits per input shape, cached.

    It profiles the graph it was given at load time, never the file again: a model file replaced
    or removed while serving must not change (or break) what the server enforces. It keeps only
    the graph's skeleton, not a second copy of the weights the session already holds.
    """

    def __init__(self, model: onnx.ModelProto | Skeleton, *, budget_bytes: int | None) -> None:
        self.model = load_skeleton(model)
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        # Per instance, not functools.lru_cache on the methods: that cache is shared by every
        # Admission and keeps each one (and its graph) alive.
        self.predicted_bytes = functools.lru_cache(maxsize=PROFILE_CACHE_SIZE)(self._predicted_bytes)
        self.batch_limit = functools.lru_cache(maxsize=PROFILE_CACHE_SIZE)(self._batch_limit)

    def _predicted_bytes(self, height: int, width: int, batch: int = 1) -> int:
        """Predicted peak bytes of one batch of [height, width] inputs."""
        return profile_model(self.model, height=height, width=width, batch=batch).predicted_peak_bytes

    def _batch_limit(self, height: int, width: int) -> int:
        """The largest batch of this input size within the budget (0: not even one); no budget: unbounded."""
        if self.budget_bytes is None:
            return 1 << 30
        with self._lock:
            return largest_batch(self.model, height=height, width=width, budget_bytes=self.budget_bytes)

    def admit(self, height: int, width: int, *, scale: int, largest_scale: Callable[[], int]) -> int:
        """The batch limit for this size; RESOURCE_EXHAUSTED with the numbers when one pass cannot fit."""
        try:
            limit = self.batch_limit(height, width)
        except ProfileError as error:
            raise ScoringError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"scale {scale} gives an input of {height}x{width} the model cannot take: {error}",
            ) from error
        if limit > 0:
            return limit
        predicted = self.predicted_bytes(height, width)
        fits = largest_scale()
        hint = f"the largest scale that fits is {fits}" if fits else "no scale of this image fits"
        raise ScoringError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"scale {scale} ({height}x{width} input) needs a predicted {predicted} bytes ({format_bytes(predicted)}) "
            f"but the memory budget is {self.budget_bytes} bytes ({format_bytes(self.budget_bytes)}); {hint}",
        )

    def fits(self, height: int, width: int) -> bool:
        """One pass of this input size fits the budget."""
        if self.budget_bytes is None:
            return True
        try:
            return self.predicted_bytes(height, width) <= self.budget_bytes
        except ProfileError:
            return False
