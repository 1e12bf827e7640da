"""`scoremap-convert SOURCE -o OUT.onnx --preprocessing NAME`: a classifier into a verified dense scorer.

A bare ONNX or PyTorch classifier does not say how its pixels were normalised in training, so
choose: --preprocessing NAME (a preset below), or --mean/--std/--pixel-scale/--channel-order
(on top of a preset, or of `raw`). Means and stds are in the graph's channel order; one value
stands for every channel. The default model carries its own.

Exit status: 0 converted (and written), 1 the classifier cannot be converted faithfully or the
report image cannot be read (nothing written; the image is read before converting), 2 bad usage (an
option, a missing file, factory or label set, no preprocessing chosen, an already converted graph).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

from convert.arguments import DEFAULT_OUTPUT_STRIDE, SUPPORTED_OUTPUT_STRIDES, number_in, number_list, size_pair
from convert.errors import ConversionError, UsageError
from convert.int8_kernels import WEIGHT_CHOICES
from convert.labels import LABEL_SETS
from convert.presets import PRESETS
from protos import version

if TYPE_CHECKING:
    import numpy as np
    import onnx

    from protos.model_card_pb2 import Preprocessing

# Everything heavier (onnx, onnxruntime, onnxscript, torch for PyTorch sources) is imported after
# the arguments parse, so `--help` and usage errors answer at once.

EXIT_OK, EXIT_CONVERSION, EXIT_USAGE = 0, 1, 2
# Side, in pixels, the --report image is resized to when --size is not given (--size needs --report).
DEFAULT_REPORT_SIZE = 384
# The largest --size: the report runs the classifier once per cell's crop, (size / stride)^2 runs.
MAX_REPORT_SIZE = 2048
# Bounds of the numeric options: pixel values stay within what float32 represents; a std or pixel scale
# at or below the floor would divide or multiply the pixels to nothing.
PIXEL_BOUND = 1e6
SCALE_FLOOR = 1e-6
# Loggers whose warnings reach the user without --verbose; third-party ones (torch's exporter) go to the debug log.
OWN_LOGGERS = ("convert", "__main__")


def presets_help() -> str:
    return "; ".join(f"{name}: {entry[-1]}" for name, entry in PRESETS.items())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scoremap-convert", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="'default', an .onnx file, a TorchScript file, or package.module:factory (imported from the current folder too)")
    p.add_argument("-o", "--output", required=True, help="where to write the converted .onnx")
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    p.add_argument("--preprocessing", choices=sorted(PRESETS), help=f"how pixels were normalised in training: {presets_help()}")
    p.add_argument("--mean", type=number_list(float, -PIXEL_BOUND, PIXEL_BOUND), help="mean subtracted after scaling, per channel or one for all (overrides the preset's)")
    p.add_argument("--std", type=number_list(float, SCALE_FLOOR, PIXEL_BOUND), help="std divided by after subtracting the mean, per channel or one for all")
    p.add_argument("--pixel-scale", type=number_in(float, SCALE_FLOOR, PIXEL_BOUND), help="pixels (0..255) are multiplied by this first, e.g. 0.00392157 for 0..1")
    p.add_argument("--channel-order", choices=("RGB", "BGR"), help="channel order the classifier expects (default: the preset's, else RGB)")
    p.add_argument("--labels", help=f"text file with one class name per line, or one of {sorted(LABEL_SETS)}")
    p.add_argument("--training-size", type=size_pair, help="input size the classifier was trained at (N or HxW); needed when the input size is symbolic")
    p.add_argument("--output-stride", type=int, default=DEFAULT_OUTPUT_STRIDE, choices=SUPPORTED_OUTPUT_STRIDES, help="pixels between cells; 16 or 8 apply the à trous rewrite")
    p.add_argument("--state-dict", help="state dict loaded strictly into a package.module:factory model")
    p.add_argument("--name", help="model name in the card (default: from the source)")
    p.add_argument("--report", metavar="IMAGE", help="compare each dense cell with the classifier on its crop of IMAGE")
    p.add_argument("--size", type=number_in(int, 1, MAX_REPORT_SIZE),
                   help=f"side the --report image is resized to (square; default {DEFAULT_REPORT_SIZE}); needs --report")
    p.add_argument("--precision", choices=("fp32", "fp16", "int8"), default="fp32",
                   help="fp16: half the memory, float32 at the edges, checked against fp32; for GPUs (slow on CPU). "
                        "int8: int8 weights and uint8 activations, calibrated on photos and checked against fp32 "
                        "(refused below the thresholds); for CPUs")
    p.add_argument("--calibration", metavar="DIR",
                   help="int8: a folder of photos like those the model will score (every 4th is held out to check "
                        "the result; default: the project's samples and scikit-image's bundled photos)")
    p.add_argument("--calibration-method", choices=("auto", "minmax", "entropy", "percentile"), default="auto",
                   help="int8: how activation ranges are calibrated (auto: each tried, the one agreeing best with "
                        "fp32 on the calibration photos kept)")
    p.add_argument("--int8-weights", choices=("auto", *WEIGHT_CHOICES), default="auto",
                   help="int8: the weights' levels in convolutions that are not depthwise. full: 8 bits, closer to "
                        "fp32, but wrong on CPUs whose int8 kernels sum in 16 bits (x86 without VNNI or AMX), which "
                        "refuse to load it; pair-bounded: a little coarser, right on every CPU; auto: full where this "
                        "CPU's kernels sum in 32 bits, else pair-bounded (docs/converting.md)")
    p.add_argument("--allow-precision-loss", action="store_true",
                   help="int8: write the graph even below the agreement thresholds, with a warning in its card")
    p.add_argument("--verbose", action="store_true", help="show progress and third-party warnings (torch's exporter)")
    p.add_argument("--traceback", action="store_true", help="show the full traceback on failure")
    return p


def preprocessing_options(args: argparse.Namespace) -> Preprocessing | None:
    """The card preprocessing chosen on the command line (a preset, explicit values on top), or None for the source's."""
    from convert.presets import preset

    explicit = (args.mean, args.std, args.pixel_scale, args.channel_order)
    if args.preprocessing is None and all(value is None for value in explicit):
        return None
    chosen = preset(args.preprocessing or "raw")
    if args.mean is not None:
        chosen.ClearField("mean")
        chosen.mean.extend(args.mean)
    if args.std is not None:
        chosen.ClearField("std")
        chosen.std.extend(args.std)
    if args.pixel_scale is not None:
        chosen.pixel_scale = args.pixel_scale
    if args.channel_order is not None:
        from convert.card import ChannelOrder, parse_label

        chosen.channel_order = parse_label(ChannelOrder, args.channel_order)
    return chosen


def conversion_options(args: argparse.Namespace) -> dict:
    """Keyword options for convert_classifier from the command line."""
    from convert.labels import read_labels

    return dict(training_size=args.training_size, output_stride=args.output_stride, name=args.name,
                labels=read_labels(args.labels) if args.labels else None,
                preprocessing=preprocessing_options(args), state_dict=args.state_dict, require_preprocessing=True)


def save(model: onnx.ModelProto, path: str) -> None:
    """Write to a temporary file beside `path`, then rename: a failed write leaves nothing behind, and the file
    gets the umask's permissions like any other output (a mkstemp file would stay 0600)."""
    import onnx

    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    temporary = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.part")
    try:
        onnx.save(model, temporary)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def report_pixels(path: str, size: int) -> np.ndarray:
    """The --report image decoded whole and resized to size x size, float32 RGB: read before converting,
    so a truncated or unreadable image fails at once, not after the conversion."""
    import numpy as np
    from PIL import Image

    try:
        with Image.open(path) as image:
            return np.asarray(image.convert("RGB").resize((size, size), Image.Resampling.BILINEAR), np.float32)
    except (OSError, SyntaxError, ValueError) as error:
        raise ConversionError(f"cannot read report image {path!r}: {error}; nothing was converted") from error


def refuse_converted(source: str) -> None:
    """A graph scoremap-convert already made is refused (UsageError): its head is convolutional, so the
    surgery would find no classifier head to rewrite, and its card already says how to serve it. A .onnx that
    does not parse is a UsageError too."""
    if not source.lower().endswith(".onnx") or not os.path.isfile(source):
        return
    import onnx
    from google.protobuf.message import DecodeError

    from convert.card import METADATA_KEY

    try:
        model = onnx.load(source, load_external_data=False)
    except DecodeError as error:
        raise UsageError(f"{source!r} is not an ONNX file ({error}); expected an ONNX classifier") from error
    if any(prop.key == METADATA_KEY for prop in model.metadata_props):
        raise UsageError(f"{source!r} is already converted (it carries a scoremap model card): serve or inspect it "
                         "as it is (scoremap-serve, scoremap-inspect), or convert its original classifier")


def crop_report(source: str, converted: onnx.ModelProto, pixels: np.ndarray, args: argparse.Namespace) -> str:
    """The dense-vs-crops comparison on one image, as text."""
    from convert.card import ImageInput, read_card
    from convert.normalize import reference, runnable
    from convert.preprocessing import to_input
    from convert.sources import load_source
    from convert.verify import compare_with_crops

    card = read_card(converted)
    training = (card.training_height, card.training_width)
    source_model = load_source(source, training_size=training, state_dict=args.state_dict).model
    original = reference(source_model, runnable(source_model))
    image_input = ImageInput.of(card)
    report = compare_with_crops(original, converted, to_input(pixels[None], image_input), layout=image_input.layout,
                                training_size=training, stride=card.output_stride)
    return (
        f"report on {args.report} at {pixels.shape[0]}x{pixels.shape[1]}: {report.cells} cells ({report.grid[0]}x{report.grid[1]}) "
        f"vs the classifier on each {training[0]}x{training[1]} crop\n"
        f"  max abs diff {report.max_abs_diff:.4g}, mean abs diff {report.mean_abs_diff:.4g}, "
        f"argmax agreement {report.argmax_agreement:.1%}\n"
        "  (padded nets differ: a crop is zero-padded at its borders, a dense cell sees the real neighbours)"
    )


def calibration_photos(folder: str | None):
    """The int8 photos, read before converting: a missing folder or too few photos fail at once."""
    from convert.calibration import default_set, folder_set

    return folder_set(folder) if folder else default_set()


def int8_summary(card) -> str:
    """The int8 check in a few lines: the method chosen, both photo sets' numbers, the worst layer."""
    from convert.int8_kernels import describe

    q = card.quantization
    lines = [f"int8: {describe(q.weights)} weights, {q.method} calibration (tried "
             f"{', '.join(trial.method for trial in q.trials)}) on {len(q.calibration_images)} photos from "
             f"{q.calibration_source}"]
    for name, record in (("calibration", q.calibration), ("held out", q.held_out)):
        lines.append(f"  {name}: {record.images} photos at sides {list(record.sides)}: top-1 agreement "
                     f"{record.top1_agreement:.1%} of cells ({record.image_top1_agreement:.0%} of images), map "
                     f"correlation min {record.map_correlation:.3f} (mean {record.mean_map_correlation:.3f}), "
                     f"probability diff max {record.max_probability_diff:.3f}")
    lines.extend(f"  kept in float: {layer}" for layer in q.float_layers)
    lines.append(f"  thresholds: top-1 >= {q.min_top1_agreement:.0%}, map correlation >= {q.min_map_correlation:g}; "
                 f"worst layer {q.worst_layer}")
    if q.warning:
        lines.append(f"  WARNING: {q.warning}")
    return "\n".join(lines)


def configure_logging(*, verbose: bool) -> None:
    """Our warnings always; progress and third-party messages (torch's exporter) only with --verbose."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    if not verbose:
        handler.addFilter(lambda record: record.name.split(".")[0] in OWN_LOGGERS)
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, handlers=[handler], force=True)


def main(argv: list[str] | None = None) -> int:
    arguments = parser()
    args = arguments.parse_args(argv)
    if args.size is not None and not args.report:
        arguments.error("--size is the side of the --report image; pass --report IMAGE with it, or drop --size")
    int8_only = [flag for flag, given in (("--calibration", args.calibration is not None),
                                          ("--calibration-method", args.calibration_method != "auto"),
                                          ("--int8-weights", args.int8_weights != "auto"),
                                          ("--allow-precision-loss", args.allow_precision_loss)) if given]
    if int8_only and args.precision != "int8":
        arguments.error(f"{', '.join(int8_only)} apply to --precision int8; add it, or drop them")
    configure_logging(verbose=args.verbose)
    # A console script, unlike `python -m`, does not put the current folder on sys.path: do, so that
    # `scoremap-convert mynets:vgg_like` finds mynets.py where the user stands.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        from convert.card import OutputKind, label, read_card
        from convert.pipeline import convert_classifier
        from convert.precision import to_fp16

        refuse_converted(args.source)
        pixels = report_pixels(args.report, args.size or DEFAULT_REPORT_SIZE) if args.report else None
        photos = calibration_photos(args.calibration) if args.precision == "int8" else None
        converted = convert_classifier(args.source, **conversion_options(args))
        report = crop_report(args.source, converted, pixels, args) if args.report else None
        if args.precision == "fp16":
            converted = to_fp16(converted)
        elif args.precision == "int8":
            from convert.int8_kernels import weights_for
            from convert.quantize import CALIBRATION_METHODS, to_int8

            methods = tuple(CALIBRATION_METHODS) if args.calibration_method == "auto" else (args.calibration_method,)
            converted = to_int8(converted, photos, methods=methods, allow_precision_loss=args.allow_precision_loss,
                                weights=weights_for(args.int8_weights))
        save(converted, args.output)
    except (ConversionError, OSError) as error:
        if args.traceback:
            raise
        sys.stderr.write(f"scoremap-convert: {error}\n")
        return EXIT_USAGE if isinstance(error, UsageError) else EXIT_CONVERSION
    card = read_card(converted)
    verified = ("int8, checked against fp32 on photos:" if card.HasField("quantization") else
                f"verified max abs diff {card.verification.max_abs_diff:.3g} (allowed {card.verification.tolerance:.3g})")
    sys.stdout.write(
        f"wrote {args.output}: {card.name}, {len(card.labels)} classes ({label(OutputKind, card.output_kind)}), "
        f"stride {card.output_stride} (native {card.native_output_stride}), receptive field {card.receptive_field.size} px, "
        f"{verified}\n")
    if card.HasField("quantization"):
        sys.stdout.write(int8_summary(card) + "\n")
    if report:
        sys.stdout.write(report + "\n")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
