"""Gradient noise and the gradient noise scale (stage 1).

* On the linear-regression problem of :mod:`utils.linear_regression`: per-example gradients, the
  variance of the minibatch gradient against batch size, and the exact noise scale of a finite
  dataset (the population's is :meth:`utils.linear_regression.LinearProblem.noise_scale`);
* McCandlish et al.'s two-batch estimator of the gradient noise scale
  B_simple = tr(Sigma) / |G|^2, from squared gradient norms of a small and a big batch: on the
  linear problem, and on any model and dataset (:func:`measure_noise_scale`); its standard error by
  the bootstrap (:func:`bootstrap_log_se`); a running estimate during training (:class:`NoiseScaleEMA`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import matplotlib.pyplot as plt
import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from . import plots as _plots
from .linear_regression import LinearProblem

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def per_example_grads(x: torch.Tensor, y: torch.Tensor, w: float, b: float) -> torch.Tensor:
    """(n, 2): the gradient of each example's squared error (w x_i + b - y_i)^2 w.r.t. (w, b)."""
    r = w * x + b - y
    return torch.stack([2 * r * x, 2 * r], dim=1)


def dataset_noise_scale(x: torch.Tensor, y: torch.Tensor, w: float, b: float) -> tuple[float, float, float]:
    """(|G|^2, tr(Sigma), B_simple) of the finite dataset at (w, b): G is the full-batch gradient,
    Sigma the covariance of the per-example gradients (divided by n)."""
    g = per_example_grads(x, y, w, b)
    G = g.mean(0)
    trS = float(((g - G) ** 2).sum(1).mean())
    G2 = float((G**2).sum())
    return G2, trS, trS / G2 if G2 > 0 else math.inf


def gradient_variance(
    x: torch.Tensor, y: torch.Tensor, w: float, b: float, batch_sizes: Iterable[int], draws: int = 200, seed: int = 0
) -> dict[str, Any]:
    """The variance E|g_B - G|^2 of the minibatch gradient for each batch size, measured over
    ``draws`` minibatches drawn with replacement (i.i.d. examples, as the 1/B theory assumes),
    next to the theory tr(Sigma)/B. Returns {"batch_sizes", "measured", "theory", "tr_sigma"}."""
    g = per_example_grads(x, y, w, b)
    G = g.mean(0)
    trS = float(((g - G) ** 2).sum(1).mean())
    gen = torch.Generator().manual_seed(seed)
    measured = []
    for B in batch_sizes:
        idx = torch.randint(0, len(x), (draws, int(B)), generator=gen)
        gB = g[idx].mean(1)  # (draws, 2)
        measured.append(float(((gB - G) ** 2).sum(1).mean()))
    bs = [int(B) for B in batch_sizes]
    return {"batch_sizes": bs, "measured": measured, "theory": [trS / B for B in bs], "tr_sigma": trS}


def loglog_slope(xs: Iterable[float], ys: Iterable[float]) -> float:
    """Least-squares slope of log(y) against log(x)."""
    lx, ly = np.log(np.asarray(xs, dtype=float)), np.log(np.asarray(ys, dtype=float))
    return float(np.polyfit(lx, ly, 1)[0])


def plot_gradient_variance(
    result: dict, ax: Axes | None = None, title: str = "Minibatch gradient variance vs batch size"
) -> Figure:
    if ax is None:
        fig, ax = plt.subplots(figsize=(5.5, 4))
    bs = result["batch_sizes"]
    ax.loglog(bs, result["measured"], "o-", label=f"measured (slope {loglog_slope(bs, result['measured']):.2f})")
    ax.loglog(bs, result["theory"], "k--", label=r"theory tr($\Sigma$)/B (slope -1)")
    ax.set(title=title, xlabel="batch size B (examples)", ylabel=r"E|g$_B$ - G|$^2$ ((loss/param)$^2$)")
    _plots.plain_ticks(ax, "x", bs)
    _plots.plain_ticks(ax, "y")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return ax.figure


class NoiseScale(NamedTuple):
    b_simple: float  # tr(Sigma) / |G|^2, in examples
    G2: float  # |G|^2, the squared norm of the true gradient
    tr_sigma: float  # tr(Sigma), the per-example gradient variance


def two_batch_estimates(
    sq_small: torch.Tensor | Sequence[float], sq_big: torch.Tensor | Sequence[float], b_small: int, b_big: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """McCandlish et al.'s unbiased per-pair estimates (|G|^2, tr(Sigma)) from the squared norms
    of a small-batch and a big-batch gradient, using E|G_B|^2 = |G|^2 + tr(Sigma) / B:

        |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
        tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)

    Each is noisy (and can be negative); average them separately before dividing."""
    if not 1 <= b_small < b_big:
        raise ValueError(f"need 1 <= b_small < b_big, got b_small={b_small}, b_big={b_big}")
    s = torch.as_tensor(sq_small, dtype=torch.float64)
    g = torch.as_tensor(sq_big, dtype=torch.float64)
    G2 = (b_big * g - b_small * s) / (b_big - b_small)
    trS = (s - g) / (1.0 / b_small - 1.0 / b_big)
    return G2, trS


def noise_scale(
    sq_small: torch.Tensor | Sequence[float], sq_big: torch.Tensor | Sequence[float], b_small: int, b_big: int
) -> NoiseScale:
    """B_simple from many (small, big) pairs: mean of the |G|^2 estimates and mean of the
    tr(Sigma) estimates, THEN the ratio (a mean of per-pair ratios is biased and unstable)."""
    G2, trS = two_batch_estimates(sq_small, sq_big, b_small, b_big)
    G2, trS = float(G2.mean()), float(trS.mean())
    return NoiseScale(trS / G2 if G2 > 0 else math.inf, G2, trS)


def bootstrap_log_se(
    sq_small: torch.Tensor | Sequence[float],
    sq_big: torch.Tensor | Sequence[float],
    b_small: int,
    b_big: int,
    resamples: int = 2000,
    seed: int = 0,
) -> float:
    """The standard error of log B_simple (:func:`noise_scale`) from the pairs behind it, by the
    bootstrap: the pairs drawn again with replacement, ``resamples`` times, B_simple of each resample,
    and the standard deviation of their logs (B_simple is a ratio, so its errors are closer to
    symmetric on a log scale). ``inf`` when a resample's mean |G|^2 or tr(Sigma) is not positive:
    B_simple then has no finite bound."""
    G2, trS = two_batch_estimates(sq_small, sq_big, b_small, b_big)
    idx = torch.randint(len(G2), (resamples, len(G2)), generator=torch.Generator().manual_seed(seed))
    G2_boot, trS_boot = G2[idx].mean(1), trS[idx].mean(1)
    if not bool((G2_boot > 0).all() and (trS_boot > 0).all()):
        return math.inf
    return float((trS_boot / G2_boot).log().std())


class NoiseScaleEMA:
    """Running B_simple during training: exponential moving averages of the |G|^2 and tr(Sigma)
    estimates, kept separately (bias-corrected, as Adam does), divided only when read."""

    def __init__(self, b_small: int, b_big: int, beta: float = 0.9):
        if not 0 <= beta < 1:
            raise ValueError(f"beta must be in [0, 1), got {beta}")
        self.b_small, self.b_big, self.beta = b_small, b_big, beta
        self.G2 = self.trS = 0.0
        self.count = 0

    def update(self, sq_small: float, sq_big: float) -> None:
        G2, trS = two_batch_estimates([sq_small], [sq_big], self.b_small, self.b_big)
        self.G2 = self.beta * self.G2 + (1 - self.beta) * float(G2[0])
        self.trS = self.beta * self.trS + (1 - self.beta) * float(trS[0])
        self.count += 1

    @property
    def value(self) -> NoiseScale:
        if self.count == 0:
            raise ValueError("NoiseScaleEMA.value read before any update()")
        corr = 1 - self.beta**self.count
        G2, trS = self.G2 / corr, self.trS / corr
        return NoiseScale(trS / G2 if G2 > 0 else math.inf, G2, trS)


def linear_grad_sq_norms(
    problem: LinearProblem, w: float, b: float, b_small: int, b_big: int, draws: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Squared norms of small- and big-batch gradients on FRESH samples of the population
    (a data stream), so E|G_B|^2 = |G|^2 + tr(Sigma)/B holds exactly with the closed-form
    values of :meth:`LinearProblem.gradient_stats`. The small batch is the big batch's head."""
    gen = torch.Generator().manual_seed(seed)
    x, y = problem.sample(draws * b_big, gen)
    g = per_example_grads(x, y, w, b).view(draws, b_big, 2)
    return (g[:, :b_small].mean(1) ** 2).sum(1), (g.mean(1) ** 2).sum(1)


def grad_sq_norms(
    model: nn.Module,
    dataset: TensorDataset,
    b_small: int,
    b_big: int,
    draws: int,
    *,
    seed: int = 0,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``draws`` random big batches (sampled with replacement from ``dataset``): the squared
    norm of the loss gradient over all parameters on the big batch and on its first ``b_small``
    examples. Returns two float64 CPU tensors of length ``draws``. The parameters are unchanged."""
    if not 1 <= b_small < b_big:
        raise ValueError(f"need 1 <= b_small < b_big, got b_small={b_small}, b_big={b_big}")
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    device = torch.device(device) if device is not None else next(model.parameters()).device
    x_all, y_all = dataset.tensors
    gen = torch.Generator().manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    was_training = model.training
    model.train()

    def sq_norm(x, y):
        grads = torch.autograd.grad(loss_fn(model(x), y), params)
        return sum((g.double() ** 2).sum() for g in grads)  # stays on the device: no sync

    small, big = [], []
    try:
        for _ in range(draws):
            idx = torch.randint(0, len(y_all), (b_big,), generator=gen)
            x, y = x_all[idx].to(device), y_all[idx].to(device)
            small.append(sq_norm(x[:b_small], y[:b_small]))
            big.append(sq_norm(x, y))
    finally:
        model.train(was_training)
    return torch.stack(small).cpu(), torch.stack(big).cpu()  # sync point: once, at the end


def measure_noise_scale(
    model: nn.Module,
    dataset: TensorDataset,
    b_small: int,
    b_big: int,
    draws: int,
    *,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> NoiseScale:
    """B_simple of ``model`` at its current parameters on ``dataset`` (two-batch estimator)."""
    s, g = grad_sq_norms(model, dataset, b_small, b_big, draws, seed=seed, device=device)
    return noise_scale(s, g, b_small, b_big)
