"""The few fixed shapes the engine runs: canvas sizes and batch sizes (docs/design.md: one session per shape).

onnxruntime's CUDA provider replans a session on every change of input shape (0.35-0.8 s on an
H100, batch size included), so every session runs one shape only. As vLLM pads a batch up to the
nearest captured size and TensorRT builds per optimisation profile, a resized image is padded to
the smallest canvas bucket that holds it (plus the shifted passes' slack) and a batch to the next
batch bucket. Canvas buckets come from the served scales and common aspect ratios unless given; on
the CPU, where a new plan costs no replan stall but padding costs its share of every run, from every
step of the size multiple between 1:1 and 2:1 (a 448x384 image on 512x384 takes 1.19x bare onnxruntime, on its own
448x384 canvas 1.12x).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from server.geometry.dense import resized_size

# Height:width of the photos most cameras and phones give, both orientations.
COMMON_ASPECTS = ((1, 1), (3, 4), (4, 3), (2, 3), (3, 2))
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
BATCH_DELAY_CHARGE = 0.1  # of the time per item a CPU batch must save per doubling (Buckets.cheapest_batches)


@dataclass(frozen=True)
class Buckets:
    """Canvas sizes (height, width) and batch sizes a model's plans are made for."""

    canvases: tuple[tuple[int, int], ...]
    batches: tuple[int, ...]

    def canvas_for(self, height: int, width: int, *, slack: int) -> tuple[int, int] | None:
        """The smallest-area canvas holding (height + slack, width + slack); None when none does."""
        fitting = [c for c in self.canvases if c[0] >= height + slack and c[1] >= width + slack]
        return min(fitting, key=lambda c: (c[0] * c[1], c)) if fitting else None

    def batch_for(self, count: int) -> int:
        """The smallest batch bucket holding `count` items (the largest bucket when none does)."""
        return next((b for b in self.batches if b >= count), self.batches[-1])

    def cheapest_batches(self, count: int, seconds_per_item: Callable[[int], float | None]) -> list[int]:
        """Batch buckets holding `count` items with no padding (the buckets start at 1), each the largest that
        fits unless a smaller one that fits was measured cheaper per item once the larger's wait is charged (None:
        not measured; an unmeasured largest runs, and so gets measured). For the CPU, where a padded slot costs a
        whole image and a larger batch need not cost less per item (docs/design.md: CPU batching off by default). Every item of a batch ends
        when its last does, so each doubling must save BATCH_DELAY_CHARGE of the time per item; at equal cost the
        smaller runs."""
        sizes = []
        while count:
            fitting = [b for b in self.batches if b <= count]
            largest = max(fitting)
            measured = {b: seconds for b in fitting if (seconds := seconds_per_item(b)) is not None}
            size = min(measured, key=lambda b: (measured[b] / (1 - BATCH_DELAY_CHARGE) ** math.log2(b), b)) \
                if largest in measured else largest
            sizes.append(size)
            count -= size
        return sizes

    def describe(self) -> str:
        return ", ".join(f"{h}x{w}" for h, w in self.canvases)


def on_demand_canvas(height: int, width: int, *, slack: int, multiple: int) -> tuple[int, int]:
    """The canvas planned for a shape outside every bucket: image plus slack, rounded up to `multiple`."""
    step = max(multiple, 1)
    return (math.ceil((height + slack) / step) * step, math.ceil((width + slack) / step) * step)


def default_buckets(
    *, scales: Iterable[int], slacks: Iterable[int], multiple: int, max_batch: int,
    aspects: Sequence[tuple[int, int]] = COMMON_ASPECTS, every_step: bool = False,
) -> Buckets:
    """Canvases for every served scale x aspect ratio x pass slack; batches 1, 2, 4 ... max_batch.
    `every_step`: the aspects are each scale's `aspect_ladder` instead of `aspects`."""
    canvases = {
        on_demand_canvas(*resized_size(tall, wide, scale=scale, multiple=multiple), slack=slack, multiple=multiple)
        for scale in scales
        for tall, wide in (aspect_ladder(scale, multiple) if every_step else aspects)
        for slack in slacks
    }
    return Buckets(tuple(sorted(canvases)), batch_buckets(max_batch))


def aspect_ladder(scale: int, multiple: int) -> tuple[tuple[int, int], ...]:
    """Height:width from 1:1 to 1:2 and 2:1, the long side in steps of `multiple` at `scale`: every image
    in that range resized to `scale` fits one canvas exactly."""
    longs = range(scale, 2 * scale + 1, max(multiple, 1))
    return tuple(sorted({(scale, long) for long in longs} | {(long, scale) for long in longs}))


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4 ... up to and including `max_batch`."""
    return tuple(b for b in BATCH_BUCKETS if b < max_batch) + (max_batch,)

