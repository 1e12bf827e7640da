"""The gRPC servicer: DenseScoring, a thin adapter over the server's Front (server/edges/front.py).

Each method turns the call's deadline and cancellation into plain values (a `Call`), calls the pipeline and
maps its ScoringError to a status with `context.abort` (gRPC's route_guide / errors examples); a
transient refusal also carries a retry hint in trailing metadata (`RETRY_AFTER_KEY`), and is answered
at the server's refusal pace (`CallLimits.hold`, server.edges.refusal_pace.RefusalPacer). The call's
accounting is the Front's, as the HTTP edge's is.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from concurrent.futures import Future

import grpc

from protos import model_card_pb2, scoring_pb2, scoring_pb2_grpc
from server.edges.calls import Call
from server.edges.front import Front
from server.edges.grpc.calls import call_of, ended, refuse
from server.edges.grpc.interceptors import CallLimits
from server.edges.streams import windowed
from server.errors import Retry, ScoringError
from server.metrics import NO_MODEL

__all__ = ["DenseScoringServicer", "SERVICE_NAME"]

SERVICE_NAME = scoring_pb2.DESCRIPTOR.services_by_name["DenseScoring"].full_name


class DenseScoringServicer(scoring_pb2_grpc.DenseScoringServicer):
    """Score, ScoreStream, ListModels and GetModel over one Pipeline."""

    def __init__(self, front: Front, *, limits: CallLimits) -> None:
        self.front = front
        self.pipeline = front.pipeline
        self.settings = front.settings
        self.limits = limits  # the call limits it runs under, which hold its transient refusals

    @contextlib.contextmanager
    def accounted(self, method: str, context: grpc.ServicerContext, model: str = NO_MODEL) -> Iterator[Call]:
        """The call accounted by the Front (by method, final code and model: `model`, or the first request's), refused
        while draining, aborted on ScoringError (a transient one once held for its turn at the refusal pace)."""
        call = call_of(context, method, model)
        with self.front.accounted(call):
            try:
                self.front.refuse_when_draining()
                yield call
                if context.is_active():
                    self.limits.leave(context)  # its place is free for a resend before the answer is sent
                else:
                    call.code = ended(context)  # the call ended before its answer: the request iterator just stopped
            except ScoringError as error:
                call.refused(error)
                if error.retry is Retry.LATER:
                    self.limits.hold(context, error, deadline=call.deadline, cancelled=call.cancelled)
                refuse(context, error)
            except (grpc.RpcError, GeneratorExit):
                # A stream's call ended under it (the client cancelled or the deadline passed): reading its
                # requests raises RpcError, or gRPC closes the handler's generator before asking for the
                # next answer. No one to answer, no bug to log.
                call.code = ended(context)

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
            with windowed(request_iterator, functools.partial(self._score, call=call), call, settings=self.settings,
                          name="stream") as submitted:
                for request_id, future in submitted:
                    yield answer(request_id, future)

    def ListModels(
        self, request: scoring_pb2.ListModelsRequest, context: grpc.ServicerContext
    ) -> scoring_pb2.ListModelsResponse:
        with self.accounted("ListModels", context):
            return scoring_pb2.ListModelsResponse(models=self.pipeline.models())  # paths only with --expose-paths

    def GetModel(self, request: scoring_pb2.GetModelRequest, context: grpc.ServicerContext) -> model_card_pb2.ModelCard:
        with self.accounted("GetModel", context):
            return self.pipeline.card(request.name)


def answer(request_id: str, future: Future) -> scoring_pb2.ScoreResponse:
    """The future's response; its ScoringError re-raised with the request_id in the message."""
    try:
        return future.result()
    except ScoringError as error:
        message = f"request {request_id!r}: {error.message}" if request_id else error.message
        raise ScoringError(error.refusal, message, retry_after_seconds=error.retry_after_seconds) from error
