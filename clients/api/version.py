"""The installed scoremap version, for every command's --version."""

from __future__ import annotations

from importlib import metadata

__all__ = ["version"]


def version() -> str:
    """The version of the installed `scoremap` distribution ("unknown" when run from a bare checkout)."""
    try:
        return metadata.version("scoremap")
    except metadata.PackageNotFoundError:
        return "unknown"
