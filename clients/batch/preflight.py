"""Run-wide checks of a batch run, made once against the server's models before any file is scored.

A mistake that concerns the run rather than a file (two models loaded and none named, a stride
the model cannot give, scales out of range) would otherwise come back once per image: a
10,000-image folder would get 10,000 failure records. ListModels tells what each
model accepts (ModelSummary: output_strides, min_scale, max_scale, default_scale); fields a
server leaves empty (max_scale 0: no cap) are not checked here (the server still checks every request).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import grpc

from clients.api.errors import ScoremapError
from clients.api.options import ScoreOptions
from protos import scoring_pb2

__all__ = ["RunRefused", "check_run"]


class RunRefused(ScoremapError):
    """The run's settings cannot work; INVALID_ARGUMENT for a usage mistake, NOT_FOUND for an
    unknown model, FAILED_PRECONDITION for a server without models."""


def _names(models: Sequence[scoring_pb2.ModelSummary]) -> str:
    return ", ".join(m.name for m in models)


def check_run(models: Sequence[scoring_pb2.ModelSummary], options: ScoreOptions) -> ScoreOptions:
    """`options` with the model, stride and scales the server would pick made explicit (so a re-run
    that names the defaults is the same run); RunRefused if they cannot work."""
    if not models:
        raise RunRefused(grpc.StatusCode.FAILED_PRECONDITION, "the server has no models loaded")
    if not options.model:
        if len(models) > 1:
            raise RunRefused(grpc.StatusCode.INVALID_ARGUMENT,
                             f"the server has {len(models)} models loaded ({_names(models)}); "
                             "choose one with --model")
        model = models[0]
    else:
        found = [m for m in models if m.name == options.model]
        if not found:
            raise RunRefused(grpc.StatusCode.NOT_FOUND,
                             f"the server has no model named {options.model!r}; loaded: {_names(models)}; "
                             "name one of them with --model")
        model = found[0]
    strides = list(model.output_strides)
    stride = options.stride
    if strides:
        if stride and stride not in strides:
            raise RunRefused(grpc.StatusCode.INVALID_ARGUMENT,
                             f"--stride {stride}: model {model.name!r} gives strides "
                             f"{', '.join(map(str, strides))}; pick one of them (or leave --stride out "
                             f"for {strides[0]})")
        stride = stride or strides[0]
    scales = tuple(options.scales)
    # max_scale 0: no cap, the server sizes each request by its own memory and response.
    outside = [s for s in scales if s < model.min_scale or model.max_scale and s > model.max_scale]
    if outside:
        takes = f"{model.min_scale} to {model.max_scale}" if model.max_scale else f"from {model.min_scale}"
        raise RunRefused(grpc.StatusCode.INVALID_ARGUMENT,
                         f"--scales {','.join(map(str, outside))}: model {model.name!r} takes scales {takes} "
                         "(shorter side in pixels)")
    if not scales and model.default_scale:
        scales = (model.default_scale,)
    return dataclasses.replace(options, model=model.name, stride=stride, scales=scales)
