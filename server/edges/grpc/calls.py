"""A gRPC call as the edges' plain `Call` (server/edges/calls.py), and how a refusal is answered on it."""

from __future__ import annotations

import threading
import time

import grpc

from server.edges.calls import Call
from server.errors import RETRY_AFTER_KEY, Retry, ScoringError
from server.metrics import NO_MODEL

__all__ = ["call_of", "deadline_of", "ended", "refuse", "status_code"]

# A client's own deadline timer may cancel the call a moment before the server's fires.
DEADLINE_SLACK_SECONDS = 0.05


def call_of(context: grpc.ServicerContext, method: str, model: str = NO_MODEL,
            cancelled: threading.Event | None = None) -> Call:
    """The call as plain values: its deadline, and a flag (`cancelled`, or a new one) set when it ends."""
    call = Call(method, model=model, deadline=deadline_of(context))
    if cancelled is not None:
        call.cancelled = cancelled
    context.add_callback(call.cancelled.set)
    return call


def deadline_of(context: grpc.ServicerContext) -> float | None:
    """The call's deadline as a time.monotonic() instant (None: it has none)."""
    remaining = context.time_remaining()
    return time.monotonic() + remaining if remaining is not None else None


def refuse(context: grpc.ServicerContext, error: ScoringError) -> None:
    """Abort the call with the error's status; a transient refusal also says when to retry."""
    if error.retry is Retry.LATER:
        context.set_trailing_metadata(((RETRY_AFTER_KEY, str(round(1000 * error.retry_after_seconds))),))
    context.abort(status_code(error), error.message)


def status_code(error: ScoringError) -> grpc.StatusCode:
    """The gRPC status a refusal is answered with: each Refusal is named after one."""
    return grpc.StatusCode[error.refusal.name]


def ended(context: grpc.ServicerContext) -> str:
    """How a call that ended before its answer was sent ended, as the metrics name it: at its deadline, or
    cancelled."""
    remaining = context.time_remaining()
    expired = remaining is not None and remaining <= DEADLINE_SLACK_SECONDS
    return (grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED).name
