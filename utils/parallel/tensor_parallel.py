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
and ``RowwiseParallel`` (DTensor) do the same. ``utils.demos.tp_demo`` checks both against one
process and counts the collectives each issues.

A whole GPT block (``utils.gpt``) is split the same way: attention by heads, the MLP by hidden
units. :class:`SplitQKVAttention` gives attention the separate query, key and value Linears a
column split needs, and :func:`gpt_plan` is the ``parallelize_module`` plan, with or without
sequence parallelism (``utils.demos.gpt_tp_demo`` runs it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["column_shard", "row_shard", "TPMLP", "tp_comm_bytes", "SplitQKVAttention", "split_qkv", "gpt_plan"]


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


class SplitQKVAttention(nn.Module):
    """``utils.gpt.CausalSelfAttention`` with three Linears ``q``, ``k``, ``v`` (d -> d each) in place
    of the fused ``qkv`` (d -> 3d), their weights copied from it: the same function.

    The fused weight's output rows are laid out (3, heads, head_width): all the queries, then all
    the keys, then all the values. A column split cuts it into N contiguous pieces, so on 2 ranks
    rank 0 would get every query head and the first half of the key heads. Split separately, each
    of q, k and v gives rank r the same heads. ``forward`` reads the number of heads from its
    input (``unflatten(-1, (-1, head_width))``), so it runs unchanged on a rank's share of them."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        d = attn.proj.in_features
        self.head_width, self.dropout = d // attn.heads, attn.dropout
        bias = attn.qkv.bias is not None
        self.q, self.k, self.v = (nn.Linear(d, d, bias=bias) for _ in range(3))
        with torch.no_grad():
            for i, lin in enumerate((self.q, self.k, self.v)):
                lin.weight.copy_(attn.qkv.weight[i * d : (i + 1) * d])
                if bias:
                    lin.bias.copy_(attn.qkv.bias[i * d : (i + 1) * d])
        self.proj = nn.Linear(d, d, bias=attn.proj.bias is not None)
        self.proj.load_state_dict(attn.proj.state_dict())
        self.out_dropout = nn.Dropout(attn.out_dropout.p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (b, t, heads * head_width) -> (b, heads, t, head_width); heads = this rank's share
        q, k, v = (lin(x).unflatten(-1, (-1, self.head_width)).transpose(1, 2) for lin in (self.q, self.k, self.v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.out_dropout(self.proj(y.transpose(1, 2).flatten(2)))


def split_qkv(model: nn.Module) -> nn.Module:
    """``model`` (a ``utils.gpt.GPT``) with every block's attention replaced by a
    :class:`SplitQKVAttention` copied from it, in place; returns ``model``."""
    for block in model.blocks:
        block.attn = SplitQKVAttention(block.attn)
    return model


def gpt_plan(layers: int, *, sequence_parallel: bool = False, shared_input: bool = True) -> dict:
    """The ``parallelize_module`` plan of a ``utils.gpt.GPT`` whose attention is split
    (:func:`split_qkv`), by module name.

    Tensor parallelism: in every block ``attn.q``, ``attn.k``, ``attn.v`` and ``mlp.fc`` column-wise
    (``ColwiseParallel``: heads and hidden units divided over the ranks), ``attn.proj`` and
    ``mlp.proj`` row-wise (``RowwiseParallel``: partial sums, all-reduced). ``shared_input``: a
    ``PrepareModuleInput`` makes attention's input one replicated DTensor, so backward adds the
    three input gradients of q, k and v before one all-reduce (without it, each of the three
    Linears all-reduces its own). The embeddings, the final LayerNorm and the tied head are not in
    the plan: every rank holds them whole and computes them on the whole batch.

    ``sequence_parallel``: between the column and row splits the residual stream is sharded by
    sequence position (dimension 1): the LayerNorms run on each rank's positions
    (``SequenceParallel``), attention and the MLP all-gather their input (``PrepareModuleInput``,
    Shard(1) to Replicate) and the row-wise Linears reduce-scatter their output (``Shard(1)``)
    instead of all-reducing it. The first block takes the embeddings' output as replicated and
    keeps its own positions; the final LayerNorm is sequence-parallel too, and the head all-gathers
    its input."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    def gather(src):  # attention's or the MLP's input as one replicated DTensor
        return PrepareModuleInput(input_layouts=(src,), desired_input_layouts=(Replicate(),))

    plan = {}
    out = Shard(1) if sequence_parallel else Replicate()
    for i in range(layers):
        p = f"blocks.{i}."
        if sequence_parallel:
            plan[p + "norm1"], plan[p + "norm2"] = SequenceParallel(), SequenceParallel()
            plan[p + "attn"], plan[p + "mlp"] = gather(Shard(1)), gather(Shard(1))
        elif shared_input:
            plan[p + "attn"] = gather(Replicate())
        for name in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
            plan[p + name] = ColwiseParallel()
        for name in ("attn.proj", "mlp.proj"):
            plan[p + name] = RowwiseParallel(output_layouts=out)
    if sequence_parallel:
        plan["blocks.0"] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
        plan["norm"] = SequenceParallel()
        plan["head"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    return plan
