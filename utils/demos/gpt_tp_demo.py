"""Notebook 07's tensor- and sequence-parallel experiment: the course's GPT (``utils.gpt``) split
over the ranks with ``parallelize_module`` (plans from ``parallel.tensor_parallel.gpt_plan``), one
training step's forward and backward against one process on the whole model, and the collectives
each module issues counted by PyTorch's ``CommDebugMode``. Launched by
``parallel.launch(gpt_tp_demo.worker, 2, arch, batch_size)``."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from ..gpt import GPT, GPTConfig
from ..parallel import exact_fp32, setup, teardown
from ..parallel.shard import CommCounter
from ..parallel.tensor_parallel import gpt_plan, split_qkv

if TYPE_CHECKING:
    from torch.distributed.tensor.debug import CommDebugMode

__all__ = ["PLANS", "worker", "full_grads", "module_counts"]

# the plans the worker runs: name -> gpt_plan's keywords
PLANS = {
    "tp": {},  # tensor parallelism, attention's input shared by q, k and v
    "tp_unshared": {"shared_input": False},  # each of q, k and v all-reduces its own input gradient
    "sp": {"sequence_parallel": True},  # tensor and sequence parallelism
}
_KINDS = {"all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter"}


def module_counts(mode: CommDebugMode) -> dict[str, dict[str, dict[str, int]]]:
    """``CommDebugMode``'s per-module counts as plain names: ``{"blocks.0.attn": {"forward":
    {"all_reduce": 1}, "backward": {...}}, ...}`` (the model's own name prefix dropped; ``"total"``
    for everything)."""
    out = {}
    for fqn, phases in mode.comm_module_counts.items():
        name = "total" if fqn == "Global" else fqn.partition(".")[2] or "model"
        out[name] = {
            phase: {next((k for key, k in _KINDS.items() if key in str(op)), str(op)): n for op, n in ops.items() if n}
            for phase, ops in phases.items()
        }
    return out


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The gradients of a (split, parallelized) GPT as whole tensors under the one-process GPT's
    names: DTensors reassembled (``full_tensor``), and each block's q, k and v gradients stacked
    back into the fused ``attn.qkv`` layout."""

    def whole(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    out = {}
    for name, p in model.named_parameters():
        *prefix, part, kind = name.split(".")
        if part in ("q", "k", "v"):  # gathered below, in the fused order q, k, v
            continue
        out[name] = whole(p.grad).detach().cpu()
    for i, block in enumerate(model.blocks):
        a = block.attn
        for kind in ("weight", "bias"):
            if getattr(a.q, kind) is not None:
                out[f"blocks.{i}.attn.qkv.{kind}"] = torch.cat(
                    [whole(getattr(lin, kind).grad).detach().cpu() for lin in (a.q, a.k, a.v)]
                )
    return out


def worker(arch: GPTConfig, batch_size: int, seed: int = 0) -> dict:
    """On every rank: the same batch of random token ids and the same GPT. Returns the one-process
    reference (``"ref"``: logits, loss, gradients) and, for each plan of :data:`PLANS`, the split
    model's logits, loss, whole gradients, the collectives per module and pass (``CommDebugMode``),
    their bytes (``parallel.shard.CommCounter``: the buffers, and what a ring sends per rank), the
    local shapes of a few weights and the placements of the LayerNorms' gradients. Every rank
    computes the same; rank 0 returns it, the others only their rank (whole gradients of a large
    model are not worth sending back twice)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import parallelize_module

    exact_fp32()  # compared with one process to float32's tolerances
    ctx = setup()
    try:
        g = torch.Generator().manual_seed(seed + 1)
        idx = torch.randint(0, arch.vocab_size, (batch_size, arch.context + 1), generator=g).to(ctx.device)
        x, y = idx[:, :-1], idx[:, 1:]
        ref = GPT(arch, seed=seed).to(ctx.device)
        logits, loss = ref(x, y)
        loss.backward()
        out = {
            "ref": {
                "logits": logits.detach().cpu(),
                "loss": loss.detach().cpu(),
                "grads": {n: p.grad.detach().cpu() for n, p in ref.named_parameters()},
            },
            "world_size": ctx.world_size,
            "backend": ctx.backend,
        }
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        for name, kw in PLANS.items():
            model = split_qkv(GPT(arch, seed=seed)).to(ctx.device)
            parallelize_module(model, mesh, gpt_plan(arch.layers, **kw))
            with CommDebugMode() as comm, CommCounter(ctx.world_size) as sent, warnings.catch_warnings():
                # its module tracker's backward hooks warn when a module's inputs need no gradient
                warnings.simplefilter("ignore", UserWarning)
                logits, loss = model(x, y)
                loss.backward()
            counts = module_counts(comm)
            block = model.blocks[0]
            out[name] = {
                "logits": logits.detach().cpu(),
                "loss": loss.detach().cpu(),
                "grads": full_grads(model),
                "counts": counts,
                "nbytes": dict(sent.nbytes),  # the full buffer of each kind, summed
                "sent": sent.sent,  # bytes a ring sends per rank for them all
                "local_shapes": {
                    n: tuple(getattr(getattr(block, a), b).weight.to_local().shape)
                    for n, (a, b) in {
                        "attn.q": ("attn", "q"),
                        "attn.proj": ("attn", "proj"),
                        "mlp.fc": ("mlp", "fc"),
                    }.items()
                },
                "norm_grad_placements": [str(p) for p in getattr(block.norm1.weight.grad, "placements", ())],
            }
        return out if ctx.rank == 0 else {"rank": ctx.rank}
    finally:
        teardown()
