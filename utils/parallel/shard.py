"""Sharded data parallelism: ZeRO and FSDP2, their memory per rank, their communication, and
sharded checkpoints.

* :func:`zero_bytes`: the ZeRO paper's bytes per rank for stage 0 (DDP), 1 (optimizer state
  sharded), 2 (+ gradients), 3 (+ parameters, = FSDP): ``(P + G + O) / N`` for what is sharded.
* :func:`rank_bytes`: the bytes one rank really holds (DTensor shards counted locally).
* :func:`dim0_shard_numel`: the elements of one tensor a rank holds when FSDP2 splits it on its
  first dimension, in closed form.
* :class:`CommCounter`: every collective a rank issues (DDP's all-reduce, FSDP's all-gather and
  reduce-scatter, ZeRO's broadcast), with the bytes a ring moves per rank for each.
* :func:`zero_traffic`: the ZeRO paper's communication per step and stage, as the collectives it
  names and the ring bytes they move per rank: stages 1 and 2 move what DDP moves, stage 3 1.5x.
  (PyTorch's ``ZeroRedundancyOptimizer`` on top of DDP is not the paper's stage 1: it keeps DDP's
  all-reduce and adds a broadcast of the parameters, 1.5x; :class:`CommCounter` measures it.)
* :func:`shard_worker`: trains :func:`utils.memory.block_mlp` under ``"ddp"``, ``"zero1"``
  (``ZeroRedundancyOptimizer``), ``"fsdp2"`` (``fully_shard``) and ``"fsdp2_bf16"`` (with a bf16
  ``MixedPrecisionPolicy``) on the same global batches, and reports losses, bytes, traffic and
  time; it can also save a sharded checkpoint (``torch.distributed.checkpoint``) and resume from
  one on a different number of ranks. :func:`reference_losses` is the one-process oracle.

``fully_shard`` lives in ``torch.distributed.fsdp`` from torch 2.6, in
``torch.distributed._composable.fsdp`` in 2.4 and 2.5: :data:`fully_shard` is whichever exists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from .group import DistContext

try:  # torch >= 2.6
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:  # torch 2.4 and 2.5
    try:
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # pragma: no cover - torch < 2.4
        fully_shard = MixedPrecisionPolicy = None
try:  # offload to CPU memory (on a CPU-only box: pin_memory=False)
    from torch.distributed.fsdp import CPUOffloadPolicy
except ImportError:  # pragma: no cover - older layouts
    try:
        from torch.distributed._composable.fsdp import CPUOffloadPolicy
    except ImportError:
        CPUOffloadPolicy = None

__all__ = [
    "ZERO_STAGES",
    "zero_bytes",
    "rank_bytes",
    "dim0_shard_numel",
    "CommCounter",
    "ring_bytes",
    "zero_traffic",
    "shard_model",
    "save_sharded",
    "load_sharded",
    "STRATEGIES",
    "fully_shard",
    "MixedPrecisionPolicy",
    "CPUOffloadPolicy",
    "export_checkpoint",
]

ZERO_STAGES = {
    0: "DDP (nothing sharded)",
    1: "ZeRO-1 (optimizer state)",
    2: "ZeRO-2 (+ gradients)",
    3: "ZeRO-3 / FSDP (+ parameters)",
}
STRATEGIES = ("ddp", "zero1", "fsdp2", "fsdp2_bf16")


def zero_bytes(
    n_params: int,
    world_size: int,
    stage: int,
    *,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    optim_bytes: float = 12,
) -> dict:
    """Bytes per rank for ``n_params`` parameters on ``world_size`` ranks at ZeRO ``stage``.

    Defaults are the ZeRO paper's mixed-precision Adam: 2-byte parameters and gradients, 12
    bytes of optimizer state per parameter (fp32 master copy, momentum, variance): 16 bytes per
    parameter in all. Plain fp32 Adam: ``param_bytes=4, grad_bytes=4, optim_bytes=8``.
    Stage 1 divides the optimizer state by N, stage 2 the gradients too, stage 3 everything:
    stage 0 is ``(2+2+12)P``, stage 1 ``4P + 12P/N``, stage 2 ``2P + 14P/N``, stage 3 ``16P/N``."""
    if stage not in ZERO_STAGES:
        raise ValueError(f"ZeRO stage must be 0 (DDP), 1, 2 or 3, got {stage!r}")
    if world_size < 1 or n_params < 0:
        raise ValueError(f"need world_size >= 1 and n_params >= 0, got {world_size}, {n_params}")
    n = world_size
    out = {
        "params": param_bytes * n_params / (n if stage >= 3 else 1),
        "grads": grad_bytes * n_params / (n if stage >= 2 else 1),
        "optimizer": optim_bytes * n_params / (n if stage >= 1 else 1),
    }
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor holds only its shard


def _nbytes(t) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def rank_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds now: its parameters (shards, under FSDP), their gradients and the
    per-element optimizer state (0-dimensional step counters left out). For a
    ``ZeroRedundancyOptimizer``, the state of the parameters this rank owns."""
    params = list(model.parameters())
    out = {
        "params": sum(_nbytes(p) for p in params),
        "grads": sum(_nbytes(p.grad) for p in params if p.grad is not None),
    }
    opt = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local one
    out["optimizer"] = sum(
        _nbytes(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0
    )
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def dim0_shard_numel(shape: tuple[int, ...], world_size: int, rank: int) -> int:
    """Elements of a tensor of ``shape`` that ``rank`` holds when FSDP2 shards it on dimension 0,
    as ``torch.chunk`` splits it: ``ceil(rows / N)`` rows to each rank in turn, so the last ranks get
    fewer rows, or none. FSDP2 pads every shard to the longest for its collectives; the padding is
    not part of the shard ``to_local()`` returns, and is not counted here. A 0-dimensional tensor is
    held whole by every rank."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if not shape:
        return 1
    rows, rest = shape[0], 1
    for n in shape[1:]:
        rest *= n
    per = -(-rows // world_size)  # ceil
    return max(0, min(per, rows - rank * per)) * rest


# ----------------------------------------------------------------------------------------
# Communication volume
# ----------------------------------------------------------------------------------------

_KINDS = {
    "allreduce": "all_reduce",
    "all_reduce": "all_reduce",
    "allgather": "all_gather",
    "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "broadcast": "broadcast",
}
_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")  # process-group ops, functional ones


def ring_bytes(kind: str, nbytes: int, world_size: int) -> float:
    """Bytes one rank sends for a collective over a buffer of ``nbytes`` (the full, unsharded
    size), with ring algorithms: all-reduce ``2(N-1)/N``, all-gather and reduce-scatter
    ``(N-1)/N`` each (an all-reduce *is* a reduce-scatter then an all-gather), broadcast
    ``(N-1)/N`` on average (a pipelined ring: every rank but the last forwards the buffer once)."""
    n = world_size
    factor = {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "broadcast": (n - 1) / n,
    }
    if kind not in factor:
        raise ValueError(f"unknown collective {kind!r}; known: {', '.join(factor)}")
    return factor[kind] * nbytes


def zero_traffic(nbytes: float, world_size: int, stage: int) -> dict:
    """The ZeRO paper's communication for one training step at ``stage`` (Rajbhandari et al.,
    arXiv 1910.02054, section 7): the collectives it issues over a gradient or parameter buffer of
    ``nbytes`` (the whole model's), and the bytes a ring sends per rank for them (:func:`ring_bytes`).

    * stage 0 (DDP): one all-reduce of the gradients;
    * stages 1 and 2: a reduce-scatter of the gradients (each rank keeps the reduced part it
      updates), then an all-gather of the updated parameters: together one all-reduce's volume;
    * stage 3: an all-gather of the parameters before forward, another before backward, and a
      reduce-scatter of the gradients: 1.5x.

    Returns ``{"calls": {kind: count}, "sent": bytes per rank}``."""
    if stage not in ZERO_STAGES:
        raise ValueError(f"ZeRO stage must be 0 (DDP), 1, 2 or 3, got {stage!r}")
    calls = {
        0: {"all_reduce": 1},
        1: {"reduce_scatter": 1, "all_gather": 1},
        2: {"reduce_scatter": 1, "all_gather": 1},
        3: {"reduce_scatter": 1, "all_gather": 2},
    }[stage]
    sent = sum(k * ring_bytes(kind, nbytes, world_size) for kind, k in calls.items())
    return {"calls": calls, "sent": sent}


class CommCounter(TorchDispatchMode):
    """Count the collectives issued inside ``with CommCounter(world_size) as c:``.

    Collectives reach PyTorch's dispatcher as ``c10d`` operators (from DDP's reducer, FSDP2 and
    ``torch.distributed`` alike; DTensor's as ``_c10d_functional`` ones), so a dispatch mode sees
    every one, with its tensors.
    ``c.calls[kind]``, ``c.nbytes[kind]`` (the full buffer each time) and ``c.sent`` (bytes a
    ring sends per rank, :func:`ring_bytes`)."""

    def __init__(self, world_size: int):
        super().__init__()
        self.world_size = world_size
        self.calls: dict[str, int] = {}
        self.nbytes: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace, _, name = str(func).partition(".")
        if namespace in _NAMESPACES:
            kind = next((k for key, k in _KINDS.items() if key in name), None)
            if kind is not None:
                self.calls[kind] = self.calls.get(kind, 0) + 1
                self.nbytes[kind] = self.nbytes.get(kind, 0) + self._full_bytes(kind, args, namespace != "c10d")
        return func(*args, **kwargs)

    @staticmethod
    def _full_bytes(kind, args, functional: bool) -> int:
        def size(x):
            if isinstance(x, torch.Tensor):
                return x.numel() * x.element_size()
            if isinstance(x, (list, tuple)):
                return sum(size(v) for v in x)
            return 0

        if functional:  # (input, ...): all_gather_into_tensor(shard, group_size, group)
            return size(args[0]) * (args[1] if kind == "all_gather" else 1)
        # process-group ops: all_gather's output (args[0]) is the full buffer; reduce-scatter's
        # input (args[1]); all-reduce and broadcast: the tensors themselves (args[0])
        return size(args[1]) if kind == "reduce_scatter" else size(args[0])

    @property
    def sent(self) -> float:
        return sum(ring_bytes(k, b, self.world_size) for k, b in self.nbytes.items())


# ----------------------------------------------------------------------------------------
# One model, four ways to shard it (utils.demos.shard_demo drives it)
# ----------------------------------------------------------------------------------------


def shard_model(
    model: nn.Module, strategy: str, ctx: DistContext, lr: float
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """(model, optimizer) for ``strategy`` on the process group of ``ctx``."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from .group import ddp

    model = model.to(ctx.device)
    if strategy == "ddp":
        model = ddp(model, ctx)
        return model, torch.optim.Adam(model.parameters(), lr=lr, foreach=False)
    if strategy == "zero1":
        model = ddp(model, ctx)
        return model, ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.Adam, lr=lr, foreach=False
        )
    if strategy in ("fsdp2", "fsdp2_bf16"):
        if fully_shard is None:
            raise RuntimeError("FSDP2 (fully_shard) needs torch 2.4 or later")
        # The mesh of the ranks' own device type: without one, fully_shard builds a mesh of the
        # accelerator's type (CUDA whenever one is visible) and pins cuda:LOCAL_RANK, so gloo ranks on
        # the CPU of a box with fewer GPUs than ranks die ("invalid device ordinal"; torch 2.4
        # segfaults, pytorch#132471).
        from torch.distributed.device_mesh import init_device_mesh

        kw = {"mesh": init_device_mesh(ctx.device.type, (ctx.world_size,))}
        if strategy == "fsdp2_bf16":
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model:  # one all-gather per block: only one is whole at a time
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        return model, torch.optim.Adam(model.parameters(), lr=lr, foreach=False)
    raise ValueError(f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")


# ----------------------------------------------------------------------------------------
# Sharded checkpoints (torch.distributed.checkpoint)
# ----------------------------------------------------------------------------------------


def save_sharded(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> dict[str, torch.Tensor]:
    """Every rank writes its own shards (and rank 0 the metadata) to the folder ``path``.
    Returns the full (unsharded) model state, gathered, for comparing after a reload."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.clone() for k, v in full.items()}


def load_sharded(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> int:
    """Load a sharded checkpoint into ``model`` and ``opt`` whatever the number of ranks that
    wrote it: DCP reshards. Returns the number of steps it was saved after."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)  # the layout this run wants, to fill
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    steps = {int(s["step"]) for s in opt.state.values() if "step" in s}
    if len(steps) != 1:
        raise RuntimeError(f"the checkpoint's optimizer steps disagree: {sorted(steps)}")
    return steps.pop()


def export_checkpoint(path: str, out_file: str) -> dict:
    """Turn the sharded checkpoint folder ``path`` into one plain ``torch.save`` file (no process
    group needed), atomically; return its model state dict (what ``model.load_state_dict`` wants)."""
    import os

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    tmp = f"{out_file}.tmp{os.getpid()}"
    dcp_to_torch_save(path, tmp)
    os.replace(tmp, out_file)
    return torch.load(out_file, weights_only=False)["model"]
