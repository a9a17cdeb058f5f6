"""Lab 1's exercises (solutions/lab1_gd_sgd_batch.ipynb) on the exercise engine. Oracles: utils.linear_regression's
GD and SGD, utils.gradient_noise's two-batch estimator, a loop of torch.autograd.grad over the examples, the unbiased
estimates written out, numpy.polyfit, the closed forms of S(B) and E(B); exercises 3 to 5 refuse the library's own
versions."""

import itertools
import math

import numpy as np
import torch

from .. import gradient_noise as _noise
from .. import linear_regression as _linreg
from .. import models as _models
from ..linear_regression import mse_grad as _grad
from .engine import Case, Exercise, Mistake

LAB = "lab1_gd_sgd_batch"


def _converted(got, to):
    """``to(got)``, or ``got`` as it is when it does not convert (the engine then says what it is)."""
    try:
        return to(got)
    except (TypeError, ValueError, RuntimeError):
        return got


def _pair(got) -> tuple:
    a, b = got.reshape(-1).tolist() if hasattr(got, "reshape") else got
    return float(a), float(b)


def _close(a, b) -> bool:
    return torch.allclose(torch.as_tensor(a).double(), torch.as_tensor(b).double(), rtol=1e-6, atol=1e-9)


# ------------------------------------------------------------------ exercises 1 and 2: a GD step, minibatch SGD
def _run_steps(gd_step, case):
    """``steps`` calls of gd_step, each from the pair the last one returned."""
    x, y, w, b, lr, steps = case.args
    for _ in range(steps):
        got = _converted(gd_step(x.clone(), y.clone(), w, b, lr), _pair)
        if not isinstance(got, tuple):
            return got
        w, b = got
    return w, b


def _move(w, b, lr, g):
    return w - lr * g[0], b - lr * g[1]


def _first_step_on_other_points(o) -> bool:
    """The first step is an SGD step on some batch_size points, just not on the expected ones."""
    x, y, w0, b0, lr, _, batch_size, _ = o.case.args
    idx = torch.tensor(list(itertools.combinations_with_replacement(range(len(x)), batch_size)))
    r = w0 * x + b0 - y
    first = torch.stack([w0 - lr * 2 * (r * x)[idx].mean(1), b0 - lr * 2 * r[idx].mean(1)], 1)
    return bool(torch.isclose(first, o.got[1], rtol=1e-6, atol=1e-9).all(1).any())


GD_STEP = Exercise(
    name="gd_step",
    oracle=_linreg.gd_step,
    run=_run_steps,
    passed="one step on two datasets and 400 steps in a row",
    # By hand on the first case: r = (-1, -1.5, -3), dL/dw = 2 mean(r x) = -26/3, dL/db = 2 mean(r) = -11/3.
    cases=lambda: [
        Case(
            (torch.tensor([1.0, 2.0, 3.0]).double(), torch.tensor([2.0, 3.0, 5.0]).double(), 0.5, 0.5, 0.1, 1),
            label="one step on 3 points",
        ),
        Case((*_linreg.LinearProblem().sample(20, seed=1), -1.0, 2.0, 0.05, 1), label="one step on 20 points"),
        Case(
            (*_linreg.LinearProblem().sample(64, seed=3), 0.0, 0.0, 0.2, 400),
            label="400 steps on 64 points, each from where the last ended",
        ),
    ],
    hint="the residual is w x + b - y; w moves by lr times twice the mean of residual times x, b by lr times twice the mean residual",
    mistakes=[
        Mistake(
            "the step goes UP the gradient",
            "gradient descent moves against the gradient: subtract lr times it (check the residual's sign too)",
            variant=lambda x, y, w, b, lr: _move(w, b, -lr, _grad(x, y, w, b)),
        ),
        Mistake(
            "the gradient is half what it should be",
            "the derivative of r squared is 2 r times dr: keep the factor 2 from the square",
            variant=lambda x, y, w, b, lr: _move(w, b, lr / 2, _grad(x, y, w, b)),
        ),
        Mistake(
            "the gradient is a sum over the points, not a mean",
            "the loss is the MEAN squared error: average over the points",
            variant=lambda x, y, w, b, lr: _move(w, b, lr * len(x), _grad(x, y, w, b)),
        ),
        Mistake(
            "w moves correctly but b does not",
            "b's gradient is twice the mean residual: update b too",
            variant=lambda x, y, w, b, lr: (_move(w, b, lr, _grad(x, y, w, b))[0], b),
        ),
        Mistake(
            "b moves correctly but w does not",
            "w's gradient is twice the mean of the residual times x: update w too",
            variant=lambda x, y, w, b, lr: (w, _move(w, b, lr, _grad(x, y, w, b))[1]),
        ),
        Mistake(
            "the two gradients are swapped",
            "w's gradient is the one with x in it, b's is twice the mean residual",
            variant=lambda x, y, w, b, lr: _move(w, b, lr, _grad(x, y, w, b)[::-1]),
        ),
        Mistake(
            "the residual leaves out b",
            "the prediction is w times x plus b: subtract y from that",
            variant=lambda x, y, w, b, lr: _move(w, b, lr, _grad(x, y, w, 0.0)),
        ),
        Mistake(
            "b moved by w's gradient",
            "b's gradient has no x in it: twice the mean residual, not of the residual times x",
            variant=lambda x, y, w, b, lr: _move(w, b, lr, _grad(x, y, w, b)[:1] * 2),
        ),
        Mistake(
            "it does not start from the (w, b) it is given",
            "move the (w, b) each call receives and return the moved pair, keeping nothing between calls",
            variant=lambda x, y, w, b, lr: _move(0.0, 0.0, lr, _grad(x, y, 0.0, 0.0)),
        ),
    ],
)
SGD = Exercise(
    name="sgd",
    answer=("minibatch_sgd",),
    oracle=_linreg.sgd,
    run=lambda f, c: _converted(f(*c.args), lambda g: torch.as_tensor(g, dtype=torch.float64)),
    cases=lambda: [
        Case(
            (*_linreg.LinearProblem().sample(12, seed=5), -1.0, 2.0, 0.05, 9, 3, 7),
            label="9 steps of batch 3 on 12 points",
        ),
        Case(
            (*_linreg.LinearProblem().sample(10, seed=8), 0.5, -0.5, 0.1, 12, 2, 3),
            label="12 steps of batch 2 on 10 points",
        ),
    ],
    rtol=1e-6,
    atol=1e-9,
    passed="two runs of different lengths and batch sizes",
    hint="each step takes the next batch of indices, moves (w, b) by the gradient on those points only, and appends the new pair",
    mistakes=[
        Mistake(
            "the start is missing",
            "begin the path with (w0, b0), then add one row after every step: steps + 1 rows",
            variant=lambda *a: _linreg.sgd(*a)[1:],
            when=lambda o: len(o.got) == len(o.want) - 1,
        ),
        Mistake(
            "the first row is not the start (w0, b0)",
            "the path starts with (w0, b0), before any step",
            variant=lambda x, y, w0, b0, lr, n, *a: _linreg.sgd(x, y, w0, b0, lr, n + 1, *a)[1:],
            when=lambda o: not _close(o.got[0], o.want[0]),
        ),
        Mistake(
            "the path equals full-batch GD: every step used all the data",
            "compute each step's gradient on the current minibatch's points only",
            variant=lambda x, y, w0, b0, lr, n, bs, seed: _linreg.sgd(x, y, w0, b0, lr, n, len(x), seed),
        ),
        Mistake(
            "the steps are batch_size times too long: the minibatch gradient is summed, not averaged",
            "average over the batch, as the MSE does",
            variant=lambda x, y, w0, b0, lr, n, bs, seed: _linreg.sgd(x, y, w0, b0, lr * bs, n, bs, seed),
        ),
        Mistake(
            "the first step is right but later ones are not",
            "take the NEXT batch each step from one shared minibatches iterator, and each gradient at the latest (w, b)",
            variant=lambda x, y, w0, b0, lr, n, bs, seed: _linreg.gd(
                *(t[next(_linreg.minibatches(len(x), bs, seed))] for t in (x, y)), w0, b0, lr, n
            ),
            when=lambda o: _close(o.got[1], o.want[1]),
        ),
        Mistake(
            "the steps are SGD steps, but not on the expected batches (own indices)",
            "use the batches of utils.linear_regression.minibatches, in the order it gives them",
            variant=lambda *a: _linreg.sgd(*a[:-1], a[-1] + 1),
            when=_first_step_on_other_points,
        ),
    ],
)


# ------------------------------------------------------------------ exercise 3: the gradient noise scale from pairs
def _pairs(f):
    """A b_simple that returns f(s, g, b_small, b_big, |G|^2 estimates, tr(Sigma) estimates)."""
    return lambda s, g, bs, bb: float(f(s, g, bs, bb, (bb * g - bs * s) / (bb - bs), (s - g) / (1 / bs - 1 / bb)))


NOISE_SCALE = Exercise(
    name="noise_scale",
    answer=("b_simple",),
    oracle=lambda *a: _noise.noise_scale(*a).b_simple,
    passed="hand-made pairs and a stream",
    # Built so that mean |G_4|^2 = 11 and mean |G_64|^2 = 1.625: |G|^2 = 1, tr(Sigma) = 40, B_simple = 40.
    cases=lambda: [
        Case(
            (torch.tensor([6.0, 16.0, 9.0, 13.0]).double(), torch.tensor([1.2, 2.5, 1.0, 1.8]).double(), 4, 64),
            label="4 hand-made pairs",
        ),
        Case(
            (*_noise.linear_grad_sq_norms(_linreg.LinearProblem(), 2.3, -1.0, 4, 128, 1000), 4, 128),
            label="1000 pairs from a stream",
        ),
    ],
    refuse=("utils.gradient_noise.noise_scale", "utils.gradient_noise.two_batch_estimates"),
    refuse_hint="write the two estimates from the formulas above the exercise",
    hint="compare each line with the two formulas above the exercise (which batch size goes with which norm, the signs), and average each kind of estimate over the pairs before dividing",
    mistakes=[
        Mistake(
            "you averaged the per-pair ratios",
            "average the |G|^2 estimates and the tr(Sigma) estimates SEPARATELY, then divide the two means",
            variant=_pairs(lambda s, g, bs, bb, G2, tr: (tr / G2).mean()),
        ),
        Mistake(
            "|G|^2 was taken as the big batch's |G_big|^2",
            "the big batch's norm still holds noise: weight each norm by its batch size, as in the formula",
            variant=_pairs(lambda s, g, bs, bb, G2, tr: tr.mean() / g.mean()),
        ),
        Mistake(
            "tr(Sigma) was divided by (B_big - B_small)",
            "divide the difference of the norms by the difference of the batch sizes' reciprocals",
            variant=_pairs(lambda s, g, bs, bb, G2, tr: (s - g).mean() / (bb - bs) / G2.mean()),
        ),
        Mistake(
            "b_small and b_big are swapped in |G|^2",
            "the big batch's norm is weighted by B_big, and B_big - B_small is below",
            variant=_pairs(lambda s, g, bs, bb, G2, tr: tr.mean() / ((bs * g - bb * s) / (bs - bb)).mean()),
        ),
        Mistake(
            "B_small and B_big are swapped in the |G|^2 formula (each norm got the other batch's size)",
            "weight each squared norm by its OWN batch size, the big batch's term first",
            variant=_pairs(lambda s, g, bs, bb, G2, tr: tr.mean() / ((bs * g - bb * s) / (bb - bs)).mean()),
        ),
        Mistake(
            "the ratio is upside down (|G|^2 / tr(Sigma))",
            "B_simple is tr(Sigma) over |G|^2: the noise on top, the signal below",
            variant=_pairs(lambda s, g, bs, bb, G2, tr: G2.mean() / tr.mean()),
        ),
        Mistake(
            "the first 4 pairs give the right value but more pairs give a wrong one: some pairs are left out",
            "average over all the pairs you are given, in float64",
            variant=_pairs(lambda s, g, bs, bb, G2, tr: tr[:4].mean() / G2[:4].mean()),
        ),
        Mistake(
            "the noise scale is negative",
            "check the signs: the small batch's norm minus the big batch's, over 1/B_small minus 1/B_big, is positive",
            variant=_pairs(lambda s, g, bs, bb, G2, tr: -tr.mean() / G2.mean()),
            when=lambda o: o.got < 0,
        ),
    ],
)


# ------------------------------------------------------------------ exercise 4: per-example gradients and the noise scale
def _models_cases() -> list:
    gen, f64 = torch.Generator().manual_seed(0), torch.float64
    with torch.random.fork_rng():  # leave the notebook's random state alone
        torch.manual_seed(0)
        cnn = _models.net_for((1, 8, 8), width=4).double()
        reg = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3)).double()
    x, y = torch.randn(8, 1, 8, 8, generator=gen, dtype=f64), torch.tensor([3, 3, 3, 1, 3, 7, 3, 3])
    x2, y2 = torch.randn(10, 3, 4, generator=gen, dtype=f64), torch.randn(10, 3, generator=gen, dtype=f64)
    return [
        Case((cnn, torch.nn.CrossEntropyLoss(), x, y), label="a CNN and cross-entropy on 8 examples"),
        Case((reg, torch.nn.MSELoss(), x2, y2), label="a linear model and the MSE on 10 examples"),
    ]


def _per_param(model, loss_fn, x, y, one=lambda t, i: t[i : i + 1]) -> list:
    """Per parameter, the [B, ...] stack of each example's own gradient: a loop of torch.autograd.grad."""
    params = list(model.parameters())
    rows = [torch.autograd.grad(loss_fn(model(one(x, i)), one(y, i)), params) for i in range(len(x))]
    return [torch.stack(gs) for gs in zip(*rows)]


def _per_example(model, loss_fn, x, y):
    return torch.cat([t.reshape(len(x), -1) for t in _per_param(model, loss_fn, x, y)], 1)


def _run_keeping_parameters(fn, case):
    before = [p.detach().clone() for p in case.args[0].parameters()]
    got = fn(*case.args)
    if any(not torch.equal(a, p.detach()) for a, p in zip(before, case.args[0].parameters())):
        raise RuntimeError("the function changed the model's parameters")
    return got


def _b_simple(g, dim=0, ddof=1, correct=True, B=None) -> float:
    """tr(Sigma) / |G|^2 from [B, P] gradients: squared deviations over B - ddof; |mean|^2 less tr(Sigma)/B if ``correct``."""
    g = torch.as_tensor(g).double()
    B = B or g.shape[0]
    mean = g.mean(dim, keepdim=True)
    tr = ((g - mean) ** 2).sum() / (B - ddof)
    return float(tr / ((mean**2).sum() - (tr / B if correct else 0)))


def _chunks(m, f, x, y, c) -> list:
    return [_per_example(m, f, x[i : i + c], y[i : i + c]) for i in range(0, len(x), c)]


_PER_EXAMPLE = dict(
    cases=_models_cases,
    oracle=_per_example,
    run=_run_keeping_parameters,
    rtol=1e-6,
    atol=1e-9,
    refuse=("utils.gradient_noise.per_example_grads",),
    passed="a CNN with cross-entropy and a linear model with the MSE",
    hint="differentiate the loss of ONE example with respect to the parameters, with the loss_fn you are given, and put example i's gradient in row i",
    mistakes=[
        Mistake(
            "the model failed on a single example: it lost its batch dimension",
            "give the model a batch of one example: the slice i to i+1 in a loop, or x and y unsqueezed at dim 0 inside the function vmap maps",
            variant=lambda m, f, x, y: _per_param(m, f, x, y, one=lambda t, i: t[i]),
            when=lambda o: "shapes cannot be multiplied" in o.error,
        ),
        Mistake(
            "your function changed the model's parameters",
            "compute the gradients only, and take no step",
            variant=lambda m, f, x, y: (_per_example(m, f, x, y), [p.data.mul_(0.9) for p in m.parameters()])[0],
            when=lambda o: "changed the model's parameters" in o.error,
        ),
        Mistake(
            "it returned a dict of per-parameter gradients, not one [B, P] tensor",
            "flatten each [B, ...] gradient to B rows and concatenate them along dim 1",
            variant=lambda m, f, x, y: dict(zip(dict(m.named_parameters()), _per_param(m, f, x, y))),
            when=lambda o: isinstance(o.got, dict),
        ),
        Mistake(
            "it returned one gradient for the whole batch, not one per example",
            "take the gradient of each example's own loss, so that each example gets its own row",
            variant=lambda m, f, x, y: _per_example(m, f, x, y).sum(0),
            when=lambda o: o.got.shape == o.want.shape[1:],
        ),
        Mistake(
            "each row is 1/B of the example's gradient: you differentiated the batch MEAN loss",
            "differentiate the loss of ONE example, a batch of one",
            variant=lambda m, f, x, y: _per_example(m, f, x, y) / len(x),
        ),
        Mistake(
            "row i is the SUM of the gradients of examples 0 to i: .grad accumulates across .backward() calls",
            "clear the gradients before each example, or use torch.autograd.grad, which returns fresh ones",
            variant=lambda m, f, x, y: _per_example(m, f, x, y).cumsum(0),
        ),
        Mistake(
            "every row is the same batch gradient: the loss was taken over the whole batch, then copied",
            "take the loss of one example at a time, and its own gradient for its own row",
            variant=lambda m, f, x, y: _per_example(m, f, x, y).mean(0).expand(len(x), -1),
            when=lambda o: any(_close(o.got, o.want.mean(0).expand_as(o.want) * k) for k in (1, len(o.want))),
        ),
        Mistake(
            "each row holds the right numbers, but the parameters are in another order",
            "concatenate the flattened gradients in model.named_parameters() order",
            variant=lambda m, f, x, y: torch.cat([t.flatten(1) for t in _per_param(m, f, x, y)[::-1]], 1),
            when=lambda o: _close(o.got.sort(1)[0], o.want.sort(1)[0]),
        ),
        Mistake(
            "the right numbers, in the wrong rows: each [B, ...] gradient was flattened in the wrong order",
            "keep the example dimension first when you flatten each parameter's gradient",
            variant=lambda m, f, x, y: torch.cat([t.reshape(-1, len(x)) for t in _per_param(m, f, x, y)]).T,
            when=lambda o: _close(o.got.flatten().sort()[0], o.want.flatten().sort()[0]),
        ),
    ],
)
PER_EXAMPLE_GRADS_LOOP = Exercise(
    name="per_example_grads_loop",
    refuse_hint="loop over the examples, one torch.autograd.grad call on each example's own loss",
    **_PER_EXAMPLE,
)
PER_EXAMPLE_GRADS = Exercise(
    name="per_example_grads", refuse_hint="use torch.func.functional_call, grad and vmap", **_PER_EXAMPLE
)
NOISE_SCALE_FROM_PER_EXAMPLE = Exercise(
    name="noise_scale_from_per_example",
    oracle=_b_simple,
    passed="three sets of per-example gradients",
    # By hand on the first case: mean (2, 1), |mean|^2 = 5, squared deviations 8, tr(Sigma) = 8/3, |G|^2 = 13/3: 8/13.
    cases=lambda: [
        Case((torch.tensor([[1.0, 0.0], [3.0, 0.0], [1.0, 2.0], [3.0, 2.0]]).double(),), label="4 hand-made gradients"),
        Case(
            (_noise.per_example_grads(*_linreg.LinearProblem().sample(16, seed=4), 1.7, -0.6),),
            label="16 linear-regression gradients",
        ),
        Case(
            (torch.randn(9, 6, generator=torch.Generator().manual_seed(2)).double() + 0.7,),
            label="9 gradients of 6 parameters",
        ),
    ],
    refuse=(
        "utils.gradient_noise.noise_scale",
        "utils.gradient_noise.dataset_noise_scale",
        "utils.gradient_noise.two_batch_estimates",
    ),
    refuse_hint="use the mean over the rows, the squared deviations from it, and their sum over the parameters",
    hint="the mean is one row, taken over the examples; tr(Sigma) sums the squared deviations over ALL entries and divides by B - 1; |G|^2 subtracts the mean's own noise",
    mistakes=[
        Mistake(
            "|G|^2 is the squared norm of the mean, which still holds the mean's own noise tr(Sigma)/B",
            "correct it: subtract tr(Sigma) / B from the squared norm of the mean",
            variant=lambda g: _b_simple(g, correct=False),
        ),
        Mistake(
            "tr(Sigma) divides the squared deviations by B (the population formula): it is biased low",
            "divide the summed squared deviations by B - 1",
            variant=lambda g: _b_simple(g, ddof=0),
        ),
        Mistake(
            "both estimates are biased: divisor B in tr(Sigma) and no correction of |mean|^2",
            "divide the squared deviations by B - 1, and subtract tr(Sigma) / B from the squared norm of the mean",
            variant=lambda g: _b_simple(g, ddof=0, correct=False),
        ),
        Mistake(
            "the ratio is upside down (|G|^2 / tr(Sigma))",
            "B_simple is tr(Sigma) over |G|^2: the noise on top",
            variant=lambda g: 1 / _b_simple(g),
        ),
        Mistake(
            "tr(Sigma) was divided by B once more: that is the noise of the MEAN, tr(Sigma)/B",
            "tr(Sigma) is the per-EXAMPLE variance: the summed squared deviations over B - 1, no further division",
            variant=lambda g: _b_simple(g) / len(g),
        ),
        Mistake(
            "the mean was taken over the wrong dim: over each row's parameters, not over the examples",
            "the mean gradient averages the B rows (dim 0): one value per parameter",
            variant=lambda g: _b_simple(g, dim=1),
        ),
        Mistake(
            "it returned a tuple, not one number",
            "return B_simple only, as a float",
            variant=lambda g: (_b_simple(g), 1.0),
            when=lambda o: isinstance(o.got, tuple),
        ),
        Mistake(
            "it is right for 4 examples but not for other numbers of examples",
            "take B and P from the tensor's shape, not fixed numbers",
            variant=lambda g: _b_simple(g, B=4),
        ),
    ],
)
DATASET_NOISE_SCALE = Exercise(
    name="dataset_noise_scale",
    oracle=lambda m, f, x, y, c: _b_simple(_per_example(m, f, x, y)),
    rtol=1e-6,
    passed="two models, in chunks that leave a shorter last one",
    cases=lambda: [
        Case((*case.args, c), label=f"{case.label} in chunks of {c}") for case, c in zip(_models_cases(), (3, 4))
    ],
    refuse=(
        "utils.gradient_noise.per_example_grads",
        "utils.gradient_noise.noise_scale",
        "utils.gradient_noise.dataset_noise_scale",
    ),
    refuse_hint="accumulate the sums yourself, with your own per_example_grads",
    hint="keep two running totals over every chunk (the summed gradients, the summed squared entries), divide once by N at the end, then use the unbiased tr(Sigma) and |G|^2",
    mistakes=[
        Mistake(
            "you averaged the per-chunk B_simple values",
            "accumulate sums over ALL examples (of the gradients, of their squared entries) and divide once at the end",
            variant=lambda m, f, x, y, c: float(np.mean([_b_simple(g) for g in _chunks(m, f, x, y, c)])),
        ),
        Mistake(
            "only the first chunk was used",
            "loop over every chunk, from the first example to the last, and add up before dividing",
            variant=lambda m, f, x, y, c: _b_simple(_chunks(m, f, x, y, c)[0]),
        ),
        Mistake(
            "the last, shorter chunk was dropped",
            "start a chunk at every multiple of the chunk size below N; the last slice may be shorter, keep it",
            variant=lambda m, f, x, y, c: _b_simple(_per_example(m, f, x[: len(x) // c * c], y[: len(x) // c * c])),
        ),
        Mistake(
            "tr(Sigma) divides by N, not N - 1",
            "the sum of the squared norms less N times the squared norm of the mean, over N - 1",
            variant=lambda m, f, x, y, c: _b_simple(_per_example(m, f, x, y), ddof=0),
        ),
        Mistake(
            "|G|^2 is |mean|^2 without the correction for the mean's own noise",
            "subtract tr(Sigma) / N from the squared norm of the mean",
            variant=lambda m, f, x, y, c: _b_simple(_per_example(m, f, x, y), correct=False),
        ),
    ],
)


# ------------------------------------------------------------------ exercise 5: the critical batch size
def _line(bs, ss, against_b=False) -> tuple:
    """(intercept, slope) of the least-squares line of the steps against 1/B (or B)."""
    B = np.asarray(bs, dtype=float)
    slope, intercept = np.polyfit(B if against_b else 1 / B, np.asarray(ss, dtype=float), 1)
    return float(intercept), float(slope)


def _relative_fit(bs, ss) -> tuple:
    B, S = np.asarray(bs, dtype=float), np.asarray(ss, dtype=float)
    (a, k), *_ = np.linalg.lstsq(np.stack([np.ones_like(B), 1 / B], 1) / S[:, None], np.ones_like(S), rcond=None)
    return float(a), float(k / a)


def _steps(bs, s_min, b_crit):
    return s_min * (1 + b_crit / np.asarray(bs, dtype=float))


FIT_CRITICAL_BATCH = Exercise(
    name="fit_critical_batch",
    oracle=lambda bs, ss: (lambda a, k: (a, k / a))(*_line(bs, ss)),
    run=lambda f, c: _converted(f(*c.args), _pair),
    cases=lambda: [
        Case(
            ([2**k for k in range(3, 10)], [200 * (1 + 64 / 2**k) for k in range(3, 10)]),
            label="steps on the curve itself, at 7 batch sizes",
        ),
        Case(
            (
                bs := [4, 8, 16, 32, 64, 128, 256, 1024],
                [150 * (1 + 40 / b) * e for b, e in zip(bs, [1.08, 0.93, 1.05, 0.9, 1.1, 0.95, 1.07, 0.92])],
            ),
            label="noisy steps at 8 batch sizes",
        ),
    ],
    rtol=1e-6,
    refuse=("utils.batch_sweeps.fit_critical_batch",),
    refuse_hint="fit the steps against 1/B by least squares yourself",
    passed="exact and noisy steps, as numpy.polyfit",
    hint="fit one ordinary least-squares line of the steps against 1/B, using every point: its intercept is S_min, its slope S_min times B_crit",
    mistakes=[
        Mistake("B_crit is the slope S_min * B_crit itself", "divide the slope by the intercept S_min", variant=_line),
        Mistake(
            "the pair is swapped",
            "return (S_min, B_crit) in that order",
            variant=lambda bs, ss: (lambda a, k: (k / a, a))(*_line(bs, ss)),
        ),
        Mistake(
            "the coefficients' order is swapped: numpy.polyfit returns the highest degree first",
            "the first coefficient is the slope (of 1/B), the second the intercept S_min",
            variant=lambda bs, ss: (lambda k, a: (a, k / a))(*_line(bs, ss)),
        ),
        Mistake(
            "S was fitted against B, not against 1/B",
            "the model is linear in 1/B: regress the steps on one over the batch size",
            variant=lambda bs, ss: (lambda a, k: (a, k / a))(*_line(bs, ss, against_b=True)),
        ),
        Mistake(
            "the intercept was not fitted (it is not the fewest measured steps, nor 0)",
            "fit a + k / B with both a and k free: S_min is a, B_crit is k / a",
            variant=lambda bs, ss: (min(ss), _line(bs, ss)[1] / min(ss)),
            when=lambda o: (
                math.isclose(o.got[0], min(o.case.args[1])) or abs(o.got[0]) < 1e-6 or not math.isfinite(o.got[1])
            ),
        ),
        Mistake(
            "this is a fit of the RELATIVE error, not plain least squares",
            "minimise the sum of squared differences in steps, every point weighted alike",
            variant=_relative_fit,
        ),
    ],
)
STEPS_TO_TARGET = Exercise(
    name="steps_to_target",
    oracle=_steps,
    run=lambda f, c: _converted(f(*c.args), lambda g: torch.as_tensor(np.asarray(g, dtype=float)).reshape(-1)),
    cases=lambda: [
        Case(([16, 64, 256], 200.0, 64.0), label="3 batch sizes"),
        Case(([8, 100, 1000, 5000], 50.0, 120.0), label="4 batch sizes"),
    ],
    passed="two sets of batch sizes",
    hint="S(B) is S_min times one plus B_crit over B, with the batch sizes as a float array",
    mistakes=[
        Mistake(
            "B and B_crit are swapped",
            "B_crit goes on top and the batch size below",
            variant=lambda bs, s, b: s * (1 + np.asarray(bs) / b),
        ),
        Mistake(
            "these are the examples E(B), not the steps",
            "drop the factor B",
            variant=lambda bs, s, b: _steps(bs, s, b) * np.asarray(bs),
        ),
        Mistake(
            "this is only the perfect-scaling part S_min B_crit / B",
            "add the floor S_min",
            variant=lambda bs, s, b: s * b / np.asarray(bs),
        ),
    ],
)
EXAMPLES_TO_TARGET = Exercise(
    name="examples_to_target",
    oracle=lambda bs, s, b: _steps(bs, s, b) * np.asarray(bs),
    run=STEPS_TO_TARGET.run,
    cases=STEPS_TO_TARGET.cases,
    passed="two sets of batch sizes",
    hint="E_min is S_min times B_crit, and E(B) is E_min times one plus B over B_crit",
    mistakes=[
        Mistake("these are the steps S(B), not the examples", "the examples are the steps times B", variant=_steps),
        Mistake(
            "this is S_min * B, the examples of perfect scaling",
            "E(B) is S(B) times B",
            variant=lambda bs, s, b: s * np.asarray(bs),
        ),
        Mistake(
            "B and B_crit are swapped",
            "E(B) is E_min times one plus B over B_crit",
            variant=lambda bs, s, b: s * b * (1 + b / np.asarray(bs)),
        ),
    ],
)

check_gd_step = GD_STEP.checker(
    "``gd_step(x, y, w, b, lr)``: one full-batch GD step on the MSE, returning the new (w, b)."
)
check_sgd = SGD.checker("``minibatch_sgd(x, y, w0, b0, lr, steps, batch_size, seed)``: the (steps + 1, 2) path of SGD.")
check_noise_scale = NOISE_SCALE.checker(
    "``b_simple(sq_small, sq_big, b_small, b_big)``: B_simple from pairs of batches."
)
check_per_example_grads_loop = PER_EXAMPLE_GRADS_LOOP.checker(
    "``per_example_grads_loop(model, loss_fn, x, y)``: [B, P], by a loop."
)
check_per_example_grads = PER_EXAMPLE_GRADS.checker(
    "``per_example_grads(model, loss_fn, x, y)``: [B, P] with torch.func."
)
check_noise_scale_from_per_example = NOISE_SCALE_FROM_PER_EXAMPLE.checker(
    "``noise_scale_from_per_example(g)``: B_simple."
)
check_dataset_noise_scale = DATASET_NOISE_SCALE.checker(
    "``dataset_noise_scale(model, loss_fn, x, y, chunk)``: B_simple."
)
check_fit_critical_batch = FIT_CRITICAL_BATCH.checker("``fit_critical_batch(batch_sizes, steps)``: (S_min, B_crit).")
check_steps_to_target = STEPS_TO_TARGET.checker("``steps_to_target(batch_sizes, s_min, b_crit)``: S(B) per batch size.")
check_examples_to_target = EXAMPLES_TO_TARGET.checker(
    "``examples_to_target(batch_sizes, s_min, b_crit)``: E(B) per batch size."
)

__all__ = [name for name in dir() if name.startswith("check_")]
