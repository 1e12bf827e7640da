import onnx
import pytest
from onnx import TensorProto, helper

from convert.card import CardError, ModelCard, ReceptiveField, read_card, write_card


def tiny_model() -> onnx.ModelProto:
    node = helper.make_node("Relu", ["x"], ["y"])
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 4, 4])],
    )
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])


def test_card_round_trips_through_a_saved_file(tmp_path):
    card = ModelCard(name="m", labels=["a", "b"], output_stride=32,
                     receptive_field=ReceptiveField(size=99, center_y=15.5, center_x=15.5))
    model = write_card(tiny_model(), card)
    write_card(model, card)  # writing twice keeps one entry
    assert sum(p.key == "scoremap.model_card" for p in model.metadata_props) == 1
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    assert read_card(str(path)) == card


def test_missing_card_says_how_to_fix():
    with pytest.raises(CardError, match="scoremap-convert"):
        read_card(tiny_model())
