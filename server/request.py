"""The request's types, below every stage: what a request becomes on its way through the pipeline.

    ScoreRequest --admission--> Ticket (one ScaleJob per scale) --decode--> Items --plans.run--> Scored
                 --assemble--> ScoreResponse

Each stage module takes these from here, so only server/pipeline.py imports the stages.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protos import scoring_pb2
from server.dense import Passes
from server.settings import RequestLimits


@dataclass(frozen=True)
class ScaleJob:
    """One scale of a request as admitted: sizes, the canvas bucket and the cells kept."""

    scale: int
    resized: tuple[int, int]
    canvas: tuple[int, int]
    cells: tuple[int, int]
    batch_limit: int  # items of this canvas one batch may hold in memory (a batch bucket)


@dataclass(frozen=True)
class GroupKey:
    """Items that can share a batch: one canvas shape, one set of passes."""

    height: int
    width: int
    passes: Passes


@dataclass(frozen=True)
class Item:
    """One canvas to score: a scale of an image, or its mirror."""

    canvas: np.ndarray
    cells: tuple[int, int]
    lattice: str | None  # the plan output its response needs (LATTICE, LATTICE_FP16), or None
    traffic: bool  # False for the server's own warm-up, which the metrics leave out


@dataclass
class Scored:
    """What the run stage gives back for one item."""

    lattice: np.ndarray | None
    probabilities: np.ndarray
    planning_seconds: float


def top_k(request: scoring_pb2.ScoreRequest, limits: RequestLimits) -> int:
    """How many of the image's classes the response lists."""
    return request.top_k or limits.default_top_k
