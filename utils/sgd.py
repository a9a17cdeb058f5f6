"""Gradient descent vs SGD, and what batch size does (stage 1).

Two halves:

* a linear-regression problem y = w*x + b + noise, small enough to see whole: its closed-form
  least-squares solution, its MSE loss surface over (w, b), full-batch GD / SGD / minibatch
  trajectories on that surface, the variance of the minibatch gradient against batch size,
  and the exact gradient noise scale of the population (a closed form from moments of x);
* the lecture CNN on a real dataset: batch-size sweeps that call :func:`utils.train.fit` (with
  ``eval_every`` and :class:`utils.train.StopAtAccuracy` for steps-to-target), and McCandlish et
  al.'s two-batch estimator of the gradient noise scale B_simple = tr(Sigma) / |G|^2.

The linear half works in float64 on the CPU (it is tiny and we compare with closed forms).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import matplotlib.pyplot as plt
import numpy as np
import torch
from torch import nn

from . import data as _data
from . import plots as _plots
from . import models as _models
from . import train as _train
from .device import get_device

# ------------------------------------------------------------------------------------------
# The linear-regression problem
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearProblem:
    """The population y = w_true * x + b_true + eps, x ~ N(x_mean, x_std^2), eps ~ N(0, noise^2).

    ``x_mean != 0`` couples w and b, so the loss surface is a tilted ellipse rather than a
    circle and gradient descent visibly curves."""
    w_true: float = 2.0
    b_true: float = -1.0
    x_mean: float = 1.0
    x_std: float = 1.0
    noise: float = 0.5

    def sample(self, n: int, seed: int | torch.Generator = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` points (x, y), float64 tensors of shape (n,)."""
        if n < 2:
            raise ValueError(f"need at least 2 points to fit a line, got n={n}")
        g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
        x = self.x_mean + self.x_std * torch.randn(n, generator=g, dtype=torch.float64)
        y = self.w_true * x + self.b_true + self.noise * torch.randn(n, generator=g, dtype=torch.float64)
        return x, y

    def _moments(self):
        m, s = self.x_mean, self.x_std
        return (m, m * m + s * s, m ** 3 + 3 * m * s * s, m ** 4 + 6 * m * m * s * s + 3 * s ** 4)

    def gradient_stats(self, w: float, b: float) -> tuple[float, float]:
        """(|G|^2, tr(Sigma)) of the per-example MSE gradient g = 2 r (x, 1), r = w x + b - y, over
        the population, in closed form from the moments of x (no sampling).

        With a = w - w_true, c = b - b_true, q = a x + c: E[r^2 | x] = q^2 + noise^2, so
        E|g|^2 = 4 E[(q^2 + noise^2)(x^2 + 1)] and G = 2 (E[q x], E[q])."""
        a, c, v = w - self.w_true, b - self.b_true, self.noise ** 2
        m1, m2, m3, m4 = self._moments()
        e_qx, e_q = a * m2 + c * m1, a * m1 + c
        e_q2x2 = a * a * m4 + 2 * a * c * m3 + c * c * m2
        e_q2 = a * a * m2 + 2 * a * c * m1 + c * c
        g_sq = 4 * (e_q2x2 + e_q2 + v * (m2 + 1))          # E|g|^2
        G2 = 4 * (e_qx ** 2 + e_q ** 2)
        return G2, g_sq - G2

    def noise_scale(self, w: float, b: float) -> float:
        """The exact B_simple = tr(Sigma) / |G|^2 of the population at (w, b)."""
        G2, trS = self.gradient_stats(w, b)
        if G2 == 0:
            return math.inf
        return trS / G2


def least_squares(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """The closed-form minimiser (w, b) of mean((w x + b - y)^2): the normal equations."""
    x, y = torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(y, dtype=torch.float64)
    xm, ym = x.mean(), y.mean()
    var = ((x - xm) ** 2).mean()
    if var <= 0:
        raise ValueError("all x are equal: the slope w is not determined")
    w = ((x - xm) * (y - ym)).mean() / var
    return float(w), float(ym - w * xm)


def mse(x, y, w, b) -> float:
    return float(((w * x + b - y) ** 2).mean())


def mse_grad(x: torch.Tensor, y: torch.Tensor, w: float, b: float) -> tuple[float, float]:
    """Gradient of mean((w x + b - y)^2) with respect to (w, b): (2 mean(r x), 2 mean(r))."""
    r = w * x + b - y
    return float(2 * (r * x).mean()), float(2 * r.mean())


def gd_step(x, y, w: float, b: float, lr: float) -> tuple[float, float]:
    """One full-batch gradient-descent step on the MSE."""
    dw, db = mse_grad(x, y, w, b)
    return w - lr * dw, b - lr * db


def gd(x, y, w0: float, b0: float, lr: float, steps: int) -> torch.Tensor:
    """Full-batch GD: the trajectory, a (steps + 1, 2) tensor of (w, b) including the start."""
    path = [(w0, b0)]
    w, b = w0, b0
    for _ in range(steps):
        w, b = gd_step(x, y, w, b, lr)
        path.append((w, b))
    return torch.tensor(path, dtype=torch.float64)


def minibatches(n: int, batch_size: int, seed: int = 0):
    """Index tensors of minibatches, forever: each epoch a fresh permutation of range(n) cut
    into consecutive slices of ``batch_size`` (an incomplete last slice is dropped, so every
    batch has the same size). ``batch_size == n`` gives the whole dataset every time."""
    if not 1 <= batch_size <= n:
        raise ValueError(f"batch_size must be between 1 and the dataset size {n}, got {batch_size}")
    g = torch.Generator().manual_seed(seed)
    while True:
        perm = torch.randperm(n, generator=g)
        for start in range(0, n - batch_size + 1, batch_size):
            yield perm[start:start + batch_size]


def sgd(x, y, w0: float, b0: float, lr: float, steps: int, batch_size: int, seed: int = 0) -> torch.Tensor:
    """Minibatch SGD on the MSE: each step takes the next batch of :func:`minibatches` and moves
    (w, b) against the gradient on that batch only. Returns the (steps + 1, 2) trajectory
    including the start. ``batch_size=1`` is plain SGD; ``batch_size=len(x)`` is full-batch GD."""
    path = [(w0, b0)]
    w, b = w0, b0
    for _, idx in zip(range(steps), minibatches(len(x), batch_size, seed)):
        dw, db = mse_grad(x[idx], y[idx], w, b)
        w, b = w - lr * dw, b - lr * db
        path.append((w, b))
    return torch.tensor(path, dtype=torch.float64)


def loss_surface(x, y, w_grid, b_grid) -> torch.Tensor:
    """MSE at every (w, b) of the grid: a (len(b_grid), len(w_grid)) tensor (rows are b), from
    the data's moments: mean((w x + b - y)^2) = w^2 Sxx + b^2 + Syy + 2 w b Sx - 2 w Sxy - 2 b Sy."""
    x, y = torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(y, dtype=torch.float64)
    W = torch.as_tensor(w_grid, dtype=torch.float64)[None, :]
    B = torch.as_tensor(b_grid, dtype=torch.float64)[:, None]
    sx, sy, sxx, syy, sxy = x.mean(), y.mean(), (x * x).mean(), (y * y).mean(), (x * y).mean()
    return W * W * sxx + B * B + syy + 2 * W * B * sx - 2 * W * sxy - 2 * B * sy


def plot_trajectories(x, y, paths: dict, ax=None, title: str = "MSE loss surface and trajectories",
                      margin: float = 0.6):
    """Contours of the MSE over (w, b) with each {label: (T, 2) trajectory} drawn from its start
    (circle) to its end (square); the least-squares solution is a star. Returns the figure."""
    if ax is None:
        fig, ax = plt.subplots(figsize=(6.4, 5))
    fig = ax.figure
    w_star, b_star = least_squares(x, y)
    pts = torch.cat([p for p in paths.values()] + [torch.tensor([[w_star, b_star]], dtype=torch.float64)])
    lo, hi = pts.min(0).values, pts.max(0).values
    span = (hi - lo).clamp_min(1.0)
    lo, hi = lo - margin * span / 2, hi + margin * span / 2
    wg, bg = torch.linspace(lo[0], hi[0], 160), torch.linspace(lo[1], hi[1], 160)
    L = loss_surface(x, y, wg, bg)
    lmin = mse(x, y, w_star, b_star)
    levels = lmin + (L.max() - lmin) * np.geomspace(1e-3, 1, 18)
    cs = ax.contour(wg.numpy(), bg.numpy(), L.numpy(), levels=levels, cmap="viridis", linewidths=0.8)
    fig.colorbar(cs, ax=ax, label="MSE loss (y units$^2$)")
    for (label, p), color in zip(paths.items(), ["tab:red", "tab:orange", "tab:blue", "tab:purple", "tab:brown"]):
        p = p.numpy()
        ax.plot(p[:, 0], p[:, 1], "-", color=color, lw=1.2, alpha=0.85, label=label)
        ax.plot(p[0, 0], p[0, 1], "o", color="black", ms=6)
        ax.plot(p[-1, 0], p[-1, 1], "s", color=color, ms=6)
    ax.plot([w_star], [b_star], "*", color="gold", mec="black", ms=15, label="least squares")
    ax.set(title=title, xlabel="slope w (y units per x unit)", ylabel="intercept b (y units)")
    ax.legend(fontsize=8, loc="best")
    return fig


def compare_trajectories(x, y, w0, b0, lr, steps, batch_size, seed=0, sgd_fn=None) -> dict:
    """{label: trajectory} for full-batch GD, SGD (batch 1) and minibatch ``batch_size``, all
    from (w0, b0) with the same rate and number of steps. ``sgd_fn`` defaults to :func:`sgd`."""
    sgd_fn = sgd_fn or sgd
    n = len(x)
    return {f"full-batch GD (B={n})": sgd_fn(x, y, w0, b0, lr, steps, n, seed),
            "SGD (B=1)": sgd_fn(x, y, w0, b0, lr, steps, 1, seed),
            f"minibatch (B={batch_size})": sgd_fn(x, y, w0, b0, lr, steps, batch_size, seed)}


def trajectory_panel(x, y, w0, b0, *, lr=0.1, steps=60, batch_size=16, seed=0, sgd_fn=None,
                     max_steps=None, max_lr=0.35):
    """Draw the trajectories of :func:`compare_trajectories`, then attach sliders (batch size,
    learning rate, steps) that redraw the same figure in place.

    The figure is shown with ``display(..., display_id=True)`` and updated on every slider move,
    so without a widget front end (nbval, nbconvert) the cell still has the static figure.
    Returns the widget box (None if ipywidgets is missing)."""
    from IPython.display import display

    n = len(x)
    fig, ax = plt.subplots(figsize=(6.4, 5))

    def draw(batch_size, lr, steps):
        fig.clf()
        ax = fig.add_subplot()
        paths = compare_trajectories(x, y, w0, b0, lr, steps, batch_size, seed, sgd_fn)
        plot_trajectories(x, y, paths, ax=ax, title=f"MSE surface: {steps} steps at lr={lr:g}")
        fig.tight_layout()

    draw(batch_size, lr, steps)
    handle = display(fig, display_id=True)
    plt.close(fig)              # the inline backend must not show it a second time
    try:
        import ipywidgets as widgets
    except ImportError:
        return None
    sizes = sorted({2 ** k for k in range(int(math.log2(n)) + 1)} | {batch_size})
    full = {"description_width": "initial"}     # the default width cuts "learning rate" to "learning..."
    bs = widgets.SelectionSlider(options=sizes, value=batch_size, description="batch size", style=full)
    lr_w = widgets.FloatSlider(value=lr, min=0.005, max=max_lr, step=0.005, description="learning rate",
                               readout_format=".3f", style=full)
    st = widgets.IntSlider(value=steps, min=1, max=max_steps or 4 * steps, description="steps", style=full)

    def on_change(_):
        draw(bs.value, lr_w.value, st.value)
        if handle is not None:          # None outside IPython: nothing to update
            handle.update(fig)

    for w in (bs, lr_w, st):
        w.observe(on_change, names="value")
    box = widgets.HBox([bs, lr_w, st])
    display(box)
    return box


# ------------------------------------------------------------------------------------------
# Gradient noise
# ------------------------------------------------------------------------------------------


def per_example_grads(x, y, w: float, b: float) -> torch.Tensor:
    """(n, 2): the gradient of each example's squared error (w x_i + b - y_i)^2 w.r.t. (w, b)."""
    r = w * x + b - y
    return torch.stack([2 * r * x, 2 * r], dim=1)


def dataset_noise_scale(x, y, w: float, b: float) -> tuple[float, float, float]:
    """(|G|^2, tr(Sigma), B_simple) of the finite dataset at (w, b): G is the full-batch gradient,
    Sigma the covariance of the per-example gradients (divided by n)."""
    g = per_example_grads(x, y, w, b)
    G = g.mean(0)
    trS = float(((g - G) ** 2).sum(1).mean())
    G2 = float((G ** 2).sum())
    return G2, trS, trS / G2 if G2 > 0 else math.inf


def gradient_variance(x, y, w: float, b: float, batch_sizes, draws: int = 200, seed: int = 0) -> dict:
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
        gB = g[idx].mean(1)                                   # (draws, 2)
        measured.append(float(((gB - G) ** 2).sum(1).mean()))
    bs = [int(B) for B in batch_sizes]
    return {"batch_sizes": bs, "measured": measured, "theory": [trS / B for B in bs], "tr_sigma": trS}


def loglog_slope(xs, ys) -> float:
    """Least-squares slope of log(y) against log(x)."""
    lx, ly = np.log(np.asarray(xs, dtype=float)), np.log(np.asarray(ys, dtype=float))
    return float(np.polyfit(lx, ly, 1)[0])


def plot_gradient_variance(result: dict, ax=None, title="Minibatch gradient variance vs batch size"):
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
    b_simple: float   # tr(Sigma) / |G|^2, in examples
    G2: float         # |G|^2, the squared norm of the true gradient
    tr_sigma: float   # tr(Sigma), the per-example gradient variance


def two_batch_estimates(sq_small, sq_big, b_small: int, b_big: int):
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


def noise_scale(sq_small, sq_big, b_small: int, b_big: int) -> NoiseScale:
    """B_simple from many (small, big) pairs: mean of the |G|^2 estimates and mean of the
    tr(Sigma) estimates, THEN the ratio (a mean of per-pair ratios is biased and unstable)."""
    G2, trS = two_batch_estimates(sq_small, sq_big, b_small, b_big)
    G2, trS = float(G2.mean()), float(trS.mean())
    return NoiseScale(trS / G2 if G2 > 0 else math.inf, G2, trS)


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
        corr = 1 - self.beta ** self.count
        G2, trS = self.G2 / corr, self.trS / corr
        return NoiseScale(trS / G2 if G2 > 0 else math.inf, G2, trS)


def linear_grad_sq_norms(problem: LinearProblem, w: float, b: float, b_small: int, b_big: int,
                         draws: int, seed: int = 0):
    """Squared norms of small- and big-batch gradients on FRESH samples of the population
    (a data stream), so E|G_B|^2 = |G|^2 + tr(Sigma)/B holds exactly with the closed-form
    values of :meth:`LinearProblem.gradient_stats`. The small batch is the big batch's head."""
    gen = torch.Generator().manual_seed(seed)
    x, y = problem.sample(draws * b_big, gen)
    g = per_example_grads(x, y, w, b).view(draws, b_big, 2)
    return (g[:, :b_small].mean(1) ** 2).sum(1), (g.mean(1) ** 2).sum(1)


def grad_sq_norms(model: nn.Module, dataset, b_small: int, b_big: int, draws: int, *, seed: int = 0,
                  loss_fn=None, device=None):
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
        return sum((g.double() ** 2).sum() for g in grads)    # stays on the device: no sync

    small, big = [], []
    try:
        for _ in range(draws):
            idx = torch.randint(0, len(y_all), (b_big,), generator=gen)
            x, y = x_all[idx].to(device), y_all[idx].to(device)
            small.append(sq_norm(x[:b_small], y[:b_small]))
            big.append(sq_norm(x, y))
    finally:
        model.train(was_training)
    return torch.stack(small).cpu(), torch.stack(big).cpu()      # sync point: once, at the end


def measure_noise_scale(model: nn.Module, dataset, b_small: int, b_big: int, draws: int, *, seed: int = 0,
                        device=None) -> NoiseScale:
    """B_simple of ``model`` at its current parameters on ``dataset`` (two-batch estimator)."""
    s, g = grad_sq_norms(model, dataset, b_small, b_big, draws, seed=seed, device=device)
    return noise_scale(s, g, b_small, b_big)


# ------------------------------------------------------------------------------------------
# Batch-size sweeps on the lecture CNN
# ------------------------------------------------------------------------------------------


def lr_for_batch(batch_size: int, base_lr: float, base_batch: int, rule: str = "linear",
                 max_lr: float | None = None) -> float:
    """The learning rate for ``batch_size`` from one tuned at ``base_batch``: ``linear``
    (Goyal et al.: k times the batch, k times the rate), ``sqrt`` (sqrt(k) times) or ``none``;
    then capped at ``max_lr`` (past some rate training diverges whatever the batch)."""
    from .schedules import scaled_lr     # the scaling rules live in one place
    lr = scaled_lr(base_lr, batch_size, base_batch, rule)
    return min(lr, max_lr) if max_lr is not None else lr


def _cnn_run(splits, batch_size, lr, *, momentum, hidden, seed, device, desc, **fit_kw):
    torch.manual_seed(seed)
    model = _models.net_for(splits.shape, hidden).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    train_loader = _data.make_loader(splits.train, batch_size, device=device, seed=seed)
    val_loader = _data.make_loader(splits.val, 1024, shuffle=False, device=device)
    hist = _train.fit(model, train_loader, opt, val_loader=val_loader, device=device, desc=desc, **fit_kw)
    return model, hist


def sweep_fixed_epochs(splits, batch_sizes, lr_fn: Callable[[int], float], *, epochs: int,
                       momentum: float = 0.9, hidden: int = 32, seed: int = 0, device=None,
                       progress: bool = True) -> list[dict]:
    """Train the lecture CNN once per batch size for the same number of epochs (the same number
    of images). Per batch size: steps, lr, time per epoch (median, s), images/s (training only)
    and the final validation accuracy."""
    device = device or get_device()
    rows = []
    for B in batch_sizes:
        lr = lr_fn(B)
        _, h = _cnn_run(splits, B, lr, momentum=momentum, hidden=hidden, seed=seed, device=device,
                        epochs=epochs, progress=progress, desc=f"B={B}")
        rows.append({"batch_size": B, "lr": lr, "steps": h.steps,
                     "time_per_epoch_s": float(np.median([e["time_s"] for e in h.epochs])),
                     "images_per_s": h.images_per_s, "val_acc": h.val_acc})
    return rows


def sweep_steps_to_target(splits, batch_sizes, lr_fn: Callable[[int], float], *, target_acc: float,
                          max_steps: int, eval_images: int = 32, momentum: float = 0.9, hidden: int = 32,
                          seed: int = 0, device=None, progress: bool = True, keep_models: bool = False):
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
        model, h = _cnn_run(splits, B, lr, momentum=momentum, hidden=hidden, seed=seed, device=device,
                            steps=max_steps, eval_every=every, progress=progress, desc=f"B={B}",
                            callbacks=[_train.StopAtAccuracy(target_acc)])
        s = h.steps_to(target_acc)
        rows.append({"batch_size": B, "lr": lr, "steps_to_target": s, "eval_every": every,
                     "images": None if s is None else s * B})
        if keep_models:
            models[B] = model
    return (rows, models) if keep_models else rows


def fit_critical_batch(batch_sizes, steps) -> tuple[float, float]:
    """Fit McCandlish et al.'s S(B) = S_min (1 + B_crit / B) to measured steps-to-target (least
    squares on relative error, linear in (S_min, S_min B_crit)). Returns (S_min, B_crit)."""
    B = np.asarray(batch_sizes, dtype=float)
    S = np.asarray(steps, dtype=float)
    if len(B) < 2:
        raise ValueError("need at least two batch sizes that reached the target")
    A = np.stack([np.ones_like(B), 1.0 / B], 1) / S[:, None]
    (s_min, k), *_ = np.linalg.lstsq(A, np.ones_like(S), rcond=None)
    if s_min <= 0:                     # no floor visible: every B was still in perfect scaling
        return float("nan"), float("inf")
    return float(s_min), float(max(k, 0.0) / s_min)


def plot_steps_to_target(rows, b_simple: float | None = None, ax=None, regime_factor: float = 4.0,
                         title="Steps to target accuracy vs batch size"):
    """Log-log steps-to-target with the perfect-scaling line from the smallest batch, the fitted
    S_min (1 + B_crit/B), the three regimes shaded (perfect scaling below B_crit/regime_factor,
    no further gain above B_crit*regime_factor, diminishing returns between) and B_simple marked.
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
        ax.axvspan(lo, max(lo, a), color="tab:green", alpha=0.08, label="perfect scaling")
        ax.axvspan(max(lo, a), min(hi, c), color="tab:orange", alpha=0.08, label="diminishing returns")
        ax.axvspan(min(hi, c), hi, color="tab:red", alpha=0.08, label="no further gain")
        ax.loglog(grid, s_min * (1 + b_crit / grid), "-", color="gray",
                  label=f"fit $S_{{min}}(1+B_{{crit}}/B)$, $B_{{crit}}$={b_crit:.0f}")
    ax.loglog(grid, S[0] * B[0] / grid, "k:", label="perfect scaling (steps ∝ 1/B)")
    ax.loglog(B, S, "o", color="tab:blue", ms=7, label="measured")
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


def plot_fixed_epoch_sweep(rows, title="Fixed epoch budget: what batch size buys"):
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
        ax.set_yscale("log")            # throughput spans orders of magnitude on a GPU
        _plots.plain_ticks(ax, "y")
    for ax in axes:
        _plots.plain_ticks(ax, "x", B)
    fig.suptitle(title)
    fig.tight_layout()
    return fig
