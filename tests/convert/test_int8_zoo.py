"""int8 on the ONNX model zoo's architectures: onnx's "light" test graphs (the zoo's real Caffe2-era graphs at opset 9,
each weight tensor one repeated constant) convert to fp32 as tests/convert/test_model_zoo.py converts them, then to
int8, and the int8 graph serves as the fp32 one does (scoremap-score --local), its card recording int8.

Constant weights make every class tie, so the agreement numbers say nothing here: these check that each
architecture's ops (MaxPool, Concat, LRN, Sum, the classifier head's pooling and Softmax) pass through quantization,
its passes and the server's plans. One calibration photo, one held-out photo and MinMax alone keep each to seconds."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from clients.batch.score_cli import EXIT_OK, main as score
from convert.calibration import SAMPLES, PhotoSet, as_fed, default_set, fed_sides
from convert.card import Precision, read_card
from convert.labels import imagenet_labels
from convert.pipeline import convert_classifier
from convert.int8_passes import PAIR_SUM_LEVELS, head_nodes, name_nodes
from convert.quantize import QDQ_OPSET, float_ops, quantize, to_int8
from tests.convert.test_model_zoo import CAFFE, LIGHT_MODELS, alexnet, googlenet_like, resnet_like, vgg_bn


@pytest.fixture(scope="module")
def photos() -> PhotoSet:
    full = default_set()
    return PhotoSet(full.calibration[:1], full.held_out[:1], full.source)


def served(model: onnx.ModelProto, folder) -> tuple[dict, dict]:
    """scoremap-score --local's record for samples/cat.jpg at the card's default scale, and its maps."""
    folder.mkdir()
    path = folder / "model.onnx"
    onnx.save(model, path)
    code = score([str(SAMPLES / "cat.jpg"), "--local", str(path), "--out", str(folder / "out"), "--maps", "--no-progress"])
    assert code == EXIT_OK
    record = json.loads((folder / "out" / "results.jsonl").read_text().splitlines()[-1])
    with np.load(folder / "out" / record["maps_file"]) as maps:
        return record, {name: maps[name] for name in maps.files}


# The real SqueezeNet graph, and tests/convert/test_model_zoo.py's toy layouts of the others (the real ones take
# 40 s to minutes each here: the passes run the graph once per convolution).
ZOO = {"squeezenet": lambda: str(LIGHT_MODELS / "light_squeezenet.onnx"), "alexnet": alexnet, "googlenet": googlenet_like,
       "resnet": lambda: resnet_like(opset=6), "vgg_bn": vgg_bn}


@pytest.mark.parametrize("name", list(ZOO))
def test_a_zoo_architecture_quantizes_and_serves_as_its_fp32_graph_does(name, photos, tmp_path):
    fp32 = convert_classifier(ZOO[name](), preprocessing=CAFFE, labels=imagenet_labels() if name == "squeezenet" else None)
    assert fp32.opset_import[0].version < QDQ_OPSET  # converted at opset 12: int8 upgrades it for per-channel weights
    int8 = to_int8(fp32, photos, methods=("minmax",), allow_precision_loss=True)
    card = read_card(int8)
    assert card.precision == Precision.PRECISION_INT8 and card.quantization.method == "minmax"
    assert card.quantization.held_out.images == 1 and card.quantization.float_layers
    assert any(node.op_type == "DequantizeLinear" for node in int8.graph.node)
    (expected, expected_maps), (got, got_maps) = served(fp32, tmp_path / "fp32"), served(int8, tmp_path / "int8")
    assert got["status"] == expected["status"] == "OK"
    assert got["maps"] == expected["maps"] and got["output_stride"] == expected["output_stride"]
    assert {key: value.shape for key, value in got_maps.items()} == {key: value.shape for key, value in expected_maps.items()}
    assert all(np.isfinite(value).all() for value in got_maps.values())


@pytest.fixture(scope="module")
def toy_alexnet(photos) -> tuple[onnx.ModelProto, list[np.ndarray]]:
    """tests/convert/test_model_zoo.py's AlexNet layout (random weights) converted, and its calibration tensors."""
    fp32 = name_nodes(convert_classifier(alexnet(), preprocessing=CAFFE))
    card = read_card(fp32)
    return fp32, [as_fed(photo, card, side=side) for photo in photos.calibration for side in fed_sides(card)]


def test_grouped_convolutions_with_several_channels_per_group_get_pair_bounded_weights(toy_alexnet):
    """AlexNet's group-2 convolutions run in onnxruntime as one GEMM per group, whose AVX2 kernels sum products in
    pairs like any other convolution's: only depthwise ones (one channel per group) get full 8-bit weights."""
    quantized = quantize(*toy_alexnet, method="minmax", bias_correction=False)
    producers = {node.output[0]: node for node in quantized.graph.node}
    values = {tensor.name: onnx.numpy_helper.to_array(tensor) for tensor in quantized.graph.initializer}
    grouped = [node for node in quantized.graph.node if node.op_type == "Conv"
               and any(attribute.name == "group" and attribute.i == 2 for attribute in node.attribute)]
    assert len(grouped) == 3
    for node in grouped:
        levels = values[producers[node.input[1]].input[0]].astype(int)
        assert np.abs(levels.reshape(levels.shape[0], -1, 2)).sum(axis=2).max() <= PAIR_SUM_LEVELS


def test_a_head_of_fc_layers_keeps_its_classifier_convolution_and_softmax_in_float(toy_alexnet):
    """No pooling near AlexNet's output: the head is fc8 (a convolution now) and its Softmax, in float, not uint8
    probabilities."""
    fp32, tensors = toy_alexnet
    head = head_nodes(fp32)
    operations = {node.name: node.op_type for node in fp32.graph.node}
    assert [operations[name] for name in head] == ["Transpose", "Softmax", "Transpose", "Conv"]
    quantized = quantize(fp32, tensors, method="minmax", keep_float=tuple(head), bias_correction=False)
    assert "Softmax" in float_ops(quantized)
    classifier = next(node for node in quantized.graph.node if node.name == head[-1])
    assert classifier.input[1] in {tensor.name for tensor in quantized.graph.initializer}  # float weights
