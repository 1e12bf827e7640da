import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from convert.card import read_card
from convert.errors import ConversionError
from convert.precision import FP16_TOLERANCE, fp16_graph, to_fp16
from convert.profile import profile_model
from protos.model_card_pb2 import PRECISION_FP16


def scores(model: onnx.ModelProto, image: np.ndarray) -> np.ndarray:
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: image})[0]


@pytest.fixture(scope="module")
def default_pair(default_model_path):
    fp32 = onnx.load(default_model_path)
    return fp32, to_fp16(fp32)


def test_default_model_in_fp16_keeps_float32_edges_and_records_its_check(default_pair):
    fp32, fp16 = default_pair
    graph = fp16.graph
    assert graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert {init.data_type for init in graph.initializer if init.dims} <= {TensorProto.FLOAT16, TensorProto.INT64}
    assert [node.op_type for node in graph.node].count("Cast") == 2  # one at each edge
    card = read_card(fp16)
    assert card.precision == PRECISION_FP16
    assert card.labels == read_card(fp32).labels
    record = card.verification
    assert record.passed and 0 < record.max_abs_diff <= record.tolerance
    assert record.argmax_agreement >= 0.9
    assert "fp32" in record.reference
    assert read_card(fp32).precision != PRECISION_FP16  # the source is left alone


def test_fp16_scores_agree_with_fp32_on_an_unseen_image(default_pair):
    fp32, fp16 = default_pair
    image = np.random.default_rng(7).uniform(-1, 1, (1, 3, 256, 320)).astype(np.float32)
    expected, got = scores(fp32, image), scores(fp16, image)
    assert got.dtype == np.float32 and got.shape == expected.shape == (1, 1000, 2, 4)
    assert np.max(np.abs(got - expected)) <= FP16_TOLERANCE * np.max(np.abs(expected))


def test_fp16_profile_has_half_the_weight_bytes(default_pair):
    fp32, fp16 = default_pair
    full = profile_model(fp32, height=384, width=384)
    half = profile_model(fp16, height=384, width=384)
    assert half.dtype == "fp16"
    assert half.weights_bytes / full.weights_bytes == pytest.approx(0.5, abs=0.01)
    assert half.peak_activation_bytes / full.peak_activation_bytes == pytest.approx(0.5, abs=0.1)


def scaled_conv(scale: float) -> onnx.ModelProto:
    weight = numpy_helper.from_array(np.full((4, 3, 3, 3), scale, np.float32), "w")
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, "H", "W"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [weight])
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])


def test_a_graph_whose_weights_overflow_float16_is_refused():
    to_fp16(scaled_conv(0.5))  # a small graph converts fine
    with pytest.raises(ConversionError, match="keep this model in fp32"):
        to_fp16(scaled_conv(100_000.0))  # weights past float16's 65504 are clamped


def test_only_fp32_graphs_are_converted():
    half = fp16_graph(scaled_conv(0.5))
    with pytest.raises(ConversionError, match="expected an fp32 graph"):
        to_fp16(half)
