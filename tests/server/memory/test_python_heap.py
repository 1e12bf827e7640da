"""The serving process's start-up heap is out of the garbage collector's reach once it is ready."""

from __future__ import annotations

import gc
import subprocess
import sys

from tests.server.conftest import serving


def test_a_ready_server_has_frozen_its_start_up_heap(tiny_model_path):
    gc.unfreeze()
    with serving([tiny_model_path]):
        assert gc.get_freeze_count() > 10_000  # modules, the model, gRPC's bindings: frozen when it became ready


def test_freezing_keeps_collecting_what_requests_make():
    """Cycles made after the freeze are still collected (a frozen heap is not a disabled collector)."""
    script = ("import gc, weakref\n"
              "from server.memory.python_heap import freeze_startup_heap\n"
              "freeze_startup_heap()\n"
              "class Node: pass\n"
              "a, b = Node(), Node(); a.other, b.other = b, a\n"
              "seen = weakref.ref(a); del a, b\n"
              "gc.collect()\n"
              "assert seen() is None and gc.get_freeze_count() > 0\n")
    subprocess.run([sys.executable, "-c", script], check=True)
