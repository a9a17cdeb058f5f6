"""Self-checks for stage 5: memory and model parallelism (solutions/lab5_memory_and_model_parallel.ipynb).

All three run in this process, in a second or so: the tensor-parallel check adds the ranks'
partial sums itself (that is what the all-reduce does), the pipeline check runs both stages here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..models import mlp
from ._common import CheckFailed, _call, _close, _fail, _passed  # noqa: F401

__all__ = ["check_tensor_parallel", "check_zero_memory", "check_gpipe_microbatches"]


# ---------------------------------------------------------------------------- exercise 1


def _mlp(d, hidden, seed):
    torch.manual_seed(seed)  # the weights, then the check's inputs, from the global RNG
    return mlp(hidden, 2, in_features=d, out_features=d, activation="gelu")


def check_tensor_parallel(column_shard: Callable[..., Any], row_shard: Callable[..., Any]) -> None:
    """``column_shard(linear, rank, world_size) -> (weight, bias)`` and
    ``row_shard(linear, rank, world_size) -> weight``: the Megatron split of an MLP. The check
    runs every rank's part here, adds the partial outputs (the all-reduce g) and compares with
    the whole MLP, for 1, 2 and 4 ranks."""
    name = "tensor parallel MLP"
    d, hidden = 8, 16
    for world in (1, 2, 4):
        block = _mlp(d, hidden, seed=world)
        x = torch.randn(5, d)
        want = block(x).detach()
        partial = torch.zeros(5, d)
        for rank in range(world):
            w1, b1 = _call(name, column_shard, block[0], rank, world)
            w2 = _call(name, row_shard, block[2], rank, world)
            if not (torch.is_tensor(w1) and torch.is_tensor(b1) and torch.is_tensor(w2)):
                _fail(
                    name,
                    "column_shard must return (weight, bias) and row_shard a weight, all tensors",
                    "return linear.weight.chunk(...)[rank], linear.bias.chunk(...)[rank] (and a tensor from row_shard)",
                )
            if tuple(w1.shape) != (hidden // world, d):
                hint = (
                    "you split the input dimension: a column-parallel layer splits the OUTPUT features, "
                    "which are the rows of nn.Linear's weight [out, in]: chunk along dim 0"
                    if tuple(w1.shape) == (hidden, d // world)
                    else "each rank gets hidden/N output features: weight.chunk(world_size, dim=0)[rank]"
                )
                _fail(
                    name,
                    f"column shard of a Linear({d}, {hidden}) on {world} ranks has shape {tuple(w1.shape)}, "
                    f"expected {(hidden // world, d)}",
                    hint,
                )
            if tuple(b1.shape) != (hidden // world,):
                _fail(
                    name,
                    f"column shard's bias has shape {tuple(b1.shape)}, expected {(hidden // world,)}",
                    "each rank adds the bias of ITS output features: bias.chunk(world_size)[rank]",
                )
            if tuple(w2.shape) != (d, hidden // world):
                hint = (
                    "you split the output dimension: a row-parallel layer splits its INPUT features, "
                    "the columns of the weight [out, in]: chunk along dim 1"
                    if tuple(w2.shape) == (d // world, hidden)
                    else "each rank multiplies its hidden/N inputs: weight.chunk(world_size, dim=1)[rank]"
                )
                _fail(
                    name,
                    f"row shard of a Linear({hidden}, {d}) on {world} ranks has shape {tuple(w2.shape)}, "
                    f"expected {(d, hidden // world)}",
                    hint,
                )
            h = nn.functional.gelu(x @ w1.detach().T + b1.detach())
            partial += h @ w2.detach().T
        got = partial + block[2].bias.detach()
        if not _close(got, want, rtol=1e-5, atol=1e-5):
            _fail(
                name,
                f"on {world} ranks the summed partial outputs differ from the whole MLP by "
                f"{(got - want).abs().max().item():.3g}",
                "rank r must take the SAME slice r in both layers: rows r of the first weight (and bias) "
                "and columns r of the second, both with .chunk(world_size, dim)[rank]",
            )
    _passed(name, "1, 2 and 4 ranks: partial sums add up to the whole MLP")


# ---------------------------------------------------------------------------- exercise 2


def _zero(p, n, stage, param=2, grad=2):
    return (
        param * p / (n if stage >= 3 else 1) + grad * p / (n if stage >= 2 else 1) + 12 * p / (n if stage >= 1 else 1)
    )


def check_zero_memory(zero_memory: Callable[..., Any]) -> None:
    """``zero_memory(n_params, world_size, stage)``: bytes per GPU for mixed-precision Adam (2-byte
    parameters, 2-byte gradients, 12 bytes of fp32 optimizer state per parameter) under ZeRO
    stage 0 (DDP), 1, 2 or 3."""
    name = "zero_memory"
    P = 1_000_000
    for n in (1, 2, 8, 64):
        for stage in (0, 1, 2, 3):
            got = _call(name, zero_memory, P, n, stage)
            want = _zero(P, n, stage)
            if got is None:
                _fail(name, "returned None", "return the number of bytes")
            if _close(got, want, rtol=1e-9, atol=0):
                continue
            where = f"stage {stage}, {n} GPUs"
            if stage == 0 and _close(got, 16 * P / n, rtol=1e-9, atol=0):
                _fail(
                    name,
                    f"{where}: you divided by N, but stage 0 is plain DDP",
                    "at stage 0 every GPU holds all 16 bytes per parameter",
                )
            if _close(got, _zero(P, n, stage, param=4, grad=4), rtol=1e-9, atol=0):
                _fail(
                    name,
                    f"{where}: {got:,.0f} bytes looks like fp32 parameters and gradients",
                    "in mixed precision the parameters and gradients are bf16/fp16: 2 bytes each; the fp32 master copy is part of the 12 optimizer bytes",
                )
            for other in (0, 1, 2, 3):
                if other != stage and _close(got, _zero(P, n, other), rtol=1e-9, atol=0):
                    _fail(
                        name,
                        f"{where}: you returned stage {other}'s value ({got:,.0f} bytes, expected {want:,.0f})",
                        "stage 1 shards the optimizer state (12 bytes), stage 2 also the gradients (2), stage 3 also the parameters (2)",
                    )
            _fail(
                name,
                f"{where}: got {got:,.0f} bytes, expected {want:,.0f}",
                "bytes per parameter: parameters 2, gradients 2, optimizer state 12; divide by N the parts the stage shards",
            )
    _passed(
        name,
        f"every stage on 1 to 64 GPUs; e.g. 7B parameters, stage 3 on 8 GPUs: {_zero(7e9, 8, 3) / 1e9:.0f} GB each",
    )


# ---------------------------------------------------------------------------- exercise 3


def _stages(seed):
    torch.manual_seed(seed)
    return (
        mlp(12, 2, in_features=6, out_features=6, activation="tanh"),
        mlp(12, 2, in_features=6, out_features=3, activation="tanh"),
    )


def _loss(out, y):
    return (out - y).pow(2).mean()


def check_gpipe_microbatches(gpipe_microbatches: Callable[..., Any]) -> None:
    """``gpipe_microbatches(stage0, stage1, x, y, m)``: one GPipe step in one process: all m
    forwards (each through stage0, across the boundary, through stage1, loss / m), then all m
    backwards (stage1, then the boundary's gradient into stage0). Returns the summed loss; the
    gradients in both stages equal one full-batch step's."""
    name = "gpipe_microbatches"
    for m in (1, 2, 4):
        s0, s1 = _stages(m)
        r0, r1 = _stages(m)
        g = torch.Generator().manual_seed(m)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        want_loss = _loss(r1(r0(x)), y)
        want_loss.backward()
        events = []
        first = next(s0.parameters())  # its gradient is computed once per stage-0 backward
        hooks = [
            s0.register_forward_pre_hook(lambda mod, inp, ev=events: ev.append("F")),
            first.register_hook(lambda grad, ev=events: ev.append("B")),
        ]
        try:
            got_loss = _call(name, gpipe_microbatches, s0, s1, x, y, m)
        finally:
            for h in hooks:
                h.remove()
        if any(p.grad is None for p in (*s0.parameters(), *s1.parameters())):
            which = "stage0" if any(p.grad is None for p in s0.parameters()) else "stage1"
            _fail(
                name,
                f"with m={m}, {which}'s parameters got no gradient",
                "stage1: call loss.backward() for each micro-batch; stage0: out0.backward(boundary.grad), "
                "where boundary = out0.detach().requires_grad_() is what stage1 received",
            )
        g0 = torch.cat([p.grad.flatten() for p in s0.parameters()])
        g1 = torch.cat([p.grad.flatten() for p in s1.parameters()])
        w0 = torch.cat([p.grad.flatten() for p in r0.parameters()])
        w1 = torch.cat([p.grad.flatten() for p in r1.parameters()])
        if events.count("F") != m:
            _fail(
                name,
                f"with m={m}, stage0 ran {events.count('F')} forwards, expected {m}",
                "cut the batch with x.chunk(m) and run each micro-batch through stage0 once",
            )
        if m > 1 and events != ["F"] * m + ["B"] * m:
            _fail(
                name,
                f"with m={m}, the order was {''.join(events)}; GPipe runs {'F' * m}{'B' * m}",
                "first a loop of all forwards (keep each micro-batch's boundary and loss in lists), then a loop of all backwards",
            )
        if _close(g1, m * w1, rtol=1e-4, atol=1e-6) and m > 1:
            _fail(
                name,
                f"with m={m}, the gradients are {m} times too large",
                "divide each micro-batch's loss by m: the full-batch loss is the mean of the m micro-batch losses",
            )
        if _close(g0, 2 * w0, rtol=1e-4, atol=1e-6):
            _fail(
                name,
                f"with m={m}, stage0's gradients are twice too large",
                "detach at the boundary (boundary = out0.detach().requires_grad_()): otherwise loss.backward() "
                "already reaches stage0 and out0.backward(boundary.grad) adds it a second time",
            )
        if not _close(g1, w1, rtol=1e-4, atol=1e-6):
            _fail(
                name,
                f"with m={m}, stage1's gradients differ from the full batch's by {(g1 - w1).abs().max().item():.3g}",
                "zero the gradients once before the step, not inside the loop; gradients must ACCUMULATE over micro-batches",
            )
        if not _close(g0, w0, rtol=1e-4, atol=1e-6):
            _fail(
                name,
                f"with m={m}, stage0's gradients differ from the full batch's by {(g0 - w0).abs().max().item():.3g}",
                "feed stage0 the gradient of the boundary tensor stage1 received: out0.backward(boundary.grad)",
            )
        if got_loss is None or not _close(float(got_loss), want_loss.item(), rtol=1e-4, atol=1e-6):
            _fail(
                name,
                f"with m={m}, returned loss {got_loss} but the full batch's is {want_loss.item():.6f}",
                "return the sum of the m micro-batch losses, each already divided by m (use .item() or .detach())",
            )
    _passed(name, "m = 1, 2, 4: GPipe order, gradients equal the full batch's")
