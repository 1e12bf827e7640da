"""The in-process backend of `scoremap-score --local`: the server's own Pipeline, no gRPC.

It answers the same ScoreResponse protos as the server, so the CLI has one code path for both,
and raises the same ScoremapError (translated from the server's ScoringError here, once).
"""

from __future__ import annotations

import time
from typing import Sequence

from clients.errors import ScoremapError
from protos import scoring_pb2
from server.errors import ScoringError
from server.pipeline import Pipeline
from server.settings import Settings

__all__ = ["LocalScorer"]


class LocalScorer:
    """Scores requests with server.pipeline.Pipeline over `model_paths`, in this process."""

    def __init__(self, model_paths: Sequence[str], *, settings: Settings | None = None) -> None:
        try:
            self._pipeline = Pipeline(list(model_paths), settings=settings)
        except ScoringError as error:
            raise ScoremapError(error.code, error.message) from error

    def score_request(self, request: scoring_pb2.ScoreRequest, *, timeout: float | None = None) -> scoring_pb2.ScoreResponse:
        """The pipeline's answer to `request`, within `timeout` seconds as over gRPC."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            return self._pipeline.score(request, deadline=deadline)
        except ScoringError as error:
            raise ScoremapError(error.code, error.message) from error

    def close(self) -> None:
        self._pipeline.close()

    def __enter__(self) -> LocalScorer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
