"""Learning-rate scaling rules and per-iteration schedules: gradual warmup, then decay.

Scaling rules (:func:`lr_for_batch`), for a rate ``base_lr`` tuned at batch ``base_batch`` and a
new batch ``batch`` (``k = batch / base_batch``):

* linear (Goyal et al. 2017):   ``lr = base_lr * k``
* square root (the variance argument): ``lr = base_lr * sqrt(k)``

:class:`WarmupDecay` is the rate at each optimizer step ``t`` (0 = the first step), counted per
iteration, never per epoch. With ``W = warmup_steps``, ``T = total_steps``, ``peak = peak_lr``,
``start = start_lr`` (default: ``base_lr`` of Goyal et al., the unscaled rate) and
``s = min(t - W, T - W) / (T - W)``, the fraction of the decay phase done::

    t <  W : lr = start + (peak - start) * t / W                  # gradual warmup, linear ramp
    t >= W : lr = peak                                            # decay="constant"
             lr = peak * gamma ** (number of milestones m <= t)   # decay="step"
             lr = min_lr + (peak - min_lr) * (1 + cos(pi * s)) / 2   # decay="cosine"
             lr = min_lr + (peak - min_lr) * (1 - s) ** power     # decay="poly"

So step 0 runs at ``start``, step ``W`` at ``peak`` (the ramp adds ``(peak - start) / W`` per
step), and from step ``T`` on the rate stays at its final value (``min_lr`` for cosine and
poly). Milestones of the step decay are absolute step numbers.

With the one training loop::

    sched = WarmupDecay(base_lr, peak_lr, warmup_steps, total_steps, decay="cosine")
    opt = torch.optim.SGD(params, lr=sched.peak_lr, momentum=0.9)
    fit(model, loader, opt, epochs=E, scheduler=sched.scheduler(opt))

``sched.scheduler(opt)`` is a ``torch.optim.lr_scheduler.LambdaLR`` whose multiplier is
``lr(t) / peak_lr``; ``fit`` steps it after every optimizer step, so step ``t`` runs at
``lr(t)``, exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

from torch.optim.lr_scheduler import LambdaLR

if TYPE_CHECKING:
    from torch.optim import Optimizer

DECAYS = ("constant", "step", "cosine", "poly")


def _positive(name, value, allow_zero=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    return value


RULES = ("linear", "sqrt", "none")


def lr_for_batch(
    base_lr: float, base_batch: int, batch: int, rule: str = "linear", max_lr: float | None = None
) -> float:
    """The learning rate for ``batch`` from ``base_lr`` tuned at ``base_batch``, with
    ``k = batch / base_batch``: ``rule`` "linear" (Goyal et al.: ``base_lr * k``), "sqrt"
    (``base_lr * sqrt(k)``) or "none" (``base_lr``); then capped at ``max_lr`` when given (past
    some rate training diverges whatever the batch)."""
    _positive("base_lr", base_lr)
    _positive("base_batch", base_batch)
    _positive("batch", batch)
    if rule == "linear":
        lr = base_lr * batch / base_batch
    elif rule == "sqrt":
        lr = base_lr * math.sqrt(batch / base_batch)
    elif rule == "none":
        lr = base_lr
    else:
        raise ValueError(f"unknown LR rule {rule!r}: the scaling rules are 'linear', 'sqrt' and 'none'")
    return min(lr, _positive("max_lr", max_lr)) if max_lr is not None else lr


class WarmupDecay:
    """Gradual warmup from ``start_lr`` to ``peak_lr`` over ``warmup_steps`` optimizer steps,
    then ``decay`` until ``total_steps`` (formulas in the module docstring).

    Args:
        start_lr: the rate of step 0 (Goyal et al.: the base, unscaled rate).
        peak_lr: the rate reached at step ``warmup_steps`` (the scaled rate).
        warmup_steps: length of the ramp in steps (0 = no warmup); e.g.
            ``warmup_epochs * len(loader)``.
        total_steps: steps of the whole run (>= warmup_steps).
        decay: "constant", "step", "cosine" or "poly".
        milestones, gamma: for "step": multiply by ``gamma`` at each milestone (absolute steps).
        power: for "poly" (2 in the LARS paper).
        min_lr: the final rate of "cosine" and "poly".
    """

    def __init__(
        self,
        start_lr: float,
        peak_lr: float,
        warmup_steps: int,
        total_steps: int,
        decay: str = "constant",
        *,
        milestones: Iterable[int] = (),
        gamma: float = 0.1,
        power: float = 2.0,
        min_lr: float = 0.0,
    ):
        _positive("start_lr", start_lr, allow_zero=True)
        _positive("peak_lr", peak_lr)
        _positive("min_lr", min_lr, allow_zero=True)
        _positive("gamma", gamma, allow_zero=True)
        _positive("power", power)
        for name, v in (("warmup_steps", warmup_steps), ("total_steps", total_steps)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(
                    f"{name} must be an int >= 0, got {v!r} (steps, not epochs: multiply epochs by len(loader))"
                )
        if total_steps < warmup_steps:
            raise ValueError(f"total_steps ({total_steps}) must be >= warmup_steps ({warmup_steps})")
        if decay not in DECAYS:
            raise ValueError(f"unknown decay {decay!r}; use one of {', '.join(DECAYS)}")
        milestones = sorted(int(m) for m in milestones)
        if decay == "step" and not milestones:
            raise ValueError("decay='step' needs milestones=[step, ...] (absolute optimizer steps)")
        self.start_lr, self.peak_lr, self.min_lr = float(start_lr), float(peak_lr), float(min_lr)
        self.warmup_steps, self.total_steps = warmup_steps, total_steps
        self.decay, self.milestones, self.gamma, self.power = decay, milestones, gamma, power

    def lr(self, t: int) -> float:
        """The rate of optimizer step ``t`` (0-based)."""
        if t < 0:
            raise ValueError(f"step must be >= 0, got {t}")
        W, T, peak = self.warmup_steps, self.total_steps, self.peak_lr
        if t < W:
            return self.start_lr + (peak - self.start_lr) * t / W
        if self.decay == "constant":
            return peak
        if self.decay == "step":
            return peak * self.gamma ** sum(1 for m in self.milestones if m <= t)
        s = min(t - W, T - W) / (T - W) if T > W else 1.0
        if self.decay == "cosine":
            return self.min_lr + (peak - self.min_lr) * (1 + math.cos(math.pi * s)) / 2
        return self.min_lr + (peak - self.min_lr) * (1 - s) ** self.power  # poly

    def __call__(self, t: int) -> float:
        """The LambdaLR multiplier: ``lr(t) / peak_lr``."""
        return self.lr(t) / self.peak_lr

    def rates(self, steps: int | None = None) -> list[float]:
        """``[lr(0), ..., lr(steps - 1)]`` (default: ``total_steps`` of them)."""
        return [self.lr(t) for t in range(self.total_steps if steps is None else steps)]

    def scheduler(self, optimizer: Optimizer) -> LambdaLR:
        """A ``LambdaLR`` on ``optimizer`` that gives step ``t`` the rate ``lr(t)``: every
        group's rate is set to ``peak_lr`` first (LambdaLR multiplies it by ``self(t)``)."""
        for group in optimizer.param_groups:
            group["lr"] = self.peak_lr
            group.pop("initial_lr", None)  # left by an earlier scheduler
        return LambdaLR(optimizer, self)

    def __repr__(self):
        return (
            f"WarmupDecay(start_lr={self.start_lr:g}, peak_lr={self.peak_lr:g}, "
            f"warmup_steps={self.warmup_steps}, total_steps={self.total_steps}, decay={self.decay!r})"
        )


def goyal_schedule(
    base_lr: float,
    batch: int,
    base_batch: int,
    steps_per_epoch: int,
    epochs: int,
    warmup_epochs: float,
    decay: str = "constant",
    rule: str = "linear",
    **kw,
) -> WarmupDecay:
    """Goyal et al.'s recipe: scale ``base_lr`` by ``rule`` for ``batch``, ramp linearly from
    ``base_lr`` to it over ``warmup_epochs`` (per iteration), then ``decay``."""
    if steps_per_epoch < 1 or epochs < 1:
        raise ValueError(f"steps_per_epoch and epochs must be >= 1, got {steps_per_epoch} and {epochs}")
    peak = lr_for_batch(base_lr, base_batch, batch, rule)
    warmup = round(_positive("warmup_epochs", warmup_epochs, allow_zero=True) * steps_per_epoch)
    total = steps_per_epoch * epochs
    return WarmupDecay(base_lr, peak, min(warmup, total), total, decay, **kw)


__all__ = ["lr_for_batch", "RULES", "WarmupDecay", "goyal_schedule", "DECAYS"]
