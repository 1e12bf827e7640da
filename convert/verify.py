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
from protos.model_card_pb2 import Agreement, Preprocessing, Verification

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


def probabilities(scores: np.ndarray, *, logits: bool) -> np.ndarray:
    """Per-cell class probabilities of scores [N, K, h, w] (softmax over K when they are logits), float64."""
    scores = scores.astype(np.float64)
    if not logits:
        return scores
    shifted = np.exp(scores - scores.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def map_correlation(expected: np.ndarray, got: np.ndarray, *, classes: int = 5) -> float:
    """Pearson correlation of the probability maps [1, K, h, w] of the reference's `classes` top image-level
    classes (their maps side by side): how alike the two score maps look, where they matter."""
    top = np.argsort(-expected[0].mean(axis=(1, 2)))[:classes]
    a, b = expected[0, top].ravel(), got[0, top].ravel()
    if a.std() == 0 or b.std() == 0:
        return 1.0 if np.array_equal(a, b) else 0.0
    return float(np.corrcoef(a, b)[0, 1])


def agreement(reference, candidate, tensors: list[list[np.ndarray]], *, sides: tuple[int, ...],
              logits: bool) -> Agreement:
    """`candidate` against `reference` (models or sessions) on each image's input tensors, one per side (the last
    the dense size, where the maps are correlated); the card's record."""
    reference, candidate = (runner if isinstance(runner, onnxruntime.InferenceSession) else session(runner)
                            for runner in (reference, candidate))
    cells = agreed = images_agreed = runs = 0
    largest, total, values = 0.0, 0.0, 0
    correlations = []
    for per_side in tensors:
        for index, tensor in enumerate(per_side):
            expected = probabilities(run(reference, tensor), logits=logits)
            got = probabilities(run(candidate, tensor), logits=logits)
            top_expected, top_got = expected.argmax(axis=1), got.argmax(axis=1)
            cells += top_expected.size
            agreed += int(np.sum(top_expected == top_got))
            runs += 1
            images_agreed += int(expected.mean(axis=(2, 3)).argmax() == got.mean(axis=(2, 3)).argmax())
            diff = np.abs(expected - got)
            largest, total, values = max(largest, float(diff.max())), total + float(diff.sum()), values + diff.size
            if index == len(per_side) - 1:
                correlations.append(map_correlation(expected, got))
    return Agreement(images=len(tensors), sides=list(sides), top1_agreement=agreed / max(cells, 1),
                     image_top1_agreement=images_agreed / max(runs, 1), max_probability_diff=largest,
                     mean_probability_diff=total / max(values, 1), map_correlation=min(correlations, default=1.0),
                     mean_map_correlation=float(np.mean(correlations)) if correlations else 1.0)
