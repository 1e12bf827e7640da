"""Memory admission with convert.profile's prediction: batches cut to fit, impossible requests refused."""

import grpc
import numpy as np
import pytest

from convert.profile import largest_batch, profile_model
from protos import scoring_pb2


def predicted(path: str, side: int, batch: int = 1) -> int:
    return profile_model(path, height=side, width=side, batch=batch).predicted_peak_bytes


def test_oversized_request_is_refused_with_the_numbers(kit, tiny_model_path):
    budget = (predicted(tiny_model_path, 96) + predicted(tiny_model_path, 128)) // 2
    fits = max(side for side in range(32, 2049, 32) if predicted(tiny_model_path, side) <= budget)
    assert fits == 96
    pixels = np.zeros((64, 64, 3), dtype=np.uint8)
    with kit.serving([tiny_model_path], memory_budget_bytes=budget) as (_server, _port, stub):
        with pytest.raises(grpc.RpcError) as caught:
            stub.Score(kit.raw_request(pixels, scales=[64, 512]))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        details = caught.value.details()
        assert f"needs a predicted {predicted(tiny_model_path, 512)} bytes" in details
        assert f"the memory budget is {budget} bytes" in details
        assert "the largest scale that fits is 96" in details
        assert stub.Score(kit.raw_request(pixels, scales=[96])).maps  # what fits still runs


def test_batches_are_cut_to_what_fits(kit, tiny_model_path):
    budget = predicted(tiny_model_path, 64, batch=2)
    assert largest_batch(tiny_model_path, height=64, width=64, budget_bytes=budget) == 2
    pixels = np.zeros((64, 64, 3), dtype=np.uint8)
    with kit.serving([tiny_model_path], memory_budget_bytes=budget, metrics_port=0, max_batch=8,
                     max_queue_delay_ms=50) as (server, _port, stub):
        stub.Score(kit.raw_request(pixels, scales=[64], output_stride=16, flip=True))  # 8 passes of one shape
        registry = server.metrics.registry
        count = registry.get_sample_value("scoremap_batch_size_count", {"model": "tiny"})
        total = registry.get_sample_value("scoremap_batch_size_sum", {"model": "tiny"})
        largest = registry.get_sample_value("scoremap_batch_predicted_bytes_sum", {"model": "tiny"})
    assert total == 8 and count == 4  # four batches of two, never the eight at once
    assert largest == 4 * budget


def test_the_budget_is_split_between_models(tiny_model_path, coordinate_model_path):
    from server.pipeline import Pipeline
    from server.settings import Settings

    pipeline = Pipeline([tiny_model_path, coordinate_model_path],
                        settings=Settings(warm_up=False, intra_op_threads=1, memory_budget_bytes=10_000_001))
    try:
        assert [pipeline._model(name).admission.budget_bytes for name in ("tiny", "coords")] == [5_000_000] * 2
    finally:
        pipeline.close()


def test_a_model_file_removed_while_serving_changes_nothing(kit, tiny_model_path):
    """Admission and the batch metrics profile the graph loaded at start, not the file."""
    import os

    pixels = np.zeros((64, 64, 3), dtype=np.uint8)
    with kit.serving([tiny_model_path], metrics_port=0) as (server, _port, stub):
        assert stub.Score(kit.raw_request(pixels, scales=[64]), timeout=10).maps
        os.remove(tiny_model_path)
        for scale in (96, 128):  # sizes never profiled before the file went away
            assert stub.Score(kit.raw_request(pixels, scales=[scale]), timeout=10).maps
        count = server.metrics.registry.get_sample_value("scoremap_batch_predicted_bytes_count", {"model": "tiny"})
    assert count == 3


def test_each_admission_owns_its_cache(tiny_model_path):
    import gc
    import weakref

    import onnx

    from server.admission import Admission

    admission = Admission(onnx.load(tiny_model_path), budget_bytes=None)
    assert admission.predicted_bytes(64, 64) == predicted(tiny_model_path, 64)
    gone = weakref.ref(admission)
    del admission
    gc.collect()
    assert gone() is None  # no cache shared between instances keeps it alive


def test_admission_keeps_the_skeleton_not_the_weights(tiny_model_path):
    import onnx

    from server.admission import Admission

    model = onnx.load(tiny_model_path)
    heaviest = max(np.prod(init.dims) for init in model.graph.initializer)
    admission = Admission(model, budget_bytes=None)
    kept = [init for init in admission.model.model.graph.initializer if np.prod(init.dims) == heaviest]
    assert heaviest > 64 and not kept  # the 10x3x32x32 conv weights are not held a second time
    assert admission.predicted_bytes(96, 64) == profile_model(model, height=96, width=64).predicted_peak_bytes
