"""Self-checks for stage 1: gradient descent vs SGD, batch size (lab1).

Each check runs the student's function on a small case whose answer is known (hand-computed,
the closed-form least-squares solution, the references in utils.linear_regression and
utils.gradient_noise, a loop of torch.autograd.grad over examples for per-example gradients,
numpy.polyfit for the critical-batch fit) and, when it is wrong, names the likely mistake. The
checks of exercises 4 and 5 refuse the library's own functions (utils.gradient_noise's
per_example_grads/noise_scale/dataset_noise_scale/two_batch_estimates, utils.batch_sweeps'
fit_critical_batch), passed in or called."""

import itertools
import math
from collections.abc import Callable
from typing import Any

import torch

from .. import gradient_noise as _noise
from .. import linear_regression as _linreg
from ._common import CheckFailed, _call, _close, _fail, _passed, refusing  # noqa: F401

__all__ = [
    "check_gd_step",
    "check_sgd",
    "check_noise_scale",
    "check_per_example_grads",
    "check_noise_scale_from_per_example",
    "check_fit_critical_batch",
    "check_dataset_noise_scale",
    "check_examples_to_target",
    "check_steps_to_target",
]

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
        r = (w0 * x + b0 - y).double()
        own_batch = any(  # the first step is a right step on some B points, just not the expected ones
            _close(got[1], torch.tensor([w0 - lr * 2 * (r * x)[list(i)].mean(), b0 - lr * 2 * r[list(i)].mean()]))
            for i in itertools.combinations_with_replacement(range(len(x)), B)
        )
        if own_batch or torch.allclose(full, gd_path, rtol=1e-6, atol=1e-9):
            _fail(
                name,
                "the steps are SGD steps, but not on the expected batches: own indices (torch.randint, randperm)",
                "the exercise asks for the batches of utils.linear_regression.minibatches(len(x), batch_size, seed), "
                "in the order it gives them (one epoch after another): take the next one at every step",
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
        _fail(
            name,
            f"returned {type(got).__name__}, expected a float",
            "return one Python float (float() of a 0-d tensor)",
        )
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
            float(((s - g).mean() / (1 / bs - 1 / bb)) / ((bs * g - bb * s).mean() / (bb - bs))),
            "B_small and B_big are swapped in the |G|^2 formula (each norm got the other batch's size)",
            "each squared norm is weighted by its OWN batch size, the big batch's term first",
        ),
        (
            float(G2_i.mean() / trS_i.mean()),
            "the ratio is upside down (|G|^2 / tr(Sigma))",
            "B_simple = tr(Sigma) / |G|^2: the noise on top, the signal below",
        ),
    ]
    if not _close(got, 40.0, rtol=1e-6):
        for value, problem, hint in mistakes:
            if _close(got, value, rtol=1e-6):
                _fail(name, f"returned {got:.4f} instead of 40: {problem}", hint)
        if got < 0:
            _fail(
                name,
                f"returned {got:.4g}, a negative noise scale",
                "check the signs: tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big) is positive",
            )
        _fail(
            name,
            f"returned {got:.4f}; on this hand-made case |G|^2 = 1 and tr(Sigma) = 40, so B_simple = 40",
            "compare each line with the two formulas above the exercise (which batch size goes with which norm, "
            "the signs); average each kind of estimate over the pairs before dividing",
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


# ------------------------------------------------------------------ per-example gradients (lab 1, exercise 4)


def _is_library(name: str, fn, library) -> None:
    if fn is library:
        _fail(
            name,
            f"this is {library.__module__}.{library.__name__}, the library's own function, not yours",
            "write the exercise's function in the cell above and pass that one",
        )


def _loop_per_example(model, loss_fn, x, y) -> torch.Tensor:
    """The oracle: one example at a time, torch.autograd.grad, parameters in model.parameters() order."""
    params = [p for p in model.parameters()]
    rows = []
    for i in range(len(x)):
        gs = torch.autograd.grad(loss_fn(model(x[i : i + 1]), y[i : i + 1]), params)
        rows.append(torch.cat([g.reshape(-1) for g in gs]))
    return torch.stack(rows)


def _per_example_case(name, fn, model, loss_fn, x, y):
    want = _loop_per_example(model, loss_fn, x, y)
    before = [p.detach().clone() for p in model.parameters()]
    unbatched = ""
    try:
        model(x[0])
    except RuntimeError as e:
        unbatched = str(e).split("(")[0]

    def run():
        try:
            return fn(model, loss_fn, x.clone(), y.clone())
        except RuntimeError as e:
            if unbatched and str(e).split("(")[0] == unbatched:
                _fail(
                    name,
                    "the model failed on one example: inside vmap each example has lost its batch dimension",
                    "inside the function vmap maps, give the model x.unsqueeze(0) and the loss y.unsqueeze(0)",
                )
            raise

    how = "loop over the examples" if name.endswith("_loop") else "use torch.func.functional_call, grad and vmap"
    with refusing(name, _noise, ("per_example_grads",), how):
        got = _call(name, run)
    if any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters())):
        _fail(name, "your function changed the model's parameters", "compute gradients only; take no step")
    if isinstance(got, dict):
        _fail(
            name,
            "returned a dict of per-parameter gradients, expected one [B, P] tensor",
            "flatten each [B, ...] gradient to [B, -1] and torch.cat them along dim 1",
        )
    if not isinstance(got, torch.Tensor):
        _fail(name, f"returned {type(got).__name__}, expected a [B, P] tensor", "return one torch.Tensor")
    B, P = want.shape
    if tuple(got.shape) == (P,):
        _fail(
            name,
            f"returned shape ({P},): one gradient for the whole batch, summed or averaged, not one per example",
            "take the gradient of each example's own loss (a loop, or vmap over the examples) so each gets its own row",
        )
    if tuple(got.shape) != (B, P):
        _fail(
            name,
            f"returned shape {tuple(got.shape)}, expected ({B}, {P}): {B} examples, {P} parameters",
            "one row per example; flatten each parameter's gradient and concatenate in model.named_parameters() order",
        )
    got = got.detach().to(torch.float64)
    if torch.allclose(got, want, rtol=1e-6, atol=1e-9):
        return
    if torch.allclose(got * B, want, rtol=1e-6, atol=1e-9):
        _fail(
            name,
            f"each row is 1/{B} of the example's gradient: you differentiated the batch MEAN loss",
            "differentiate the loss of ONE example (a batch of 1), inside the function that vmap maps",
        )
    if torch.allclose(got.sort(1).values, want.sort(1).values, rtol=1e-6, atol=1e-9):
        _fail(
            name,
            "each row holds the right numbers, but the parameters are in another order",
            "concatenate the flattened gradients in model.named_parameters() order",
        )
    if torch.allclose(got, want.cumsum(0), rtol=1e-6, atol=1e-9):
        _fail(
            name,
            "row i is the SUM of the gradients of examples 0..i: .grad accumulates across .backward() calls",
            "clear the gradients before each example (or use torch.autograd.grad, which returns fresh ones)",
        )
    for batch in (want.mean(0), want.sum(0)):
        if torch.allclose(got, batch.expand(B, -1), rtol=1e-6, atol=1e-9):
            _fail(
                name,
                "every row is the same batch gradient: the loss was taken over the whole batch, then copied",
                "take the loss of one example at a time (a batch of one), and its own gradient for its own row",
            )
    if torch.allclose(got.reshape(-1).sort().values, want.reshape(-1).sort().values, rtol=1e-6, atol=1e-9):
        _fail(
            name,
            "the right numbers, in the wrong rows: each [B, ...] gradient was flattened in the wrong order",
            "keep the example dimension first when you flatten each parameter's gradient: B rows, the rest in a row",
        )
    _fail(
        name,
        f"differs from a loop of torch.autograd.grad over the examples (largest gap {float((got - want).abs().max()):.3g})",
        "differentiate the loss of ONE example (a batch of one) with respect to the parameters, the same loss_fn "
        "you are given, and put example i's gradient in row i",
    )


def check_per_example_grads(per_example_grads: Callable[..., Any]) -> None:
    """``per_example_grads(model, loss_fn, x, y)``: the [B, P] tensor whose row i is the gradient of
    example i's loss with respect to all P parameters (flattened, in ``model.named_parameters()``
    order). Compared with a loop of ``torch.autograd.grad`` over the examples, one at a time."""
    name = getattr(per_example_grads, "__name__", "")
    name = name if name.startswith("per_example_grads") else "per_example_grads"
    _is_library(name, per_example_grads, _noise.per_example_grads)
    from .. import models

    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng():  # leave the notebook's random state alone
        torch.manual_seed(0)
        cnn = models.net_for((1, 8, 8), width=4).double()
        reg = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3)).double()
    x = torch.randn(6, 1, 8, 8, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 10, (6,), generator=gen)
    _per_example_case(name, per_example_grads, cnn, torch.nn.CrossEntropyLoss(), x, y)
    # A second model and loss: the function must use the loss it is given, and any target shape.
    x2 = torch.randn(5, 3, 4, generator=gen, dtype=torch.float64)
    y2 = torch.randn(5, 3, generator=gen, dtype=torch.float64)
    _per_example_case(name, per_example_grads, reg, torch.nn.MSELoss(), x2, y2)
    P = sum(p.numel() for p in cnn.parameters())
    _passed(name, f"matches a per-example loop of torch.autograd.grad on a CNN ({P} parameters) and a linear model")


def _one_number(name, got, what):
    if isinstance(got, tuple):
        _fail(name, f"returned a tuple {got!r}, expected one number", f"return {what} only")
    if isinstance(got, torch.Tensor):
        if got.numel() != 1:
            _fail(name, f"returned a tensor of shape {tuple(got.shape)}, expected one number", f"return {what}")
        got = got.item()
    try:
        return float(got)
    except (TypeError, ValueError):
        _fail(name, f"returned {type(got).__name__}, expected a float", f"return float({what})")


def check_noise_scale_from_per_example(noise_scale_from_per_example: Callable[..., Any]) -> None:
    """``noise_scale_from_per_example(g)``: B_simple = tr(Sigma) / |G|^2 from a [B, P] tensor of
    per-example gradients, with unbiased estimates: tr(Sigma) from the sample covariance (divisor
    B - 1) and |G|^2 = |mean|^2 - tr(Sigma) / B."""
    name = "noise_scale_from_per_example"
    fn = noise_scale_from_per_example
    refuse = ("noise_scale", "dataset_noise_scale", "two_batch_estimates")
    try_ = "the mean over rows, the squared deviations from it, their sum over parameters"
    # Hand-made: rows (1,0), (3,0), (1,2), (3,2): mean (2,1), |mean|^2 = 5, squared deviations sum 8,
    # so tr(Sigma) = 8/3, |G|^2 = 5 - (8/3)/4 = 13/3 and B_simple = 8/13.
    g = torch.tensor([[1.0, 0.0], [3.0, 0.0], [1.0, 2.0], [3.0, 2.0]], dtype=torch.float64)
    with refusing(name, _noise, refuse, try_):
        got = _one_number(name, _call(name, fn, g.clone()), "B_simple")
    mistakes = [
        (
            8 / 15,
            "|G|^2 is the squared norm of the mean, which still holds the mean's own noise tr(Sigma)/B",
            "correct it: |G|^2 = |mean|^2 - tr(Sigma) / B",
        ),
        (
            4 / 9,
            "tr(Sigma) divides the squared deviations by B (the population formula): it is biased low",
            "divide the summed squared deviations by B - 1",
        ),
        (
            2 / 5,
            "both estimates are biased: divisor B in tr(Sigma) and no correction of |mean|^2",
            "tr(Sigma) = sum of squared deviations / (B - 1); |G|^2 = |mean|^2 - tr(Sigma) / B",
        ),
        (13 / 8, "the ratio is upside down (|G|^2 / tr(Sigma))", "B_simple = tr(Sigma) / |G|^2: the noise on top"),
        (
            2 / 13,
            "tr(Sigma) was divided by B once more: that is the noise of the MEAN, tr(Sigma)/B",
            "tr(Sigma) is the per-EXAMPLE variance: summed squared deviations / (B - 1), no further / B",
        ),
    ]
    m1 = g.mean(1, keepdim=True)  # the mean taken over each row's parameters instead of over the examples
    trS_1 = float(((g - m1) ** 2).sum() / 3)
    mistakes.append(
        (
            trS_1 / (float((m1**2).sum()) - trS_1 / 4),
            "the mean was taken over the wrong dim: over each row's parameters, not over the examples",
            "the mean gradient averages the B rows (dim 0): one value per parameter",
        )
    )
    if not _close(got, 8 / 13, rtol=1e-6):
        for value, problem, hint in mistakes:
            if _close(got, value, rtol=1e-6):
                _fail(name, f"returned {got:.4f} instead of 8/13 = 0.6154: {problem}", hint)
        _fail(
            name,
            f"on rows (1,0), (3,0), (1,2), (3,2) it returned {got:.4f}; tr(Sigma) = 8/3 and |G|^2 = 13/3, so 8/13",
            "the mean is one row (over the examples); tr(Sigma) sums squared deviations over ALL entries, "
            "divided by B - 1; |G|^2 subtracts the mean's own noise",
        )
    # Linear regression: per-example gradients from utils.gradient_noise, whose dataset_noise_scale
    # uses the population (biased) formulas; turned into the unbiased ones by hand.
    x, y = _linreg.LinearProblem().sample(16, seed=4)
    g = _noise.per_example_grads(x, y, 1.7, -0.6)
    G2_pop, trS_pop, _ = _noise.dataset_noise_scale(x, y, 1.7, -0.6)
    n = len(x)
    want = (trS_pop * n / (n - 1)) / (G2_pop - trS_pop / (n - 1))
    with refusing(name, _noise, refuse, try_):
        got = _one_number(name, _call(name, fn, g.clone()), "B_simple")
    if not _close(got, want, rtol=1e-6):
        _fail(
            name,
            f"the hand-made case passed, but on 16 linear-regression gradients it returned {got:.4f}, not {want:.4f}",
            "take B and P from the tensor's shape (not fixed numbers), sum over all parameters, compute in float64",
        )
    _passed(name, f"hand-made case exact (8/13); 16 linear-regression gradients give {want:.3f} as expected")


# ------------------------------------------------------------------ critical batch size (lab 1, exercise 5)


def _fit_pair(name, got):
    if isinstance(got, dict) or not isinstance(got, (tuple, list)) or len(got) != 2:
        _fail(name, f"returned {got!r}, expected a pair (S_min, B_crit)", "end with `return s_min, b_crit`")
    try:
        return float(got[0]), float(got[1])
    except (TypeError, ValueError, RuntimeError):
        _fail(name, f"returned {got!r}: its entries are not numbers", "return two floats")


def check_fit_critical_batch(fit_critical_batch: Callable[..., Any]) -> None:
    """``fit_critical_batch(batch_sizes, steps)``: least-squares fit of S = S_min + S_min B_crit (1/B)
    (linear in 1/B), returning (S_min, B_crit). Compared with numpy.polyfit."""
    import numpy as np

    from .. import batch_sweeps

    name = "fit_critical_batch"
    _is_library(name, fit_critical_batch, batch_sweeps.fit_critical_batch)

    def run(bs, ss):
        with refusing(name, batch_sweeps, ("fit_critical_batch",), "fit S against 1/B by least squares yourself"):
            return _fit_pair(name, _call(name, fit_critical_batch, list(bs), list(ss)))

    # Exact data on the curve S_min = 200, B_crit = 64.
    bs = [8, 16, 32, 64, 128, 256, 512]
    ss = [200 * (1 + 64 / b) for b in bs]
    got = run(bs, ss)
    if not (_close(got[0], 200, rtol=1e-6) and _close(got[1], 64, rtol=1e-6)):
        k_B, c_B = np.polyfit(bs, ss, 1)
        mistakes = [
            ((200, 200 * 64), "B_crit is the slope S_min * B_crit itself", "divide the slope by the intercept S_min"),
            ((64, 200), "the pair is swapped", "return (S_min, B_crit) in that order"),
            (
                (200 * 64, 1 / 64),
                "the coefficients' order is swapped: numpy.polyfit returns the highest degree first",
                "the first coefficient is the slope (of 1/B), the second the intercept S_min",
            ),
            (
                (c_B, k_B / c_B),
                "S was fitted against B, not against 1/B",
                "the model is linear in 1/B: regress S on 1 / B",
            ),
            ((c_B, k_B), "S was fitted against B, not against 1/B", "the model is linear in 1/B: regress S on 1 / B"),
        ]
        for cand, problem, hint in mistakes:
            if _close(got[0], cand[0], rtol=1e-6) and _close(got[1], cand[1], rtol=1e-6):
                _fail(
                    name,
                    f"returned ({got[0]:.4g}, {got[1]:.4g}) on data made with S_min = 200, B_crit = 64: {problem}",
                    hint,
                )
        if _close(got[0], min(ss), rtol=1e-6) or _close(got[0], 0, atol=1e-6) or not math.isfinite(got[1]):
            _fail(
                name,
                f"returned S_min = {got[0]:.4g}: the intercept was not fitted (it is not the fewest measured steps, nor 0)",
                "fit S = a + k / B with both a and k free: S_min = a, B_crit = k / a",
            )
        _fail(
            name,
            f"on exact data made with S_min = 200, B_crit = 64 it returned ({got[0]:.4g}, {got[1]:.4g})",
            "a least-squares line of S against 1/B: its intercept is S_min, its slope S_min * B_crit",
        )
    # Noisy data: the plain least-squares answer (numpy.polyfit), not a weighted one.
    noise = [1.08, 0.93, 1.05, 0.9, 1.1, 0.95, 1.07, 0.92]
    bs = [4, 8, 16, 32, 64, 128, 256, 1024]
    ss = [150 * (1 + 40 / b) * e for b, e in zip(bs, noise)]
    k, a = np.polyfit(1 / np.asarray(bs, float), np.asarray(ss), 1)
    want = (float(a), float(k / a))
    got = run(bs, ss)
    if not (_close(got[0], want[0], rtol=1e-6) and _close(got[1], want[1], rtol=1e-6)):
        lib = batch_sweeps.fit_critical_batch(bs, ss)
        if _close(got[0], lib[0], rtol=1e-4) and _close(got[1], lib[1], rtol=1e-4):
            _fail(
                name,
                "on noisy data this is a fit of the RELATIVE error, not plain least squares",
                "minimise the sum of squared differences in steps: numpy.polyfit(1 / B, S, 1)",
            )
        _fail(
            name,
            f"exact data passed, but on noisy data it returned ({got[0]:.4g}, {got[1]:.4g}), "
            f"least squares gives ({want[0]:.4g}, {want[1]:.4g})",
            "use every point, unweighted, in one ordinary least-squares line of S against 1/B",
        )
    _passed(name, f"exact data gives (200, 64); noisy data ({want[0]:.1f}, {want[1]:.1f}) as numpy.polyfit")


def _unbiased_scale(g: torch.Tensor) -> float:
    B = g.shape[0]
    mean = g.mean(0)
    trS = ((g - mean) ** 2).sum() / (B - 1)
    return float(trS / ((mean**2).sum() - trS / B))


def check_dataset_noise_scale(dataset_noise_scale: Callable[..., Any]) -> None:
    """``dataset_noise_scale(model, loss_fn, x, y, chunk)``: B_simple over all N examples of (x, y),
    from per-example gradients computed ``chunk`` examples at a time and accumulated (their sum and
    their summed squared norms), with the same unbiased estimates as noise_scale_from_per_example."""
    name = "dataset_noise_scale"
    from .. import models

    gen = torch.Generator().manual_seed(1)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        cnn = models.net_for((1, 8, 8), width=4).double()
    x = torch.randn(10, 1, 8, 8, generator=gen, dtype=torch.float64)
    y = torch.tensor([3, 3, 3, 3, 3, 3, 3, 1, 3, 7])  # mostly one class: a clear mean gradient, |G|^2 > 0
    loss_fn = torch.nn.CrossEntropyLoss()
    g = _loop_per_example(cnn, loss_fn, x, y)
    want = _unbiased_scale(g)
    with refusing(name, _noise, ("per_example_grads", "noise_scale", "dataset_noise_scale"), "accumulate yourself"):
        got = _one_number(name, _call(name, dataset_noise_scale, cnn, loss_fn, x.clone(), y.clone(), 4), "B_simple")
    if _close(got, want, rtol=1e-6):
        _passed(name, f"10 examples in chunks of 4 give B_simple = {want:.4f}, as all 10 per-example gradients at once")
        return
    chunks = [g[i : i + 4] for i in range(0, 10, 4)]
    mean = g.mean(0)
    trS_pop = float(((g - mean) ** 2).sum() / 10)
    mistakes = [
        (
            sum(_unbiased_scale(c) for c in chunks) / len(chunks),
            "you averaged the per-chunk B_simple values",
            "accumulate sums over ALL examples (sum of the gradients, sum of their squared norms), divide once at the end",
        ),
        (
            _unbiased_scale(chunks[0]),
            "only the first chunk was used",
            "loop over every chunk, from the first example to the last, and add up before dividing",
        ),
        (
            _unbiased_scale(g[:8]),
            "the last, shorter chunk was dropped (10 examples in chunks of 4 leave 2)",
            "step through the starts 0, chunk, 2 chunk, ... up to N; the last slice may be shorter, keep it",
        ),
        (
            trS_pop / float((mean**2).sum() - trS_pop / 10),
            "tr(Sigma) divides by N, not N - 1",
            "tr(Sigma) = (sum of |g_i|^2 - N |mean|^2) / (N - 1)",
        ),
        (
            (10 / 9 * trS_pop) / float((mean**2).sum()),
            "|G|^2 is |mean|^2 without the correction for the mean's own noise",
            "|G|^2 = |mean|^2 - tr(Sigma) / N",
        ),
    ]
    for value, problem, hint in mistakes:
        if _close(got, value, rtol=1e-6):
            _fail(name, f"returned {got:.4f} instead of {want:.4f}: {problem}", hint)
    _fail(
        name,
        f"on 10 examples in chunks of 4 it returned {got:.4f}; all 10 per-example gradients at once give {want:.4f}",
        "keep two running totals over every chunk (the summed gradients, the summed squared entries), "
        "divide once by N at the end, then use the unbiased tr(Sigma) and |G|^2 of exercise 4",
    )


def check_examples_to_target(examples_to_target: Callable[..., Any]) -> None:
    """``examples_to_target(batch_sizes, s_min, b_crit)``: E(B) = E_min (1 + B / B_crit) with
    E_min = S_min B_crit, one value per batch size (a numpy array)."""
    import numpy as np

    name = "examples_to_target"
    bs = [16, 64, 256]
    want = np.array([16000.0, 25600.0, 64000.0])  # 200 * 64 * (1 + B / 64)
    got = _call(name, examples_to_target, bs, 200.0, 64.0)
    try:
        got = np.asarray(got, dtype=float).reshape(-1)
    except (TypeError, ValueError):
        _fail(name, f"returned {type(got).__name__}, expected one number per batch size", "return a numpy array")
    if got.shape != want.shape:
        _fail(name, f"returned {got.shape[0]} values for 3 batch sizes", "one E(B) per batch size")
    if np.allclose(got, want, rtol=1e-9):
        _passed(name, "E(16, 64, 256) = 16000, 25600, 64000 for S_min = 200, B_crit = 64")
        return
    mistakes = [
        (200 * (1 + 64 / np.array(bs)), "these are the steps S(B), not the examples", "examples = steps * B"),
        (200 * np.array(bs, float), "this is S_min * B, the examples of perfect scaling", "E(B) = S(B) * B"),
        (200 * 64 * (1 + 64 / np.array(bs)), "B and B_crit are swapped", "E(B) = E_min (1 + B / B_crit)"),
    ]
    for value, problem, hint in mistakes:
        if np.allclose(got, value, rtol=1e-9):
            _fail(name, f"returned {got.tolist()}: {problem}", hint)
    _fail(
        name,
        f"for S_min = 200, B_crit = 64, B = {bs} it returned {got.tolist()}, expected {want.tolist()}",
        "E_min = S_min * B_crit; E(B) = E_min * (1 + B / B_crit)",
    )


def check_steps_to_target(steps_to_target: Callable[..., Any]) -> None:
    """``steps_to_target(batch_sizes, s_min, b_crit)``: S(B) = S_min (1 + B_crit / B) for each batch
    size (a numpy array)."""
    import numpy as np

    name = "steps_to_target"
    bs = [16, 64, 256]
    want = np.array([1000.0, 400.0, 250.0])  # 200 * (1 + 64 / B)
    got = _call(name, steps_to_target, bs, 200.0, 64.0)
    try:
        got = np.asarray(got, dtype=float).reshape(-1)
    except (TypeError, ValueError):
        _fail(name, f"returned {type(got).__name__}, expected one number per batch size", "return a numpy array")
    if got.shape != want.shape:
        _fail(name, f"returned {got.shape[0]} values for 3 batch sizes", "one S(B) per batch size")
    if np.allclose(got, want, rtol=1e-9):
        _passed(name, "S(16, 64, 256) = 1000, 400, 250 for S_min = 200, B_crit = 64")
        return
    mistakes = [
        (np.array([250.0, 400.0, 1000.0]), "B and B_crit are swapped", "S(B) = S_min (1 + B_crit / B): B below"),
        (np.array([1000.0, 400.0, 250.0]) * np.array(bs), "these are the examples E(B), not the steps", "drop the * B"),
        (
            200 * 64 / np.array(bs, float),
            "this is only the perfect-scaling part S_min B_crit / B",
            "add the floor S_min",
        ),
    ]
    for value, problem, hint in mistakes:
        if np.allclose(got, value, rtol=1e-9):
            _fail(name, f"returned {got.tolist()}: {problem}", hint)
    _fail(
        name,
        f"for S_min = 200, B_crit = 64, B = {bs} it returned {got.tolist()}, expected {want.tolist()}",
        "S(B) = S_min * (1 + B_crit / B), with B as a float array",
    )
