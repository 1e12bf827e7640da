"""The one exception type that leaves the convert package."""

from __future__ import annotations


class ConversionError(ValueError):
    """A classifier that cannot be converted faithfully; the message names the node and the reason."""
