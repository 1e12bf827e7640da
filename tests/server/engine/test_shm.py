"""Shared-memory regions: arrays by offset, and a mapping that outlives its views."""

from __future__ import annotations

import os
import uuid

import numpy as np

from server.engine.shm import ALIGNMENT, Allocator, Region


def test_a_view_keeps_the_mapping_its_owner_closed():
    """An engine that unmaps a gone front's region while a plan still reads a canvas in it must not crash: the
    view keeps the memory mapped until it goes."""
    name = f"scoremap-test-{uuid.uuid4().hex}"
    owner = Region(name, 1 << 16, create=True)
    attached = Region(name, create=False)
    written = owner.array(128, (4, 5, 3), np.uint8)
    written[...] = np.arange(60, dtype=np.uint8).reshape(4, 5, 3)
    seen = attached.array(128, (4, 5, 3), np.uint8)
    owner.close()
    attached.close()
    assert not os.path.exists(owner.path)  # unlinked by its owner
    assert seen.sum() == sum(range(60)) and written[3, 4, 2] == 59  # still mapped, both sides
    seen[0, 0, 0] = 7
    assert written[0, 0, 0] == 7


def test_the_allocator_reuses_freed_blocks_and_says_when_none_fits():
    allocator = Allocator(4 * ALIGNMENT)
    first, second = allocator.allocate(ALIGNMENT), allocator.allocate(2 * ALIGNMENT)
    assert (first, second) == (0, ALIGNMENT)
    assert allocator.allocate(2 * ALIGNMENT) is None
    allocator.free(first)
    allocator.free(second)
    assert allocator.allocate(3 * ALIGNMENT) == 0  # the freed neighbours merged
