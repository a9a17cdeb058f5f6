"""Self-checks for stage 1: gradient descent vs SGD, batch size (lab1).

Each check runs the student's function on a small case whose answer is known (hand-computed,
the closed-form least-squares solution, or the references in utils.linear_regression and
utils.gradient_noise) and, when it is wrong, names the likely mistake."""

from collections.abc import Callable
from typing import Any

import torch

from .. import gradient_noise as _noise
from .. import linear_regression as _linreg
from ._common import CheckFailed, _call, _close, _fail, _passed  # noqa: F401

__all__ = ["check_gd_step", "check_sgd", "check_noise_scale"]

# A tiny dataset for hand computation: mean((w x + b - y)^2) at w=0.5, b=0.5 has gradient
# dw = 2 mean(r x) = -26/3 and db = 2 mean(r) = -11/3, with r = (-1, -1.5, -3). b is not 0, so a
# residual that forgets b (r = w x - y: dw = -32/3, db = -14/3) gives a different step.
_X = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
_Y = torch.tensor([2.0, 3.0, 5.0], dtype=torch.float64)


def _pair(name, got):
    if isinstance(got, torch.Tensor) and got.numel() == 2:
        got = tuple(got.flatten().tolist())
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        _fail(
            name,
            f"returned {type(got).__name__} {got!r}, expected a pair (new_w, new_b)",
            "end with `return w_new, b_new`",
        )
    try:
        return float(got[0]), float(got[1])
    except (TypeError, ValueError, RuntimeError):
        _fail(name, f"returned {got!r}: its entries are not numbers", "return two floats (or 0-d tensors)")


def check_gd_step(gd_step: Callable[..., Any]) -> None:
    """``gd_step(x, y, w, b, lr)``: one full-batch gradient-descent step on mean((w x + b - y)^2),
    returning the new (w, b)."""
    name = "gd_step"
    w, b, lr = 0.5, 0.5, 0.1
    dw, db = -26 / 3, -11 / 3
    got = _pair(name, _call(name, gd_step, _X.clone(), _Y.clone(), w, b, lr))
    want = (w - lr * dw, b - lr * db)
    if not (_close(got[0], want[0]) and _close(got[1], want[1])):
        mistakes = [
            (
                (w + lr * dw, b + lr * db),
                "the step goes UP the gradient",
                "gradient descent moves against the gradient: w - lr * dL/dw (check the sign of the residual too)",
            ),
            (
                (w - lr * dw / 2, b - lr * db / 2),
                "the gradient is half what it should be",
                "d/dw of r^2 is 2 r x: keep the factor 2 from the square",
            ),
            (
                (w - 3 * lr * dw, b - 3 * lr * db),
                "the gradient is 3x too big on 3 points: a sum, not a mean",
                "the loss is the MEAN squared error: average r * x and r over the points",
            ),
            (
                (w - lr * dw, b),
                "w moves correctly but b does not",
                "the intercept's gradient is 2 * mean(r) with r = w x + b - y; update b too",
            ),
            (
                (w, b - lr * db),
                "b moves correctly but w does not",
                "the slope's gradient is 2 * mean(r * x); update w too",
            ),
            (
                (w - lr * db, b - lr * dw),
                "the two gradients are swapped",
                "dL/dw = 2 mean(r * x) (it has the x), dL/db = 2 mean(r)",
            ),
            (
                (w - lr * -32 / 3, b - lr * -14 / 3),
                "the residual leaves out b",
                "the prediction is w * x + b: r = w * x + b - y",
            ),
            (
                (w - lr * dw, b - lr * dw),
                "b moved by w's gradient",
                "b's gradient has no x in it: 2 * mean(r), not 2 * mean(r * x)",
            ),
        ]
        for cand, problem, hint in mistakes:
            if _close(got[0], cand[0]) and _close(got[1], cand[1]):
                _fail(name, f"returned ({got[0]:.4f}, {got[1]:.4f}): {problem}", hint)
        _fail(
            name,
            f"on x={_X.tolist()}, y={_Y.tolist()}, w={w}, b={b}, lr={lr} it returned "
            f"({got[0]:.4f}, {got[1]:.4f}), expected ({want[0]:.4f}, {want[1]:.4f})",
            "r = w*x + b - y; w_new = w - lr * 2*mean(r*x); b_new = b - lr * 2*mean(r)",
        )
    # Many steps must reach the closed-form least-squares solution.
    x, y = _linreg.LinearProblem().sample(64, seed=3)
    w_star, b_star = _linreg.least_squares(x, y)
    w, b = 0.0, 0.0
    for _ in range(400):
        w, b = _pair(name, _call(name, gd_step, x, y, w, b, 0.2))
    if abs(w - w_star) > 1e-3 or abs(b - b_star) > 1e-3:
        _fail(
            name,
            f"400 steps at lr=0.2 ended at ({w:.4f}, {b:.4f}), not at the least-squares "
            f"solution ({w_star:.4f}, {b_star:.4f})",
            "each call must use the (w, b) it is given and return the moved pair, without state kept between calls",
        )
    _passed(name, "one step matches the hand computation; 400 steps reach least squares within 1e-3")


def _trajectory(name, got, steps):
    if not isinstance(got, torch.Tensor):
        try:
            got = torch.as_tensor(got, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError):
            _fail(
                name,
                f"returned {type(got).__name__}, expected a (steps + 1, 2) tensor",
                "collect (w, b) after each step in a list and return torch.tensor(path)",
            )
    got = got.to(torch.float64)
    if tuple(got.shape) == (steps, 2):
        _fail(
            name,
            f"returned shape {tuple(got.shape)} for steps={steps}: the start is missing",
            "begin the path with (w0, b0), then append (w, b) after every step: steps + 1 rows",
        )
    if tuple(got.shape) != (steps + 1, 2):
        _fail(
            name,
            f"returned shape {tuple(got.shape)}, expected ({steps + 1}, 2) for steps={steps}",
            "one row (w, b) per point: the start, then one after each step",
        )
    return got


def check_sgd(sgd: Callable[..., Any]) -> None:
    """``sgd(x, y, w0, b0, lr, steps, batch_size, seed)``: minibatch SGD taking its batches from
    ``utils.linear_regression.minibatches(len(x), batch_size, seed)``; returns the (steps + 1, 2) trajectory."""
    name = "sgd"
    x, y = _linreg.LinearProblem().sample(12, seed=5)
    w0, b0, lr, steps, B, seed = -1.0, 2.0, 0.05, 9, 3, 7
    ref = _linreg.sgd(x, y, w0, b0, lr, steps, B, seed)
    got = _trajectory(name, _call(name, sgd, x.clone(), y.clone(), w0, b0, lr, steps, B, seed), steps)
    if not _close(got[0], ref[0]):
        _fail(
            name,
            f"the first row is {got[0].tolist()}, not the start ({w0}, {b0})",
            "the path starts with (w0, b0) before any step",
        )
    if not torch.allclose(got, ref, rtol=1e-6, atol=1e-9):
        gd_path = _linreg.sgd(x, y, w0, b0, lr, steps, len(x), seed)
        summed = _linreg.sgd(x, y, w0, b0, lr * B, steps, B, seed)
        if torch.allclose(got, gd_path, rtol=1e-6, atol=1e-9):
            _fail(
                name,
                "with batch_size=3 of 12 points the path equals full-batch GD: every step used all the data",
                "compute the gradient on x[idx], y[idx] only, for the idx of the current minibatch",
            )
        if torch.allclose(got, summed, rtol=1e-6, atol=1e-9):
            _fail(
                name,
                f"the steps are {B}x too long: the minibatch gradient is summed, not averaged",
                "average over the batch (the MSE's mean), so the step size does not grow with the batch",
            )
        if _close(got[1], ref[1]):
            _fail(
                name,
                "the first step is right but later ones are not",
                "take the NEXT batch each step (one shared minibatches(...) iterator, not a new one per step) "
                "and compute each gradient at the latest (w, b)",
            )
        full = _trajectory(name, _call(name, sgd, x.clone(), y.clone(), w0, b0, lr, steps, len(x), seed), steps)
        if torch.allclose(full, gd_path, rtol=1e-6, atol=1e-9):
            _fail(
                name,
                "full-batch runs are right but minibatch runs do not use the expected batches",
                "draw batches with `for _, idx in zip(range(steps), utils.linear_regression.minibatches(len(x), batch_size, seed))`",
            )
        _fail(
            name,
            f"the path differs from the reference from step 1 on (got {got[1].tolist()}, expected {ref[1].tolist()})",
            "check the update w -= lr * 2*mean(r*x), b -= lr * 2*mean(r) on the batch (your gd_step on x[idx], y[idx])",
        )
    _passed(name, f"matches the reference trajectory ({steps} steps, batch {B})")


def check_noise_scale(b_simple: Callable[..., Any]) -> None:
    """``b_simple(sq_small, sq_big, b_small, b_big)``: the gradient noise scale tr(Sigma)/|G|^2
    from tensors of squared small- and big-batch gradient norms (McCandlish et al.'s two-batch
    estimator, numerator and denominator averaged separately)."""
    name = "b_simple"
    # Built so that mean |G_4|^2 = 11 and mean |G_64|^2 = 1.625: |G|^2 = 1, tr(Sigma) = 40.
    s = torch.tensor([6.0, 16.0, 9.0, 13.0], dtype=torch.float64)
    g = torch.tensor([1.2, 2.5, 1.0, 1.8], dtype=torch.float64)
    bs, bb = 4, 64
    got = _call(name, b_simple, s.clone(), g.clone(), bs, bb)
    if isinstance(got, torch.Tensor):
        if got.numel() != 1:
            _fail(
                name,
                f"returned a tensor of shape {tuple(got.shape)}, expected one number",
                "average the |G|^2 estimates and the tr(Sigma) estimates over the pairs, then divide",
            )
        got = got.item()
    if isinstance(got, tuple):
        _fail(name, f"returned a tuple {got!r}, expected one number", "return tr(Sigma) / |G|^2 only")
    try:
        got = float(got)
    except (TypeError, ValueError):
        _fail(name, f"returned {type(got).__name__}, expected a float", "return float(tr_sigma / G2)")
    G2_i = (bb * g - bs * s) / (bb - bs)
    trS_i = (s - g) / (1 / bs - 1 / bb)
    mistakes = [
        (
            float((trS_i / G2_i).mean()),
            "you averaged the per-pair ratios",
            "the per-pair estimates are noisy (|G|^2 can be near 0 or negative): average the |G|^2 "
            "estimates and the tr(Sigma) estimates SEPARATELY, then divide the two means",
        ),
        (
            float(trS_i.mean() / g.mean()),
            "|G|^2 was taken as the big batch's |G_big|^2",
            "|G_big|^2 still holds tr(Sigma)/B_big of noise: use (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)",
        ),
        (
            float(((s - g).mean() / (bb - bs)) / G2_i.mean()),
            "tr(Sigma) was divided by (B_big - B_small)",
            "tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big): reciprocals of the batch sizes",
        ),
        (
            float(((s - g).mean() / (1 / bs - 1 / bb)) / ((bs * g - bb * s).mean() / (bs - bb))),
            "b_small and b_big are swapped in |G|^2",
            "the big batch's norm is weighted by B_big: (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)",
        ),
        (
            float(G2_i.mean() / trS_i.mean()),
            "the ratio is upside down (|G|^2 / tr(Sigma))",
            "B_simple = tr(Sigma) / |G|^2: the noise on top, the signal below",
        ),
    ]
    if not _close(got, 40.0, rtol=1e-6):
        if got < 0:
            _fail(
                name,
                f"returned {got:.4g}, a negative noise scale",
                "check the signs: tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big) is positive",
            )
        for value, problem, hint in mistakes:
            if _close(got, value, rtol=1e-6):
                _fail(name, f"returned {got:.4f} instead of 40: {problem}", hint)
        _fail(
            name,
            f"returned {got:.4f}; on this hand-made case |G|^2 = 1 and tr(Sigma) = 40, so B_simple = 40",
            "per pair: G2 = (B_big g - B_small s)/(B_big - B_small), trS = (s - g)/(1/B_small - 1/B_big); "
            "then trS.mean() / G2.mean()",
        )
    # A statistical case: fresh samples of a linear-regression population with a known B_simple.
    prob = _linreg.LinearProblem()
    w, b = 2.3, -1.0
    exact = prob.noise_scale(w, b)
    s, g = _noise.linear_grad_sq_norms(prob, w, b, 4, 128, 4000, seed=0)
    est = float(_call(name, b_simple, s, g, 4, 128))
    if abs(est / exact - 1) > 0.2:
        _fail(
            name,
            f"on a linear-regression stream with exact B_simple = {exact:.2f} it estimated {est:.2f}",
            "the hand-made case passed, so look for something that depends on the number of pairs or on "
            "the dtype (use all the pairs, in float64)",
        )
    _passed(name, f"hand-made case exact; a stream with B_simple = {exact:.2f} estimated as {est:.2f}")
