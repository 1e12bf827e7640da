"""One gRPC call as plain values, and how a refusal is answered on it."""

from __future__ import annotations

import threading
import time

import grpc

from server.errors import RETRY_AFTER_KEY, Retry, ScoringError
from server.metrics import NO_MODEL

__all__ = ["Call", "deadline_of", "ended", "refuse"]

# A client's own deadline timer may cancel the call a moment before the server's fires.
DEADLINE_SLACK_SECONDS = 0.05


class Call:
    """One RPC as plain values: its deadline (time.monotonic), a flag set when it ends or is cancelled,
    and the loaded model it concerns once known (a stream: its first request's), for the metrics."""

    def __init__(self, context: grpc.ServicerContext, cancelled: threading.Event | None = None) -> None:
        self.model = NO_MODEL
        self.cancelled = threading.Event() if cancelled is None else cancelled
        context.add_callback(self.cancelled.set)
        self.deadline = deadline_of(context)


def deadline_of(context: grpc.ServicerContext) -> float | None:
    """The call's deadline as a time.monotonic() instant (None: it has none)."""
    remaining = context.time_remaining()
    return time.monotonic() + remaining if remaining is not None else None


def refuse(context: grpc.ServicerContext, error: ScoringError) -> None:
    """Abort the call with the error's status; a transient refusal also says when to retry."""
    if error.retry is Retry.LATER:
        context.set_trailing_metadata(((RETRY_AFTER_KEY, str(round(1000 * error.retry_after_seconds))),))
    context.abort(error.code, error.message)


def ended(context: grpc.ServicerContext) -> grpc.StatusCode:
    """How a call that ended before its answer was sent ended: at its deadline, or cancelled."""
    remaining = context.time_remaining()
    expired = remaining is not None and remaining <= DEADLINE_SLACK_SECONDS
    return grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
