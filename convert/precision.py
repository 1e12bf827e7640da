"""Half precision: weights and activations in float16, float32 at the graph's edges, verified.

fp16 halves weight and activation memory and is what GPUs run fastest. On the CPU it is slow:
onnxruntime's CPU provider has few float16 kernels and wraps the others in Casts to float32, so
an fp16 graph is meant for the CUDA provider.

The rewrite is onnxconverter-common's float16 pass (`keep_io_types=True`: a Cast after each
input and before each output, so clients keep sending float32). It keeps ops that need float32
(Resize scales, ...) in float32, and clamps weights to float16's range; values below its
smallest normal are truncated, which is why the result is checked against the fp32 graph.

The check runs where the converter runs, usually on the CPU. There, onnxruntime runs the float16
nodes it has no kernel for in float32 (it inserts Casts and removes redundant pairs), so the CPU
check covers the weights' rounding and clamping and the edge casts, not float16 arithmetic;
on a GPU the same check covers both.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
from onnxconverter_common import float16

from convert import verify
from convert.card import CardError, ChannelOrder, ImageInput, InputDtype, Layout, Precision, read_card, write_card
from convert.errors import ConversionError
from convert.preprocessing import to_input
from protos.model_card_pb2 import Preprocessing, Verification

__all__ = ["to_fp16", "fp16_graph", "verify_fp16", "FP16_TOLERANCE", "FP16_VERIFY_SIZE"]

# Allowed max |fp16 - fp32| over all scores, relative to max |fp32 score| on the same inputs:
# float16 keeps 11 significant bits (5e-4 relative per rounding), and errors add up over ~50 layers.
FP16_TOLERANCE = 2e-2
# Input side used for the check when the model card names no training size.
FP16_VERIFY_SIZE = 224


def _fp32_input(model: onnx.ModelProto) -> ImageInput:
    try:
        return ImageInput.of(read_card(model))
    except CardError:
        # No card: an RGB NCHW image mapped to [-1, 1], the usual range of image classifiers' inputs.
        return ImageInput.of(Preprocessing(
            layout=Layout.LAYOUT_NCHW, dtype=InputDtype.INPUT_DTYPE_FLOAT32, channel_order=ChannelOrder.CHANNEL_ORDER_RGB,
            pixel_scale=1.0, mean=[127.5] * 3, std=[127.5] * 3))


def verify_fp16(reference: onnx.ModelProto, candidate: onnx.ModelProto, *, height: int, width: int,
                samples: int = verify.VERIFY_SAMPLES, tolerance: float = FP16_TOLERANCE) -> Verification:
    """Compare an fp16 graph with its fp32 reference on deterministic images; the card's record."""
    image = _fp32_input(reference)
    pixels = verify.sample_pixels(count=samples, height=height, width=width, channels=image.channels)
    inputs = to_input(pixels, image)
    expected = verify.run(reference, inputs).astype(np.float64)
    got = verify.run(candidate, inputs).astype(np.float64)
    if expected.shape != got.shape:
        raise ConversionError(f"the fp16 graph's output has shape {got.shape}, the fp32 graph's {expected.shape}")
    max_abs_diff = float(np.max(np.abs(expected - got)))
    bound = tolerance * max(float(np.max(np.abs(expected))), 1e-12)
    # Scores are [N, K, h, w] (or [N, K]): the class axis is 1. Reported, not required: on random
    # images many cells are near-ties between classes.
    agreement = float(np.mean(expected.argmax(axis=1) == got.argmax(axis=1)))
    return Verification(
        max_abs_diff=max_abs_diff, tolerance=bound, samples=samples,
        passed=max_abs_diff <= bound,
        argmax_agreement=agreement,
        reference=f"fp32 graph on {samples} random {height}x{width} images; tolerance = {tolerance:g} x max |fp32 score|",
    )


def fp16_graph(model: onnx.ModelProto) -> onnx.ModelProto:
    """The float16 rewrite alone, unverified (for sizing: `scoremap-inspect --dtype fp16`)."""
    floats = [init for init in model.graph.initializer if init.data_type == onnx.TensorProto.FLOAT]
    if not floats:
        raise ConversionError("the graph has no float32 weights to convert; expected an fp32 graph")
    with warnings.catch_warnings():
        # Each weight below float16's smallest value warns once; verify_fp16 is what matters.
        warnings.simplefilter("ignore", UserWarning)
        source = onnx.ModelProto()
        source.CopyFrom(model)  # the pass edits its argument
        converted = float16.convert_float_to_float16(source, keep_io_types=True)
    converted.ir_version = model.ir_version
    return converted


def to_fp16(model: onnx.ModelProto, *, tolerance: float = FP16_TOLERANCE) -> onnx.ModelProto:
    """An fp16 copy of an fp32 graph (float32 inputs/outputs), checked against it.

    The model card, when there is one, is carried over with precision FP16 and the check's
    record as its verification. Raises ConversionError when the check fails.
    """
    converted = fp16_graph(model)
    try:
        card = read_card(model)
    except CardError:
        card = None
    height = (card.training_height if card is not None else 0) or FP16_VERIFY_SIZE
    width = (card.training_width if card is not None else 0) or FP16_VERIFY_SIZE
    record = verify_fp16(model, converted, height=height, width=width, tolerance=tolerance)
    if not record.passed:
        raise ConversionError(
            f"the fp16 graph differs from the fp32 graph: max |diff| {record.max_abs_diff:.4g} "
            f"(allowed {record.tolerance:.4g}), argmax agreement {record.argmax_agreement:.3f}; "
            "keep this model in fp32")
    if card is not None:
        card.precision = Precision.PRECISION_FP16
        card.verification.CopyFrom(record)
        write_card(converted, card)
    return converted
