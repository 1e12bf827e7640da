"""The tiny classifiers of tests/clients/slides/nets.py, converted once per session."""

from __future__ import annotations

import onnx
import pytest

from convert import convert_classifier
from tests.clients.slides.nets import UNIT, tiny_classifier


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """Converted tiny nets by (padded, nhwc, output_stride), each saved once."""
    folder, made = tmp_path_factory.mktemp("tiny_tiling"), {}

    def get(padded: bool, nhwc: bool, output_stride: int = 32) -> str:
        key = (padded, nhwc, output_stride)
        if key not in made:
            source = tiny_classifier(padded=padded, nhwc=nhwc, size=64 if padded else 96)
            path = folder / f"tiny-{'pad' if padded else 'valid'}-{'nhwc' if nhwc else 'nchw'}-os{output_stride}.onnx"
            onnx.save(convert_classifier(source, output_stride=output_stride, preprocessing=UNIT), path)
            made[key] = str(path)
        return made[key]
    return get
