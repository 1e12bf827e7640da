"""The exception types that leave the convert package."""

from __future__ import annotations


class ConversionError(ValueError):
    """A classifier that cannot be converted faithfully; the message names the node and the reason."""


class UsageError(ConversionError):
    """The request is incomplete or names something that is not there (a file, a factory, a label set,
    a missing preprocessing choice): nothing is wrong with the classifier; fix the command line."""
