"""The one exception a scoremap client raises, whatever went wrong behind it.

gRPC's RpcError is translated here, once, at the edge (as Triton's client does), so callers
branch on `error.code` (and `error.retry_after_s`) instead of digging through channel internals.
"""

from __future__ import annotations

import grpc

from protos import RETRY_AFTER_KEY

__all__ = ["ScoremapError", "from_rpc_error", "RETRY_AFTER_KEY"]


class ScoremapError(Exception):
    """A failed scoremap call: the gRPC status code and the server's (or client's) message.

    Bad input found on the client side uses INVALID_ARGUMENT, so callers see one shape of error.
    `retry_after_s` is set when the server said the refusal is transient and when to retry.
    """

    def __init__(self, code: grpc.StatusCode, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


def _retry_after_s(error: grpc.RpcError) -> float | None:
    metadata = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in metadata or ():
        if key == RETRY_AFTER_KEY:
            try:
                return max(0.0, float(value) / 1000)
            except (TypeError, ValueError):
                return None
    return None


def from_rpc_error(error: grpc.RpcError) -> ScoremapError:
    """The ScoremapError for an RpcError raised by a stub call."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    return ScoremapError(code or grpc.StatusCode.UNKNOWN, details or "(no message from the server)",
                         retry_after_s=_retry_after_s(error))
