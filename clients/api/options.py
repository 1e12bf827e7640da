"""Scoring options (scales, stride, shift, ...) and the ScoreRequest built from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import grpc

from clients.api.errors import ScoremapError
from clients.api.images import ImageLike, image_fields
from protos import scoring_pb2

__all__ = ["ScoreOptions", "build_request", "SHIFTS", "MAP_DTYPES"]

SHIFTS = {"auto": scoring_pb2.SHIFT_UNSPECIFIED, "none": scoring_pb2.SHIFT_NONE,
          "grid": scoring_pb2.SHIFT_GRID, "diagonal": scoring_pb2.SHIFT_DIAGONAL,
          "atrous": scoring_pb2.SHIFT_ATROUS}
MAP_DTYPES = {"float32": scoring_pb2.FLOAT32, "float16": scoring_pb2.FLOAT16}


@dataclass(frozen=True)
class ScoreOptions:
    """What to compute for an image; zero/empty values mean "the model card's default"."""

    model: str = ""
    scales: Sequence[int] = ()
    stride: int = 0
    shift: str = "auto"
    flip: bool = False
    return_maps: bool = False
    map_dtype: str = "float32"
    classes: Sequence[int] = ()
    cell_top_k: int = 0
    top_k: int = 5

    def __post_init__(self) -> None:
        if self.shift not in SHIFTS:
            raise ScoremapError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"shift {self.shift!r} is not one of {sorted(SHIFTS)}")
        if self.map_dtype not in MAP_DTYPES:
            raise ScoremapError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"map dtype {self.map_dtype!r} is not one of {sorted(MAP_DTYPES)}")
        for name, values in (("scales", self.scales), ("classes", self.classes)):
            if any(int(v) < (1 if name == "scales" else 0) for v in values):
                raise ScoremapError(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"{name} {list(values)} must all be {'positive' if name == 'scales' else '>= 0'}")
        if self.stride < 0 or self.top_k < 0 or self.cell_top_k < 0:
            raise ScoremapError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"stride {self.stride}, top_k {self.top_k}, cell_top_k {self.cell_top_k} "
                                "must be >= 0")


def build_request(image: ImageLike, options: ScoreOptions, *, request_id: str = "") -> scoring_pb2.ScoreRequest:
    """The ScoreRequest for `image` under `options` (the image validated first)."""
    return scoring_pb2.ScoreRequest(
        model=options.model,
        scales=[int(s) for s in options.scales],
        output_stride=options.stride,
        shift=SHIFTS[options.shift],
        flip=options.flip,
        return_maps=options.return_maps,
        map_dtype=MAP_DTYPES[options.map_dtype],
        classes=[int(c) for c in options.classes],
        cell_top_k=options.cell_top_k,
        top_k=options.top_k,
        request_id=request_id,
        **image_fields(image),
    )


def as_new_work(request: scoring_pb2.ScoreRequest, number: int) -> scoring_pb2.ScoreRequest:
    """`request` sent as new work, the `number`th: a request_id of its own (its own, then `#number`).

    A server recognises a request sent again byte for byte as a resend, and may hold it until there is
    room (scoremap-serve --resend-memory-seconds); a load generator's arrivals are new work each.
    """
    arrival = scoring_pb2.ScoreRequest()
    arrival.CopyFrom(request)
    arrival.request_id = f"{request.request_id}#{number}"
    return arrival
