"""Ring against tree all-reduce (utils.parallel.topology), against oracles outside the module:
a simulated ring all-reduce (rounds until every rank holds the sum), the depth of an explicit
binary tree, nb03's ring byte count, and hand-computed times."""

import math

import pytest

from utils.parallel import collectives, topology


def simulated_ring_rounds(n: int) -> int:
    """Run a ring all-reduce on n ranks, one chunk per rank per round, and count the rounds until
    every rank holds every chunk's full sum. Chunk c of rank r starts as the set {r}."""
    chunks = [[{r} for _ in range(n)] for r in range(n)]  # chunks[rank][chunk] = ranks summed in
    full = set(range(n))
    rounds = 0
    # reduce-scatter: in round k, rank r sends chunk (r - k) mod n to rank r + 1, which adds it
    for k in range(n - 1):
        sends = [(r, (r - k) % n, set(chunks[r][(r - k) % n])) for r in range(n)]
        for r, c, payload in sends:
            chunks[(r + 1) % n][c] |= payload
        rounds += 1
    # all-gather: rank r owns the full chunk (r + 1) mod n; pass the full chunks around
    for k in range(n - 1):
        sends = [(r, (r + 1 - k) % n, set(chunks[r][(r + 1 - k) % n])) for r in range(n)]
        for r, c, payload in sends:
            chunks[(r + 1) % n][c] = payload
        rounds += 1
    assert all(chunks[r][c] == full for r in range(n) for c in range(n)), "the simulated ring is wrong"
    return rounds


@pytest.mark.parametrize("n", [2, 3, 4, 7, 8, 16])
def test_ring_steps_equal_a_simulated_ring(n):
    assert topology.ring_steps(n) == simulated_ring_rounds(n) == 2 * (n - 1)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 9, 100, 1024, 1025])
def test_tree_steps_are_twice_the_depth_of_a_binary_tree(n):
    parent = {i: (i - 1) // 2 for i in range(1, n)}  # a heap-ordered binary tree rooted at 0

    def depth(i):
        return 0 if i == 0 else 1 + depth(parent[i])

    assert topology.tree_steps(n) == 2 * max(depth(i) for i in range(n))  # up, then down


def test_bandwidth_terms():
    """With no latency, the ring moves nb03's 2(N-1)/N of the buffer; the tree 2x; ring never more."""
    m, bw = 1e9, 25e9
    for n in (2, 8, 1024):
        assert topology.ring_allreduce_time(m, n, 0.0, bw) == pytest.approx(collectives.ring_allreduce_bytes(m, n) / bw)
        assert topology.tree_allreduce_time(m, n, 0.0, bw) == pytest.approx(2 * m / bw)
        assert topology.ring_allreduce_time(m, n, 0.0, bw) <= topology.tree_allreduce_time(m, n, 0.0, bw)


def test_times_by_hand():
    alpha, bw, m, n = 5e-6, 25e9, 65536, 1024
    # ring: 2046 steps of 5 us = 10.23 ms, plus 2 * 1023/1024 * 65536 B / 25 GB/s = 5.2378 us
    assert topology.ring_allreduce_time(m, n, alpha, bw) == pytest.approx(10.23e-3 + 5.2378e-6, rel=1e-5)
    # tree: 2 * 10 steps of 5 us = 100 us, plus 2 * 65536 B / 25 GB/s = 5.24288 us
    assert topology.tree_allreduce_time(m, n, alpha, bw) == pytest.approx(100e-6 + 5.24288e-6, rel=1e-6)
    assert topology.ring_allreduce_time(m, 1, alpha, bw) == topology.tree_allreduce_time(m, 1, alpha, bw) == 0.0
    with pytest.raises(ValueError):
        topology.ring_steps(0)


def test_crossover_is_where_brute_force_finds_it():
    alpha, bw = topology.NCCL_NET_HOP_S["LL"], topology.IB_HDR_BW
    for m in (4096, 65536, 1 << 24, 1 << 30):
        got = topology.crossover_ranks(m, alpha, bw, max_ranks=4096)
        faster = [
            n
            for n in range(2, 4097)
            if topology.tree_allreduce_time(m, n, alpha, bw) < topology.ring_allreduce_time(m, n, alpha, bw)
        ]
        assert got == (faster[0] if faster else None)
        assert faster == list(range(faster[0], 4097)) if faster else True  # once faster, always faster
    # a small message: the tree wins from a handful of ranks; a large one needs many more
    small = topology.crossover_ranks(65536, alpha, bw)
    large = topology.crossover_ranks(1 << 30, alpha, bw)
    assert small is not None and small <= 16 and (large is None or large > 4 * small)
    assert math.isclose(topology.IB_HDR_BW, 25e9)
