"""Admission, the one module that refuses a request before compute.

`admit(request, model, deadline=) -> Ticket` runs `CHECKS`, one ordered list of small checks each
returning its refusal (or None): the request's fields (the image's first bytes included), then the
queue's room and expected wait, then the image's header, then what the header tells (every scale's
canvas, or its tiles on one, and batch limit in memory: server/scoring/fitting.py; the tiles' queue
places, the response's size and the host memory, and past either limit what would fit:
server/scoring/footprint.py). The ticket holds the queue places and the host bytes together and gives
both back in `release`, the one way out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from convert.arguments import format_bytes
from protos import scoring_pb2
from server.errors import NoRoom, Refusal, ScoringError, Transient, invalid
from server.geometry import dense
from server.memory.host import RGB, HostEstimate
from server.memory.host_budget import admit_host
from server.scoring import fields, footprint, imaging
from server.scoring.fitting import scale_job
from server.scoring.request import ScaleJob

if TYPE_CHECKING:
    from server.engine.client import CanvasStore, EngineClient, Places
    from server.scoring.model import Model

__all__ = ["CHECKS", "Ticket", "admit"]


@dataclass(eq=False)
class Ticket:
    """A request being admitted, then admitted: what it will run, and what it holds until `release`
    (its places in the model's queue, until its items are queued; its host bytes and canvases, until it ends)."""

    request: scoring_pb2.ScoreRequest
    model: Model
    engine: EngineClient
    deadline: float | None
    scales: list[int] = field(default_factory=list)
    passes: dense.Passes | None = None
    flips: tuple[bool, ...] = (False,)
    places: Places | None = None
    opened: imaging.OpenedImage | None = None
    jobs: list[ScaleJob] = field(default_factory=list)
    host: HostEstimate | None = None
    held_bytes: int = 0
    canvases: CanvasStore | None = None

    @property
    def original(self) -> tuple[int, int]:
        return self.opened.height, self.opened.width

    def release(self) -> None:
        """Give back the queue places (nothing once queued), the canvases and the host bytes; once, the one way
        out."""
        places, self.places = self.places, None
        if places is not None:
            self.engine.release(self.model.name, places)
        canvases, self.canvases = self.canvases, None
        if canvases is not None:
            canvases.release()
        held, self.held_bytes = self.held_bytes, 0
        if held:
            self.model.host_budget.give_back(held)

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def check_scales(ticket: Ticket) -> ScoringError | None:
    model, limits = ticket.model, ticket.model.limits
    scales = ticket.scales = list(ticket.request.scales) or [model.default_scale]
    if len(scales) > limits.max_scales:
        return invalid(f"{len(scales)} scales requested; at most {limits.max_scales} are allowed (--max-scales)")
    for scale in scales:
        if scale < model.min_scale:
            return invalid(f"scale {scale} is below {model.min_scale}, the smallest this server takes (the target "
                           f"shorter side in pixels; model {model.name} needs at least its training size "
                           f"{model.training_size}): ask for a larger scale")
        if limits.max_scale is not None and scale > limits.max_scale:
            return invalid(f"scale {scale} is above the server's --max-scale {limits.max_scale} (the target shorter "
                           "side in pixels): ask for a smaller scale, or restart the server with a larger "
                           "--max-scale or without it (then the request's own host memory estimate decides)")
    if len(set(scales)) != len(scales):
        return invalid(f"scales {scales} repeat a value; give each scale once")
    return None


def check_fields(ticket: Ticket) -> ScoringError | None:
    request, model = ticket.request, ticket.model
    for name in ("top_k", "cell_top_k", "output_stride"):
        refused = fields.outside(name, getattr(request, name), name)
        if refused is not None:
            return refused
    bad = [c for c in request.classes if not 0 <= c < model.classes]
    if bad:
        return invalid(f"classes {bad} are out of range: model {model.name} has classes 0..{model.classes - 1}")
    if request.map_dtype not in scoring_pb2.MapDtype.values():
        return invalid(f"map_dtype {request.map_dtype} is not a MapDtype; use one of "
                       f"{', '.join(scoring_pb2.MapDtype.keys())}")
    return None


def choose_passes(ticket: Ticket) -> ScoringError | None:
    request, model = ticket.request, ticket.model
    try:
        ticket.passes = dense.passes_for(native_stride=model.card.output_stride, output_stride=request.output_stride,
                                         shift=request.shift)
    except dense.PassesError as error:
        return invalid(f"model {model.name}: {error}")
    ticket.flips = (False, True) if request.flip else (False,)
    return None


def check_image_field(ticket: Ticket) -> ScoringError | None:
    """The image is there, and its first bytes are an image's: a permanent refusal stays one under load."""
    kind = ticket.request.WhichOneof("image")
    if kind is None:
        return invalid(f"the request has no image: set `encoded` ({imaging.FORMAT_NAMES} bytes) or `raw` pixels")
    if kind == "encoded":
        try:
            imaging.check_encoded(ticket.request.encoded)
        except imaging.ImageError as error:
            return invalid(str(error))
    return None


def hold_places(ticket: Ticket) -> ScoringError | None:
    """Places in the model's queue, before the header is read: under overload most requests are refused,
    and each refusal then costs no header parsing or planning (26% of its server CPU, measured). A broken
    header is found once there is room, so under overload it is first refused as transient."""
    try:
        ticket.places = queue_places(ticket, len(ticket.scales) * len(ticket.flips))
    except ScoringError as error:
        return error
    return None


def queue_places(ticket: Ticket, items: int) -> Places:
    """`items` places in the model's queue, or the refusal saying why there is no room."""
    held = ticket.engine.reserve(ticket.model.name, items, deadline=ticket.deadline)
    if isinstance(held, NoRoom):
        raise held.refusal(deadline=ticket.deadline)
    return held


def read_header(ticket: Ticket) -> ScoringError | None:
    """The image's header: its size, and nothing decoded yet."""
    request, limit = ticket.request, ticket.model.limits.max_image_pixels
    try:
        if request.WhichOneof("image") == "encoded":
            ticket.opened = imaging.open_image(request.encoded, max_pixels=limit)
        else:
            ticket.opened = imaging.from_raw(request.raw, max_pixels=limit)
    except imaging.ImageError as error:
        return invalid(str(error))
    return None


def fit_scales(ticket: Ticket) -> ScoringError | None:
    """Each scale's resized size, canvas bucket (or the tiles on one), kept cells and batch limit; refused when
    the image cannot take it: first a scale whose resized image alone is beyond one request's host memory."""
    oversized = footprint.oversized_scale(ticket.model, ticket.original, ticket.scales)
    if oversized is not None:
        scale, alone, limit = *oversized, ticket.model.limits.max_request_host_bytes
        return ScoringError(
            Refusal.RESOURCE_EXHAUSTED,
            f"scale {scale} resizes the {ticket.original[0]}x{ticket.original[1]} image to {alone // RGB} pixels, "
            f"whose RGB copy alone ({format_bytes(alone)}) is beyond the host memory one request may hold, "
            f"{format_bytes(limit)} (--max-request-host-bytes); {would_fit(ticket)}; or restart the server with a "
            "larger --max-request-host-bytes",
        )
    try:
        ticket.jobs = [scale_job(ticket.model, ticket.original, scale, ticket.passes, flip=len(ticket.flips) > 1)
                       for scale in ticket.scales]
    except ScoringError as error:
        return error
    return None


def hold_tile_places(ticket: Ticket) -> ScoringError | None:
    """A tiled scale is one item per tile and orientation: the places held before the header was read
    (one per scale and orientation) become the request's whole count."""
    items = footprint.queue_items(ticket.jobs, orientations=len(ticket.flips))
    if ticket.places is None or items == ticket.places.items:
        return None
    places, ticket.places = ticket.places, None
    ticket.engine.release(ticket.model.name, places)
    held = ticket.engine.reserve(ticket.model.name, items, deadline=ticket.deadline)
    if not isinstance(held, NoRoom):
        ticket.places = held
        return None
    if held.why is Transient.QUEUE_FULL and items > held.depth:  # no retry makes room for it
        return ScoringError(
            Refusal.RESOURCE_EXHAUSTED,
            f"this request is {items} items (scales x orientations x tiles), more than the queue holds "
            f"({held.depth}, --queue-depth): it never fits; {would_fit(ticket)}; or restart the server with "
            "a larger --queue-depth or larger --shape-buckets (fewer tiles)",
        )
    return held.refusal(deadline=ticket.deadline)



def check_response_size(ticket: Ticket) -> ScoringError | None:
    """The response within --max-message-bytes; past it, what would fit (server/scoring/footprint.py)."""
    request, model, limit = ticket.request, ticket.model, ticket.model.limits.max_message_bytes
    expected = footprint.response_bytes(request, model, ticket.jobs)
    if expected > limit:
        return ScoringError(
            Refusal.RESOURCE_EXHAUSTED,
            f"the response would be about {expected} bytes ({format_bytes(expected)}), above the server's "
            f"--max-message-bytes {limit} ({format_bytes(limit)}); {would_fit(ticket)}; or score it region by region "
            "(`scoremap-score --tiled` asks for each region's map in a response of its own); or restart the server "
            "with a larger --max-message-bytes",
        )
    return None


def check_host_memory(ticket: Ticket) -> ScoringError | None:
    """What the request will hold on the host, estimated from the header: within one request's limit (past it,
    what would fit), then held from the budget the requests in flight share."""
    model, limit = ticket.model, ticket.model.limits.max_request_host_bytes
    ticket.host = footprint.host_estimate(ticket.request, model, ticket.opened, ticket.jobs, ticket.passes)
    try:
        if ticket.host.total > limit:
            admit_host(ticket.host, limit_bytes=limit, instead=would_fit(ticket))
        model.host_budget.take(ticket.host)
    except ScoringError as error:
        return error
    ticket.held_bytes = ticket.host.total
    return None


def would_fit(ticket: Ticket) -> str:
    """What the refused request could ask for instead, in its own words."""
    found = footprint.what_fits(ticket.request, ticket.model, ticket.opened, ticket.jobs or None, ticket.passes)
    if not found:
        return "no smaller scale, coarser stride or lighter maps of this image fits"
    return "it would fit with " + "; or ".join(found)


# The measured order: the cheap checks of the fields first, then the queue's room and expected wait,
# then the header, then what the header tells (the canvas of every scale, the response's size, memory).
CHECKS: tuple[Callable[[Ticket], ScoringError | None], ...] = (
    check_scales, check_fields, choose_passes, check_image_field, hold_places, read_header, fit_scales,
    hold_tile_places, check_response_size, check_host_memory,
)


def admit(request: scoring_pb2.ScoreRequest, model: Model, *, engine: EngineClient,
          deadline: float | None) -> Ticket:
    """The request checked whole before any pixel is decoded, or the first check's refusal; the ticket
    holds its queue places and host bytes until released (`with admit(...) as ticket:`)."""
    ticket = Ticket(request, model, engine, deadline)
    try:
        for check in CHECKS:
            refused = check(ticket)
            if refused is not None:
                raise refused
    except BaseException:
        ticket.release()
        raise
    return ticket
