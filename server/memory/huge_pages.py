"""Transparent huge pages for glibc's mappings: a process that decodes photos (the server's command, `scoremap-score
--local`) starts again with glibc told to ask for them.

Above the 2 MiB mmap threshold (server.memory.runtime.configure_allocator) each of a request's large buffers (a
12-megapixel photo's decoded and resized pixels, PIL's blocks, the canvases on the heap) is mapped afresh and faulted
in 4 KiB at a time: about 6,400 page faults to decode and resize one such photo to 768, a seventh of its time.
With `glibc.malloc.hugetlb=1` glibc advises its mappings for transparent huge pages (MADV_HUGEPAGE), which the
kernel then fills 2 MiB at a time (docs/design.md: huge pages for glibc's mappings). glibc reads its tunables only
when a process starts, so the command starts itself again with the tunable added to GLIBC_TUNABLES, once. A
GLIBC_TUNABLES that names `glibc.malloc.hugetlb` already (`=0` to keep 4 KiB pages) is left as it is. Nothing here
imports anything heavy: the server runs it before its command line is parsed.
"""

from __future__ import annotations

import os
import sys

__all__ = ["HUGE", "TUNABLE", "glibc", "restart_with_huge_pages"]

TUNABLE = "glibc.malloc.hugetlb"
HUGE = f"{TUNABLE}=1"


def restart_with_huge_pages() -> None:
    """Replace this process with itself under glibc's huge-page tunable (the same pid, argv and descriptors); return
    without doing so where the C library is not glibc, GLIBC_TUNABLES already names the tunable, or the exec fails."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if TUNABLE in tunables or not glibc():
        return
    environment = dict(os.environ, GLIBC_TUNABLES=f"{tunables}:{HUGE}" if tunables else HUGE)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, environment)
    except OSError:  # the interpreter cannot be started again (gone, or not executable): served with 4 KiB pages
        return


def glibc() -> bool:
    """Whether this process runs on glibc."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (ValueError, OSError, AttributeError):  # not a GNU system
        return False
