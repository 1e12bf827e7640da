"""Every limit the clients apply, named and documented in one place."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from protos import TOKEN_ENV

__all__ = ["ClientSettings", "TOKEN_ENV", "BATCH_RETRY_BUDGET_S", "MIN_TIMEOUT_S", "env_token"]


def env_token(environ: Mapping[str, str] = os.environ) -> str | None:
    """The command lines' bearer token: `$TOKEN_ENV` stripped, as the server strips its own; None if unset or blank."""
    return environ.get(TOKEN_ENV, "").strip() or None

# How long (seconds) scoremap-score keeps retrying an unreachable server by default (--retry-for):
# long enough to ride out a server restart during an overnight run.
BATCH_RETRY_BUDGET_S = 120.0
# The shortest deadline (seconds) a command line may ask for (--timeout): 0 or less fails every call at once.
MIN_TIMEOUT_S = 0.001


@dataclass(frozen=True)
class ClientSettings:
    """Channel, deadline and retry settings of a ScoremapClient.

    The defaults suit a scorer on the same host or LAN; a batch run over a flaky link raises
    `retry_budget_s` so a server restart is ridden out instead of failing files.
    """

    # Deadline of one unary call (seconds). Dense maps of large images take a while on a CPU.
    timeout_s: float = 60.0
    # Deadline of a whole ScoreStream call (seconds): every call has one, streams included.
    stream_timeout_s: float = 3600.0
    # Largest message either way (bytes): full [K, h, w] float32 maps of a large photo reach tens of MB.
    max_message_bytes: int = 256 * 1024 * 1024
    # HTTP/2 keep-alive pings (ms) so a dead peer is noticed during long idle batch gaps.
    keepalive_time_ms: int = 30_000
    keepalive_timeout_ms: int = 10_000
    # How fast the channel reconnects after the server went away (ms); gRPC's own default waits
    # up to 120 s, which would turn a two-second restart into a two-minute stall.
    initial_reconnect_backoff_ms: int = 100
    max_reconnect_backoff_ms: int = 2_000
    # Retries (clients/api/retry.py: UNAVAILABLE, a server dropping calls as it stops, refusals the
    # server marks transient) are bounded by time alone: `retry_budget_s` seconds per call. No attempt
    # starts after it; the one running then keeps its own deadline (`timeout_s`), so a call lasts at
    # most about `retry_budget_s + timeout_s`.
    retry_budget_s: float = 30.0
    # A server never reached at all is more likely a wrong address than a restart: give up on it
    # after this many seconds, whatever the budget.
    connect_budget_s: float = 5.0
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 2.0
    backoff_multiplier: float = 2.0
    # How often (seconds) a client waiting for its server says so.
    wait_notice_every_s: float = 10.0
