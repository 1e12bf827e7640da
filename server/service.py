"""The gRPC edge: `create_server`, a thin servicer over the Pipeline, the token check and the call limits.

Each method turns the call's deadline and cancellation into plain values, calls the pipeline and
maps its ScoringError to a status with `context.abort` (gRPC's route_guide / errors examples); a
transient refusal also carries a retry hint in trailing metadata (`RETRY_AFTER_KEY`), and is answered
at the server's refusal pace (`CallLimits.hold`, server.admission.RefusalPacer).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hmac
import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos import model_card_pb2, scoring_pb2, scoring_pb2_grpc, version
from server.admission import RefusalPacer
from server.call_slots import CallSlots
from server.errors import RETRY_AFTER_KEY, Refusal, ScoringError, Transient, retry_after
from server.exposure import token_problem
from server.metrics import NO_MODEL, Metrics
from server.pipeline import Pipeline
from server.settings import Settings

if TYPE_CHECKING:
    from server.web import HttpServer

LOG = logging.getLogger(__name__)
SERVICE_NAME = scoring_pb2.DESCRIPTOR.services_by_name["DenseScoring"].full_name
HEALTH_PREFIX = "/grpc.health.v1.Health/"  # probes need no token
# Probes answered however busy the server is (exempt from the call limits): gRPC health, and KServe v2's.
PROBES = (HEALTH_PREFIX, *(f"/inference.GRPCInferenceService/{name}"
                           for name in ("ServerLive", "ServerReady", "ModelReady")))
# A client's own deadline timer may cancel the call a moment before the server's fires.
DEADLINE_SLACK_SECONDS = 0.05
POLL_SECONDS = 0.05  # how often a stream's reader, held back by the window, looks whether the call ended
# gRPC cuts off requests above its receive limit with its own words, before any code of ours runs;
# set this many times above --max-message-bytes, the servicer refuses the requests in between with
# a message that names the flag (issue 10, item 8). Larger ones still get gRPC's message.
RECEIVE_LIMIT_FACTOR = 2


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


class DenseScoringServicer(scoring_pb2_grpc.DenseScoringServicer):
    """Score, ScoreStream, ListModels and GetModel over one Pipeline."""

    def __init__(self, pipeline: Pipeline, *, settings: Settings, metrics: Metrics, limits: CallLimits) -> None:
        self.pipeline = pipeline
        self.settings = settings
        self.metrics = metrics
        self.limits = limits  # the call limits it runs under, which hold its transient refusals
        self.draining = threading.Event()
        self.ready = threading.Event()  # set once warm-up is done: scoring before it is refused (UNAVAILABLE)
        self._names = [summary.name for summary in pipeline.models()]
        self._active = 0
        self._idle = threading.Condition()

    @property
    def active(self) -> int:
        """Calls in flight."""
        with self._idle:
            return self._active

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no call is in flight (or `timeout` seconds); True when idle."""
        with self._idle:
            return self._idle.wait_for(lambda: self._active == 0, timeout)

    @contextlib.contextmanager
    def accounted(self, method: str, context: grpc.ServicerContext, model: str = NO_MODEL) -> Iterator[Call]:
        """Count the call by method, final code and model (`model`, or the first request's), track it in
        flight, abort on ScoringError (a transient one once held for its turn at the refusal pace)."""
        code = grpc.StatusCode.OK
        call = Call(context)
        call.model = model
        self.metrics.in_flight.inc()
        with self._idle:
            self._active += 1
        try:
            if self.draining.is_set():
                raise ScoringError(Refusal.UNAVAILABLE, "the server is shutting down; retry on another replica")
            yield call
        except ScoringError as error:
            code = error.code
            if error.retry_after_seconds is not None:
                self.limits.hold(context, error, deadline=call.deadline, cancelled=call.cancelled)
            refuse(context, error)
        except (grpc.RpcError, GeneratorExit):
            # A stream's call ended under it (the client cancelled or the deadline passed): reading its
            # requests raises RpcError, or gRPC closes the handler's generator before asking for the
            # next answer. No one to answer, no bug to log.
            code = ended(context)
        except Exception:
            code = grpc.StatusCode.UNKNOWN  # a bug: gRPC answers UNKNOWN, the log keeps the traceback
            LOG.exception("%s failed", method)
            raise
        finally:
            if code == grpc.StatusCode.OK and not context.is_active():
                code = ended(context)  # the call ended before its answer: the request iterator just stopped
            if code == grpc.StatusCode.OK:
                self.limits.leave(context)  # its place is free for a resend before the answer is sent
                self.limits.pacer.answered()
            self.metrics.in_flight.dec()
            self.metrics.count_request(method, code.name, call.model)
            with self._idle:
                self._active -= 1
                self._idle.notify_all()

    def Score(self, request: scoring_pb2.ScoreRequest, context: grpc.ServicerContext) -> scoring_pb2.ScoreResponse:
        with self.accounted("Score", context) as call:
            return self._score(request, call)

    def _score(self, request: scoring_pb2.ScoreRequest, call: Call) -> scoring_pb2.ScoreResponse:
        if call.model == NO_MODEL:
            call.model = self.model_label(request)
        self.require_ready()
        check_size(request, self.settings.max_message_bytes)
        return self.pipeline.score(request, deadline=call.deadline, cancelled=call.cancelled)

    def require_ready(self) -> None:
        """UNAVAILABLE (retry soon) until the warm-up has made every plan: health says NOT_SERVING meanwhile,
        and plans are made and measured one at a time."""
        if not self.ready.is_set():
            raise ScoringError(Refusal.UNAVAILABLE, "the server is warming up (health NOT_SERVING); retry shortly",
                               retry_after_seconds=retry_after(Transient.WARMING_UP))

    def model_label(self, request: scoring_pb2.ScoreRequest) -> str:
        """The loaded model a request names (or the only one); never the caller's text, which could be anything."""
        if request.model in self._names:
            return request.model
        return self._names[0] if not request.model and len(self._names) == 1 else NO_MODEL

    def ScoreStream(
        self, request_iterator: Iterator[scoring_pb2.ScoreRequest], context: grpc.ServicerContext
    ) -> Iterator[scoring_pb2.ScoreResponse]:
        """Up to `stream_window` requests scored at once (so they batch together); answers in request order.

        Requests are read in a helper thread, so each answer is sent as soon as it and those before
        it are done: a client that waits for answer 1 before sending request 2 is served. A failing
        request ends the stream with its status; the message names its request_id. A stream with
        every answer sent and no request for `stream_idle_seconds` is ended, giving its worker back.
        """
        with self.accounted("ScoreStream", context) as call:
            window = max(1, self.settings.stream_window)
            with ThreadPoolExecutor(window, thread_name_prefix="stream") as pool:
                reader = StreamReader(request_iterator, pool, functools.partial(self._score, call=call), call,
                                      window=window, idle_seconds=self.settings.stream_idle_seconds)
                try:
                    for request_id, future in reader.submitted():
                        yield answer(request_id, future)
                finally:
                    call.cancelled.set()  # a failed or abandoned stream stops its other requests
                    pool.shutdown(wait=True, cancel_futures=True)

    def ListModels(
        self, request: scoring_pb2.ListModelsRequest, context: grpc.ServicerContext
    ) -> scoring_pb2.ListModelsResponse:
        with self.accounted("ListModels", context):
            return scoring_pb2.ListModelsResponse(models=self.pipeline.models())  # paths only with --expose-paths

    def GetModel(self, request: scoring_pb2.GetModelRequest, context: grpc.ServicerContext) -> model_card_pb2.ModelCard:
        with self.accounted("GetModel", context):
            return self.pipeline.card(request.name)


def refuse(context: grpc.ServicerContext, error: ScoringError) -> None:
    """Abort the call with the error's status; a transient refusal also says when to retry."""
    if error.retry_after_seconds is not None:
        context.set_trailing_metadata(((RETRY_AFTER_KEY, str(round(1000 * error.retry_after_seconds))),))
    context.abort(error.code, error.message)


def check_size(request: scoring_pb2.ScoreRequest, limit: int) -> None:
    """Refuse a request over `--max-message-bytes`, naming the flag (gRPC's own cut-off, set above it, cannot)."""
    size = request.ByteSize()
    if size > limit:
        raise ScoringError(
            Refusal.RESOURCE_EXHAUSTED,
            f"the request is {size} bytes, over this server's limit of {limit} bytes: send a smaller image "
            "(re-encoded, or resized to the largest scale you ask for), or start the server with a larger "
            "--max-message-bytes",
        )


def ended(context: grpc.ServicerContext) -> grpc.StatusCode:
    """How a call that ended before its answer was sent ended: at its deadline, or cancelled."""
    remaining = context.time_remaining()
    expired = remaining is not None and remaining <= DEADLINE_SLACK_SECONDS
    return grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED


class StreamReader:
    """A stream's requests, read in a thread of their own and submitted to `pool` as they arrive.

    Reading on while answers are pending is what lets a lockstep client (answer 1 before request 2)
    be served; at most `window` submitted requests wait to be answered, which holds reading back.
    """

    def __init__(self, requests: Iterator[scoring_pb2.ScoreRequest], pool: ThreadPoolExecutor,
                 score: Callable[[scoring_pb2.ScoreRequest], scoring_pb2.ScoreResponse], call: Call, *,
                 window: int, idle_seconds: float) -> None:
        self._pending: queue.Queue[tuple[str, Future]] = queue.Queue(maxsize=window)
        self._finished = threading.Event()
        self._error: Exception | None = None
        self._call = call
        self._idle_seconds = idle_seconds
        self._active_at = time.monotonic()  # the last request read or answer handed over
        thread = threading.Thread(target=self._read, args=(requests, pool, score), name="stream-reader", daemon=True)
        thread.start()

    def submitted(self) -> Iterator[tuple[str, Future]]:
        """(request_id, future) in request order; raises what reading raised (cancelled, deadline), or
        DEADLINE_EXCEEDED once the stream has been idle for `idle_seconds`."""
        while True:
            try:
                yield self._pending.get(timeout=POLL_SECONDS)
                self._active_at = time.monotonic()
            except queue.Empty:
                if self._finished.is_set() and self._pending.empty():  # put happens before finished is set
                    if self._error is not None:
                        raise self._error from None
                    return
                idle = time.monotonic() - self._active_at
                if idle > self._idle_seconds:
                    raise ScoringError(
                        Refusal.DEADLINE_EXCEEDED,
                        f"no request for {idle:.0f} s on this stream, whose answers were all sent: the server "
                        f"ends streams idle for {self._idle_seconds:g} s (--stream-idle-seconds); open a new "
                        "stream when you have more to send",
                    )

    def _read(self, requests: Iterator[scoring_pb2.ScoreRequest], pool: ThreadPoolExecutor,
              score: Callable[[scoring_pb2.ScoreRequest], scoring_pb2.ScoreResponse]) -> None:
        call = self._call
        try:
            for request in requests:
                self._active_at = time.monotonic()
                if call.cancelled.is_set():
                    return
                future = pool.submit(score, request)
                while not call.cancelled.is_set():
                    with contextlib.suppress(queue.Full):
                        self._pending.put((request.request_id, future), timeout=POLL_SECONDS)
                        break
        except Exception as error:  # the client cancelled or the deadline passed: the handler answers for it
            self._error = error
        finally:
            self._finished.set()


def answer(request_id: str, future: Future) -> scoring_pb2.ScoreResponse:
    """The future's response; its ScoringError re-raised with the request_id in the message."""
    try:
        return future.result()
    except ScoringError as error:
        message = f"request {request_id!r}: {error.message}" if request_id else error.message
        raise ScoringError(error.refusal, message, retry_after_seconds=error.retry_after_seconds) from error


class TokenInterceptor(grpc.ServerInterceptor):
    """UNAUTHENTICATED unless metadata carries `authorization: Bearer <token>` (health probes exempt)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        received = metadata.get("authorization", "")
        if isinstance(received, str):
            received = received.encode()
        if hmac.compare_digest(received, self._expected):
            return handler
        return guarded(handler, denied)


@contextlib.contextmanager
def denied(context: grpc.ServicerContext, _request: Message | None) -> Iterator[None]:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token: send metadata "
                  "`authorization: Bearer <token>`")
    yield  # never reached: abort raises


class CallLimits(grpc.ServerInterceptor):
    """At most `total` calls running at once, and `per_peer` from one client address (0: no such limit).

    gRPC runs every call on one thread pool: idle streams from one client, or from many, could hold
    every worker, and health probes would wait behind them (issue 10, item 4). Calls beyond a limit
    are refused as soon as they reach a worker, RESOURCE_EXHAUSTED with a retry hint, so the workers
    `total` leaves free always answer probes (`PROBES`, exempt here) and refusals. The client's
    address is known only inside the call (`context.peer()`), hence the check there, not here.

    Calls are slowed by `pacer` (issue 22, item 4): a resent request waits at its door before it takes a
    place, and transient refusals, these and the servicer's, are answered at its pace. Either wait is on
    a thread of the pool's own (`--max-held-refusals` of them beyond `--grpc-workers`), out of any worker
    place, so held calls never take the places of calls being scored, nor the reserved workers.
    """

    def __init__(self, *, total: int, per_peer: int, metrics: Metrics, pacer: RefusalPacer) -> None:
        self._slots = CallSlots(total=total, per_peer=per_peer)
        self._metrics = metrics
        self.pacer = pacer
        self._lock = threading.Lock()
        self._places: dict[grpc.ServicerContext, Callable[[], None]] = {}  # each call's slot, to give back
        self._keys: dict[grpc.ServicerContext, Callable[[], Hashable | None]] = {}  # each call's resend key

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(PROBES):
            return handler
        method = handler_call_details.method.rsplit("/", 1)[-1]
        return guarded(handler, functools.partial(self._slot, method=method))

    @contextlib.contextmanager
    def _slot(self, context: grpc.ServicerContext, request: Message | None, *, method: str) -> Iterator[None]:
        key = functools.partial(resend_key, method, request)
        if request is not None and self.pacer.refusing:
            woken = threading.Event()
            with self.pacer.door(key(), wake=woken.set, deadline=Call(context, woken).deadline) as seconds:
                woken.wait(seconds)
        with self._lock:
            self._keys[context] = key
        try:
            try:
                give_back = self._slots.take(client_address(context.peer()))
            except ScoringError as error:
                self._metrics.count_request(method, grpc.StatusCode.RESOURCE_EXHAUSTED.name)
                self.hold(context, error, deadline=deadline_of(context))
                refuse(context, error)
            with self._lock:
                self._places[context] = give_back
            yield
        finally:
            self.leave(context)

    def leave(self, context: grpc.ServicerContext, *, refused: bool = False) -> Callable[[], Hashable | None]:
        """Give back the call's place, once (a held refusal gives it back before its hold), for a resend at the
        door to take unless the call was `refused` for want of room; its resend key."""
        with self._lock:
            give_back = self._places.pop(context, None)
            key = self._keys.pop(context, None)
        if give_back is not None:
            give_back()
            if not refused:
                self.pacer.freed()
        return key or (lambda: None)

    def hold(self, context: grpc.ServicerContext, refusal: ScoringError, *, deadline: float | None,
             cancelled: threading.Event | None = None) -> None:
        """Hold a transient refusal for its turn at the refusal pace, out of its worker place; a call that is
        cancelled or ends meanwhile stops waiting (`cancelled`: the event its end sets, if it has one)."""
        key = self.leave(context, refused=True)()
        with self.pacer.hold(key, deadline=deadline, decided=refusal.decided) as seconds:
            if seconds:
                if cancelled is None:
                    cancelled = threading.Event()
                    context.add_callback(cancelled.set)
                cancelled.wait(seconds)


def resend_key(method: str, request: Message | None) -> Hashable | None:
    """What a request sent again is recognised by: its method and bytes (None: a stream's, never recognised)."""
    return None if request is None else hash((method, request.SerializeToString(deterministic=True)))


def client_address(peer: str) -> str:
    """The client's address without its port: "ipv4:10.0.0.7:53211" -> "10.0.0.7", "ipv6:[::1]:5" -> "::1"."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6" and rest.startswith("["):
        return rest[1:rest.index("]")]
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    return peer  # unix sockets and the like: the whole string


def guarded(
    handler: grpc.RpcMethodHandler,
    guard: Callable[[grpc.ServicerContext, Message | None], contextlib.AbstractContextManager],
) -> grpc.RpcMethodHandler:
    """`handler` with its behaviour run inside `guard(context, request)`, which may abort the call on entry
    (`request`: the call's one request, None for a stream of them)."""
    serializers = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if not handler.response_streaming:
        behaviour = handler.unary_unary or handler.stream_unary

        def unary(request, context):
            with guard(context, None if handler.request_streaming else request):
                return behaviour(request, context)

        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(unary, **serializers)
        return grpc.unary_unary_rpc_method_handler(unary, **serializers)
    behaviour = handler.unary_stream or handler.stream_stream

    def streaming(request, context):
        with guard(context, None if handler.request_streaming else request):
            yield from behaviour(request, context)

    if handler.request_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **serializers)
    return grpc.unary_stream_rpc_method_handler(streaming, **serializers)


class ScoringServer:
    """A started gRPC server with its pipeline, health, metrics; `stop` drains and releases them all.

    `warm_up_error` is set when a warm-up pass failed: health then stays NOT_SERVING for good.
    """

    def __init__(self, grpc_server: grpc.Server, *, pipeline: Pipeline, servicer: DenseScoringServicer,
                 health_servicer: health.HealthServicer, metrics: Metrics, metrics_port: int | None,
                 http: HttpServer | None = None) -> None:
        self.grpc_server = grpc_server
        self.pacer = servicer.limits.pacer  # the refusal pace: another edge of this server shares it
        self.pipeline = pipeline
        self.servicer = servicer
        self.health = health_servicer
        self.metrics = metrics
        self.metrics_port = metrics_port
        self.http = http  # the HTTP face (--http-port), stopped with the gRPC server
        self.warm_up_error: ScoringError | None = None

    def stop(self, grace: float | None = None) -> threading.Event:
        """New calls UNAVAILABLE, in-flight ones get `grace` seconds; returns an event set when all is closed.

        The servicer refuses new calls itself (gRPC's own stop would answer them CANCELLED), and
        the gRPC server stops once the last in-flight call is answered or the grace period ends.
        """
        self.servicer.draining.set()
        self.health.enter_graceful_shutdown()
        done = threading.Event()

        def release() -> None:
            started = time.monotonic()

            def remaining() -> float:
                return max(0.0, grace - (time.monotonic() - started)) if grace else 0

            if grace:
                self.servicer.wait_idle(grace)
            # Calls accepted but not yet dispatched get what is left of the grace period; HTTP calls too.
            self.grpc_server.stop(remaining()).wait()
            if self.http is not None:
                self.http.stop(remaining())
            self.pipeline.close()
            self.metrics.close()
            done.set()

        threading.Thread(target=release, name="scoremap-release", daemon=True).start()
        return done

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self.grpc_server.wait_for_termination(timeout)


def server_options(settings: Settings) -> list[tuple[str, int]]:
    """gRPC channel arguments: message limits, connection lifetimes, keep-alive and its enforcement."""

    def ms(seconds: float) -> int:
        return int(1000 * seconds)

    return [
        ("grpc.max_receive_message_length", RECEIVE_LIMIT_FACTOR * settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.so_reuseport", 0),  # a port already in use is an error, not silently shared
        ("grpc.max_connection_idle_ms", ms(settings.connection_idle_seconds)),
        ("grpc.max_connection_age_ms", ms(settings.connection_age_seconds)),
        ("grpc.max_connection_age_grace_ms", ms(settings.connection_age_grace_seconds)),
        ("grpc.keepalive_time_ms", ms(settings.keepalive_seconds)),
        ("grpc.keepalive_timeout_ms", ms(settings.keepalive_timeout_seconds)),
        ("grpc.http2.min_ping_interval_without_data_ms", ms(settings.min_client_ping_seconds)),
    ]


def create_server(
    models: Sequence[str] | Mapping[str, str],
    *,
    address: str = "127.0.0.1:0",
    settings: Settings | None = None,
    token: str | None = None,
    tls: tuple[bytes, bytes] | None = None,
    wait_until_ready: bool = True,
) -> tuple[ScoringServer, int]:
    """Load the models (paths, or {name: path}) and serve on `address` (port 0: a free one); returns (server, port).

    `tls` is (certificate chain PEM, private key PEM); `token` turns on the bearer-token check.
    Health reports NOT_SERVING until every model has run its warm-up passes, then SERVING; if a
    warm-up pass fails it stays NOT_SERVING, the log says why and `server.warm_up_error` holds the
    error. With `wait_until_ready=False` the warm-up runs in the background after the port is
    open, so probes can watch it.
    """
    from server import kserve  # it builds on this module

    if token is not None and (problem := token_problem(token)):
        raise ValueError(f"the token {problem}; pass token=None to serve without one")
    settings = settings or Settings()
    settings.check()
    metrics = Metrics()
    pipeline = Pipeline(models, settings=dataclasses.replace(settings, warm_up=False), metrics=metrics)
    grpc_server = None
    try:
        if settings.warm_up:
            pipeline.check_warm_up()
        limits = CallLimits(total=settings.scoring_workers, per_peer=settings.max_calls_per_peer, metrics=metrics,
                            pacer=RefusalPacer.for_settings(settings))
        interceptors = [TokenInterceptor(token), limits] if token is not None else [limits]
        grpc_server = grpc.server(  # held refusals wait on threads of their own, counted beyond the call limit
            ThreadPoolExecutor(max_workers=settings.grpc_workers + settings.max_held_refusals, thread_name_prefix="rpc"),
            options=server_options(settings), interceptors=interceptors,
            maximum_concurrent_rpcs=settings.max_concurrent_rpcs + settings.max_held_refusals,
        )
        servicer = DenseScoringServicer(pipeline, settings=settings, metrics=metrics, limits=limits)
        scoring_pb2_grpc.add_DenseScoringServicer_to_server(servicer, grpc_server)
        health_servicer = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
        served = [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME]
        if kserve.add_to_server(grpc_server, servicer, health_servicer):  # KServe v2, with the `triton` extra
            served.append(kserve.SERVICE_NAME)
        for service in ("", SERVICE_NAME):
            health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        reflection.enable_server_reflection(served, grpc_server)
        try:
            if tls is not None:
                port = grpc_server.add_secure_port(address, grpc.ssl_server_credentials([(tls[1], tls[0])]))
            else:
                port = grpc_server.add_insecure_port(address)
        except RuntimeError as error:
            raise ScoringError(Refusal.UNAVAILABLE, f"could not bind {address} (in use?): {error}") from error
        metrics_port = None
        if settings.metrics_port is not None:
            try:
                metrics_port = metrics.serve(port=settings.metrics_port, address=settings.metrics_address)
            except OSError as error:
                where = f"{settings.metrics_address}:{settings.metrics_port}"
                raise ScoringError(Refusal.UNAVAILABLE,
                                   f"could not serve metrics on {where} (--metrics-port): {error.strerror}") from error
        grpc_server.start()
        http = None
        if settings.http_port is not None:  # the HTTP face (issue 21): the same host, TLS and token
            from server import web

            http = web.serve(servicer, host=address.rpartition(":")[0], port=settings.http_port, tls=tls, token=token,
                             version=version())
    except BaseException:
        if grpc_server is not None:
            grpc_server.stop(None)  # releases a port already bound
        pipeline.close()
        metrics.close()
        raise
    server = ScoringServer(grpc_server, pipeline=pipeline, servicer=servicer, health_servicer=health_servicer,
                           metrics=metrics, metrics_port=metrics_port, http=http)

    def become_ready() -> None:
        if settings.warm_up:
            try:
                pipeline.warm_up()
            except ScoringError as error:
                server.warm_up_error = error
                LOG.error("warm-up failed, health stays NOT_SERVING: %s", error.message)
                return
            except Exception as error:  # a bug, but never a silent thread death with health stuck at NOT_SERVING
                server.warm_up_error = ScoringError(Refusal.INTERNAL, f"warm-up failed: {error}")
                LOG.exception("warm-up failed, health stays NOT_SERVING")
                return
        servicer.ready.set()
        if not servicer.draining.is_set():
            for service in ("", SERVICE_NAME):
                health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
            LOG.info("ready: health SERVING")

    if wait_until_ready:
        become_ready()
    else:
        threading.Thread(target=become_ready, name="scoremap-warm-up", daemon=True).start()
    return server, port
