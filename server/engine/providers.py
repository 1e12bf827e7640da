"""The execution provider: which one really runs, probed once per server, and sessions made on it.

CUDA is asked for only when it can load (provider compiled in AND a CUDA device present), since
asking for it without CUDA logs a loud error before falling back; after creation each session's
own `get_providers()` is the truth reported to callers. The probe first preloads the CUDA runtime
and cuDNN that the `gpu` extra installs as wheels (convert.cuda.preload_libraries, once per process),
so the engine's first CUDA session finds them without LD_LIBRARY_PATH.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import onnxruntime

from convert.cuda import (INSTALL_HINT, Schedule, cuda_free_bytes, driver_present, preload_libraries,
                         set_schedule, why_no_cuda)
from convert.memory_model import Device
from server.engine.priority import made_lowered
from server.engine.shared_weights import SharedWeights, optimize
from server.errors import shutting_down
from server.memory.arena import CPU_ARENA
from server.memory.runtime import PREDICTABLE_CUDA_OPTIONS, first_cpu_run, predictable_session_options, warm_up_runtime
from server.settings import Settings

LOG = logging.getLogger(__name__)
CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"


class EngineError(RuntimeError):
    """The provider asked for cannot run; the message says why."""


@dataclass(frozen=True)
class ProviderChoice:
    """The providers to request and, when CUDA is not among them, why; `surprising` when a GPU machine
    (a driver present) runs on the CPU, which the log says as a warning rather than as news."""

    providers: tuple[str, ...]
    reason: str
    surprising: bool = False


def choose_providers(
    available: tuple[str, ...] | list[str], *, cuda_device: bool, provider: str = "auto", require_gpu: bool = False,
    driver: bool = False, detail: str = "",
) -> ProviderChoice:
    """Pure provider selection; raises EngineError when a GPU is required but absent. `driver`: the NVIDIA
    driver is installed; `detail`: why the probe found no device (convert.cuda.why_no_cuda)."""
    if provider not in ("auto", "cuda", "cpu"):
        raise EngineError(f"provider must be auto, cuda or cpu; received {provider!r}")
    if provider == "cpu" and require_gpu:
        raise EngineError("--require-gpu contradicts --provider cpu")
    if provider == "cpu":
        return ProviderChoice((CPU,), "the CPU provider was requested")
    if CUDA not in available:
        missing = f"this onnxruntime build has no {CUDA} (available: {', '.join(available)})"
    elif not cuda_device:
        missing = "no CUDA device or CUDA runtime library was found" + (f": {detail}" if detail else "")
    else:
        return ProviderChoice((CUDA, CPU), "CUDA is available")
    if require_gpu or provider == "cuda":
        raise EngineError(f"a GPU is required but {missing}")
    return ProviderChoice((CPU,), f"running on the CPU: {missing}", surprising=driver)


# Providers with integer kernels for QDQ graphs (onnxruntime fuses each QuantizeLinear/DequantizeLinear pair with its
# op into QLinearConv, ...). onnxruntime's CUDA provider has none for convolutions: it runs such a graph as float32
# convolutions between Quantize/DequantizeLinear nodes, int8's loss without its speed.
_NUMPY_TYPES = {"tensor(float)": np.float32, "tensor(uint8)": np.uint8, "tensor(float16)": np.float16,
                "tensor(int64)": np.int64}


@contextlib.contextmanager
def stoppable(runs: onnxruntime.RunOptions | None) -> Iterator[None]:
    """Around a run under `runs`: one ended by `Engine.stop_runs` raises ScoringError(UNAVAILABLE), the server's
    word for a stopping server (onnxruntime's own is its generic Fail, which would read as a failed inference)."""
    try:
        yield
    except Exception as error:
        if runs is not None and runs.terminate:
            raise shutting_down() from error
        raise


def _first_run(session: onnxruntime.InferenceSession, runs: onnxruntime.RunOptions) -> None:
    """A fixed-shape CPU session's first run, on zeros (server.memory.runtime.first_cpu_run says why);
    a session whose inputs are not all fixed is left alone."""
    feeds = {}
    for value in session.get_inputs():
        if value.type not in _NUMPY_TYPES or not all(isinstance(dim, int) for dim in value.shape):
            return
        feeds[value.name] = np.zeros(value.shape, _NUMPY_TYPES[value.type])
    first_cpu_run(session, feeds, runs)


def cuda_device_present() -> bool:
    """A CUDA runtime loads and sees a device: the one probe (server.memory.runtime) memory measurement uses too;
    it preloads the CUDA and cuDNN wheels first (convert.cuda.preload_libraries)."""
    return cuda_free_bytes() is not None


class Engine:
    """The provider every plan of every model runs on, and the options its sessions get."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        available = onnxruntime.get_available_providers()
        wanted = Schedule[settings.cuda_sync.upper()]
        # Before the probe below makes the device's context: a context made keeps its schedule in older CUDA.
        schedule = (set_schedule(wanted) if wanted is not Schedule.AUTO and settings.provider != "cpu"
                    and CUDA in available else None)
        # The probe preloads the CUDA libraries (convert.cuda), before any CUDA session is made.
        device = settings.provider != "cpu" and CUDA in available and cuda_device_present()
        explain = settings.provider != "cpu" and CUDA in available and not device
        choice = choose_providers(
            available, cuda_device=device, provider=settings.provider, require_gpu=settings.require_gpu,
            driver=explain and driver_present(), detail=why_no_cuda() if explain else "",
        )
        self._providers: list = list(choice.providers)
        if CUDA in self._providers:
            self._providers[0] = (CUDA, {
                "cudnn_conv_algo_search": settings.cudnn_conv_algo_search, **PREDICTABLE_CUDA_OPTIONS,
            })
            if wanted is not Schedule.AUTO and schedule is not wanted:
                LOG.warning("--cuda-sync %s could not be set: the CUDA runtime keeps %s", settings.cuda_sync,
                            "its own" if schedule is None else schedule.name.lower())
        else:
            LOG.log(logging.WARNING if choice.surprising else logging.INFO, "%s", choice.reason)
        self.provider = CUDA if CUDA in choice.providers else CPU
        self.runs = onnxruntime.RunOptions()  # every run of every plan, its first included: `stop_runs` ends them
        if not self.on_gpu:  # so the first plan's measured footprint is the plan's, not the runtime's first use
            warm_up_runtime([CPU])
            CPU_ARENA.idle_held_bytes = settings.max_idle_arena_bytes

    @property
    def on_gpu(self) -> bool:
        return self.provider == CUDA

    def stop_runs(self) -> None:
        """End the runs under way at their next node, and fail every later one (RunOptions.terminate): a server
        that closes waits for no batch or plan's run, and a process exiting with a thread inside onnxruntime aborts
        (std::terminate) instead of exiting 0."""
        self.runs.terminate = True

    @property
    def device(self) -> Device:
        """The device whose memory terms (convert.memory_model) predict this engine's plans."""
        return Device.CUDA if self.on_gpu else Device.CPU

    def options(self) -> onnxruntime.SessionOptions:
        """The options under which admission's prediction (convert.profile) was validated; on the GPU one
        intra-op thread that does not spin, since the host only launches kernels."""
        options = predictable_session_options(on_gpu=self.on_gpu)
        options.log_severity_level = 3
        # No spinning: a server holds many plans, each with its own thread pool, and spinning pools of
        # idle plans would take the cores from the one that runs.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.intra_op_num_threads = self.settings.intra_op_threads_for(on_gpu=self.on_gpu)
        options.inter_op_num_threads = self.settings.inter_op_threads
        return options

    def session(self, graph: bytes, *, weights: SharedWeights | None = None) -> onnxruntime.InferenceSession:
        """A session of `graph` on the chosen provider; EngineError when CUDA was chosen but did not load.

        On the CPU with `weights` (the model's, server.engine.shared_weights), the graph is optimized once
        and its session loaded on the model's shared copy of the optimized weights. Made from a file, not the
        bytes: onnxruntime's Python session keeps bytes it was given for as long as it lives (a second copy of
        the weights per plan, 18 MiB on the default model)."""
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "graph.onnx")
            with open(path, "wb") as file:
                file.write(graph)
            options = self.options()
            if weights is not None and not self.on_gpu:
                path = weights.share(optimize(path, folder, self._optimizing_options(), [CPU]), options)
            session = made_lowered(lambda: onnxruntime.InferenceSession(path, options, providers=self._providers),
                                   self.settings.compute_nice_for(on_gpu=self.on_gpu))  # its pool threads lowered
        if weights is not None and not self.on_gpu:
            # onnxruntime uses the values handed to add_initializer in place but does not keep them alive: the
            # session holds the model's weights for as long as it lives (a session outliving them read freed memory)
            session.shared_weights = weights
        actual = session.get_providers()[0]
        if actual != self.provider:
            failed = preload_libraries()
            why = (f"{CUDA} failed to load (the session runs on {actual}): a CUDA or cuDNN library is missing"
                   f"{f' ({failed})' if failed else ''}; {INSTALL_HINT}, and "
                   "`python -c 'import onnxruntime; onnxruntime.print_debug_info()'` lists what it finds")
            if self.settings.require_gpu:
                raise EngineError(why)
            LOG.warning("%s; running on the CPU", why)
            self.provider = actual
        if not self.on_gpu:
            with stoppable(self.runs):
                _first_run(session, self.runs)
        return session

    @staticmethod
    def _optimizing_options() -> onnxruntime.SessionOptions:
        """A session that only optimizes a graph and writes it out: one thread, no arena (it never runs)."""
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        return options

    def free_gpu_bytes(self) -> int | None:
        """Free device memory from the CUDA runtime (cudaMemGetInfo), when running on the GPU."""
        return cuda_free_bytes() if self.on_gpu else None
