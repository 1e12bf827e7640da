"""Every bound of a load test, named and documented in one place (the command line's ranges come from here)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LoadLimits", "MIN_RATE", "MIN_STABLE_PERCENT"]

# The slowest open-loop rate (--rate, per second): one arrival per 100 s, some within a 600 s level.
MIN_RATE = 0.01
# The tightest --stable-within (percent): below it, window rates of a real server never agree.
MIN_STABLE_PERCENT = 0.1


@dataclass(frozen=True)
class LoadLimits:
    """Hard bounds of a load test, whatever the command line asks, and how the load tester judges itself."""

    # Longest a level may run (seconds).
    max_duration_s: float = 600.0
    # Most requests one level may send.
    max_requests: int = 100_000
    # Most concurrent callers (closed loop) or requests in flight (open loop), over every process.
    max_in_flight: int = 256
    # Most arrivals per second (open loop), over every process.
    max_rate: float = 20_000.0
    # Most input images held in memory.
    max_inputs: int = 64
    # After a level's sending stops, how long (seconds) its last answers are awaited beyond the deadline.
    drain_grace_s: float = 5.0
    # Most measurement windows of one level with --until-stable (and max_duration_s in all).
    max_windows: int = 20
    # How often (seconds) a level's live line is redrawn on a terminal.
    live_every_s: float = 1.0
    # How long (seconds) reading the server's /metrics may take.
    metrics_timeout_s: float = 5.0
    # Most sending processes (--processes); the cores the load tester may use bound them too.
    max_processes: int = 64
    # Most connections (channels with a subchannel of their own) per sending process (--connections).
    max_connections: int = 64
    # How often (seconds) each sending process hands its new sends and answers to the process that merges them;
    # during a level's warm-up more often, so that the window opens (and its edge is read) on time.
    stream_every_s: float = 0.25
    warm_up_every_s: float = 0.002
    # The sending processes' gRPC experiments (GRPC_EXPERIMENTS; where the environment already sets it, that
    # is kept): gRPC's own client I/O path, whose socket reads and writes run on the thread that polls the
    # calls' completions, takes about half the context switches per call and less CPU per request than the
    # EventEngine client with its thread pool (bench_loadtest, docs/design.md). Empty: gRPC's defaults.
    grpc_experiments: str = "-event_engine_client"
    # How long (seconds) a sending process may take to start (import gRPC, open its channels).
    process_start_s: float = 60.0
    # How far ahead (seconds) of a level's start its processes are told, so that they all start at one instant.
    start_lead_s: float = 0.05
    # Above this share of its capacity (one core per sending process, no more than its cores) the load tester
    # says its figures may be its own limit, not the server's: perf_analyzer's warning at 80%.
    client_busy_warning: float = 0.8
    # --processes auto: more processes are started while one calibration window at the heaviest level finds
    # the load tester busier than this share of its capacity (below the warning, with room to spare).
    auto_busy: float = 0.6
    # --processes auto: length (seconds) of each calibration window, after its own warm-up.
    calibration_s: float = 1.0
