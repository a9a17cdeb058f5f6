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

__all__ = ["column_shard", "row_shard", "TPMLP", "tp_worker", "tp_comm_bytes"]


def column_shard(linear: nn.Linear, rank: int, world_size: int) -> tuple:
    """(weight, bias) of rank ``rank``'s output features: rows ``rank`` of ``W.chunk(N, 0)``."""
    if linear.out_features % world_size:
        raise ValueError(f"{linear.out_features} output features do not split evenly over {world_size} ranks")
    return (linear.weight.detach().chunk(world_size, 0)[rank].clone(),
            linear.bias.detach().chunk(world_size, 0)[rank].clone())


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
        self.b2 = nn.Parameter(block[2].bias.detach().clone())   # replicated, added once

    def forward(self, x):
        x = _CopyToTP.apply(x)                                  # f
        h = F.gelu(F.linear(x, self.w1, self.b1))               # [batch, hidden / N]
        partial = F.linear(h, self.w2)                          # [batch, d], a partial sum
        return _ReduceFromTP.apply(partial) + self.b2           # g


def tp_comm_bytes(batch_size: int, width: int, world_size: int, element_size: int = 4) -> dict:
    """Per MLP and step: one all-reduce of ``batch x width`` in forward (g), one in backward (f);
    the bytes a ring sends per rank for each: ``2(N-1)/N`` of the buffer."""
    buf = batch_size * width * element_size
    per = 2 * (world_size - 1) / world_size * buf
    return {"forward_calls": 1, "backward_calls": 1, "buffer": buf, "sent_forward": per, "sent_backward": per}


def _count(fn, world_size):
    from .shard import CommCounter
    with CommCounter(world_size) as c:
        out = fn()
    return out, {"calls": dict(c.calls), "nbytes": dict(c.nbytes)}


def tp_worker(width: int = 32, batch_size: int = 8, expand: int = 4, seed: int = 0) -> dict:
    """On every rank: one MLP block, the whole batch (tensor parallelism splits the layer, not
    the data). Returns the one-process reference, the hand split and ``parallelize_module``:
    outputs, loss, gradients (reassembled to full shape) and collectives counted per pass."""
    from ..memory import block_mlp
    from .group import exact_fp32, setup, teardown
    exact_fp32()                                 # compared with the one-process CPU reference to 1e-5
    ctx = setup()
    try:
        n, r = ctx.world_size, ctx.rank
        block = block_mlp(width, 1, expand=expand, seed=seed)[0]
        g = torch.Generator().manual_seed(seed + 1)
        x = torch.randn(batch_size, width, generator=g)
        # reference: one process, the whole layer
        ref = block_mlp(width, 1, expand=expand, seed=seed)[0]
        y_ref = ref(x)
        y_ref.pow(2).mean().backward()
        out = {"ref": {"y": y_ref.detach(), "w1": ref[0].weight.grad, "w2": ref[2].weight.grad}}

        # by hand
        tp = TPMLP(block, r, n).to(ctx.device)
        xd = x.to(ctx.device).requires_grad_(True)
        y, fwd = _count(lambda: tp(xd), n)
        _, bwd = _count(lambda: y.pow(2).mean().backward(), n)
        w1 = [torch.empty_like(tp.w1.grad) for _ in range(n)]
        w2 = [torch.empty_like(tp.w2.grad) for _ in range(n)]
        dist.all_gather(w1, tp.w1.grad)          # reassemble the shards' gradients to compare
        dist.all_gather(w2, tp.w2.grad.contiguous())
        out["hand"] = {"y": y.detach(), "w1": torch.cat(w1, 0), "w2": torch.cat(w2, 1),
                       "x_grad": xd.grad, "forward": fwd, "backward": bwd,
                       "shard_shapes": (tuple(tp.w1.shape), tuple(tp.w2.shape))}

        # DTensor: parallelize_module with the same plan
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        mesh = init_device_mesh(ctx.device.type, (n,))
        m = parallelize_module(block_mlp(width, 1, expand=expand, seed=seed)[0].to(ctx.device), mesh,
                               {"0": ColwiseParallel(), "2": RowwiseParallel()})
        xd2 = x.to(ctx.device).requires_grad_(True)     # as above: the input needs its gradient
        y2, fwd2 = _count(lambda: m(xd2), n)
        _, bwd2 = _count(lambda: y2.pow(2).mean().backward(), n)
        out["dtensor"] = {"y": y2.detach(), "w1": m[0].weight.grad.full_tensor(),
                          "w2": m[2].weight.grad.full_tensor(), "x_grad": xd2.grad, "forward": fwd2, "backward": bwd2,
                          "shard_shapes": (tuple(m[0].weight.to_local().shape), tuple(m[2].weight.to_local().shape))}
        return out
    finally:
        teardown()
