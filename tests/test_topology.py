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


def test_each_algorithm_its_own_latency_and_a_base_per_call():
    # N = 4, 65536 B at 25 GB/s. Ring: 6.6 us + 6 steps of 2.7 us + 1.5 * 65536 B / 25 GB/s
    # = 6.6 + 16.2 + 3.93216 = 26.73216 us. Tree: 6.8 us + 4 steps of 5 us + 2 * 65536 B / 25 GB/s
    # = 6.8 + 20 + 5.24288 = 32.04288 us.
    m, bw = 65536, 25e9
    assert topology.ring_allreduce_time(m, 4, 2.7e-6, bw, base=6.6e-6) == pytest.approx(26.73216e-6, rel=1e-9)
    assert topology.tree_allreduce_time(m, 4, 5.0e-6, bw, base=6.8e-6) == pytest.approx(32.04288e-6, rel=1e-9)
    assert topology.ring_allreduce_time(m, 1, 2.7e-6, bw, base=6.6e-6) == 0.0  # one rank: no call at all


def _brute_force_crossover(m, bw, ra, ta, rb, tb, max_ranks):
    """The smallest N from which the tree is faster at every N up to max_ranks, by checking each."""
    faster = [
        topology.tree_allreduce_time(m, n, ta, bw, tb) < topology.ring_allreduce_time(m, n, ra, bw, rb)
        for n in range(2, max_ranks + 1)
    ]
    if not faster[-1]:
        return None
    first = len(faster)
    while first > 0 and faster[first - 1]:
        first -= 1
    return first + 2


def test_crossover_is_where_brute_force_finds_it():
    bw = topology.IB_HDR_BW
    for proto in ("LL", "Simple"):
        ra, ta = topology.NCCL_NET_STEP_S["ring"][proto], topology.NCCL_NET_STEP_S["tree"][proto]
        rb, tb = topology.NCCL_BASE_S["ring"][proto], topology.NCCL_BASE_S["tree"][proto]
        for m in (4096, 65536, 1 << 24, 1 << 30):
            got = topology.crossover_ranks(m, bw, ra, ta, rb, tb, max_ranks=4096)
            assert got == _brute_force_crossover(m, bw, ra, ta, rb, tb, 4096), (proto, m)
    # one alpha for both: once the tree is faster it stays faster, so the first win is the crossover
    for m in (4096, 65536, 1 << 24, 1 << 30):
        got = topology.crossover_ranks(m, bw, 5e-6, 5e-6, max_ranks=4096)
        ring = [topology.ring_allreduce_time(m, n, 5e-6, bw) for n in range(2, 4097)]
        tree = [topology.tree_allreduce_time(m, n, 5e-6, bw) for n in range(2, 4097)]
        faster = [n for n, r, t in zip(range(2, 4097), ring, tree) if t < r]
        assert got == (faster[0] if faster else None)
        assert faster == list(range(faster[0], 4097)) if faster else True
    # a small message: the tree wins from a handful of ranks; a large one needs many more
    ll = [topology.NCCL_NET_STEP_S["ring"]["LL"], topology.NCCL_NET_STEP_S["tree"]["LL"]]
    ll += [topology.NCCL_BASE_S["ring"]["LL"], topology.NCCL_BASE_S["tree"]["LL"]]
    small = topology.crossover_ranks(65536, bw, *ll)
    large = topology.crossover_ranks(1 << 30, bw, *ll)
    assert small is not None and small <= 16 and (large is None or large > 4 * small)
    assert math.isclose(topology.IB_HDR_BW, 25e9)


def test_a_dearer_tree_step_can_win_then_lose():
    """4096 B at 25 GB/s with LL's figures, by hand (us). N = 3: ring 6.6 + 4 * 2.7 + 0.218 = 17.618,
    tree 6.8 + 2 * 5 + 0.328 = 17.128, the tree wins. N = 4: ring 6.6 + 6 * 2.7 + 0.246 = 23.046,
    tree 6.8 + 4 * 5 + 0.328 = 27.128, the ring wins again. N = 5: ring 28.462, tree 27.128."""
    m, bw = 4096, 25e9
    ring = [topology.ring_allreduce_time(m, n, 2.7e-6, bw, 6.6e-6) for n in (3, 4, 5)]
    tree = [topology.tree_allreduce_time(m, n, 5.0e-6, bw, 6.8e-6) for n in (3, 4, 5)]
    assert ring == pytest.approx([17.61845e-6, 23.04576e-6, 28.46214e-6], rel=1e-5)
    assert tree == pytest.approx([17.12768e-6, 27.12768e-6, 27.12768e-6], rel=1e-6)
    assert topology.crossover_ranks(m, bw, 2.7e-6, 5.0e-6, 6.6e-6, 6.8e-6, max_ranks=64) == 5
