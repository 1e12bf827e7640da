import numpy as np
import pytest

from convert.preprocessing import normalize, to_input
from protos.model_card_pb2 import CHANNEL_ORDER_BGR, CHANNEL_ORDER_RGB, INPUT_DTYPE_FLOAT32, INPUT_DTYPE_UINT8, LAYOUT_NCHW, LAYOUT_NHWC, Preprocessing

PIXELS = np.arange(2 * 3 * 4 * 3, dtype=np.uint8).reshape(2, 3, 4, 3) * 2


def test_the_cards_formula_channel_order_and_layout():
    card = Preprocessing(layout=LAYOUT_NCHW, dtype=INPUT_DTYPE_FLOAT32, channel_order=CHANNEL_ORDER_BGR, pixel_scale=1 / 255,
                         mean=[0.1, 0.2, 0.3], std=[0.5, 0.5, 0.5])
    tensor = to_input(PIXELS, card)
    assert tensor.shape == (2, 3, 3, 4) and tensor.dtype == np.float32
    expected_blue_first = (PIXELS[..., 2].astype(np.float32) / 255 - 0.1) / 0.5
    np.testing.assert_allclose(tensor[:, 0], expected_blue_first, rtol=1e-6)


def test_uint8_inputs_get_the_formula_rounded_and_clipped():
    card = Preprocessing(layout=LAYOUT_NHWC, dtype=INPUT_DTYPE_UINT8, channel_order=CHANNEL_ORDER_RGB, pixel_scale=2.0, mean=[10, 10, 10], std=[1, 1, 1])
    tensor = to_input(PIXELS, card)
    assert tensor.dtype == np.uint8 and tensor.shape == PIXELS.shape
    np.testing.assert_array_equal(tensor, np.clip(PIXELS.astype(np.int32) * 2 - 10, 0, 255))


def test_an_unset_enum_is_named():
    with pytest.raises(ValueError, match="Layout value 0 is unset"):
        normalize(PIXELS, Preprocessing(dtype=INPUT_DTYPE_FLOAT32, channel_order=CHANNEL_ORDER_RGB))
