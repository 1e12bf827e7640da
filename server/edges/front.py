"""The front every edge of one server shares, transport-free: readiness, draining, each call's accounting and
the calls in flight, the refusal pace and the request checks an edge makes before the pipeline.

The gRPC servicer and the HTTP edge each hold the one `Front` of their server, so neither reaches into
the other for shared state; what one call is, whatever its transport, is server/edges/calls.py's.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

from protos import scoring_pb2
from server.edges.calls import CANCELLED, OK, UNKNOWN, Call
from server.edges.refusal_pace import RefusalPacer
from server.errors import Refusal, ScoringError, Transient, retry_after, shutting_down
from server.metrics import NO_MODEL, Metrics
from server.scoring.pipeline import Pipeline
from server.settings import Settings

__all__ = ["Front", "check_size"]

LOG = logging.getLogger(__name__)


class Front:
    """One server's pipeline as its edges see it, with the state they share."""

    def __init__(self, pipeline: Pipeline, *, settings: Settings, metrics: Metrics, pacer: RefusalPacer) -> None:
        self.pipeline = pipeline
        self.settings = settings
        self.metrics = metrics
        self.pacer = pacer
        self.draining = threading.Event()
        self.ready = threading.Event()  # set once warm-up is done: scoring before it is refused (UNAVAILABLE)
        self._names = [summary.name for summary in pipeline.models()]
        self._active = 0
        self._idle = threading.Condition()

    @property
    def serving(self) -> bool:
        """Warmed up, not draining, and the engine able to run requests (an engine process may be gone, or starting
        again): what health reports SERVING for, on every edge."""
        return self.ready.is_set() and not self.draining.is_set() and self.pipeline.engine.ready

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
    def in_flight(self) -> Iterator[None]:
        """A call counted in flight until the block ends (what draining waits for)."""
        with self._idle:
            self._active += 1
        try:
            yield
        finally:
            with self._idle:
                self._active -= 1
                self._idle.notify_all()

    @contextlib.contextmanager
    def accounted(self, call: Call, *, probe: bool = False) -> Iterator[Call]:
        """A call's accounting, whatever its transport: in flight while the block runs (what draining waits for),
        counted by method, final code and model when it ends, and an answered call (a probe's aside) counted
        towards the refusal pace.

        The edge records a refusal or an end in `call.code` as it answers it; the block ending with none recorded
        is an answer (OK); an exception it did not record is a bug (UNKNOWN, logged with its traceback and raised
        on); an end the block never saw (a task cancelled) is CANCELLED."""
        self.metrics.in_flight.inc()
        with self.in_flight():
            try:
                yield call
                if call.code is None:
                    call.code = OK
            except Exception:
                if call.code is None:
                    self.failed(call)
                raise
            finally:
                if call.code is None:
                    call.code = CANCELLED
                if call.code == OK and not probe:
                    self.pacer.answered()
                self.metrics.in_flight.dec()
                self.metrics.count_request(call.method, call.code, call.model)

    @staticmethod
    def failed(call: Call) -> None:
        """The call met a bug (call it in the except block that caught it): UNKNOWN, and the log keeps the
        traceback, which the client never gets."""
        call.code = UNKNOWN
        LOG.exception("%s failed", call.method)

    def refuse_when_draining(self) -> None:
        if self.draining.is_set():
            raise shutting_down()

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

    def score(self, request: scoring_pb2.ScoreRequest, *, deadline: float | None,
              cancelled: threading.Event | None) -> scoring_pb2.ScoreResponse:
        """The checks every edge makes before the pipeline (ready, size), then the pipeline's answer."""
        self.require_ready()
        check_size(request, self.settings.max_message_bytes)
        return self.pipeline.score(request, deadline=deadline, cancelled=cancelled)


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
