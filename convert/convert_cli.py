"""`scoremap-convert SOURCE -o OUT.onnx`: a classifier into a verified dense scorer.

Exit status: 0 converted (and written), 1 the classifier cannot be converted faithfully or the
report image cannot be read (nothing written), 2 bad usage.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile

import numpy as np
import onnx
from PIL import Image

from convert.arguments import size_pair
from convert.card import ChannelOrder, OutputKind, label, parse_label, read_card
from convert.errors import ConversionError
from convert.pipeline import SUPPORTED_OUTPUT_STRIDES, convert_classifier
from convert.precision import to_fp16
from convert.preprocessing import to_input
from convert.sources import load_source
from convert.verify import compare_with_crops
from protos.model_card_pb2 import Preprocessing

EXIT_OK, EXIT_CONVERSION, EXIT_USAGE = 0, 1, 2
# Side, in pixels, the --report image is resized to when --size is not given.
DEFAULT_REPORT_SIZE = 384


def floats(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected comma-separated numbers, e.g. 123.7,116.3,103.5") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scoremap-convert", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="'default', an .onnx file, a TorchScript file, or package.module:factory")
    p.add_argument("-o", "--output", required=True, help="where to write the converted .onnx")
    p.add_argument("--training-size", type=size_pair, help="input size the classifier was trained at (N or HxW); needed when the input size is symbolic")
    p.add_argument("--output-stride", type=int, default=32, choices=SUPPORTED_OUTPUT_STRIDES, help="pixels between cells; 16 or 8 apply the à trous rewrite")
    p.add_argument("--state-dict", help="state dict loaded strictly into a package.module:factory model")
    p.add_argument("--name", help="model name in the card (default: from the source)")
    p.add_argument("--labels", help="text file with one class name per line")
    p.add_argument("--mean", type=floats, help="per-channel mean subtracted after scaling (card preprocessing)")
    p.add_argument("--std", type=floats, help="per-channel std divided by after subtracting the mean")
    p.add_argument("--pixel-scale", type=float, help="pixels (0..255) are multiplied by this first, e.g. 0.00392157 for 0..1")
    p.add_argument("--channel-order", choices=("RGB", "BGR"), help="channel order the classifier expects")
    p.add_argument("--report", metavar="IMAGE", help="compare each dense cell with the classifier on its crop of IMAGE")
    p.add_argument("--size", type=int, default=DEFAULT_REPORT_SIZE, help="side the --report image is resized to (square)")
    p.add_argument("--precision", choices=("fp32", "fp16"), default="fp32",
                   help="fp16: half the memory, float32 at the edges, checked against fp32; for GPUs (slow on CPU)")
    p.add_argument("--traceback", action="store_true", help="show the full traceback on failure")
    return p


def preprocessing_options(args: argparse.Namespace) -> Preprocessing | None:
    """The card preprocessing given on the command line, or None to keep the source's."""
    if args.mean is None and args.std is None and args.pixel_scale is None and args.channel_order is None:
        return None
    channels = len(args.mean or args.std or [0, 0, 0])
    return Preprocessing(
        channel_order=parse_label(ChannelOrder, args.channel_order or "RGB"), pixel_scale=args.pixel_scale if args.pixel_scale is not None else 1.0,
        mean=args.mean or [0.0] * channels, std=args.std or [1.0] * channels, resize_filter="bilinear",
    )


def conversion_options(args: argparse.Namespace) -> dict:
    """Keyword options for convert_classifier from the command line."""
    labels = None
    if args.labels:
        with open(args.labels, encoding="utf-8") as handle:
            labels = [line.strip() for line in handle if line.strip()]
    return dict(training_size=args.training_size, output_stride=args.output_stride, name=args.name, labels=labels,
                preprocessing=preprocessing_options(args), state_dict=args.state_dict)


def save_atomically(model: onnx.ModelProto, path: str) -> None:
    """Write to a temporary file beside `path`, then rename: a failed write leaves nothing behind."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    handle, temporary = tempfile.mkstemp(suffix=".onnx.part", dir=folder)
    os.close(handle)
    try:
        onnx.save(model, temporary)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def crop_report(source: str, converted: onnx.ModelProto, args: argparse.Namespace) -> str:
    """The dense-vs-crops comparison on one image, as text."""
    card = read_card(converted)
    try:
        with Image.open(args.report) as image:
            pixels = np.asarray(image.convert("RGB").resize((args.size, args.size), Image.Resampling.BILINEAR), np.float32)
    except OSError as error:
        raise ConversionError(f"cannot read report image {args.report!r}: {error}") from error
    original = load_source(source, training_size=(card.training_height, card.training_width), state_dict=args.state_dict).model
    tensor = to_input(pixels[None], card.preprocessing)
    training = (card.training_height, card.training_width)
    report = compare_with_crops(original, converted, tensor, layout=card.preprocessing.layout, training_size=training,
                                stride=card.output_stride)
    return (
        f"report on {args.report} at {args.size}x{args.size}: {report.cells} cells ({report.grid[0]}x{report.grid[1]}) "
        f"vs the classifier on each {training[0]}x{training[1]} crop\n"
        f"  max abs diff {report.max_abs_diff:.4g}, mean abs diff {report.mean_abs_diff:.4g}, "
        f"argmax agreement {report.argmax_agreement:.1%}\n"
        "  (padded nets differ: a crop is zero-padded at its borders, a dense cell sees the real neighbours)"
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        converted = convert_classifier(args.source, **conversion_options(args))
        report = crop_report(args.source, converted, args) if args.report else None
        if args.precision == "fp16":
            converted = to_fp16(converted)
        save_atomically(converted, args.output)
    except (ConversionError, OSError) as error:
        if args.traceback:
            raise
        sys.stderr.write(f"scoremap-convert: {error}\n")
        return EXIT_CONVERSION
    card = read_card(converted)
    sys.stdout.write(
        f"wrote {args.output}: {card.name}, {len(card.labels)} classes ({label(OutputKind, card.output_kind)}), stride {card.output_stride}, "
        f"receptive field {card.receptive_field.size} px, verified max abs diff {card.verification.max_abs_diff:.3g} "
        f"(allowed {card.verification.tolerance:.3g})\n")
    if report:
        sys.stdout.write(report + "\n")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
