"""Files of a batch run: finding images, atomic writes, and the append-only results log.

A run may be killed at any instant (SIGKILL included) and must leave only complete lines and
complete files: outputs are written to a temporary file in the same directory, fsynced and
renamed over the target (os.replace is atomic within a filesystem); results.jsonl gets whole
lines, each fsynced, and a torn last line is ignored on read-back. Outputs get the modes the
user's umask gives any new file (mkstemp's own 0600 would hide them from the rest of a team).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path, PurePath
from typing import Any, Callable, Iterable, Iterator

from clients.api.images import ImageLike, looks_like_image
from protos.image_formats import SUFFIXES

__all__ = ["ImageFile", "PARTIAL_SUFFIX", "ResultsLog", "atomic_write", "find_images", "is_image_file",
           "read_records", "remove_partials", "unique_label"]

# Suffix of in-progress temporary files; leftovers from a killed run are removed at start.
PARTIAL_SUFFIX = ".partial"
# Bytes read from each candidate file to recognise an image by its signature.
SIGNATURE_BYTES = 16
# Files with these suffixes are kept even when their bytes are not an image: a zero-byte or
# garbled "photo.jpg" is a failure to record, not a file to skip in silence.
IMAGE_SUFFIXES = SUFFIXES
# The mode a new file asks for before the umask takes its bits away (as open() does).
NEW_FILE_MODE = 0o666


def _read_umask() -> int:
    """The process's umask. Reading it means setting it, which would race with threads creating
    files, so it is read once, at import, before any worker runs."""
    current = os.umask(0o077)
    os.umask(current)
    return current


_UMASK = _read_umask()


@dataclass(frozen=True)
class ImageFile:
    """An image to score: its path, and its path relative to the root it was found under."""

    path: Path
    relative: Path

    @property
    def key(self) -> str:
        """The identity used to resume a run: the absolute, symlink-resolved path."""
        return os.path.realpath(self.path)

    def content(self) -> ImageLike:
        """What is scored: the path (read when the request is built); files elsewhere give their bytes."""
        return self.path


def _read_head(path: Path, size: int) -> bytes:
    with open(path, "rb") as handle:
        return handle.read(size)


def is_image_file(name: str, read_head: Callable[[int], bytes]) -> bool:
    """Whether a file found in a folder is scored: an image suffix, or an image signature in the
    bytes `read_head(n)` gives (so files behind any filesystem are judged alike); unreadable is no."""
    if PurePath(name).suffix.lower() in IMAGE_SUFFIXES:
        return True
    try:
        return looks_like_image(read_head(SIGNATURE_BYTES))
    except OSError:
        return False


def unique_label(name: str, taken: set[str]) -> str:
    """`name`, or `name-2`, `name-3`... if taken; the label is added to `taken`."""
    label, n = name, 1
    while label in taken:
        n += 1
        label = f"{name}-{n}"
    taken.add(label)
    return label


def find_images(paths: Iterable[str | os.PathLike], *,
                on_skip: Callable[[Path], None] | None = None) -> Iterator[ImageFile]:
    """Image files under `paths`: folders walked recursively (sorted), files kept by content.

    A file named explicitly is always yielded (the user asked for it; if it is not an image, its
    scoring fails and is recorded); inside folders, files with an image signature or an image
    suffix are (a corrupt "x.jpg" is recorded as failed, a PNG named "x.txt" is scored).
    Hidden files and folders are skipped; `on_skip` is told each other file left out (not an image).

    With several paths, each file found in a folder is named under that folder's name (made unique
    with a "-2", "-3" suffix), so `a/x.png` and `b/x.png` never share an output name.
    """
    given_paths = list(paths)
    labels: set[str] = set()
    for given in given_paths:
        root = Path(given)
        prefix = Path()
        if len(given_paths) > 1 and root.is_dir():
            prefix = Path(unique_label(os.path.basename(os.path.realpath(root)) or "root", labels))
        if root.is_dir():
            for folder, dirs, names in os.walk(root):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for name in sorted(names):
                    path = Path(folder) / name
                    if name.startswith(".") or not path.is_file():
                        continue
                    if is_image_file(name, partial(_read_head, path)):
                        yield ImageFile(path, prefix / path.relative_to(root))
                    elif on_skip:
                        on_skip(path)
        elif root.exists():
            yield ImageFile(root, Path(root.name))
        else:
            raise FileNotFoundError(f"no such file or folder: {str(root)!r}")


def atomic_write(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` so that readers see either the old file or the whole new one."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=PARTIAL_SUFFIX)
    try:
        os.fchmod(fd, NEW_FILE_MODE & ~_UMASK)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def remove_partials(folder: str | os.PathLike) -> int:
    """Delete temporary files a killed run left under `folder`; how many were removed."""
    removed = 0
    root = Path(folder)
    if root.is_dir():
        for leftover in root.rglob(f".*{PARTIAL_SUFFIX}"):
            leftover.unlink(missing_ok=True)
            removed += 1
    return removed


class ResultsLog:
    """results.jsonl: one JSON object per line, appended whole and fsynced.

    Re-reading keeps the last complete record of each path, so a re-run that re-scores an image
    (`--retry-failed`) supersedes the earlier line.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._repair_torn_tail()
        self._handle = open(self.path, "ab")

    def _repair_torn_tail(self) -> None:
        """Cut a torn last line (a run killed mid-write) so the next append starts on a fresh line."""
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(self.path, "r+b") as handle:
                handle.truncate(data.rfind(b"\n") + 1)
                handle.flush()
                os.fsync(handle.fileno())

    def records(self) -> dict[str, dict[str, Any]]:
        """The last complete record of each key, in file order."""
        return read_records(self.path)

    def append(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, ensure_ascii=False, sort_keys=True).encode() + b"\n"
        self._handle.write(line)
        self._handle.flush()
        os.fsync(self._handle.fileno())

    def close(self) -> None:
        self._handle.close()

    def __enter__(self) -> ResultsLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def keep_records(path: str | os.PathLike, keep: Callable[[dict[str, Any]], bool]) -> int:
    """Rewrite a results.jsonl (atomically) with the last record of each key that `keep` accepts; how many
    lines went. Nothing is written when none would go."""
    target = Path(path)
    if not target.exists():
        return 0
    lines = sum(1 for _ in open(target, "rb"))
    kept = [record for record in read_records(target).values() if keep(record)]
    if len(kept) < lines:
        atomic_write(target, b"".join(json.dumps(record, ensure_ascii=False, sort_keys=True).encode() + b"\n"
                                      for record in kept))
    return lines - len(kept)


def read_records(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """Records of a results.jsonl by key (last one wins); lines that do not parse are skipped."""
    records: dict[str, dict[str, Any]] = {}
    target = Path(path)
    if not target.exists():
        return records
    with open(target, "rb") as handle:
        for line in handle:
            if not line.endswith(b"\n"):
                break  # a torn last line: the run was killed while writing it
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and "key" in record:
                records[record["key"]] = record
    return records
