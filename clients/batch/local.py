"""The in-process backend of `scoremap-score --local`: the server's own Pipeline, no gRPC.

It answers the same ScoreResponse protos as the server, so the CLI has one code path for both,
raises the same ScoremapError (translated from the server's ScoringError here, once, with its
retry hint) and retries a full queue by the same policy (clients/api/retry.py). Two of the server's
settings do not apply to a job in this process: plans are made when the job first needs them, never warmed
up front (a server warms every scale and the tile canvas so its first answers are prompt; here that held a
job most of a minute before its first photo, for plans it may never use), and compute runs at the process's
own priority (a server lowers it to keep its edges answering; here there are no edges, and a lowered job
crawls beside any other work on the machine).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Sequence

import grpc

from clients.api.errors import ScoremapError
from clients.api.retry import Backoff, Retrying, call_with_retries
from clients.api.settings import ClientSettings
from protos import model_card_pb2, scoring_pb2
from server.errors import ScoringError
from server.scoring.pipeline import Pipeline
from server.settings import Settings

__all__ = ["LocalScorer"]


class LocalScorer:
    """Scores requests with server.scoring.pipeline.Pipeline over `model_paths`, in this process, with `settings`
    (the server's defaults when None), its plans made on demand and its compute at this process's priority."""

    def __init__(self, model_paths: Sequence[str], *, settings: Settings | None = None,
                 client_settings: ClientSettings | None = None) -> None:
        self.client_settings = client_settings or ClientSettings()
        self._stop = threading.Event()
        try:
            own = dataclasses.replace(settings or Settings(), warm_up=False, compute_nice=0)
            self._pipeline = Pipeline(list(model_paths), settings=own)
        except ScoringError as error:
            raise _translated(error) from error

    def score_request(self, request: scoring_pb2.ScoreRequest, *, timeout: float | None = None) -> scoring_pb2.ScoreResponse:
        """The pipeline's answer to `request`, within `timeout` seconds as over gRPC."""
        def attempt() -> scoring_pb2.ScoreResponse:
            deadline = None if timeout is None else time.monotonic() + timeout
            try:
                return self._pipeline.score(request, deadline=deadline, cancelled=self._stop)
            except ScoringError as error:
                raise _translated(error) from error
        s = self.client_settings
        return call_with_retries(attempt, Retrying(
            budget_s=s.retry_budget_s, stop=self._stop,
            backoff=Backoff(s.backoff_initial_s, s.backoff_max_s, s.backoff_multiplier)))

    def models(self) -> list[scoring_pb2.ModelSummary]:
        """The models loaded, as the server's ListModels tells them."""
        return self._pipeline.models()

    def model(self, name: str = "") -> model_card_pb2.ModelCard:
        """A loaded model's card, as the server's GetModel tells it."""
        try:
            return self._pipeline.card(name)
        except ScoringError as error:
            raise _translated(error) from error

    def interrupt(self) -> None:
        """Stop scoring now: pauses end and running requests are abandoned (Interrupted)."""
        self._stop.set()

    def close(self) -> None:
        self.interrupt()
        self._pipeline.close()

    def __enter__(self) -> LocalScorer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _translated(error: ScoringError) -> ScoremapError:
    """The error a gRPC client would get: each Refusal is named after its gRPC status."""
    return ScoremapError(grpc.StatusCode[error.refusal.name], error.message, retry_after_s=error.retry_after_seconds)
