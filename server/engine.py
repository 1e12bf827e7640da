"""onnxruntime sessions: which execution provider really runs the graph, and running batches on it.

CUDA is asked for only when it can load (provider compiled in AND a CUDA device present), since
asking for it without CUDA logs a loud error before falling back; after creation the session's
own `get_providers()` is the truth reported to callers.
"""

from __future__ import annotations

import ctypes.util
import glob
import logging
from dataclasses import dataclass

import grpc
import numpy as np
import onnxruntime

from convert.runtime_memory import PREDICTABLE_CUDA_OPTIONS, predictable_session_options
from server.errors import ScoringError
from server.settings import Settings

LOG = logging.getLogger(__name__)
CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"


@dataclass(frozen=True)
class ProviderChoice:
    """The providers to request and, when CUDA is not among them, why."""

    providers: tuple[str, ...]
    reason: str


def choose_providers(
    available: tuple[str, ...] | list[str], *, cuda_device: bool, provider: str = "auto", require_gpu: bool = False
) -> ProviderChoice:
    """Pure provider selection; raises ScoringError(FAILED_PRECONDITION) when a GPU is required but absent."""
    if provider not in ("auto", "cuda", "cpu"):
        raise ScoringError(grpc.StatusCode.INVALID_ARGUMENT, f"provider must be auto, cuda or cpu; received {provider!r}")
    if provider == "cpu" and require_gpu:
        raise ScoringError(grpc.StatusCode.FAILED_PRECONDITION, "--require-gpu contradicts --provider cpu")
    if provider == "cpu":
        return ProviderChoice((CPU,), "the CPU provider was requested")
    if CUDA not in available:
        missing = f"this onnxruntime build has no {CUDA} (available: {', '.join(available)})"
    elif not cuda_device:
        missing = "no CUDA device or CUDA runtime library was found"
    else:
        return ProviderChoice((CUDA, CPU), "CUDA is available")
    if require_gpu or provider == "cuda":
        raise ScoringError(grpc.StatusCode.FAILED_PRECONDITION, f"a GPU is required but {missing}")
    return ProviderChoice((CPU,), f"running on the CPU: {missing}")


def cuda_device_present() -> bool:
    """A CUDA device node and the CUDA runtime library both exist on this machine."""
    has_device = bool(glob.glob("/dev/nvidia[0-9]*"))
    has_runtime = any(ctypes.util.find_library(name) for name in ("cudart", "cuda"))
    return has_device and has_runtime


def session_options(settings: Settings) -> onnxruntime.SessionOptions:
    # The options under which admission's prediction (convert.profile) was validated.
    options = predictable_session_options()
    options.intra_op_num_threads = settings.intra_op_threads
    options.inter_op_num_threads = settings.inter_op_threads
    options.log_severity_level = 3
    return options


class Engine:
    """One model's onnxruntime session on the chosen provider."""

    def __init__(self, path: str, *, input_name: str, output_name: str, settings: Settings) -> None:
        choice = choose_providers(
            onnxruntime.get_available_providers(),
            cuda_device=cuda_device_present(),
            provider=settings.provider,
            require_gpu=settings.require_gpu,
        )
        providers: list = list(choice.providers)
        if CUDA in providers:
            providers[0] = (CUDA, {"cudnn_conv_algo_search": settings.cudnn_conv_algo_search, **PREDICTABLE_CUDA_OPTIONS})
        self.session = onnxruntime.InferenceSession(path, session_options(settings), providers=providers)
        self.provider = self.session.get_providers()[0]
        if CUDA in choice.providers and self.provider != CUDA:
            if settings.require_gpu:
                raise ScoringError(grpc.StatusCode.FAILED_PRECONDITION, f"{CUDA} failed to load for {path}")
            LOG.warning("%s: CUDA was requested but the session runs on %s", path, self.provider)
        elif CUDA not in choice.providers:
            LOG.info("%s: %s", path, choice.reason)
        self.input_name = input_name
        self.output_name = output_name

    @property
    def on_gpu(self) -> bool:
        return self.provider == CUDA

    def run(self, batch: np.ndarray) -> np.ndarray:
        """Scores [N, K, h, w] for one input batch; on the GPU through IO binding."""
        if not self.on_gpu:
            return self.session.run([self.output_name], {self.input_name: batch})[0]
        binding = self.session.io_binding()
        binding.bind_cpu_input(self.input_name, batch)
        binding.bind_output(self.output_name, "cpu")
        self.session.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()[0]

    def free_gpu_bytes(self) -> int | None:
        """Free device memory from the CUDA runtime (cudaMemGetInfo), when running on the GPU."""
        if not self.on_gpu:
            return None
        name = ctypes.util.find_library("cudart")
        if name is None:
            return None
        runtime = ctypes.CDLL(name)
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        if runtime.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)) != 0:
            return None
        return int(free.value)
