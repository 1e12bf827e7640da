import numpy as np
import pytest

from clients.api.results import decode_tensor, result_from_response
from protos import scoring_pb2


def tensor(array: np.ndarray) -> scoring_pb2.Tensor:
    return scoring_pb2.Tensor(dtype=str(array.dtype), shape=list(array.shape), data=array.astype(array.dtype.newbyteorder("<")).tobytes())


def response() -> scoring_pb2.ScoreResponse:
    scores = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4) / 24
    return scoring_pb2.ScoreResponse(
        model="m", image_height=96, image_width=128, output_stride=32, shift=scoring_pb2.SHIFT_NONE,
        top_k=[scoring_pb2.Label(index=1, label="b", probability=0.75), scoring_pb2.Label(index=0, label="a", probability=0.25)],
        maps=[scoring_pb2.ScaleMap(
            scale=96, scores=tensor(scores), classes=[0, 1], height=3, width=4,
            geometry=scoring_pb2.MapGeometry(stride_y=32, stride_x=32, center_y=16, center_x=16,
                                             box_height=64, box_width=64, scale_factor=1,
                                             resized_height=96, resized_width=128))],
        timings=scoring_pb2.Timings(total_ms=3.5),
    )


def test_response_decodes_to_numpy_maps_and_geometry():
    result = result_from_response(response())
    assert result.top_k[0] == ("b", 1, 0.75)
    assert result.top_k[0].label == "b" and result.top_k[1].index == 0
    scale = result.maps[0]
    assert scale.scores.shape == (2, 3, 4) and scale.scores.dtype == np.float32
    np.testing.assert_array_equal(scale.class_map(1), np.arange(12, 24, dtype=np.float32).reshape(3, 4) / 24)
    assert scale.geometry.cell_center(2, 3) == (16 + 64, 16 + 96)
    assert scale.geometry.cell_box(0, 0) == (-16, -16, 48, 48)
    assert result.shift == "SHIFT_NONE" and result.timings["total"] == 3.5
    record = result.to_record()
    assert record["maps"][0]["cells"] == [3, 4] and record["top_k"][0]["label"] == "b"
    assert set(result.map_arrays()) == {"scores_96", "classes_96"}


def test_a_record_without_maps_still_has_the_map_cells():
    without_maps = response()
    del without_maps.maps[0].classes[:]
    without_maps.maps[0].ClearField("scores")
    record = result_from_response(without_maps).to_record()
    assert record["maps"][0]["cells"] == [3, 4] and "shape" not in record["maps"][0]


def test_float16_and_int32_tensors_decode():
    half = np.array([[1.5, -2.0]], np.float16)
    assert np.array_equal(decode_tensor(tensor(half)), half)
    ints = np.array([3, 1, 2], np.int32)
    assert np.array_equal(decode_tensor(tensor(ints)), ints)
    assert decode_tensor(scoring_pb2.Tensor()) is None


def test_a_truncated_tensor_is_refused():
    bad = scoring_pb2.Tensor(dtype="float32", shape=[2, 2], data=b"\0" * 12)
    with pytest.raises(ValueError, match="has 12 bytes; expected 16"):
        decode_tensor(bad)


def test_a_response_with_non_finite_values_is_never_a_success():
    import grpc

    from clients.api.errors import ScoremapError
    nan_top = response()
    nan_top.top_k[0].probability = float("nan")
    with pytest.raises(ScoremapError, match=r"probability nan for class 1 \('b'\)") as refused:
        result_from_response(nan_top)
    assert refused.value.code == grpc.StatusCode.INTERNAL and "--retry-failed" in refused.value.message
    nan_map = response()
    values = np.zeros((2, 3, 4), np.float32)
    values[0, 1, 1] = np.nan
    nan_map.maps[0].scores.CopyFrom(tensor(values))
    with pytest.raises(ScoremapError, match="1 non-finite scores in the map at scale 96"):
        result_from_response(nan_map)
    nan_map.shift = scoring_pb2.SHIFT_DIAGONAL  # the lattice cells no pass scored are NaN by contract
    assert np.isnan(result_from_response(nan_map).maps[0].scores).sum() == 1


def test_warnings_are_recorded_and_counted():
    from clients.batch.run import BatchSummary
    warned = response()
    warned.warnings.append("the image (10x10) is far below the training size 224: enlarged 22x")
    record = {"key": "k", "path": "/p/x.png", "status": "OK", **result_from_response(warned).to_record()}
    assert record["warnings"] == ["the image (10x10) is far below the training size 224: enlarged 22x"]
    summary = BatchSummary()
    summary.add(record)
    summary.add({**record, "key": "k2", "path": "/p/y.png",
                 "warnings": ["the image (12x9) is far below the training size 224: enlarged 25x"]})
    assert summary.scored == 2 and summary.warned == 2
    [kind] = summary.warnings.values()  # one kind of warning, with its first example
    assert kind.count == 2 and kind.example_path == "/p/x.png"
    assert summary.to_dict()["warnings"][0]["count"] == 2
