import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from convert.card import (
    METADATA_KEY,
    CardError,
    ChannelOrder,
    ImageInput,
    InputDtype,
    Layout,
    ModelCard,
    OutputKind,
    Precision,
    Preprocessing,
    ReceptiveField,
    batch_shape,
    is_logits,
    label,
    parse_label,
    read_card,
    write_card,
)


def tiny_model() -> onnx.ModelProto:
    node = helper.make_node("Relu", ["x"], ["y"])
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 4, 4])],
    )
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])


def full_card() -> ModelCard:
    return ModelCard(
        name="m", labels=["a", "b"], output_stride=16, native_output_stride=32,
        preprocessing=Preprocessing(input_name="x", layout=Layout.LAYOUT_NHWC, dtype=InputDtype.INPUT_DTYPE_UINT8,
                                    channel_order=ChannelOrder.CHANNEL_ORDER_BGR, pixel_scale=1.0, mean=[1, 2, 3], std=[4, 5, 6]),
        receptive_field=ReceptiveField(size=99, center_y=15.5, center_x=15.5),
        output_kind=OutputKind.OUTPUT_KIND_PROBABILITIES, precision=Precision.PRECISION_FP16,
    )


def test_card_round_trips_through_a_saved_file(tmp_path):
    card = full_card()
    model = write_card(tiny_model(), card)
    write_card(model, card)  # writing twice keeps one entry
    assert sum(p.key == METADATA_KEY for p in model.metadata_props) == 1
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    assert read_card(str(path)) == card
    assert '"layout": "LAYOUT_NHWC"' in model.metadata_props[0].value  # enums are stored by name, readable in Netron


def test_image_input_is_the_typed_view_of_the_card():
    image = ImageInput.of(full_card())
    assert (image.name, image.dtype, image.channels, image.bgr) == ("x", np.dtype(np.uint8), 3, True)
    assert (image.channel_axis, image.spatial_axes, image.size_of((2, 7, 9, 3))) == (3, (1, 2), (7, 9))
    assert batch_shape(Layout.LAYOUT_NCHW, batch=1, channels=3, height=5, width=6) == [1, 3, 5, 6]
    assert "NHWC uint8 BGR" in image.describe()
    assert not is_logits(full_card())


def test_labels_read_and_parse_every_enum():
    assert (label(Layout, Layout.LAYOUT_NCHW), label(Precision, Precision.PRECISION_FP16)) == ("NCHW", "fp16")
    assert label(OutputKind, OutputKind.OUTPUT_KIND_LOGITS) == "logits"
    assert label(InputDtype, InputDtype.INPUT_DTYPE_FLOAT32) == "float32"
    assert parse_label(ChannelOrder, "bgr") == ChannelOrder.CHANNEL_ORDER_BGR
    with pytest.raises(CardError, match=r"'CMYK' is not a ChannelOrder; expected one of \['RGB', 'BGR'\]"):
        parse_label(ChannelOrder, "CMYK")


def test_a_card_with_an_unset_enum_is_refused_by_name():
    card = full_card()
    card.ClearField("output_kind")
    with pytest.raises(CardError, match="leaves output_kind unset.*OUTPUT_KIND_LOGITS"):
        read_card(write_card(tiny_model(), card))


def test_a_card_with_the_old_string_layout_says_to_convert_again():
    model = tiny_model()
    entry = model.metadata_props.add()
    entry.key, entry.value = METADATA_KEY, '{"name": "m", "preprocessing": {"layout": "NCHW"}}'
    with pytest.raises(CardError, match="converted again"):
        read_card(model)


def test_missing_card_says_how_to_fix():
    with pytest.raises(CardError, match="scoremap-convert"):
        read_card(tiny_model())
