"""Lab 1's exercises (solutions/lab1_gd_sgd_batch.ipynb). Oracles: utils.linear_regression's GD and SGD,
utils.gradient_noise's two-batch estimator, a loop of torch.autograd.grad over the examples, the unbiased estimates
written out, numpy.polyfit, the closed forms of S(B) and E(B); exercises 3 to 5 refuse the library's own versions."""

import contextlib
import copy
import itertools
import math
import weakref
from functools import partial

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from .. import gradient_noise as _noise
from .. import linear_regression as _linreg
from .. import models as _models
from ..linear_regression import mse_grad as _grad
from .engine import Case, Exercise, difference
from .engine import mistake as _m

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
    return difference(torch.as_tensor(a).double(), torch.as_tensor(b).double(), 1e-6, 1e-9) is None


def _float32_digits(got, want) -> bool:
    """``got`` differs from ``want`` in the digits float32 loses: not within 1e-10, but within 1e-5."""
    return difference(got, want, 1e-10, 1e-12) is not None and difference(got, want, 1e-5, 1e-7) is None


def _keeping(run=lambda f, case: f(*case.args)):
    """``run``, which must leave the case's arguments as they were given: the caller uses them again."""

    def kept(fn, case):
        before = copy.deepcopy(case.args)
        got = run(fn, case)
        if difference(list(case.args), list(before), 0, 0) is not None:
            raise ValueError("the function changed the arguments it was given")
        return got

    return kept


def _changed(variant):  # the mistake of an answer that changes its arguments in place (``variant`` does)
    return _m(
        "your function changed the arguments it was given, in place. Try: compute new values, with no -=, sub_, add_ "
        "or slice assignment on an argument",
        variant,
        when=lambda o: "changed the arguments" in o.error,
    )


# ------------------------------------------------------------------ exercises 1 and 2: a GD step, minibatch SGD
@_keeping
def _run_steps(gd_step, case):
    """``steps`` calls of gd_step, each from the pair the last one returned."""
    x, y, w, b, lr, steps = case.args
    for _ in range(steps):
        got = _converted(gd_step(x, y, w, b, lr), _pair)
        if not (isinstance(got, tuple) and len(got) == 2):
            return got
        w, b = got
    return w, b


def _gd(f):
    """A gd_step whose new (w, b) is ``f(w, b, lr * dL/dw, lr * dL/db, x)``."""
    return lambda x, y, w, b, lr: f(w, b, *(lr * d for d in _grad(x, y, w, b)), x)


def _first_step_on_other_points(o) -> bool:
    """The first step is an SGD step on some batch_size points, just not on the expected ones."""
    x, y, w0, b0, lr, _, batch_size, _ = o.case.args
    idx = torch.tensor(list(itertools.combinations_with_replacement(range(len(x)), batch_size)))
    r = w0 * x + b0 - y
    first = torch.stack([w0 - lr * 2 * (r * x)[idx].mean(1), b0 - lr * 2 * r[idx].mean(1)], 1)
    return bool(torch.isclose(first, o.got[1], rtol=1e-6, atol=1e-9).all(1).any())


_points = lambda n, seed: _linreg.LinearProblem().sample(n, seed=seed)
GD_STEP = Exercise(
    name="gd_step",
    oracle=_linreg.gd_step,
    run=_run_steps,
    passed="one step on two datasets and 400 steps in a row",
    refuse=("utils.linear_regression.mse_grad", "utils.linear_regression.gd"),
    refuse_hint="compute the residual and the two gradients yourself, from the formulas above the exercise",
    # By hand on the first case: r = (-1.25, -1.75, -3.25), dL/dw = 2 mean(r x) = -29/3, dL/db = 2 mean(r) = -25/6.
    cases=lambda: [
        Case(
            (torch.tensor([1.0, 2, 3]).double(), torch.tensor([2.0, 3, 5]).double(), 0.5, 0.25, 0.1, 1),
            label="one step on 3 points",
        ),
        Case((*_points(20, 1), -1.0, 2.0, 0.05, 1), label="one step on 20 points"),
        Case((*_points(64, 3), 0.0, 0.0, 0.2, 400), label="400 steps on 64 points, each from where the last ended"),
    ],
    hint="the residual is w x + b - y; w moves by lr times twice the mean of residual times x, b by lr times twice the "
    "mean residual",
    mistakes=[
        _m(
            "the step goes UP the gradient. Try: move against the gradient, subtracting lr times it (check the "
            "residual's sign too)",
            _gd(lambda w, b, dw, db, x: (w + dw, b + db)),
        ),
        _m(
            "the gradient is half what it should be. Try: the derivative of r squared is 2 r times dr: keep the factor "
            "2",
            _gd(lambda w, b, dw, db, x: (w - dw / 2, b - db / 2)),
        ),
        _m(
            "the gradient is a sum over the points, not a mean. Try: the loss is the MEAN squared error: average",
            _gd(lambda w, b, dw, db, x: (w - dw * len(x), b - db * len(x))),
        ),
        _m(
            "w moves correctly but b does not. Try: b's gradient is twice the mean residual: update b too",
            _gd(lambda w, b, dw, db, x: (w - dw, b)),
        ),
        _m(
            "b moves correctly but w does not. Try: w's gradient is twice the mean of the residual times x: update w "
            "too",
            _gd(lambda w, b, dw, db, x: (w, b - db)),
        ),
        _m(
            "the pair is in the wrong order. Try: return (w, b), the new w first",
            _gd(lambda w, b, dw, db, x: (b - db, w - dw)),
        ),
        _changed(lambda x, y, w, b, lr: (_linreg.gd_step(x, y, w, b, lr), y.add_(1.0))[0]),
        _m(
            "the two gradients are swapped. Try: w's gradient is the one with x in it, b's is twice the mean residual",
            _gd(lambda w, b, dw, db, x: (w - db, b - dw)),
        ),
        _m(
            "the residual leaves out b. Try: the prediction is w times x plus b: subtract y from that",
            lambda x, y, w, b, lr: tuple(v - lr * d for v, d in zip((w, b), _grad(x, y, w, 0.0))),
        ),
        _m(
            "b moved by w's gradient. Try: b's gradient is twice the mean residual, with no x in it",
            _gd(lambda w, b, dw, db, x: (w - dw, b - dw)),
        ),
        _m(
            "it does not start from the (w, b) it is given. Try: move the (w, b) each call receives, keeping nothing "
            "between calls",
            lambda x, y, w, b, lr: _linreg.gd_step(x, y, 0.0, 0.0, lr),
        ),
    ],
)


def _sgd(x, y, w0, b0, lr, n, bs, seed, lr_x=1.0, bs_all=False, steps_more=0):
    """utils.linear_regression.sgd with ``lr`` times ``lr_x``, batches of all the data, ``steps_more`` steps."""
    return _linreg.sgd(x, y, w0, b0, lr * lr_x, n + steps_more, len(x) if bs_all else bs, seed)


SGD = Exercise(
    name="sgd",
    answer=("minibatch_sgd",),
    oracle=_linreg.sgd,
    rtol=1e-10,
    atol=1e-12,  # float32 rounding fails
    refuse=("utils.linear_regression.gd_step", "utils.linear_regression.gd"),
    refuse_hint="step with your own gd_step",
    run=lambda f, c: _converted(
        f(*c.args), lambda g: g if torch.is_tensor(g) else torch.as_tensor(g, dtype=torch.float64)
    ),
    cases=lambda: [
        Case((*_points(12, 5), -1.0, 2.0, 0.05, 9, 3, 7), label="9 steps of batch 3 on 12 points"),
        Case((*_points(10, 8), 0.5, -0.5, 0.1, 12, 2, 3), label="12 steps of batch 2 on 10 points"),
    ],
    passed="two runs of different lengths and batch sizes",
    hint="each step takes the next batch of indices, moves (w, b) by the gradient on those points only, and appends "
    "the new pair",
    mistakes=[
        _m(
            "the path is float32, or went through float32 (torch.tensor of Python floats is float32), so it keeps "
            "fewer digits than the data. Try: make every tensor of the path with dtype=torch.float64",
            lambda *a: _sgd(*a).float(),
            mechanism=True,
            when=lambda o: (
                torch.is_tensor(o.got)
                and o.got.shape == o.want.shape
                and (o.got.dtype != torch.float64 or _float32_digits(o.got, o.want))
            ),
        ),
        _m(
            "the path is transposed: it has 2 rows. Try: one row per point, a tensor of shape (steps + 1, 2)",
            lambda *a: _sgd(*a).T,
            when=lambda o: tuple(o.got.shape) == tuple(o.want.shape)[::-1],
        ),
        _m(
            "the path has one row too many or too few: the loop ran steps + 1 or steps - 1 times. Try: after the start "
            "row, run exactly as many steps as `steps` says, one row each",
            lambda *a: _sgd(*a, steps_more=1),
            when=lambda o: abs(len(o.got) - len(o.want)) == 1 and _close(o.got[0], o.want[0]),
        ),
        _m(
            "the start is missing. Try: begin the path with (w0, b0), then add one row per step: steps + 1 rows",
            lambda *a: _sgd(*a)[1:],
            when=lambda o: len(o.got) == len(o.want) - 1,
        ),
        _m(
            "the first row is not the start (w0, b0). Try: the path starts with (w0, b0), before any step",
            lambda *a: _sgd(*a, steps_more=1)[1:],
            when=lambda o: not _close(o.got[0], o.want[0]),
        ),
        _m(
            "the path equals full-batch GD: every step used all the data. Try: take each step's gradient on the "
            "current minibatch only",
            partial(_sgd, bs_all=True),
        ),
        _m(
            "the steps are batch_size times too long: the minibatch gradient is summed. Try: average it, as the MSE "
            "does",
            lambda *a: _sgd(*a, lr_x=a[6]),
        ),
        _m(
            "the first step is right but later ones are not. Try: take the NEXT batch each step from one minibatches "
            "iterator, and each gradient at the latest (w, b)",
            lambda x, y, w0, b0, lr, n, bs, seed: _linreg.gd(
                *(t[next(_linreg.minibatches(len(x), bs, seed))] for t in (x, y)), w0, b0, lr, n
            ),
            when=lambda o: _close(o.got[1], o.want[1]),
        ),
        _m(
            "the steps are SGD steps, but not on the expected batches. Try: use the batches of "
            "utils.linear_regression.minibatches, in its order",
            lambda *a: _sgd(*a[:-1], a[-1] + 1),
            when=_first_step_on_other_points,
        ),
    ],
)


# ------------------------------------------------------------------ exercise 3: the gradient noise scale from pairs
def _no_ratio(variant):  # the mistake of dividing by a |G|^2 estimate that is not positive (``variant`` does)
    return _m(
        "the mean |G|^2 estimate is not positive here: the noise hides the gradient, and the ratio means nothing. Try: "
        "return infinity (math.inf) when the |G|^2 estimate is zero or negative",
        variant,
        when=lambda o: o.want == math.inf and float(o.got) <= 0,
    )


def _pairs(f):
    """A b_simple that returns f(s, g, b_small, b_big, |G|^2 estimates, tr(Sigma) estimates)."""
    return lambda s, g, bs, bb: float(f(s, g, bs, bb, (bb * g - bs * s) / (bb - bs), (s - g) / (1 / bs - 1 / bb)))


NOISE_SCALE = Exercise(
    name="noise_scale",
    answer=("b_simple",),
    oracle=lambda *a: _noise.noise_scale(*a).b_simple,
    run=_keeping(),
    passed="hand-made pairs, a stream, and pairs too noisy to measure",
    # Built so that mean |G_4|^2 = 11 and mean |G_64|^2 = 1.625: |G|^2 = 1, tr(Sigma) = 40, B_simple = 40.
    cases=lambda: [
        Case(
            (torch.tensor([6.0, 16, 9, 13]).double(), torch.tensor([1.2, 2.5, 1.0, 1.8]).double(), 4, 64),
            label="4 hand-made pairs",
        ),
        Case(
            (*_noise.linear_grad_sq_norms(_linreg.LinearProblem(), 2.3, -1.0, 4, 128, 1000), 4, 128),
            label="1000 pairs from a stream",
        ),
        Case(
            (torch.tensor([10.0, 12]).double(), torch.tensor([0.4, 0.5]).double(), 4, 64),
            label="2 pairs whose mean |G|^2 estimate is negative",
        ),
    ],
    refuse=("utils.gradient_noise.noise_scale", "utils.gradient_noise.two_batch_estimates"),
    refuse_hint="write the two estimates from the formulas above the exercise",
    hint="compare each line with the two formulas above the exercise (which batch size goes with which norm, the "
    "signs), and average each kind of estimate over the pairs before dividing",
    mistakes=[
        _no_ratio(_pairs(lambda s, g, bs, bb, G2, tr: tr.mean() / G2.mean())),
        _m(
            "you averaged the per-pair ratios. Try: average the |G|^2 and the tr(Sigma) estimates SEPARATELY, then "
            "divide the two means",
            _pairs(lambda s, g, bs, bb, G2, tr: (tr / G2).mean()),
        ),
        _m(
            "|G|^2 was taken as the big batch's |G_big|^2. Try: that norm still holds noise: weight each norm by its "
            "batch size, as in the formula",
            _pairs(lambda s, g, bs, bb, G2, tr: tr.mean() / g.mean()),
        ),
        _m(
            "tr(Sigma) was divided by (B_big - B_small). Try: divide the norms' difference by the difference of the "
            "reciprocals 1/B",
            _pairs(lambda s, g, bs, bb, G2, tr: (s - g).mean() / (bb - bs) / G2.mean()),
        ),
        _m(
            "B_small and B_big are swapped in |G|^2. Try: weight each squared norm by its OWN batch size, the big "
            "batch's term first",
            _pairs(lambda s, g, bs, bb, G2, tr: tr.mean() / ((bs * g - bb * s) / (bs - bb)).mean()),
        ),
        _m(
            "the ratio is upside down (|G|^2 / tr(Sigma)). Try: B_simple is tr(Sigma) over |G|^2: the noise on top",
            _pairs(lambda s, g, bs, bb, G2, tr: G2.mean() / tr.mean()),
        ),
        _m(
            "the noise scale is negative. Try: check the signs in both estimates: tr(Sigma)'s numerator and "
            "denominator both put the small batch first, and |G|^2 weights each norm by its own batch size, the big "
            "batch's first",
            _pairs(lambda s, g, bs, bb, G2, tr: -tr.mean() / G2.mean()),
            when=lambda o: o.got < 0 < o.want < math.inf,
        ),
        _changed(lambda s, g, bs, bb: (_noise.noise_scale(s, g, bs, bb).b_simple, s.sub_(g))[0]),
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


def _vmapped(model, loss_fn, x, y):
    """The per-example gradients in one torch.func pass over all of x (the model runs once)."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    one = lambda p, a, b: loss_fn(torch.func.functional_call(model, p, (a[None],)), b[None])
    grads = torch.func.vmap(torch.func.grad(one), (None, 0, 0))(params, x, y)
    return torch.cat([t.flatten(1) for t in grads.values()], 1)


@contextlib.contextmanager
def _forwards(model):
    """Per run of ``model`` (``model(x)`` or ``model.forward(x)``): the input's first dim, and whether it ran
    outside every torch.func.vmap."""
    seen, forward = [], model.forward

    def counted(x, *args, **kwargs):
        transforms = torch._C._functorch.get_interpreter_stack() or ()
        rows = x.shape[0] if torch.is_tensor(x) and x.dim() else 1  # a model called with something else: 1
        seen.append((rows, not any(str(t.key()).endswith("Vmap") for t in transforms)))
        return forward(x, *args, **kwargs)

    model.forward = counted
    try:
        yield seen
    finally:
        del model.forward


def _run_counting_loops(fn, case):
    """As _run_keeping_parameters, noting on the output (``.unmapped_calls``) how many times the model ran outside
    torch.func.vmap: a Python loop does so once per example (or pair), a vmap never."""
    with _forwards(case.args[0]) as seen:
        got = _run_keeping_parameters(fn, case)
    with contextlib.suppress(AttributeError):
        got.unmapped_calls = sum(unmapped for _, unmapped in seen)
    return got


def _b_simple(g, dim=0, ddof=1, correct=True, inf=True) -> float:
    """tr(Sigma) / |G|^2 from [B, P] gradients: squared deviations over B - ddof; |mean|^2 less tr(Sigma)/B if
    ``correct``; infinite (if ``inf``) where |G|^2 is not positive."""
    g = torch.as_tensor(g).double()
    B = g.shape[0]
    mean = g.mean(dim, keepdim=True)
    tr = ((g - mean) ** 2).sum() / (B - ddof)
    G2 = (mean**2).sum() - (tr / B if correct else 0)
    return float(tr / G2) if G2 > 0 or not inf else math.inf


_sorted_equal = lambda a, b: _close(a.sort()[0], b.sort()[0])
_PER_EXAMPLE = dict(
    cases=_models_cases,
    oracle=_per_example,
    run=_run_keeping_parameters,
    rtol=1e-6,
    atol=1e-9,
    refuse=("utils.gradient_noise.per_example_grads",),
    passed="a CNN with cross-entropy and a linear model with the MSE",
    hint="differentiate the loss of ONE example with respect to the parameters, with the loss_fn you are given, and "
    "put example i's gradient in row i",
    mistakes=[
        _m(
            "the model failed on a single example: it lost its batch dimension. Try: give the model a batch of one, "
            "the slice i to i+1 (or unsqueeze(0) inside vmap)",
            lambda m, f, x, y: _per_param(m, f, x, y, one=lambda t, i: t[i]),
            when=lambda o: "shapes cannot be multiplied" in o.error,
        ),
        _m(
            "your function changed the model's parameters. Try: compute the gradients only, and take no step",
            lambda m, f, x, y: (_per_example(m, f, x, y), [p.data.mul_(0.9) for p in m.parameters()])[0],
            when=lambda o: "changed the model's parameters" in o.error,
        ),
        _m(
            "it returned a dict of per-parameter gradients, not one [B, P] tensor. Try: flatten each to B rows and "
            "concatenate along dim 1",
            lambda m, f, x, y: dict(zip(dict(m.named_parameters()), _per_param(m, f, x, y))),
            when=lambda o: isinstance(o.got, dict),
        ),
        _m(
            "it returned one gradient for the whole batch, not one per example. Try: give each example's own loss its "
            "own row",
            lambda m, f, x, y: _per_example(m, f, x, y).sum(0),
            when=lambda o: o.got.shape == o.want.shape[1:],
        ),
        _m(
            "each row is 1/B of the example's gradient: you differentiated the batch MEAN loss. Try: differentiate the "
            "loss of ONE example, a batch of one",
            lambda m, f, x, y: _per_example(m, f, x, y) / len(x),
        ),
        _m(
            "row i is the SUM of the gradients of examples 0 to i: .grad accumulates. Try: clear the gradients before "
            "each example, or use torch.autograd.grad",
            lambda m, f, x, y: _per_example(m, f, x, y).cumsum(0),
        ),
        _m(
            "every row is the same batch gradient. Try: take the loss of one example at a time, its gradient in its "
            "own row",
            lambda m, f, x, y: _per_example(m, f, x, y).mean(0).expand(len(x), -1),
            when=lambda o: any(_close(o.got, o.want.mean(0).expand_as(o.want) * k) for k in (1, len(o.want))),
        ),
        _m(
            "each row holds the right numbers, but the parameters are in another order. Try: concatenate them in "
            "model.named_parameters() order",
            lambda m, f, x, y: torch.cat([t.flatten(1) for t in _per_param(m, f, x, y)[::-1]], 1),
            when=lambda o: _sorted_equal(o.got, o.want),
        ),
        _m(
            "the right numbers, in the wrong rows: a gradient was flattened in the wrong order. Try: keep the example "
            "dimension first",
            lambda m, f, x, y: torch.cat([t.reshape(-1, len(x)) for t in _per_param(m, f, x, y)]).T,
            when=lambda o: _sorted_equal(o.got.flatten(), o.want.flatten()),
        ),
    ],
)
PER_EXAMPLE_GRADS_LOOP = Exercise(
    name="per_example_grads_loop",
    refuse_hint="loop over the examples, one torch.autograd.grad call on each example's own loss",
    **_PER_EXAMPLE | {"refuse": _PER_EXAMPLE["refuse"] + ("torch.func.vmap", "torch.vmap")},
)
_LOOPED = _m(
    "your function runs the model in a Python loop, outside torch.func.vmap. Try: write the loss of ONE example as a "
    "function of the parameters (torch.func.functional_call), take its torch.func.grad and map it over the batch with "
    "torch.func.vmap",
    lambda *a: _per_example(*a),
    mechanism=True,
    when=lambda o: getattr(o.got, "unmapped_calls", 0) >= 2 and _close(o.got, o.want),
)
PER_EXAMPLE_GRADS = Exercise(
    name="per_example_grads",
    refuse_hint="use torch.func.functional_call, grad and vmap",
    **_PER_EXAMPLE | {"run": _run_counting_loops, "mistakes": [*_PER_EXAMPLE["mistakes"], _LOOPED]},
)
_ESTIMATES = tuple(f"utils.gradient_noise.{f}" for f in ("noise_scale", "dataset_noise_scale", "two_batch_estimates"))
NOISE_SCALE_FROM_PER_EXAMPLE = Exercise(
    name="noise_scale_from_per_example",
    oracle=_b_simple,
    run=_keeping(),
    passed="four sets of per-example gradients, one too noisy to measure",
    # By hand on the first case: mean (2, 1), |mean|^2 = 5, squared deviations 8, tr(Sigma) = 8/3, |G|^2 = 13/3: 8/13.
    cases=lambda: [
        Case((torch.tensor([[1.0, 0.0], [3.0, 0.0], [1.0, 2.0], [3.0, 2.0]]).double(),), label="4 hand-made gradients"),
        Case((_noise.per_example_grads(*_points(16, 4), 1.7, -0.6),), label="16 linear-regression gradients"),
        Case(
            (torch.randn(9, 6, generator=torch.Generator().manual_seed(2)).double() + 0.7,),
            label="9 gradients of 6 parameters",
        ),
        Case(
            (torch.tensor([[1.0, -1], [-1, 1], [1, 1], [-1, -0.5]]).double(),),
            label="4 gradients whose |G|^2 estimate is negative",
        ),
    ],
    refuse=_ESTIMATES,
    refuse_hint="use the mean over the rows, the squared deviations from it, and their sum over the parameters",
    hint="the mean is one row, taken over the examples; tr(Sigma) sums the squared deviations over ALL entries and "
    "divides by B - 1; |G|^2 subtracts the mean's own noise",
    mistakes=[
        _no_ratio(partial(_b_simple, inf=False)),
        _m(
            "|G|^2 is the squared norm of the mean, which still holds the mean's own noise. Try: subtract tr(Sigma) / "
            "B from it",
            partial(_b_simple, correct=False),
        ),
        _m(
            "tr(Sigma) divides the squared deviations by B: it is biased low. Try: divide them by B - 1",
            partial(_b_simple, ddof=0),
        ),
        _m(
            "the ratio is upside down (|G|^2 / tr(Sigma)). Try: B_simple is tr(Sigma) over |G|^2: the noise on top",
            lambda g: 1 / _b_simple(g),
        ),
        _m(
            "tr(Sigma) was divided by B once more, the noise of the MEAN. Try: tr(Sigma) is the per-EXAMPLE variance: "
            "the squared deviations over B - 1",
            lambda g: _b_simple(g) / len(g),
        ),
        _m(
            "the mean was taken over each row's parameters, not over the examples. Try: average the B rows (dim 0)",
            partial(_b_simple, dim=1),
        ),
        _m(
            "it returned a tuple, not one number. Try: return B_simple only, as a float",
            lambda g: (_b_simple(g), 1.0),
            when=lambda o: isinstance(o.got, tuple),
        ),
        _changed(lambda g: (_b_simple(g), g.sub_(g.mean(0)))[0]),
    ],
)


def _chunked(m, f, x, y, c, keep=None, each=False, ddof=1, correct=True, hold=False, dtype=torch.float64):
    """B_simple from running sums over the chunks of ``c`` (the first ``keep`` only, or the "full" ones), or
    (``each``) the mean of each chunk's; ``ddof`` and ``correct`` as in :func:`_b_simple`; ``hold`` keeps every
    chunk's gradients to the end; the sums in ``dtype``."""
    n, total, squares, each_b, held = 0, 0.0, 0.0, [], []
    starts = list(range(0, len(x), c))
    for i in [i for i in starts if i + c <= len(x)] if keep == "full" else starts[:keep]:
        g = _per_example(m, f, x[i : i + c], y[i : i + c]).to(dtype)
        n, total, squares = n + len(g), total + g.sum(0), squares + (g**2).sum()
        each_b += [_b_simple(g)] if each else []
        held += [g] if hold else []
    if each:
        return float(np.mean(each_b))
    tr = (squares - n * ((total / n) ** 2).sum()) / (n - ddof)
    return float(tr / (((total / n) ** 2).sum() - (tr / n if correct else 0)))


class _Rows(TorchFunctionMode):
    """Of the per-example gradients made while it is on (a [rows, P] tensor, P the parameter count, or a [rows,
    *shape] one of a parameter's shape; the data's and the parameters' own shapes left out): the most rows in one
    tensor (``most``), and the most rows of one trailing shape alive at once in tensors of at most ``chunk`` rows,
    in distinct storages (``held``: a list of chunks' gradients, not one stack of the chunks' sums)."""

    def __init__(self, model, chunk, *data):
        super().__init__()
        self.chunk = chunk
        self.shapes = {(sum(p.numel() for p in model.parameters()),)} | {tuple(p.shape) for p in model.parameters()}
        self.most, self.held, self.alive, self.data = 0, 0, [], {tuple(t.shape) for t in data} | self.shapes

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dim() and tuple(out.shape[1:]) in self.shapes:
            if tuple(out.shape) not in self.data:
                self.most = max(self.most, out.shape[0])
                self.alive = [r for r in self.alive if r() is not None] + [weakref.ref(out)]
                same = {
                    _storage(t): t.shape[0]
                    for t in (r() for r in self.alive)
                    if t is not None and t.shape[1:] == out.shape[1:] and len(t) <= self.chunk
                }
                self.held = max(self.held, sum(same.values()))
        return out


def _storage(t):
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor inside torch.func has no storage of its own
        return id(t)


def _run_in_chunks(fn, case):
    """The answer's B_simple; it raises when the model saw more than ``chunk`` examples in one pass, ran fewer
    times than there are chunks with the right value (one torch.func pass over all of them), held more than
    ``chunk`` examples' gradients in one tensor, or kept many chunks' gradients alive together (a list of them)."""
    model, _, x, y, chunk = case.args
    with _forwards(model) as seen, _Rows(model, chunk, x, y) as rows:
        got = fn(*case.args)
    chunks = -(-len(x) // chunk)  # a [chunks, P] stack of the chunks' sums is no per-example gradient
    # fewer runs than chunks with the right value: one pass over all (with the wrong one: chunks were left out)
    one_pass = 0 < len(seen) < chunks and difference(got, _chunked(*case.args), 1e-6, 1e-9) is None
    if max((n for n, _ in seen), default=0) > chunk or one_pass or rows.most > max(chunk, chunks):
        raise RuntimeError(f"more than chunk={chunk} examples went through at once")
    if rows.held > max(len(x) // 2, 8 * chunk):  # a chunk and a few copies of it, never half the dataset
        raise RuntimeError(f"the gradients of {rows.held} examples were kept at once")
    return got


def _noise_cases() -> list:
    """Two small cases whose last chunk is shorter, and one of many small chunks, where half the dataset's
    gradients alive at once is far more than a chunk and a few copies of it."""
    cases = [Case((*case.args, 3), label=f"{case.label} in chunks of 3") for case in _models_cases()]
    gen, f64 = torch.Generator().manual_seed(3), torch.float64
    x, y = torch.randn(48, 3, 4, generator=gen, dtype=f64), torch.randn(48, 3, generator=gen, dtype=f64)
    return cases + [
        Case((*cases[1].args[:2], x, y, 2), label="a linear model and the MSE on 48 examples in chunks of 2")
    ]


DATASET_NOISE_SCALE = Exercise(
    name="dataset_noise_scale",
    oracle=lambda *a: _chunked(*a),
    run=_run_in_chunks,
    cases=_noise_cases,
    rtol=1e-10,
    atol=1e-12,
    passed="two models, in chunks that leave a shorter last one, and 48 examples in chunks of 2",
    refuse=tuple(f"utils.gradient_noise.{f}" for f in ("per_example_grads", "noise_scale", "dataset_noise_scale")),
    refuse_hint="accumulate the sums yourself, with your own per_example_grads",
    hint="keep two running totals over every chunk (the summed gradients, the summed squared entries), divide once by "
    "N at the end, then use the unbiased tr(Sigma) and |G|^2",
    mistakes=[
        _m(
            "more than chunk examples went through at once: your function ran the model on them, or held their "
            "gradients, together. Try: slice x and y into pieces of chunk examples, take each piece's per-example "
            "gradients in turn, and keep only running sums",
            lambda m, f, x, y, c: _b_simple(_vmapped(m, f, x, y)),
            when=lambda o: "examples went through at once" in o.error,
        ),
        _m(
            "your function kept every chunk's gradients until the end, so its memory still grows with the number of "
            "examples. Try: fold each chunk into the two running sums as soon as you have it, and keep nothing else "
            "of it",
            partial(_chunked, hold=True),
            when=lambda o: "were kept at once" in o.error,
        ),
        _m(
            "the sums kept fewer digits than the float64 gradients: they were float32 (torch.zeros and torch.tensor of "
            "Python floats make float32). Try: start the running sums at 0.0, or make them with the gradients' dtype",
            partial(_chunked, dtype=torch.float32),
            when=lambda o: _float32_digits(o.got, o.want),
        ),
        _m(
            "you averaged the per-chunk B_simple values. Try: accumulate sums over ALL examples and divide once at the "
            "end",
            partial(_chunked, each=True),
        ),
        _m(
            "only the first chunk was used. Try: loop over every chunk, and add up before dividing",
            partial(_chunked, keep=1),
        ),
        _m(
            "the last, shorter chunk was dropped. Try: keep the last slice, even when it is shorter",
            partial(_chunked, keep="full"),
        ),
        _m(
            "tr(Sigma) divides by N, not N - 1. Try: the summed squared norms less N |mean|^2, over N - 1",
            partial(_chunked, ddof=0),
        ),
        _m(
            "|G|^2 lacks the correction for the mean's own noise. Try: subtract tr(Sigma) / N from |mean|^2",
            partial(_chunked, correct=False),
        ),
    ],
)


# ------------------------------------------------------------------ exercise 5: the critical batch size
def _line(bs, ss, against_b=False) -> tuple:
    """(intercept, slope) of the least-squares line of the steps against 1/B (or B)."""
    B = np.asarray(bs, dtype=float)
    slope, intercept = np.polyfit(B if against_b else 1 / B, np.asarray(ss, dtype=float), 1)
    return float(intercept), float(slope)


def _fit(bs, ss, against_b=False):
    a, k = _line(bs, ss, against_b)
    return a, k / a


def _steps(bs, s_min, b_crit):
    return s_min * (1 + b_crit / np.asarray(bs, dtype=float))


_noisy = [4, 8, 16, 32, 64, 128, 256, 1024], [1.08, 0.93, 1.05, 0.9, 1.1, 0.95, 1.07, 0.92]
FIT_CRITICAL_BATCH = Exercise(
    name="fit_critical_batch",
    oracle=_fit,
    run=lambda f, c: _converted(f(*c.args), _pair),
    rtol=1e-6,
    cases=lambda: [
        Case(
            ([2**k for k in range(3, 10)], [200 * (1 + 64 / 2**k) for k in range(3, 10)]),
            label="steps on the curve itself, at 7 batch sizes",
        ),
        Case((_noisy[0], [150 * (1 + 40 / b) * e for b, e in zip(*_noisy)]), label="noisy steps at 8 batch sizes"),
    ],
    refuse=("utils.batch_sweeps.fit_critical_batch",),
    refuse_hint="fit the steps against 1/B by least squares yourself",
    passed="exact and noisy steps, as numpy.polyfit",
    hint="fit one ordinary least-squares line of the steps against 1/B, using every point: its intercept is S_min, its "
    "slope S_min times B_crit",
    mistakes=[
        _m("B_crit is the slope S_min * B_crit itself. Try: divide the slope by the intercept S_min", _line),
        _m("the pair is swapped. Try: return (S_min, B_crit) in that order", lambda bs, ss: _fit(bs, ss)[::-1]),
        _m(
            "the coefficients' order is swapped: numpy.polyfit returns the highest degree first. Try: the first is the "
            "slope (of 1/B), the second the intercept",
            lambda bs, ss: (lambda k, a: (a, k / a))(*_line(bs, ss)),
        ),
        _m(
            "S was fitted against B, not against 1/B. Try: regress the steps on one over the batch size",
            partial(_fit, against_b=True),
        ),
        _m(
            "the intercept was not fitted (it is not the fewest measured steps, nor 0). Try: fit a + k / B with a and "
            "k free",
            lambda bs, ss: (min(ss), _line(bs, ss)[1] / min(ss)),
            when=lambda o: (
                math.isclose(o.got[0], min(o.case.args[1])) or abs(o.got[0]) < 1e-6 or not math.isfinite(o.got[1])
            ),
        ),
    ],
)
_as_row = lambda g: torch.as_tensor(np.asarray(g, dtype=float)).reshape(-1)
_per_b = _keeping(lambda f, c: _converted(f(*c.args), _as_row))
_b_cases = lambda: [
    Case(([16, 64, 256], 200.0, 64.0), label="3 batch sizes"),
    Case(([8, 100, 1000, 5000], 50.0, 120.0), label="4 batch sizes"),
]
_examples = lambda bs, s, b: _steps(bs, s, b) * np.asarray(bs)
STEPS_TO_TARGET = Exercise(
    name="steps_to_target",
    oracle=_steps,
    run=_per_b,
    cases=_b_cases,
    passed="two sets of batch sizes",
    hint="S(B) is S_min times one plus B_crit over B, with the batch sizes as a float array",
    mistakes=[
        _m(
            "B and B_crit are swapped. Try: B_crit goes on top and the batch size below",
            lambda bs, s, b: _steps(b, s, bs),
        ),
        _m("these are the examples E(B), not the steps. Try: drop the factor B", _examples),
        _m(
            "this is only the perfect-scaling part S_min B_crit / B. Try: add the floor S_min",
            lambda bs, s, b: s * b / np.asarray(bs),
        ),
        _changed(lambda bs, s, b: (_steps(bs, s, b), bs.reverse())[0]),
    ],
)
EXAMPLES_TO_TARGET = Exercise(
    name="examples_to_target",
    oracle=_examples,
    run=_per_b,
    cases=_b_cases,
    passed="two sets of batch sizes",
    hint="E_min is S_min times B_crit, and E(B) is E_min times one plus B over B_crit",
    mistakes=[
        _m("these are the steps S(B), not the examples. Try: the examples are the steps times B", _steps),
        _m(
            "this is S_min * B, the examples of perfect scaling. Try: E(B) is S(B) times B",
            lambda bs, s, b: s * np.asarray(bs),
        ),
        _m(
            "B and B_crit are swapped. Try: E(B) is E_min times one plus B over B_crit",
            lambda bs, s, b: s * b * (1 + b / np.asarray(bs)),
        ),
        _changed(lambda bs, s, b: (_examples(bs, s, b), bs.reverse())[0]),
    ],
)

check_gd_step = GD_STEP.checker("``gd_step(x, y, w, b, lr)``: one full-batch GD step on the MSE, the new (w, b).")
check_sgd = SGD.checker("``minibatch_sgd(x, y, w0, b0, lr, steps, batch_size, seed)``: the (steps + 1, 2) path of SGD.")
check_noise_scale = NOISE_SCALE.checker("``b_simple(sq_small, sq_big, b_small, b_big)``: B_simple from pairs.")
check_per_example_grads_loop = PER_EXAMPLE_GRADS_LOOP.checker("``per_example_grads_loop(model, loss_fn, x, y)``.")
check_per_example_grads = PER_EXAMPLE_GRADS.checker("``per_example_grads(model, loss_fn, x, y)``: [B, P], torch.func.")
check_noise_scale_from_per_example = NOISE_SCALE_FROM_PER_EXAMPLE.checker("``noise_scale_from_per_example(g)``.")
check_dataset_noise_scale = DATASET_NOISE_SCALE.checker("``dataset_noise_scale(model, loss_fn, x, y, chunk)``.")
check_fit_critical_batch = FIT_CRITICAL_BATCH.checker("``fit_critical_batch(batch_sizes, steps)``: (S_min, B_crit).")
check_steps_to_target = STEPS_TO_TARGET.checker("``steps_to_target(batch_sizes, s_min, b_crit)``: S(B) per batch.")
check_examples_to_target = EXAMPLES_TO_TARGET.checker("``examples_to_target(batch_sizes, s_min, b_crit)``: E(B).")

__all__ = [name for name in dir() if name.startswith("check_")]
