"""`scoremap-inspect`: a converted model's card, per-layer table and predicted peak memory.

    scoremap-inspect MODEL.onnx [--size 384x512] [--batch 4] [--device cpu|cuda] [--dtype fp16] [--budget 2GiB] [--json]

Without --size the table is for the card's default scale (a square), else its training size.
--device picks the execution provider whose memory terms (convert.memory_model) are printed.

Exit status: 0 printed, 1 the model cannot be profiled at that size, 2 bad arguments (a model path that is
no ONNX file included).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import onnx
from google.protobuf import json_format
from google.protobuf.message import DecodeError

from convert.arguments import memory_size, number_in, size_pair
from convert.card import CardError, ImageInput, Layout, OutputKind, Precision, label, parse_label, read_card
from convert.memory_model import PROVIDER_TERMS, Device
from convert.profile import (Profile, ProfileError, largest_batch, largest_square_size, load_skeleton,
                             profile_model)
from protos import version

__all__ = ["main", "format_table"]

# Square sizes are searched in steps of this when the model card names no size multiple.
DEFAULT_SIZE_MULTIPLE = 32


class NotAModel(ValueError):
    """The model argument names no readable ONNX file: a mistake on the command line (exit 2)."""


def open_model(path: str) -> onnx.ModelProto:
    """The ONNX file at `path`, its weights left unread; NotAModel saying what the path is instead."""
    expected = "expected a converted .onnx file (`scoremap-convert CLASSIFIER -o MODEL.onnx` makes one)"
    if not os.path.exists(path):
        raise NotAModel(f"{path!r}: no such file; {expected}")
    if os.path.isdir(path):
        raise NotAModel(f"{path!r} is a folder; {expected}")
    try:
        model = onnx.load(path, load_external_data=False)
    except DecodeError as error:
        raise NotAModel(f"{path!r} is not an ONNX file ({error}); {expected}") from error
    except OSError as error:
        raise NotAModel(f"cannot read {path!r}: {error.strerror or error}; {expected}") from error
    if not model.graph.node:  # an empty file parses as an empty ModelProto
        raise NotAModel(f"{path!r} is not an ONNX file (no graph in it); {expected}")
    return model


def cuda_visible() -> bool:
    """Whether a CUDA runtime loads here and sees a device (the probe memory measurement uses)."""
    from convert.cuda import cuda_free_bytes

    return cuda_free_bytes() is not None


def _mib(value: int) -> str:
    return f"{value / 2**20:,.1f} MiB"


def format_table(profile: Profile) -> str:
    """The per-layer table with totals, then every term of the predicted peak."""
    header = ("layer", "op", "output shape", "activations", "params", "MACs", "bytes")
    rows = [("input", "", "", f"{profile.input_activations:,}", "0", "0", f"{profile.input_bytes:,}")]
    for layer in profile.layers:
        rows.append((layer.name, layer.op, "x".join(map(str, layer.output_shape)), f"{layer.activations:,}",
                     f"{layer.params:,}", f"{layer.macs:,}", f"{layer.bytes:,}"))
    total = ("total", "", "", f"{profile.activations:,}", f"{profile.params:,}", f"{profile.macs:,}",
             f"{profile.naive_activation_bytes:,}")
    widths = [max(len(row[i]) for row in [header, *rows, total]) for i in range(len(header))]

    def line(row: tuple[str, ...]) -> str:
        cells = [cell.ljust(width) if i < 3 else cell.rjust(width) for i, (cell, width) in enumerate(zip(row, widths))]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * width for width in widths)
    saving = 1 - profile.peak_activation_bytes / profile.naive_activation_bytes if profile.naive_activation_bytes else 0.0
    terms = profile.terms
    memory = [
        f"Activations of batch {profile.batch} at {profile.height}x{profile.width} ({profile.dtype}):",
        f"  naive sum                        {_mib(profile.naive_activation_bytes):>14}  (every output kept)",
        f"  live peak                        {_mib(profile.peak_activation_bytes):>14}  "
        f"(at {profile.peak_layer}; memory planning saves {saving:.0%})",
        f"Predicted peak on {terms.device.value} (one session):",
        *(f"  {name:<32} {_mib(value):>14}  ({how})" for name, value, how in terms.rows()),
        f"  {'predicted peak':<32} {_mib(profile.predicted_peak_bytes):>14}  (sum of the terms)",
        *([f"In a server, of that: {_mib(terms.per_model).strip()} per model (however many plans), "
           f"{_mib(terms.per_plan).strip()} per plan (kept between runs), {_mib(terms.per_run).strip()} per running "
           "batch (the shared arena keeps the largest)."] if terms.per_model or terms.per_run else []),
        f"Terms fitted on: {PROVIDER_TERMS[terms.device].fitted_on}.",
        "Activations count the input and every new buffer a layer writes; aliasing layers (in-place"
        " element-wise ops, Reshape/Flatten) write none. MACs: Conv, Gemm and MatMul.",
    ]
    return "\n".join([line(header), rule, *map(line, rows), rule, line(total), "", *memory])


def _card_summary(card) -> str:
    rf = card.receptive_field
    labels = ", ".join(card.labels[:5]) + (", ..." if len(card.labels) > 5 else "")
    return "\n".join([
        f"Model {card.name!r}: {len(card.labels)} classes, {label(Precision, card.precision)}, scores {card.scores_name!r} "
        f"({label(OutputKind, card.output_kind)}), stride {card.output_stride} px, "
        + (f"sizes multiple of {card.size_multiple}" if card.size_multiple else "any input size"),
        f"  labels: {labels}",
        f"  input {ImageInput.of(card).describe()}",
        f"  training size {card.training_height}x{card.training_width}, default scale {card.default_scale or 'none'}",
        f"  cell (i, j) centred at ({rf.center_y:g} + {card.output_stride}i, {rf.center_x:g} + {card.output_stride}j) "
        f"input pixels, receptive field {rf.size} px",
        f"  source: {card.source}",
        f"  verified against {card.verification.reference or 'the source'}: max |diff| {card.verification.max_abs_diff:.3g} "
        f"(tolerance {card.verification.tolerance:.3g}), {'passed' if card.verification.passed else 'FAILED'}",
    ])


def _default_size(card) -> tuple[int, int] | None:
    """The size to profile when none is asked: the card's default scale, else its training size."""
    if card is None:
        return None
    if card.default_scale:
        return card.default_scale, card.default_scale
    if card.training_height and card.training_width:
        return card.training_height, card.training_width
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scoremap-inspect", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    parser.add_argument("model", help="a converted .onnx file")
    parser.add_argument("--size", type=size_pair,
                        help="input size HxW in pixels, e.g. 384x512 (default: the card's default scale)")
    parser.add_argument("--batch", type=number_in(int, 1), default=1, help="images per run (default 1)")
    parser.add_argument("--device", choices=[device.value for device in Device], default=Device.CPU.value,
                        help="execution provider whose memory terms to apply (default cpu)")
    parser.add_argument("--layout", choices=("NCHW", "NHWC"),
                        help="the image input's layout, for a graph without a model card")
    parser.add_argument("--dtype", choices=("fp32", "fp16"),
                        help="profile as this precision (fp16 of an fp32 graph: converted, unverified, for sizing)")
    parser.add_argument("--budget", type=memory_size, help="a memory budget such as 2GiB: largest batch and square size that fit")
    parser.add_argument("--json", action="store_true", help="print JSON for programs instead of tables")
    args = parser.parse_args(argv)
    try:
        card = read_card(open_model(args.model))
    except CardError:
        card = None
    except NotAModel as error:
        sys.stderr.write(f"scoremap-inspect: {error}\n")
        return 2
    size = args.size or _default_size(card)
    if size is None:
        parser.error(f"{args.model} has no model card naming a size: give --size HxW")
    height, width = size
    device = Device(args.device)
    if device is Device.CUDA and not cuda_visible():
        sys.stderr.write("scoremap-inspect: no CUDA device is visible on this machine: the figures below are "
                         "predicted for a CUDA GPU elsewhere, not measured or checked here\n")
    layout = parse_label(Layout, args.layout) if args.layout else None
    try:
        model = load_skeleton(args.model, layout=layout)
        profile = profile_model(model, height=height, width=width, batch=args.batch, device=device)
        if args.dtype and args.dtype != profile.dtype:
            if args.dtype != "fp16":
                raise ProfileError(f"--dtype {args.dtype} of a {profile.dtype} graph is not supported; convert it again")
            from convert.precision import fp16_graph

            model = load_skeleton(fp16_graph(onnx.load(args.model)), layout=model.layout)
            profile = profile_model(model, height=height, width=width, batch=args.batch, device=device)
        budget = {}
        if args.budget is not None:
            multiple = (card.size_multiple if card is not None else 0) or DEFAULT_SIZE_MULTIPLE
            budget = {
                "budget_bytes": args.budget,
                "largest_batch": largest_batch(model, height=height, width=width, budget_bytes=args.budget, device=device),
                "largest_square_size": largest_square_size(model, budget_bytes=args.budget, multiple=multiple,
                                                           device=device),
            }
    except ProfileError as error:
        sys.stderr.write(f"scoremap-inspect: {error}\n")
        return 1
    if args.json:
        document = profile.to_dict()
        document["card"] = json_format.MessageToDict(card, preserving_proto_field_name=True) if card is not None else None
        document.update(budget)
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
        return 0
    sections = [_card_summary(card) if card is not None else f"{args.model}: no model card (not converted by scoremap-convert)"]
    sections.append(format_table(profile))
    if budget:
        sections.append(
            f"Budget {_mib(budget['budget_bytes'])} on {device.value}: largest batch at {height}x{width} = "
            f"{budget['largest_batch']}; "
            f"largest square size at batch 1 = {budget['largest_square_size']} px"
        )
    sys.stdout.write("\n\n".join(sections) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
