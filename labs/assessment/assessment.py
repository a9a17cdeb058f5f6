"""The assessment's starting point: a SERIAL training script.

Your task (see README.md beside this file): make it train data-parallel under
``torchrun --standalone --nproc-per-node N`` and reach the target validation accuracy within
the time budget. Keep the command line, the model and the output format as they are:

    python assessment.py --data-dir DATA --out model.pt

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
from torch.utils.data import TensorDataset

import utils.data
import utils.models
import utils.train

# Hyperparameters, per dataset. Units in the comments.
HYP = {
    "digits": {
        "epochs": 2,            # passes over the training split: all one process can afford
        "batch_size": 32,       # images per optimizer step
        "lr": 0.02,             # SGD rate at this batch size
        "momentum": 0.9,
        "weight_decay": 5e-4,
    },
    "cifar10": {
        "epochs": 4,
        "batch_size": 128,
        "lr": 0.05,
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


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(0)                                  # same initial weights on every run
    train_set, info = load_train(Path(args.data_dir))
    hyp = HYP[info["dataset"]]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    shape = tuple(train_set.tensors[0].shape[1:])         # (C, H, W)
    model = utils.models.build(info["model"], shape, **info.get("model_kwargs", {})).to(device)
    loader = utils.data.make_loader(train_set, hyp["batch_size"], device=device, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=hyp["lr"], momentum=hyp["momentum"],
                                weight_decay=hyp["weight_decay"], nesterov=True)

    t0 = time.perf_counter()
    history = utils.train.fit(model, loader, optimizer, epochs=hyp["epochs"], device=device)
    print(f"trained {history.steps} steps in {time.perf_counter() - t0:.1f} s, "
          f"last train accuracy {history.last('train_acc'):.3f}")

    save(model.state_dict(), Path(args.out))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
