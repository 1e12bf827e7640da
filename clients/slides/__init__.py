"""Images too large to send or decode whole, scored tile by tile and stitched on disk (issue 20)."""

DEFAULT_CANVAS = 2048  # the canvas side each tile is scored on: --canvas, SlideOptions.canvas
