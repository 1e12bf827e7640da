"""ScoreResponse protos → plain Python results with numpy maps.

Both backends (the gRPC server and the in-process pipeline) answer with ScoreResponse protos,
so this is the one place responses become results.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import grpc
import numpy as np

from clients.api.errors import ScoremapError
from protos import scoring_pb2

__all__ = ["Prediction", "Geometry", "ScaleResult", "ScoreResult", "Tiling", "decode_tensor", "check_finite",
           "result_from_response"]

_DTYPES = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "int32": np.dtype("<i4")}


class Prediction(NamedTuple):
    """One image-level class: its label, its index, its probability."""

    label: str
    index: int
    probability: float


@dataclass(frozen=True)
class Geometry:
    """Where map cell (i, j) lies in original-image pixels (protos/scoring.proto MapGeometry)."""

    stride_y: float
    stride_x: float
    center_y: float
    center_x: float
    box_height: float
    box_width: float
    scale_factor: float
    resized_height: int
    resized_width: int
    # Cells of the last rows / columns whose receptive field reaches into the server's padding.
    padded_border_rows: int = 0
    padded_border_cols: int = 0

    def cell_center(self, i: int, j: int) -> tuple[float, float]:
        """(y, x) of cell (i, j)'s centre in the original image."""
        return self.center_y + i * self.stride_y, self.center_x + j * self.stride_x

    def cell_box(self, i: int, j: int) -> tuple[float, float, float, float]:
        """(top, left, bottom, right) of cell (i, j)'s receptive field, unclipped."""
        y, x = self.cell_center(i, j)
        return y - self.box_height / 2, x - self.box_width / 2, y + self.box_height / 2, x + self.box_width / 2

    def to_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass(frozen=True)
class Tiling:
    """How the server tiled a scale no canvas bucket held (protos/scoring.proto Tiling): `exact` when the halo
    holds the receptive field, so the map equals one pass over the whole image."""

    tiles: int
    halo_px: int
    exact: bool
    canvas_height: int
    canvas_width: int

    def to_dict(self) -> dict[str, int | bool]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass(frozen=True)
class ScaleResult:
    """One scale's map: `scores` [K, h, w] (K = len(classes)), empty when maps were not asked for."""

    scale: int
    height: int
    width: int
    geometry: Geometry
    classes: tuple[int, ...]
    scores: np.ndarray | None
    cell_top_k_indices: np.ndarray | None = None
    cell_top_k_scores: np.ndarray | None = None
    tiling: Tiling | None = None  # None: one pass over the whole image

    def class_map(self, index: int) -> np.ndarray:
        """The [h, w] map of class `index` (a class index, not a channel position)."""
        if self.scores is None:
            raise KeyError("this result carries no maps; score with return_maps=True")
        channel = self.classes.index(index) if self.classes else index
        return self.scores[channel]


@dataclass(frozen=True)
class ScoreResult:
    """What a score call returns: the image-level top-k, best first, and one map per scale."""

    model: str
    image_height: int
    image_width: int
    top_k: list[Prediction]
    maps: list[ScaleResult]
    timings: dict[str, float] = field(default_factory=dict)
    execution_provider: str = ""
    output_stride: int = 0
    shift: str = ""
    request_id: str = ""
    warnings: tuple[str, ...] = ()

    def to_record(self) -> dict[str, Any]:
        """A JSON-ready summary (no map values): what results.jsonl stores per image."""
        return {
            "model": self.model,
            "image_size": [self.image_height, self.image_width],
            "scales": [m.scale for m in self.maps],
            "top_k": [p._asdict() for p in self.top_k],
            "maps": [
                # Cells only: the class count is known only when maps were sent (--maps), and a
                # record should not change shape with the options it was scored under. A tiled map
                # says so (its halo, whether it is exact), as every output of a tiled map does.
                {"scale": m.scale, "cells": [m.height, m.width], "geometry": m.geometry.to_dict()}
                | ({"tiling": m.tiling.to_dict()} if m.tiling is not None else {})
                for m in self.maps
            ],
            "output_stride": self.output_stride,
            "shift": self.shift,
            "execution_provider": self.execution_provider,
            "timings_ms": self.timings,
            "warnings": list(self.warnings),
        }

    def map_arrays(self) -> dict[str, np.ndarray]:
        """Arrays for an .npz file: per scale `scores_<scale>` and `classes_<scale>`."""
        arrays: dict[str, np.ndarray] = {}
        for m in self.maps:
            if m.scores is not None:
                arrays[f"scores_{m.scale}"] = m.scores
                arrays[f"classes_{m.scale}"] = np.asarray(m.classes or range(m.scores.shape[0]), np.int32)
        return arrays


def decode_tensor(tensor: scoring_pb2.Tensor) -> np.ndarray | None:
    """A Tensor message as a numpy array (None when the field is empty)."""
    if not tensor.dtype and not tensor.shape:
        return None
    if tensor.dtype not in _DTYPES:
        raise ValueError(f"tensor dtype {tensor.dtype!r} is not one of {sorted(_DTYPES)}")
    dtype = _DTYPES[tensor.dtype]
    shape = tuple(tensor.shape)
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(tensor.data) != expected:
        raise ValueError(f"tensor of shape {shape} {tensor.dtype} has {len(tensor.data)} bytes; expected {expected}")
    return np.frombuffer(tensor.data, dtype).reshape(shape).astype(dtype.newbyteorder("="))


def _geometry(g: scoring_pb2.MapGeometry) -> Geometry:
    return Geometry(
        stride_y=g.stride_y, stride_x=g.stride_x, center_y=g.center_y, center_x=g.center_x,
        box_height=g.box_height, box_width=g.box_width, scale_factor=g.scale_factor,
        resized_height=g.resized_height, resized_width=g.resized_width,
        padded_border_rows=g.padded_border_rows, padded_border_cols=g.padded_border_cols,
    )


def _untrustworthy(message: str) -> ScoremapError:
    return ScoremapError(grpc.StatusCode.INTERNAL,
                         f"the response carries {message}; it is not used (every answer must be finite). "
                         "Report the image and options to the server's maintainers, and score it again with "
                         "--retry-failed once the server is fixed")


def check_finite(response: scoring_pb2.ScoreResponse, maps: list[ScaleResult]) -> None:
    """Refuse a response with non-finite values: top-k probabilities and map scores must be finite,
    except the NaN a diagonal shift leaves where no pass scored a cell."""
    for label in response.top_k:
        if not math.isfinite(label.probability):
            raise _untrustworthy(f"probability {label.probability} for class {label.index} ({label.label!r})")
    holes_allowed = response.shift == scoring_pb2.SHIFT_DIAGONAL
    for m in maps:
        for name, values in (("scores", m.scores), ("cell top-k scores", m.cell_top_k_scores)):
            if values is None or values.dtype.kind != "f":
                continue
            bad = np.isinf(values) if holes_allowed else ~np.isfinite(values)
            if bad.any():
                raise _untrustworthy(f"{int(bad.sum())} non-finite {name} in the map at scale {m.scale}")


def result_from_response(response: scoring_pb2.ScoreResponse) -> ScoreResult:
    """The ScoreResult of a ScoreResponse; ScoremapError (INTERNAL) if it carries non-finite values."""
    maps = [
        ScaleResult(
            scale=m.scale, height=m.height, width=m.width, geometry=_geometry(m.geometry),
            classes=tuple(m.classes), scores=decode_tensor(m.scores),
            cell_top_k_indices=decode_tensor(m.cell_top_k_indices),
            cell_top_k_scores=decode_tensor(m.cell_top_k_scores),
            tiling=Tiling(m.tiling.tiles, m.tiling.halo_px, m.tiling.exact, m.tiling.canvas_height,
                          m.tiling.canvas_width) if m.HasField("tiling") else None,
        )
        for m in response.maps
    ]
    check_finite(response, maps)
    t = response.timings
    return ScoreResult(
        model=response.model,
        image_height=response.image_height,
        image_width=response.image_width,
        top_k=[Prediction(label.label, label.index, label.probability) for label in response.top_k],
        maps=maps,
        timings={"queue": t.queue_ms, "preprocess": t.preprocess_ms, "inference": t.inference_ms,
                 "postprocess": t.postprocess_ms, "total": t.total_ms},
        execution_provider=response.execution_provider,
        output_stride=response.output_stride,
        shift=scoring_pb2.Shift.Name(response.shift),
        request_id=response.request_id,
        warnings=tuple(response.warnings),
    )
