"""Session fixtures shared by every package's tests: the default model, converted once per session."""

from __future__ import annotations

import onnx
import pytest

from convert import convert_classifier
from server.memory.runtime import configure_allocator

# glibc's allocator as the server sets it, before any test starts a thread: its one heap holds only once glibc
# fixes its limit on heaps, which it does when more than eight exist (plan footprints read low otherwise).
configure_allocator()


@pytest.fixture(scope="session")
def default_model_path(tmp_path_factory) -> str:
    """The default classifier converted at stride 32 (the ~10 s export is cached for the session)."""
    path = tmp_path_factory.mktemp("default_model") / "default.onnx"
    onnx.save(convert_classifier("default"), path)
    return str(path)


@pytest.fixture(scope="session")
def default_model_os16_path(tmp_path_factory) -> str:
    """The default classifier converted with the à trous rewrite to stride 16."""
    path = tmp_path_factory.mktemp("default_model_os16") / "default_os16.onnx"
    onnx.save(convert_classifier("default", output_stride=16), path)
    return str(path)
