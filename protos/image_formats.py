"""The encoded image formats a ScoreRequest's `encoded` bytes may hold, defined once: the server's decoder opens
these (server/scoring/imaging.py), refusals name them, and the clients find files by them. A convention of the
wire beside the messages, light (no decoder imported), so command lines import it for `--help` and file search.

HEIC is read by pillow-heif, AVIF by Pillow's own plugin; a GIF (or any animation) is scored by its first frame.
"""

from __future__ import annotations

__all__ = ["FORMATS", "NAMES", "SUFFIXES"]

# PIL's name of each format: (its name as people write it, the file suffixes it is saved under).
FORMATS = {
    "JPEG": ("JPEG", (".jpg", ".jpeg", ".jpe", ".jfif")),
    "PNG": ("PNG", (".png",)),
    "WEBP": ("WebP", (".webp",)),
    "BMP": ("BMP", (".bmp",)),
    "TIFF": ("TIFF", (".tif", ".tiff")),
    "GIF": ("GIF", (".gif",)),
    "HEIF": ("HEIC", (".heic", ".heif", ".hif")),
    "AVIF": ("AVIF", (".avif",)),
}
NAMES = ", ".join(name for name, _suffixes in FORMATS.values())  # "JPEG, PNG, WebP, ..." for messages
SUFFIXES = frozenset(suffix for _name, suffixes in FORMATS.values() for suffix in suffixes)
