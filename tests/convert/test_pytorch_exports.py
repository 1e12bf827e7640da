"""PyTorch families: Flatten/Reshape then Gemm or MatMul+Add, Dropout, GAP or ReduceMean, Softmax or logits."""

import numpy as np
import pytest
import torch
from torch import nn

from convert import convert_classifier
from convert.card import read_card
from convert.preprocessing import to_input
from convert.sources import export_module
from convert.verify import compare_with_crops, sample_pixels
from convert.presets import preset
from protos.model_card_pb2 import CHANNEL_ORDER_RGB, LAYOUT_NCHW, OUTPUT_KIND_LOGITS, OUTPUT_KIND_PROBABILITIES, Preprocessing

TRAINING = 24
# Pixels to [-1, 1], so outputs are O(1) and the absolute tolerance means what it says.
UNIT_RANGE = Preprocessing(channel_order=CHANNEL_ORDER_RGB, pixel_scale=1.0, mean=[127.5] * 3, std=[127.5] * 3)
# Dense cells of a pad-free net equal the classifier on each crop to this tolerance (the converter's bar, 1e-5).
CROP_TOLERANCE = 1e-5

RAW = preset("raw")


def features() -> nn.Sequential:
    """Pad-free body: 24 → 22 → 11 → 9 → 4 (stride 4)."""
    return nn.Sequential(nn.Conv2d(3, 6, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 8, 3), nn.ReLU(), nn.MaxPool2d(2))


class ReshapeMatMul(nn.Module):
    """Reshape of the map, then explicit matmul + bias (exports MatMul + Add), logits out."""

    def __init__(self) -> None:
        super().__init__()
        self.body = features()
        self.weight = nn.Parameter(torch.randn(8 * 4 * 4, 5) * 0.1)
        self.bias = nn.Parameter(torch.randn(5))

    def forward(self, x):
        x = self.body(x)
        return torch.matmul(x.reshape(x.shape[0], -1), self.weight) + self.bias


class MeanHead(nn.Module):
    """ReduceMean over H, W then Linear and Softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.body = features()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return torch.softmax(self.fc(self.body(x).mean(dim=(2, 3))), dim=1)


def flatten_gemm() -> nn.Module:
    return nn.Sequential(features(), nn.Flatten(), nn.Dropout(0.5), nn.Linear(8 * 4 * 4, 12), nn.ReLU(), nn.Linear(12, 5))


def gap_softmax() -> nn.Module:
    return nn.Sequential(features(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3), nn.Softmax(dim=1))


@pytest.mark.parametrize("build, classes, kind", [
    (flatten_gemm, 5, OUTPUT_KIND_LOGITS),
    (ReshapeMatMul, 5, OUTPUT_KIND_LOGITS),
    (gap_softmax, 3, OUTPUT_KIND_PROBABILITIES),
    (MeanHead, 4, OUTPUT_KIND_PROBABILITIES),
], ids=["flatten-gemm-dropout", "reshape-matmul-add", "gap-softmax", "reducemean-softmax"])
def test_pytorch_family_converts_and_dense_cells_equal_crops(build, classes, kind):
    torch.manual_seed(0)
    original = export_module(build().eval(), training_size=(TRAINING, TRAINING))
    converted = convert_classifier(original, training_size=TRAINING, preprocessing=UNIT_RANGE)
    card = read_card(converted)
    assert (card.output_kind, len(card.labels), card.output_stride) == (kind, classes, 4)
    assert card.verification.passed and card.verification.max_abs_diff <= card.verification.tolerance
    assert [o.name for o in converted.graph.output] == ["scores"]
    assert not any(n.op_type in ("Gemm", "MatMul", "Flatten", "Reshape", "Dropout") for n in converted.graph.node)
    image = to_input(sample_pixels(count=1, height=TRAINING + 16, width=TRAINING + 12, channels=3, seed=3), card.preprocessing)
    report = compare_with_crops(original, converted, image, layout=LAYOUT_NCHW, training_size=(TRAINING, TRAINING), stride=4)
    assert report.grid == (5, 4)
    assert report.max_abs_diff <= CROP_TOLERANCE
    assert report.argmax_agreement == 1.0


def test_receptive_field_follows_the_layers():
    torch.manual_seed(0)
    card = read_card(convert_classifier(flatten_gemm().eval(), training_size=TRAINING, preprocessing=RAW))
    # conv3 → 3, pool2 → 4, conv3 → 8, pool2 → 10 (the last pool drops row 9), FC 4x4 at jump 4 → 22;
    # the first window spans pixels 0..21, centred at 10.5 (pixel indices).
    assert card.receptive_field.size == 22
    assert (card.receptive_field.center_y, card.receptive_field.center_x) == (10.5, 10.5)


def test_pytorch_module_without_training_size_is_refused():
    from convert import ConversionError

    with pytest.raises(ConversionError, match="training size"):
        convert_classifier(flatten_gemm().eval())


def test_dense_map_grows_with_the_image():
    torch.manual_seed(0)
    converted = convert_classifier(gap_softmax().eval(), training_size=TRAINING, preprocessing=RAW)
    image = np.zeros((2, 3, 64, 48), np.float32)
    from convert.verify import run

    scores = run(converted, image)
    assert scores.shape == (2, 3, (64 - TRAINING) // 4 + 1, (48 - TRAINING) // 4 + 1)
    np.testing.assert_allclose(scores.sum(axis=1), 1.0, atol=1e-5)
