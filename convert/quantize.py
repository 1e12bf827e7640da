"""int8: static QDQ quantization of a converted graph, calibrated and checked on photos fed as the server feeds them.

onnxruntime's quantization tools write QuantizeLinear/DequantizeLinear pairs around every quantizable
op (QDQ format): int8 weights per output channel, uint8 activations per tensor, ranges calibrated on
photos (convert.calibration). onnxruntime's CPU provider fuses each pair with its op into an integer
kernel (QLinearConv, ...); a graph without the pairs fused still computes the same values in float, which
is what the check compares when it names the layer that loses the most.

* The calibration method is chosen by measurement: each of CALIBRATION_METHODS quantizes the graph, and
  the one whose result agrees best with the fp32 graph on the calibration photos (cells' top class,
  then the maps' correlation) is kept; the held-out photos only check the choice.
* Weights of the convolutions that are not depthwise are full 8-bit or pair-bounded, as the caller chooses (`weights`;
  the CLI's `--int8-weights auto` asks convert.int8_kernels whether this CPU's kernels sum in 32 bits, where full 8-bit
  weights agree better with fp32; docs/design.md). Pair-bounded (convert.int8_passes.requantize_weights):
  onnxruntime's uint8 x int8 kernels on AVX2 CPUs without VNNI sum each two neighbouring products in 16 bits
  (VPMADDUBSW), which saturates when two neighbouring weights near 127 meet large activations. Each output
  channel's scale is the smallest at which any two neighbours along the reduction sum to at most 128 levels: never
  coarser than 7-bit weights (onnxruntime's `reduce_range`), on the default model's 34 such convolutions 1.2-1.7x
  finer. On the default model on an AVX2 CPU without VNNI, full 8-bit weights agreed with fp32 on 97.2% of the
  calibration photos' cells when the graph ran unfused, in float, and on 69.7% through the fused kernels; 7-bit
  weights on 90.9% fused, and the pair bound on 94.7% fused (held out: 96.6% with 7 bits, 97.0% pair-bounded);
  pair-bounded with entropy calibration 97.4% (held out 96.1%), with percentile 97.1% (held out 96.8%).
* Some layers stay in float, depthwise weights are quantized again at 8 bits, and each convolution's bias is
  corrected for the mean shift its rounding causes: convert.int8_passes, each measured there.
* Last, the classifier becomes integer sums with float logits where the calibration photos still pass with it
  (`_integer_classifier`); and on a CPU with AMX, with full 8-bit weights, deep pointwise convolutions run on
  onnxruntime's int8 GEMM: convert.int8_forms, each measured there.
* The image input is quantized on the pixel grid when the card's normalisation allows (one scale
  pixel_scale / std and a whole-pixel mean for every channel: the default model's (x - 127) / 128): the
  uint8 canvas then is the quantized input, and the server feeds it as it is (server/engine/device_graph.py).
  Otherwise its range is the whole pixel range, so no pixel is clipped.
* Accuracy-driven mixed precision (as Intel Neural Compressor's and TensorRT's precision fallback): while the graph
  falls short of the thresholds on the calibration photos, the quantized layer whose weights, put back in float, lift
  the cells' probabilities' signal-to-quantization-noise ratio on them the most (`fallback_ranking`, measured once on the fused
  plan) is kept in float and the graph quantized again, at most MAX_FALLBACK_LAYERS times; then each layer so chosen
  that the passing graph no longer needs goes back to int8 (`_prune`). The card names each layer kept in float and
  the numbers that chose it. The held-out photos take no part in the choice.
* The check (convert.verify.agreement) gates the result: below MIN_TOP1_AGREEMENT or MIN_MAP_CORRELATION
  on the calibration or the held-out photos, nothing is written unless the caller allows the loss, and
  then the card carries a warning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import tempfile

import numpy as np
import onnx
import onnxruntime
from onnx import numpy_helper, version_converter
from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType, quantize_static

from convert import int8_kernels, verify
from convert.int8_forms import INTEGER_CLASSIFIER, INTEGER_HEAD, classifier_in_integers, gemm_weights, integer_classifier
from convert.int8_passes import (FLOAT_LAYER_MIN_SNR_DB, correct_biases, float_layers, guard_float_layers, head_nodes,
                                 name_nodes, requantize_weights)
from convert.calibration import PhotoSet, as_fed, fed_sides
from convert.card import CardError, ImageInput, Precision, is_logits, read_card, write_card
from convert.errors import ConversionError
from protos.model_card_pb2 import Agreement, CalibrationTrial, Int8Weights, ModelCard, Quantization, Verification

__all__ = ["CALIBRATION_METHODS", "MIN_TOP1_AGREEMENT", "MIN_MAP_CORRELATION", "to_int8", "quantize", "input_grid",
           "MAX_FALLBACK_LAYERS", "fallback_ranking", "float_ops", "QDQ_OPSET", "qdq_opset"]

log = logging.getLogger(__name__)

CALIBRATION_METHODS = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
                       "percentile": CalibrationMethod.Percentile}
# The gate, on the calibration and on the held-out photos alike. Cells whose two best classes nearly tie flip
# under any perturbation, so agreement is never 100%: 97% of cells keep their top class, and the maps the
# server returns keep their shape (Pearson >= 0.98 over the top-5 classes' probability maps at the dense size).
MIN_TOP1_AGREEMENT = 0.97
MIN_MAP_CORRELATION = 0.98
PAIR_BOUNDED = Int8Weights.INT8_WEIGHTS_PAIR_BOUNDED
# onnxruntime's own weight levels at 7 bits: requantize_weights replaces them (full 8-bit or pair-bounded).
REDUCE_RANGE = True
QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
INTEGER_OPS = ("MatMulInteger",)  # integer arithmetic on quantized tensors without a DequantizeLinear
# Per-channel QuantizeLinear/DequantizeLinear (their `axis`) came with opset 13; converted Caffe-era graphs are at
# convert.normalize's TARGET_OPSET, 12.
QDQ_OPSET = 13
# Layers the fallback (`_fall_back`) may keep in float beyond float_layers' choice: each costs a quantization and
# runs at fp32 speed (the measured choice in docs/design.md).
MAX_FALLBACK_LAYERS = 4


class _Reader(CalibrationDataReader):
    """The calibration tensors one at a time; `set_range` lets onnxruntime collect one run per call (its
    histogram calibrators need one shape per call: photos come at several sizes)."""

    def __init__(self, input_name: str, tensors: list[np.ndarray]) -> None:
        self._name, self._tensors = input_name, tensors
        self.set_range(0, len(tensors))

    def __len__(self) -> int:
        return len(self._tensors)

    def set_range(self, start_index: int, end_index: int) -> None:
        self._next = iter(self._tensors[start_index:end_index])

    def get_next(self) -> dict | None:
        tensor = next(self._next, None)
        return None if tensor is None else {self._name: tensor}


def input_grid(card: ModelCard) -> tuple[float, int] | None:
    """(scale, zero point) that make the uint8 pixels themselves the quantized image input, when the card's
    normalisation is one x * scale - zero_point * scale for every channel with a whole zero point; else None."""
    image = ImageInput.of(card)
    scale = np.float32(image.pixel_scale) / np.asarray(image.std, np.float32)
    zero_point = np.asarray(image.mean, np.float64) / image.pixel_scale
    if (image.dtype != np.float32 or len(set(scale.tolist())) != 1 or len(set(zero_point.tolist())) != 1
            or zero_point[0] != round(zero_point[0]) or not 0 <= zero_point[0] <= 255):
        return None
    return float(scale[0]), int(zero_point[0])


def _input_overrides(card: ModelCard) -> dict:
    """onnxruntime's TensorQuantOverrides for the image input: the pixel grid, else the whole pixel range."""
    grid = input_grid(card)
    if grid is not None:
        scale, zero_point = grid
        return {card.preprocessing.input_name: [{"scale": np.array(scale, np.float32), "zero_point": np.array(zero_point, np.uint8)}]}
    image = ImageInput.of(card)
    ends = [(value * image.pixel_scale - mean) / std for value in (0.0, 255.0) for mean, std in zip(image.mean, image.std)]
    return {card.preprocessing.input_name: [{"rmin": np.array(min(ends), np.float32), "rmax": np.array(max(ends), np.float32)}]}


def qdq_opset(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` at QDQ_OPSET at least (onnx's version converter; a converted graph's Softmax is over its last axis, which
    opset 13 computes as 12 did); `model` itself when it is already there."""
    version = next((entry.version for entry in model.opset_import if entry.domain in ("", "ai.onnx")), QDQ_OPSET)
    if version >= QDQ_OPSET:
        return model
    try:
        upgraded = version_converter.convert_version(model, QDQ_OPSET)
    except Exception as error:  # the converter raises bare RuntimeErrors naming the op
        raise ConversionError(f"int8 needs the graph at opset {QDQ_OPSET} (per-channel weights); onnx's version "
                              f"converter cannot upgrade it from opset {version}: {error}") from error
    upgraded.ir_version = model.ir_version
    return upgraded


def quantize(model: onnx.ModelProto, tensors: list[np.ndarray], *, method: str, keep_float: tuple[str, ...] = (),
             weights: int = PAIR_BOUNDED, bias_correction: bool = True) -> onnx.ModelProto:
    """The QDQ int8 graph of a converted fp32 `model`, calibrated by `method` on its input `tensors`, the nodes
    named in `keep_float` left in float (guarded, so they stay so in onnxruntime's plans), its conv weights
    quantized again (depthwise at 8 bits, the others as `weights`, an Int8Weights) and (unless told not to) its
    biases corrected on `tensors` (convert.int8_passes); on a CPU with AMX, deep pointwise weights sent to the GEMM
    (convert.int8_forms)."""
    pair_bounded = weights != Int8Weights.INT8_WEIGHTS_FULL
    model = name_nodes(qdq_opset(model))
    card = read_card(model)
    with tempfile.TemporaryDirectory(prefix="scoremap-int8-") as folder:
        source, path = os.path.join(folder, "fp32.onnx"), os.path.join(folder, "int8.onnx")
        onnx.save(model, source)  # given a proto, quantize_static moves its weights out to a file in place
        with contextlib.redirect_stdout(io.StringIO()):  # onnxruntime prints its calibration's progress
            quantize_static(
                source, path, _Reader(card.preprocessing.input_name, tensors), quant_format=QuantFormat.QDQ,
                per_channel=True, reduce_range=REDUCE_RANGE, activation_type=QuantType.QUInt8,
                weight_type=QuantType.QInt8, calibrate_method=CALIBRATION_METHODS[method],
                calibration_providers=verify.PROVIDERS, nodes_to_exclude=list(keep_float),
                extra_options={"CalibStridedMinMax": 1, "TensorQuantOverrides": _input_overrides(card)})
        quantized = onnx.load(path)
    quantized.ir_version = model.ir_version
    quantized = requantize_weights(quantized, model, pair_bounded=pair_bounded)
    if bias_correction:
        quantized = correct_biases(quantized, model, tensors)
    if not pair_bounded and int8_kernels.gemm_on_amx():
        quantized = gemm_weights(quantized)
    return guard_float_layers(quantized, keep_float)


def _op_type(model: onnx.ModelProto, name: str) -> str:
    return next(node.op_type for node in model.graph.node if node.name == name)


def float_ops(model: onnx.ModelProto) -> list[str]:
    """Op types of a QDQ graph that run in float: no DequantizeLinear feeds them (onnxruntime fuses none), and they
    are not integer ops of their own (an integer classifier's MatMulInteger)."""
    dequantized = {node.output[0] for node in model.graph.node if node.op_type == "DequantizeLinear"}
    return sorted({node.op_type for node in model.graph.node
                   if node.op_type not in QDQ_OPS + INTEGER_OPS
                   and not any(name in dequantized for name in node.input if name)})


def _with_float_weights(candidate: onnx.ModelProto, reference: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """`candidate` with node `name`'s quantized weights and bias replaced by `reference`'s float ones (guarded, so
    they stay float): that layer kept in float, the rest of the int8 graph as it is."""
    out = onnx.ModelProto()
    out.CopyFrom(candidate)
    original = next(node for node in reference.graph.node if node.name == name)
    node = next(node for node in out.graph.node if node.name == name)
    floats = {tensor.name: tensor for tensor in reference.graph.initializer}
    for index in range(1, len(original.input)):
        if original.input[index] in floats:
            node.input[index] = f"{name}_float_input_{index}"
            out.graph.initializer.append(numpy_helper.from_array(numpy_helper.to_array(floats[original.input[index]]),
                                                                 node.input[index]))
    used = {value for other in out.graph.node for value in other.input}
    unused = [other for other in out.graph.node if other.op_type == "DequantizeLinear" and other.output[0] not in used]
    for other in unused:
        out.graph.node.remove(other)
    return guard_float_layers(out, (name,))


def fallback_ranking(reference: onnx.ModelProto, candidate: onnx.ModelProto, tensors: list[np.ndarray], *,
                     logits: bool, keep_float: tuple[str, ...] = ()) -> tuple[float, list[tuple[str, float]]]:
    """(the cells' class probabilities' signal-to-quantization-noise ratio in dB over `tensors`, [(layer, that ratio
    with the layer's weights put back in float)], highest first) for each quantized layer (one with quantized
    weights) of `candidate` not in `keep_float`; `logits`: the scores are logits (softmax first).

    Measured on the plan onnxruntime runs (fused), each layer in turn, the rest of the int8 graph as it is: what the
    check sees, not what a layer's own output loses (a layer's output SNR hides how its noise grows or fades on the
    way to the scores, and a ReLU folded into a convolution hides the convolution). Probabilities, as the check
    compares them, weigh the classes that hold a cell's top places; logits weigh a thousand unlikely classes alike."""
    producers = {output: node for node in candidate.graph.node for output in node.output}
    weights = {tensor.name for tensor in candidate.graph.initializer}
    names = [node.name for node in candidate.graph.node
             if node.op_type not in QDQ_OPS and node.name not in keep_float and len(node.input) > 1
             and getattr(producers.get(node.input[1]), "op_type", None) == "DequantizeLinear"
             and producers[node.input[1]].input[0] in weights]
    session = verify.session(reference)
    expected = [verify.probabilities(verify.run(session, tensor), logits=logits) for tensor in tensors]
    signal = sum(float(np.sum(value ** 2)) for value in expected)

    def snr(model: onnx.ModelProto) -> float:
        session = verify.session(model)
        noise = sum(float(np.sum((verify.probabilities(verify.run(session, tensor), logits=logits) - value) ** 2))
                    for tensor, value in zip(tensors, expected))
        return float(10 * np.log10(max(signal, 1e-30) / max(noise, 1e-30)))

    lifted = [(name, snr(_with_float_weights(candidate, reference, name))) for name in names]
    return snr(candidate), sorted(lifted, key=lambda entry: -entry[1])


def _worst_layer(reference: onnx.ModelProto, snr: float, ranking: list[tuple[str, float]]) -> str:
    """The first layer of `ranking` (`fallback_ranking`): the one that loses the most."""
    if not ranking:
        return "none: no layer is quantized"
    name, lifted = ranking[0]
    return (f"{_op_type(reference, name)} {name!r}: in float, it lifts the probabilities' signal-to-quantization-noise ratio "
            f"on the calibration photos the most of the quantized layers, from {snr:.1f} to {lifted:.1f} dB")


@dataclasses.dataclass(frozen=True)
class _Trial:
    method: str
    model: onnx.ModelProto
    calibration: Agreement

    @property
    def rank(self) -> tuple[float, float]:
        return self.calibration.top1_agreement, self.calibration.mean_map_correlation


def _shortfalls(name: str, record: Agreement, *, min_top1: float, min_correlation: float) -> list[str]:
    problems = []
    if record.top1_agreement < min_top1:
        problems.append(f"{name}: top-1 agreement {record.top1_agreement:.1%} of cells (needs {min_top1:.0%})")
    if record.map_correlation < min_correlation:
        problems.append(f"{name}: map correlation {record.map_correlation:.3f} (needs {min_correlation:g})")
    return problems


def _describe(name: str, record: Agreement) -> str:
    return (f"{name} ({record.images} photos at sides {list(record.sides)}): top-1 agreement "
            f"{record.top1_agreement:.1%} of cells, {record.image_top1_agreement:.0%} of images; map correlation "
            f"min {record.map_correlation:.3f}, mean {record.mean_map_correlation:.3f}; probability diff max "
            f"{record.max_probability_diff:.3f}, mean {record.mean_probability_diff:.2g}")


@dataclasses.dataclass(frozen=True)
class _Trials:
    """What every quantization trial of one conversion shares: the fp32 `model` and its `reference` session, the
    calibration photos (`calibration`: each photo's tensors at every side; `tensors`: all of them, as `quantize`
    calibrates on them), the weights' kind and the thresholds on the calibration photos."""

    model: onnx.ModelProto
    reference: onnxruntime.InferenceSession
    calibration: list[list[np.ndarray]]
    tensors: list[np.ndarray]
    sides: tuple[int, ...]
    logits: bool
    weights: int
    min_top1: float
    min_correlation: float

    def run(self, method: str, keep_float: tuple[str, ...]) -> _Trial:
        """The graph quantized by `method` with `keep_float` in float, checked on the calibration photos."""
        return self.judged(method, quantize(self.model, self.tensors, method=method, keep_float=keep_float,
                                            weights=self.weights))

    def judged(self, method: str, candidate: onnx.ModelProto) -> _Trial:
        """`candidate`, quantized by `method`, checked on the calibration photos."""
        return _Trial(method, candidate, verify.agreement(self.reference, candidate, self.calibration, sides=self.sides,
                                                          logits=self.logits))

    def shortfalls(self, trial: _Trial) -> list[str]:
        return _shortfalls("calibration photos", trial.calibration, min_top1=self.min_top1,
                           min_correlation=self.min_correlation)


def _fall_back(trials: _Trials, best: _Trial, kept: dict[str, str], ranking: list[tuple[str, float]], snr: float, *,
               max_layers: int) -> tuple[_Trial, dict[str, str]]:
    """Accuracy-driven mixed precision: while `best` falls short of the thresholds on the calibration photos, the next
    layer of `ranking` (`fallback_ranking` of `best`, whose SNR is `snr`) joins `kept` in float and the graph is
    quantized again, `max_layers` times at most (ranked once, as Intel Neural Compressor's fallback does: each
    ranking costs a run per quantized layer). The held-out photos take no part: they check the result."""
    fallen: dict[str, str] = {}
    for name, lifted in ranking[:max_layers]:
        problems = trials.shortfalls(best)
        if not problems:
            break
        fallen[name] = (f"the fallback's choice {len(fallen) + 1}: alone in float it lifted the probabilities' signal-to-"
                        f"quantization-noise ratio on the calibration photos from {snr:.1f} to {lifted:.1f} dB, "
                        f"where {'; '.join(problems)}")
        best = trials.run(best.method, (*kept, *fallen))
        log.info("int8 with %s kept in float too: %s", name, _describe("calibration", best.calibration))
    return best, fallen


def _prune(trials: _Trials, best: _Trial, kept: dict[str, str],
           fallen: dict[str, str]) -> tuple[_Trial, dict[str, str]]:
    """The fallback's layers that the passing graph no longer needs, put back in int8: each in the order the fallback
    chose it, the graph quantized again without it in float, and kept so when the calibration photos still pass (the
    thresholds, as the fallback itself stops at the first graph that meets them). A layer chosen while the graph
    was at its worst can be made unneeded by those chosen after it: on the default model the fallback's first layer
    (a 1152-to-320 projection) was, and the graph without it agreed better and ran faster (docs/design.md)."""
    if len(fallen) < 2 or trials.shortfalls(best):  # without its only layer the graph is the one that fell short
        return best, fallen
    chosen = list(fallen)
    for name in chosen:
        if name == chosen[-1] and len(fallen) == len(chosen):  # the graph before the last choice: it fell short
            break
        rest = {other: why for other, why in fallen.items() if other != name}
        trial = trials.run(best.method, (*kept, *rest))
        if not trials.shortfalls(trial):
            log.info("int8 with %s back in int8 (%s still in float): %s", name, ", ".join(rest),
                     _describe("calibration", trial.calibration))
            best, fallen = trial, rest
    return best, fallen


def _integer_classifier(trials: _Trials, best: _Trial, head: list[str]) -> _Trial:
    """`best` with its float classifier as integer sums (convert.int8_forms), where the calibration photos still pass
    with it (the thresholds, as `_prune` keeps a layer back in int8): its weights' rounding is a loss like any
    layer's, and on the default model the plan ran 1.01-1.04x faster with it (docs/design.md)."""
    candidate = integer_classifier(best.model, head, pair_bounded=trials.weights != Int8Weights.INT8_WEIGHTS_FULL)
    if candidate is best.model:
        return best
    trial = trials.judged(best.method, candidate)
    problems = trials.shortfalls(trial)
    log.info("int8 with the classifier as integer sums: %s%s", _describe("calibration", trial.calibration),
             f" (kept in float: {'; '.join(problems)})" if problems else "")
    return best if problems else trial


def to_int8(model: onnx.ModelProto, photos: PhotoSet, *, methods: tuple[str, ...] = tuple(CALIBRATION_METHODS),
            allow_precision_loss: bool = False, min_top1_agreement: float = MIN_TOP1_AGREEMENT,
            min_map_correlation: float = MIN_MAP_CORRELATION, max_fallback_layers: int = MAX_FALLBACK_LAYERS,
            min_weight_snr_db: float = FLOAT_LAYER_MIN_SNR_DB, weights: int = PAIR_BOUNDED) -> onnx.ModelProto:
    """The int8 graph of a converted fp32 graph, its card recording the calibration, the weights' levels (`weights`,
    an Int8Weights: pair-bounded, right on every CPU, unless asked for full 8 bits), the layers kept in float and
    the check.

    Convolutions whose weights alone, quantized, leave less than `min_weight_snr_db` stay in float from the start
    (convert.int8_passes.float_layers); below the thresholds on the calibration photos, up to `max_fallback_layers`
    more follow, in the order `fallback_ranking` measures (`_fall_back`), and those the passing graph no longer needs
    go back to int8 (`_prune`); then the classifier becomes integer sums where they still pass (`_integer_classifier`).
    Raises ConversionError, naming the numbers, the layers kept in float
    and the layer that loses the most, when the check still falls below the thresholds and `allow_precision_loss` is
    not given; with it, the card carries a warning."""
    try:
        card = read_card(model)
    except CardError as error:
        raise ConversionError(f"int8 needs a converted graph with its model card: {error}") from error
    if card.precision != Precision.PRECISION_FP32:
        raise ConversionError("int8 quantizes an fp32 graph; convert the classifier again with --precision int8")
    unknown = [method for method in methods if method not in CALIBRATION_METHODS]
    if unknown or not methods:
        raise ConversionError(f"calibration methods {unknown or list(methods)}; expected some of {list(CALIBRATION_METHODS)}")
    model = name_nodes(qdq_opset(model))
    sides = fed_sides(card)
    calibration = [[as_fed(photo, card, side=side) for side in sides] for photo in photos.calibration]
    held_out = [[as_fed(photo, card, side=side) for side in sides] for photo in photos.held_out]
    logits = is_logits(card)
    reference = verify.session(model)
    # Pair-bounded weights are never coarser than 7 bits (module docstring): the sensitivity assumes that coarsest case.
    kept = float_layers(model, [per_photo[0] for per_photo in calibration],
                        pointwise_bits=8 if weights == Int8Weights.INT8_WEIGHTS_FULL else 7, min_snr_db=min_weight_snr_db)
    tensors = [tensor for per_photo in calibration for tensor in per_photo]
    trials = _Trials(model, reference, calibration, tensors, sides, logits, weights, min_top1_agreement,
                     min_map_correlation)
    by_method = []
    for method in methods:
        by_method.append(trials.run(method, tuple(kept)))
        log.info("int8 with %s calibration: %s", method, _describe("calibration", by_method[-1].calibration))
    best = max(by_method, key=lambda trial: trial.rank)
    snr, ranking = fallback_ranking(model, best.model, tensors, logits=logits, keep_float=tuple(kept))
    best, fallen = _fall_back(trials, best, kept, ranking, snr, max_layers=max_fallback_layers)
    best, fallen = _prune(trials, best, kept, fallen)
    head = head_nodes(model)  # in `kept` from the start (float_layers)
    best = _integer_classifier(trials, best, head)
    integer = [name for name in head if classifier_in_integers(best.model, name)]
    kept = {name: INTEGER_CLASSIFIER if name in integer else INTEGER_HEAD if integer and name in head else why
            for name, why in {**kept, **fallen}.items()}
    held = verify.agreement(reference, best.model, held_out, sides=sides, logits=logits)
    worst = _worst_layer(model, snr, [entry for entry in ranking if entry[0] not in fallen])
    record = Quantization(
        method=best.method, calibration_source=photos.source,
        calibration_images=[photo.name for photo in photos.calibration],
        held_out_images=[photo.name for photo in photos.held_out], calibration=best.calibration, held_out=held,
        min_top1_agreement=min_top1_agreement, min_map_correlation=min_map_correlation,
        trials=[CalibrationTrial(method=trial.method, calibration=trial.calibration) for trial in by_method],
        worst_layer=worst, float_ops=float_ops(best.model), weights=weights,
        float_layers=[f"{_op_type(model, name)} {name!r}: {why}" for name, why in kept.items()])
    problems = [*_shortfalls("calibration photos", best.calibration, min_top1=min_top1_agreement,
                             min_correlation=min_map_correlation),
                *_shortfalls("held-out photos", held, min_top1=min_top1_agreement, min_correlation=min_map_correlation)]
    numbers = f"{_describe('calibration', best.calibration)}; {_describe('held out', held)}"
    bound = (f" (the fallback's bound: at most {max_fallback_layers} layers beyond the first choice)"
             if len(fallen) == max_fallback_layers else "")
    if problems and not allow_precision_loss:
        raise ConversionError(
            f"the int8 graph ({int8_kernels.describe(weights)} weights, {best.method} calibration, the best of "
            f"{[trial.method for trial in by_method]}) strays "
            f"from the fp32 graph: {'; '.join(problems)}. {numbers}. Kept in float{bound}: "
            f"{', '.join(f'{_op_type(model, name)} {name!r}' for name in kept)}. The layer that loses the most: "
            f"{worst}. "
            "Nothing written: keep this model in fp32 (or fp16 on a GPU), calibrate on photos like those it will "
            "score (--calibration DIR), or write it anyway with --allow-precision-loss")
    if problems:
        record.warning = f"written below the thresholds (--allow-precision-loss): {'; '.join(problems)}"
        log.warning("int8: %s", record.warning)
    card.precision = Precision.PRECISION_INT8
    card.quantization.CopyFrom(record)
    card.verification.CopyFrom(Verification(
        max_abs_diff=held.max_probability_diff, samples=held.images,
        passed=not problems, argmax_agreement=held.top1_agreement,
        reference=f"fp32 graph on {held.images} held-out photos at sides {list(sides)}: cell probabilities "
                  f"(max |diff|), cells' top-1 agreement; {numbers}"))
    return write_card(best.model, card)
