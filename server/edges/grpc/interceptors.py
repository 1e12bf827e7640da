"""The gRPC interceptors: the bearer token, and the call limits with the refusal pace and resend door.

The rules themselves (the token, the places, the resend key) are server/edges/calls.py's, the HTTP edge's too;
these only find them their values in a gRPC call."""

from __future__ import annotations

import abc
import contextlib
import contextvars
import functools
import threading
import time
from collections.abc import Callable, Hashable, Iterator

import grpc
from google.protobuf.message import Message

from server.edges.calls import CallSlots, Place, Token, resend_key
from server.edges.grpc.calls import deadline_of, refuse, status_code
from server.edges.refusal_pace import RefusalPacer
from server.errors import ScoringError
from server.metrics import Metrics

__all__ = ["CallLimits", "PROBES", "TokenInterceptor", "client_address"]

HEALTH_PREFIX = "/grpc.health.v1.Health/"  # probes need no token
# Probes answered however busy the server is (exempt from the call limits): gRPC health, and KServe v2's.
PROBES = (HEALTH_PREFIX, *(f"/inference.GRPCInferenceService/{name}"
                           for name in ("ServerLive", "ServerReady", "ModelReady")))
# When the call reached the server (time.monotonic()): gRPC runs a call's interceptors as it arrives, before its
# message is read, and its handler later, both in the call's own context.
ARRIVED: contextvars.ContextVar[float] = contextvars.ContextVar("arrived")


class ExemptingInterceptor(grpc.ServerInterceptor):
    """An interceptor that leaves the methods starting with `exempt` alone and hands every other to `intercept`."""

    exempt: tuple[str, ...] = ()

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self.exempt):
            return handler
        return self.intercept(handler, handler_call_details)

    @abc.abstractmethod
    def intercept(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        """The handler a call not exempt runs."""


class TokenInterceptor(ExemptingInterceptor):
    """UNAUTHENTICATED unless metadata carries `authorization: Bearer <token>` (health probes exempt)."""

    exempt = (HEALTH_PREFIX,)

    def __init__(self, token: str) -> None:
        self._token = Token(token)

    def intercept(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        try:
            self._token.check(dict(details.invocation_metadata or ()).get("authorization"))
        except ScoringError as error:
            return guarded(handler, functools.partial(denied, error=error))
        return handler


@contextlib.contextmanager
def denied(context: grpc.ServicerContext, _request: Message | None, *, error: ScoringError) -> Iterator[None]:
    context.abort(status_code(error), error.message)
    yield  # never reached: abort raises


class CallLimits(ExemptingInterceptor):
    """At most `total` calls running at once, and `per_peer` from one client address (0: no such limit).

    gRPC runs every call on one thread pool: idle streams from one client, or from many, could hold
    every worker, and health probes would wait behind them. Calls beyond a limit
    are refused as soon as they reach a worker, RESOURCE_EXHAUSTED with a retry hint, so the workers
    `total` leaves free always answer probes (`PROBES`, exempt here) and refusals. The client's
    address is known only inside the call (`context.peer()`), hence the check there, not here.

    Calls are slowed by `pacer` (docs/design.md: the refusal pace and the resend door): a resent request waits at its door before it takes a
    place (a copy that arrived before any refusal of its request was answered is no resend), and transient
    refusals, these and the servicer's, are answered at its pace. Either wait is on
    a thread of the pool's own (`--max-held-refusals` of them beyond `--grpc-workers`), out of any worker
    place, so held calls never take the places of calls being scored, nor the reserved workers.
    """

    exempt = PROBES

    def __init__(self, *, total: int, per_peer: int, metrics: Metrics, pacer: RefusalPacer) -> None:
        self._slots = CallSlots(total=total, per_peer=per_peer, pacer=pacer)
        self._metrics = metrics
        self.pacer = pacer
        self._lock = threading.Lock()
        self._places: dict[grpc.ServicerContext, Place] = {}  # each call's place, to give back
        self._keys: dict[grpc.ServicerContext, Callable[[], Hashable | None]] = {}  # each call's resend key
        # By method: the handler gRPC gave, and it in its slot. gRPC asks on every call; making the slot's handler
        # once per method saves 0.04-0.08 ms of CPU per request (docs/design.md: the host's cost per request).
        self._handlers: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def intercept(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        """The method's handler in its slot, made again only when the handler given is not the one it was made
        from (an interceptor before this one may answer a call with another)."""
        ARRIVED.set(time.monotonic())
        made = self._handlers.get(details.method)
        if made is None or made[0] is not handler:
            made = handler, guarded(handler, functools.partial(self._slot, method=details.method.rsplit("/", 1)[-1]))
            self._handlers[details.method] = made
        return made[1]

    @contextlib.contextmanager
    def _slot(self, context: grpc.ServicerContext, request: Message | None, *, method: str) -> Iterator[None]:
        key = functools.cache(functools.partial(message_key, method, request))  # read at the door and in a hold: once
        if request is not None and self.pacer.refusing:
            woken = threading.Event()
            context.add_callback(woken.set)
            with self.pacer.door(key(), wake=woken.set, deadline=deadline_of(context),
                                 started=ARRIVED.get(None)) as seconds:
                woken.wait(seconds)
        with self._lock:
            self._keys[context] = key
        try:
            try:
                place = self._slots.take(client_address(context.peer()))
            except ScoringError as error:
                self._metrics.count_request(method, error.refusal.name)
                self.hold(context, error, deadline=deadline_of(context))
                refuse(context, error)
            with self._lock:
                self._places[context] = place
            yield
        finally:
            self.leave(context)

    def leave(self, context: grpc.ServicerContext, *, refused: bool = False) -> Callable[[], Hashable | None]:
        """Give back the call's place, once (a held refusal gives it back before its hold), for a resend at the
        door to take unless the call was `refused` for want of room; its resend key."""
        with self._lock:
            place = self._places.pop(context, None)
            key = self._keys.pop(context, None)
        if place is not None:
            place.leave(refused=refused)
        return key or (lambda: None)

    def hold(self, context: grpc.ServicerContext, refusal: ScoringError, *, deadline: float | None,
             cancelled: threading.Event | None = None) -> None:
        """Hold a transient refusal for its turn at the refusal pace, out of its worker place; a call that is
        cancelled or ends meanwhile stops waiting (`cancelled`: the event its end sets, if it has one)."""
        key = self.leave(context, refused=True)()
        with self.pacer.hold(key, deadline=deadline, decided=refusal.decided,
                             retry_after=refusal.retry_after_seconds or 0.0) as seconds:
            if seconds:
                if cancelled is None:
                    cancelled = threading.Event()
                    context.add_callback(cancelled.set)
                cancelled.wait(seconds)


def message_key(method: str, request: Message | None) -> Hashable | None:
    """A call's resend key: its method and message's bytes (None: a stream's, never recognised)."""
    return None if request is None else resend_key(method, request.SerializeToString(deterministic=True))


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
