"""The fuzz tests' one way of breaking a real encoded file (hypothesis draws which mutations, and where)."""

from __future__ import annotations

from hypothesis import strategies as st


def mutate(draw, data: bytearray, times: int) -> bytes:
    """`data` mutated `times` times: some bytes overwritten, a slice cut out or repeated, or its tail cut off."""
    for _ in range(times):
        if not data:
            break
        kind = draw(st.sampled_from(["overwrite", "cut", "repeat", "truncate"]))
        position = draw(st.integers(0, len(data) - 1))
        if kind == "overwrite":
            data[position:position + 4] = draw(st.binary(min_size=1, max_size=4))
        elif kind == "cut":
            del data[position:position + draw(st.integers(1, 64))]
        elif kind == "repeat":
            data[position:position] = data[position:position + draw(st.integers(1, 64))]
        else:
            del data[position:]
    return bytes(data)
