"""Images too large to send or decode whole, scored tile by tile and stitched on disk (issue 20)."""
