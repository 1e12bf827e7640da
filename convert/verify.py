"""Checks that a converted graph computes what the classifier computes.

At conversion: original and converted graphs on the same deterministic inputs at the training
size. On request (`--report`): every dense cell against the classifier on its crop. And the
literal shift-and-stitch reference that an à trous graph must equal in its interior.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime

from convert.card import spatial_axes
from convert.errors import ConversionError
from convert.preprocessing import to_input
from protos.model_card_pb2 import Preprocessing, Verification

# Max abs difference allowed at conversion, relative to the output's magnitude (max(1, max |output|)).
TOLERANCE = 1e-4
# Deterministic random images the conversion check runs.
VERIFY_SAMPLES = 2
VERIFY_SEED = 0
# The converter checks on the CPU: it needs no GPU and gives the same numbers everywhere.
PROVIDERS = ["CPUExecutionProvider"]


def session(model: onnx.ModelProto) -> onnxruntime.InferenceSession:
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    return onnxruntime.InferenceSession(model.SerializeToString(), options, providers=PROVIDERS)


def sample_pixels(*, count: int, height: int, width: int, channels: int, seed: int = VERIFY_SEED) -> np.ndarray:
    """Deterministic random pixel images [count, H, W, C], integers 0..255."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(count, height, width, channels)).astype(np.float32)


def run(model_or_session, tensor: np.ndarray) -> np.ndarray:
    """The first output of a model (or session) on one input tensor."""
    runner = model_or_session if isinstance(model_or_session, onnxruntime.InferenceSession) else session(model_or_session)
    name = runner.get_inputs()[0].name
    return runner.run(None, {name: tensor})[0]


def run_classifier(model_or_session, tensor: np.ndarray) -> np.ndarray:
    """The classifier's outputs [n, K] for a batch, one sample at a time when its batch is fixed."""
    runner = model_or_session if isinstance(model_or_session, onnxruntime.InferenceSession) else session(model_or_session)
    batch = runner.get_inputs()[0].shape[0]
    if isinstance(batch, int) and batch != tensor.shape[0]:
        outputs = [run(runner, tensor[i:i + 1]) for i in range(tensor.shape[0])]
        return np.concatenate(outputs).reshape(tensor.shape[0], -1)
    return run(runner, tensor).reshape(tensor.shape[0], -1)


def verify(original: onnx.ModelProto, converted: onnx.ModelProto, *, preprocessing: Preprocessing,
           training_size: tuple[int, int], channels: int, samples: int = VERIFY_SAMPLES, tolerance: float = TOLERANCE) -> Verification:
    """Original vs converted at the training size: cell (0, 0) of the dense map must equal the classifier's output."""
    height, width = training_size
    tensor = to_input(sample_pixels(count=samples, height=height, width=width, channels=channels), preprocessing)
    try:
        expected = run_classifier(original, tensor)
        dense = run(converted, tensor)
    except Exception as error:
        raise ConversionError(f"running original and converted graphs at {height}x{width} failed: {error}") from error
    got = dense[:, :, 0, 0]
    if got.shape != expected.shape:
        raise ConversionError(f"the converted graph gives {got.shape[1]} scores per cell; the classifier gives {expected.shape[1]}")
    diff = float(np.max(np.abs(got.astype(np.float64) - expected.astype(np.float64))))
    allowed = tolerance * max(1.0, float(np.max(np.abs(expected))))
    return Verification(max_abs_diff=diff, tolerance=allowed, samples=samples, passed=bool(diff <= allowed),
                        reference="original classifier at the training size, deterministic random images")


@dataclass(frozen=True)
class CropReport:
    """Dense cells against the classifier run on each cell's crop."""

    cells: int
    max_abs_diff: float
    mean_abs_diff: float
    argmax_agreement: float
    grid: tuple[int, int]


def crop_grid(tensor_shape: tuple[int, ...], *, layout: int, training_size: tuple[int, int], stride: int) -> tuple[int, int]:
    """How many full training-size crops fit at the given stride, per axis."""
    height, width = (tensor_shape[axis] for axis in spatial_axes(layout))
    return (height - training_size[0]) // stride + 1, (width - training_size[1]) // stride + 1


def crops(tensor: np.ndarray, *, layout: int, training_size: tuple[int, int], stride: int) -> np.ndarray:
    """All training-size crops at the stride (row-major), as one batch; `tensor` holds one image."""
    rows, cols = crop_grid(tensor.shape, layout=layout, training_size=training_size, stride=stride)
    th, tw = training_size
    y_axis, x_axis = spatial_axes(layout)
    pieces = []
    for i in range(rows):
        for j in range(cols):
            y, x = i * stride, j * stride
            window = [slice(None)] * tensor.ndim
            window[y_axis], window[x_axis] = slice(y, y + th), slice(x, x + tw)
            pieces.append(tensor[tuple(window)])
    return np.concatenate(pieces)


def compare_with_crops(original: onnx.ModelProto, converted: onnx.ModelProto, tensor: np.ndarray, *, layout: int,
                       training_size: tuple[int, int], stride: int) -> CropReport:
    """Each dense cell (i, j) against the classifier on the crop at (i*stride, j*stride) of one image."""
    rows, cols = crop_grid(tensor.shape, layout=layout, training_size=training_size, stride=stride)
    if rows < 1 or cols < 1:
        raise ConversionError(f"the image tensor {tensor.shape} is smaller than the training size {training_size}")
    try:
        expected = run_classifier(original, crops(tensor, layout=layout, training_size=training_size, stride=stride))
        dense = run(converted, tensor)[0]
    except Exception as error:
        raise ConversionError(f"running the classifier on crops and the dense graph on {tensor.shape} failed: {error}") from error
    got = dense[:, :rows, :cols].reshape(dense.shape[0], -1).T
    diff = np.abs(got.astype(np.float64) - expected.astype(np.float64))
    agreement = float(np.mean(np.argmax(got, axis=1) == np.argmax(expected, axis=1)))
    return CropReport(cells=rows * cols, max_abs_diff=float(diff.max()), mean_abs_diff=float(diff.mean()),
                      argmax_agreement=agreement, grid=(rows, cols))


def shift_and_stitch(model_or_session, tensor: np.ndarray, *, shift: int, factor: int) -> np.ndarray:
    """The literal shift-and-stitch map: the graph run on the image cropped by (a*shift, b*shift) for a, b < factor, outputs interleaved.

    Cell (factor*i + a, factor*j + b) of the result is cell (i, j) of the run on the crop shifted by
    (a*shift, b*shift); a shifted run has at most one cell fewer per axis, so the grid is full. NCHW
    input only. This is the reference the à trous graph must equal.
    """
    runs = {}
    for a in range(factor):
        for b in range(factor):
            runs[a, b] = run(model_or_session, np.ascontiguousarray(tensor[:, :, a * shift:, b * shift:]))
    rows = sum(runs[a, 0].shape[2] for a in range(factor))
    cols = sum(runs[0, b].shape[3] for b in range(factor))
    first = runs[0, 0]
    stitched = np.zeros((first.shape[0], first.shape[1], rows, cols), first.dtype)
    for (a, b), out in runs.items():
        stitched[:, :, a::factor, b::factor] = out
    return stitched
