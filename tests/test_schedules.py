"""Scaling rules and per-iteration schedules against their formulas; the schedule inside fit;
and the phenomenon itself at the largest batch of the smoke sweep."""

import math

import pytest
import torch
from torch import nn

from utils import config, data
from utils.models import mlp
from utils.schedules import WarmupDecay, goyal_schedule, lr_for_batch
from utils.train import fit


def test_scaling_rules():
    # lr_for_batch(base_lr, base_batch, batch, rule, max_lr): the lab's argument order
    assert lr_for_batch(0.1, 256, 8192) == pytest.approx(3.2)  # Goyal et al.: 0.1 * k
    assert lr_for_batch(0.1, 256, 1024, "sqrt") == pytest.approx(0.2)
    assert lr_for_batch(0.1, 256, 1024, "none") == 0.1
    assert lr_for_batch(0.05, 16, 8, "linear") == pytest.approx(0.025)  # smaller batch: smaller rate
    assert lr_for_batch(0.01, 16, 64) == pytest.approx(0.04)
    assert lr_for_batch(0.01, 16, 64, "sqrt") == pytest.approx(0.02)
    assert lr_for_batch(0.01, 16, 1024, max_lr=0.1) == pytest.approx(0.1)  # capped
    with pytest.raises(ValueError, match="LR rule"):
        lr_for_batch(0.1, 256, 1024, "quadratic")
    with pytest.raises(ValueError, match="batch"):
        lr_for_batch(0.1, 256, 0)


def test_warmup_ramp_first_middle_last():
    s = WarmupDecay(start_lr=0.1, peak_lr=0.8, warmup_steps=10, total_steps=30)
    assert s.lr(0) == pytest.approx(0.1), "step 0 runs at the start (base) rate"
    assert s.lr(5) == pytest.approx(0.1 + 0.7 * 5 / 10), "the ramp is linear per iteration"
    assert s.lr(9) == pytest.approx(0.1 + 0.7 * 9 / 10)
    assert s.lr(10) == pytest.approx(0.8), "step warmup_steps reaches the peak"
    assert s.lr(29) == pytest.approx(0.8) and s.lr(100) == pytest.approx(0.8)
    steps = [s.lr(t + 1) - s.lr(t) for t in range(10)]
    assert max(steps) == pytest.approx(min(steps)) == pytest.approx(0.07), "a constant increment per step"


def test_no_warmup_starts_at_peak():
    s = WarmupDecay(0.1, 0.8, 0, 5, "cosine")
    assert s.lr(0) == pytest.approx(0.8)
    assert s.lr(5) == pytest.approx(0.0)


def test_cosine_decay():
    s = WarmupDecay(0.0, 1.0, 4, 14, "cosine", min_lr=0.1)
    assert s.lr(0) == 0.0 and s.lr(2) == pytest.approx(0.5)
    assert s.lr(4) == pytest.approx(1.0), "the decay starts at the peak"
    assert s.lr(9) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi * 0.5)) / 2)  # middle: 0.55
    assert s.lr(13) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi * 0.9)) / 2)  # last step of the run
    assert s.lr(14) == pytest.approx(0.1) and s.lr(50) == pytest.approx(0.1), "after total_steps: min_lr"


def test_poly_decay():
    s = WarmupDecay(0.2, 2.0, 5, 25, "poly", power=2.0)
    assert s.lr(0) == pytest.approx(0.2)
    assert s.lr(5) == pytest.approx(2.0)
    assert s.lr(15) == pytest.approx(2.0 * 0.5**2)
    assert s.lr(24) == pytest.approx(2.0 * (1 - 19 / 20) ** 2)
    assert s.lr(25) == 0.0


def test_step_decay():
    s = WarmupDecay(0.1, 1.0, 2, 20, "step", milestones=[10, 15], gamma=0.1)
    assert [s.lr(t) for t in (0, 1, 2, 9)] == pytest.approx([0.1, 0.55, 1.0, 1.0])
    assert s.lr(10) == pytest.approx(0.1) and s.lr(14) == pytest.approx(0.1)
    assert s.lr(15) == pytest.approx(0.01) and s.lr(19) == pytest.approx(0.01)


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(start_lr=0.1, peak_lr=0.0, warmup_steps=1, total_steps=2), "peak_lr"),
        (dict(start_lr=-0.1, peak_lr=1.0, warmup_steps=1, total_steps=2), "start_lr"),
        (dict(start_lr=0.1, peak_lr=1.0, warmup_steps=5, total_steps=2), "total_steps"),
        (dict(start_lr=0.1, peak_lr=1.0, warmup_steps=1.5, total_steps=2), "warmup_steps"),
        (dict(start_lr=0.1, peak_lr=1.0, warmup_steps=1, total_steps=2, decay="linear"), "decay"),
        (dict(start_lr=0.1, peak_lr=1.0, warmup_steps=1, total_steps=2, decay="step"), "milestones"),
    ],
)
def test_bad_arguments(kw, msg):
    with pytest.raises(ValueError, match=msg):
        WarmupDecay(**kw)


def test_goyal_schedule():
    s = goyal_schedule(0.1, 8192, 256, steps_per_epoch=100, epochs=90, warmup_epochs=5)
    assert s.start_lr == pytest.approx(0.1) and s.peak_lr == pytest.approx(3.2)
    assert s.warmup_steps == 500 and s.total_steps == 9000
    assert s.lr(250) == pytest.approx(0.1 + 3.1 * 0.5)


def test_fit_runs_each_step_at_the_formula_rate():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    data = [(torch.randn(8, 4), torch.randint(0, 2, (8,))) for _ in range(5)]
    sched = WarmupDecay(0.01, 0.1, 4, 10, "cosine")
    opt = torch.optim.SGD(model.parameters(), lr=123.0, momentum=0.9)  # overwritten with the peak
    hist = fit(model, data, opt, epochs=2, scheduler=sched.scheduler(opt), progress=False)
    assert hist.step_lr == pytest.approx(sched.rates(10)), "fit must see lr(t) at step t"


def _mlp(shape, width):
    """The sweep's model in notebooks/04_large_batch.ipynb: two BatchNorm hidden layers."""
    return mlp(width, 3, in_features=math.prod(shape), out_features=10, norm="batch", flatten=True)


def _sweep_run(cfg, splits, batch, rule, warmup_epochs, seed=0):
    """One run of the notebook's sweep: SGD with momentum, the rule's rate, warmup, cosine decay."""
    from utils.optim import lars_param_groups

    torch.manual_seed(seed)
    model = _mlp(splits.shape, cfg.lb_mlp_width)
    loader = data.make_loader(splits.train, batch, seed=seed)
    peak = lr_for_batch(cfg.lb_base_lr, cfg.lb_base_batch, batch, rule)
    sched = WarmupDecay(
        min(cfg.lb_base_lr, peak), peak, round(warmup_epochs * len(loader)), cfg.lb_epochs * len(loader), "cosine"
    )
    opt = torch.optim.SGD(lars_param_groups(model, cfg.lb_weight_decay), lr=peak, momentum=0.9)
    return fit(
        model,
        loader,
        opt,
        epochs=cfg.lb_epochs,
        scheduler=sched.scheduler(opt),
        val_loader=data.make_loader(splits.val, 512, shuffle=False),
        progress=False,
    )


def test_linear_scaling_with_warmup_beats_the_naive_rate_at_the_largest_batch():
    """The phenomenon, in the smoke profile: at the sweep's largest batch, the linearly scaled
    rate with gradual warmup ends with a higher validation accuracy than the base rate."""
    cfg = config.profile("smoke")
    splits = data.load(cfg.lb_dataset, cfg.n_train, cfg.n_val, seed=0)
    batch = max(cfg.lb_batch_sizes)
    naive = _sweep_run(cfg, splits, batch, "none", 0)
    warm = _sweep_run(cfg, splits, batch, "linear", cfg.lb_warmup_epochs)
    assert warm.val_acc > naive.val_acc, (
        f"at batch {batch}: linear scaling + warmup reached {warm.val_acc:.3f}, the naive rate "
        f"{naive.val_acc:.3f}; check the lb_* rows of utils/config.py and utils.schedules"
    )


# ---- self-checks of lab4


def _placeholder(*args, **kwargs):
    raise NotImplementedError("Exercise: write this part (see the hint above)")


def test_check_warmup_lr():
    from utils.checks import CheckFailed, check_warmup_lr

    check_warmup_lr(lambda t, base, peak, W: base + (peak - base) * t / W if t < W else peak)
    with pytest.raises(CheckFailed, match="not implemented"):
        check_warmup_lr(_placeholder)
    with pytest.raises(CheckFailed, match="off by one"):
        check_warmup_lr(lambda t, base, peak, W: base + (peak - base) * min(t + 1, W) / W)
    with pytest.raises(CheckFailed, match="not from 0"):
        check_warmup_lr(lambda t, base, peak, W: peak * min(t, W) / W)
