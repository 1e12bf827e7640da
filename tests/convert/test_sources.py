"""Every source kind reaches the same ONNX surgery: TorchScript files, package.module:factory (+ state dict), the default model."""

import pathlib
import textwrap

import numpy as np
import onnx
import pytest
import torch

from convert import ConversionError, convert_classifier
from convert.card import read_card
from convert.preprocessing import to_input
from convert.verify import run
from convert.presets import preset
from protos.model_card_pb2 import OUTPUT_KIND_PROBABILITIES, PRECISION_FP32

SAMPLES = pathlib.Path(__file__).resolve().parents[2] / "samples"
FACTORY_MODULE = textwrap.dedent('''
    from torch import nn

    def tiny():
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4 * 7 * 7, 3))
''')

RAW = preset("raw")


@pytest.fixture
def factory_module(tmp_path, monkeypatch) -> str:
    (tmp_path / "scoremap_test_factory.py").write_text(FACTORY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "scoremap_test_factory:tiny"


def test_factory_with_state_dict_converts_with_those_weights(factory_module, tmp_path):
    import scoremap_test_factory

    torch.manual_seed(1)
    net = scoremap_test_factory.tiny().eval()
    torch.save(net.state_dict(), tmp_path / "weights.pt")
    converted = convert_classifier(factory_module, training_size=16, state_dict=str(tmp_path / "weights.pt"), preprocessing=RAW)
    card = read_card(converted)
    assert card.source == f"pytorch: {factory_module}" and card.verification.passed
    image = torch.rand(1, 3, 16, 16) * 255
    with torch.no_grad():
        expected = net(image).numpy()
    np.testing.assert_allclose(run(converted, image.numpy())[:, :, 0, 0], expected, rtol=1e-4, atol=1e-3)


def test_state_dict_that_does_not_fit_is_refused(factory_module, tmp_path):
    torch.save({"unexpected.weight": torch.zeros(1)}, tmp_path / "bad.pt")
    with pytest.raises(ConversionError, match="does not match"):
        convert_classifier(factory_module, training_size=16, state_dict=str(tmp_path / "bad.pt"), preprocessing=RAW)


def test_torchscript_file_converts(tmp_path):
    torch.manual_seed(2)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                              torch.nn.Flatten(), torch.nn.Linear(4, 2), torch.nn.Softmax(dim=1)).eval()
    path = tmp_path / "net.pt"
    torch.jit.script(net).save(str(path))
    card = read_card(convert_classifier(str(path), training_size=12, preprocessing=RAW))
    assert card.source == "torchscript: net.pt" and card.output_kind == OUTPUT_KIND_PROBABILITIES and card.verification.passed


def test_unknown_source_says_what_is_expected():
    with pytest.raises(ConversionError, match="expected 'default', a path to an .onnx"):
        convert_classifier(42)


def test_default_model_card(default_model_path):
    card = read_card(default_model_path)
    assert (card.name, len(card.labels), card.labels[967]) == ("efficientnet-lite0", 1000, "espresso")
    assert (card.training_height, card.training_width, card.output_stride) == (224, 224, 32)
    assert (card.default_scale, card.size_multiple, card.precision, card.scores_name) == (384, 32, PRECISION_FP32, "scores")
    assert card.preprocessing.input_name == "image" and list(card.preprocessing.mean) == [127.0] * 3
    assert card.verification.passed and card.verification.max_abs_diff <= card.verification.tolerance
    assert card.receptive_field.size >= 224
    model = onnx.load(default_model_path)
    assert model.ir_version <= 10
    dims = [d.dim_param or d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["N", 3, "H", "W"]


def photo_probabilities(model_path: str, photo: str, size: tuple[int, int]) -> np.ndarray:
    from PIL import Image

    card = read_card(model_path)
    with Image.open(photo) as image:
        pixels = np.asarray(image.convert("RGB").resize(size, Image.Resampling.BILINEAR), np.float32)
    scores = run(onnx.load(model_path), to_input(pixels[None], card.preprocessing))[0]
    cells = np.exp(scores - scores.max(axis=0))
    return (cells / cells.sum(axis=0)).mean(axis=(1, 2))


def test_default_model_finds_the_cat_and_the_espresso(default_model_path):
    cat = photo_probabilities(default_model_path, str(SAMPLES / "cat.jpg"), (576, 384))
    coffee = photo_probabilities(default_model_path, str(SAMPLES / "coffee.jpg"), (576, 384))
    assert 281 <= int(np.argmax(cat)) <= 285
    assert int(np.argmax(coffee)) == 967
