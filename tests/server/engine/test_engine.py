import grpc
import numpy as np
import onnx
import onnxruntime
import pytest

from server.engine.providers import CPU, CUDA, Engine, EngineError, choose_providers
from server.settings import GPU_DEFAULT_MAX_BATCH, Settings
from tests.tiny_models import tolerance


def test_cuda_is_chosen_when_it_can_load():
    choice = choose_providers((CUDA, CPU), cuda_device=True)
    assert choice.providers == (CUDA, CPU)


@pytest.mark.parametrize("available, device, words", [
    ((CUDA, CPU), False, "no CUDA device"),
    ((CPU,), True, "has no CUDAExecutionProvider"),
])
def test_cpu_fallback_says_why(available, device, words):
    choice = choose_providers(available, cuda_device=device)
    assert choice.providers == (CPU,) and words in choice.reason


def test_require_gpu_refuses_without_cuda():
    with pytest.raises(EngineError, match="a GPU is required but no CUDA device"):
        choose_providers((CUDA, CPU), cuda_device=False, require_gpu=True)
    with pytest.raises(EngineError, match="GPU is required"):
        choose_providers((CPU,), cuda_device=True, provider="cuda")


def test_cpu_can_be_forced():
    assert choose_providers((CUDA, CPU), cuda_device=True, provider="cpu").providers == (CPU,)


def test_engine_reports_what_its_sessions_really_run_on(tiny_model_path):
    engine = Engine(Settings(intra_op_threads=1))
    session = engine.session(onnx.load(tiny_model_path).SerializeToString())
    assert engine.provider == session.get_providers()[0]
    batch = np.random.default_rng(0).normal(size=(2, 3, 64, 96)).astype(np.float32)
    direct = onnxruntime.InferenceSession(tiny_model_path, providers=[CPU]).run(None, {"image": batch})[0]
    np.testing.assert_allclose(session.run(None, {"image": batch})[0], direct, **tolerance(engine.provider))


def test_require_gpu_refuses_to_start_on_this_machine_without_cuda(tiny_model_path):
    from server.engine.providers import cuda_device_present
    from server.errors import ScoringError
    from server.scoring.pipeline import Pipeline

    if cuda_device_present():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(EngineError, match="a GPU is required"):
        Engine(Settings(require_gpu=True))
    with pytest.raises(ScoringError, match="a GPU is required") as caught:
        Pipeline([tiny_model_path], settings=Settings(require_gpu=True, warm_up=False))
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_max_batch_defaults_to_batching_on_gpu_only_and_obeys_an_explicit_setting():
    assert Settings().max_batch_for(on_gpu=True) == GPU_DEFAULT_MAX_BATCH > 1
    assert Settings().max_batch_for(on_gpu=False) == 1
    assert Settings(max_batch=3).max_batch_for(on_gpu=False) == 3
    assert Settings(max_batch=1).max_batch_for(on_gpu=True) == 1


def test_a_model_s_cpu_sessions_hold_its_optimized_weights_once():
    """Sessions of one model's plan graphs at four shapes, made on one SharedWeights: the same outputs as a session
    of the graph itself, the weights' bytes held once, and each further session adds its own state only (before
    issue 33 each kept its own reordered copy, 17.7 MiB per plan of the default model)."""
    from convert.card import read_card
    from server.engine.device_graph import PIXELS, VALID, build_plan_graph
    from server.engine.shared_weights import SharedWeights
    from server.memory.runtime import configure_allocator, release_free_memory, resident_bytes
    from tests.tiny_models import heavy_net

    configure_allocator()
    net = heavy_net(width=256)  # 9.4 MiB of weights, small activations at these sizes
    card = read_card(net)
    weights_bytes = sum(np.prod(tensor.dims) * 4 for tensor in net.graph.initializer)
    engine = Engine(Settings(provider="cpu", intra_op_threads=1))
    shared = SharedWeights()
    graphs = [build_plan_graph(net, card, batch=1, height=height, width=width, offsets=((0, 0),), factor=1,
                               stride=card.output_stride).SerializeToString()
              for height, width in ((64, 64), (64, 96), (96, 64), (96, 96))]
    sessions = [engine.session(graphs[0], weights=shared)]
    held = shared.bytes  # reordered for onnxruntime's NCHWc kernels: the 4-class head padded to their block
    assert held > 0.95 * weights_bytes
    release_free_memory()
    before = resident_bytes()
    sessions += [engine.session(graph, weights=shared) for graph in graphs[1:]]
    release_free_memory()
    grown = resident_bytes() - before
    assert shared.bytes == held  # no second copy of any of them
    assert grown < 0.25 * held * (len(graphs) - 1), grown
    for graph, session in zip(graphs, sessions):
        plain = onnxruntime.InferenceSession(graph, providers=[CPU])
        valid_shape = next(value.shape for value in plain.get_inputs() if value.name == VALID)
        height, width = next(value.shape for value in plain.get_inputs() if value.name == PIXELS)[1:3]
        feeds = {PIXELS: np.random.default_rng(height).integers(0, 256, (1, height, width, 3), dtype=np.uint8),
                 VALID: np.ones(valid_shape, np.float32)}
        for served, expected in zip(session.run(None, feeds), plain.run(None, feeds)):
            np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-6)


def test_a_cpu_session_keeps_the_shared_weights_it_runs_on_alive(tiny_model_path):
    """onnxruntime does not keep the values handed to add_initializer alive: a session must, or it reads freed
    memory once its model's SharedWeights is gone (a segmentation fault, seen)."""
    import gc

    from server.engine.shared_weights import SharedWeights

    engine = Engine(Settings(provider="cpu", intra_op_threads=1))
    session = engine.session(onnx.load(tiny_model_path).SerializeToString(), weights=SharedWeights())
    gc.collect()
    batch = np.random.default_rng(1).normal(size=(1, 3, 64, 64)).astype(np.float32)
    direct = onnxruntime.InferenceSession(tiny_model_path, providers=[CPU]).run(None, {"image": batch})[0]
    for _ in range(3):
        np.testing.assert_allclose(session.run(None, {"image": batch})[0], direct, rtol=1e-5, atol=1e-6)
