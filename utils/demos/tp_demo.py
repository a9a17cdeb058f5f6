"""Notebook 05's tensor-parallel experiment: one MLP block split Megatron-style over the ranks, by
hand (:class:`utils.parallel.tensor_parallel.TPMLP`) and with ``parallelize_module``, against one
process on the whole layer. Launched by ``parallel.launch(tp_demo.worker, 2, ...)``."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..memory import block_mlp
from ..parallel import exact_fp32, setup, teardown
from ..parallel.shard import CommCounter
from ..parallel.tensor_parallel import TPMLP

__all__ = ["worker"]


def _count(fn, world_size):
    with CommCounter(world_size) as c:
        out = fn()
    return out, {"calls": dict(c.calls), "nbytes": dict(c.nbytes)}


def worker(width: int = 32, batch_size: int = 8, expand: int = 4, seed: int = 0) -> dict:
    """On every rank: one MLP block, the whole batch (tensor parallelism splits the layer, not
    the data). Returns the one-process reference, the hand split and ``parallelize_module``:
    outputs, loss, gradients (reassembled to full shape) and collectives counted per pass."""
    exact_fp32()  # compared with the one-process CPU reference to 1e-5
    ctx = setup()
    try:
        n, r = ctx.world_size, ctx.rank
        block = block_mlp(width, 1, expand=expand, seed=seed)[0]
        g = torch.Generator().manual_seed(seed + 1)
        x = torch.randn(batch_size, width, generator=g)
        # reference: one process, the whole layer
        ref = block_mlp(width, 1, expand=expand, seed=seed)[0]
        y_ref = ref(x)
        y_ref.pow(2).mean().backward()
        out = {"ref": {"y": y_ref.detach(), "w1": ref[0].weight.grad, "w2": ref[2].weight.grad}}

        # by hand
        tp = TPMLP(block, r, n).to(ctx.device)
        xd = x.to(ctx.device).requires_grad_(True)
        y, fwd = _count(lambda: tp(xd), n)
        _, bwd = _count(lambda: y.pow(2).mean().backward(), n)
        w1 = [torch.empty_like(tp.w1.grad) for _ in range(n)]
        w2 = [torch.empty_like(tp.w2.grad) for _ in range(n)]
        dist.all_gather(w1, tp.w1.grad)  # reassemble the shards' gradients to compare
        dist.all_gather(w2, tp.w2.grad.contiguous())
        out["hand"] = {
            "y": y.detach(),
            "w1": torch.cat(w1, 0),
            "w2": torch.cat(w2, 1),
            "x_grad": xd.grad,
            "forward": fwd,
            "backward": bwd,
            "shard_shapes": (tuple(tp.w1.shape), tuple(tp.w2.shape)),
        }

        # DTensor: parallelize_module with the same plan
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh(ctx.device.type, (n,))
        m = parallelize_module(
            block_mlp(width, 1, expand=expand, seed=seed)[0].to(ctx.device),
            mesh,
            {"0": ColwiseParallel(), "2": RowwiseParallel()},
        )
        xd2 = x.to(ctx.device).requires_grad_(True)  # as above: the input needs its gradient
        y2, fwd2 = _count(lambda: m(xd2), n)
        _, bwd2 = _count(lambda: y2.pow(2).mean().backward(), n)
        out["dtensor"] = {
            "y": y2.detach(),
            "w1": m[0].weight.grad.full_tensor(),
            "w2": m[2].weight.grad.full_tensor(),
            "x_grad": xd2.grad,
            "forward": fwd2,
            "backward": bwd2,
            "shard_shapes": (tuple(m[0].weight.to_local().shape), tuple(m[2].weight.to_local().shape)),
        }
        return out
    finally:
        teardown()
