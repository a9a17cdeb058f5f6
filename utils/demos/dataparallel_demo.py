"""Notebook 03: who runs the forward pass under ``nn.DataParallel``. One process; with 2+ GPUs
one thread per GPU, each with a replica and a slice of the batch; on a CPU it just calls the module."""

from __future__ import annotations

import os
import threading

import torch
from torch import nn


class WhereAmI(nn.Module):
    """A linear layer that notes, for every forward call, the process, the thread (by name, which is
    unique; a finished thread's id can be reused), the device and the number of rows it got.
    DataParallel's replicas share the list ``calls``."""

    def __init__(self, calls: list[tuple[int, str, str, int]], features: int = 8):
        super().__init__()
        self.calls = calls
        self.linear = nn.Linear(features, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append((os.getpid(), threading.current_thread().name, str(x.device), x.shape[0]))
        return self.linear(x)


def run(batch: int = 16) -> dict[str, object]:
    """One forward of ``batch`` rows through ``nn.DataParallel`` on every visible GPU (none on a CPU)."""
    calls: list[tuple[int, str, str, int]] = []
    torch.manual_seed(0)
    model = WhereAmI(calls)
    x = torch.randn(batch, 8)
    expected = model(x).detach()  # the module alone
    calls.clear()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dp = nn.DataParallel(model.to(dev))
    y = dp(x.to(dev)).detach().cpu()
    return {
        "device_ids": list(dp.device_ids),
        "calls": calls,
        "max_diff": (y - expected).abs().max().item(),
        "pid": os.getpid(),
        "thread": threading.current_thread().name,
    }
