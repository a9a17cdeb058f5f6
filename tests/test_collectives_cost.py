"""The alpha-beta cost model of utils.parallel.collectives against hand-computed values."""

from __future__ import annotations

import pytest

from utils import parallel


def test_allreduce_time_counts_alpha_once_per_ring_step():
    # N = 4: 2(N-1) = 6 steps; 2(N-1)/N = 1.5 of the message through each link.
    # 6 * 10 us + 1.5 * 1 MB / 1 GB/s = 60 us + 1500 us = 1.56 ms
    assert parallel.allreduce_time(1e6, 4, 10e-6, 1e9) == pytest.approx(1.56e-3, rel=1e-12)
    # N = 2: 2 steps, the whole message once: 2 * 5 us + 8 MB / 2 GB/s = 10 us + 4 ms
    assert parallel.allreduce_time(8e6, 2, 5e-6, 2e9) == pytest.approx(4.01e-3, rel=1e-12)
    assert parallel.allreduce_time(8e6, 1, 5e-6, 2e9) == 0.0


def test_ring_fit_returns_per_message_alpha_and_bus_bandwidth():
    # timings made by hand for N = 4, alpha 3 us per step, 2 GB/s per link:
    # t = 6 * 3 us + 1.5 * S / 2e9 = 18 us + 0.75 ns per byte of the message
    sizes = [4e3, 4e5, 4e7]
    t = [18e-6 + 0.75e-9 * s for s in sizes]
    whole_latency, _ = parallel.alpha_beta_fit(sizes, t)
    assert whole_latency == pytest.approx(18e-6, rel=1e-6), "the plain line's intercept: a whole all-reduce"
    alpha, bw = parallel.ring_alpha_beta_fit(sizes, t, 4)
    assert alpha == pytest.approx(3e-6, rel=1e-6) and bw == pytest.approx(2e9, rel=1e-6)
    # round trip: the model with the fitted values gives the timings back
    assert [parallel.allreduce_time(s, 4, alpha, bw) for s in sizes] == pytest.approx(t, rel=1e-6)
    with pytest.raises(ValueError):
        parallel.ring_alpha_beta_fit(sizes, t, 1)


def test_ddp_efficiency_by_hand():
    # T_c = 0.1 s, N = 2, no latency, 100 MB at 1 GB/s: 0.1 s of communication -> 50%
    assert parallel.ddp_efficiency(0.1, 1e8, 2, 0.0, 1e9) == pytest.approx(0.5)
    assert parallel.ddp_efficiency(0.1, 1e8, 2, 0.0, 1e9, overlap=0.5) == pytest.approx(0.1 / 0.15)
    assert parallel.ddp_efficiency(0.1, 1e8, 2, 0.0, 1e9, overlap=1.0) == 1.0
    assert parallel.ddp_efficiency(0.1, 1e8, 1, 1.0, 1.0) == 1.0
    # ResNet-50 (25.6 M fp32 parameters), batch 32 at 329 images/s, 8 GPUs, 5 us, 100 GB/s:
    # T_c = 97.264 ms, comm = 14 * 5 us + 1.75 * 102.4 MB / 100 GB/s = 0.070 + 1.792 ms -> 98.12%
    assert parallel.ddp_efficiency(32 / 329, 25.6e6 * 4, 8, 5e-6, 100e9) == pytest.approx(0.98122, abs=1e-4)
    with pytest.raises(ValueError):
        parallel.ddp_efficiency(0.1, 1e8, 2, 0.0, 1e9, overlap=1.5)


def test_parameter_server_against_ring_traffic():
    assert parallel.parameter_server_bytes(100, 4) == 400  # the server: 4 workers x 100 bytes
    assert parallel.ring_allreduce_bytes(100, 4) == 150  # each rank: 2 * 3 / 4 x 100 bytes
    assert parallel.parameter_server_bytes(100, 64) == 6400 and parallel.ring_allreduce_bytes(100, 64) == 196.875
