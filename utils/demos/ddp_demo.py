"""Notebook 03: DDP by hand and with ``DistributedDataParallel`` (compared with one process),
uneven inputs under ``Join`` (and how its average is divided), gradient accumulation with
``no_sync``, bucket sizes against overlap, and BatchNorm's statistics (``batchnorm_demo``). One launch runs them all: ``parallel.launch(ddp_demo.worker, N, ...)``."""

# No `from __future__ import annotations` here: DDP's register_comm_hook compares the hook's annotations
# with dist.GradBucket and Future[Tensor] themselves, and refuses them as strings.

import contextlib
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join
from torch.utils.data import TensorDataset

from utils import data, device, models, parallel
from utils.demos import batchnorm_demo
from utils.train import fit


def small_net(seed: int) -> models.Net:
    torch.manual_seed(seed)
    return models.Net(8, in_channels=1, image_size=8)


def by_hand(
    ctx: parallel.DistContext, ds: TensorDataset, batch: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model = small_net(100 + ctx.rank).to(ctx.device)  # a different start on every rank
    init = {k: v.clone() for k, v in model.state_dict().items()}
    for p in model.parameters():
        dist.broadcast(p.data, src=0)  # (1) everyone gets rank 0's weights
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in data.make_loader(ds, batch, rank=ctx.rank, world_size=ctx.world_size, seed=5, device=ctx.device):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()  # (2) my shard
        parallel.average_gradients(model)  # (3) all-reduce, divide by N
        opt.step()  # (4) the same step everywhere
    return init, model.state_dict()


def with_ddp(ctx: parallel.DistContext, ds: TensorDataset, batch: int) -> dict[str, torch.Tensor]:
    model = parallel.ddp(small_net(100 + ctx.rank), ctx)  # broadcasts rank 0's weights
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = data.make_loader(ds, batch, rank=ctx.rank, world_size=ctx.world_size, seed=5, device=ctx.device)
    fit(model, loader, opt, epochs=1, progress=False)  # all-reduce happens in backward()
    return model.module.state_dict()


def uneven_with_join(ctx: parallel.DistContext, divide_by_initial_world_size: bool = True) -> dict[str, Any]:
    model = parallel.ddp(small_net(0), ctx)
    n_batches = 3 if ctx.rank == 0 else 2  # the same uneven split
    g = torch.Generator().manual_seed(ctx.rank)  # each rank its own data
    with Join([model], divide_by_initial_world_size=divide_by_initial_world_size):
        for _ in range(n_batches):
            x, y = torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)
            model.zero_grad()
            nn.functional.cross_entropy(model(x.to(ctx.device)), y.to(ctx.device)).backward()
    dist.barrier()  # now reached by everyone
    out = {"batches": n_batches}
    if ctx.rank == 0:  # rank 0's last batch was all-reduced with rank 1 already joined
        alone = small_net(0).to(ctx.device)  # the same weights (no step was taken), no DDP
        nn.functional.cross_entropy(alone(x.to(ctx.device)), y.to(ctx.device)).backward()
        out["own_grad"] = [p.grad.cpu() for p in alone.parameters()]  # rank 0's gradient, not averaged
        out["ddp_grad"] = [p.grad.cpu() for p in model.parameters()]  # what DDP left after the all-reduce
    return out


def counting_hook(calls: list[int], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    calls.append(bucket.buffer().numel())  # note the bucket...
    return default_hooks.allreduce_hook(None, bucket)  # ...then DDP's usual averaging all-reduce


def accumulation(ctx: parallel.DistContext, ds: TensorDataset, batch: int, k: int = 4) -> dict[bool, dict[str, Any]]:
    out = {}
    for use_no_sync in (False, True):
        calls = []
        model = parallel.ddp(small_net(0), ctx)
        model.register_comm_hook(calls, counting_hook)
        micro = list(data.make_loader(ds, batch // k, rank=ctx.rank, world_size=ctx.world_size, device=ctx.device))[:k]
        for i, (x, y) in enumerate(micro):
            skip = use_no_sync and i < k - 1
            with model.no_sync() if skip else contextlib.nullcontext():
                (nn.functional.cross_entropy(model(x), y) / k).backward()
        out[use_no_sync] = {"all_reduces": len(calls), "grads": [p.grad for p in model.parameters()]}
    return out


def mlp(width: int, depth: int = 4) -> nn.Sequential:
    """``depth`` Linear-ReLU layers of ``width``, then 10 outputs; the same weights on every rank."""
    torch.manual_seed(0)
    return models.mlp(width, depth + 1, out_features=10)


def step_time(
    ctx: parallel.DistContext,
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    repeats: int,
    sync_ctx: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    after: Callable[[], Any] | None = None,
) -> float:
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        dist.barrier()
        t0 = time.perf_counter()
        with sync_ctx():
            nn.functional.cross_entropy(model(x), y).backward()
        if after:
            after()
        device.synchronize(ctx.device)  # sync point: before reading the clock
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return sorted(times[1:])[len(times[1:]) // 2]


def buckets(ctx: parallel.DistContext, width: int, caps: Iterable[float], repeats: int) -> dict[str, Any]:
    x = torch.randn(32, width, device=ctx.device)
    y = torch.randint(0, 10, (32,), device=ctx.device)
    out = {"buckets": {}, "t_ddp": {}}
    for cap in caps:
        calls = []
        model = parallel.ddp(mlp(width), ctx, bucket_cap_mb=cap)
        model.register_comm_hook(calls, counting_hook)
        step_time(ctx, model, x, y, 1)  # DDP re-buckets after its first steps
        calls.clear()
        out["t_ddp"][cap] = step_time(ctx, model, x, y, repeats)
        out["buckets"][cap] = len(calls) // (repeats + 1)
    model = parallel.ddp(mlp(width), ctx)
    out["t_compute"] = step_time(ctx, model, x, y, repeats, sync_ctx=model.no_sync)
    plain = mlp(width).to(ctx.device)
    out["t_serial"] = step_time(ctx, plain, x, y, repeats, after=lambda: parallel.average_gradients(plain))
    out["bytes"] = 4 * sum(p.numel() for p in plain.parameters())
    return out


def worker(n: int, batch: int, width: int, caps: Iterable[float], repeats: int) -> dict[str, Any]:
    parallel.exact_fp32()  # TF32 off: the weights are compared with a CPU run to 1e-4
    ctx = parallel.setup()
    ds = data.synthetic(n, shape=(1, 8, 8), seed=3)
    init, hand = by_hand(ctx, ds, batch)
    return {
        "init": init,
        "hand": hand,
        "ddp": with_ddp(ctx, ds, batch),
        "join": uneven_with_join(ctx),
        "join_live_ranks": uneven_with_join(ctx, divide_by_initial_world_size=False),
        "batchnorm": batchnorm_demo.batchnorm(ctx),
        "pid": os.getpid(),
        "accumulation": accumulation(ctx, ds, batch),
        "buckets": buckets(ctx, width, caps, repeats),
    }


def join_worker(divide_by_initial_world_size: bool = True) -> dict[str, Any]:
    """:func:`uneven_with_join` alone on every rank (``parallel.launch(ddp_demo.join_worker, N)``)."""
    parallel.exact_fp32()
    return uneven_with_join(parallel.setup(), divide_by_initial_world_size)
