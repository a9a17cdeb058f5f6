"""Notebook 07's pipeline experiment: the course's GPT cut into one stage of whole blocks per rank
(``parallel.pipeline.gpt_stages``), one training step with ``torch.distributed.pipelining``'s GPipe
and 1F1B schedules, against one process on the whole model. Launched by
``parallel.launch(gpt_pp_demo.worker, 2, arch, batch_size, micro_batches)``."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..gpt import GPT, GPTConfig
from ..parallel import exact_fp32, setup, teardown
from ..parallel.pipeline import gpt_loss, gpt_stages, library_step

__all__ = ["worker"]


def worker(arch: GPTConfig, batch_size: int, micro_batches: int, seed: int = 0) -> dict:
    """Rank r holds stage r of ``GPT(arch, seed)``. For each schedule (``"gpipe"``, ``"1f1b"``):
    one step on the same batch in ``micro_batches`` micro-batches, then the tied table's two copies
    (token table on the first stage, head on the last) summed by one all-reduce. Returns, per
    schedule, this rank's gradients by the whole model's parameter names, the tied copy's gradient
    before that all-reduce (``tied_alone``; None on a middle stage) and the last stage's loss; and
    the one-process reference's loss and gradients of this rank's parameters (``"ref"``)."""
    exact_fp32()
    ctx = setup()
    try:
        p, r = ctx.world_size, ctx.rank
        g = torch.Generator().manual_seed(seed + 1)
        idx = torch.randint(0, arch.vocab_size, (batch_size, arch.context + 1), generator=g).to(ctx.device)
        x, y = idx[:, :-1], idx[:, 1:]
        whole = GPT(arch, seed=seed).to(ctx.device)
        _, loss = whole(x, y)
        loss.backward()
        ref = {n: q.grad.detach().cpu() for n, q in whole.named_parameters()}
        ends = dist.new_group([0, p - 1])  # the two stages that hold a copy of the tied table
        out = {"rank": r, "stages": p, "ref": {"loss": loss.item()}, "schedules": {}}
        for kind in ("gpipe", "1f1b"):
            stage = gpt_stages(GPT(arch, seed=seed), p)[r].to(ctx.device)
            dist.barrier()
            step_loss = library_step(kind, stage, x, y, micro_batches, ctx, loss_fn=gpt_loss)
            tied = stage.tok.weight if r == 0 else stage.head.weight if r == p - 1 else None
            alone = None if tied is None else tied.grad.detach().cpu().clone()  # this stage's part only
            if tied is not None:
                dist.all_reduce(tied.grad, group=ends)  # both copies step with the sum of their gradients
            grads = {n: q.grad.detach().cpu() for n, q in stage.named_parameters()}
            out["schedules"][kind] = {"loss": step_loss, "grads": grads, "tied_alone": alone}
        names = set(out["schedules"]["gpipe"]["grads"])
        out["ref"]["grads"] = {n: ref["tok.weight" if n == "head.weight" else n] for n in names}
        return out
    finally:
        teardown()
