"""The ONNX model zoo's traits, one tiny graph each: IR 3 with weights listed as inputs, weights in
Constant nodes or computed by ConstantOfShape and constant arithmetic, opsets 1-9 with their old attributes
(Gemm's broadcast, Dropout's is_test, Relu's consumed_inputs, Reshape's shape, BatchNormalization's spatial), Caffe-style AlexNet, VGG and GoogLeNet
layouts. Each is normalised once, converts, and verifies to 1e-4."""

import collections
import pathlib

import numpy as np
import onnx
import onnx.version_converter
import pytest
from onnx import TensorProto, helper, numpy_helper

from convert import UsageError, convert_classifier
from convert.card import read_card
from convert.labels import imagenet_labels
from convert.normalize import IR_VERSIONS, TARGET_OPSET, normalize, runnable
from convert.presets import preset
from convert.preprocessing import to_input
from convert.verify import run, sample_pixels
from protos.model_card_pb2 import INPUT_DTYPE_FLOAT32, LAYOUT_NCHW, OUTPUT_KIND_LOGITS

CAFFE = preset("caffe")
CAFFE_NCHW = preset("caffe")  # completed as the converter completes it, to run the graphs directly
CAFFE_NCHW.layout, CAFFE_NCHW.dtype = LAYOUT_NCHW, INPUT_DTYPE_FLOAT32
TOLERANCE = 1e-4


class Builder:
    """Nodes of a Caffe-era graph whose weights are stored the way `style` says:
    "inputs" (initializers also listed as graph inputs, IR 3), "constants" (Constant nodes) or
    "computed" (ConstantOfShape and constant arithmetic, opset 9 and later)."""

    def __init__(self, style: str, opset: int, seed: int = 0):
        self.style, self.opset = style, opset
        self.rng = np.random.default_rng(seed)
        self.nodes, self.weights = [], []

    def weight(self, name: str, *shape: int, scale: float = 0.2) -> str:
        value = (self.rng.standard_normal(shape) * scale).astype(np.float32)
        if self.style == "inputs":
            self.weights.append(numpy_helper.from_array(value, name))
        elif self.style == "constants":
            self.nodes.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name + "_value")))
        else:  # value = Reshape(flat) * ConstantOfShape(2) - ConstantOfShape(offset) + offset: folded to `value`
            flat, dims = f"{name}_flat", f"{name}_dims"
            self.nodes += [
                helper.make_node("Constant", [], [flat], value=numpy_helper.from_array(value.ravel() / 2, flat + "_value")),
                helper.make_node("Constant", [], [dims], value=numpy_helper.from_array(np.array(shape, np.int64), dims + "_v")),
                helper.make_node("Reshape", [flat, dims], [f"{name}_half"]),
                helper.make_node("ConstantOfShape", [dims], [f"{name}_two"], value=numpy_helper.from_array(np.array([2.0], np.float32))),
                helper.make_node("Mul", [f"{name}_half", f"{name}_two"], [f"{name}_raw"]),
                helper.make_node("ConstantOfShape", [dims], [f"{name}_offset"], value=numpy_helper.from_array(np.array([0.5], np.float32))),
                helper.make_node("Sub", [f"{name}_raw", f"{name}_offset"], [f"{name}_low"]),
                helper.make_node("Add", [f"{name}_low", f"{name}_offset"], [name]),
            ]
        return name

    def conv(self, x: str, name: str, cin: int, cout: int, k: int, *, stride: int = 1, pad: int = 0, group: int = 1) -> str:
        w, b = self.weight(f"{name}_w", cout, cin // group, k, k), self.weight(f"{name}_b", cout, scale=0.05)
        old = {"consumed_inputs": [0]} if self.opset < 6 else {}  # opset 1-5's in-place hint
        self.nodes += [helper.make_node("Conv", [x, w, b], [name], kernel_shape=[k, k], strides=[stride] * 2, pads=[pad] * 4, group=group),
                       helper.make_node("Relu", [name], [name + "_relu"], **old)]
        return name + "_relu"

    def lrn(self, x: str, name: str) -> str:
        self.nodes.append(helper.make_node("LRN", [x], [name], size=5, alpha=1e-4, beta=0.75, bias=1.0))
        return name

    def max_pool(self, x: str, name: str, *, k: int = 3, stride: int = 2, pads=(0, 0, 0, 0)) -> str:
        self.nodes.append(helper.make_node("MaxPool", [x], [name], kernel_shape=[k, k], strides=[stride] * 2, pads=list(pads)))
        return name

    def flatten(self, x: str) -> str:
        """Caffe2's export: Reshape to [1, -1] (an attribute before opset 5); the "computed" style derives the
        target from Shape like tf2onnx."""
        if self.opset < 5:
            self.nodes.append(helper.make_node("Reshape", [x], ["flat"], shape=[1, -1]))
            return "flat"
        if self.style == "computed":
            self.nodes += [
                helper.make_node("Shape", [x], ["flat_shape_all"]),
                helper.make_node("Constant", [], ["flat_zero"], value=numpy_helper.from_array(np.array([0], np.int64), "z")),
                helper.make_node("Gather", ["flat_shape_all", "flat_zero"], ["flat_batch"], axis=0),
                helper.make_node("Constant", [], ["flat_rest"], value=numpy_helper.from_array(np.array([-1], np.int64), "r")),
                helper.make_node("Concat", ["flat_batch", "flat_rest"], ["flat_shape"], axis=0),
            ]
        elif self.style == "inputs":
            self.weights.append(numpy_helper.from_array(np.array([1, -1], np.int64), "flat_shape"))
        else:
            self.nodes.append(helper.make_node("Constant", [], ["flat_shape"], value=numpy_helper.from_array(np.array([1, -1], np.int64), "s")))
        self.nodes.append(helper.make_node("Reshape", [x, "flat_shape"], ["flat"]))
        return "flat"

    def fc(self, x: str, name: str, cin: int, cout: int, *, relu: bool = True, dropout: bool = False) -> str:
        w, b = self.weight(f"{name}_w", cout, cin, scale=0.3), self.weight(f"{name}_b", cout, scale=0.05)
        old = {"broadcast": 1} if self.opset < 7 else {}
        self.nodes.append(helper.make_node("Gemm", [x, w, b], [name], transB=1, **old))
        out = name
        if relu:
            self.nodes.append(helper.make_node("Relu", [out], [out + "_relu"]))
            out += "_relu"
        if dropout:
            old = {"is_test": 1} if self.opset < 7 else {}
            self.nodes.append(helper.make_node("Dropout", [out], [out + "_drop"], ratio=0.5, **old))
            out += "_drop"
        return out

    def model(self, image: str, size: int, output: str, classes: int) -> onnx.ModelProto:
        inputs = [helper.make_tensor_value_info(image, TensorProto.FLOAT, [1, 3, size, size])]
        inputs += [helper.make_tensor_value_info(w.name, w.data_type, list(w.dims)) for w in self.weights]  # IR 3: weights are inputs
        self.nodes.append(helper.make_node("Softmax", [output], ["prob_1"]))
        graph = helper.make_graph(self.nodes, "zoo", inputs, [helper.make_tensor_value_info("prob_1", TensorProto.FLOAT, [1, classes])],
                                  self.weights)
        return helper.make_model(graph, ir_version=3, opset_imports=[helper.make_opsetid("", self.opset)])


def alexnet(*, style: str = "inputs", opset: int = 9) -> onnx.ModelProto:
    """bvlc_alexnet's layout at toy widths: conv/LRN/maxpool (Caffe's ceil mode as end padding), grouped convs,
    FC x3 with Dropout, Softmax; 51 px in, native stride 16, a 2x2 map before fc6."""
    b = Builder(style, opset)
    x = b.conv("data_0", "conv1", 3, 8, 5, stride=2)
    x = b.max_pool(b.lrn(x, "norm1"), "pool1", pads=(0, 0, 1, 1))
    x = b.conv(x, "conv2", 8, 8, 3, pad=1, group=2)
    x = b.max_pool(b.lrn(x, "norm2"), "pool2", pads=(0, 0, 1, 1))
    x = b.conv(x, "conv3", 8, 12, 3, pad=1)
    x = b.conv(x, "conv4", 12, 12, 3, pad=1, group=2)
    x = b.conv(x, "conv5", 12, 8, 3, pad=1, group=2)
    x = b.flatten(b.max_pool(x, "pool5"))
    x = b.fc(x, "fc6", 8 * 2 * 2, 16, dropout=True)
    x = b.fc(x, "fc7", 16, 16, dropout=True)
    return b.model("data_0", 51, b.fc(x, "fc8", 16, 5, relu=False), 5)


def vgg_bn(*, opset: int = 8) -> onnx.ModelProto:
    """vgg16-bn's layout: conv/BatchNormalization (with opset-7/8's `spatial`)/relu blocks, maxpool, Flatten, FC x3."""
    b = Builder("inputs", opset)
    x, cin = "data", 3
    for block, cout in enumerate((4, 8)):
        for layer in range(2):
            name = f"conv{block}_{layer}"
            w = b.weight(name + "_w", cout, cin, 3, 3)
            scale = numpy_helper.from_array((b.rng.random(cout) + 0.5).astype(np.float32), name + "_g")
            params = [scale] + [numpy_helper.from_array(v.astype(np.float32), f"{name}_{p}") for p, v in
                                (("beta", b.rng.standard_normal(cout) * 0.1), ("mean", b.rng.standard_normal(cout) * 0.1),
                                 ("var", b.rng.random(cout) + 0.5))]
            b.weights += params
            b.nodes += [helper.make_node("Conv", [x, w], [name], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
                        helper.make_node("BatchNormalization", [name] + [p.name for p in params], [name + "_bn"], epsilon=1e-5, spatial=1),
                        helper.make_node("Relu", [name + "_bn"], [name + "_relu"])]
            x, cin = name + "_relu", cout
        x = b.max_pool(x, f"pool{block}", k=2)
    b.nodes.append(helper.make_node("Flatten", [x], ["flat"], axis=1))
    x = b.fc("flat", "fc6", 8 * 4 * 4, 16, dropout=True)
    x = b.fc(x, "fc7", 16, 16, dropout=True)
    return b.model("data", 16, b.fc(x, "fc8", 16, 6, relu=False), 6)


def googlenet_like(*, opset: int = 8) -> onnx.ModelProto:
    """bvlc_googlenet's head and one inception block: 1x1 / 1x1→3x3 / maxpool→1x1 branches concatenated, an
    AveragePool as large as the map, Dropout, Reshape, Gemm, Softmax."""
    b = Builder("inputs", opset)
    x = b.conv("data_0", "conv1", 3, 8, 3, stride=2)
    x = b.lrn(b.max_pool(x, "pool1", pads=(0, 0, 1, 1)), "norm1")
    one = b.conv(x, "inc_1x1", 8, 4, 1)
    three = b.conv(b.conv(x, "inc_3x3_reduce", 8, 4, 1), "inc_3x3", 4, 6, 3, pad=1)
    pooled = b.conv(b.max_pool(x, "inc_pool", stride=1, pads=(1, 1, 1, 1)), "inc_pool_proj", 8, 2, 1)
    b.nodes.append(helper.make_node("Concat", [one, three, pooled], ["inc_output"], axis=1))
    b.nodes.append(helper.make_node("AveragePool", ["inc_output"], ["pool5"], kernel_shape=[4, 4], strides=[1, 1]))
    b.nodes.append(helper.make_node("Dropout", ["pool5"], ["pool5_drop"], ratio=0.4))
    x = b.fc(b.flatten("pool5_drop"), "loss3_classifier", 12, 7, relu=False)
    return b.model("data_0", 17, x, 7)


def assert_converts_and_verifies(model: onnx.ModelProto, **options) -> onnx.ModelProto:
    onnx.checker.check_model(model)
    converted = convert_classifier(model, preprocessing=CAFFE, **options)
    card = read_card(converted)
    assert card.verification.passed and card.verification.max_abs_diff <= TOLERANCE  # probabilities: |scores| <= 1
    assert [value.name for value in converted.graph.input] == [model.graph.input[0].name]
    assert converted.ir_version in IR_VERSIONS
    return converted


@pytest.mark.parametrize("style, opset", [
    ("inputs", 1), ("inputs", 3), ("inputs", 5), ("constants", 3),
    ("inputs", 6), ("inputs", 7), ("inputs", 8), ("inputs", 9),
    ("constants", 6), ("constants", 9), ("computed", 9),
], ids=lambda v: str(v))
def test_alexnet_family_converts_at_every_old_opset_and_weight_style(style, opset):
    model = alexnet(style=style, opset=opset)
    converted = assert_converts_and_verifies(model)
    card = read_card(converted)
    assert ("upgraded to opset 12" in card.verification.reference) == (opset < 7)  # onnxruntime runs opset 7 on
    assert (card.output_stride, card.native_output_stride, len(card.labels)) == (16, 16, 5)
    image = to_input(sample_pixels(count=1, height=83, width=67, channels=3, seed=3), card.preprocessing)
    scores = run(converted, image)
    assert scores.shape == (1, 5, 3, 2)
    np.testing.assert_allclose(scores.sum(axis=1), 1.0, atol=1e-5)  # Softmax per cell over the classes


def test_every_weight_style_is_the_same_classifier_after_normalisation():
    """Same seed, same weights: stored as inputs, as Constant nodes or computed, the normalised graphs agree."""
    image = to_input(sample_pixels(count=1, height=51, width=51, channels=3), CAFFE_NCHW)
    outputs = {style: run(normalize(runnable(alexnet(style=style)), input_shape=[1, 3, 51, 51]), image)
               for style in ("inputs", "constants", "computed")}
    np.testing.assert_allclose(outputs["constants"], outputs["inputs"], atol=1e-6)
    np.testing.assert_allclose(outputs["computed"], outputs["inputs"], atol=1e-6)


@pytest.mark.parametrize("style", ["inputs", "constants", "computed"])
def test_normalisation_leaves_one_canonical_form(style):
    """"computed" names the case onnxscript's folder leaves alone by default: ConstantOfShape (see fold_constant_of_shape)."""
    model = alexnet(style=style, opset=6 if style != "computed" else 9)
    normal = normalize(runnable(model), input_shape=[1, 3, 51, 51])
    ops = collections.Counter(node.op_type for node in normal.graph.node)
    assert not {"Constant", "ConstantOfShape", "Shape", "Gather", "Concat", "Dropout", "Identity", "Sub", "Mul"} & set(ops)
    assert ops["Gemm"] == 3 and ops["Reshape"] == 1
    assert [value.name for value in normal.graph.input] == ["data_0"]
    assert normal.ir_version in IR_VERSIONS and normal.opset_import[0].version == TARGET_OPSET
    names = [out for node in normal.graph.node for out in node.output] + [init.name for init in normal.graph.initializer]
    assert len(names) == len(set(names))
    gemm = next(node for node in normal.graph.node if node.op_type == "Gemm")
    assert not any(a.name == "broadcast" for a in gemm.attribute)  # opset 6's attribute went with the upgrade


def test_caffe_alexnet_at_ir3_gets_the_atrous_rewrite_after_the_upgrade():
    """MaxPool takes dilations from opset 10: an opset-9 AlexNet gets them once normalised to opset 12."""
    fine = assert_converts_and_verifies(alexnet(opset=9), output_stride=8)
    card = read_card(fine)
    assert (card.output_stride, card.native_output_stride) == (8, 16)
    image = to_input(sample_pixels(count=1, height=83, width=67, channels=3, seed=3), card.preprocessing)
    coarse = run(convert_classifier(alexnet(opset=9), preprocessing=CAFFE), image)
    dense = run(fine, image)
    # Cell (2i, 2j) of the stride-8 map is cell (i, j) of the stride-16 map: à trous is shift-and-stitch.
    np.testing.assert_allclose(dense[:, :, ::2, ::2][:, :, :coarse.shape[2], :coarse.shape[3]], coarse, atol=1e-5)


def test_vgg_with_batch_norm_at_opset_8_folds_it_into_the_convs():
    converted = assert_converts_and_verifies(vgg_bn(opset=8))
    ops = collections.Counter(node.op_type for node in converted.graph.node)
    assert "BatchNormalization" not in ops and ops["Conv"] == 4 + 3
    assert read_card(converted).output_stride == 4


def test_googlenet_like_head_converts():
    converted = assert_converts_and_verifies(googlenet_like(opset=8))
    card = read_card(converted)
    assert (card.output_stride, len(card.labels)) == (4, 7)
    image = to_input(sample_pixels(count=1, height=25, width=29, channels=3, seed=1), card.preprocessing)
    assert run(converted, image).shape == (1, 7, 3, 4)



def test_densenet_like_head_of_a_1x1_conv_after_global_pooling_converts():
    """Caffe's DenseNet ends GlobalAveragePool → 1x1 Conv (the FC as a convolution) with no Softmax."""
    b = Builder("inputs", 9)
    x = b.conv("data", "conv1", 3, 6, 3, stride=2)
    grown = b.conv(x, "dense1", 6, 4, 3, pad=1)
    b.nodes += [helper.make_node("Concat", [x, grown], ["concat1"], axis=1),
                helper.make_node("GlobalAveragePool", ["concat1"], ["pool"])]
    w, bias = b.weight("fc6_w", 5, 10, 1, 1), b.weight("fc6_b", 5)
    b.nodes.append(helper.make_node("Conv", ["pool", w, bias], ["fc6"], kernel_shape=[1, 1]))
    graph = helper.make_graph(b.nodes, "densenet_like", [helper.make_tensor_value_info("data", TensorProto.FLOAT, [1, 3, 11, 11])]
                              + [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in b.weights],
                              [helper.make_tensor_value_info("fc6", TensorProto.FLOAT, [1, 5, 1, 1])], b.weights)
    model = helper.make_model(graph, ir_version=3, opset_imports=[helper.make_opsetid("", 9)])
    converted = convert_classifier(model, preprocessing=CAFFE)
    card = read_card(converted)
    assert card.verification.passed and card.output_kind == OUTPUT_KIND_LOGITS and card.output_stride == 2
    image = to_input(sample_pixels(count=1, height=15, width=13, channels=3, seed=2), card.preprocessing)
    assert run(converted, image).shape == (1, 5, 3, 2)


LIGHT_MODELS = pathlib.Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"


@pytest.mark.parametrize("name", ["squeezenet", "inception_v1"])
def test_the_model_zoo_graphs_onnx_ships_convert(name):
    """onnx's test data holds the zoo's real Caffe2-era graphs with ConstantOfShape weights ("light" models):
    IR 3, opset 9, weights listed as inputs. (AlexNet, ZFNet, VGG19, ResNet-50, Inception v2 and DenseNet-121
    convert too, but take 10-60 s each.)"""
    path = LIGHT_MODELS / f"light_{name}.onnx"
    if not path.exists():
        pytest.skip(f"{path} is not installed with this onnx")
    converted = convert_classifier(str(path), preprocessing=CAFFE, labels=imagenet_labels())
    card = read_card(converted)
    assert card.verification.passed and len(card.labels) == 1000 and card.output_stride in (16, 32)


def test_a_graph_at_the_newest_ir_version_is_verified_against_its_loadable_form():
    """onnx 1.23 writes IR 14 by default, which onnxruntime 1.31 refuses: the IR version is capped, not the graph refused."""
    newest = runnable(alexnet(style="constants"))  # opset 12, IR 4
    newest.ir_version = onnx.IR_VERSION
    converted = assert_converts_and_verifies(newest)
    assert onnx.IR_VERSION not in IR_VERSIONS and converted.ir_version == IR_VERSIONS[-1]


def test_without_a_preprocessing_the_library_converts_raw_pixels_with_a_warning(caplog):
    """scoremap-convert refuses (exit 2, tests/convert/test_convert_cli.py); the library says so and goes on."""
    with caplog.at_level("WARNING", logger="convert"):
        card = read_card(convert_classifier(googlenet_like()))
    assert "choose a preprocessing" in caplog.text and "raw 0..255" in caplog.text
    assert (card.preprocessing.pixel_scale, list(card.preprocessing.mean), list(card.preprocessing.std)) == (1.0, [0.0] * 3, [1.0] * 3)
    with pytest.raises(UsageError, match="choose a preprocessing"):
        convert_classifier(googlenet_like(), require_preprocessing=True)


def resnet_like(*, opset: int) -> onnx.ModelProto:
    """A Caffe2-era ResNet stem and head: BatchNormalization with its old attributes, a per-channel scale and
    shift by Mul/Add with `broadcast=1, axis=1` before opset 7, Sum, an AveragePool as large as the map."""
    b = Builder("inputs", opset)
    legacy = opset < 7
    bn_old = {"is_test": 1, "consumed_inputs": [0, 0, 0, 1, 1]} if opset < 6 else {"is_test": 1} if legacy else {}
    channel_shape = (4,) if legacy else (4, 1, 1)  # opset 7 broadcasts like numpy: a per-channel constant is [C, 1, 1]
    w = b.weight("conv1_w", 4, 3, 3, 3)
    params = [b.weight("bn_s", 4), b.weight("bn_b", 4), b.weight("bn_m", 4)]
    b.weights.append(numpy_helper.from_array((b.rng.random(4) + 0.5).astype(np.float32), "bn_v"))
    scale, shift = b.weight("scale", *channel_shape), b.weight("shift", *channel_shape)
    at_axis = {"broadcast": 1, "axis": 1} if legacy else {}
    b.nodes += [
        helper.make_node("Conv", ["data", w], ["conv1"], kernel_shape=[3, 3], strides=[2, 2]),
        helper.make_node("BatchNormalization", ["conv1", *params, "bn_v"], ["bn"], epsilon=1e-5, spatial=1, **bn_old),
        helper.make_node("Mul", ["bn", scale], ["scaled"], **at_axis),
        helper.make_node("Add", ["scaled", shift], ["shifted"], **at_axis),
        helper.make_node("Relu", ["shifted"], ["relu"]),
        helper.make_node("Sum", ["relu", "bn"], ["res"]),
        helper.make_node("AveragePool", ["res"], ["pool"], kernel_shape=[6, 6]),
    ]
    x = b.fc(b.flatten("pool"), "fc", 4, 5, relu=False)
    return b.model("data", 13, x, 5)


@pytest.mark.parametrize("opset", [3, 6, 8])
def test_caffe2_resnet_like_graph_with_legacy_broadcasting_converts(opset):
    assert_converts_and_verifies(resnet_like(opset=opset))


def test_legacy_broadcast_axis_is_made_explicit_because_the_version_converter_ignores_it():
    """The case onnx's version converter gets wrong (onnx 1.23): Add(broadcast=1, axis=1) of a [C] bias to an
    [N, C, H, W] map becomes Unsqueeze(axes=[1, 2, 3]), a [C, 1, 1, 1] bias; explicit_broadcast_axes runs first."""
    bias = np.arange(4, dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Add", ["r", "bias"], ["y"], broadcast=1, axis=1)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 2, 2]), helper.make_tensor_value_info("bias", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 2, 2])], [numpy_helper.from_array(bias, "bias")])
    model = helper.make_model(graph, ir_version=3, opset_imports=[helper.make_opsetid("", 6)])
    x = np.ones((1, 4, 2, 2), np.float32)
    by_the_tool = onnx.version_converter.convert_version(model, TARGET_OPSET)
    unsqueeze = next(node for node in by_the_tool.graph.node if node.op_type == "Unsqueeze")
    assert list(next(a.ints for a in unsqueeze.attribute if a.name == "axes")) == [1, 2, 3]  # [C, 1, 1, 1]: wrong
    np.testing.assert_allclose(run(runnable(model), x), x + bias.reshape(1, 4, 1, 1))
