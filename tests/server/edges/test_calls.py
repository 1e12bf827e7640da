"""server/edges/calls.py alone: the rules of one call that both edges follow, whatever the transport."""

import pytest

from server.edges.calls import CallSlots, Token, resend_key
from server.errors import Refusal, ScoringError


class FreedCount:
    """The one thing a place tells the refusal pace: that it was given back for a resend to take."""

    def __init__(self) -> None:
        self.count = 0

    def freed(self) -> None:
        self.count += 1


@pytest.mark.parametrize("received", ["Bearer s3cret", b"Bearer s3cret"])
def test_the_token_is_accepted_as_grpc_metadata_or_an_http_header_gives_it(received):
    Token("s3cret").check(received)


@pytest.mark.parametrize("received", [None, "", "s3cret", "Bearer other", "bearer s3cret", b"Bearer s3cret "])
def test_a_missing_or_wrong_token_is_unauthenticated_saying_how_to_send_it(received):
    with pytest.raises(ScoringError, match=r"send `authorization: Bearer <token>`") as caught:
        Token("s3cret").check(received)
    assert caught.value.refusal is Refusal.UNAUTHENTICATED and caught.value.retry_after_seconds is None


def test_a_full_house_and_a_busy_address_are_refused_transiently_naming_their_flags():
    slots = CallSlots(total=2, per_peer=1, pacer=FreedCount())
    first = slots.take("10.0.0.1")
    with pytest.raises(ScoringError, match="--max-calls-per-peer") as busy_address:
        slots.take("10.0.0.1")
    second = slots.take("10.0.0.2")
    with pytest.raises(ScoringError, match="--grpc-workers less --reserved-workers") as full:
        slots.take("10.0.0.3")
    for caught in (busy_address, full):
        assert caught.value.refusal is Refusal.RESOURCE_EXHAUSTED and caught.value.retry_after_seconds > 0
    first.leave()
    second.leave()
    slots.take("10.0.0.1")


def test_a_place_is_given_back_once_and_offered_to_a_resend_unless_refused():
    pacer = FreedCount()
    slots = CallSlots(total=1, per_peer=0, pacer=pacer)
    place = slots.take("peer")
    place.leave()
    place.leave()  # a second leave gives nothing back twice
    assert pacer.count == 1
    held = slots.take("peer")  # the one place is free again, and only one
    with pytest.raises(ScoringError):
        slots.take("peer")
    held.leave(refused=True)  # a transient refusal waits out of its place, and frees none for a resend
    assert pacer.count == 1
    slots.take("peer")


def test_a_resend_is_recognised_by_its_method_and_bytes():
    assert resend_key("Score", b"image") == resend_key("Score", b"image")
    assert resend_key("Score", b"image") != resend_key("Score", b"other")
    assert resend_key("Score", b"image") != resend_key("ModelInfer", b"image")
    assert resend_key("Score", "/v1/models/m/score", "scales=64", b"image") != \
        resend_key("Score", "/v1/models/m/score", "scales=96", b"image")
