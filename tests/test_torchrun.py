"""The training worker under torchrun, as separate programs: two nodes on one machine, and a
crashed rank recovered by ``--max-restarts`` from the checkpoint. CPU and gloo only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from utils.parallel import free_port, torchrun

pytestmark = pytest.mark.slow  # torchrun agents and their ranks, a restart after a killed rank

ROOT = Path(__file__).resolve().parent.parent
ARGS = [
    "-m",
    "utils.ddp_train",
    "--n-train",
    "256",
    "--n-val",
    "64",
    "--width",
    "8",
    "--epochs",
    "2",
    "--batch-size",
    "32",
]  # 4 steps per epoch per rank with 2 ranks


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LAB_DIST_BACKEND"):
        env.pop(k, None)
    return env


def _torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", *args]


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """Two torchrun launches (one per 'node'), meeting at a c10d rendezvous on 127.0.0.1."""
    out = tmp_path_factory.mktemp("two_nodes")
    port = free_port()
    procs = [
        subprocess.Popen(
            _torchrun(
                "--nnodes=2",
                f"--node-rank={r}",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=two-nodes-test",
                *ARGS,
                "--out",
                str(out / "final_{rank}.pt"),
            ),
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=150)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"node {r} failed (exit {p.returncode}):\n{log[-3000:]}"
    return [torch.load(out / f"final_{r}.pt", weights_only=True) for r in range(2)]


def test_two_nodes_end_with_identical_weights(two_nodes):
    a, b = two_nodes
    assert _same(a, b), "the two nodes' ranks ended with different weights: DDP must keep replicas identical"


def test_max_restarts_recovers_a_killed_rank_exactly(two_nodes, tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    p = torchrun(
        [
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=1",
            "--monitor-interval=0.2",
            *ARGS,
            "--ckpt",
            ckpt,
            "--fail-at-step",
            "6",
            "--fail-rank",
            "1",
            "--out",
            tmp_path / "final_{rank}.pt",
        ],
        cwd=ROOT,
        env=_env(),
        timeout=150,
    )
    log = p.stdout
    assert p.returncode == 0, f"torchrun did not recover from the injected failure:\n{log[-3000:]}"
    assert "injected failure at step 6" in log, "the failure was not injected: check FailAt in utils/ddp_train.py"
    assert "resumed from" in log and "epoch 1, step 4" in log, (
        f"the restarted ranks did not resume from the end-of-epoch-1 checkpoint:\n{log[-2000:]}"
    )
    final = [torch.load(tmp_path / f"final_{r}.pt", weights_only=True) for r in range(2)]
    assert _same(final[0], final[1]), "after the restart the ranks disagree"
    assert _same(final[0], two_nodes[0]), (
        "the recovered run must end with exactly the weights of the uninterrupted run (same world size)"
    )
