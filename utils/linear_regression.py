"""Gradient descent vs SGD on a linear-regression problem small enough to see whole (stage 1).

The problem y = w*x + b + noise: its closed-form least-squares solution, its MSE loss surface
over (w, b), full-batch GD / SGD / minibatch trajectories on that surface, and a panel with
sliders that redraws them. It works in float64 on the CPU (it is tiny and we compare with
closed forms). The gradient noise of the same problem is in :mod:`utils.gradient_noise`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import matplotlib.pyplot as plt
import numpy as np
import torch

if TYPE_CHECKING:
    import ipywidgets
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


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
        return (m, m * m + s * s, m**3 + 3 * m * s * s, m**4 + 6 * m * m * s * s + 3 * s**4)

    def gradient_stats(self, w: float, b: float) -> tuple[float, float]:
        """(|G|^2, tr(Sigma)) of the per-example MSE gradient g = 2 r (x, 1), r = w x + b - y, over
        the population, in closed form from the moments of x (no sampling).

        With a = w - w_true, c = b - b_true, q = a x + c: E[r^2 | x] = q^2 + noise^2, so
        E|g|^2 = 4 E[(q^2 + noise^2)(x^2 + 1)] and G = 2 (E[q x], E[q])."""
        a, c, v = w - self.w_true, b - self.b_true, self.noise**2
        m1, m2, m3, m4 = self._moments()
        e_qx, e_q = a * m2 + c * m1, a * m1 + c
        e_q2x2 = a * a * m4 + 2 * a * c * m3 + c * c * m2
        e_q2 = a * a * m2 + 2 * a * c * m1 + c * c
        g_sq = 4 * (e_q2x2 + e_q2 + v * (m2 + 1))  # E|g|^2
        G2 = 4 * (e_qx**2 + e_q**2)
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


def hessian(x: torch.Tensor) -> torch.Tensor:
    """The Hessian of mean((w x + b - y)^2) over (w, b): ``2 [[mean(x^2), mean(x)], [mean(x), 1]]``,
    the same at every point (the loss is quadratic), a float64 (2, 2) tensor."""
    x = torch.as_tensor(x, dtype=torch.float64)
    m1, m2 = x.mean(), (x * x).mean()
    return 2 * torch.stack([torch.stack([m2, m1]), torch.stack([m1, torch.ones_like(m1)])])


def gd_lr_threshold(x: torch.Tensor) -> float:
    """``2 / lambda_max`` of the loss surface: full-batch GD with a constant rate converges below
    it and diverges above it (along the steepest direction each step multiplies the error by
    ``1 - lr * lambda_max``). ``lambda_max`` of the 2x2 Hessian in closed form."""
    (a, c), (_, d) = hessian(x).tolist()
    lam_max = (a + d) / 2 + math.sqrt(((a - d) / 2) ** 2 + c * c)
    return 2 / lam_max


def mse(x: torch.Tensor, y: torch.Tensor, w: float | torch.Tensor, b: float | torch.Tensor) -> float:
    return float(((w * x + b - y) ** 2).mean())


def mse_grad(x: torch.Tensor, y: torch.Tensor, w: float, b: float) -> tuple[float, float]:
    """Gradient of mean((w x + b - y)^2) with respect to (w, b): (2 mean(r x), 2 mean(r))."""
    r = w * x + b - y
    return float(2 * (r * x).mean()), float(2 * r.mean())


def gd_step(x: torch.Tensor, y: torch.Tensor, w: float, b: float, lr: float) -> tuple[float, float]:
    """One full-batch gradient-descent step on the MSE."""
    dw, db = mse_grad(x, y, w, b)
    return w - lr * dw, b - lr * db


def gd(x: torch.Tensor, y: torch.Tensor, w0: float, b0: float, lr: float, steps: int) -> torch.Tensor:
    """Full-batch GD: the trajectory, a (steps + 1, 2) tensor of (w, b) including the start."""
    path = [(w0, b0)]
    w, b = w0, b0
    for _ in range(steps):
        w, b = gd_step(x, y, w, b, lr)
        path.append((w, b))
    return torch.tensor(path, dtype=torch.float64)


def minibatches(n: int, batch_size: int, seed: int = 0) -> Iterator[torch.Tensor]:
    """Index tensors of minibatches, forever: each epoch a fresh permutation of range(n) cut
    into consecutive slices of ``batch_size`` (an incomplete last slice is dropped, so every
    batch has the same size). ``batch_size == n`` gives the whole dataset every time."""
    if not 1 <= batch_size <= n:
        raise ValueError(f"batch_size must be between 1 and the dataset size {n}, got {batch_size}")
    g = torch.Generator().manual_seed(seed)
    while True:
        perm = torch.randperm(n, generator=g)
        for start in range(0, n - batch_size + 1, batch_size):
            yield perm[start : start + batch_size]


def sgd(
    x: torch.Tensor, y: torch.Tensor, w0: float, b0: float, lr: float, steps: int, batch_size: int, seed: int = 0
) -> torch.Tensor:
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


def loss_surface(
    x: torch.Tensor | Sequence[float],
    y: torch.Tensor | Sequence[float],
    w_grid: torch.Tensor | Sequence[float],
    b_grid: torch.Tensor | Sequence[float],
) -> torch.Tensor:
    """MSE at every (w, b) of the grid: a (len(b_grid), len(w_grid)) tensor (rows are b), from
    the data's moments: mean((w x + b - y)^2) = w^2 Sxx + b^2 + Syy + 2 w b Sx - 2 w Sxy - 2 b Sy."""
    x, y = torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(y, dtype=torch.float64)
    W = torch.as_tensor(w_grid, dtype=torch.float64)[None, :]
    B = torch.as_tensor(b_grid, dtype=torch.float64)[:, None]
    sx, sy, sxx, syy, sxy = x.mean(), y.mean(), (x * x).mean(), (y * y).mean(), (x * y).mean()
    return W * W * sxx + B * B + syy + 2 * W * B * sx - 2 * W * sxy - 2 * B * sy


def plot_trajectories(
    x: torch.Tensor,
    y: torch.Tensor,
    paths: dict,
    ax: Axes | None = None,
    title: str = "MSE loss surface and trajectories",
    margin: float = 0.6,
) -> Figure:
    """Contours of the MSE over (w, b) with each {label: (T, 2) trajectory} drawn from its start
    (circle) to its end (square); the least-squares solution is a star. Returns the figure."""
    if ax is None:
        fig, ax = plt.subplots(figsize=(6.4, 5))
    fig = ax.figure
    w_star, b_star = least_squares(x, y)
    star = torch.tensor([[w_star, b_star]], dtype=torch.float64)
    # The view holds every point within 3x the farthest start's distance from the minimum; a path
    # that leaves it (a rate past 2 / lambda_max) runs off the figure and is labelled "diverged".
    radius = 3 * max(1.0, max(float(torch.dist(p[0], star[0])) for p in paths.values()))
    inside = lambda p: p[torch.isfinite(p).all(1) & ((p - star).norm(dim=1) <= radius)]  # noqa: E731
    pts = torch.cat([inside(p) for p in paths.values()] + [star])
    lo, hi = pts.min(0).values, pts.max(0).values
    span = (hi - lo).clamp_min(1.0)
    lo, hi = lo - margin * span / 2, hi + margin * span / 2
    wg, bg = torch.linspace(lo[0], hi[0], 160), torch.linspace(lo[1], hi[1], 160)
    L = loss_surface(x, y, wg, bg)
    lmin = mse(x, y, w_star, b_star)
    levels = lmin + (float(L.max()) - lmin) * np.geomspace(1e-3, 1, 18)
    cs = ax.contour(wg.numpy(), bg.numpy(), L.numpy(), levels=levels, cmap="viridis", linewidths=0.8)
    fig.colorbar(cs, ax=ax, label="MSE loss (y units$^2$)")
    for (label, p), color in zip(paths.items(), ["tab:red", "tab:orange", "tab:blue", "tab:purple", "tab:brown"]):
        gone = not bool(torch.isfinite(p[-1]).all()) or float(torch.dist(p[-1], star[0])) > radius
        p = torch.where(torch.isfinite(p), p, torch.nan).numpy()
        ax.plot(p[:, 0], p[:, 1], "-", color=color, lw=1.2, alpha=0.85, label=label + (" (diverged)" if gone else ""))
        ax.plot(p[0, 0], p[0, 1], "o", color="black", ms=6)
        ax.plot(p[-1, 0], p[-1, 1], "s", color=color, ms=6)
    ax.plot([w_star], [b_star], "*", color="gold", mec="black", ms=15, label="least squares")
    ax.set_xlim(float(lo[0]), float(hi[0]))
    ax.set_ylim(float(lo[1]), float(hi[1]))
    ax.set(title=title, xlabel="slope w (y units per x unit)", ylabel="intercept b (y units)")
    ax.legend(fontsize=8, loc="best")
    return fig


def compare_trajectories(
    x: torch.Tensor,
    y: torch.Tensor,
    w0: float,
    b0: float,
    lr: float,
    steps: int,
    batch_size: int,
    seed: int = 0,
    sgd_fn: Callable[..., torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """{label: trajectory} for full-batch GD, SGD (batch 1) and minibatch ``batch_size``, all
    from (w0, b0) with the same rate and number of steps. ``sgd_fn`` defaults to :func:`sgd`."""
    sgd_fn = sgd_fn or sgd
    n = len(x)
    return {
        f"full-batch GD (B={n})": sgd_fn(x, y, w0, b0, lr, steps, n, seed),
        "SGD (B=1)": sgd_fn(x, y, w0, b0, lr, steps, 1, seed),
        f"minibatch (B={batch_size})": sgd_fn(x, y, w0, b0, lr, steps, batch_size, seed),
    }


def trajectory_panel(
    x: torch.Tensor,
    y: torch.Tensor,
    w0: float,
    b0: float,
    *,
    lr: float = 0.1,
    steps: int = 60,
    batch_size: int = 16,
    seed: int = 0,
    sgd_fn: Callable[..., torch.Tensor] | None = None,
    max_steps: int | None = None,
    max_lr: float | None = None,
) -> ipywidgets.HBox | None:
    """Draw the trajectories of :func:`compare_trajectories`, then attach sliders (batch size,
    learning rate, steps) that redraw the same figure in place.

    The figure is shown with ``display(..., display_id=True)`` and updated on every slider move,
    so without a widget front end (nbval, nbconvert) the cell still has the static figure.
    ``max_lr`` (the rate slider's end) defaults to 1.5 times :func:`gd_lr_threshold`, so the
    slider reaches the rates where GD diverges. Returns the widget box (None if ipywidgets is
    missing)."""
    from IPython.display import display

    n = len(x)
    if max_lr is None:
        max_lr = math.ceil(1.5 * gd_lr_threshold(x) / 0.005) * 0.005  # a whole number of slider steps
    fig, ax = plt.subplots(figsize=(6.4, 5))

    def draw(batch_size, lr, steps):
        fig.clf()
        ax = fig.add_subplot()
        paths = compare_trajectories(x, y, w0, b0, lr, steps, batch_size, seed, sgd_fn)
        plot_trajectories(x, y, paths, ax=ax, title=f"MSE surface: {steps} steps at lr={lr:g}")
        fig.tight_layout()

    draw(batch_size, lr, steps)
    handle = display(fig, display_id=True)
    plt.close(fig)  # the inline backend must not show it a second time
    try:
        import ipywidgets as widgets
    except ImportError:
        return None
    sizes = sorted({2**k for k in range(int(math.log2(n)) + 1)} | {batch_size})
    full = {"description_width": "initial"}  # the default width cuts "learning rate" to "learning..."
    bs = widgets.SelectionSlider(options=sizes, value=batch_size, description="batch size", style=full)
    lr_w = widgets.FloatSlider(
        value=lr, min=0.005, max=max_lr, step=0.005, description="learning rate", readout_format=".3f", style=full
    )
    st = widgets.IntSlider(value=steps, min=1, max=max_steps or 4 * steps, description="steps", style=full)

    def on_change(_):
        draw(bs.value, lr_w.value, st.value)
        if handle is not None:  # None outside IPython: nothing to update
            handle.update(fig)

    for w in (bs, lr_w, st):
        w.observe(on_change, names="value")
    box = widgets.HBox([bs, lr_w, st])
    display(box)
    return box
