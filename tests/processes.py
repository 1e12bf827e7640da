"""Finding a test's own helper processes by what their command line names (Ray actors carry their class), and
starting one with process settings of its own.

A child's settings are given by a command in front of it, not by subprocess's `preexec_fn`: that runs Python in the
forked child of a test process whose gRPC threads hold locks, and gRPC's fork handler then aborted the child.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
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


def with_umask_022(command: Sequence[str]) -> list[str]:
    """`command` run with umask 022, so the modes of the files it writes are known."""
    return ["sh", "-c", 'umask 022 && exec "$@"', "sh", *command]


def without_tunables() -> dict[str, str]:
    """This process's environment less GLIBC_TUNABLES: a child that starts with glibc's defaults."""
    return {key: value for key, value in os.environ.items() if key != "GLIBC_TUNABLES"}
