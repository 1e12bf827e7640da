"""bench_overload's closed-loop figures: the process CPU it reads, and the CPU it puts on each refusal."""

import os
import time

import numpy as np
import pytest

from bench.bench_overload import Resent, process_cpu_seconds


def test_process_cpu_seconds_reads_this_process_as_the_kernel_counts_it():
    before, own = process_cpu_seconds(os.getpid()), time.process_time()
    until = time.process_time() + 0.3
    while time.process_time() < until:  # burn CPU
        pass
    spent, own_spent = process_cpu_seconds(os.getpid()) - before, time.process_time() - own
    assert spent == pytest.approx(own_spent, abs=0.05)  # clock ticks: 10 ms each


def test_cpu_per_refusal_is_what_the_answers_did_not_spend_per_refusal():
    level = Resent(16, True, 10.0, ok_ms=np.full(100, 900.0), refused_ms=np.full(400, 5.0), hinted=400, others={},
                   dropped=0, server_cpu_s=8.2, client_cpu_s=1.0)
    assert level.goodput == 10.0
    assert level.cpu_per_refusal_ms(0.08) == pytest.approx(0.5)  # (8.2 s - 100 x 80 ms) / 400
    assert np.isnan(Resent(4, True, 10.0, ok_ms=np.full(100, 900.0), refused_ms=np.array([]), hinted=0, others={},
                           dropped=0, server_cpu_s=8.0, client_cpu_s=1.0).cpu_per_refusal_ms(0.08))


def test_the_burst_photo_weighs_what_a_phone_photo_does_and_the_ratio_is_of_medians():
    from bench.bench_overload import BURST_JPEG_BYTES, Burst, burst_photo

    assert 0.8 * BURST_JPEG_BYTES < len(burst_photo()) < 1.2 * BURST_JPEG_BYTES
    burst = Burst(1, full_ms=np.array([10.0, 30.0, 90.0]), unknown_ms=np.array([5.0, 20.0, 21.0]), rounds=[1.5],
                  others={}, mixed_full_ms=np.array([4.0]), mixed_unknown_ms=np.array([8.0]))
    assert burst.ratio == pytest.approx(1.5) and burst.mixed_ratio == pytest.approx(0.5)
