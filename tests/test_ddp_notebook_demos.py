"""Notebook 03's demos against outside oracles: the plain DDP script against the plain serial
script, Join's division against rank 0's own gradient, BatchNorm against one process on the
global batch, DataParallel on a CPU against the module alone."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from utils import models, parallel
from utils.demos import batchnorm_demo, dataparallel_demo, ddp_demo

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_plain_ddp_script_under_torchrun_matches_the_serial_script(tmp_path):
    serial = subprocess.run(
        [sys.executable, "-m", "utils.demos.plain_serial", "--epochs=2", f"--out={tmp_path / 's.pt'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert serial.returncode == 0, serial.stderr
    args = ["--standalone", "--nproc-per-node=2", "-m", "utils.demos.plain_ddp", "--epochs=2"]
    proc = parallel.torchrun([*args, f"--out={tmp_path / 'd.pt'}"], timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:]
    s = torch.load(tmp_path / "s.pt", weights_only=True)
    d = torch.load(tmp_path / "d.pt", weights_only=True)
    assert d["epoch"] == 1 and d["losses"][1] < d["losses"][0], "the DDP script trains"
    for k, v in s["model"].items():
        torch.testing.assert_close(d["model"][k], v, atol=1e-5, rtol=1e-4)
    assert proc.stdout.count("epoch 1: loss") == 1, "only rank 0 prints"


@pytest.mark.slow
def test_join_divides_by_the_initial_world_size_unless_told_otherwise():
    for divide, factor in ((True, 2.0), (False, 1.0)):
        res = parallel.launch(ddp_demo.join_worker, 2, divide, backend="gloo")
        assert [r["batches"] for r in res] == [3, 2]
        for g, own in zip(res[0]["ddp_grad"], res[0]["own_grad"]):
            torch.testing.assert_close(g, own / factor, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_batchnorm_synced_by_hand_is_the_global_batch_and_plain_ddp_is_ghost_bn():
    res = parallel.launch(batchnorm_demo.worker, 2, 4, backend="gloo")
    x = batchnorm_demo.global_batch(2, 4)
    whole = torch.nn.BatchNorm2d(3)(x).detach()
    ghost = models.GhostBatchNorm2d(3, 4)(x).detach()
    for r, out in enumerate(res):
        rows = slice(4 * r, 4 * r + 4)
        torch.testing.assert_close(out["by_hand"], whole[rows], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out["synced_mean"], x.mean((0, 2, 3)), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out["plain"], ghost[rows], atol=1e-5, rtol=1e-5)
        assert (out["plain"] - whole[rows]).abs().max() > 1e-2, "per-rank statistics are not the global ones"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path: DataParallel without GPUs")
def test_dataparallel_on_a_cpu_just_calls_the_module():
    out = dataparallel_demo.run(batch=6)
    assert out["device_ids"] == [] and out["max_diff"] == 0.0
    assert [(pid, tid, rows) for pid, tid, _, rows in out["calls"]] == [
        (out["pid"], threading.current_thread().name, 6)
    ]
