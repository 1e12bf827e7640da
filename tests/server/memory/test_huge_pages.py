"""The server's command runs under glibc's huge-page tunable (started again once, with the same pid), a tunable the
environment names already is left alone, and under it glibc's large mappings are backed by transparent huge pages."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from server.memory.huge_pages import HUGE, TUNABLE, glibc
from tests.processes import without_tunables
from tests.server.test_main import Served

pytestmark = pytest.mark.skipif(not glibc(), reason="glibc's tunables: not a glibc system")

PROBE = ("import os, sys\n"
         "print('TUNABLES', os.environ.get('GLIBC_TUNABLES'), flush=True)\n"
         "from server.main import main\n"
         "sys.argv = ['scoremap-serve', '--version']\n"
         "main()\n")


def probe(environment: dict[str, str]) -> list[str]:
    """What the probe printed of GLIBC_TUNABLES, at each start of its process, running the server's command."""
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60,
                            env=environment)
    assert result.returncode == 0, result.stderr
    return [line.split(" ", 1)[1] for line in result.stdout.splitlines() if line.startswith("TUNABLES")]


def test_the_command_starts_again_once_with_huge_pages_and_keeps_what_the_environment_says():
    bare = without_tunables()
    assert probe(bare) == ["None", HUGE]  # once, then never again
    other = "glibc.malloc.arena_max=2"
    assert probe(dict(bare, GLIBC_TUNABLES=other)) == [other, f"{other}:{HUGE}"]
    declined = f"{TUNABLE}=0"  # 4 KiB pages, as asked
    assert probe(dict(bare, GLIBC_TUNABLES=declined)) == [declined]


def test_a_started_server_runs_under_the_tunable_with_its_own_pid(tiny_model_path):
    served = Served([tiny_model_path, "--port", "0", "--intra-op-threads", "1", "--no-warm-up", "--log-level", "INFO"])
    try:
        served.wait_for("ready: health SERVING")
        environment = pathlib.Path(f"/proc/{served.process.pid}/environ").read_bytes().split(b"\0")
        assert any(entry.startswith(b"GLIBC_TUNABLES=") and HUGE.encode() in entry for entry in environment)
    finally:
        served.process.terminate()
        served.process.wait(60)


def test_a_large_buffer_is_backed_by_huge_pages_under_the_tunable():
    modes = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not modes.exists() or "[never]" in modes.read_text():
        pytest.skip("transparent huge pages are off on this machine")
    bare = without_tunables()
    assert huge_kib_of_a_malloc(dict(bare, GLIBC_TUNABLES=HUGE)) >= 2048, \
        "no huge page backs a 32 MiB buffer under glibc.malloc.hugetlb=1"
    if "[madvise]" in modes.read_text():  # huge pages only where asked: none without the tunable
        assert huge_kib_of_a_malloc(bare) == 0


def huge_kib_of_a_malloc(environment: dict[str, str]) -> int:
    """KiB of huge pages in a process (started with `environment`) that mallocs and writes 32 MiB: as PIL's and
    libjpeg's buffers are made (numpy advises its own large arrays already), above the 2 MiB mmap threshold, so
    mapped by itself."""
    touch = ("import ctypes, pathlib\n"
             "libc = ctypes.CDLL(None)\n"
             "libc.malloc.restype = ctypes.c_void_p\n"
             "buffer = libc.malloc(32 * 2**20)\n"
             "ctypes.memset(buffer, 1, 32 * 2**20)\n"
             "rollup = pathlib.Path('/proc/self/smaps_rollup').read_text()\n"
             "print(int(rollup.split('AnonHugePages:')[1].split()[0]))\n")
    return int(subprocess.run([sys.executable, "-c", touch], capture_output=True, text=True, timeout=60,
                              env=environment, check=True).stdout)
