"""`scoremap-export triton MODEL.onnx OUT/`: a Triton model repository for a converted graph.

Fleets that already run NVIDIA Triton serve the dense graph there: the graph
itself (platform `onnxruntime_onnx`, H and W dynamic), its labels as Triton's label file, dynamic
batching with the largest batch the memory profile (`convert.profile.largest_batch`, the numbers
`scoremap-inspect` prints) fits in the GPU memory given, GPU instance groups, the CUDA or TensorRT
settings (fp16 TensorRT when the card says the graph is fp16) and warm-up passes at the card's
scales, so the first request of each shape is not the one that pays for it. Triton then runs the
net; resizing, the shifted passes, stitching and top-k stay with the caller (or scoremap-serve).

    OUT/NAME/config.pbtxt
    OUT/NAME/labels.txt
    OUT/NAME/1/model.onnx
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError

from convert.arguments import memory_size, number_in
from convert.card import CardError, ImageInput, Layout, Precision, batch_shape, read_card, spatial_axes
from convert.memory_model import Device
from convert.profile import ProfileError, largest_batch
from protos import version

DEFAULT_GPU_MEMORY = "16GiB"  # the smallest data-centre card in common use (T4, V100-16G)
DEFAULT_QUEUE_DELAY_US = 0  # as scoremap-serve's --max-queue-delay-ms default: work-conserving
MAX_TRITON_BATCH = 64  # beyond this a dense map's batch only adds latency
TENSORRT_WORKSPACE_BYTES = 2**30  # TensorRT's scratch space per engine (the onnxruntime backend's example)
LANDSCAPE = (3, 4)  # warm-up and sizing canvases: the common photo aspect, shorter side = the scale
TRITON_DTYPES = {np.dtype(np.float32): "TYPE_FP32", np.dtype(np.float16): "TYPE_FP16", np.dtype(np.uint8): "TYPE_UINT8"}
FORMATS = {Layout.LAYOUT_NCHW: "FORMAT_NCHW", Layout.LAYOUT_NHWC: "FORMAT_NHWC"}
LABELS_NAME = "labels.txt"
CONFIG_NAME = "config.pbtxt"
MODEL_FILE = "model.onnx"
VERSION = "1"


class ExportError(ValueError):
    """Why a repository cannot be written, in words for the user."""


@dataclass(frozen=True)
class TritonPlan:
    """What the repository says, decided from the card and the memory profile."""

    name: str
    max_batch_size: int
    canvases: tuple[tuple[int, int], ...]  # (height, width) of each warm-up scale
    instances: int
    queue_delay_us: int
    tensorrt: bool


def canvas(scale: int, multiple: int) -> tuple[int, int]:
    """The landscape canvas of a scale: shorter side `scale`, both sides rounded up to `multiple`."""
    step = max(1, multiple)
    short, long = LANDSCAPE
    return step * math.ceil(scale / step), step * math.ceil(scale * long / short / step)


def plan(model: onnx.ModelProto, *, name: str = "", gpu_memory_bytes: int, instances: int = 1,
         scales: Sequence[int] = (), queue_delay_us: int = DEFAULT_QUEUE_DELAY_US,
         tensorrt: bool = False) -> TritonPlan:
    """The repository's settings; the batch is the largest whose GPU peak at the largest scale fits one instance."""
    card = read_card(model)
    if instances < 1:
        raise ExportError(f"--instances {instances}: give at least 1 instance per GPU")
    scales = tuple(scales) or (card.default_scale or card.training_height,)
    canvases = tuple(canvas(scale, card.size_multiple) for scale in scales)
    largest = max(canvases, key=lambda size: size[0] * size[1])
    try:
        batch = largest_batch(model, height=largest[0], width=largest[1], budget_bytes=gpu_memory_bytes // instances,
                              device=Device.CUDA)
    except ProfileError as error:
        raise ExportError(f"cannot profile the graph at {largest[0]}x{largest[1]}: {error}") from error
    if batch == 0:
        raise ExportError(f"one {largest[0]}x{largest[1]} pass is predicted to need more than "
                          f"{gpu_memory_bytes // instances} bytes (GPU memory / instances): give a card with more "
                          "--gpu-memory, fewer --instances or smaller --scales")
    return TritonPlan(name=name or card.name or "scoremap", max_batch_size=min(batch, MAX_TRITON_BATCH),
                      canvases=canvases, instances=instances, queue_delay_us=queue_delay_us, tensorrt=tensorrt)


def _graph_input(model: onnx.ModelProto, image: ImageInput) -> onnx.ValueInfoProto:
    for value in model.graph.input:
        if value.name == image.name:
            return value
    raise ExportError(f"the card names input {image.name!r}, the graph has {[v.name for v in model.graph.input]}: "
                      "was the graph edited after conversion? convert it again")


def config_text(model: onnx.ModelProto, settings: TritonPlan) -> str:
    """config.pbtxt (protobuf text format of Triton's ModelConfig)."""
    card = read_card(model)
    image = ImageInput.of(card)
    dims = [d.dim_value or -1 for d in _graph_input(model, image).type.tensor_type.shape.dim]
    channels = next(size for axis, size in enumerate(dims) if axis and axis not in spatial_axes(image.layout))
    input_dims = batch_shape(image.layout, batch=1, channels=channels, height=-1, width=-1)[1:]
    fp16 = card.precision == Precision.PRECISION_FP16
    lines = [
        f'name: "{settings.name}"',
        'platform: "onnxruntime_onnx"',
        f"max_batch_size: {settings.max_batch_size}",
        f'input [{{ name: "{image.name}" data_type: {TRITON_DTYPES[image.dtype]} format: {FORMATS[image.layout]} '
        f"dims: {input_dims} }}]",
        f'output [{{ name: "{card.scores_name}" data_type: TYPE_FP32 dims: [{len(card.labels)}, -1, -1] '
        f'label_filename: "{LABELS_NAME}" }}]',
        "dynamic_batching {",
        f"  preferred_batch_size: {_preferred(settings.max_batch_size)}",
        f"  max_queue_delay_microseconds: {settings.queue_delay_us}",
        "}",
        f"instance_group [{{ kind: KIND_GPU count: {settings.instances} }}]",
        "optimization { execution_accelerators { gpu_execution_accelerator: [",
    ]
    if settings.tensorrt:  # TensorRT runs what it can; the CUDA provider below takes the rest
        lines += [
            '  { name: "tensorrt"',
            f'    parameters {{ key: "precision_mode" value: "{"FP16" if fp16 else "FP32"}" }}',
            f'    parameters {{ key: "max_workspace_size_bytes" value: "{TENSORRT_WORKSPACE_BYTES}" }}',
            '    parameters { key: "trt_engine_cache_enable" value: "1" } },',
        ]
    # Shapes vary with every image size: heuristic cuDNN search, as scoremap-serve's default.
    lines += ['  { name: "cuda" parameters { key: "cudnn_conv_algo_search" value: "HEURISTIC" } }', "] } }"]
    for height, width in settings.canvases:
        warm = batch_shape(image.layout, batch=1, channels=channels, height=height, width=width)[1:]
        lines += [
            f'model_warmup [{{ name: "{height}x{width}" batch_size: 1 count: 1',
            f'  inputs {{ key: "{image.name}" value: {{ data_type: {TRITON_DTYPES[image.dtype]} dims: {warm} '
            "zero_data: true } }",
            "}]",
        ]
    return "\n".join(lines) + "\n"


def _preferred(max_batch: int) -> list[int]:
    """Powers of two up to the largest batch (vLLM's and TensorRT's habit: a few shapes, each prepared)."""
    sizes = [2**power for power in range(1, max_batch.bit_length()) if 2**power <= max_batch]
    return sizes or [max_batch]


def export(model_path: str | Path, out: str | Path, settings: TritonPlan | None = None, **plan_options) -> Path:
    """Write the repository for the converted graph at `model_path` under `out`; returns the model's folder."""
    try:
        model = onnx.load(str(model_path), load_external_data=False)
    except DecodeError as error:
        raise ExportError(f"{model_path} is not an ONNX file ({error}); export a graph made by "
                          "scoremap-convert") from error
    try:
        card = read_card(model)
    except CardError as error:
        raise ExportError(f"{model_path}: {error}") from error
    settings = settings or plan(model, **plan_options)
    folder = Path(out) / settings.name
    (folder / VERSION).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(model_path, folder / VERSION / MODEL_FILE)
    (folder / LABELS_NAME).write_text("".join(f"{label}\n" for label in card.labels), encoding="utf-8")
    (folder / CONFIG_NAME).write_text(config_text(model, settings), encoding="utf-8")
    return folder


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scoremap-export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    targets = parser.add_subparsers(dest="target", required=True)
    triton = targets.add_parser("triton", help="a Triton model repository (onnxruntime backend)")
    triton.add_argument("model", help="a graph made by scoremap-convert")
    triton.add_argument("out", help="the model repository folder (created; the model goes in OUT/NAME)")
    triton.add_argument("--name", default="", help="the model's name in Triton (default: the card's)")
    triton.add_argument("--gpu-memory", type=memory_size, default=DEFAULT_GPU_MEMORY,
                        help="memory of the GPU it will run on, e.g. 24GiB: sizes max_batch_size")
    triton.add_argument("--instances", type=number_in(int, 1), default=1, help="model instances per GPU (they share its memory)")
    triton.add_argument("--scales", type=number_in(int, 1), nargs="*", default=[],
                        help="warm-up scales (shorter side, px); the largest sizes the batch (default: the card's)")
    triton.add_argument("--max-queue-delay-us", type=number_in(int, 0), default=DEFAULT_QUEUE_DELAY_US,
                        help="how long Triton's dynamic batcher waits to fill a batch")
    triton.add_argument("--tensorrt", action="store_true",
                        help="run through TensorRT (fp16 when the card is fp16); engines are built per shape, cached")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        folder = export(args.model, args.out, name=args.name, gpu_memory_bytes=args.gpu_memory,
                        instances=args.instances, scales=args.scales, queue_delay_us=args.max_queue_delay_us,
                        tensorrt=args.tensorrt)
    except (ExportError, ProfileError, OSError) as error:
        sys.stderr.write(f"scoremap-export: {error}\n")
        return 1
    sys.stdout.write(f"{folder}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
