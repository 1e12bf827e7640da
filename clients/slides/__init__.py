"""Images too large to send or decode whole, scored tile by tile and stitched on disk."""

DEFAULT_CANVAS = 2048  # the canvas side each tile is scored on: --canvas, SlideOptions.canvas
# Declared pixels a slide's largest level may hold (--max-slide-pixels): real scans reach about 100k x 100k at
# level 0; a header claiming more is refused before anything is read or written.
DEFAULT_MAX_SLIDE_PIXELS = 10_000_000_000
# The most one decode may allocate: a TIFF's tile or strip, or an image PIL decodes whole. A file that needs more
# is refused by its header, so memory stays bounded whatever the header says.
MAX_DECODE_BYTES = 1 << 30
