"""Checkpoints: rank 0 writes, atomically; every rank resumes exactly."""

from __future__ import annotations

import os
import random
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..files import atomic_save

# ----------------------------------------------------------------------------------------
# Checkpoints: rank 0 writes, atomically; every rank resumes
# ----------------------------------------------------------------------------------------


def rng_state() -> dict:
    """Every random generator a run may use: torch (CPU and CUDA), NumPy, Python."""
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"].cpu())
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.cpu().numpy().astype(np.uint32), *rest))
    random.setstate(_tuples(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def _rank_world():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _unwrap(model):
    return getattr(model, "module", model)


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    *,
    epoch: int = 0,
    step: int = 0,
    sampler_epoch: int | None = None,
    extra: dict | None = None,
) -> bool:
    """Save everything needed to resume exactly; only rank 0 writes. Call it on EVERY rank.

    Holds the model (unwrapped from DDP), optimizer, scheduler, ``epoch`` (epochs completed),
    ``step`` (optimizer steps taken), ``sampler_epoch`` (the next ``set_epoch`` value) and
    every rank's RNG states (gathered, so each rank gets its own back). Written to a temporary
    file and renamed, so a crash mid-save never leaves a half-written checkpoint; all ranks
    wait at a barrier until the file is complete. Returns True on the rank that wrote.
    """
    rank, world = _rank_world()
    rngs = [rng_state()]
    if world > 1:
        rngs = [None] * world
        dist.all_gather_object(rngs, rng_state())  # collective: every rank must call this
    wrote = False
    if rank == 0:
        state = {
            "model": _unwrap(model).state_dict(),
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "epoch": int(epoch),
            "step": int(step),
            "sampler_epoch": int(epoch if sampler_epoch is None else sampler_epoch),
            "world_size": world,
            "rng": rngs,
            "extra": extra or {},
        }
        atomic_save(state, path)  # atomic (old or new, never half), on disk before the rename
        wrote = True
    if world > 1:
        dist.barrier()  # nobody reads it before it is complete
    return wrote


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    *,
    map_location: Any = None,
    restore_rng: bool = True,
) -> dict:
    """Load a :func:`save_checkpoint` file on every rank and restore what was saved.

    The file is read onto the CPU, then each piece is moved where it belongs: the weights into
    the model's parameters (on whatever device they are), the optimizer's state by
    ``optimizer.load_state_dict``, which puts moment buffers beside their parameters and keeps
    Adam's ``step`` counters on the CPU, where the optimizer expects them. (Loading with a GPU
    ``map_location`` would put those counters on the GPU, and a checkpoint written from cuda:0
    would land every rank's copy on GPU 0.) ``map_location``: where torch.load puts the tensors
    first; leave it None (the CPU). Returns the checkpoint dict (``epoch``, ``step``,
    ``sampler_epoch``, ``extra``...)."""
    ckpt = torch.load(os.fspath(path), map_location=map_location or "cpu", weights_only=True)
    _unwrap(model).load_state_dict(ckpt["model"])
    if optimizer is not None and ckpt.get("optimizer") is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
    if scheduler is not None and ckpt.get("scheduler") is not None:
        scheduler.load_state_dict(ckpt["scheduler"])
    if restore_rng and ckpt.get("rng"):
        rank, world = _rank_world()
        rngs = ckpt["rng"]
        if len(rngs) != world:
            raise RuntimeError(
                f"{path} was saved by {len(rngs)} rank(s) but {world} are resuming: RNG "
                "states cannot be matched (pass restore_rng=False to resume anyway)"
            )
        set_rng_state(rngs[rank])
    return ckpt


class Checkpointer:
    """A ``fit`` callback that saves a checkpoint at the end of every ``every`` epochs (all ranks
    call it; rank 0 writes). ``fit``'s epoch numbers are true ones (``start_epoch``), so the
    checkpoint's ``epoch`` is ``state.epoch + 1``, the epochs completed, which a resumed run passes
    back as ``fit(start_epoch=...)``. ``fit`` counts steps from 0 in every call: ``start_step``
    is where a resumed run began, added to make the checkpoint's ``step`` the run's total."""

    def __init__(
        self,
        path: str | os.PathLike,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        *,
        every: int = 1,
        start_step: int = 0,
    ):
        self.path, self.optimizer, self.scheduler = path, optimizer, scheduler
        self.every, self.start_step = every, start_step
        self.saved = []

    def on_step_end(self, state: SimpleNamespace) -> None:
        pass

    def on_epoch_end(self, state: SimpleNamespace) -> None:
        epoch = state.epoch + 1  # epochs completed so far
        if epoch % self.every == 0:
            save_checkpoint(
                self.path,
                state.model,
                self.optimizer or state.optimizer,
                self.scheduler,
                epoch=epoch,
                step=self.start_step + state.step,
                sampler_epoch=epoch,
            )
            self.saved.append(epoch)
