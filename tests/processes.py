"""Finding a test's own helper processes by what their command line names (Ray actors carry their class)."""

from __future__ import annotations

from pathlib import Path


def pids_named(name: bytes) -> list[int]:
    """Process ids of the running processes whose command line contains `name`."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and name in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids
