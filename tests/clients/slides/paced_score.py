"""`scoremap-score` at a set pace, for tests that must stop a run part-way (tests/clients/slides/test_run.py).

    python -m tests.clients.slides.paced_score SECONDS_PER_TILE [scoremap-score's arguments ...]

Each tile's scoring takes at least SECONDS_PER_TILE, so the run lasts at least tiles x that / --concurrency
however fast the machine: on an H200 an unpaced run ends before the test can kill it.
Everything else is the real command.
"""

from __future__ import annotations

import sys
import time

from clients.batch.score_cli import main
from clients.slides import run


def pace(seconds: float) -> None:
    """Make every tile's `score_map` in clients.slides.run take at least `seconds`."""
    score_map = run.score_map

    def paced(*args, **kwargs):
        started = time.monotonic()
        try:
            return score_map(*args, **kwargs)
        finally:
            time.sleep(max(0.0, seconds - (time.monotonic() - started)))

    run.score_map = paced


if __name__ == "__main__":
    pace(float(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
