"""Ring against tree all-reduce at scale: the alpha-beta cost model of each.

A message of ``nbytes`` costs ``alpha`` seconds per sequential step (latency) plus its bytes
over the link's bandwidth ``bw`` (bytes/s). For an all-reduce over ``N`` ranks:

* ring (reduce-scatter then all-gather around one ring): ``2(N-1)`` steps, each moving
  ``nbytes / N``, so ``2(N-1) alpha + 2(N-1)/N nbytes / bw``;
* tree (reduce up a binary tree, broadcast back down, pipelined in chunks; NCCL runs two
  complementary trees, each on half the data, so every link stays busy):
  ``2 floor(log2 N)`` steps, and about ``2 nbytes / bw``.

The bandwidth terms are about equal (the ring's is a little smaller); the latency terms are not:
the ring's grows linearly with N, the tree's with log2 N. So small messages on many ranks go by
tree, large ones on few ranks by ring. NCCL chooses per call from a model of the same shape
(``src/graph/tuning.cc`` in NVIDIA/nccl), and ``NCCL_ALGO`` overrides it.

:data:`NCCL_NET_HOP_S` is the latency per inter-node step that NCCL's tuning model assumes;
:data:`IB_HDR_BW` the bandwidth of one 200 Gb/s InfiniBand HDR link. Pure arithmetic: no torch.
"""

from __future__ import annotations

import math

from .collectives import allreduce_time

__all__ = [
    "NCCL_NET_HOP_S",
    "IB_HDR_BW",
    "ring_steps",
    "tree_steps",
    "ring_allreduce_time",
    "tree_allreduce_time",
    "crossover_ranks",
]

# NCCL's tuning model (NVIDIA/nccl, src/graph/tuning.cc, the default hwLatencies for NET):
# microseconds per network step with the low-latency "LL" protocol (used for small messages),
# and with the "Simple" protocol (used for large ones). With one GPU per node NCCL charges the
# tree's figure to both algorithms; the same alpha for both is used here.
NCCL_NET_HOP_S = {"LL": 5.0e-6, "Simple": 14.0e-6}
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


def ring_allreduce_time(nbytes: float, world_size: int, alpha: float, bw: float) -> float:
    """Seconds for a ring all-reduce of ``nbytes``: ``2(N-1) alpha + 2(N-1)/N nbytes / bw``, the
    course's one ring model (:func:`utils.parallel.collectives.allreduce_time`)."""
    return allreduce_time(nbytes, world_size, alpha, bw)


def tree_allreduce_time(nbytes: float, world_size: int, alpha: float, bw: float) -> float:
    """Seconds for a (double binary) tree all-reduce of ``nbytes``: ``2 log2(N) alpha + 2 nbytes / bw``."""
    if world_size == 1:
        return 0.0
    return tree_steps(world_size) * alpha + 2 * nbytes / bw


def crossover_ranks(nbytes: float, alpha: float, bw: float, max_ranks: int = 1 << 16) -> int | None:
    """The smallest N (up to ``max_ranks``) from which the tree is faster than the ring, or None.

    Ring minus tree is ``2 alpha (N - 1 - floor(log2 N)) - 2 nbytes / (N bw)``, which never falls
    as N grows: once the tree is faster, it stays faster."""
    n = 2
    while n <= max_ranks:
        if tree_allreduce_time(nbytes, n, alpha, bw) < ring_allreduce_time(nbytes, n, alpha, bw):
            return n
        n += 1
    return None
