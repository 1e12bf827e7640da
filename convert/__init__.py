"""Net surgery: any image classifier into a verified fully-convolutional ONNX graph with its model card."""

from convert.errors import ConversionError
from convert.pipeline import convert_classifier

__all__ = ["ConversionError", "convert_classifier"]
