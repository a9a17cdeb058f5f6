"""Oracle from outside the project: utils.schedules against PyTorch's own schedulers.

Goyal et al.'s recipe (linear scaling by k = batch / base_batch, then a gradual warmup from the
base rate to k times it) is, in PyTorch's vocabulary, ``LinearLR(start_factor=1/k)`` on an
optimizer whose rate is the scaled peak, followed by the decay (``StepLR``/``MultiStepLR``,
``CosineAnnealingLR``, ``PolynomialLR``) through ``SequentialLR`` at the end of the warmup.
Every step of a run must get the same rate from both, read from what ``fit`` actually used.
"""

import warnings

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as L

from utils.schedules import goyal_schedule
from utils.train import fit

STEPS_PER_EPOCH, EPOCHS, WARMUP_EPOCHS = 4, 6, 2  # 24 steps, the first 8 of them warmup
BASE_LR, BASE_BATCH, BATCH = 0.05, 32, 256  # k = 8: peak 0.4


def torch_schedule(opt, decay: str, k: float, warmup: int, total: int, milestones=(), gamma=0.1, power=2.0):
    """PyTorch's schedulers only: the warmup ramp, then the decay, chained by SequentialLR."""
    ramp = L.LinearLR(opt, start_factor=1.0 / k, end_factor=1.0, total_iters=warmup)
    after = {
        "constant": lambda: L.ConstantLR(opt, factor=1.0, total_iters=0),
        "step": lambda: L.MultiStepLR(opt, milestones=[m - warmup for m in milestones], gamma=gamma),
        "steplr": lambda: L.StepLR(opt, step_size=milestones[0] - warmup, gamma=gamma),
        "cosine": lambda: L.CosineAnnealingLR(opt, T_max=total - warmup, eta_min=0.0),
        "poly": lambda: L.PolynomialLR(opt, total_iters=total - warmup, power=power),
    }[decay]()
    return L.SequentialLR(opt, [ramp, after], milestones=[warmup])


def _run(scheduler_for):
    """The rates fit used, step by step, on a small model and a list of batches."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    batches = [(torch.randn(BATCH // 32, 3), torch.randint(0, 2, (BATCH // 32,))) for _ in range(STEPS_PER_EPOCH)]
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    sched = scheduler_for(opt)
    with warnings.catch_warnings():
        # SequentialLR steps its second scheduler with an explicit epoch at the milestone, which
        # some PyTorch versions flag as deprecated; the rates are what this test checks
        warnings.filterwarnings("ignore", message=".*epoch parameter.*", category=UserWarning)
        hist = fit(model, batches, opt, epochs=EPOCHS, scheduler=sched, progress=False)
    return hist.step_lr


@pytest.mark.parametrize(
    "decay,kw,torch_decay",
    [
        ("constant", {}, "constant"),
        ("cosine", {}, "cosine"),
        ("poly", {"power": 2.0}, "poly"),
        ("step", {"milestones": [12, 20], "gamma": 0.1}, "step"),
        ("step", {"milestones": [16], "gamma": 0.5}, "steplr"),
    ],
)
def test_warmup_and_linear_scaling_equal_torch_linearlr_then_decay(decay, kw, torch_decay):
    k = BATCH / BASE_BATCH
    ours = goyal_schedule(BASE_LR, BATCH, BASE_BATCH, STEPS_PER_EPOCH, EPOCHS, WARMUP_EPOCHS, decay, **kw)
    W, T = ours.warmup_steps, ours.total_steps
    assert (W, T) == (8, 24) and ours.peak_lr == pytest.approx(BASE_LR * k), "linear scaling: peak = k * base"

    def torch_sched(opt):
        for g in opt.param_groups:
            g["lr"] = BASE_LR * k  # the linearly scaled rate; LinearLR starts at 1/k of it
        return torch_schedule(
            opt,
            torch_decay,
            k,
            W,
            T,
            milestones=kw.get("milestones", ()),
            gamma=kw.get("gamma", 0.1),
            power=kw.get("power", 2.0),
        )

    want = _run(torch_sched)
    got = _run(ours.scheduler)
    assert len(want) == len(got) == T
    assert want[0] == pytest.approx(BASE_LR), "step 0 runs at the base (unscaled) rate"
    for t, (a, b) in enumerate(zip(got, want)):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-12), (
            f"step {t}: utils.schedules gives lr {a:.6g}, PyTorch's LinearLR + {torch_decay} gives {b:.6g}"
        )
    assert ours.rates() == pytest.approx(want, rel=1e-9, abs=1e-12), "WarmupDecay.rates() disagrees with the run"
