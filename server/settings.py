"""Every limit and knob of the server, named and documented in one frozen dataclass.

`scoremap-serve` exposes each field as a flag; tests build a `Settings` with `dataclasses.replace`.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 2**20
GPU_DEFAULT_MAX_BATCH = 8


@dataclass(frozen=True)
class Settings:
    # --- requests -------------------------------------------------------------------------
    max_image_pixels: int = 50_000_000
    """Decoded images above this many pixels are refused (decompression bombs)."""
    max_message_bytes: int = 64 * MiB
    """gRPC send/receive limit; well above gRPC's 4 MB default so a 12-megapixel JPEG fits."""
    max_scales: int = 4
    """Scales one request may ask for (with the two limits around it, the worst single request
    fits `max_request_host_bytes`: server/host_memory.py `worst_request`)."""
    min_scale: int | None = None
    """Smallest target shorter side, in pixels; None: each model's training size, the least it can take
    (a smaller setting is raised to it)."""
    max_scale: int = 2048
    """Largest target shorter side, in pixels."""
    max_resized_pixels: int = 2048 * 2048
    """Resized images above this many pixels are refused (a huge scale on a panorama)."""
    max_request_host_bytes: int = 4 * 1024 * MiB
    """Host memory one request may hold (decoded image, resized copies, model inputs, maps), estimated
    from the image header before decoding; above it RESOURCE_EXHAUSTED with every term."""
    host_memory_budget_bytes: int | None = None
    """Host memory the requests in flight may hold together (their estimates); beyond it a request is
    refused with RESOURCE_EXHAUSTED and a retry hint. None: `host_memory_fraction` of MemAvailable at
    start, at least `max_request_host_bytes`."""
    host_memory_fraction: float = 0.25
    """Share of MemAvailable for requests in flight when no host budget is given (the CPU's plans
    take `cpu_memory_fraction` of it)."""
    default_top_k: int = 5
    """Image-level top-k when a request says 0."""

    # --- batching -------------------------------------------------------------------------
    max_batch: int | None = None
    """Images (a scale or its mirror, each running its passes) of one canvas run together, up to this
    many (1 turns batching off); None: 8 on a GPU, 1 on the CPU, where onnxruntime already spreads
    one image over every core and batching lowered throughput (bench/RESULTS.md, bench_server)."""
    max_queue_delay_ms: float = 5.0
    """How long the first image of a batch waits for others of its canvas."""
    queue_depth: int = 128
    """Images waiting per model; beyond it new requests get RESOURCE_EXHAUSTED."""
    max_queue_ms: float = 1000.0
    """Longest a request may wait before its first image (a scale or its mirror) runs, as Triton's queue
    policy: a request not expected to start within it, less a margin of one item's time (at most half
    the limit) when items wait ahead, is refused before its image is decoded, and one that waited
    longer is dropped; both RESOURCE_EXHAUSTED with a retry hint."""
    stream_window: int = 4
    """Requests of one ScoreStream scored concurrently (answers stay in order)."""

    def batch_limit(self, *, on_gpu: bool) -> int:
        """The batch size in force: `max_batch`, or the default for the device the model runs on."""
        if self.max_batch is not None:
            return self.max_batch
        return GPU_DEFAULT_MAX_BATCH if on_gpu else 1

    # --- plans (shape-stable execution) ------------------------------------------------------
    shape_buckets: tuple[tuple[int, int], ...] = ()
    """Canvas sizes (height, width) images are padded to; empty: every warm-up scale x common aspect
    ratio, with and without the shifted passes' slack (server/buckets.py)."""
    strict_shapes: bool = False
    """Refuse (INVALID_ARGUMENT, naming the buckets) an image no bucket holds, instead of planning
    its shape on demand."""
    max_plans: int = 64
    """Plans (sessions of one shape) each model keeps; beyond it the least recently used goes."""
    decode_threads: int = 0
    """Threads decoding and resizing images; 0: one per CPU core."""

    # --- memory ---------------------------------------------------------------------------
    memory_budget_bytes: int | None = None
    """Predicted peak memory allowed for the batches running at once (split evenly between the
    loaded models, whose batches run concurrently); None: the GPU's free memory, or on the CPU
    `cpu_memory_fraction` of the machine's available memory."""
    cpu_memory_fraction: float = 0.5
    """Share of MemAvailable used as the budget on the CPU when no budget is given."""

    # --- engine ---------------------------------------------------------------------------
    provider: str = "auto"
    """"auto" (CUDA when it loads, else CPU), "cuda" or "cpu"."""
    require_gpu: bool = False
    """Refuse to start unless the CUDA provider really loads."""
    cudnn_conv_algo_search: str = "HEURISTIC"
    """CUDA conv algorithm search: HEURISTIC suits variable shapes (EXHAUSTIVE re-tunes per shape)."""
    intra_op_threads: int = 0
    """onnxruntime threads inside one op; 0 lets onnxruntime choose."""
    inter_op_threads: int = 0
    """onnxruntime threads across ops; 0 lets onnxruntime choose."""
    warm_up: bool = True
    """Run every warm-up scale and stride once before reporting SERVING."""
    warm_up_scales: tuple[int, ...] = ()
    """Scales to warm up; empty: each model's default scale."""

    # --- service --------------------------------------------------------------------------
    grpc_workers: int = 32
    """Threads answering RPCs (each waits on its batch, so more than cores)."""
    max_concurrent_rpcs: int = 64
    """Calls running or waiting for one of those threads (a stream counts once, health probes too);
    beyond it gRPC answers RESOURCE_EXHAUSTED at once instead of holding calls, each with its request
    of up to `max_message_bytes`, in an unbounded backlog. Twice `grpc_workers`: a short backlog
    absorbs bursts while the threads feed the model queues (`queue_depth`)."""
    reserved_workers: int = 2
    """Worker threads scoring calls may never take, so health probes are answered (and excess calls
    refused at once) while every other worker is busy: at most `grpc_workers - reserved_workers`
    calls run at once, beyond that RESOURCE_EXHAUSTED with a retry hint (issue 10, item 4)."""
    max_calls_per_peer: int = 16
    """Calls one client address may have running at once (0: no limit), so one peer cannot hold
    every worker; beyond it RESOURCE_EXHAUSTED with a retry hint. Below `scoring_workers`, or the
    server refuses to start."""

    @property
    def scoring_workers(self) -> int:
        """Worker threads scoring calls may take; the reserved ones answer probes and refusals."""
        return self.grpc_workers - self.reserved_workers

    def check_call_limits(self) -> None:
        """ValueError when the call limits would let calls hold every worker (issue 10, item 4)."""
        if self.scoring_workers < 1:
            raise ValueError(f"--reserved-workers {self.reserved_workers} leaves none of the {self.grpc_workers} "
                             "--grpc-workers for scoring calls; reserve fewer, or give more workers")
        if self.max_calls_per_peer >= self.scoring_workers:
            raise ValueError(f"--max-calls-per-peer {self.max_calls_per_peer} lets one client address hold all "
                             f"{self.scoring_workers} workers that take scoring calls (--grpc-workers less "
                             f"--reserved-workers); give at most {self.scoring_workers - 1}, or 0 for no per-peer limit")
    stream_idle_seconds: float = 60.0
    """A ScoreStream with every answer sent and no new request for this long is ended
    (DEADLINE_EXCEEDED), so idle streams give their worker back."""
    connection_idle_seconds: float = 300.0
    """A connection with no call for this long is closed (GOAWAY; clients reconnect on their next call)."""
    connection_age_seconds: float = 3600.0
    """Connections are closed after this long (GOAWAY), so clients spread over new replicas."""
    connection_age_grace_seconds: float = 3600.0
    """Calls still running when their connection reaches its age get this long to finish: as long
    as the clients' own stream deadline (clients.ClientSettings.stream_timeout_s)."""
    keepalive_seconds: float = 60.0
    """The server pings each connection this often, so a vanished client's calls end."""
    keepalive_timeout_seconds: float = 20.0
    """An unanswered ping closes the connection after this long."""
    min_client_ping_seconds: float = 10.0
    """Clients pinging more often than this (while no data flows) are told to go away; the
    scoremap clients ping every 30 s, gRPC's own default (5 min) would refuse them."""
    grace_seconds: float = 10.0
    """On SIGTERM, in-flight calls get this long to finish."""
    http_port: int | None = None
    """HTTP port beside gRPC (0: pick a free one): KServe v2 REST, /v1 scoring and the score-map viewer,
    on the same host with the same TLS, token and limits (server/web); None: no HTTP."""
    http_body_idle_seconds: float = 30.0
    """An HTTP call whose body stops arriving for this long is answered 408 and closed, so slow senders
    give their call slot back (as idle gRPC connections and streams are ended)."""
    metrics_port: int | None = None
    """Prometheus port (0: pick a free one); None: no metrics endpoint."""
    metrics_address: str = "127.0.0.1"
    """Address the metrics endpoint binds."""
    expose_paths: bool = False
    """ListModels tells callers each model's file path (off: paths are the server's business)."""
