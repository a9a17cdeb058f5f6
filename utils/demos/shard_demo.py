"""Notebook 05's sharding experiment: one block MLP trained with Adam under DDP, ZeRO-1 and FSDP2
(fp32 and bf16), each rank on its slice of the same global batches, against one process.

The mechanism it measures lives in :mod:`utils.parallel.shard` (``shard_model``, ``rank_bytes``,
``CommCounter``, the sharded checkpoints); this module only drives it and returns what the
notebook plots. Launched by ``parallel.launch(shard_demo.worker, n, ...)``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
import torch.distributed as dist

from ..memory import block_mlp, peak_bytes
from ..parallel import exact_fp32, setup, teardown
from ..parallel.shard import STRATEGIES, CommCounter, load_sharded, rank_bytes, save_sharded, shard_model

__all__ = ["worker", "reference_losses"]


def _batches(width: int, batch_size: int, steps: int, seed: int):
    """The global batches every strategy (and the one-process reference) trains on."""
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(steps, batch_size, width, generator=g)
    y = torch.randn(steps, batch_size, width, generator=g)
    return x, y


def _step(model, opt, x, y, ctx):
    opt.zero_grad(set_to_none=True)
    loss = (model(x).float() - y).pow(2).mean()
    loss.backward()
    opt.step()
    return loss.detach()


def _global_mean(t: torch.Tensor, ctx) -> float:
    t = t.clone().to(ctx.device)
    if ctx.world_size > 1:
        dist.all_reduce(t)  # sync point: once per run, not per step
    return (t / ctx.world_size).item()


def worker(
    strategies: Iterable[str] = STRATEGIES,
    *,
    width: int = 64,
    depth: int = 4,
    batch_size: int = 32,
    steps: int = 4,
    lr: float = 1e-3,
    seed: int = 0,
    save_dir: str | None = None,
    save_after: int | None = None,
    resume_dir: str | None = None,
    measure_peak: bool = True,
) -> dict:
    """Train ``block_mlp(width, depth)`` with Adam under each strategy on ``steps`` global
    batches of ``batch_size`` (each rank takes its ``batch_size / N`` slice). Per strategy:

    ``loss`` (global mean per step), ``bytes`` (:func:`rank_bytes` after training), ``peak``
    (bytes: ``utils.memory.peak_bytes`` of one more step: CUDA allocator or CPU profiler),
    ``comm`` (calls and bytes per collective in one step, and ``sent``: ring bytes per rank),
    ``step_s`` (median seconds per step).

    ``save_dir``: with ``"fsdp2"``, write a sharded checkpoint (model and optimizer, every rank
    its shard) after ``save_after`` steps, and return the full state for comparison.
    ``resume_dir``: with ``"fsdp2"``, load it first (on any number of ranks) and train the
    remaining steps (the other strategies start afresh)."""
    exact_fp32()  # the losses are compared with reference_losses to 1e-5
    ctx = setup()
    try:
        if batch_size % ctx.world_size:
            raise ValueError(f"batch_size {batch_size} must be divisible by the {ctx.world_size} ranks")
        xs, ys = _batches(width, batch_size, steps, seed)
        per = batch_size // ctx.world_size
        sl = slice(ctx.rank * per, (ctx.rank + 1) * per)
        out = {"world_size": ctx.world_size, "backend": ctx.backend, "n_params": None}
        for strategy in strategies:
            torch.manual_seed(seed)
            model, opt = shard_model(block_mlp(width, depth, seed=seed), strategy, ctx, lr)
            start = 0
            if resume_dir is not None and strategy == "fsdp2":
                start = load_sharded(model, opt, resume_dir)
            losses, times, comm = [], [], None
            for i in range(start, steps):
                x, y = xs[i, sl].to(ctx.device), ys[i, sl].to(ctx.device)
                counter = CommCounter(ctx.world_size) if i == start + 1 or steps - start == 1 else None
                t0 = time.perf_counter()
                if counter is not None:
                    with counter:
                        losses.append(_step(model, opt, x, y, ctx))
                    comm = {"calls": dict(counter.calls), "nbytes": dict(counter.nbytes), "sent": counter.sent}
                else:
                    losses.append(_step(model, opt, x, y, ctx))
                if ctx.device.type == "cuda":
                    torch.cuda.synchronize(ctx.device)  # sync point: time the step, not its launch
                times.append(time.perf_counter() - t0)
                if save_dir is not None and strategy == "fsdp2" and i + 1 == save_after:
                    out["saved_state"] = save_sharded(model, opt, save_dir)
            res = {
                "loss": [_global_mean(v, ctx) for v in losses],
                "bytes": rank_bytes(model, opt),
                "comm": comm,
                "step_s": sorted(times[1:] or times)[len(times[1:] or times) // 2],
            }
            if measure_peak:
                # the step's transient bytes above what stays resident (parameters, optimizer
                # state): gradients, activations and, under FSDP, the all-gathered parameters
                x, y = xs[-1, sl].to(ctx.device), ys[-1, sl].to(ctx.device)
                opt.zero_grad(set_to_none=True)  # free before measuring, not during
                res["peak"] = peak_bytes(lambda m=model, o=opt, x=x, y=y: _step(m, o, x, y, ctx), ctx.device)
            out["n_params"] = sum(p.numel() for p in block_mlp(width, depth).parameters())
            out[strategy] = res
            del model, opt
        return out
    finally:
        teardown()


def reference_losses(
    *, width: int = 64, depth: int = 4, batch_size: int = 32, steps: int = 4, lr: float = 1e-3, seed: int = 0
) -> list:
    """The oracle: the same training in one process, on whole batches, with plain Adam."""
    xs, ys = _batches(width, batch_size, steps, seed)
    torch.manual_seed(seed)
    model = block_mlp(width, depth, seed=seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr, foreach=False)
    out = []
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = (model(xs[i]) - ys[i]).pow(2).mean()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out
