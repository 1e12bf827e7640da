"""The one exception type of the server package: a gRPC status code and a message for the caller."""

from __future__ import annotations

import grpc

from protos import RETRY_AFTER_KEY

__all__ = ["RETRY_AFTER_KEY", "ScoringError"]


class ScoringError(Exception):
    """A request the pipeline refuses or cannot finish; the servicer turns it into `context.abort`.

    `retry_after_seconds` is set only on transient refusals (a full queue, a wait longer than the
    deadline): the servicer sends it as `RETRY_AFTER_KEY` trailing metadata.
    """

    def __init__(self, code: grpc.StatusCode, message: str, *, retry_after_seconds: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_seconds = retry_after_seconds

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"
