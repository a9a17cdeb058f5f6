"""Notebook 03: BatchNorm under DDP. Plain DDP normalises each rank's batch with that rank's own
statistics (ghost batch norm with the per-rank batch); synchronised batch norm uses the global
batch's. Called on every rank by ``ddp_demo.worker``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from utils import parallel


def global_batch(world_size: int, per_rank: int = 4, channels: int = 3) -> torch.Tensor:
    """The same images on every rank (and in the notebook): rank r trains on rows r*per_rank onwards."""
    g = torch.Generator().manual_seed(0)
    return 3 * torch.randn(world_size * per_rank, channels, 4, 4, generator=g) + 1


def synced_batch_norm(x: torch.Tensor, eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batch norm over the global batch, by hand: all-reduce each channel's count, sum and sum of
    squares, then normalise the local rows with the global mean and (biased) variance."""
    dims = (0, 2, 3)  # everything but the channel
    stats = torch.stack([torch.full_like(x.sum(dims), x.numel() / x.shape[1]), x.sum(dims), (x * x).sum(dims)])
    dist.all_reduce(stats)  # one message: counts, sums, sums of squares of every rank
    count, total, total_sq = stats
    mean = total / count
    var = total_sq / count - mean**2
    shape = (1, -1, 1, 1)
    return (x - mean.view(shape)) / torch.sqrt(var.view(shape) + eps), mean, var


def batchnorm(ctx: parallel.DistContext, per_rank: int = 4) -> dict[str, Any]:
    x_all = global_batch(ctx.world_size, per_rank)
    x = x_all[ctx.rank * per_rank : (ctx.rank + 1) * per_rank].to(ctx.device)  # my rows
    torch.manual_seed(0)
    plain = parallel.ddp(nn.BatchNorm2d(x.shape[1]), ctx)  # plain DDP: my batch's statistics
    out = {
        "plain": plain(x).detach().cpu(),
        "plain_mean": x.mean((0, 2, 3)).cpu(),
    }
    y, mean, _ = synced_batch_norm(x)
    out["by_hand"], out["synced_mean"] = y.cpu(), mean.cpu()
    out["library"] = None
    if ctx.device.type == "cuda":  # torch.nn.SyncBatchNorm runs on GPUs only
        sync = nn.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm2d(x.shape[1]))
        out["library"] = parallel.ddp(sync, ctx)(x).detach().cpu()
    return out


def worker(per_rank: int = 4) -> dict[str, Any]:
    """:func:`batchnorm` alone on every rank (``parallel.launch(batchnorm_demo.worker, N)``)."""
    return batchnorm(parallel.setup(), per_rank)
