import numpy as np
import pytest

from protos.scoring_pb2 import Shift
from server import dense


def test_plan_native_stride_is_one_pass():
    plan = dense.plan_passes(native_stride=32, output_stride=0, shift=Shift.SHIFT_UNSPECIFIED)
    assert (plan.stride, plan.factor, plan.shift, plan.offsets) == (32, 1, Shift.SHIFT_NONE, ((0, 0),))


def test_plan_half_stride_defaults_to_the_full_grid():
    plan = dense.plan_passes(native_stride=32, output_stride=16, shift=Shift.SHIFT_UNSPECIFIED)
    assert plan.shift == Shift.SHIFT_GRID and sorted(plan.offsets) == [(0, 0), (0, 16), (16, 0), (16, 16)]
    diagonal = dense.plan_passes(native_stride=32, output_stride=16, shift=Shift.SHIFT_DIAGONAL)
    assert diagonal.offsets == ((0, 0), (16, 16))


def test_plan_atrous_model_is_one_pass_at_its_own_stride():
    plan = dense.plan_passes(native_stride=16, output_stride=16, shift=Shift.SHIFT_UNSPECIFIED)
    assert (plan.shift, plan.offsets) == (Shift.SHIFT_ATROUS, ((0, 0),))


@pytest.mark.parametrize("native, stride, shift, words", [
    (32, 8, Shift.SHIFT_UNSPECIFIED, "use 0, 32 or 16"),
    (32, 16, Shift.SHIFT_ATROUS, "--output-stride 16"),
    (32, 32, Shift.SHIFT_ATROUS, "--output-stride 16"),
    (32, 32, Shift.SHIFT_GRID, "needs output_stride 16"),
    (16, 32, Shift.SHIFT_UNSPECIFIED, "use 0, 16 or 8"),
])
def test_plan_refuses_what_the_model_cannot_do(native, stride, shift, words):
    with pytest.raises(dense.PlanError, match=words):
        dense.plan_passes(native_stride=native, output_stride=stride, shift=shift)


def test_resized_size_keeps_aspect_and_rounds_to_the_multiple():
    assert dense.resized_size(480, 640, scale=384, multiple=32) == (384, 512)
    assert dense.resized_size(1000, 333, scale=224, multiple=32) == (672, 224)
    assert dense.resized_size(10, 10, scale=40, multiple=32) == (32, 32)
    assert dense.resized_size(100, 150, scale=50, multiple=0) == (50, 75)


def test_shifted_passes_are_windows_of_the_edge_padded_image():
    image = np.arange(64 * 64 * 3, dtype=np.float32).reshape(64, 64, 3)
    plan = dense.plan_passes(native_stride=32, output_stride=16, shift=Shift.SHIFT_GRID)
    windows = dense.pass_images(image, plan, flip=False)
    assert all(w.shape == image.shape for w in windows)
    by_offset = dict(zip(plan.offsets, windows))
    np.testing.assert_array_equal(by_offset[(16, 16)][:48, :48], image[16:, 16:])
    np.testing.assert_array_equal(by_offset[(0, 16)][:, 48:], np.repeat(image[:, 63:64], 16, axis=1))
    mirrored = dict(zip(plan.offsets, dense.pass_images(image, plan, flip=True)))
    np.testing.assert_array_equal(mirrored[(0, 16)][:, 16:], image[:, ::-1][:, :48])


def test_interleave_places_each_pass_on_its_lattice_sites():
    plan = dense.plan_passes(native_stride=32, output_stride=16, shift=Shift.SHIFT_GRID)
    maps = [np.full((1, 2, 3), 10 * dy + dx, dtype=np.float32) for dy, dx in plan.offsets]
    lattice = dense.interleave(maps, plan, flip=False)
    assert lattice.shape == (1, 4, 6)
    np.testing.assert_array_equal(lattice[0, :2, :2], [[0, 16], [160, 176]])


def test_diagonal_is_a_quincunx_with_nan_holes():
    plan = dense.plan_passes(native_stride=32, output_stride=16, shift=Shift.SHIFT_DIAGONAL)
    lattice = dense.interleave([np.ones((2, 3, 3), np.float32), 2 * np.ones((2, 3, 3), np.float32)], plan, flip=False)
    assert np.isnan(lattice[:, 0::2, 1::2]).all() and np.isnan(lattice[:, 1::2, 0::2]).all()
    assert (lattice[:, 0::2, 0::2] == 1).all() and (lattice[:, 1::2, 1::2] == 2).all()
    probabilities = dense.mean_probabilities(lattice, logits=True)
    np.testing.assert_allclose(probabilities, [0.5, 0.5], atol=1e-6)
    indices, scores = dense.cell_top_k(lattice, 1)
    assert (indices[:, 0::2, 1::2] == -1).all() and np.isnan(scores[:, 0::2, 1::2]).all()


def test_mean_probabilities_softmaxes_logits_per_cell_then_averages():
    lattice = np.zeros((2, 1, 2), dtype=np.float32)
    lattice[0, 0, 0] = np.log(3.0)  # cell 0: [0.75, 0.25]; cell 1: [0.5, 0.5]
    np.testing.assert_allclose(dense.mean_probabilities(lattice, logits=True), [0.625, 0.375], rtol=1e-6)
    np.testing.assert_allclose(dense.mean_probabilities(lattice, logits=False), [np.log(3.0) / 2, 0.0], rtol=1e-6)


def test_cell_and_image_top_k():
    lattice = np.array([[[1.0, 5.0]], [[3.0, 2.0]], [[2.0, 9.0]]], dtype=np.float32)
    indices, scores = dense.cell_top_k(lattice, 2)
    np.testing.assert_array_equal(indices[:, 0, 0], [1, 2])
    np.testing.assert_array_equal(scores[:, 0, 1], [9.0, 5.0])
    assert dense.top_k(np.array([0.1, 0.7, 0.2]), 5) == [(1, 0.7), (2, 0.2), (0, 0.1)]


def test_geometry_maps_the_lattice_back_to_original_pixels():
    geometry = dense.cell_geometry(original=(240, 320), resized=(384, 512), stride=16,
                                   field_size=32, field_center=(15.5, 15.5))
    assert geometry.scale_factor == pytest.approx(1.6)
    assert geometry.stride_y == pytest.approx(10.0) and geometry.stride_x == pytest.approx(10.0)
    assert geometry.center_y == pytest.approx(16 / 1.6 - 0.5)
    assert geometry.box_width == pytest.approx(20.0)


def test_mirrored_maps_are_aligned_by_the_receptive_field_offset():
    assert dense.mirror_shift(resized_width=128, center_x=15.5, native_stride=32, pass_width=4, stride=32) == 0
    # 'SAME' padding at the end only: one more cell, centres still at 15.5 + 32 j.
    assert dense.mirror_shift(resized_width=128, center_x=15.5, native_stride=32, pass_width=5, stride=32) == -1
    assert dense.mirror_shift(resized_width=128, center_x=15.5, native_stride=32, pass_width=5, stride=16) == -2
    lattice = np.arange(4, dtype=np.float32).reshape(1, 1, 4)
    np.testing.assert_array_equal(dense.align(lattice, -1), [[[1, 2, 3, np.nan]]])
    np.testing.assert_array_equal(dense.align(lattice, 2), [[[np.nan, np.nan, 0, 1]]])
    averaged = dense.average_flips([lattice, dense.align(lattice, -1)])
    np.testing.assert_array_equal(averaged, [[[0.5, 1.5, 2.5, 3]]])
