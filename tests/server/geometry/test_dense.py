import numpy as np
import pytest

from protos.scoring_pb2 import Shift
from server.geometry import dense


def test_plan_native_stride_is_one_pass():
    plan = dense.passes_for(native_stride=32, output_stride=0, shift=Shift.SHIFT_UNSPECIFIED)
    assert (plan.stride, plan.factor, plan.shift, plan.offsets) == (32, 1, Shift.SHIFT_NONE, ((0, 0),))


def test_plan_half_stride_defaults_to_the_full_grid():
    plan = dense.passes_for(native_stride=32, output_stride=16, shift=Shift.SHIFT_UNSPECIFIED)
    assert plan.shift == Shift.SHIFT_GRID and sorted(plan.offsets) == [(0, 0), (0, 16), (16, 0), (16, 16)]
    diagonal = dense.passes_for(native_stride=32, output_stride=16, shift=Shift.SHIFT_DIAGONAL)
    assert diagonal.offsets == ((0, 0), (16, 16))


def test_plan_atrous_model_is_one_pass_at_its_own_stride():
    plan = dense.passes_for(native_stride=16, output_stride=16, shift=Shift.SHIFT_UNSPECIFIED)
    assert (plan.shift, plan.offsets) == (Shift.SHIFT_ATROUS, ((0, 0),))


@pytest.mark.parametrize("native, stride, shift, words", [
    (32, 8, Shift.SHIFT_UNSPECIFIED, "use 0, 32 or 16"),
    (32, 16, Shift.SHIFT_ATROUS, "--output-stride 16"),
    (32, 32, Shift.SHIFT_ATROUS, "--output-stride 16"),
    (32, 32, Shift.SHIFT_GRID, "needs output_stride 16"),
    (16, 32, Shift.SHIFT_UNSPECIFIED, "use 0, 16 or 8"),
])
def test_plan_refuses_what_the_model_cannot_do(native, stride, shift, words):
    with pytest.raises(dense.PassesError, match=words):
        dense.passes_for(native_stride=native, output_stride=stride, shift=shift)


def test_resized_size_keeps_aspect_and_rounds_to_the_multiple():
    assert dense.resized_size(480, 640, scale=384, multiple=32) == (384, 512)
    assert dense.resized_size(1000, 333, scale=224, multiple=32) == (672, 224)
    assert dense.resized_size(10, 10, scale=40, multiple=32) == (32, 32)
    assert dense.resized_size(100, 150, scale=50, multiple=0) == (50, 75)


def test_unknown_shift_values_are_refused_with_the_allowed_names():
    with pytest.raises(dense.PassesError, match="shift 99 is not a Shift; use one of SHIFT_UNSPECIFIED, SHIFT_NONE"):
        dense.passes_for(native_stride=32, output_stride=0, shift=99)
    with pytest.raises(dense.PassesError, match="shift 99"):
        dense.passes_for(native_stride=32, output_stride=16, shift=99)


def test_shifted_passes_need_slack_on_the_canvas():
    grid = dense.passes_for(native_stride=32, output_stride=16, shift=Shift.SHIFT_GRID)
    single = dense.passes_for(native_stride=32, output_stride=0, shift=Shift.SHIFT_UNSPECIFIED)
    assert (grid.slack, single.slack) == (16, 0)


def test_the_canvas_holds_the_image_top_left_and_the_mean_colour_elsewhere():
    image = np.full((2, 3, 3), 7, dtype=np.uint8)
    fill = np.array([1, 2, 3], dtype=np.uint8)
    canvas = dense.canvas(image, (4, 4), fill)
    assert canvas.shape == (4, 4, 3)
    assert (canvas[:2, :3] == 7).all() and (canvas[2:] == fill).all() and (canvas[:2, 3] == fill).all()


def test_mirror_back_is_the_plain_mirror_when_the_field_is_centred():
    lattice = np.arange(4, dtype=np.float32).reshape(1, 1, 4)
    # 128 px, centres 15.5 + 32 j: symmetric.
    np.testing.assert_array_equal(
        dense.mirror_back(lattice, resized_width=128, first_center_x=15.5, stride=32), [[[3, 2, 1, 0]]])
    # One-sided 'SAME' padding, centres 0 + 32 j on 128 px: mirrored column n sits at x = 127 - 32 n,
    # unmirrored column n0 at 32 n0, so n0 = 4 - n (rounded): one column over.
    moved = dense.mirror_back(lattice, resized_width=128, first_center_x=0.0, stride=32)
    np.testing.assert_array_equal(moved, [[[np.nan, 3, 2, 1]]])
    averaged = dense.average_flips([lattice, moved])
    np.testing.assert_array_equal(averaged, [[[0, 2, 2, 2]]])


def test_averaging_flips_holds_one_lattice_and_a_byte_per_value_beside_them():
    """The host memory estimate counts the average as one float32 lattice; a stacked average would hold ~9
    lattices of a 1000-class map at once. NaN cells (holes) keep the other orientation's value, or stay NaN."""
    import tracemalloc

    rng = np.random.default_rng(0)
    first, second = (rng.normal(size=(100, 60, 70)).astype(np.float32) for _ in range(2))
    first[:, :, 0], second[:, :, -1], first[:, 3, 3], second[:, 3, 3] = np.nan, np.nan, np.nan, np.nan
    tracemalloc.start()
    try:
        averaged = dense.average_flips([first, second])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= 1.6 * first.nbytes
    np.testing.assert_array_equal(averaged[:, :, 0], second[:, :, 0])
    np.testing.assert_array_equal(averaged[:, :, -1], first[:, :, -1])
    assert np.isnan(averaged[:, 3, 3]).all() and averaged.dtype == np.float32
    np.testing.assert_allclose(averaged[:, 1:-1, 1:-1][:, 5:], ((first + second) / 2)[:, 1:-1, 1:-1][:, 5:])


def test_cell_and_image_top_k():
    lattice = np.array([[[1.0, 5.0]], [[3.0, 2.0]], [[2.0, 9.0]]], dtype=np.float32)
    indices, scores = dense.cell_top_k(lattice, 2)
    np.testing.assert_array_equal(indices[:, 0, 0], [1, 2])
    np.testing.assert_array_equal(scores[:, 0, 1], [9.0, 5.0])
    assert dense.top_k(np.array([0.1, 0.7, 0.2]), 5) == [(1, 0.7), (2, 0.2), (0, 0.1)]


def test_geometry_maps_the_lattice_back_to_original_pixels():
    geometry = dense.cell_geometry(original=(240, 320), resized=(384, 512), canvas=(384, 512), cells=(12, 16),
                                   stride=16, field_size=32, first_center=(15.5, 15.5))
    assert geometry.scale_factor == pytest.approx(1.6)
    assert geometry.stride_y == pytest.approx(10.0) and geometry.stride_x == pytest.approx(10.0)
    assert geometry.center_y == pytest.approx(16 / 1.6 - 0.5)
    assert geometry.box_width == pytest.approx(20.0)
    assert (geometry.padded_border_rows, geometry.padded_border_cols) == (0, 0)  # no canvas padding


def test_geometry_counts_the_border_cells_whose_field_reaches_into_the_canvas_padding():
    # Cells centred at 15.5 + 32 m with a 64-px field on a 128-px image padded to a 192-px canvas:
    # the last cell (centre 111.5) reaches 143.5 > 128.
    geometry = dense.cell_geometry(original=(128, 128), resized=(128, 128), canvas=(192, 128), cells=(4, 4),
                                   stride=32, field_size=64, first_center=(15.5, 15.5))
    assert (geometry.padded_border_rows, geometry.padded_border_cols) == (1, 0)


def test_top_k_agree_with_a_full_sort_and_mark_unscored_cells():
    rng = np.random.default_rng(0)
    lattice = rng.normal(size=(50, 3, 4)).astype(np.float32)
    lattice[:, 0, 0] = np.nan
    indices, scores = dense.cell_top_k(lattice, 5)
    full = np.argsort(-np.nan_to_num(lattice, nan=-np.inf), axis=0, kind="stable")[:5]
    np.testing.assert_array_equal(indices[:, 1:, :], full[:, 1:, :])
    assert (indices[:, 0, 0] == -1).all() and np.isnan(scores[:, 0, 0]).all()
    probabilities = rng.random(1000)
    assert [i for i, _ in dense.top_k(probabilities, 7)] == list(np.argsort(-probabilities)[:7])
