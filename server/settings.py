"""Every setting of the server, each declared once: its default, its help, its group and its parser.

The five groups are frozen dataclasses: address and security (server/edges/exposure.py), the service edge
(server/edges/, server/serving.py), the request limits (server/scoring/), the batch policy (server/engine/batcher.py)
and the engine (server/engine/: plans, providers, memory). `Settings` is all five at once, so tests build one with
keywords or `dataclasses.replace`. `scoremap-serve`'s flags and `--help` (`add_flags`) and the settings table of
docs/reference.md (`markdown_table`, printed by `python -m server.settings`, placed by `python -m docs.reference`)
are made from these declarations. Light: `--help` imports only this.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from convert.arguments import PORT, format_bytes, memory_size, number_in, size_pair
from convert.cuda import Schedule
from protos import LOOPBACK, TOKEN_ENV

MiB = 2**20
DEFAULT_MAX_REQUEST_HOST_BYTES = 4 * 1024 * MiB
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000
DEFAULT_MAX_SCALES = 4
GPU_DEFAULT_MAX_BATCH = 8
COUNT = number_in(int, 1)  # how many of something: at least one
THREADS = number_in(int, 0)  # 0: let the library choose
FRACTION = number_in(float, 0.01, 1.0)
SECONDS = number_in(float, 0.001, 2_000_000)  # gRPC takes milliseconds in a C int
MILLISECONDS = number_in(float, 0)
# gRPC reads its message limits as C ints, and the receive limit is twice --max-message-bytes
# (server/serving.py, RECEIVE_LIMIT_FACTOR).
MESSAGE_BYTES = number_in(int, 1024, 2**30 - 1)


def canvas_sizes(text: str) -> tuple[tuple[int, int], ...]:
    """ "384x512,512x384" -> ((384, 512), (512, 384))."""
    try:
        sizes = tuple(tuple(int(side) for side in item.lower().split("x")) for item in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or any(len(size) != 2 or min(size) <= 0 for size in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: expected sizes HEIGHTxWIDTH separated by commas, e.g. 384x512,512x384")
    return sizes


def setting(default: Any, help: str, *, parse: Any = None, metavar: str | None = None, flag: str | None = None,
            choices: tuple[str, ...] | None = None, shown: str | None = None, many: bool = False) -> Any:
    """One setting's declaration. `flag` when it is not the field's name; `shown`: the default as people
    read it, when the value itself says nothing (None: what happens then); `many`: one flag taking several values.
    Byte counts and sizes are shown from their values (`shown_default`)."""
    return field(default=default, metadata=dict(help=help, parse=parse, metavar=metavar, flag=flag, choices=choices,
                                                shown=shown, many=many))


def shown_default(declared: dataclasses.Field) -> str | None:
    """The default as people read it: the declared text, else a byte count in MiB/GiB, a size as HxW (None: the
    value as it is)."""
    meta, default = declared.metadata, declared.default
    if meta["shown"]:
        return meta["shown"]
    if meta["parse"] in (memory_size, MESSAGE_BYTES) and isinstance(default, int):
        return format_bytes(default).replace(".0 ", " ")
    if meta["parse"] is size_pair and isinstance(default, tuple):
        return "x".join(map(str, default))
    return None


DEFAULT_PORT = 50051
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


@dataclass(frozen=True)
class Exposure:
    """Where the server listens and who may call it (server/edges/exposure.py applies the rules)."""

    host: str = setting(LOOPBACK, "address to bind; beyond loopback (e.g. 0.0.0.0) it needs TLS or a token, or "
                        "--insecure", metavar="ADDRESS")
    port: int = setting(DEFAULT_PORT, "port; 0 picks a free one and prints it", parse=PORT, metavar="PORT")
    tls_cert: str | None = setting(None, "PEM certificate chain; with --tls-key serves TLS", metavar="PATH",
                                   shown="off")
    tls_key: str | None = setting(None, "PEM private key", metavar="PATH", shown="off")
    token_file: str | None = setting(
        None, f"file holding the bearer token callers must send (or set ${TOKEN_ENV}); an empty or unreadable one "
        "refuses to start", metavar="PATH", shown="off")
    insecure: bool = setting(False, "allow a --host beyond loopback with neither TLS nor a token (your own network "
                             "only)")
    log_level: str = setting("INFO", "how much the log on stderr says", choices=LOG_LEVELS)


@dataclass(frozen=True)
class ServiceEdge:
    """The gRPC service: its threads, call limits, connections and metrics endpoint."""

    grpc_workers: int = setting(32, "threads answering calls (each waits on its batch, so more than cores)",
                                parse=number_in(int, 2), metavar="N")
    max_concurrent_rpcs: int = setting(
        64, "calls running or waiting for a worker thread (a stream counts once, health probes too); beyond "
        "it gRPC answers RESOURCE_EXHAUSTED at once rather than hold each call's message in an unbounded backlog",
        parse=COUNT, metavar="N")
    reserved_workers: int = setting(
        2, "worker threads scoring calls may never take, so health probes are answered (and excess calls "
        "refused at once, with a retry hint) while every other worker is busy",
        parse=THREADS, metavar="N")
    max_calls_per_peer: int = setting(
        16, "calls one client address may have running at once (0: no limit), beyond: RESOURCE_EXHAUSTED; "
        "below --grpc-workers less --reserved-workers, or the server refuses to start",
        parse=number_in(int, 0), metavar="N")
    refusals_per_answer: float = setting(
        6.0, "transient refusals (overloaded, retry later) answered at once per call answered over the last "
        "second, a second's worth at a time: an open loop up to 1 + N times capacity is refused at once; beyond "
        "this pace each refusal is held for its turn before it is answered, with its retry hint, so clients "
        "that resend at once cannot spend on refusals the CPU scoring needs (0 with --refusals-per-second 0: "
        "never held)", parse=number_in(float, 0), metavar="N")
    refusals_per_second: float = setting(
        100.0, "the refusal pace's floor: this many refusals a second are always answered at once, however "
        "few calls are answered (a warming or draining server)", parse=number_in(float, 0), metavar="N")
    max_refusal_hold_ms: float = setting(
        1000.0, "longest a refusal is held before it is answered, or a resend waits at the door (never past "
        "a gRPC call's deadline)",
        parse=MILLISECONDS, metavar="MS")
    max_held_refusals: int = setting(
        64, "calls held at once, refusals waiting for their turn and resends waiting at the door, each on a "
        "thread of its own beyond --grpc-workers and counted beyond --max-concurrent-rpcs (so probes and new "
        "calls still get in); beyond it a refusal is answered, or a resend goes on, at once",
        parse=number_in(int, 0), metavar="N")
    resend_memory_seconds: float = setting(
        10.0, "a request refused this recently that comes again, byte for byte, while the server is refusing, "
        "waits until a call gives back its place (at most --max-refusal-hold-ms, counted in --max-held-refusals) "
        "instead of being refused again at once: clients that resend at once wait as in a queue (0: every call "
        "goes straight on)", parse=number_in(float, 0), metavar="SECONDS")
    stream_window: int = setting(4, "requests of one ScoreStream scored at once (answers stay in order)",
                                 parse=COUNT, metavar="N")
    stream_idle_seconds: float = setting(
        60.0, "a ScoreStream with every answer sent and no request for this long ends (DEADLINE_EXCEEDED), "
        "giving its worker back", parse=SECONDS, metavar="SECONDS")
    connection_idle_seconds: float = setting(
        300.0, "a connection with no call for this long is closed (GOAWAY; clients reconnect)",
        parse=SECONDS, metavar="SECONDS")
    connection_age_seconds: float = setting(
        3600.0, "connections are closed after this long (GOAWAY), so clients spread over new replicas",
        parse=SECONDS, metavar="SECONDS")
    connection_age_grace_seconds: float = setting(
        3600.0, "calls still running when their connection reaches its age get this long: as long as the "
        "clients' own stream deadline", parse=SECONDS, metavar="SECONDS")
    keepalive_seconds: float = setting(60.0, "the server pings each connection this often, so a vanished client's "
                                       "calls end", parse=SECONDS, metavar="SECONDS")
    keepalive_timeout_seconds: float = setting(20.0, "an unanswered ping closes its connection after this long",
                                               parse=SECONDS, metavar="SECONDS")
    min_client_ping_seconds: float = setting(
        10.0, "clients pinging more often (while no data flows) are told to go away; the scoremap clients "
        "ping every 30 s, which gRPC's own default (5 min) would refuse", parse=SECONDS, metavar="SECONDS")
    grace_seconds: float = setting(10.0, "on SIGTERM, how long in-flight calls get to finish",
                                   parse=number_in(float, 0), metavar="SECONDS")
    http_port: int | None = setting(
        None, "also serve HTTP on this port of --host, with the same TLS, token and limits: KServe v2 REST, /v1 "
        "scoring for curl, the score-map viewer at / (0: a free one)", parse=PORT, metavar="PORT", shown="off")
    http_body_idle_seconds: float = setting(
        30.0, "an HTTP call whose body stops arriving for this long gets 408 and is closed, giving its call slot "
        "back", parse=SECONDS, metavar="SECONDS")
    http_max_header_bytes: int = setting(
        16 * 1024, "largest request line and headers an HTTP call may send together; beyond it the call is answered "
        "431 (400 while the head is still arriving) and closed before any route reads it", parse=number_in(int, 1024, 2**24), metavar="BYTES")
    http_max_json_depth: int = setting(
        32, "deepest nesting of arrays and objects a KServe v2 JSON request may have (the protocol's own requests "
        "need 6: an image's pixels as [H, W, C] lists); a deeper body is refused (400) before it is parsed",
        parse=number_in(int, 2, 512), metavar="N")
    http_max_form_parts: int = setting(
        8, "parts a multipart score form may have (it needs one: the file `image`); a form with more, or with a "
        "second file, is refused (400) as it is parsed", parse=number_in(int, 1, 1024), metavar="N")
    metrics_port: int | None = setting(None, "Prometheus /metrics port (0: a free one)", parse=PORT, metavar="PORT",
                                       shown="off")
    metrics_address: str = setting(LOOPBACK, "address the metrics endpoint binds (no TLS, no token: beyond "
                                   "loopback it warns)", metavar="ADDRESS")
    expose_paths: bool = setting(False, "ListModels tells callers each model's file path")
    workers: int = setting(
        1, "server processes sharing --port and --http-port (SO_REUSEPORT; the kernel spreads connections), each "
        "with its own interpreter, batcher and plans and 1/N of the memory budgets, so per-request Python work "
        "scales past one GIL; metrics: one port per process from --metrics-port on",
        parse=number_in(int, 1, 64), metavar="N")
    reuse_port: bool = setting(False, "bind --port and --http-port with SO_REUSEPORT, so other processes may serve "
                               "the same port (set by --workers for each of its processes)")
    fronts: int = setting(
        0, "front processes sharing --port and --http-port (SO_REUSEPORT), each doing a request's host work (the "
        "edges, admission, decoding, assembly) with 1/N of --host-memory-budget, beside one engine process that "
        "holds the plans, the batcher and the whole --memory-budget: request work on every core, one CUDA "
        "context. 0: one process does both", parse=number_in(int, 0, 64), metavar="N")
    front_shm_bytes: int = setting(
        256 * MiB, "shared memory each front process maps for its requests' canvases and lattices (a request whose "
        "arrays find no room there sends them through the engine's socket instead); /dev/shm must hold --fronts "
        "times this, or the server refuses to start", parse=memory_size, metavar="SIZE")
    split_role: str | None = setting(
        None, "set by --fronts for each of its processes: `engine`, or `front:N`", metavar="ROLE", shown="off")
    split_run: str | None = setting(
        None, "set by --fronts for each of its processes: the folder of the server's sockets", metavar="PATH",
        shown="off")
    supervisor: int | None = setting(
        None, "set by --workers and --fronts for each of their processes: the supervisor's process id; this process "
        "is sent SIGTERM (and drains) when that one ends, even by SIGKILL", parse=int, metavar="PID", shown="off")
    budget_share: int = setting(
        1, "this process takes 1/N of --memory-budget and --host-memory-budget (or of their defaults); set by "
        "--workers for each of its processes", parse=number_in(int, 1, 64), metavar="N")

    @property
    def scoring_workers(self) -> int:
        """Worker threads scoring calls may take; the reserved ones answer probes and refusals."""
        return self.grpc_workers - self.reserved_workers

    def check_call_limits(self) -> None:
        """ValueError when the call limits would let calls hold every worker."""
        if self.scoring_workers < 1:
            raise ValueError(f"--reserved-workers {self.reserved_workers} leaves none of the {self.grpc_workers} "
                             "--grpc-workers for scoring calls; reserve fewer, or give more workers")
        if self.max_calls_per_peer >= self.scoring_workers:
            raise ValueError(f"--max-calls-per-peer {self.max_calls_per_peer} lets one client address hold all "
                             f"{self.scoring_workers} workers that take scoring calls (--grpc-workers less "
                             f"--reserved-workers); give at most {self.scoring_workers - 1}, or 0 for no per-peer limit")


@dataclass(frozen=True)
class RequestLimits:
    """What one request, and the requests in flight together, may ask for and hold."""

    max_image_pixels: int = setting(DEFAULT_MAX_IMAGE_PIXELS, "decoded images above this many pixels are refused "
                                    "before decoding (decompression bombs)", parse=COUNT, metavar="N")
    max_message_bytes: int = setting(
        64 * MiB, "largest request or response (gRPC's 4 MB default would refuse a 12-megapixel JPEG); larger "
        "requests get RESOURCE_EXHAUSTED naming this flag", parse=MESSAGE_BYTES, metavar="BYTES")
    max_scales: int = setting(DEFAULT_MAX_SCALES, "scales one request may ask for", parse=COUNT, metavar="N")
    min_scale: int | None = setting(None, "smallest target shorter side, in pixels (one below a model's "
                                    "training size, the least it can take, is raised to it)", parse=COUNT,
                                    metavar="N", shown="the model's training size")
    max_scale: int | None = setting(
        None, "largest target shorter side, in pixels: a cap, when you want one. Without it a request may ask "
        "for any scale, up to its image's own size and beyond, that its own host memory estimate "
        "(--max-request-host-bytes) and response (--max-message-bytes) allow", parse=COUNT, metavar="N",
        shown="off")
    max_resized_pixels: int | None = setting(
        None, "resized images above this many pixels are refused (INVALID_ARGUMENT naming the largest scale "
        "within it): a cap, when you want one. Not a plan's size: an image larger than every canvas bucket is "
        "tiled onto one (--halo). Without it each request is held to its own host memory estimate, tiles "
        "included, and its response to --max-message-bytes, both refused with RESOURCE_EXHAUSTED naming what "
        "would fit", parse=COUNT, metavar="N", shown="off")
    max_request_host_bytes: int = setting(
        DEFAULT_MAX_REQUEST_HOST_BYTES, "host memory one request may hold (image, resized copies, model inputs, "
        "maps), estimated from the image header before decoding: above it RESOURCE_EXHAUSTED with every term and "
        "the largest scale, the coarser stride or the lighter maps that would fit (server/memory/host.py); this, "
        "not a size cap, decides how large a request may be", parse=memory_size, metavar="SIZE")
    host_memory_budget_bytes: int | None = setting(
        None, "host memory the requests in flight may hold together (their estimates), e.g. 8GiB; beyond it "
        "RESOURCE_EXHAUSTED with a retry hint", parse=memory_size, metavar="SIZE", flag="host-memory-budget",
        shown="--host-memory-fraction of MemAvailable, at least one largest request")
    host_memory_fraction: float = setting(0.25, "share of MemAvailable for the requests in flight when no "
                                          "--host-memory-budget is given", parse=FRACTION, metavar="FRACTION")
    default_top_k: int = setting(5, "image-level top-k when a request says 0", parse=COUNT, metavar="N")


@dataclass(frozen=True)
class BatchPolicy:
    """How items wait and are grouped into batches (Triton's dynamic batcher and queue policy)."""

    max_batch: int | None = setting(
        None, "images (a scale or its mirror, each running its passes) of one canvas run together, up to this "
        "many; 1 turns batching off (on the CPU onnxruntime already spreads one image over every core, and "
        "batching lowered throughput: bench/RESULTS.md)", parse=COUNT, metavar="N", shown=f"{GPU_DEFAULT_MAX_BATCH} on a GPU, 1 on the CPU")
    max_queue_delay_ms: float = setting(
        0.0, "how long the first image of a batch may wait for others of its canvas; at 0 batching is work-conserving: "
        "a batch starts the moment the model's runner is free, carrying whatever queued while it ran (Triton's "
        "default; a wait holds a lone image while the device idles: docs/design.md)", parse=MILLISECONDS, metavar="MS")
    queue_depth: int = setting(128, "images (a scale or its mirror) waiting or decoding per model; beyond it "
                               "RESOURCE_EXHAUSTED \"queue full\", retry with backoff", parse=COUNT, metavar="N")
    max_queue_ms: float = setting(
        1000.0, "longest a request may wait before its first image runs: one not expected to start within it "
        "(less one item's time, at most half, when items wait ahead), or to end by its deadline, is refused "
        "before decoding; one that waited longer is dropped before compute; both RESOURCE_EXHAUSTED with a "
        "retry hint", parse=number_in(float), metavar="MS")

    def max_batch_for(self, *, on_gpu: bool) -> int:
        """The batch size in force: `max_batch`, or the default for the device the model runs on."""
        if self.max_batch is not None:
            return self.max_batch
        return GPU_DEFAULT_MAX_BATCH if on_gpu else 1

    def check_queue(self) -> None:
        if self.max_queue_ms <= 0:
            raise ValueError(f"--max-queue-ms must be above 0 (received {self.max_queue_ms:g}): every pass would be "
                             "dropped; give the longest wait to allow, e.g. 1000")


@dataclass(frozen=True)
class EngineOptions:
    """Sessions, plans, the memory budget and warm-up."""

    provider: str = setting("auto", "auto: CUDA when it really loads, else the CPU", choices=("auto", "cuda", "cpu"))
    require_gpu: bool = setting(False, "refuse to start unless the CUDA provider really loads")
    cuda_sync: str = setting(
        "auto", "how the engine's thread waits for the GPU: spin (woken soonest, a core busy while the GPU works), "
        "yield (polling, the core given to other threads between looks), block (asleep until the GPU signals, the "
        "core free for decoding), auto (CUDA's choice: spin where cores outnumber contexts)",
        choices=tuple(schedule.name.lower() for schedule in Schedule))
    cudnn_conv_algo_search: str = setting("HEURISTIC", "CUDA convolution algorithm search: HEURISTIC suits "
                                          "variable shapes (EXHAUSTIVE re-tunes per shape)",
                                          choices=("HEURISTIC", "EXHAUSTIVE", "DEFAULT"))
    intra_op_threads: int = setting(0, "onnxruntime threads inside one op (0: onnxruntime chooses)", parse=THREADS,
                                    metavar="N")
    inter_op_threads: int = setting(0, "onnxruntime threads across ops (0: onnxruntime chooses)", parse=THREADS,
                                    metavar="N")
    compute_nice: int = setting(
        19, "the nice value of compute threads (image decoding; on the CPU also batcher runners and onnxruntime's "
        "pools), so the threads that read, admit, refuse and answer calls run first when both are ready; compute "
        "still takes every cycle they leave. On a host shared with other CPU-heavy work, which would then take most "
        "of the cores from compute, set it lower; 0: one priority for all. A GPU's runner is never lowered",
        parse=number_in(int, 0, 19), metavar="N")
    cpu_runners: int = setting(
        1, "CPU: batches of one model run at once, each on one onnxruntime thread (unless --intra-op-threads), so "
        "requests run side by side instead of one image spread over every core: set it to the cores for throughput "
        "under concurrent load; a lone image is slower (bench/RESULTS.md, bench_runners). The memory budget counts "
        "N running batches per model. A GPU runs one at a time",
        parse=COUNT, metavar="N")
    shape_buckets: tuple[tuple[int, int], ...] = setting(
        (), "canvas sizes images are padded to, e.g. 384x512,512x384,2048x2048; an image none holds is tiled onto "
        "one that holds --halo (the default model's exact halo needs 1184 px or more)", parse=canvas_sizes,
        metavar="HxW,...",
        shown="every warm-up scale, with and without the shifted passes' slack, at 1:1, 3:4, 4:3, 2:3, 3:2 on a GPU "
        "and on the CPU at every step of the size multiple from 1:1 to 2:1 either way (warm-up makes the first "
        "five; the others are made on first use)")
    strict_shapes: bool = setting(False, "never plan a shape outside the buckets: an image no bucket holds that "
                                  "cannot be tiled onto one either (the halo does not fit) is refused "
                                  "(INVALID_ARGUMENT, naming the buckets) instead of planned on demand")
    halo: int | None = setting(
        None, "pixels of context each side of a tile's owned cells when an image larger than every canvas bucket "
        "is tiled onto one; below the exact halo (half the model's receptive field) seams may differ from one "
        "pass (docs/large-images.md: the halo); every tiled answer states its halo and whether it is exact",
        parse=number_in(int, 0), metavar="PX", shown="exact: half the model's receptive field")
    tile_canvas: tuple[int, int] = setting(
        (2048, 2048), "when --halo fits no bucket: an image no bucket holds is planned on demand up to this many "
        "pixels, and beyond them tiled onto this canvas (made at warm-up for the model's own stride; cut along an "
        "axis the image fits, such a strip's canvas made on first use; a "
        "multiple of the model's size multiple), so no plan grows with the image", parse=size_pair, metavar="HxW")
    max_plans: int = setting(64, "plans (sessions of one shape) each model keeps; beyond it the least recently "
                             "used goes", parse=COUNT, metavar="N")
    decode_threads: int = setting(0, "threads decoding and resizing images (0: one per CPU core)", parse=THREADS,
                                  metavar="N")
    memory_budget_bytes: int | None = setting(
        None, "predicted peak memory every model's plans may hold together, e.g. 2GiB (each model's batches get "
        "an even share); what cannot fit alone gets RESOURCE_EXHAUSTED with the largest scale that would",
        parse=memory_size, metavar="SIZE", flag="memory-budget",
        shown="the GPU's free memory, else --cpu-memory-fraction of MemAvailable")
    cpu_memory_fraction: float = setting(0.5, "share of MemAvailable used as the budget on the CPU when no "
                                         "--memory-budget is given", parse=FRACTION, metavar="FRACTION")
    max_idle_arena_bytes: int = setting(
        256 * 2**20, "CPU: the most activations the plans' shared arena keeps while no request is in flight (the "
        "largest block a run took, or the blocks of runs side by side together with --cpu-runners); more goes back "
        "to the system once no run has begun for 2 s after the last request ended (the next runs take their pages "
        "again), and any after requests held much memory",
        parse=memory_size, metavar="SIZE")
    warm_up: bool = setting(True, "run every warm-up scale and stride once before reporting SERVING, and the tile "
                            "canvas of images larger than every bucket once SERVING")
    warm_up_scales: tuple[int, ...] = setting((), "scales to warm up before SERVING", parse=COUNT, metavar="SCALE",
                                              many=True, shown="each model's default scale")

    def runners_for(self, *, on_gpu: bool) -> int:
        """Batches of one model run at once: `cpu_runners` on the CPU; one on a GPU, whose plans bind their buffers."""
        return 1 if on_gpu else self.cpu_runners

    def compute_nice_for(self, *, on_gpu: bool) -> int:
        """The nice value of compute threads: none on a GPU, whose runner feeds the device."""
        return 0 if on_gpu else self.compute_nice

    def intra_op_threads_for(self, *, on_gpu: bool) -> int:
        """onnxruntime's threads per session (0: its choice): one on a GPU, where the host only launches kernels;
        on the CPU `intra_op_threads`, else one with several runners (a session's pool is shared by its concurrent
        runs, so runs of one plan could not each have a share of the cores)."""
        if on_gpu or self.cpu_runners > 1 and not self.intra_op_threads:
            return 1
        return self.intra_op_threads


@dataclass(frozen=True)
class Settings(Exposure, ServiceEdge, RequestLimits, BatchPolicy, EngineOptions):
    """All of the server's settings; each module is handed the group it reads."""

    def check(self) -> None:
        """ValueError, naming the flags, for settings that are each in range but wrong together."""
        self.check_call_limits()
        self.check_queue()
        self.check_scales()
        if self.fronts and self.workers > 1:
            raise ValueError(f"--fronts {self.fronts} and --workers {self.workers} both split the server into "
                             "processes: give one (--fronts on a GPU: one engine for every front)")

    def check_scales(self) -> None:
        """--min-scale above --max-scale, or a warm-up scale outside them, before any model loads."""
        least, most = self.min_scale or 1, self.max_scale
        if most is not None and least > most:
            raise ValueError(f"--min-scale {least} is above --max-scale {most}: no scale could be asked for; "
                             "give a --min-scale at most --max-scale")
        outside = [scale for scale in self.warm_up_scales if scale < least or most is not None and scale > most]
        if outside:
            where = (f"outside [{least}, {most}] (--min-scale, --max-scale)" if most is not None
                     else f"below --min-scale {least}")
            raise ValueError(f"--warm-up-scales {' '.join(map(str, outside))} {where}: warm up scales requests may "
                             "ask for")


GROUPS = {"address and security": Exposure, "service edge": ServiceEdge, "request limits": RequestLimits, "batch policy": BatchPolicy,
          "engine": EngineOptions}


def flag(declared: dataclasses.Field) -> str:
    """The command-line flag of a setting (a setting on by default is turned off by --no-NAME)."""
    name = declared.metadata["flag"] or declared.name.replace("_", "-")
    return f"--no-{name}" if declared.default is True else f"--{name}"


def described(declared: dataclasses.Field) -> str:
    """What a setting's flag does: a --no-NAME flag turns off what the setting's help describes."""
    if declared.default is True:
        name = declared.name.replace("_", "-")
        return f"turn {name} off (on by default: {declared.metadata['help']})"
    return declared.metadata["help"]


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, in an argument group per group; each parses and range-checks its value."""
    for title, group in GROUPS.items():
        flags = parser.add_argument_group(title)
        for declared in dataclasses.fields(group):
            meta = declared.metadata
            default = shown_default(declared)
            shown = f" (default: {default})" if default else ""
            options: dict[str, Any] = dict(dest=declared.name, help=(described(declared) + shown).replace("%", "%%"))
            if isinstance(declared.default, bool):
                options.update(action="store_false" if declared.default else "store_true")
            else:
                options.update(default=declared.default, metavar=meta["metavar"], choices=meta["choices"],
                               type=meta["parse"], nargs="*" if meta["many"] else None)
            flags.add_argument(flag(declared), **options)


def from_flags(args: argparse.Namespace) -> Settings:
    """The parsed flags as Settings (ValueError naming the flags when they do not go together)."""
    values = {name.name: getattr(args, name.name) for name in dataclasses.fields(Settings)}
    values["warm_up_scales"] = tuple(values["warm_up_scales"])
    settings = Settings(**values)
    settings.check()
    return settings


def markdown_table() -> str:
    """The settings table of docs/reference.md, group by group."""
    lines = ["| setting | default | what it does |", "| --- | --- | --- |"]
    for title, group in GROUPS.items():
        lines.append(f"| **{title}** | | |")
        for declared in dataclasses.fields(group):
            default = shown_default(declared) or (f"{declared.name.replace('_', '-')} on" if declared.default is True
                                        else "off" if declared.default is False
                                        else f"{declared.default:g}" if isinstance(declared.default, float)
                                        else str(declared.default))
            lines.append(f"| `{flag(declared)}` | {default} | {described(declared)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
