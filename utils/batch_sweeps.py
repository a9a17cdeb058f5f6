"""What batch size does to the lecture CNN (stage 1): batch-size sweeps and the critical batch.

The sweeps train :func:`utils.models.net_for` with :func:`utils.train.fit`: a fixed epoch budget
at every batch size (:func:`sweep_fixed_epochs`), and steps to a target accuracy (with
``eval_every`` and :class:`utils.train.StopAtAccuracy`, :func:`sweep_steps_to_target`), to which
:func:`fit_critical_batch` fits McCandlish et al.'s S(B) = S_min (1 + B_crit / B). The rate for
each batch comes from the caller (e.g. :func:`utils.schedules.lr_for_batch`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import matplotlib.pyplot as plt
import numpy as np
import torch

from . import data as _data
from . import models as _models
from . import plots as _plots
from . import train as _train
from .device import get_device

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def _cnn_run(splits, batch_size, lr, *, momentum, width, seed, device, desc, **fit_kw):
    torch.manual_seed(seed)
    model = _models.net_for(splits.shape, width).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    train_loader = _data.make_loader(splits.train, batch_size, device=device, seed=seed)
    val_loader = _data.make_loader(splits.val, 1024, shuffle=False, device=device)
    hist = _train.fit(model, train_loader, opt, val_loader=val_loader, device=device, desc=desc, **fit_kw)
    return model, hist


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
        _, h = _cnn_run(
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


def sweep_steps_to_target(
    splits: _data.Splits,
    batch_sizes: Iterable[int],
    lr_fn: Callable[[int], float],
    *,
    target_acc: float,
    max_steps: int,
    eval_images: int = 32,
    momentum: float = 0.9,
    width: int = 32,
    seed: int = 0,
    device: torch.device | str | None = None,
    progress: bool = True,
    keep_models: bool = False,
) -> list[dict] | tuple[list[dict], dict[int, torch.nn.Module]]:
    """Train the lecture CNN at each batch size until the validation accuracy first reaches
    ``target_acc`` (or ``max_steps``). Evaluation every ``max(1, eval_images // B)`` steps, so a
    small batch is evaluated about every ``eval_images`` training images and a big one every step.

    Returns rows {batch_size, lr, steps_to_target (None if not reached), eval_every, images}, and,
    with ``keep_models``, also {batch_size: trained model} (parameters where the run stopped)."""
    device = device or get_device()
    rows, models = [], {}
    for B in batch_sizes:
        lr = lr_fn(B)
        every = max(1, eval_images // B)
        model, h = _cnn_run(
            splits,
            B,
            lr,
            momentum=momentum,
            width=width,
            seed=seed,
            device=device,
            steps=max_steps,
            eval_every=every,
            progress=progress,
            desc=f"B={B}",
            callbacks=[_train.StopAtAccuracy(target_acc)],
        )
        s = h.steps_to(target_acc)
        rows.append(
            {
                "batch_size": B,
                "lr": lr,
                "steps_to_target": s,
                "eval_every": every,
                "images": None if s is None else s * B,
            }
        )
        if keep_models:
            models[B] = model
    return (rows, models) if keep_models else rows


def fit_critical_batch(batch_sizes: Sequence[float], steps: Sequence[float]) -> tuple[float, float]:
    """Fit McCandlish et al.'s S(B) = S_min (1 + B_crit / B) to measured steps-to-target (least
    squares on relative error, linear in (S_min, S_min B_crit)). Returns (S_min, B_crit)."""
    B = np.asarray(batch_sizes, dtype=float)
    S = np.asarray(steps, dtype=float)
    if len(B) < 2:
        raise ValueError("need at least two batch sizes that reached the target")
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
    lr_cap: float | None = None,
) -> tuple[Figure, dict[str, float]]:
    """Log-log steps-to-target with the perfect-scaling line from the smallest batch, the fitted
    S_min (1 + B_crit/B), the three regimes shaded and B_simple marked.

    The regime boundaries B_crit/regime_factor and B_crit*regime_factor (4 by default) are this
    course's convention for drawing McCandlish et al.'s curve, not lines Shallue et al. draw.
    With ``lr_cap`` (the cap on the scaled rate), the rows that trained at the cap are drawn
    hollow, labelled "rate capped": they all share one rate, so part of their bend is the cap.
    Returns (figure, {"s_min", "b_crit"})."""
    if ax is None:
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
    done = [r for r in rows if r["steps_to_target"] is not None]
    B = np.array([r["batch_size"] for r in done], dtype=float)
    S = np.array([r["steps_to_target"] for r in done], dtype=float)
    s_min, b_crit = fit_critical_batch(B, S)
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
    capped = np.array([lr_cap is not None and r["lr"] >= lr_cap * (1 - 1e-9) for r in done], dtype=bool)
    ax.loglog(B[~capped], S[~capped], "o", color="tab:blue", ms=7, label="measured")
    if capped.any():
        ax.loglog(
            B[capped],
            S[capped],
            "o",
            mfc="none",
            mec="tab:blue",
            mew=2,
            ms=9,
            label=f"measured, rate capped at {lr_cap:g}",
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
