"""What batch size does to the lecture CNN (stage 1): batch-size sweeps and the critical batch.

The sweeps train :func:`utils.models.net_for` with :func:`utils.train.fit` and SGD with momentum:
a fixed epoch budget at every batch size, the rate from the caller (:func:`sweep_fixed_epochs`);
steps to a target accuracy (:func:`steps_to_target`, with ``eval_every`` and
:class:`utils.train.StopAtAccuracy`) with the rate tuned at every batch size on a grid, as Shallue
et al. (2018) do (:func:`tune_steps_to_target`, :func:`search_rate`, :func:`pick_rate`), to whose
tuned points (:func:`tuned_rows`) :func:`fit_critical_batch` fits McCandlish et al.'s
S(B) = S_min (1 + B_crit / B); and the gradient noise scale B_simple at several points of one run
(:func:`noise_scale_along_run`). Each has its plot.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import matplotlib.pyplot as plt
import numpy as np
import torch

from . import data as _data
from . import gradient_noise as _noise
from . import models as _models
from . import plots as _plots
from . import train as _train
from .device import get_device

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def _cnn_run(splits, batch_size, lr, *, momentum, width, seed, device, desc, keep_steps=(), callbacks=(), **fit_kw):
    """One SGD run of the lecture CNN; ``keep_steps``: the optimizer steps after which a copy of the
    model is kept (0: the initial weights). Returns (model, history, {step: copy})."""
    torch.manual_seed(seed)
    model = _models.net_for(splits.shape, width).to(device)
    keep = _Snapshots(model, keep_steps)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    train_loader = _data.make_loader(splits.train, batch_size, device=device, seed=seed)
    val_loader = _data.make_loader(splits.val, 1024, shuffle=False, device=device)
    hist = _train.fit(
        model,
        train_loader,
        opt,
        val_loader=val_loader,
        device=device,
        desc=desc,
        callbacks=[*callbacks, keep],
        **fit_kw,
    )
    return model, hist, keep.models


class _Snapshots(_train.Callback):
    """Copies of the model after the given optimizer steps (step 0: before training)."""

    def __init__(self, model: torch.nn.Module, steps: Iterable[int]):
        self.steps = set(steps)
        self.models = {0: copy.deepcopy(model)} if 0 in self.steps else {}

    def on_step_end(self, state) -> None:
        if state.step in self.steps:
            self.models[state.step] = copy.deepcopy(state.model)


def sweep_fixed_epochs(
    splits: _data.Splits,
    batch_sizes: Iterable[int],
    lr_fn: Callable[[int], float],
    *,
    epochs: int,
    momentum: float = 0.9,
    width: int = 32,
    seed: int = 0,
    device: torch.device | str | None = None,
    progress: bool = True,
) -> list[dict]:
    """Train the lecture CNN once per batch size for the same number of epochs (the same number
    of images). Per batch size: steps, lr, time per epoch (median, s), images/s (training only)
    and the final validation accuracy."""
    device = device or get_device()
    rows = []
    for B in batch_sizes:
        lr = lr_fn(B)
        _, h, _ = _cnn_run(
            splits,
            B,
            lr,
            momentum=momentum,
            width=width,
            seed=seed,
            device=device,
            epochs=epochs,
            progress=progress,
            desc=f"B={B}",
        )
        rows.append(
            {
                "batch_size": B,
                "lr": lr,
                "steps": h.steps,
                "time_per_epoch_s": float(np.median([e["time_s"] for e in h.epochs])),
                "images_per_s": h.images_per_s,
                "val_acc": h.val_acc,
            }
        )
    return rows


def images_per_s_in_turns(
    splits: _data.Splits,
    batch_sizes: Sequence[int],
    lr_fn: Callable[[int], float],
    *,
    rounds: int,
    images: int,
    momentum: float = 0.9,
    width: int = 32,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> dict[int, list[float]]:
    """``fit``'s training images/s of the lecture CNN at each batch size, measured in turns, as benchmarks/ does:
    every round trains each batch size on about ``images`` images (at least 2 steps), the order reversing each
    round, so a busy spell of the machine slows all of them alike; a ratio of two batch sizes' figures of the same
    round cancels it. One untimed round first (allocation, first calls). Per batch size, one figure per round."""
    if rounds < 1 or images < 1:
        raise ValueError(f"need rounds >= 1 and images >= 1, got {rounds} and {images}")
    device = device or get_device()
    runs = {}
    for B in batch_sizes:
        torch.manual_seed(seed)
        model = _models.net_for(splits.shape, width).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=lr_fn(B), momentum=momentum)
        runs[B] = (model, _data.make_loader(splits.train, B, device=device, seed=seed), opt)
    rates = {B: [] for B in batch_sizes}
    for r in range(rounds + 1):
        for B in list(batch_sizes)[:: 1 if r % 2 else -1]:
            hist = _train.fit(*runs[B], steps=max(2, images // B), device=device, progress=False)
            if r > 0:
                rates[B].append(hist.images_per_s)
    return rates


def steps_to_target(
    splits: _data.Splits,
    batch_size: int,
    lr: float,
    *,
    target_acc: float,
    max_steps: int,
    eval_images: int = 32,
    momentum: float = 0.9,
    width: int = 32,
    seed: int = 0,
    device: torch.device | str | None = None,
    progress: bool = False,
) -> dict:
    """Train the lecture CNN at one batch size and rate until the validation accuracy first reaches
    ``target_acc``, or for ``max_steps`` steps. Evaluation every ``max(1, eval_images // B)`` steps,
    so a small batch is evaluated about every ``eval_images`` training images and a big one every step.

    Returns {batch_size, lr, steps_to_target (None if not reached), eval_every, images}."""
    device = device or get_device()
    every = max(1, eval_images // batch_size)
    _, h, _ = _cnn_run(
        splits,
        batch_size,
        lr,
        momentum=momentum,
        width=width,
        seed=seed,
        device=device,
        desc=f"B={batch_size} lr={lr:g}",
        callbacks=[_train.StopAtAccuracy(target_acc)],
        steps=max_steps,
        eval_every=every,
        progress=progress,
    )
    s = h.steps_to(target_acc)
    return {
        "batch_size": batch_size,
        "lr": lr,
        "steps_to_target": s,
        "eval_every": every,
        "images": None if s is None else s * batch_size,
    }


def search_rate(
    steps_at: Callable[[float, int], int | None], grid: Sequence[float], start: float, max_steps: int
) -> list[dict]:
    """Walk a grid of learning rates (sorted, e.g. a factor of 2 apart) to the one that reaches
    the target in the fewest steps, as Shallue et al. tune the rate at every batch size.

    ``steps_at(lr, limit)`` trains at ``lr`` for at most ``limit`` steps and returns the steps it
    took to reach the target, or None. The walk tries the grid rate nearest ``start``, then the
    next rate up for as long as each beats the best so far, and, when the first step up did not,
    the rates down the same way: at least three rates unless the best is at an end of the grid.
    Every trial after the first is limited to the best steps so far: a rate that cannot beat the
    best stops there, so a trial costs at most the best run's steps.

    Returns the trials in the order run: [{"lr", "steps" (None: not reached within "limit"), "limit"}]."""
    grid = sorted(grid)
    if not grid:
        raise ValueError("search_rate: the grid of rates is empty. Try: give at least one rate.")
    trials: list[dict] = []

    def best_steps() -> int | None:
        done = [t["steps"] for t in trials if t["steps"] is not None]
        return min(done) if done else None

    def improves(i: int) -> bool:
        before = best_steps()
        limit = max_steps if before is None else before
        s = steps_at(grid[i], limit)
        trials.append({"lr": grid[i], "steps": s, "limit": limit})
        return s is not None and (before is None or s < before)

    i = min(range(len(grid)), key=lambda k: abs(math.log(grid[k] / start)))
    improves(i)
    j = i
    while j + 1 < len(grid) and improves(j + 1):
        j += 1
    if j == i:
        while j - 1 >= 0 and improves(j - 1):
            j -= 1
    return trials


def pick_rate(trials: Sequence[dict], grid: Sequence[float]) -> dict:
    """The trial that reached the target in the fewest steps (ties: the one tried first), and how
    sure that pick is: {"lr" (None when no rate reached the target), "steps", "ties" (other rates
    that reached it in as few steps), "bracketed" (the grid rates on both sides of the pick were
    tried and did no better; False at an end of the grid)}."""
    reached = [t for t in trials if t["steps"] is not None]
    if not reached:
        return {"lr": None, "steps": None, "ties": [], "bracketed": False}
    best = min(reached, key=lambda t: t["steps"])  # min keeps the first of equal steps
    ties = [t["lr"] for t in reached if t["steps"] == best["steps"] and t is not best]
    grid = sorted(grid)
    k = grid.index(best["lr"])
    tried = {t["lr"] for t in trials}
    bracketed = 0 < k < len(grid) - 1 and grid[k - 1] in tried and grid[k + 1] in tried
    return {"lr": best["lr"], "steps": best["steps"], "ties": ties, "bracketed": bracketed}


def tune_steps_to_target(
    splits: _data.Splits,
    batch_sizes: Iterable[int],
    lr_grid: Sequence[float],
    start_lr: float,
    *,
    target_acc: float,
    max_steps: int,
    eval_images: int = 32,
    momentum: float = 0.9,
    width: int = 32,
    seed: int = 0,
    device: torch.device | str | None = None,
    progress: bool = True,
) -> list[dict]:
    """Steps to ``target_acc`` at each batch size with its learning rate tuned on ``lr_grid``
    (:func:`search_rate`, :func:`pick_rate`). The smallest batch starts its walk at ``start_lr``,
    each next batch at the rate the previous one picked: a rate that trained a smaller batch trains
    a bigger one too, so the first trial is not wasted, and the walk goes down where that rate was
    already too high.

    Returns one row per batch size: {batch_size, lr (the pick; None if no rate reached the target),
    steps_to_target, eval_every, images, ties, bracketed, trials (every rate tried, see
    :func:`search_rate`)}. Every run starts from the same initial weights and data order (``seed``)."""
    device = device or get_device()
    rows, start = [], start_lr
    for B in sorted(batch_sizes):

        def steps_at(lr: float, limit: int, B: int = B) -> int | None:
            return steps_to_target(
                splits,
                B,
                lr,
                target_acc=target_acc,
                max_steps=limit,
                eval_images=eval_images,
                momentum=momentum,
                width=width,
                seed=seed,
                device=device,
                progress=progress,
            )["steps_to_target"]

        trials = search_rate(steps_at, lr_grid, start, max_steps)
        pick = pick_rate(trials, lr_grid)
        s = pick["steps"]
        rows.append(
            {
                "batch_size": B,
                "lr": pick["lr"],
                "steps_to_target": s,
                "eval_every": max(1, eval_images // B),
                "images": None if s is None else s * B,
                "ties": pick["ties"],
                "bracketed": pick["bracketed"],
                "trials": trials,
            }
        )
        start = pick["lr"] or start
    return rows


def tuned_rows(rows: Iterable[dict]) -> list[dict]:
    """The rows whose rate is tuned: a rate reached the target and the grid rates on both sides of
    it did no better. The critical-batch fit uses only these."""
    return [r for r in rows if r["steps_to_target"] is not None and r["bracketed"]]


def noise_scale_along_run(
    splits: _data.Splits,
    batch_size: int,
    lr: float,
    steps: Sequence[int],
    *,
    b_small: int,
    b_big: int,
    draws: int,
    momentum: float = 0.9,
    width: int = 32,
    seed: int = 0,
    device: torch.device | str | None = None,
    progress: bool = False,
) -> list[dict]:
    """B_simple (McCandlish et al.'s two-batch estimator) at several points of one run: the lecture
    CNN trained at ``batch_size`` and ``lr`` (the same seed as :func:`tune_steps_to_target`'s runs,
    so the same run) for ``max(steps)`` steps, a copy kept after each of ``steps`` (0: the
    initial weights), each measured on the training set.

    Returns [{"step", "b_simple", "G2", "tr_sigma", "log_se" (bootstrap standard error of
    log B_simple)}], in step order."""
    device = device or get_device()
    steps = sorted(set(int(s) for s in steps))
    _, _, kept = _cnn_run(
        splits,
        batch_size,
        lr,
        momentum=momentum,
        width=width,
        seed=seed,
        device=device,
        desc=f"B={batch_size} lr={lr:g}",
        keep_steps=steps,
        steps=max(max(steps), 1),
        progress=progress,
    )
    out = []
    for s in steps:
        small, big = _noise.grad_sq_norms(kept[s], splits.train, b_small, b_big, draws, seed=seed, device=device)
        ns = _noise.noise_scale(small, big, b_small, b_big)
        se = _noise.bootstrap_log_se(small, big, b_small, b_big)
        out.append({"step": s, "b_simple": ns.b_simple, "G2": ns.G2, "tr_sigma": ns.tr_sigma, "log_se": se})
    return out


def fit_critical_batch(batch_sizes: Sequence[float], steps: Sequence[float]) -> tuple[float, float]:
    """Fit McCandlish et al.'s S(B) = S_min (1 + B_crit / B) to measured steps-to-target (least
    squares on relative error, linear in (S_min, S_min B_crit)). Returns (S_min, B_crit)."""
    B = np.asarray(batch_sizes, dtype=float)
    S = np.asarray(steps, dtype=float)
    if len(B) < 2:
        raise ValueError(
            f"fit_critical_batch: {len(B)} batch size(s) reached the target with a tuned rate, and the fit needs "
            "two. Try: raise sgd_max_steps or widen sgd_lr_grid (utils/config.py), or lower sgd_target_acc."
        )
    A = np.stack([np.ones_like(B), 1.0 / B], 1) / S[:, None]
    (s_min, k), *_ = np.linalg.lstsq(A, np.ones_like(S), rcond=None)
    if s_min <= 0:  # no floor visible: every B was still in perfect scaling
        return float("nan"), float("inf")
    return float(s_min), float(max(k, 0.0) / s_min)


def plot_steps_to_target(
    rows: list[dict],
    b_simple: float | None = None,
    ax: Axes | None = None,
    regime_factor: float = 4.0,
    title: str = "Steps to target accuracy vs batch size",
) -> tuple[Figure, dict[str, float]]:
    """Log-log steps-to-target with the perfect-scaling line from the smallest batch, the fitted
    S_min (1 + B_crit/B), the three regimes shaded and B_simple marked.

    The fit uses the tuned rows only (:func:`tuned_rows`); a row whose best rate sits at an end of
    the grid is drawn hollow and left out of the fit. The regime boundaries B_crit/regime_factor and
    B_crit*regime_factor (4 by default) are this course's convention for drawing McCandlish et al.'s
    curve, not lines Shallue et al. draw. Returns (figure, {"s_min", "b_crit"})."""
    if ax is None:
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
    done = [r for r in rows if r["steps_to_target"] is not None]
    B = np.array([r["batch_size"] for r in done], dtype=float)
    S = np.array([r["steps_to_target"] for r in done], dtype=float)
    tuned = np.array([r.get("bracketed", True) for r in done], dtype=bool)
    s_min, b_crit = fit_critical_batch(B[tuned], S[tuned])
    lo, hi = B.min() / 2, B.max() * 2
    grid = np.geomspace(lo, hi, 200)
    if math.isfinite(b_crit) and b_crit > 0:
        a, c = b_crit / regime_factor, b_crit * regime_factor
        f = f"{regime_factor:g}"
        ax.axvspan(lo, max(lo, a), color="tab:green", alpha=0.08, label=f"perfect scaling (B < B_crit/{f})")
        ax.axvspan(max(lo, a), min(hi, c), color="tab:orange", alpha=0.08, label="diminishing returns")
        ax.axvspan(min(hi, c), hi, color="tab:red", alpha=0.08, label=f"no further gain (B > {f} B_crit)")
        ax.loglog(
            grid,
            s_min * (1 + b_crit / grid),
            "-",
            color="gray",
            label=f"fit $S_{{min}}(1+B_{{crit}}/B)$, $B_{{crit}}$={b_crit:.0f}",
        )
    ax.loglog(grid, S[0] * B[0] / grid, "k:", label="perfect scaling (steps ∝ 1/B)")
    ax.loglog(B[tuned], S[tuned], "o", color="tab:blue", ms=7, label="measured, rate tuned")
    if (~tuned).any():
        ax.loglog(
            B[~tuned], S[~tuned], "o", mfc="none", mec="tab:blue", mew=2, ms=9, label="best rate at the grid's end"
        )
    for r in rows:
        if r["steps_to_target"] is None:
            ax.annotate("not reached", (r["batch_size"], S.max()), fontsize=7, ha="center")
    if b_simple is not None and math.isfinite(b_simple) and b_simple > 0:
        ax.axvline(b_simple, color="tab:purple", ls="--", label=f"noise scale $B_{{simple}}$={b_simple:.0f}")
    ax.set_xlim(lo, hi)
    ax.set_ylim(S.min() / 3, S.max() * 3)
    ax.set(title=title, xlabel="batch size B (images)", ylabel="optimizer steps to target")
    _plots.plain_ticks(ax, "x", B)
    _plots.plain_ticks(ax, "y")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper right")
    return ax.figure, {"s_min": s_min, "b_crit": b_crit}


def plot_tuned_rates(
    rows: list[dict],
    linear: Callable[[int], float] | None = None,
    ax: Axes | None = None,
    title: str = "The learning rate tuned at each batch size",
) -> Figure:
    """Every rate tried at each batch size (gray: reached the target, x: did not within its step
    limit), the pick of each (blue), and, with ``linear``, the linear scaling rule's rate for
    comparison."""
    if ax is None:
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for r in rows:
        for t in r["trials"]:
            ax.plot(r["batch_size"], t["lr"], "o" if t["steps"] is not None else "x", color="gray", ms=5)
    picked = [r for r in rows if r["lr"] is not None]
    B = [r["batch_size"] for r in rows]
    ax.plot([r["batch_size"] for r in picked], [r["lr"] for r in picked], "o-", color="tab:blue", ms=8, label="tuned")
    ax.plot([], [], "o", color="gray", ms=5, label="tried: reached the target")
    ax.plot([], [], "x", color="gray", ms=5, label="tried: slower than the best, or never")
    if linear is not None:
        ax.plot(B, [linear(b) for b in B], "k:", label="linear scaling rule")
    ax.set(
        xscale="log", yscale="log", title=title, xlabel="batch size B (images)", ylabel="learning rate (SGD, momentum)"
    )
    _plots.plain_ticks(ax, "x", B)
    _plots.plain_ticks(ax, "y")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left")
    return ax.figure


def plot_noise_scale_along_run(
    points: list[dict],
    ax: Axes | None = None,
    title: str = "Gradient noise scale during training",
    label: str = "",
) -> Figure:
    """B_simple against the optimizer step (:func:`noise_scale_along_run`), with error bars of one
    bootstrap standard error (on the log scale, drawn as the factor exp(±se)). A point whose estimate
    is not a positive number (|G|^2 estimated at or below 0) is left out."""
    if ax is None:
        fig, ax = plt.subplots(figsize=(6.4, 4))
    shown = [p for p in points if math.isfinite(p["b_simple"]) and p["b_simple"] > 0]  # a log axis
    x = np.array([p["step"] for p in shown], dtype=float)
    y = np.array([p["b_simple"] for p in shown], dtype=float)
    se = np.array([p["log_se"] if math.isfinite(p["log_se"]) else 0.0 for p in shown])
    ax.errorbar(x, y, yerr=[y - y * np.exp(-se), y * np.exp(se) - y], fmt="o-", capsize=3, label=label or None)
    ax.set(yscale="log", title=title, xlabel="optimizer step", ylabel="$B_{simple}$ = tr(Σ)/|G|² (images)")
    ax.set_xticks(x)
    _plots.plain_ticks(ax, "y")
    ax.grid(alpha=0.3, which="both")
    if label:
        ax.legend(fontsize=8)
    return ax.figure


def plot_fixed_epoch_sweep(rows: list[dict], title: str = "Fixed epoch budget: what batch size buys") -> Figure:
    B = [r["batch_size"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(B, [r["time_per_epoch_s"] for r in rows], "o-")
    axes[0].set(title="Time per epoch", xlabel="batch size (images)", ylabel="seconds per epoch")
    axes[1].plot(B, [r["images_per_s"] for r in rows], "o-")
    axes[1].set(title="Training throughput", xlabel="batch size (images)", ylabel="images/s")
    axes[2].plot(B, [100 * r["val_acc"] for r in rows], "o-")
    axes[2].set(title="Validation accuracy after the budget", xlabel="batch size (images)", ylabel="accuracy (%)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3, which="both")
    for ax in axes[:2]:
        ax.set_yscale("log")  # throughput spans orders of magnitude on a GPU
        _plots.plain_ticks(ax, "y")
    for ax in axes:
        _plots.plain_ticks(ax, "x", B)
    fig.suptitle(title)
    fig.tight_layout()
    return fig
