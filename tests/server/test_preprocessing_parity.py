import numpy as np

from convert.preprocessing import to_input
from protos.model_card_pb2 import Preprocessing
from server import imaging

PIXELS = np.arange(2 * 3 * 4 * 3, dtype=np.uint8).reshape(2, 3, 4, 3) * 2


def test_the_server_batches_exactly_what_the_converter_verified_with():
    card = Preprocessing(layout="LAYOUT_NCHW", dtype="INPUT_DTYPE_FLOAT16", channel_order="CHANNEL_ORDER_RGB", pixel_scale=1.0,
                         mean=[127, 127, 127], std=[128, 128, 128])
    served = imaging.to_batch([imaging.normalize(image, card) for image in PIXELS], card)
    np.testing.assert_array_equal(served, to_input(PIXELS, card))
