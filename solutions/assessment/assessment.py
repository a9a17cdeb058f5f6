"""The assessment's REFERENCE SOLUTION: the serial script made data-parallel.

    torchrun --standalone --nproc-per-node N assessment.py --data-dir DATA --out model.pt

The diff from labs/assessment/assessment.py: join the process group (torchrun's environment),
shard the data by rank, wrap the model in DistributedDataParallel, scale the learning rate with
the global batch (linear rule) behind a gradual warmup, spend the time saved on more epochs,
and save once, from rank 0. It still runs as one process without torchrun.

DATA holds what the grader gives you: ``train.npz`` (arrays ``x``: float32 images (N, C, H, W),
already normalised, and ``y``: int64 labels) and ``assessment.json`` (dataset, model, target,
budget, nprocs). There is no validation data: the grader keeps it. The script must write the
model's ``state_dict()`` (plain tensors, loadable with ``torch.load(weights_only=True)``) to
``--out``; anything it prints is for you, the grader ignores it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

import utils.data
import utils.models
import utils.train

# Hyperparameters, per dataset. Units in the comments.
HYP = {
    "digits": {
        "epochs": 10,  # passes over the training split (the serial script's 2, raised: N ranks make each pass N x faster)
        "batch_size": 32,  # images per optimizer step PER RANK (global: 32 x world size)
        "lr": 0.02,  # SGD rate at batch 32; multiplied by the world size (linear rule)
        "warmup_epochs": 1,  # linear ramp from the base rate to the scaled one
        "momentum": 0.9,
        "weight_decay": 5e-4,
    },
    "cifar10": {
        "epochs": 8,
        "batch_size": 128,
        "lr": 0.05,
        "warmup_epochs": 1,
        "momentum": 0.9,
        "weight_decay": 5e-4,
    },
}
HYP["fashion_mnist"] = HYP["cifar10"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True, help="folder with train.npz and assessment.json")
    p.add_argument("--out", default="model.pt", help="where to write the trained state dict")
    return p.parse_args(argv)


def load_train(data_dir: Path):
    """The training split the grader gave us, and the assessment's description."""
    info = json.loads((data_dir / "assessment.json").read_text())
    with np.load(data_dir / "train.npz") as f:
        x, y = torch.from_numpy(f["x"]), torch.from_numpy(f["y"])
    return TensorDataset(x, y), info


def save(state_dict, path: Path):
    """Write atomically: a crash mid-write never leaves a truncated model.pt."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state_dict, tmp)
    os.replace(tmp, path)


def setup():
    """(rank, world size, device): from torchrun's environment, or a single process without it."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    local_rank = int(os.environ["LOCAL_RANK"])
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if torch.cuda.is_available() and torch.cuda.device_count() >= per_node:
        device = torch.device("cuda", local_rank)  # one GPU per process
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:  # CPU, or fewer GPUs than processes
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def warmup_then_constant(optimizer, warmup_steps: int, scale: float):
    """LR multiplier: 1 -> ``scale`` linearly over ``warmup_steps`` optimizer steps, then ``scale``
    (Goyal et al. 2017, gradual warmup). Stepped once per optimizer step by fit."""

    def factor(step):
        if step >= warmup_steps:
            return scale
        return 1.0 + (scale - 1.0) * step / warmup_steps

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def main(argv=None):
    args = parse_args(argv)
    rank, world_size, device = setup()
    torch.manual_seed(0)  # same initial weights on every rank
    train_set, info = load_train(Path(args.data_dir))
    hyp = HYP[info["dataset"]]

    shape = tuple(train_set.tensors[0].shape[1:])  # (C, H, W)
    model = utils.models.build(info["model"], shape, **info.get("model_kwargs", {})).to(device)
    if world_size > 1:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    # Each rank reads its own 1/world_size of every epoch (DistributedSampler's sharding; fit
    # calls set_epoch, so the shuffle changes every epoch).
    loader = utils.data.make_loader(
        train_set, hyp["batch_size"], device=device, seed=0, rank=rank, world_size=world_size, drop_last=True
    )
    optimizer = torch.optim.SGD(
        model.parameters(), lr=hyp["lr"], momentum=hyp["momentum"], weight_decay=hyp["weight_decay"], nesterov=True
    )
    scheduler = warmup_then_constant(optimizer, hyp["warmup_epochs"] * len(loader), scale=world_size)

    t0 = time.perf_counter()
    history = utils.train.fit(
        model, loader, optimizer, epochs=hyp["epochs"], scheduler=scheduler, device=device, progress=rank == 0
    )
    if rank == 0:
        print(
            f"trained {history.steps} steps x {world_size} ranks in {time.perf_counter() - t0:.1f} s, "
            f"last train accuracy {history.last('train_acc'):.3f} (rank 0's shard)"
        )
        save(getattr(model, "module", model).state_dict(), Path(args.out))  # once, unwrapped
        print(f"saved {args.out}")
    if world_size > 1:
        dist.barrier()  # nobody exits before the file is written
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
