"""convert/cuda.py: the CUDA and cuDNN wheels are preloaded once, quietly, and only where a driver could use them."""

from __future__ import annotations

import onnxruntime
import pytest

from convert import cuda


@pytest.fixture
def fresh(monkeypatch):
    """convert.cuda as if nothing had been preloaded in this process; preload_dlls recorded, not run."""
    calls = []

    def preload_dlls(cuda: bool = True, cudnn: bool = True, msvc: bool = True, directory=None) -> None:
        calls.append((cuda, cudnn, directory))
        print("Failed to load libcudnn.so.9: libcudnn.so.9: cannot open shared object file")

    monkeypatch.setattr(cuda, "_preloaded", None)
    monkeypatch.setattr(onnxruntime, "preload_dlls", preload_dlls)
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    return calls


def test_the_wheels_are_preloaded_once_where_a_driver_is_present_and_what_failed_is_said(fresh, monkeypatch, capsys):
    monkeypatch.setattr(cuda, "driver_present", lambda: True)
    assert cuda.preload_libraries() == "Failed to load libcudnn.so.9: libcudnn.so.9: cannot open shared object file"
    cuda.runtime()
    cuda.preload_libraries()
    assert fresh == [(True, True, None)]  # once per process, CUDA and cuDNN from the nvidia site packages
    assert capsys.readouterr().out == ""  # onnxruntime prints; a command's output stays its own
    assert "libcudnn.so.9" in cuda.why_no_cuda() and cuda.INSTALL_HINT in cuda.why_no_cuda()


def test_nothing_is_preloaded_without_a_driver_or_a_cuda_build(fresh, monkeypatch):
    monkeypatch.setattr(cuda, "driver_present", lambda: False)
    assert cuda.preload_libraries() == "" and fresh == []
    assert cuda.why_no_cuda().startswith("no NVIDIA driver")
    monkeypatch.setattr(cuda, "_preloaded", None)
    monkeypatch.setattr(cuda, "driver_present", lambda: True)
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])
    assert cuda.preload_libraries() == "" and fresh == []


def test_a_failing_preload_is_reported_not_raised(fresh, monkeypatch):
    def broken(**_):
        raise RuntimeError("Invalid parameter of directory=None. The directory does not exist!")

    monkeypatch.setattr(cuda, "driver_present", lambda: True)
    monkeypatch.setattr(onnxruntime, "preload_dlls", broken)
    assert "preload_dlls failed: Invalid parameter" in cuda.preload_libraries()
