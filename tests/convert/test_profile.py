import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from convert.card import Layout
from convert.precision import fp16_graph
from convert.profile import (ProfileError, largest_batch, largest_square_size, load_skeleton, parse_bytes,
                             profile_model)

VGG16 = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]


def external_weight(name: str, shape: list[int]) -> TensorProto:
    """A float32 initializer whose bytes live in a file beside the model: only its shape is here."""
    tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=shape)
    tensor.data_location = TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", "weights.bin"
    return tensor


def vgg_graph(*, widths=VGG16, fc: int = 4096, classes: int = 1000, dense: bool = False,
              random_weights: bool = False) -> onnx.ModelProto:
    """VGG16's layout (Simonyan & Zisserman, config D); `dense` makes its FC head 7x7 and 1x1 convs."""
    rng = np.random.default_rng(0)
    nodes, weights = [], []

    def weight(name, shape):
        if random_weights:
            fan_in = math.prod(shape[1:])
            values = rng.standard_normal(shape).astype(np.float32) * np.float32(math.sqrt(2 / fan_in))
            weights.append(numpy_helper.from_array(values, name))
        else:
            weights.append(external_weight(name, shape))

    x, channels = "image", 3
    for index, width in enumerate(widths):
        if width == "M":
            nodes.append(helper.make_node("MaxPool", [x], [f"pool{index}"], kernel_shape=[2, 2], strides=[2, 2], name=f"pool{index}"))
            x = f"pool{index}"
            continue
        weight(f"w{index}", [width, channels, 3, 3])
        weight(f"b{index}", [width])
        nodes.append(helper.make_node("Conv", [x, f"w{index}", f"b{index}"], [f"conv{index}"], pads=[1, 1, 1, 1], name=f"conv{index}"))
        nodes.append(helper.make_node("Relu", [f"conv{index}"], [f"relu{index}"], name=f"relu{index}"))
        x, channels = f"relu{index}", width
    sizes = [(fc, channels), (fc, fc), (classes, fc)]
    if dense:
        for layer, (outputs, inputs) in enumerate(sizes, start=6):
            kernel = 7 if layer == 6 else 1
            weight(f"fc{layer}_w", [outputs, inputs, kernel, kernel])
            weight(f"fc{layer}_b", [outputs])
        head = ["fc6", "fc7", "fc8"]
        nodes.append(helper.make_node("Conv", [x, "fc6_w", "fc6_b"], ["fc6"], name="fc6"))
        nodes.append(helper.make_node("Relu", ["fc6"], ["fc6_relu"], name="fc6_relu"))
        nodes.append(helper.make_node("Conv", ["fc6_relu", "fc7_w", "fc7_b"], ["fc7"], name="fc7"))
        nodes.append(helper.make_node("Relu", ["fc7"], ["fc7_relu"], name="fc7_relu"))
        nodes.append(helper.make_node("Conv", ["fc7_relu", "fc8_w", "fc8_b"], ["scores"], name="fc8"))
        dims = ["N", 3, "H", "W"]
    else:
        weight("fc6_w", [channels * 7 * 7, fc])
        weight("fc6_b", [fc])
        weight("fc7_w", [fc, fc])
        weight("fc7_b", [fc])
        weight("fc8_w", [fc, classes])
        weight("fc8_b", [classes])
        nodes.append(helper.make_node("Flatten", [x], ["flat"], name="flatten"))
        head = ["flat"]
        for layer in (6, 7, 8):
            out = "scores" if layer == 8 else f"fc{layer}"
            nodes.append(helper.make_node("Gemm", [head[-1], f"fc{layer}_w", f"fc{layer}_b"], [out], name=f"fc{layer}"))
            head.append(out)
            if layer != 8:
                nodes.append(helper.make_node("Relu", [out], [f"{out}_relu"], name=f"{out}_relu"))
                head.append(f"{out}_relu")
        dims = ["N", 3, 224, 224]
    graph = helper.make_graph(nodes, "vgg", [helper.make_tensor_value_info("image", TensorProto.FLOAT, dims)],
                              [helper.make_tensor_value_info("scores", TensorProto.FLOAT, None)], weights)
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])


def small_dense_vgg() -> onnx.ModelProto:
    """VGG16's layout at a quarter of its widths with a 1024-wide FC head as convolutions."""
    widths = [w if w == "M" else w // 4 for w in VGG16]
    return vgg_graph(widths=widths, fc=1024, dense=True, random_weights=True)


def test_vgg16_matches_the_classic_breakdown():
    """cs231n's VGG16 table: 138,357,544 parameters, 15.47 GMACs at 224.

    Activations count the input and each conv, pool and FC output, ReLUs in place (the table's
    convention): 15,237,608 elements. The notes' total of "24M" (93 MB) is not the sum of their
    own per-layer lines, which is this 15.2M (61 MB).
    """
    profile = profile_model(load_skeleton(vgg_graph(), layout=Layout.LAYOUT_NCHW), height=224, width=224)
    assert profile.params == 138_357_544
    assert profile.activations == 15_237_608
    assert profile.naive_activation_bytes == 4 * 15_237_608
    assert profile.macs == 15_470_264_320
    assert profile.weights_bytes == 4 * 138_357_544
    by_name = {layer.name: layer for layer in profile.layers}
    assert by_name["conv0"].output_shape == (1, 64, 224, 224)
    assert by_name["conv0"].activations == 3_211_264 and by_name["conv0"].params == 1_792
    assert by_name["relu0"].activations == 0  # in place
    assert by_name["flatten"].activations == 0  # a view
    assert by_name["fc6"].params == 102_764_544
    # The live peak is the first two 224x224x64 maps plus the input, far below the naive sum.
    assert profile.peak_activation_bytes == 4 * (150_528 + 2 * 3_211_264)
    assert profile.predicted_peak_bytes == profile.weights_bytes + profile.peak_activation_bytes + profile.allowance_bytes


def tiny_residual() -> onnx.ModelProto:
    """x -> conv a -> relu -> conv b -> add(b, relu a) -> reshape -> sigmoid: liveness by hand."""
    w = numpy_helper.from_array(np.ones((8, 8, 3, 3), np.float32), "w")
    w0 = numpy_helper.from_array(np.ones((8, 3, 1, 1), np.float32), "w0")
    shape = numpy_helper.from_array(np.array([0, -1], np.int64), "shape")
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["a"], name="a"),
        helper.make_node("Relu", ["a"], ["ra"], name="ra"),
        helper.make_node("Conv", ["ra", "w"], ["b"], pads=[1, 1, 1, 1], name="b"),
        helper.make_node("Add", ["b", "ra"], ["s"], name="s"),
        helper.make_node("Reshape", ["s", "shape"], ["flat"], name="flat"),
        helper.make_node("Sigmoid", ["flat"], ["y"], name="y"),
    ]
    graph = helper.make_graph(nodes, "residual", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, "H", "W"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w, w0, shape])
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])


def test_liveness_follows_execution_order_and_reuses_dying_buffers():
    profile = profile_model(tiny_residual(), height=10, width=10, batch=2)
    image, plane = 2 * 3 * 100 * 4, 2 * 8 * 100 * 4
    # conv a: input + a; relu writes into a; conv b: input + a + b; add writes into b (a dies at add);
    # reshape is a view of it; sigmoid overwrites it.
    assert profile.peak_activation_bytes == image + 2 * plane
    assert profile.naive_activation_bytes == image + 2 * plane
    assert [layer.bytes for layer in profile.layers] == [plane, 0, plane, 0, 0, 0]
    assert profile.layers[2].macs == 2 * 8 * 100 * 8 * 9
    assert profile.weights_bytes == (8 * 8 * 9 + 8 * 3) * 4 + 2 * 8


def test_graph_input_is_never_overwritten_in_place():
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, "H", "W"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])
    profile = profile_model(model, height=4, width=5)
    assert profile.peak_activation_bytes == 2 * 3 * 20 * 4


def test_symbolic_sizes_resolve_for_each_request_and_activations_scale_with_batch():
    model = small_dense_vgg()
    one = profile_model(model, height=256, width=320)
    assert one.layers[-1].output_shape == (1, 1000, 2, 4)  # (256/32 - 6) x (320/32 - 6) cells
    four = profile_model(model, height=256, width=320, batch=4)
    assert four.peak_activation_bytes == 4 * one.peak_activation_bytes
    assert four.naive_activation_bytes == 4 * one.naive_activation_bytes
    assert four.weights_bytes == one.weights_bytes
    assert four.predicted_peak_bytes > one.predicted_peak_bytes


def test_fp16_graph_reports_half_the_bytes():
    model = small_dense_vgg()
    full = profile_model(model, height=224, width=224)
    half = profile_model(fp16_graph(model), height=224, width=224)
    assert (full.dtype, half.dtype) == ("fp32", "fp16")
    assert half.weights_bytes == full.weights_bytes // 2
    # fp16 activations plus the float32 input and its fp16 copy at the graph's edge.
    assert half.peak_activation_bytes / full.peak_activation_bytes == pytest.approx(0.5, abs=0.1)
    assert half.params == full.params and half.macs == full.macs


def test_largest_batch_and_size_are_the_last_that_fit():
    model = small_dense_vgg()
    budget = parse_bytes("200MiB")
    batch = largest_batch(model, height=224, width=224, budget_bytes=budget)
    assert batch >= 2
    assert profile_model(model, height=224, width=224, batch=batch).predicted_peak_bytes <= budget
    assert profile_model(model, height=224, width=224, batch=batch + 1).predicted_peak_bytes > budget
    side = largest_square_size(model, budget_bytes=budget)
    assert side % 32 == 0 and side >= 224
    assert profile_model(model, height=side, width=side).predicted_peak_bytes <= budget
    assert profile_model(model, height=side + 32, width=side + 32).predicted_peak_bytes > budget
    tiny = profile_model(model, height=224, width=224).weights_bytes // 2
    assert largest_batch(model, height=224, width=224, budget_bytes=tiny) == 0
    assert largest_square_size(model, budget_bytes=tiny) == 0


@pytest.mark.parametrize("text, expected", [
    ("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("1.5G", int(1.5 * 2**30)), ("1GB", 10**9),
    ("100", 100), ("64 kB", 64_000), ("8K", 8192),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "2 GiBs", "lots", "-1G"])
def test_parse_bytes_says_what_it_expected(text):
    with pytest.raises(ProfileError, match="expected a number"):
        parse_bytes(text)


def test_unprofilable_requests_raise_profile_error():
    model = small_dense_vgg()
    with pytest.raises(ProfileError, match="too small"):
        profile_model(model, height=64, width=64)  # the 7x7 fc6 needs a 224 input
    with pytest.raises(ProfileError, match="batch must be a positive integer"):
        profile_model(model, height=224, width=224, batch=0)
    two_inputs = helper.make_graph([helper.make_node("Add", ["x", "z"], ["y"])], "g",
                                   [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 3, 4, 4]) for n in "xz"],
                                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    with pytest.raises(ProfileError, match="one image input, got 2"):
        profile_model(helper.make_model(two_inputs, ir_version=10), height=4, width=4)


def test_a_path_is_profiled_without_loading_its_weights(tmp_path):
    path = tmp_path / "vgg16.onnx"  # its weights.bin does not exist
    onnx.save(vgg_graph(dense=True), path)
    assert profile_model(str(path), height=224, width=224).params == 138_357_544
    with pytest.raises(ProfileError, match="cannot read"):
        profile_model(str(tmp_path / "missing.onnx"), height=224, width=224)


def test_largest_batch_without_per_image_scaling_still_finds_the_last_that_fits():
    """A graph whose buffers do not all scale with the batch falls back to the search."""
    table = numpy_helper.from_array(np.ones((1, 4, 64, 64), np.float32), "table")
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Shape", ["r"], ["shape"]),
             helper.make_node("Expand", ["table", "shape"], ["big"]),  # grows with the batch
             helper.make_node("ReduceSum", ["table"], ["fixed"], keepdims=1),  # does not
             helper.make_node("Add", ["big", "fixed"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, "H", "W"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [table])
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])
    one, two = (profile_model(model, height=64, width=64, batch=b) for b in (1, 2))
    assert two.peak_activation_bytes != 2 * one.peak_activation_bytes
    budget = parse_bytes("12MiB")
    batch = largest_batch(model, height=64, width=64, budget_bytes=budget)
    assert profile_model(model, height=64, width=64, batch=batch).predicted_peak_bytes <= budget
    assert profile_model(model, height=64, width=64, batch=batch + 1).predicted_peak_bytes > budget


def nhwc_net(*, dtype: int = TensorProto.FLOAT, dims=("N", "H", "W", 3), card_layout=None) -> onnx.ModelProto:
    """Keras-style: image [N, H, W, C] (optionally uint8, cast inside), Transpose to NCHW, Conv 3x3, Relu."""
    weight = numpy_helper.from_array(np.ones((8, 3, 3, 3), np.float32), "w")
    nodes = []
    source = "image"
    if dtype != TensorProto.FLOAT:
        nodes.append(helper.make_node("Cast", ["image"], ["f"], to=TensorProto.FLOAT, name="cast"))
        source = "f"
    nodes += [helper.make_node("Transpose", [source], ["nchw"], perm=[0, 3, 1, 2], name="to_nchw"),
              helper.make_node("Conv", ["nchw", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
              helper.make_node("Relu", ["c"], ["scores"], name="relu")]
    graph = helper.make_graph(nodes, "nhwc", [helper.make_tensor_value_info("image", dtype, list(dims))],
                              [helper.make_tensor_value_info("scores", TensorProto.FLOAT, None)], [weight])
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])
    if card_layout is not None:
        from convert.card import (ChannelOrder, InputDtype, ModelCard, OutputKind, Precision, Preprocessing,
                                  write_card)

        write_card(model, ModelCard(
            preprocessing=Preprocessing(input_name="image", layout=card_layout, dtype=InputDtype.INPUT_DTYPE_FLOAT32,
                                        channel_order=ChannelOrder.CHANNEL_ORDER_RGB, mean=[0.0] * 3, std=[1.0] * 3),
            output_kind=OutputKind.OUTPUT_KIND_LOGITS, precision=Precision.PRECISION_FP32))
    return model


def test_nhwc_input_sizes_come_from_the_layout():
    profile = profile_model(nhwc_net(), height=10, width=12, batch=2)
    by_name = {layer.name: layer for layer in profile.layers}
    assert by_name["to_nchw"].output_shape == (2, 3, 10, 12)
    assert by_name["conv"].output_shape == (2, 8, 10, 12)
    assert profile.input_bytes == 2 * 10 * 12 * 3 * 4


def test_uint8_nhwc_input_counts_one_byte_per_value():
    profile = profile_model(nhwc_net(dtype=TensorProto.UINT8), height=10, width=12)
    assert profile.input_bytes == 10 * 12 * 3
    assert {layer.name: layer for layer in profile.layers}["cast"].bytes == 10 * 12 * 3 * 4


def test_the_card_says_the_layout_and_channels_when_the_graph_does_not():
    symbolic = ("N", "H", "W", "C")
    with pytest.raises(ProfileError, match="no model card saying its layout"):
        profile_model(nhwc_net(dims=symbolic), height=8, width=8)
    profile = profile_model(nhwc_net(dims=symbolic, card_layout=Layout.LAYOUT_NHWC), height=8, width=8)
    assert profile.layers[1].output_shape == (1, 8, 8, 8)
    # A graph built at load time (a server's wrapper) has no card: its builder says the layout.
    skeleton = load_skeleton(nhwc_net(dims=(1, 16, 16, 3)), layout=Layout.LAYOUT_NHWC)
    assert profile_model(skeleton, height=8, width=4).input_bytes == 8 * 4 * 3 * 4


def test_the_converted_tf2onnx_graph_is_profiled_as_nhwc():
    from convert import convert_classifier
    from tests.convert.test_onnx_families import UNIT_RANGE, tf2onnx_classifier

    converted = convert_classifier(tf2onnx_classifier(), preprocessing=UNIT_RANGE)
    profile = profile_model(converted, height=34, width=30, batch=2)
    assert profile.input_bytes == 2 * 34 * 30 * 3 * 4
    assert profile.layers[-1].output_shape[:2] == (2, 3)
