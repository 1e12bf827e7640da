import pathlib
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime
import pytest

from server.engine.providers import CPU, CUDA, Engine, EngineError, choose_providers, cuda_device_present
from server.errors import Refusal
from server.settings import GPU_DEFAULT_MAX_BATCH, Settings
from tests.tiny_models import assert_same_top_k, tolerance


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


def test_a_gpu_machine_on_the_cpu_says_why_and_how_to_install_cuda():
    """With the driver present but the CUDA 13 runtime and cuDNN 9 missing, the server says what is missing and
    how to install it, not only 'no CUDA device or CUDA runtime library was found' in an INFO line."""
    from convert.cuda import INSTALL_HINT

    detail = f"the NVIDIA driver is present but the CUDA runtime does not load: {INSTALL_HINT}"
    choice = choose_providers((CUDA, CPU), cuda_device=False, driver=True, detail=detail)
    assert choice.providers == (CPU,) and choice.surprising
    assert choice.reason == f"running on the CPU: no CUDA device or CUDA runtime library was found: {detail}"
    assert not choose_providers((CUDA, CPU), cuda_device=False).surprising  # no driver: the CPU is no surprise
    with pytest.raises(EngineError, match="pip install -e '.\\[gpu\\]'"):
        choose_providers((CUDA, CPU), cuda_device=False, require_gpu=True, driver=True, detail=detail)


def test_the_engine_warns_when_a_driver_is_present_but_cuda_does_not_load(monkeypatch, caplog):
    import server.engine.providers as providers

    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: [CUDA, CPU])
    monkeypatch.setattr(providers, "cuda_device_present", lambda: False)
    monkeypatch.setattr(providers, "driver_present", lambda: True)
    monkeypatch.setattr(providers, "why_no_cuda", lambda: "the CUDA runtime does not load (Failed to load libcudart.so.13)")
    with caplog.at_level("INFO", logger="server.engine.providers"):
        engine = Engine(Settings(intra_op_threads=1))
    assert engine.provider == CPU
    (record,) = [r for r in caplog.records if "running on the CPU" in r.message]
    assert record.levelname == "WARNING" and "Failed to load libcudart.so.13" in record.message


def test_a_session_that_falls_back_to_the_cpu_says_which_library_to_install(tiny_model_path, monkeypatch, caplog):
    """CUDA chosen, yet the session runs on the CPU (a CUDA or cuDNN library failed to load)."""
    import server.engine.providers as providers

    monkeypatch.setattr(providers, "preload_libraries", lambda: "Failed to load libcudnn.so.9")
    graph = onnx.load(tiny_model_path).SerializeToString()
    for require_gpu in (False, True):
        engine = Engine(Settings(intra_op_threads=1, require_gpu=False))
        engine.settings = Settings(intra_op_threads=1, require_gpu=require_gpu)
        engine.provider = CUDA  # as if chosen: the CPU-only sessions here stand for a CUDA one that fell back
        engine._providers = ["CPUExecutionProvider"]  # also on a machine where CUDA would load
        if require_gpu:
            with pytest.raises(EngineError, match="Failed to load libcudnn.so.9"):
                engine.session(graph)
            continue
        with caplog.at_level("WARNING", logger="server.engine.providers"):
            engine.session(graph)
        assert engine.provider == CPU
        assert "a CUDA or cuDNN library is missing (Failed to load libcudnn.so.9)" in caplog.text
        assert "print_debug_info" in caplog.text and "running on the CPU" in caplog.text


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


def test_tolerances_follow_the_provider_that_ran():
    """TF32 on an H200 puts the heavy net's -14.719 at -14.682; the CPU's float32 stays held to 1e-5."""
    expected = np.array([-14.719, 3.0, 0.5])
    got = np.array([-14.682, 3.0, 0.5])
    np.testing.assert_allclose(got, expected, **tolerance(CUDA, expected))
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(got, expected, **tolerance(CPU, expected))
    assert tolerance(CPU, expected) == tolerance(CPU) == {"rtol": 1e-5, "atol": 1e-4}

    class Label:
        def __init__(self, index, probability):
            self.index, self.probability = index, probability

    single = [Label(2, 0.30), Label(1, 0.20), Label(3, 0.1500), Label(0, 0.1498), Label(4, 0.1)]
    batched = [Label(2, 0.30), Label(1, 0.20), Label(0, 0.1499), Label(3, 0.1498), Label(4, 0.1)]
    assert_same_top_k(batched, single, CUDA)  # a near tie ranked the other way
    with pytest.raises(AssertionError, match="not a tie"):
        assert_same_top_k([single[1], single[0], *single[2:]], single, CUDA)


def test_require_gpu_refuses_to_start_on_this_machine_without_cuda(tiny_model_path):
    from server.errors import ScoringError
    from server.scoring.pipeline import Pipeline

    if cuda_device_present():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(EngineError, match="a GPU is required"):
        Engine(Settings(require_gpu=True))
    with pytest.raises(ScoringError, match="a GPU is required") as caught:
        Pipeline([tiny_model_path], settings=Settings(require_gpu=True, warm_up=False))
    assert caught.value.refusal is Refusal.FAILED_PRECONDITION


def test_max_batch_defaults_to_batching_on_gpu_only_and_obeys_an_explicit_setting():
    assert Settings().max_batch_for(on_gpu=True) == GPU_DEFAULT_MAX_BATCH > 1
    assert Settings().max_batch_for(on_gpu=False) == 1
    assert Settings(max_batch=3).max_batch_for(on_gpu=False) == 3
    assert Settings(max_batch=1).max_batch_for(on_gpu=True) == 1


def test_cpu_runners_run_on_one_thread_each_and_a_gpu_runs_one_batch_at_a_time():
    assert Settings().runners_for(on_gpu=False) == 1 and Settings().intra_op_threads_for(on_gpu=False) == 0
    assert Settings(cpu_runners=4).runners_for(on_gpu=False) == 4
    assert Settings(cpu_runners=4).intra_op_threads_for(on_gpu=False) == 1
    assert Settings(cpu_runners=4, intra_op_threads=2).intra_op_threads_for(on_gpu=False) == 2
    assert Settings(cpu_runners=4).runners_for(on_gpu=True) == 1
    assert Settings(cpu_runners=4).intra_op_threads_for(on_gpu=True) == 1
    assert Engine(Settings(provider="cpu", cpu_runners=4)).options().intra_op_num_threads == 1
    assert Engine(Settings(provider="cpu")).options().intra_op_num_threads == 0


def test_a_model_s_cpu_sessions_hold_its_optimized_weights_once():
    """Sessions of one model's plan graphs at four shapes, made on one SharedWeights: the same outputs as a session
    of the graph itself, the weights' bytes held once, and each further session adds its own state only (on its
    own, each would keep its own reordered copy, 17.7 MiB per plan of the default model)."""
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


@pytest.mark.skipif(not cuda_device_present(), reason="no CUDA device here: the schedule is the GPU's")
@pytest.mark.parametrize("sync, schedule", [("block", 4), ("spin", 1)])
def test_cuda_sync_sets_how_the_engine_s_thread_waits_for_the_gpu(sync, schedule):
    # In a process of its own: a context an earlier test made keeps its schedule in older CUDA.
    code = ("import ctypes; from convert.cuda import runtime; from server.engine.providers import Engine; "
            f"from server.settings import Settings; Engine(Settings(provider='cuda', cuda_sync='{sync}')); "
            "flags = ctypes.c_uint(); runtime().cudaGetDeviceFlags(ctypes.byref(flags)); print(flags.value & 7)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=pathlib.Path(__file__).resolve().parents[3])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == str(schedule)
    assert "could not be set" not in done.stderr
