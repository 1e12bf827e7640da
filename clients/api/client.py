"""ScoremapClient: the Python API to a scoremap server.

The client owns its channel (message size, keep-alive and reconnect backoff set explicitly),
puts a deadline on every call, retries by clients/api/retry.py (status codes and the server's retry
hint, within a time budget), stops at once when interrupted, and raises ScoremapError carrying
the gRPC status and the server's message.
"""

from __future__ import annotations

import collections
import math
import threading
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.api.errors import ScoremapError, from_rpc_error
from clients.api.images import ImageLike
from clients.api.options import ScoreOptions, build_request
from clients.api.results import ScoreResult, result_from_response
from clients.api.retry import Backoff, Interrupted, Retrying, Verdict, WaitNotice, call_with_retries
from clients.api.settings import ClientSettings
from protos import is_loopback, model_card_pb2, scoring_pb2, scoring_pb2_grpc

__all__ = ["ScoremapClient", "channel_options", "explained", "is_loopback", "open_channel"]

T = TypeVar("T")


def channel_options(settings: ClientSettings) -> list[tuple[str, int]]:
    """gRPC channel options, all set explicitly: message size, keep-alive, reconnect backoff."""
    return [
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.keepalive_time_ms", settings.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", settings.keepalive_timeout_ms),
        ("grpc.initial_reconnect_backoff_ms", settings.initial_reconnect_backoff_ms),
        ("grpc.min_reconnect_backoff_ms", settings.initial_reconnect_backoff_ms),
        ("grpc.max_reconnect_backoff_ms", settings.max_reconnect_backoff_ms),
        # Retries are ours (clients/api/retry.py, within a budget); gRPC's transparent ones would double them.
        ("grpc.enable_retries", 0),
    ]


def open_channel(target: str, *, tls: bool = False, root_certificates: bytes | None = None,
                 settings: ClientSettings | None = None) -> grpc.Channel:
    """The channel every scoremap client uses: TLS (with `root_certificates` PEM, or the system
    roots) or clear text, with channel_options(settings)."""
    options = channel_options(settings or ClientSettings())
    if tls:
        return grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=root_certificates),
                                   options=options)
    return grpc.insecure_channel(target, options=options)


def explained(error: ScoremapError, request: scoring_pb2.ScoreRequest) -> ScoremapError:
    """`error`, with the fix a user can make added when a request of raw pixels was too large to take.

    A path (or a PIL image still holding its file) goes encoded, and the server decodes a large JPEG only
    to the size the scales need; the pixels of an array or a decoded image cannot shrink that way
    (a 24-megapixel image object sent as pixels is refused where its file scores)."""
    if error.code != grpc.StatusCode.RESOURCE_EXHAUSTED or error.retry_after_s is not None or not request.HasField("raw"):
        return error  # a transient refusal (a full queue) is no matter of size
    raw = request.raw
    return ScoremapError(
        error.code,
        f"{error.message}. The image went as {raw.height}x{raw.width}x{raw.channels} raw pixels "
        f"({len(raw.data)} bytes), as an array or a decoded or changed PIL image does: pass the file's path "
        "instead, or resize the image (to about the largest scale asked for)",
        retry_after_s=error.retry_after_s)


class ScoremapClient:
    """A connection to one scoremap server at `target` ("HOST:PORT").

    `tls` turns on TLS (with `root_certificates` PEM bytes, or the system roots); `token` is sent
    as an `authorization: Bearer` header, and only over TLS or to a loopback address.
    """

    def __init__(
        self,
        target: str,
        *,
        tls: bool = False,
        root_certificates: bytes | None = None,
        token: str | None = None,
        timeout: float | None = None,
        settings: ClientSettings | None = None,
    ) -> None:
        self.target = target
        self.settings = settings or ClientSettings()
        self.timeout = self.settings.timeout_s if timeout is None else timeout
        if token and not tls and not is_loopback(target):
            raise ScoremapError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"refusing to send a bearer token in clear text to {target!r}; use tls=True "
                "(tokens without TLS are allowed only to loopback addresses)",
            )
        self._channel = open_channel(target, tls=tls, root_certificates=root_certificates, settings=self.settings)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._stub = scoring_pb2_grpc.DenseScoringStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._in_flight: set[grpc.Future] = set()
        self._reached = False  # any answer from the server yet, success or refusal
        self._notice = WaitNotice(target, every_s=self.settings.wait_notice_every_s)

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        self.interrupt()
        self._channel.close()

    def interrupt(self) -> None:
        """Stop every call of this client now (from any thread): calls in flight are cancelled,
        pauses between retries end, and each raises Interrupted."""
        self._stop.set()
        with self._lock:
            calls = list(self._in_flight)
        for call in calls:
            call.cancel()

    def __enter__(self) -> ScoremapClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- calls -----------------------------------------------------------------------------

    def _retrying(self) -> Retrying:
        s = self.settings
        return Retrying(budget_s=s.retry_budget_s, stop=self._stop, budget_for=self._budget_for, on_wait=self._notice,
                        backoff=Backoff(s.backoff_initial_s, s.backoff_max_s, s.backoff_multiplier))

    def _budget_for(self, verdict: Verdict) -> float:
        """A server never reached gets `connect_budget_s` (a wrong address fails fast); one that
        answered before and went away gets the whole budget (a restart is ridden out)."""
        if verdict is Verdict.RECONNECT and not self._reached:
            return self.settings.connect_budget_s
        return math.inf

    def _tracked(self, call: grpc.Future) -> grpc.Future:
        with self._lock:
            self._in_flight.add(call)
        call.add_done_callback(self._untrack)
        if self._stop.is_set():
            call.cancel()
        return call

    def _untrack(self, call: grpc.Future) -> None:
        with self._lock:
            self._in_flight.discard(call)

    def _translate(self, error: grpc.RpcError) -> ScoremapError:
        translated = from_rpc_error(error)
        if translated.code != grpc.StatusCode.UNAVAILABLE:
            self._reached = True
        if self._stop.is_set():
            return Interrupted()
        return translated

    def _call(self, method: Callable[..., T], request: object, *, timeout: float | None = None) -> T:
        """One unary call with a deadline, retried by the shared policy (clients/api/retry.py)."""
        def attempt() -> T:
            call = self._tracked(method.future(request, timeout=self.timeout if timeout is None else timeout,
                                               metadata=self._metadata))
            try:
                response = call.result()
            except grpc.FutureCancelledError:
                raise Interrupted() from None
            except grpc.RpcError as error:
                raise self._translate(error) from None
            self._reached = True
            return response
        return call_with_retries(attempt, self._retrying())

    def score_request(self, request: scoring_pb2.ScoreRequest, *, timeout: float | None = None) -> scoring_pb2.ScoreResponse:
        """Send a prepared ScoreRequest; the raw ScoreResponse (what the CLI and load tester use)."""
        try:
            self._check_size(request)
            return self._call(self._stub.Score, request, timeout=timeout)
        except ScoremapError as error:
            raise explained(error, request) from None

    def _check_size(self, request: scoring_pb2.ScoreRequest) -> None:
        """Refuse, naming the setting, a request gRPC would cut off on sending with only its own numbers."""
        size, limit = request.ByteSize(), self.settings.max_message_bytes
        if size > limit:
            raise ScoremapError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the request is {size} bytes, over this client's limit of {limit} bytes "
                                "(ClientSettings.max_message_bytes)")

    def score(
        self,
        image: ImageLike,
        *,
        scales: Sequence[int] = (),
        stride: int = 0,
        shift: str = "auto",
        top_k: int = 5,
        classes: Sequence[int] = (),
        flip: bool = False,
        model: str = "",
        return_maps: bool = True,
        map_dtype: str = "float32",
        cell_top_k: int = 0,
        timeout: float | None = None,
    ) -> ScoreResult:
        """Score one image (path, encoded bytes, PIL image or uint8 array).

        `stride` 0 and empty `scales` take the model card's defaults; `shift` is one of auto,
        none, grid, diagonal, atrous.
        """
        options = ScoreOptions(model=model, scales=tuple(scales), stride=stride, shift=shift, flip=flip,
                               return_maps=return_maps, map_dtype=map_dtype, classes=tuple(classes),
                               cell_top_k=cell_top_k, top_k=top_k)
        return result_from_response(self.score_request(build_request(image, options), timeout=timeout))

    def score_many(self, images: Iterable[ImageLike], *, options: ScoreOptions | None = None) -> Iterator[ScoreResult]:
        """Score images over one ScoreStream, yielding results in input order.

        If the stream breaks with UNAVAILABLE, a new stream resends the images not yet answered
        (within the retry budget), so no image is lost or answered twice. A bad image raises its
        ScoremapError (INVALID_ARGUMENT) once the images before it are answered.
        """
        options = options or ScoreOptions(return_maps=True)
        source = enumerate(images)
        pending: collections.deque[scoring_pb2.ScoreRequest] = collections.deque()
        lock = threading.Lock()
        # Requests are built in gRPC's consumer thread, where an exception would only surface as
        # UNKNOWN "Exception iterating requests!": a bad image ends the stream and is raised here.
        bad_input: list[ScoremapError] = []

        def outgoing(resend: list[scoring_pb2.ScoreRequest]) -> Iterator[scoring_pb2.ScoreRequest]:
            yield from resend
            if bad_input:
                return
            for n, image in source:
                try:
                    request = build_request(image, options, request_id=str(n))
                except ScoremapError as error:
                    bad_input.append(error)
                    return
                try:
                    self._check_size(request)
                except ScoremapError as error:
                    bad_input.append(explained(error, request))
                    return
                with lock:
                    pending.append(request)
                yield request

        retrying = self._retrying()
        resend: list[scoring_pb2.ScoreRequest] = []
        while True:
            retrying.check()
            stream = self._tracked(self._stub.ScoreStream(outgoing(resend), timeout=self.settings.stream_timeout_s,
                                                          metadata=self._metadata))
            try:
                for response in stream:
                    self._reached = True
                    with lock:
                        pending.popleft()
                    retrying.progressed()
                    yield result_from_response(response)
                if bad_input:
                    raise bad_input[0]
                return
            except grpc.RpcError as error:
                translated = self._translate(error)
            finally:
                stream.cancel()  # a consumer that stops early ends the call
            with lock:
                head = pending[0] if pending else None  # answers come in order: the one refused, if any
            retrying.after(explained(translated, head) if head is not None else translated)
            with lock:
                resend = list(pending)

    def models(self) -> list[scoring_pb2.ModelSummary]:
        """The models the server has loaded."""
        return list(self._call(self._stub.ListModels, scoring_pb2.ListModelsRequest()).models)

    def model(self, name: str = "") -> model_card_pb2.ModelCard:
        """The model card of `name` (the only model when empty)."""
        return self._call(self._stub.GetModel, scoring_pb2.GetModelRequest(name=name))

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The server's health status name: "SERVING", "NOT_SERVING", ..."""
        response = self._call(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
