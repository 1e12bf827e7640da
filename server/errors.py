"""The one exception type of the server package: a gRPC status code and a message for the caller."""

from __future__ import annotations

import grpc


class ScoringError(Exception):
    """A request the pipeline refuses or cannot finish; the servicer turns it into `context.abort`."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"
