"""The data-parallel training worker: one function, started two ways.

From a notebook (each rank's result comes back as a dict)::

    results = utils.parallel.launch(utils.ddp_train.train, 2, {"epochs": 2, "ckpt": "run.pt"})

From a shell, on one node or several (the same function, through :func:`main`)::

    torchrun --nproc-per-node 2 -m utils.ddp_train --epochs 10 --ckpt run.pt --out final.pt
    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-id JOB \\
             --rdzv-endpoint HOST:PORT -m utils.ddp_train      # the same line on every node

It is the serial recipe plus a small diff: ``setup()`` the group, a loader sharded by rank,
the model wrapped in DDP, the same ``utils.train.fit``, a checkpoint written by rank 0 after
every epoch. If ``ckpt`` exists the run resumes from it (model, optimizer, scheduler, epoch,
sampler epoch, RNG), so ``torchrun --max-restarts 1`` recovers from a crashed rank and ends
with the weights an uninterrupted run would have. ``fail_at_step`` injects such a crash.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import signal
import sys
import traceback
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from . import data, device, models, parallel
from .files import atomic_save
from .train import Callback, fit


@dataclass
class TrainConfig:
    dataset: str = "digits"  # utils.data.load name
    n_train: int = 1024  # training images (divisible by world_size * batch_size: no padding)
    n_val: int = 256  # held-out images, evaluated after every epoch
    model: str = "net"  # utils.models.build name
    width: int = 16  # the CNN's width: Net's first-convolution channels
    epochs: int = 2  # passes over n_train
    batch_size: int = 32  # images per optimizer step PER PROCESS (global: x world_size)
    lr: float = 0.1  # SGD learning rate (peak of the cosine schedule)
    momentum: float = 0.9
    seed: int = 0  # model init, data subset and shuffling
    loader: str = "device"  # "device" or "dataloader" (both sharded by rank)
    grad_accum: int = 1  # micro-batches per optimizer step (DDP no_sync on the others)
    bucket_cap_mb: float = 25.0  # DDP gradient bucket size (MB)
    ckpt: str = ""  # checkpoint path: saved every epoch by rank 0, resumed from if present
    out: str = ""  # final weights: rank 0 writes; "{rank}" in the name: every rank writes
    fail_at_step: int = 0  # > 0: crash fail_rank at this global step (first attempt only)
    fail_rank: int = 1
    fail_mode: str = "kill"  # "kill" (SIGKILL, like a lost node) or "raise"
    backend: str = ""  # "", "gloo" or "nccl" ("" = NCCL when there is a GPU per rank)
    device: str = ""  # "" = cuda:LOCAL_RANK with NCCL, else CPU; "cuda": gloo ranks share a GPU
    channels_last: bool = False  # NHWC weights and inputs (converted before the DDP wrap)
    deterministic: bool = True  # cuDNN/cuBLAS settings for bit-identical GPU runs (utils.device.set_deterministic)
    evaluate: bool = True  # validation after every epoch
    progress: bool = False  # fit's progress bar (rank 0 only)
    return_state: bool = True  # send the final state_dict back (launch)


def make_config(config: TrainConfig | dict[str, Any] | None = None, **overrides: Any) -> TrainConfig:
    """A :class:`TrainConfig` from a dict / TrainConfig / None plus overrides; unknown keys are errors."""
    base = dataclasses.asdict(config) if isinstance(config, TrainConfig) else dict(config or {})
    base.update(overrides)
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(base) - known)
    if unknown:
        raise ValueError(f"unknown training option(s) {unknown}; known: {', '.join(sorted(known))}")
    return TrainConfig(**base)


class FailAt(Callback):
    """Injected failure: ``rank`` dies at global optimizer step ``step``, on the first attempt only
    (torchrun counts attempts in TORCHELASTIC_RESTART_COUNT)."""

    def __init__(self, step: int, rank: int, my_rank: int, start_step: int, mode: str = "kill"):
        self.step, self.rank, self.my_rank, self.start_step, self.mode = step, rank, my_rank, start_step, mode

    def on_step_end(self, state: SimpleNamespace) -> None:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if attempt == 0 and self.my_rank == self.rank and self.start_step + state.step == self.step:
            print(f"rank {self.rank}: injected failure at step {self.step}", flush=True)
            if self.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected failure on rank {self.rank} at step {self.step}")


def build(
    cfg: TrainConfig, ctx: parallel.DistContext
) -> tuple[Iterable, Iterable, torch.nn.Module, torch.optim.Optimizer, Any]:
    """Data, sharded loader, model, optimizer and schedule of a run: the same on every rank."""
    splits = data.load(cfg.dataset, cfg.n_train, cfg.n_val, seed=cfg.seed)
    loader = data.make_loader(
        splits.train,
        cfg.batch_size,
        kind=cfg.loader,
        rank=ctx.rank,
        world_size=ctx.world_size,
        seed=cfg.seed,
        device=ctx.device,
    )
    val = data.make_loader(splits.val, 256, shuffle=False, device=ctx.device)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    kw = {"width": cfg.width} if cfg.model == "net" else {}
    model = models.build(cfg.model, splits.shape, **kw).to(ctx.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    total_steps = max(1, cfg.epochs * (len(loader) // cfg.grad_accum))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
    return loader, val, model, optimizer, scheduler


def train(config: TrainConfig | dict[str, Any] | None = None, **overrides: Any) -> dict[str, Any]:
    """Train with DDP on this process's rank; returns a dict (history, final weights, resume info)."""
    cfg = make_config(config, **overrides)
    if cfg.deterministic:
        device.set_deterministic()  # before any GPU work: a resumed run repeats the uninterrupted one
    ctx = parallel.setup(cfg.backend or None, device=cfg.device or None)
    net = None
    try:
        loader, val, model, optimizer, scheduler = build(cfg, ctx)
        start_epoch = start_step = 0
        if cfg.ckpt and os.path.exists(cfg.ckpt):
            ck = parallel.load_checkpoint(cfg.ckpt, model, optimizer, scheduler)
            start_epoch, start_step = ck["epoch"], ck["step"]
            if ctx.is_main:
                print(f"resumed from {cfg.ckpt}: epoch {start_epoch}, step {start_step}", flush=True)
        net = parallel.ddp(model, ctx, channels_last=cfg.channels_last, bucket_cap_mb=cfg.bucket_cap_mb)
        callbacks = []
        if cfg.ckpt:
            callbacks.append(parallel.Checkpointer(cfg.ckpt, optimizer, scheduler, start_step=start_step))
        if cfg.fail_at_step > 0:
            callbacks.append(FailAt(cfg.fail_at_step, cfg.fail_rank, ctx.rank, start_step, cfg.fail_mode))
        hist = None
        # A one-channel image (Fashion-MNIST) gives the first conv weight a size-1 dimension, whose
        # stride the CPU backward may report differently from DDP's bucket view; the layout is the same
        # (a size-1 dimension's stride is never used) and the gradients are right, but DDP warns once.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
            if start_epoch < cfg.epochs:
                hist = fit(
                    net,
                    loader,
                    optimizer,
                    epochs=cfg.epochs,
                    start_epoch=start_epoch,
                    scheduler=scheduler,
                    grad_accum=cfg.grad_accum,
                    callbacks=callbacks,
                    channels_last=cfg.channels_last,
                    val_loader=val if cfg.evaluate else None,
                    progress=cfg.progress and ctx.is_main,
                    desc=f"ddp x{ctx.world_size}",
                )
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        if cfg.out and ("{rank}" in cfg.out or ctx.is_main):
            atomic_save(state, cfg.out.format(rank=ctx.rank))
        return {
            "rank": ctx.rank,
            "world_size": ctx.world_size,
            "backend": ctx.backend,
            "device": str(ctx.device),
            "start_epoch": start_epoch,
            "start_step": start_step,
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
            "history": hist.to_dict() if hist is not None else None,
            "state": state if cfg.return_state else None,
        }
    finally:
        # Free DDP (its Reducer holds the process group) while the group is still registered: a
        # Reducer freed after destroy_process_group can deadlock in ProcessGroupGloo's destructor.
        # On an exception, the traceback's finished frames (fit's) hold it too: clear them.
        net = None
        if sys.exc_info()[2] is not None:
            traceback.clear_frames(sys.exc_info()[2])
        gc.collect()
        parallel.teardown()


# From a shell a run should train to a useful accuracy: 10 epochs of the default digits subset
# reach about 0.99 validation accuracy (2 epochs: about 0.3). Notebooks pass their own epochs.
CLI_DEFAULTS = {"epochs": 10}
_MORE_HELP = {
    "momentum": "SGD momentum",
    "fail_rank": "the rank that --fail-at-step crashes",
    "return_state": "(notebook use) send the final state_dict back",
}


def _field_help() -> dict:
    """Each TrainConfig field's help: the comment after it in the source (one place for both)."""
    import inspect
    import re

    found = dict(re.findall(r"^\s+(\w+): [^#\n]*#\s*(.+)$", inspect.getsource(TrainConfig), re.M))
    return {**_MORE_HELP, **{k: v.strip() for k, v in found.items()}}


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    ap = argparse.ArgumentParser(
        prog="python -m utils.ddp_train",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    helps = _field_help()
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        default = CLI_DEFAULTS.get(f.name, f.default)
        if f.type in ("bool", bool):
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=helps.get(f.name))
        else:
            typ = {"int": int, "float": float, "str": str}.get(f.type, f.type)
            ap.add_argument(flag, type=typ, default=default, help=helps.get(f.name))
    args = ap.parse_args(argv)
    return make_config(return_state=False, **{k: v for k, v in vars(args).items() if k != "return_state"})


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    res = train(cfg)
    h = res["history"]
    if res["rank"] == 0:
        if h is not None:
            last = h["epochs"][-1]
            print(
                f"rank 0 of {res['world_size']} ({res['backend']}): {h['steps']} steps from "
                f"epoch {res['start_epoch']}, train loss {last['train_loss']:.4f}, "
                f"val acc {last['val_acc'] if last['val_acc'] is not None else float('nan'):.3f}",
                flush=True,
            )
        else:
            print(f"rank 0: nothing to do, the checkpoint already holds {res['start_epoch']} epochs", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
