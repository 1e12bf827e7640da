"""What the HTTP edge does for every call, as the gRPC servicer and its interceptors do for theirs.

The rules of a call are the Front's and server/edges/calls.py's, the gRPC edge's too: the bearer token, the call
limits (`--grpc-workers` less `--reserved-workers` at once, and `--max-calls-per-peer` from one address), the
resend key, draining, readiness, `--max-message-bytes` and the accounting. This module finds them their values in
an HTTP call and maps a `Refusal` to a status, so the routes only convert. Status codes
follow Google's mapping of gRPC codes to HTTP (google.rpc.Code, as grpc-gateway uses it), with one
choice of ours: a RESOURCE_EXHAUSTED without a retry hint is a request too large for a limit, which
retrying cannot cure, so it is 413 Content Too Large; with a hint (overloaded for now) it is 429
Too Many Requests with `Retry-After`. HTTP's own limits on the body are here too: its size (also
once inflated, for a compressed one) and how long it may stop arriving (408).
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
import zlib
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Message

from protos import scoring_pb2
from server.edges.calls import CANCELLED, Call, CallSlots, Place, Token, resend_key
from server.edges.front import Front
from server.errors import Refusal, Retry, ScoringError
from server.metrics import NO_MODEL
from server.scoring.fields import checked

METHOD_PREFIX = "http/"  # scoremap_requests_total{method="http/Score"}: the transport in the method label
DISCONNECT_POLL_SECONDS = 0.1  # how often a scoring call looks whether its client went away
ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}  # request bodies' Content-Encoding: zlib's wbits
STATUS = {
    Refusal.INVALID_ARGUMENT: 400,
    Refusal.FAILED_PRECONDITION: 400,
    Refusal.UNAUTHENTICATED: 401,
    Refusal.NOT_FOUND: 404,
    Refusal.RESOURCE_EXHAUSTED: 429,
    Refusal.CANCELLED: 499,  # the client closed the request: nobody reads it
    Refusal.INTERNAL: 500,
    Refusal.UNAVAILABLE: 503,
    Refusal.DEADLINE_EXCEEDED: 504,
}
TOO_LARGE = 413
REQUEST_TIMEOUT = 408


class BodyTimeout(ScoringError):
    """The client stopped sending its body (`--http-body-idle-seconds`): 408 Request Timeout, the client's delay."""


def http_status(error: ScoringError) -> int:
    """The status an HTTP client gets for a refusal (see the module docstring)."""
    if isinstance(error, BodyTimeout):
        return REQUEST_TIMEOUT
    if error.refusal is Refusal.RESOURCE_EXHAUSTED and error.retry is Retry.NEVER:
        return TOO_LARGE
    return STATUS[error.refusal]


def error_response(error: ScoringError) -> JSONResponse:
    """{"error": message, "code": refusal}, as KServe v2 REST answers errors; `Retry-After` on transient ones."""
    headers = {}
    if error.retry is Retry.LATER:
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_seconds)))  # whole seconds (RFC 9110)
    if isinstance(error, BodyTimeout):
        headers["Connection"] = "close"  # the rest of its body may still come: this connection is done
    if error.refusal is Refusal.UNAUTHENTICATED:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse({"error": error.message, "code": error.refusal.name}, status_code=http_status(error),
                        headers=headers)


@dataclass(eq=False)
class HttpCall(Call):
    """One HTTP call as plain values (server/edges/calls.py's `Call`), with its request."""

    request: Request | None = None


class Edge:
    """The server's Front (pipeline, readiness, refusal pace) for HTTP calls, with HTTP's own call limits."""

    def __init__(self, front: Front, *, token: str | None, version: str) -> None:
        self.front = front
        self.version = version
        self.pipeline = front.pipeline
        self.settings = front.settings
        self._token = Token(token) if token is not None else None
        self._slots = CallSlots(total=self.settings.scoring_workers, per_peer=self.settings.max_calls_per_peer,
                                pacer=front.pacer)
        # Scoring waits on its batch in a thread; the limits above keep it within this many.
        self._threads = anyio.CapacityLimiter(self.settings.scoring_workers)
        self._keying = anyio.CapacityLimiter(self.settings.max_held_refusals)  # bodies read outside a place

    @property
    def ready(self) -> bool:
        """What health reports SERVING for (`Front.serving`): readiness on HTTP."""
        return self.front.serving

    async def answer(self, method: str, request: Request, work: Callable[[HttpCall], Awaitable[Response]], *,
                     model: str | None = None, probe: bool = False) -> Response:
        """Run `work` as gRPC runs a method: token, call limits, draining, metrics, a refusal as its status.

        `model` is the name a call for one model gives (its label in the metrics when it is served).
        Probes (`probe=True`) need no token and are exempt from the limits, as gRPC's health checks.
        """
        label = NO_MODEL if model is None else self.front.model_label(scoring_pb2.ScoreRequest(model=model))
        call = HttpCall(METHOD_PREFIX + method, model=label, request=request)
        started = time.monotonic()  # the request's head is read; its body, at the door or by the route
        place: Place | None = None
        with self.front.accounted(call, probe=probe):
            try:
                if not probe:
                    if self._token is not None:
                        self._token.check(request.headers.get("authorization"))
                    if self.front.pacer.refusing:
                        await self._door(method, request, started=started)
                    place = self._slots.take(request.client.host if request.client else "")
                    self.front.refuse_when_draining()
                return await work(call)
            except ScoringError as error:
                call.refused(error)
                if error.retry is Retry.LATER:  # transient: answered at the server's refusal pace, as gRPC's
                    if place is not None:
                        place.leave(refused=True)
                    with self.front.pacer.hold(self._known_key(method, request), deadline=call.deadline,
                                               decided=error.decided,
                                               retry_after=error.retry_after_seconds or 0.0) as seconds:
                        if seconds:
                            await anyio.sleep(seconds)
                return error_response(error)
            except ClientDisconnect:
                call.code = CANCELLED
                return Response(status_code=STATUS[Refusal.CANCELLED])  # gone at the door: no one reads it
            except Exception:
                self.front.failed(call)
                return JSONResponse({"error": f"{method} failed inside the server; its log says why",
                                     "code": call.code}, status_code=500)
            finally:
                if place is not None:
                    place.leave()  # its place, given back, for a resend at the door

    async def _resend_key(self, method: str, request: Request) -> Hashable | None:
        """What a request sent again is recognised by, as gRPC's: its method, path, query and body, read here
        (None when --max-held-refusals bodies are being read for this already: the bodies read outside a
        scoring place are bounded, and such a call goes on unrecognised)."""
        if not self._keying.available_tokens:
            return None
        async with self._keying:
            await self._whole(request)  # its trouble (too large, too slow) is the call's answer
        return self._known_key(method, request)

    def _known_key(self, method: str, request: Request) -> Hashable | None:
        """The request's resend key when its body has been read (None: not yet; a refusal does not wait for
        an upload to remember it, so refusals stay fast)."""
        body = getattr(request.state, "body", None)
        return None if body is None else resend_key(method, request.url.path, request.url.query, body)

    async def _whole(self, request: Request) -> bytes:
        """The body as sent, read once within the limits and kept in the call's state (the door's read is the
        route's)."""
        if not hasattr(request.state, "body"):
            request.state.body = await self._limited(request).body()
        return request.state.body

    async def _door(self, method: str, request: Request, *, started: float) -> None:
        """A resent request waits for room while the server is refusing (server.edges.refusal_pace.RefusalPacer.door),
        at most --max-refusal-hold-ms: its own timeout is read by the route, after."""
        key = await self._resend_key(method, request)
        if key is None:
            return
        woken, loop = asyncio.Event(), asyncio.get_running_loop()
        wake = functools.partial(loop.call_soon_threadsafe, woken.set)
        with self.front.pacer.door(key, wake=wake, started=started) as seconds:
            if seconds:
                with anyio.move_on_after(seconds):
                    await woken.wait()

    async def score(self, call: HttpCall, request: scoring_pb2.ScoreRequest) -> scoring_pb2.ScoreResponse:
        """The pipeline's answer, computed in a worker thread; cancelled when the client goes away."""
        work = functools.partial(self.front.score, request, deadline=call.deadline, cancelled=call.cancelled)
        outcome: list = []

        async def run() -> None:
            try:
                outcome.append(await anyio.to_thread.run_sync(work, limiter=self._threads))
            except ScoringError as error:
                outcome.append(error)
            finally:
                call.cancelled.set()
                group.cancel_scope.cancel()

        async with anyio.create_task_group() as group:
            group.start_soon(run)
            while not call.cancelled.is_set():  # the watch: a client that hung up cancels its request
                if await call.request.is_disconnected():
                    call.cancelled.set()
                    break
                await anyio.sleep(DISCONNECT_POLL_SECONDS)
        if isinstance(outcome[0], ScoringError):
            raise outcome[0]
        return outcome[0]

    def _too_large(self, size: str) -> ScoringError:
        return ScoringError(Refusal.RESOURCE_EXHAUSTED, f"the request body is {size} bytes, over this server's "
                            f"limit of {self.settings.max_message_bytes} bytes: send a smaller image (re-encoded, or "
                            "resized to the largest scale you ask for), or start the server with a larger "
                            "--max-message-bytes")

    def _limited(self, request: Request) -> Request:
        """`request` whose body is refused past `--max-message-bytes`: at once when its Content-Length says
        so, else as soon as the bytes received pass it, so an oversized upload is never held whole. One per
        call (kept in its state), so a form is parsed from the body read whole before."""
        if hasattr(request.state, "limited"):
            return request.state.limited
        limit = self.settings.max_message_bytes
        declared = request.headers.get("content-length", "")
        if declared.isascii() and declared.isdigit() and int(declared) > limit:
            raise self._too_large(declared)
        received = 0

        idle = self.settings.http_body_idle_seconds

        async def receive() -> Message:
            nonlocal received
            try:
                with anyio.fail_after(idle):
                    message = await request.receive()
            except TimeoutError:
                raise BodyTimeout(Refusal.DEADLINE_EXCEEDED, f"no bytes of the request body for {idle:g} s after "
                                  f"{received} (--http-body-idle-seconds): send the body whole, then wait") from None
            received += len(message.get("body", b""))
            if received > limit:
                raise self._too_large(f"more than {limit}")
            return message

        request.state.limited = Request(request.scope, receive)
        return request.state.limited

    async def body(self, request: Request) -> bytes:
        """The whole body within `--max-message-bytes`; one sent compressed (Content-Encoding gzip or deflate,
        as tritonclient.http sends with `request_compression_algorithm`) is inflated within it too, so a
        compression bomb is refused (413) after at most the limit's bytes."""
        data = await self._whole(request)
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding == "identity":
            return data
        if encoding not in ENCODINGS:
            raise ScoringError(Refusal.INVALID_ARGUMENT, f"Content-Encoding {encoding!r}: send the body as it is, "
                               f"or compressed with {' or '.join(ENCODINGS)}")
        limit = self.settings.max_message_bytes
        try:
            inflated = zlib.decompressobj(ENCODINGS[encoding]).decompress(data, limit + 1)
        except zlib.error as error:
            raise ScoringError(Refusal.INVALID_ARGUMENT, f"the body is not {encoding} data ({error}), as its "
                               "Content-Encoding says") from None
        if len(inflated) > limit:
            raise self._too_large(f"more than {limit} once inflated from {len(data)}")
        return inflated

    async def form(self, request: Request) -> FormData:
        """The multipart form, within `--max-message-bytes` and `--http-max-form-parts` (one file), parsed from the
        body read whole (and kept: a refusal recognises the same form sent again by it)."""
        await self._whole(request)
        parts = self.settings.http_max_form_parts
        try:
            return await self._limited(request).form(max_files=1, max_fields=parts - 1)
        except HTTPException as error:  # python-multipart's complaint about the form, or a limit above
            raise ScoringError(Refusal.INVALID_ARGUMENT, f"the multipart form is refused: {error.detail} (the score "
                               f"form takes one file, in the field 'image', and at most {parts} parts in all: "
                               "--http-max-form-parts)") from None


def deadline_after(timeout: float | None, *, name: str, field: str, per_second: float) -> float | None:
    """The time.monotonic deadline `timeout` from now, given in units `per_second` (None: no deadline); a timeout
    outside its range (server/scoring/fields.py: above 0, finite, at most gRPC's longest) refused naming `name`."""
    if timeout is None:
        return None
    return time.monotonic() + checked(name, timeout, field) / per_second
