"""A model's weights held once for all of its CPU plans, not once per plan (docs/design.md: one CPU arena and
one copy of the weights).

onnxruntime's CPU graph optimizer rewrites a plan's convolutions into its NCHWc kernels, writing their
weights reordered into new initializers: left to itself, every session keeps its own copy (17.7 MiB per plan of
the default model). Handing every session the original weights (`SessionOptions.add_initializer`) saves nothing, as the
reordered copies are made from them anyway, and onnxruntime's pre-packed weights container is not reachable
from Python. What works from Python:

1. optimize the plan's graph once, in a session at the full optimization level that only writes the
   optimized graph out, every initializer of `EXTERNAL_MIN_BYTES` or more in a data file beside it;
2. load the optimized graph with the optimizer off, each of those initializers handed in as an OrtValue
   (`add_initializer`, which onnxruntime uses in place; `add_external_initializers` copies it) looked up by
   its content: the reordered weights are the same bytes in every plan of a model, so every plan's session
   uses one copy. Onnxruntime's own pre-packing adds nothing on these graphs (`session.disable_prepacking`
   changed no byte of the ten default plans), and the outputs are the same to the bit.

Optimizing costs about what creating the session did (the optimizer ran in it anyway); loading the
optimized graph ~30 ms more per plan.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import onnx
import onnxruntime
import xxhash

__all__ = ["ALIGNMENT", "EXTERNAL_MIN_BYTES", "SharedWeights", "optimize"]

# Initializers of this many bytes or more are shared; smaller ones (shapes, scalars) stay in each plan's graph.
EXTERNAL_MIN_BYTES = 1024
# Where each shared copy starts, as onnxruntime's own CPU allocator places initializers (MLAS's preferred alignment):
# numpy's 16 bytes left the kernels' 32-byte loads straddling cache lines.
ALIGNMENT = 64
_GRAPH_FILE = "plan.onnx"
_DATA_FILE = "plan.data"


def _aligned(values: np.ndarray) -> np.ndarray:
    """A copy of `values` starting at an ALIGNMENT-byte boundary."""
    buffer = np.empty(values.nbytes + ALIGNMENT, np.uint8)
    start = -buffer.ctypes.data % ALIGNMENT
    copy = buffer[start:start + values.nbytes].view(values.dtype)
    copy[...] = values
    return copy


def optimize(graph_path: str, folder: str, options: onnxruntime.SessionOptions, providers: list) -> str:
    """Write `graph_path` as onnxruntime's optimizer leaves it, with its large initializers in a data file
    beside it, into `folder`; the optimized graph's path. `options` are the plan session's (its level)."""
    optimized = os.path.join(folder, _GRAPH_FILE)
    options.optimized_model_filepath = optimized
    options.add_session_config_entry("session.optimized_model_external_initializers_file_name", _DATA_FILE)
    options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes",
                                     str(EXTERNAL_MIN_BYTES))
    options.enable_cpu_mem_arena = False  # it never runs: what loading it allocates goes straight back
    onnxruntime.InferenceSession(graph_path, options, providers=providers)
    return optimized


class SharedWeights:
    """One model's large initializers, by content, as OrtValues every plan session of the model uses in place."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[tuple[int, tuple[int, ...], bytes], onnxruntime.OrtValue] = {}
        self.bytes = 0  # what the values hold together

    def __len__(self) -> int:
        return len(self._values)

    def share(self, optimized_path: str, options: onnxruntime.SessionOptions) -> str:
        """Set `options` to hand every external initializer of the optimized graph at `optimized_path` to the
        session as the shared copy of its bytes (made on first sight), the optimizer off (the graph is optimized
        already); the path to load."""
        graph = onnx.load(optimized_path, load_external_data=False)
        folder = os.path.dirname(optimized_path)
        files: dict[str, bytes] = {}
        with self._lock:
            for tensor in graph.graph.initializer:
                if tensor.data_location != onnx.TensorProto.EXTERNAL:
                    continue
                where = {entry.key: entry.value for entry in tensor.external_data}
                if where["location"] not in files:
                    with open(os.path.join(folder, where["location"]), "rb") as data:
                        files[where["location"]] = data.read()
                offset = int(where.get("offset", 0))
                raw = files[where["location"]][offset:offset + int(where["length"])]
                key = (tensor.data_type, tuple(tensor.dims), xxhash.xxh3_128_digest(raw))  # 10x blake2b's speed
                value = self._values.get(key)
                if value is None:
                    array = _aligned(np.frombuffer(raw, onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)))
                    value = self._values[key] = onnxruntime.OrtValue.ortvalue_from_numpy(
                        array.reshape(tuple(tensor.dims)))
                    self.bytes += array.nbytes
                options.add_initializer(tensor.name, value)
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
        return optimized_path
