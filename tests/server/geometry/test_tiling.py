"""The tile planner on its own: every map cell owned once, tiles on the lattice, edges on the image's edges."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protos.scoring_pb2 import Shift
from server.geometry import dense, tiling

PASSES = {
    "none": dense.passes_for(native_stride=32, output_stride=32, shift=Shift.SHIFT_NONE),
    "grid": dense.passes_for(native_stride=32, output_stride=16, shift=Shift.SHIFT_GRID),
    "diagonal": dense.passes_for(native_stride=32, output_stride=16, shift=Shift.SHIFT_DIAGONAL),
    "atrous": dense.passes_for(native_stride=16, output_stride=16, shift=Shift.SHIFT_ATROUS),
}


def padded_cells(length: int, passes: dense.Passes) -> int:
    """A 'same'-padded net's map: one cell per started net stride, times the pass factor."""
    return passes.factor * math.ceil(length / (passes.stride * passes.factor))


@settings(max_examples=300, deadline=None)
@given(
    height=st.integers(32, 3000), width=st.integers(32, 3000), tile=st.integers(4, 40),
    scheme=st.sampled_from(sorted(PASSES)), field=st.integers(1, 400), halo_share=st.floats(0, 1.2),
)
def test_every_cell_is_owned_by_exactly_one_tile(height, width, tile, scheme, field, halo_share):
    passes = PASSES[scheme]
    net = passes.stride * passes.factor
    halo = int(tiling.exact_halo(field) * halo_share)
    canvas = (tile * net, tile * net)
    try:  # a 'same'-padded net: cell n of a pass centred at (net - 1) / 2 + net * n
        plan = tiling.plan((height, width), canvas, field_size=field, field_center=((net - 1) / 2,) * 2,
                           training=(net, net), passes=passes, halo=halo)
    except tiling.TilingError as error:
        assert "use tiles of at least" in str(error)
        return
    counts = np.zeros(plan.map_cells((padded_cells(plan.rows[-1].length, passes),
                                      padded_cells(plan.columns[-1].length, passes))), dtype=int)
    assert counts.shape == (padded_cells(height, passes), padded_cells(width, passes))
    for tile_ in plan:
        cells = (padded_cells(tile_.y.length, passes), padded_cells(tile_.x.length, passes))
        rows, columns = tile_.owned(cells)
        assert 0 <= rows.start <= rows.stop <= cells[0] and 0 <= columns.start <= columns.stop <= cells[1]
        counts[tile_.placed(cells)] += 1
    assert (counts == 1).all()
    assert plan.exact == (halo >= tiling.exact_halo(field))


@settings(max_examples=300, deadline=None)
@given(length=st.integers(1, 5000), tile=st.integers(4, 40), scheme=st.sampled_from(sorted(PASSES)),
       field=st.integers(1, 300))
def test_tiles_sit_on_the_lattice_and_their_edges_on_the_image_or_a_halo_away(length, tile, scheme, field):
    passes = PASSES[scheme]
    net = passes.stride * passes.factor
    halo = tiling.exact_halo(field)
    lattice = tiling.Lattice.of(field_center=(field - 1) / 2, passes=passes, training=field)
    extent = tile * net - lattice.fill(length)
    try:
        spans = tiling.plan_axis(length, extent=extent, halo=halo, lattice=lattice)
    except tiling.TilingError:
        return
    assert spans[0].start == 0 and spans[-1].stop == length
    for span in spans:
        assert span.start % net == 0, "a tile starts on the net's stride"
        assert (length - span.stop) % net == 0, "its mirror starts on the mirrored image's lattice"
        assert 0 < span.length <= extent
        begin, end = span.owned
        if span.start > 0:  # an owned cell's field stays inside the tile unless the tile is on the image edge
            assert lattice.first + lattice.stride * begin - halo >= span.start
        if end is not None and span.stop < length:
            assert lattice.first + lattice.stride * (end - 1) + halo <= span.stop - 1 + 1e-9
    assert len(spans) == 1 or all(a.owned[1] == b.owned[0] for a, b in zip(spans, spans[1:]))


def test_ragged_last_tile_reads_a_full_tile_ending_on_the_image_edge():
    plan = tiling.plan((1000, 700), (512, 512), field_size=65, field_center=(15.5, 15.5),
                       training=(32, 32), passes=PASSES["none"])
    extent = 512 - plan.lattices[0].fill(1000)
    assert plan.rows[0] == tiling.Span(0, extent, 0, (0, plan.rows[1].owned[0]))
    assert all(span.length == extent for span in plan.rows) and plan.rows[-1].stop == 1000
    assert plan.columns[-1].stop == 700 and plan.exact and plan.halo == 32
    assert "halo 32 px (exact)" in plan.describe()


def test_a_canvas_too_small_for_the_halo_says_the_least_that_works():
    with pytest.raises(tiling.TilingError, match=r"use tiles of at least 1129 px \(a canvas of at least 1152 px\)"):
        tiling.plan((4000, 4000), (1024, 1024), field_size=1043, field_center=(15.5, 15.5),
                       training=(32, 32), passes=PASSES["none"])


def test_an_image_that_fits_is_one_tile_owning_everything():
    plan = tiling.plan((300, 200), (512, 512), field_size=1043, field_center=(15.5, 15.5),
                       training=(32, 32), passes=PASSES["grid"])
    assert len(plan) == 1 and next(iter(plan)).owned((40, 26)) == (slice(0, 40), slice(0, 26))


def test_stitching_refuses_a_tile_map_without_its_owned_cells():
    plan = tiling.plan((2000, 64), (512, 512), field_size=101, field_center=(50.0, 50.0),
                       training=(101, 101), passes=PASSES["none"], halo=0)
    middle = [t for t in plan if 0 < t.row < len(plan.rows) - 1][0]
    with pytest.raises(tiling.TilingError, match="use the exact halo"):
        tiling.stitch_into(np.zeros((1, 64, 2)), middle, np.zeros((1, 2, 2)))
