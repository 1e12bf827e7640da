"""The gRPC servicer: DenseScoring, a thin adapter over the server's Front (server/edges/front.py).

Each method turns the call's deadline and cancellation into plain values, calls the pipeline and
maps its ScoringError to a status with `context.abort` (gRPC's route_guide / errors examples); a
transient refusal also carries a retry hint in trailing metadata (`RETRY_AFTER_KEY`), and is answered
at the server's refusal pace (`CallLimits.hold`, server.edges.refusal_pace.RefusalPacer).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import grpc

from protos import model_card_pb2, scoring_pb2, scoring_pb2_grpc
from server.edges.front import Front
from server.edges.grpc.calls import Call, ended, refuse
from server.edges.grpc.interceptors import CallLimits
from server.errors import Refusal, Retry, ScoringError
from server.metrics import NO_MODEL

__all__ = ["DenseScoringServicer", "SERVICE_NAME", "StreamReader"]

LOG = logging.getLogger(__name__)
SERVICE_NAME = scoring_pb2.DESCRIPTOR.services_by_name["DenseScoring"].full_name
POLL_SECONDS = 0.05  # how often a stream's reader, held back by the window, looks whether the call ended


class DenseScoringServicer(scoring_pb2_grpc.DenseScoringServicer):
    """Score, ScoreStream, ListModels and GetModel over one Pipeline."""

    def __init__(self, front: Front, *, limits: CallLimits) -> None:
        self.front = front
        self.pipeline = front.pipeline
        self.settings = front.settings
        self.metrics = front.metrics
        self.limits = limits  # the call limits it runs under, which hold its transient refusals

    @contextlib.contextmanager
    def accounted(self, method: str, context: grpc.ServicerContext, model: str = NO_MODEL) -> Iterator[Call]:
        """Count the call by method, final code and model (`model`, or the first request's), track it in
        flight, abort on ScoringError (a transient one once held for its turn at the refusal pace)."""
        code = grpc.StatusCode.OK
        call = Call(context)
        call.model = model
        self.metrics.in_flight.inc()
        with self.front.in_flight():
            try:
                self.front.refuse_when_draining()
                yield call
            except ScoringError as error:
                code = error.code
                if error.retry is Retry.LATER:
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
                    self.front.pacer.answered()
                self.metrics.in_flight.dec()
                self.metrics.count_request(method, code.name, call.model)

    def Score(self, request: scoring_pb2.ScoreRequest, context: grpc.ServicerContext) -> scoring_pb2.ScoreResponse:
        with self.accounted("Score", context) as call:
            return self._score(request, call)

    def _score(self, request: scoring_pb2.ScoreRequest, call: Call) -> scoring_pb2.ScoreResponse:
        if call.model == NO_MODEL:
            call.model = self.front.model_label(request)
        return self.front.score(request, deadline=call.deadline, cancelled=call.cancelled)

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
