"""Workers for tests/test_oracle_ddp.py: module-level functions, so that the processes
utils.parallel.launch spawns can import them by name (pytest puts tests/ on sys.path, and spawned
children inherit it). Also the data and model both sides of the comparison use."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from utils import parallel

B, D, H, C = 4, 5, 7, 3  # per-rank batch, input features, hidden units, classes
MICRO = 3  # micro-batches per optimizer step in the no_sync case
LR, MOMENTUM = 0.1, 0.9


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, C)).double()


def data(world: int):
    """x (world, MICRO, B, D) and y (world, MICRO, B): batch s of rank r is x[r, s], y[r, s];
    the same in every process (a fixed generator)."""
    g = torch.Generator().manual_seed(1234 + world)
    x = torch.randn(world, MICRO, B, D, generator=g, dtype=torch.float64)
    y = torch.randint(0, C, (world, MICRO, B), generator=g)
    return x, y


def batches_under_join(rank: int) -> int:
    """Uneven inputs: how many batches rank ``rank`` has (1, 2, 3, 1, ...)."""
    return 1 + rank % 3


def _optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def equivalence_worker():
    """One DDP process: three cases, each from a fresh DDP model with the same initial weights."""
    from torch.distributed.algorithms.join import Join

    ctx = parallel.setup()
    r, world = ctx.rank, ctx.world_size
    x, y = data(world)
    loss_fn = nn.functional.cross_entropy
    out = {"rank": r, "world": world, "backend": ctx.backend}

    # 1. one optimizer step on this rank's shard of the global batch
    model = parallel.ddp(make_model(), ctx)
    opt = _optimizer(model)
    loss_fn(model(x[r, 0]), y[r, 0]).backward()
    opt.step()
    out["one_step"] = _state(model.module)

    # 2. gradient accumulation: MICRO micro-batches, all-reduce only on the last (no_sync)
    model = parallel.ddp(make_model(), ctx)
    opt = _optimizer(model)
    with model.no_sync():
        for j in range(MICRO - 1):
            (loss_fn(model(x[r, j]), y[r, j]) / MICRO).backward()
            if j == 0:  # under no_sync nothing was all-reduced: the rank's own gradient
                out["local_grad_after_first_micro"] = {n: p.grad.clone() for n, p in model.module.named_parameters()}
    (loss_fn(model(x[r, MICRO - 1]), y[r, MICRO - 1]) / MICRO).backward()
    opt.step()
    out["no_sync"] = _state(model.module)

    # 3. uneven inputs under Join: rank r runs batches_under_join(r) steps, then shadows the
    #    others' all-reduces with zeros until every rank is done
    model = parallel.ddp(make_model(), ctx)
    opt = _optimizer(model)
    with Join([model]):
        for s in range(batches_under_join(r)):
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x[r, s]), y[r, s]).backward()
            opt.step()
    out["join"] = _state(model.module)
    dist.barrier()
    return out
