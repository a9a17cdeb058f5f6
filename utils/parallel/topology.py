"""Ring against tree all-reduce at scale: the alpha-beta cost model of each.

A message of ``nbytes`` costs ``alpha`` seconds per sequential step (latency) plus its bytes
over the link's bandwidth ``bw`` (bytes/s), and each call pays a ``base`` latency once. For an
all-reduce over ``N`` ranks:

* ring (reduce-scatter then all-gather around one ring): ``2(N-1)`` steps, each moving
  ``nbytes / N``, so ``base + 2(N-1) alpha + 2(N-1)/N nbytes / bw``;
* tree (reduce up a binary tree, broadcast back down, pipelined in chunks; NCCL runs two
  complementary trees, each on half the data, so every link stays busy):
  ``2 floor(log2 N)`` steps, and about ``base + 2 floor(log2 N) alpha + 2 nbytes / bw``.

The bandwidth terms are about equal (the ring's is a little smaller); the latency terms are not:
the ring's grows linearly with N, the tree's with log2 N. So small messages on many ranks go by
tree, large ones on few ranks by ring. NCCL chooses per call from a model of the same shape
(``src/graph/tuning.cc`` in NVIDIA/nccl), and ``NCCL_ALGO`` overrides it.

:data:`NCCL_NET_STEP_S` and :data:`NCCL_BASE_S` are that model's default latencies, per algorithm
and protocol; :data:`IB_HDR_BW` the bandwidth of one 200 Gb/s InfiniBand HDR link. Pure
arithmetic: no torch.
"""

from __future__ import annotations

import math

from .collectives import allreduce_time

__all__ = [
    "NCCL_NET_STEP_S",
    "NCCL_BASE_S",
    "IB_HDR_BW",
    "ring_steps",
    "tree_steps",
    "ring_allreduce_time",
    "tree_allreduce_time",
    "crossover_ranks",
]

# NCCL's tuning model (NVIDIA/nccl, src/graph/tuning.cc, the default tuner constants; the same
# figures from NCCL 2.23 to 2.29), in seconds, for the low-latency protocol "LL" (small messages)
# and the "Simple" protocol (large ones). NCCL also has LL128, left out here.
# hwLatencies[NET]: the latency of one network step, each algorithm its own.
NCCL_NET_STEP_S = {
    "ring": {"LL": 2.7e-6, "Simple": 14.0e-6},
    "tree": {"LL": 5.0e-6, "Simple": 14.0e-6},
}
# baseLatencies: paid once per call, whatever the number of ranks.
NCCL_BASE_S = {
    "ring": {"LL": 6.6e-6, "Simple": 8.4e-6},
    "tree": {"LL": 6.8e-6, "Simple": 8.4e-6},
}
IB_HDR_BW = 200e9 / 8  # bytes/s: one InfiniBand HDR link, 200 Gb/s


def _check(world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")


def ring_steps(world_size: int) -> int:
    """Sequential steps of a ring all-reduce: N-1 of reduce-scatter, N-1 of all-gather."""
    _check(world_size)
    return 2 * (world_size - 1)


def tree_steps(world_size: int) -> int:
    """Sequential steps of a tree all-reduce: up a binary tree of depth floor(log2 N), and back."""
    _check(world_size)
    return 2 * int(math.floor(math.log2(world_size)))


def ring_allreduce_time(nbytes: float, world_size: int, alpha: float, bw: float, base: float = 0.0) -> float:
    """Seconds for a ring all-reduce of ``nbytes``: ``base + 2(N-1) alpha + 2(N-1)/N nbytes / bw``,
    the course's one ring model (:func:`utils.parallel.collectives.allreduce_time`) plus a latency
    ``base`` per call. Zero for one rank."""
    if world_size == 1:
        return 0.0
    return base + allreduce_time(nbytes, world_size, alpha, bw)


def tree_allreduce_time(nbytes: float, world_size: int, alpha: float, bw: float, base: float = 0.0) -> float:
    """Seconds for a (double binary) tree all-reduce of ``nbytes``:
    ``base + 2 floor(log2 N) alpha + 2 nbytes / bw``. Zero for one rank."""
    if world_size == 1:
        return 0.0
    return base + tree_steps(world_size) * alpha + 2 * nbytes / bw


def crossover_ranks(
    nbytes: float,
    bw: float,
    ring_alpha: float,
    tree_alpha: float,
    ring_base: float = 0.0,
    tree_base: float = 0.0,
    max_ranks: int = 1 << 16,
) -> int | None:
    """The smallest N from which the tree is faster than the ring at every N up to ``max_ranks``,
    or None when the ring is still as fast at ``max_ranks``.

    With one alpha for both, ring minus tree never falls as N grows. With a dearer tree step it
    dips each time N reaches a power of two (the tree gains a level), so the tree can win at some
    N and lose at the next: "from which it stays faster" is the answer that means something."""
    if max_ranks < 2:
        raise ValueError(f"max_ranks must be >= 2, got {max_ranks}")
    n = max_ranks
    while n >= 2:
        tree = tree_allreduce_time(nbytes, n, tree_alpha, bw, tree_base)
        if tree >= ring_allreduce_time(nbytes, n, ring_alpha, bw, ring_base):
            break
        n -= 1
    return n + 1 if n < max_ranks else None
