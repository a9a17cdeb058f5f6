"""Notebook 05's pipeline experiment: a block MLP split into one stage per rank, trained by the
hand GPipe loop (:func:`utils.parallel.pipeline.gpipe_step`) for several micro-batch counts and by
``torch.distributed.pipelining``'s GPipe and 1F1B schedules, each against one process on the whole
batch. Launched by ``parallel.launch(pp_demo.worker, 2, ...)``."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from ..memory import block_mlp
from ..parallel import exact_fp32, setup, teardown
from ..parallel.pipeline import gpipe_step, library_step, mse, split_stages

__all__ = ["worker"]


def _grads(module) -> dict:
    return {k: p.grad.detach().clone() for k, p in module.named_parameters()}


def worker(
    width: int = 32,
    depth: int = 4,
    batch_size: int = 16,
    micro_batches: Iterable[int] = (1, 2, 4, 8),
    repeats: int = 3,
    library_m: int = 4,
    seed: int = 0,
) -> dict:
    """Rank r holds stage r of ``block_mlp(width, depth)``. For each m in ``micro_batches``:
    ``repeats`` hand GPipe steps (traces gathered on rank 0); then ScheduleGPipe and
    Schedule1F1B with ``library_m`` micro-batches. Gradients of every variant against one
    process on the whole batch (the max difference, per variant)."""
    exact_fp32()  # gradients compared with the CPU oracle to 1e-5
    ctx = setup()
    try:
        p, r = ctx.world_size, ctx.rank
        g = torch.Generator().manual_seed(seed + 1)
        x = torch.randn(batch_size, width, generator=g)
        y = torch.randn(batch_size, width, generator=g)
        full = block_mlp(width, depth, seed=seed)  # the oracle, on the CPU
        mse(full(x), y).backward()
        ref = {k: v.to(ctx.device) for k, v in _grads(split_stages(full, p)[r]).items()}
        ref_loss = mse(full(x), y).item()
        x, y = x.to(ctx.device), y.to(ctx.device)

        out = {"stages": p, "ref_loss": ref_loss, "hand": {}, "library": {}}
        for m in micro_batches:
            errs, traces, losses = [], [], []
            for _ in range(repeats):
                stage = split_stages(block_mlp(width, depth, seed=seed), p)[r].to(ctx.device)
                trace = []
                dist.barrier()  # every stage starts together
                loss = gpipe_step(stage, x, y, m, rank=r, world_size=p, trace=trace)
                errs.append(max((q.grad - ref[k]).abs().max().item() for k, q in stage.named_parameters()))
                gathered = [None] * p
                dist.all_gather_object(gathered, trace)
                traces.append(gathered)
                losses.append(loss)
            out["hand"][m] = {
                "grad_err": max(errs),
                "traces": traces,
                "loss": float(losses[-1]) if losses[-1] is not None else None,
            }
        for kind in ("gpipe", "1f1b"):
            stage = split_stages(block_mlp(width, depth, seed=seed), p)[r].to(ctx.device)
            dist.barrier()
            loss = library_step(kind, stage, x, y, library_m, ctx)
            err = max((q.grad - ref[k]).abs().max().item() for k, q in stage.named_parameters())
            out["library"][kind] = {"grad_err": err, "loss": loss}
        return out
    finally:
        teardown()
