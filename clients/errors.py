"""The one exception a scoremap client raises, whatever went wrong behind it.

gRPC's RpcError is translated here, once, at the edge (as Triton's client does), so callers
branch on `error.code` instead of digging through channel internals.
"""

from __future__ import annotations

import grpc

__all__ = ["ScoremapError", "from_rpc_error"]


class ScoremapError(Exception):
    """A failed scoremap call: the gRPC status code and the server's (or client's) message.

    Bad input found on the client side uses INVALID_ARGUMENT, so callers see one shape of error.
    """

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


def from_rpc_error(error: grpc.RpcError) -> ScoremapError:
    """The ScoremapError for an RpcError raised by a stub call."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    return ScoremapError(code or grpc.StatusCode.UNKNOWN, details or "(no message from the server)")
