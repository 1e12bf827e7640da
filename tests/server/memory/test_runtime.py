"""The process's memory as the server runs it: allocator configuration, freed memory returned, footprints."""

import resource
import threading

import numpy as np
import onnxruntime
import pytest

from server.memory.runtime import (MeasurementError, configure_allocator, measure_footprint, measure_peak,
                                   predictable_session_options, release_free_memory, resident_bytes, select_device)
from tests.tiny_models import patch_net

MiB = 2**20


@pytest.fixture(scope="module", autouse=True)
def allocator():
    assert configure_allocator()  # glibc: the configuration the server runs under


def test_a_thread_heap_keeps_a_freed_request_sized_block_for_the_next():
    """A decoding thread's photo and canvas (1 MiB at 576x384) freed at its heap's top stay for the next request:
    trimmed to nothing, they would fault in 240 fresh pages per request."""
    faults = []

    def requests() -> None:
        np.ones(MiB, np.uint8)  # the thread's heap made
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for _ in range(20):
            np.ones(MiB, np.uint8)  # allocated, touched, freed
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

    thread = threading.Thread(target=requests)
    thread.start()
    thread.join()
    assert faults[0] < 20 * MiB // 4096 // 10  # a tenth of a page fault per page touched, at most


def test_a_footprint_counts_what_the_build_keeps_and_not_what_it_frees():
    def build():
        kept = np.ones(64 * MiB, np.uint8)
        np.ones(128 * MiB, np.uint8).sum()  # a transient peak, freed before the build returns
        return kept

    kept, footprint = measure_footprint(build, on_gpu=False)
    assert footprint.device_bytes is None and footprint.bytes == footprint.host_bytes
    assert 60 * MiB <= footprint.host_bytes <= 100 * MiB
    del kept


def test_the_footprint_of_a_session_is_its_resident_state():
    model = patch_net(classes=64, stride=32).SerializeToString()  # 64 x 3 x 32 x 32 float32 weights

    def build():
        session = onnxruntime.InferenceSession(model, predictable_session_options(), providers=["CPUExecutionProvider"])
        session.run(None, {"image": np.zeros((1, 3, 256, 256), np.float32)})
        return session

    session, footprint = measure_footprint(build, on_gpu=False)
    assert footprint.host_bytes < 64 * MiB
    del session


def test_freed_memory_goes_back_to_the_system():
    before = resident_bytes()
    chunks = [bytearray(64 * 1024) for _ in range(3000)]  # ~190 MiB of heap-sized blocks
    for chunk in chunks[::2]:
        chunk[0] = 1
    assert resident_bytes() - before > 150 * MiB
    survivors = chunks[::500]  # a few blocks left in the middle of the heap, as a server keeps
    del chunks
    release_free_memory()
    assert resident_bytes() - before < 30 * MiB
    del survivors


def test_measurement_uses_the_gpu_only_when_cuda_loads():
    assert select_device(["CUDAExecutionProvider", "CPUExecutionProvider"], cuda_loadable=True) == "cuda"
    assert select_device(["CUDAExecutionProvider", "CPUExecutionProvider"], cuda_loadable=False) == "cpu"
    assert select_device(["CPUExecutionProvider"], cuda_loadable=True) == "cpu"


def test_measurement_refuses_an_unknown_device_and_a_missing_model(tmp_path):
    with pytest.raises(MeasurementError, match="device must be"):
        measure_peak(str(tmp_path / "m.onnx"), height=32, width=32, device="tpu")
    with pytest.raises(MeasurementError, match="no model file"):
        measure_peak(str(tmp_path / "missing.onnx"), height=32, width=32, device="cpu")
    broken = tmp_path / "broken.onnx"
    broken.write_text("not a model")
    with pytest.raises(MeasurementError, match="failed"):
        measure_peak(str(broken), height=32, width=32, device="cpu")
