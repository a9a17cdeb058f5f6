"""Notebook 03, section 5: uneven inputs make DDP hang; a short collective timeout turns the hang
into an error. Launched by ``parallel.launch(hang_demo.worker, 2, ...)``."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from utils import models, parallel


def worker(timeout_s: float) -> None:
    ctx = parallel.setup()
    short = dist.new_group(timeout=timedelta(seconds=timeout_s))  # its collectives give up sooner
    torch.manual_seed(0)
    model = parallel.ddp(models.Net(8, in_channels=1, image_size=8), ctx, process_group=short)
    n_batches = 3 if ctx.rank == 0 else 2  # uneven: rank 0 has one batch more
    for _ in range(n_batches):
        x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
        torch.nn.functional.cross_entropy(model(x.to(ctx.device)), y.to(ctx.device)).backward()
    print(f"rank {ctx.rank}: my {n_batches} batches are done, waiting at the barrier", flush=True)
    dist.barrier(group=short)
