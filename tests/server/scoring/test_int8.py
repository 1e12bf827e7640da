"""An int8 graph served like any other: tiles stitched to the one-pass int8 answer, and refused at load where the
provider has no int8 kernels, or where the CPU's kernels would saturate its full 8-bit weights."""

from __future__ import annotations

import dataclasses

import onnx
import pytest

from convert import convert_classifier
from convert.int8_forms import INTEGER_SUMS
from protos.model_card_pb2 import Int8Weights
from protos.scoring_pb2 import SHIFT_GRID, SHIFT_NONE
from convert.memory_model import Device
from server.engine.client import EngineFacts
from server.engine.providers import CPU, CUDA
from server.errors import ScoringError
from server.scoring import loading
from server.scoring.pipeline import Pipeline
from server.settings import Settings
from tests.clients.slides.nets import UNIT, tiny_classifier
from tests.server.scoring.test_tiled_scoring import (SETTINGS, SMALL, assert_same_answer, image, one_pass_bucket,
                                                     plan_shapes, request_of)
from tests.tiny_models import int8_net


@pytest.fixture(scope="module")
def int8_path(tmp_path_factory) -> str:
    """The tiling tests' tiny padded classifier, converted, then quantized to int8 as scoremap-convert quantizes it:
    its classifier integer sums with float logits (convert.int8_forms)."""
    path = tmp_path_factory.mktemp("int8") / "tiny-int8.onnx"
    net = convert_classifier(tiny_classifier(padded=True, nhwc=False, size=64), preprocessing=UNIT)
    int8 = int8_net(net, sides=(64, 128), float_head=True)
    assert any(node.name.endswith(INTEGER_SUMS) for node in int8.graph.node)
    onnx.save(int8, path)
    return str(path)


@pytest.mark.parametrize("fields", [dict(output_stride=32, shift=SHIFT_NONE), dict(output_stride=16, shift=SHIFT_GRID)],
                         ids=["stride 32", "grid"])
def test_an_int8_image_larger_than_every_bucket_is_tiled_to_the_one_pass_int8_answer(int8_path, fields):
    pixels = image(617, 541)
    whole_bucket = one_pass_bucket(pixels, native_stride=32, output_stride=fields["output_stride"],
                                   shift=fields["shift"], multiple=32)
    small = Pipeline([int8_path], settings=dataclasses.replace(SETTINGS, shape_buckets=SMALL))
    whole = Pipeline([int8_path], settings=dataclasses.replace(SETTINGS, shape_buckets=(whole_bucket,)))
    try:
        tiled, reference = small.score(request_of(pixels, **fields)), whole.score(request_of(pixels, **fields))
        assert plan_shapes(small) <= set(SMALL) and plan_shapes(whole) == {whole_bucket}
    finally:
        small.close()
        whole.close()
    assert tiled.maps[0].tiling.tiles >= 4 and tiled.maps[0].tiling.exact
    assert_same_answer(tiled, reference)


def test_an_int8_model_is_refused_at_load_where_the_provider_has_no_int8_kernels(int8_path):
    """Forced: an engine that chose CUDA (this machine may have none) refuses the int8 model, saying why."""
    assert EngineFacts(CPU, Device.CPU, None, 1, 1).int8_refusal(Int8Weights.INT8_WEIGHTS_PAIR_BOUNDED) is None
    on_cuda = EngineFacts(CUDA, Device.CUDA, 2**30, 1, 8)
    with pytest.raises(ScoringError, match="no int8 convolution kernels.*fp16 or fp32 model on a GPU"):
        loading.load("", int8_path, settings=Settings(warm_up=False), facts=on_cuda, budget=None, host_budget=None,
                     metrics=None, share=1)


@pytest.fixture(scope="module")
def full_int8_path(tmp_path_factory) -> str:
    """The tiny classifier quantized with full 8-bit weights, as its card records."""
    path = tmp_path_factory.mktemp("int8-full") / "tiny-int8-full.onnx"
    net = convert_classifier(tiny_classifier(padded=True, nhwc=False, size=64), preprocessing=UNIT)
    onnx.save(int8_net(net, sides=(64, 128), weights=Int8Weights.INT8_WEIGHTS_FULL), path)
    return str(path)


def test_full_8_bit_int8_weights_are_refused_where_the_cpus_kernels_saturate(full_int8_path, int8_path, monkeypatch):
    """The engine measures its CPU's kernels once (forced here to sum in 16 bits, as AVX2 without VNNI does): a model
    with full 8-bit weights is refused at load, saying how to convert one that runs; pair-bounded weights (and a card
    that records none) still load."""
    settings = dataclasses.replace(SETTINGS, warm_up=False)
    monkeypatch.setattr("server.engine.core.pair_sums_saturate", lambda: False)
    Pipeline([full_int8_path], settings=settings).close()
    monkeypatch.setattr("server.engine.core.pair_sums_saturate", lambda: True)
    with pytest.raises(ScoringError, match="full 8-bit.*16 bits.*--int8-weights pair-bounded") as refused:
        Pipeline([full_int8_path], settings=settings)
    assert full_int8_path in str(refused.value)
    Pipeline([int8_path], settings=settings).close()
    facts = EngineFacts(CPU, Device.CPU, None, 1, 1, int8_sums_saturate=True)
    for weights in (Int8Weights.INT8_WEIGHTS_PAIR_BOUNDED, Int8Weights.INT8_WEIGHTS_UNSPECIFIED):
        assert facts.int8_refusal(weights) is None
    assert "full 8-bit" in facts.int8_refusal(Int8Weights.INT8_WEIGHTS_FULL)
