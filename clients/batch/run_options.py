"""The options a batch run scores with, stored in its output folder (OUT/options.json).

A re-run into the same folder skips what is recorded; under other options that would leave the
old results in place while looking finished. So the folder remembers its options: a
re-run with different ones is refused, naming them, unless the user asks for the new options
(--force-new-options), in which case files recorded under other options are scored again.
Each record carries the fingerprint of the options it was made with.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from clients.api.options import ScoreOptions
from clients.batch.files import atomic_write

__all__ = ["OPTIONS_NAME", "OptionsChanged", "run_options", "fingerprint", "settle_options"]

OPTIONS_NAME = "options.json"


class OptionsChanged(ValueError):
    """The output folder holds results of other options; `names` are the options that differ."""

    def __init__(self, folder: Path, changes: dict[str, tuple[Any, Any]]) -> None:
        self.names = sorted(changes)
        described = "; ".join(f"--{name.replace('_', '-')}: {old!r} before, {new!r} now"
                              for name, (old, new) in sorted(changes.items()))
        super().__init__(f"{str(folder)!r} holds results scored with other options ({described}); "
                         "score into a new --out folder, or pass --force-new-options to score every file "
                         "again with the new ones")


def run_options(options: ScoreOptions, *, maps: bool, heatmaps: bool) -> dict[str, Any]:
    """The options that shape a run's results and outputs, as JSON-ready values."""
    return {"model": options.model, "scales": [int(s) for s in options.scales], "stride": options.stride,
            "shift": options.shift, "flip": options.flip, "map_dtype": options.map_dtype,
            "top_k": options.top_k, "maps": maps, "heatmaps": heatmaps}


def fingerprint(values: dict[str, Any]) -> str:
    """A short stable digest of `values`, stored in each record."""
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]


def settle_options(folder: str | Path, values: dict[str, Any], *, force: bool) -> str:
    """Check `values` against the folder's stored options (storing them on a first run, or when
    `force`d); their fingerprint. Raises OptionsChanged when they differ and not `force`."""
    path = Path(folder) / OPTIONS_NAME
    stored: dict[str, Any] | None = None
    if path.exists():
        try:
            stored = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            stored = None  # unreadable: treated as a folder without stored options
    if stored != values:
        if stored is not None and not force:
            changes = {name: (stored.get(name), value) for name, value in values.items() if stored.get(name) != value}
            changes.update({name: (value, None) for name, value in stored.items() if name not in values})
            raise OptionsChanged(Path(folder), changes)
        atomic_write(path, (json.dumps(values, indent=2, sort_keys=True) + "\n").encode())
    return fingerprint(values)
