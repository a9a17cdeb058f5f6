"""utils/demos/gpt_ddp.py under torchrun on 2 ranks (gloo, CPU), against one process training the
same global batches in this test, and the bytes each rank holds against the closed form. The sizes
are tiny, and the context is odd, so FSDP2 splits the position table unevenly."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from utils import data, diagrams, gpt
from utils.parallel import torchrun

pytestmark = pytest.mark.slow  # two torchrun launches of 2 ranks each

ROOT = Path(__file__).resolve().parent.parent
ARCH = gpt.GPTConfig(context=7, width=8, layers=2, heads=2)
RUN = dict(steps=3, batch=4, lr=3e-3, corpus="stdlib", corpus_bytes=20_000, seed=0)


def _one_process() -> list[float]:
    """The oracle: the whole global batch in one process, plain AdamW."""
    splits = data.load_tokens(RUN["corpus"], RUN["corpus_bytes"])
    batches = data.TokenBatches(splits.train, RUN["batch"], ARCH.context, device="cpu", seed=RUN["seed"])
    model = gpt.GPT(ARCH, seed=RUN["seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=RUN["lr"], weight_decay=0.0)
    losses = []
    for _ in range(RUN["steps"]):
        x, y = next(batches)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    sizes = dict(context=ARCH.context, width=ARCH.width, layers=ARCH.layers, heads=ARCH.heads, **RUN)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in sizes.items()]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")  # gloo on the CPU, on any machine
    for strategy in ("ddp", "fsdp2"):
        path = tmp_path_factory.mktemp(strategy) / "run.json"
        args = ["--nproc-per-node=2", "-m", "utils.demos.gpt_ddp", f"--strategy={strategy}", *flags, f"--out={path}"]
        proc = torchrun(args, timeout=240, cwd=ROOT, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:]
        out[strategy] = json.loads(path.read_text())
    return out


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_train_as_one_process_does(runs, strategy):
    run = runs[strategy]
    assert (run["world_size"], run["backend"], run["device"]) == (2, "gloo", "cpu")
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(_one_process()))


def test_each_rank_holds_what_the_closed_form_says(runs):
    whole = 16 * gpt.parameter_count(ARCH)  # fp32 parameters, gradients, AdamW's two moments
    ddp = [sum(b.values()) for b in runs["ddp"]["rank_bytes"]]
    fsdp = [sum(b.values()) for b in runs["fsdp2"]["rank_bytes"]]
    assert ddp == [whole, whole]
    assert sum(fsdp) == whole
    # by hand: every first dimension is even but the position table's 7 rows: rank 0 gets 4 of
    # them, rank 1 3, so rank 0 holds one more row of 8 elements, 16 bytes each
    assert fsdp[0] - fsdp[1] == 16 * ARCH.width
    closed = diagrams.gpt_rank_bytes(ARCH, 2)
    assert fsdp == [sum(units.values()) for units in closed["fsdp2"]]
    assert ddp == [sum(units.values()) for units in closed["ddp"]]
    for b in runs["fsdp2"]["rank_bytes"]:  # parameters, gradients, moments: 4, 4 and 8 bytes per element held
        assert b["grads"] == b["params"] and b["optimizer"] == 2 * b["params"]
