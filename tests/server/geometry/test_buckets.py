"""server/geometry/buckets.py alone: which canvas and batch bucket a shape gets, and the default buckets."""

import pytest

from server.geometry.buckets import (BATCH_BUCKETS, COMMON_ASPECTS, Buckets, batch_buckets, default_buckets,
                            on_demand_canvas)
from server.geometry.dense import resized_size


def test_the_smallest_canvas_that_holds_the_image_and_its_slack():
    buckets = Buckets(canvases=((384, 384), (384, 512), (416, 416), (512, 384), (1024, 1024)), batches=(1,))
    assert buckets.canvas_for(384, 384, slack=0) == (384, 384)  # an exact fit
    assert buckets.canvas_for(384, 384, slack=16) == (416, 416)  # the shifted passes need 16 px more
    assert buckets.canvas_for(300, 500, slack=0) == (384, 512)  # wide: the tall canvas cannot hold it
    assert buckets.canvas_for(500, 300, slack=0) == (512, 384)
    assert buckets.canvas_for(385, 385, slack=0) == (416, 416)  # one pixel over: the next in area
    assert buckets.canvas_for(1000, 1000, slack=25) is None  # 1025 fits no canvas
    assert buckets.describe() == "384x384, 384x512, 416x416, 512x384, 1024x1024"


def test_equal_areas_are_chosen_by_size_so_the_answer_never_depends_on_the_order_given():
    first = Buckets(canvases=((512, 384), (384, 512), (600, 600)), batches=(1,))
    second = Buckets(canvases=((384, 512), (512, 384), (600, 600)), batches=(1,))
    assert first.canvas_for(300, 300, slack=0) == second.canvas_for(300, 300, slack=0) == (384, 512)


def test_a_batch_is_padded_up_to_the_next_bucket_and_never_beyond_the_largest():
    buckets = Buckets(canvases=((384, 384),), batches=(1, 2, 4, 8))
    assert [buckets.batch_for(count) for count in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert buckets.batch_for(20) == 8


@pytest.mark.parametrize("max_batch, expected", [
    (1, (1,)), (2, (1, 2)), (3, (1, 2, 3)), (8, (1, 2, 4, 8)), (12, (1, 2, 4, 8, 12)),
    (100, (*BATCH_BUCKETS, 100)),
])
def test_batch_buckets_are_powers_of_two_then_the_limit_itself(max_batch, expected):
    assert batch_buckets(max_batch) == expected


def test_an_on_demand_canvas_is_the_image_and_its_slack_rounded_up_to_the_multiple():
    assert on_demand_canvas(384, 576, slack=16, multiple=32) == (416, 608)
    assert on_demand_canvas(385, 577, slack=0, multiple=32) == (416, 608)
    assert on_demand_canvas(384, 576, slack=0, multiple=32) == (384, 576)
    assert on_demand_canvas(7, 9, slack=0, multiple=0) == (7, 9)  # no multiple: the size itself


def test_default_buckets_hold_every_common_aspect_at_every_scale_with_and_without_slack():
    scales, slacks, multiple = (224, 384), (0, 16), 32
    buckets = default_buckets(scales=scales, slacks=slacks, multiple=multiple, max_batch=8)
    assert buckets.batches == (1, 2, 4, 8)
    assert list(buckets.canvases) == sorted(set(buckets.canvases))  # sorted, no duplicates
    assert all(h % multiple == 0 and w % multiple == 0 for h, w in buckets.canvases)
    for scale in scales:
        for tall, wide in COMMON_ASPECTS:
            size = resized_size(tall * 1000, wide * 1000, scale=scale, multiple=multiple)
            for slack in slacks:
                canvas = buckets.canvas_for(*size, slack=slack)
                # held with no more padding than the on-demand canvas for that shape would have
                assert canvas == on_demand_canvas(*size, slack=slack, multiple=multiple), (scale, tall, wide, slack)
    assert buckets.canvas_for(384, 384, slack=0) == (384, 384)
    assert buckets.canvas_for(384, 384, slack=16) == (416, 416)
    assert buckets.canvas_for(2000, 2000, slack=0) is None  # beyond every served scale


def test_default_buckets_with_one_aspect_and_no_slack_are_one_square_per_scale():
    buckets = default_buckets(scales=(384, 224), slacks=(0,), multiple=32, max_batch=1, aspects=((1, 1),))
    assert buckets == Buckets(canvases=((224, 224), (384, 384)), batches=(1,))


def test_every_step_buckets_hold_each_image_from_1_1_to_2_1_with_no_padding():
    """The CPU's buckets: any photo between 1:1 and 2:1 either way runs on a canvas of its own resized size
    (448x384 padded to 512x384 costs 1.19x bare onnxruntime), and beyond 2:1 none holds it."""
    multiple = 32
    buckets = default_buckets(scales=(384,), slacks=(0, 16), multiple=multiple, max_batch=1, every_step=True)
    for height in range(384, 2 * 384 + 1):
        for size in ((height, 384), (384, height)):
            resized = resized_size(*size, scale=384, multiple=multiple)
            for slack in (0, 16):
                assert buckets.canvas_for(*resized, slack=slack) == on_demand_canvas(*resized, slack=slack,
                                                                                     multiple=multiple), (size, slack)
    assert buckets.canvas_for(384, 832, slack=0) is None  # beyond 2:1 and its slack: planned on demand
    assert len(buckets.canvases) == 2 * (2 * 13 - 1)  # 13 long sides either way, the square once, two slacks
    coarse = default_buckets(scales=(384,), slacks=(0,), multiple=multiple, max_batch=1)
    assert coarse.canvas_for(448, 384, slack=0) == (512, 384)  # the GPU's common aspects pad it


def test_cpu_batches_fill_their_buckets_exactly_and_take_the_cheapest_measured():
    """On the CPU a padded slot costs a whole image, and a larger batch need not cost less per item,
    nor be worth the wait its items share."""
    batches = Buckets(((64, 64),), (1, 2, 4, 8))
    assert batches.cheapest_batches(7, lambda size: None) == [4, 2, 1]  # nothing measured: the largest that fit
    assert batches.cheapest_batches(5, {1: 1.0, 2: 0.5}.get) == [4, 1]  # batch 4 not yet measured: it runs
    assert batches.cheapest_batches(7, {1: 1.0, 2: 0.85, 4: 1.2, 8: 2.0}.get) == [2, 2, 2, 1]
    assert batches.cheapest_batches(8, {1: 1.0, 2: 1.1, 4: 1.3, 8: 1.5}.get) == [1] * 8
    assert batches.cheapest_batches(8, {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}.get) == [1] * 8  # a tie: the smaller
    # each doubling must save more than BATCH_DELAY_CHARGE (0.1) of the time per item, since its items end together
    assert batches.cheapest_batches(2, {1: 1.0, 2: 0.95}.get) == [1, 1]
    assert batches.cheapest_batches(2, {1: 1.0, 2: 0.905}.get) == [1, 1]  # 9.5% saved: not enough
    assert batches.cheapest_batches(2, {1: 1.0, 2: 0.89}.get) == [2]
    assert batches.cheapest_batches(8, {1: 1.0, 2: 0.95, 4: 0.85, 8: 0.5}.get) == [8]
    assert batches.cheapest_batches(2, {2: 1.0}.get) == [2]  # an unmeasured smaller bucket is not tried (no new plan)
