"""Notebook 03, section 2: the four basic collectives on every rank, and the hand ring all-reduce
timed against ``dist.all_reduce`` (section 3). Launched by ``parallel.launch(collectives_demo.worker, N, ...)``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from utils import device, parallel


def show_collectives(ctx: parallel.DistContext) -> dict[str, Any]:
    r, n, out = ctx.rank, ctx.world_size, {}
    t = torch.tensor([100.0 + r], device=ctx.device)
    dist.broadcast(t, src=0)
    out["broadcast"] = t.item()
    t = torch.tensor([r + 1.0], device=ctx.device)
    dist.reduce(t, dst=0)
    out["reduce"] = t.item()  # only rank 0's copy holds the sum
    t = torch.tensor([r + 1.0], device=ctx.device)
    dist.all_reduce(t)
    out["all_reduce"] = t.item()
    parts = [torch.zeros(2, device=ctx.device) for _ in range(n)]
    dist.all_gather(parts, torch.full((2,), float(r), device=ctx.device))
    out["all_gather"] = torch.stack(parts)
    return out


def best_time(fn: Callable[[], Any], ctx: parallel.DistContext, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first call is a warm-up
        dist.barrier()  # start together
        t0 = time.perf_counter()
        fn()
        device.synchronize(ctx.device)  # sync point: NCCL collectives return before they finish
        times.append(time.perf_counter() - t0)
    return min(times[1:])  # the least disturbed run: other programs only add time


def worker(message_sizes: Iterable[int], repeats: int) -> dict[str, Any]:
    ctx = parallel.setup()
    out = show_collectives(ctx)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(ctx.rank)).to(ctx.device)
    ref = x.clone()
    dist.all_reduce(ref)
    out["ring_max_diff"] = (parallel.ring_all_reduce(x.clone()) - ref).abs().max().item()
    out["t_ring"], out["t_all_reduce"] = {}, {}
    for n in message_sizes:
        buf = torch.zeros(n, device=ctx.device)
        out["t_ring"][n] = best_time(lambda b=buf: parallel.ring_all_reduce(b), ctx, repeats)
        out["t_all_reduce"][n] = best_time(lambda b=buf: dist.all_reduce(b), ctx, repeats)
    return out
