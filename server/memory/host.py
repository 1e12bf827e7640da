"""Host memory of one request, budgeted from the image header before anything is decoded.

A dense request multiplies its image: decoded once, resized per scale, cut into passes (shifts x
flips) and turned into model inputs, each pass answered by a score map: a 2432x640 PNG at 8 scales, stride 16
and flip can need ~10 GB of host memory (~1 GB each) if nothing but the model's run is budgeted.
`estimate_request` counts every copy the pipeline holds at once; admission (server.memory.host_budget.admit_host)
refuses, with the numbers, a request whose estimate exceeds `Settings.max_request_host_bytes`, and the requests in
flight share `HostBudget`. That estimate, not a size cap, decides how large a request may be: a phone photo at its
own size needs a few hundred MiB, which a pixel cap derived from the worst request the limits allow would refuse
(docs/design.md). An image no canvas bucket holds is tiled, so only its host memory grows with it.

How a pipeline holds a scale is a `HostPath`: `DEVICE_PASSES` is the server's (one uint8 canvas per
scale and orientation; passes, lattice and probabilities made on the device);
`HOST_PASSES` a pipeline making them on the host (float32 inputs and a score map per shifted pass), counted
to show what the device path saves.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

__all__ = ["HostPath", "HOST_PASSES", "DEVICE_PASSES", "HostEstimate", "TiledScale", "estimate_request"]

FLOAT32 = 4
RGB = 3
# Bytes per pixel of the largest decoded mode PIL hands over before the RGB conversion (RGBA, CMYK,
# 32-bit integer grey); the RGB copy comes on top.
DECODED_BYTES_PER_PIXEL = 4
INPUT_COPIES = 2


@dataclasses.dataclass(frozen=True)
class HostPath:
    """What a pipeline keeps in host memory per scale, in copies of the resized image."""

    name: str
    input_itemsize: int   # bytes per value of the model inputs built on the host
    inputs_per_pass: bool  # one input per pass (shift) on the host, else one per scale (and orientation)
    maps_per_pass: bool    # a score map per pass comes back to the host, else one lattice per flip


HOST_PASSES = HostPath("host passes (float32 inputs, a map per pass)", FLOAT32, True, True)
DEVICE_PASSES = HostPath("device passes (one uint8 canvas per scale)", 1, False, False)


@dataclasses.dataclass(frozen=True)
class HostEstimate:
    """Bytes one request holds on the host at its peak, term by term."""

    encoded: int   # the request's image bytes
    decoded: int   # the decoded image and its RGB copy
    resized: int   # one uint8 RGB image per scale and orientation
    inputs: int    # model inputs built on the host
    maps: int      # score maps back from the model, the lattices, their flip average and the response

    @property
    def total(self) -> int:
        return self.encoded + self.decoded + self.resized + self.inputs + self.maps

    def describe(self) -> str:
        parts = ", ".join(f"{field.name} {getattr(self, field.name) / 2**20:,.0f} MiB"
                          for field in dataclasses.fields(self))
        return f"{self.total / 2**20:,.0f} MiB ({parts})"


@dataclasses.dataclass(frozen=True)
class TiledScale:
    """A scale tiled onto one canvas: its resized image, its tiles' canvas and how many per orientation."""

    resized: tuple[int, int]
    canvas: tuple[int, int]
    tiles: int
    tile_cells: int  # lattice cells of one tile's map (the largest tile's)


def estimate_request(
    *,
    encoded_bytes: int,
    image_size: tuple[int, int],
    resized_sizes: Sequence[tuple[int, int]],
    passes: int,
    flip: bool,
    classes: int,
    native_stride: int,
    output_stride: int,
    path: HostPath = DEVICE_PASSES,
    tiled: Sequence[TiledScale] = (),
    lattice_itemsize: int = FLOAT32,
) -> HostEstimate:
    """The host memory of one request, from what is known before decoding.

    `resized_sizes`: (height, width) per scale scored in one pass; `passes`: shifted passes per scale and
    orientation; `classes`: the model's output channels; strides in pixels per cell of one pass and of the
    lattice. `tiled`: the scales scored tile by tile, whose tiles are all in flight at once (each a canvas and
    its lattice back), beside the whole map they are stitched into. `lattice_itemsize`: bytes per value of the
    lattices the device hands back, 2 for float16 maps, 0 when the request asks for no maps and no cell top-k
    (only the image's probabilities come back)."""
    height, width = image_size
    orientations = 2 if flip else 1
    pixels = [h * w for h, w in resized_sizes]
    # Each input is held twice: as built (a window, a canvas) and stacked into its batch.
    per_scale_inputs = INPUT_COPIES * orientations * (passes if path.inputs_per_pass else 1)
    inputs = sum(p * RGB * path.input_itemsize * per_scale_inputs for p in pixels)
    # A lattice per orientation as fetched, then their float32 average and the response's bytes of it.
    per_cell = classes * (orientations * lattice_itemsize + 2 * FLOAT32) if lattice_itemsize else 0
    lattices = sum(per_cell * math.ceil(p / output_stride**2) for p in pixels)
    pass_maps = (sum(classes * FLOAT32 * math.ceil(p / native_stride**2) for p in pixels) * passes * orientations
                 if path.maps_per_pass else 0)
    resized = sum(p * RGB for p in pixels) * orientations  # and its mirror image
    for scale in tiled:  # the resized image once (tiles are mirrored one by one), each tile's canvas and lattice
        area = scale.resized[0] * scale.resized[1]
        resized += area * RGB
        inputs += scale.tiles * orientations * scale.canvas[0] * scale.canvas[1] * RGB * INPUT_COPIES
        lattices += (per_cell * math.ceil(area / output_stride**2)
                     + classes * lattice_itemsize * scale.tiles * orientations * scale.tile_cells)
    return HostEstimate(
        encoded=encoded_bytes,
        decoded=height * width * (DECODED_BYTES_PER_PIXEL + RGB),
        resized=resized,
        inputs=inputs,
        maps=pass_maps + lattices,
    )
