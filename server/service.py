"""The gRPC adapter: a thin servicer over the Pipeline, plus health, reflection and the token check.

Each method turns the call's deadline and cancellation into plain values, calls the pipeline and
maps its ScoringError to a status with `context.abort` (gRPC's route_guide / errors examples).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import grpc

from protos import model_card_pb2, scoring_pb2, scoring_pb2_grpc
from server.errors import ScoringError
from server.metrics import Metrics
from server.pipeline import Pipeline
from server.settings import Settings

LOG = logging.getLogger(__name__)
SERVICE_NAME = scoring_pb2.DESCRIPTOR.services_by_name["DenseScoring"].full_name
HEALTH_PREFIX = "/grpc.health.v1.Health/"  # probes need no token
# A client's own deadline timer may cancel the call a moment before the server's fires.
DEADLINE_SLACK_SECONDS = 0.05
POLL_SECONDS = 0.05  # how often a stream's reader, held back by the window, looks whether the call ended


class Call:
    """One RPC as plain values: its deadline (time.monotonic) and a flag set when it ends or is cancelled."""

    def __init__(self, context: grpc.ServicerContext) -> None:
        self.cancelled = threading.Event()
        context.add_callback(self.cancelled.set)
        remaining = context.time_remaining()
        self.deadline = time.monotonic() + remaining if remaining is not None else None


class DenseScoringServicer(scoring_pb2_grpc.DenseScoringServicer):
    """Score, ScoreStream, ListModels and GetModel over one Pipeline."""

    def __init__(self, pipeline: Pipeline, *, settings: Settings, metrics: Metrics) -> None:
        self.pipeline = pipeline
        self.settings = settings
        self.metrics = metrics
        self.draining = threading.Event()
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
    def _accounted(self, method: str, context: grpc.ServicerContext) -> Iterator[Call]:
        """Count the call by method and final code, track it in flight, abort on ScoringError."""
        code = grpc.StatusCode.OK
        self.metrics.in_flight.inc()
        with self._idle:
            self._active += 1
        try:
            if self.draining.is_set():
                raise ScoringError(grpc.StatusCode.UNAVAILABLE, "the server is shutting down; retry on another replica")
            yield Call(context)
        except ScoringError as error:
            code = error.code
            context.abort(error.code, error.message)
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
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(method, code.name).inc()
            with self._idle:
                self._active -= 1
                self._idle.notify_all()

    def Score(self, request: scoring_pb2.ScoreRequest, context: grpc.ServicerContext) -> scoring_pb2.ScoreResponse:
        with self._accounted("Score", context) as call:
            return self.pipeline.score(request, deadline=call.deadline, cancelled=call.cancelled)

    def ScoreStream(
        self, request_iterator: Iterator[scoring_pb2.ScoreRequest], context: grpc.ServicerContext
    ) -> Iterator[scoring_pb2.ScoreResponse]:
        """Up to `stream_window` requests scored at once (so they batch together); answers in request order.

        Requests are read in a helper thread, so each answer is sent as soon as it and those before
        it are done: a client that waits for answer 1 before sending request 2 is served. A failing
        request ends the stream with its status; the message names its request_id.
        """
        with self._accounted("ScoreStream", context) as call:
            window = max(1, self.settings.stream_window)
            with ThreadPoolExecutor(window, thread_name_prefix="stream") as pool:
                reader = StreamReader(request_iterator, pool, self.pipeline, call, window=window)
                try:
                    for request_id, future in reader.submitted():
                        yield answer(request_id, future)
                finally:
                    call.cancelled.set()  # a failed or abandoned stream stops its other requests
                    pool.shutdown(wait=True, cancel_futures=True)

    def ListModels(
        self, request: scoring_pb2.ListModelsRequest, context: grpc.ServicerContext
    ) -> scoring_pb2.ListModelsResponse:
        with self._accounted("ListModels", context):
            return scoring_pb2.ListModelsResponse(models=self.pipeline.models())

    def GetModel(self, request: scoring_pb2.GetModelRequest, context: grpc.ServicerContext) -> model_card_pb2.ModelCard:
        with self._accounted("GetModel", context):
            return self.pipeline.card(request.name)


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

    def __init__(self, requests: Iterator[scoring_pb2.ScoreRequest], pool: ThreadPoolExecutor, pipeline: Pipeline,
                 call: Call, *, window: int) -> None:
        self._pending: queue.Queue[tuple[str, Future]] = queue.Queue(maxsize=window)
        self._finished = threading.Event()
        self._error: Exception | None = None
        self._call = call
        thread = threading.Thread(target=self._read, args=(requests, pool, pipeline), name="stream-reader", daemon=True)
        thread.start()

    def submitted(self) -> Iterator[tuple[str, Future]]:
        """(request_id, future) in request order; raises what reading raised (cancelled, deadline)."""
        while True:
            try:
                yield self._pending.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if self._finished.is_set() and self._pending.empty():  # put happens before finished is set
                    if self._error is not None:
                        raise self._error from None
                    return

    def _read(self, requests: Iterator[scoring_pb2.ScoreRequest], pool: ThreadPoolExecutor, pipeline: Pipeline) -> None:
        call = self._call
        try:
            for request in requests:
                if call.cancelled.is_set():
                    return
                future = pool.submit(pipeline.score, request, deadline=call.deadline, cancelled=call.cancelled)
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
        raise ScoringError(error.code, message) from error


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
        return denied(handler, "missing or wrong bearer token: send metadata `authorization: Bearer <token>`")


def denied(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED."""

    def refuse(_request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    def refuse_stream(_request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # a generator, as streaming handlers must be

    serializers = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse, **serializers)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **serializers)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse, **serializers)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, **serializers)
