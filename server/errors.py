"""The one exception type of the server package: why a request is refused, and a message for the caller.

The core (pipeline, batcher, admission) says *why* with a `Refusal`; only the edges turn it into a
status code: gRPC's (`ScoringError.code`, used by service.py and kserve.py) and HTTP's
(server/web/edge.py `http_status`), so no core module imports grpc or knows HTTP.
"""

from __future__ import annotations

import enum

import grpc

from protos import RETRY_AFTER_KEY

__all__ = ["RETRY_AFTER_KEY", "Refusal", "ScoringError"]


class Refusal(enum.Enum):
    """Why a request did not get its answer; each is named after the gRPC status the edge answers with."""

    INVALID_ARGUMENT = enum.auto()  # the request, or its image, is wrong: fixing it is the caller's part
    NOT_FOUND = enum.auto()  # no such model
    RESOURCE_EXHAUSTED = enum.auto()  # too large for a limit, or (with a retry hint) overloaded for now
    UNAVAILABLE = enum.auto()  # shutting down or warming up
    DEADLINE_EXCEEDED = enum.auto()
    CANCELLED = enum.auto()
    FAILED_PRECONDITION = enum.auto()  # the server cannot run this (no GPU when one is required)
    INTERNAL = enum.auto()  # the model failed or gave no usable numbers


class ScoringError(Exception):
    """A request the pipeline refuses or cannot finish; the servicer turns it into `context.abort`.

    `retry_after_seconds` is set only on transient refusals (a full queue, a wait longer than the
    deadline, a server warming up): the servicer sends it as `RETRY_AFTER_KEY` trailing metadata.
    """

    def __init__(self, refusal: Refusal, message: str, *, retry_after_seconds: float | None = None) -> None:
        super().__init__(message)
        self.refusal = refusal
        self.message = message
        self.retry_after_seconds = retry_after_seconds

    def detached(self) -> ScoringError:
        """The same refusal with no traceback or cause: safe to keep or raise again, where a raised one's
        frames would keep the request's arrays alive (a reference cycle, freed only by the collector)."""
        return ScoringError(self.refusal, self.message, retry_after_seconds=self.retry_after_seconds)

    @property
    def code(self) -> grpc.StatusCode:
        """The gRPC status the edge answers with."""
        return grpc.StatusCode[self.refusal.name]

    def __str__(self) -> str:
        return f"{self.refusal.name}: {self.message}"
