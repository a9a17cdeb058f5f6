"""Collectives by hand: the ring all-reduce, gradient averaging, and the alpha-beta cost model.

The cost model counts the latency alpha once per message. A ring all-reduce of N ranks takes
2(N-1) steps, each one message per rank, so its time is
``2(N-1) * alpha + 2(N-1)/N * nbytes / bandwidth`` (:func:`allreduce_time`).
:func:`ring_alpha_beta_fit` fits exactly that form, so its alpha is the latency of one step, not
of a whole all-reduce (:func:`alpha_beta_fit` is the plain line underneath)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

# ----------------------------------------------------------------------------------------
# Collectives by hand
# ----------------------------------------------------------------------------------------


def _exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group=None) -> None:
    """Send ``send`` to ``dst`` while receiving ``recv`` from ``src``: one batched pair.

    ``batch_isend_irecv`` posts both operations together. With NCCL this matters: separate
    ``isend`` / ``recv`` calls each open a communicator for their pair of ranks on first use,
    a blocking step every rank of the ring takes at once, and the ring deadlocks; batched, the
    pair is one NCCL group call. gloo accepts the same batch, so one form works everywhere."""
    ops = [dist.P2POp(dist.isend, send, dst, group), dist.P2POp(dist.irecv, recv, src, group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()


def ring_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks, in place, with a ring of point-to-point messages.

    The tensor is cut into N chunks. Reduce-scatter (N-1 steps): each rank sends one chunk to
    its right neighbour and adds the chunk coming from its left, so afterwards rank r holds the
    full sum of chunk (r+1) % N. All-gather (N-1 steps): the finished chunks travel round the
    ring once more. Each rank sends 2(N-1) chunks of size 1/N: 2(N-1)/N of the tensor, whatever N.
    Each step's send and receive are posted as one batch (``batch_isend_irecv``): the form
    that also works on NCCL.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return tensor
    rank = dist.get_rank(group)
    right, left = (rank + 1) % world, (rank - 1) % world
    if group is not None:  # P2POp takes global ranks
        right = dist.get_global_rank(group, right)
        left = dist.get_global_rank(group, left)
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)
    chunks = list(flat.tensor_split(world))  # views of flat: contiguous
    buf = torch.empty_like(chunks[0])
    for step in range(world - 1):  # reduce-scatter
        send_i, recv_i = (rank - step) % world, (rank - step - 1) % world
        incoming = buf[: len(chunks[recv_i])]
        _exchange(chunks[send_i], right, incoming, left, group)
        chunks[recv_i] += incoming
    for step in range(world - 1):  # all-gather
        send_i, recv_i = (rank + 1 - step) % world, (rank - step) % world
        incoming = buf[: len(chunks[recv_i])]
        _exchange(chunks[send_i], right, incoming, left, group)
        chunks[recv_i].copy_(incoming)
    if not tensor.is_contiguous():
        tensor.copy_(flat.view_as(tensor))
    return tensor


def average_gradients(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """DDP by hand: after ``backward()``, replace every gradient with its mean over the ranks."""
    world = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
            p.grad /= world


def ring_allreduce_bytes(nbytes: float, world_size: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``nbytes``: 2(N-1)/N of it."""
    return 2.0 * (world_size - 1) / world_size * nbytes if world_size > 1 else 0.0


def parameter_server_bytes(nbytes: float, world_size: int) -> float:
    """Bytes the server sends per step with ``world_size`` workers (it receives as many): each
    worker pushes its ``nbytes`` of gradients to the server and pulls ``nbytes`` of weights back.
    The busiest node's traffic grows as N; a ring's (:func:`ring_allreduce_bytes`) stays below 2."""
    return float(world_size) * nbytes


def allreduce_time(nbytes: float, world_size: int, alpha: float, bandwidth: float) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` on ``world_size`` ranks: 2(N-1) steps of one
    message each, every message paying the latency ``alpha`` (seconds), plus the bytes each rank
    sends, ``2(N-1)/N * nbytes``, over ``bandwidth`` (bytes/s). Zero for one rank."""
    if world_size <= 1:
        return 0.0
    return 2 * (world_size - 1) * alpha + ring_allreduce_bytes(nbytes, world_size) / bandwidth


def ddp_efficiency(
    t_compute: float, nbytes: float, world_size: int, alpha: float, bandwidth: float, overlap: float = 0.0
) -> float:
    """Predicted scaling efficiency of data parallelism: ``t_compute / (t_compute + exposed)``, where
    ``exposed`` is the part of :func:`allreduce_time` not hidden behind backward (``overlap`` is the
    hidden share, 0 to 1). One rank: 1. The model leaves out everything but the all-reduce."""
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap is a share of the communication, 0 to 1; got {overlap}")
    t_comm = allreduce_time(nbytes, world_size, alpha, bandwidth)
    return t_compute / (t_compute + (1.0 - overlap) * t_comm)


def ring_alpha_beta_fit(nbytes: Sequence[float], seconds: Sequence[float], world_size: int) -> tuple[float, float]:
    """Fit :func:`allreduce_time` to all-reduces of messages of ``nbytes`` timed on ``world_size``
    ranks. Returns (alpha: seconds per message, one ring step; bandwidth: bytes/s, what each link
    delivers, NCCL's "bus bandwidth"). Use both with :func:`allreduce_time`, which counts alpha
    2(N-1) times: the fitted whole-all-reduce latency divided by 2(N-1)."""
    if world_size < 2:
        raise ValueError("an all-reduce on one rank sends nothing: time it on 2 or more")
    latency, per_message_bw = alpha_beta_fit(nbytes, seconds)  # t = latency + nbytes / per_message_bw
    return latency / (2 * (world_size - 1)), per_message_bw * ring_allreduce_bytes(1.0, world_size)


def alpha_beta_fit(nbytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of the line ``t = alpha + nbytes / bandwidth`` to measured times.

    Returns (alpha in seconds, bandwidth in bytes/s). The latency alpha dominates small
    messages, the bandwidth term large ones. Here alpha is the whole fixed cost of one timed
    operation; for a ring all-reduce, :func:`ring_alpha_beta_fit` splits it per message."""
    x = np.asarray(nbytes, dtype=float)
    y = np.asarray(seconds, dtype=float)
    if len(x) < 2:
        raise ValueError("alpha_beta_fit needs timings for at least two message sizes")
    a = np.stack([np.ones_like(x), x], axis=1)
    w = 1.0 / y  # relative errors: small messages count as much as big
    (alpha, beta), *_ = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)
    alpha = max(float(alpha), 0.0)
    beta = max(float(beta), 1e-15)
    return alpha, 1.0 / beta
