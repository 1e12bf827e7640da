"""The one error of reading a large image, and the kind that spoils one tile only."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path


class SlideError(Exception):
    """A large image that cannot be read as asked; the message names the file and the problem."""


class TileError(SlideError):
    """One region of an image whose bytes are missing or do not decode: that tile fails, the others go on."""


@contextlib.contextmanager
def refused(path: Path, what: str, *, notes: list | None = None) -> Iterator[None]:
    """Whatever a reading library raises on an untrusted file (its answers to damage are many: OSError,
    IndexError, struct.error ...) as one SlideError naming the file, with the warnings it gave first (`notes`,
    as warnings.catch_warnings records them); the cause stays chained for --traceback."""
    try:
        yield
    except SlideError:
        raise
    except Exception as error:
        said = dict.fromkeys(str(note.message).strip() for note in notes or ())
        warned = "".join(f"; it warned: {words}" for words in said)
        raise SlideError(f"{path}: {what} ({type(error).__name__}: {error}{warned})") from error
