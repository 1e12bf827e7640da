"""Net surgery: any image classifier into a verified fully-convolutional ONNX graph with its model card.

`convert_classifier` is imported on first use, so `import convert` (and the server, which reads
cards and profiles graphs) loads neither the conversion tools nor torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from convert.errors import ConversionError, UsageError

if TYPE_CHECKING:
    from convert.pipeline import convert_classifier

__all__ = ["ConversionError", "UsageError", "convert_classifier"]


def __getattr__(name: str):
    if name == "convert_classifier":
        from convert.pipeline import convert_classifier

        return convert_classifier
    raise AttributeError(f"module 'convert' has no attribute {name!r}")
