"""Tensor parallelism: the Megatron MLP split by hand, and the same with ``parallelize_module``.

An MLP ``y = W2 gelu(W1 x + b1) + b2`` on N ranks (Shoeybi et al. 2019):

* the first Linear is split by **columns** of the output (rows of ``W1``, shape
  ``[hidden, d]``): rank r computes ``hidden/N`` of the hidden units, from the whole input;
  GELU acts elementwise, so it needs nothing from the other ranks;
* the second Linear is split by **rows** of its input (columns of ``W2``): rank r multiplies its
  slice of the hidden units and gets a *partial sum* of the output;
* **g**, one all-reduce in forward, adds the partial sums (then ``b2`` once); its backward is
  the identity;
* **f**, its conjugate before the MLP, is the identity in forward and one all-reduce in
  backward: each rank's input gradient covers only its hidden units.

So one all-reduce of ``batch x d`` per MLP in forward and one in backward. ``ColwiseParallel``
and ``RowwiseParallel`` (DTensor) do the same. :func:`tp_worker` checks both against one
process and counts the collectives each issues.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["column_shard", "row_shard", "TPMLP", "tp_comm_bytes"]


def column_shard(linear: nn.Linear, rank: int, world_size: int) -> tuple:
    """(weight, bias) of rank ``rank``'s output features: rows ``rank`` of ``W.chunk(N, 0)``."""
    if linear.out_features % world_size:
        raise ValueError(f"{linear.out_features} output features do not split evenly over {world_size} ranks")
    return (
        linear.weight.detach().chunk(world_size, 0)[rank].clone(),
        linear.bias.detach().chunk(world_size, 0)[rank].clone(),
    )


def row_shard(linear: nn.Linear, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s input features of ``linear``: columns ``W.chunk(N, 1)[rank]`` (the bias is
    added once, after the partial sums are reduced)."""
    if linear.in_features % world_size:
        raise ValueError(f"{linear.in_features} input features do not split evenly over {world_size} ranks")
    return linear.weight.detach().chunk(world_size, 1)[rank].clone()


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the input's gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward (sum the partial outputs), identity backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class TPMLP(nn.Module):
    """This rank's part of ``block = Sequential(Linear(d, h), GELU(), Linear(h, d))``: the
    column shard of the first Linear, the row shard of the second, f before and g after."""

    def __init__(self, block: nn.Sequential, rank: int, world_size: int):
        super().__init__()
        w1, b1 = column_shard(block[0], rank, world_size)
        self.w1, self.b1 = nn.Parameter(w1), nn.Parameter(b1)
        self.w2 = nn.Parameter(row_shard(block[2], rank, world_size))
        self.b2 = nn.Parameter(block[2].bias.detach().clone())  # replicated, added once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToTP.apply(x)  # f
        h = F.gelu(F.linear(x, self.w1, self.b1))  # [batch, hidden / N]
        partial = F.linear(h, self.w2)  # [batch, d], a partial sum
        return _ReduceFromTP.apply(partial) + self.b2  # g


def tp_comm_bytes(batch_size: int, width: int, world_size: int, element_size: int = 4) -> dict:
    """Per MLP and step: one all-reduce of ``batch x width`` in forward (g), one in backward (f);
    the bytes a ring sends per rank for each: ``2(N-1)/N`` of the buffer."""
    buf = batch_size * width * element_size
    per = 2 * (world_size - 1) / world_size * buf
    return {"forward_calls": 1, "backward_calls": 1, "buffer": buf, "sent_forward": per, "sent_backward": per}
