"""utils.checks.gd_sgd: lab 1's self-checks pass on the references and name typical mistakes."""

import numpy as np
import pytest
import torch

from utils import batch_sweeps, checks, gradient_noise, linear_regression
from utils.checks import CheckFailed


def _placeholder(*args, **kwargs):
    raise NotImplementedError("Exercise: write this part (see the hint above)")


def test_checks_pass_on_reference():
    checks.check_gd_step(linear_regression.gd_step)
    checks.check_sgd(linear_regression.sgd)
    checks.check_noise_scale(lambda s, g, bs, bb: gradient_noise.noise_scale(s, g, bs, bb).b_simple)


@pytest.mark.parametrize("check", [checks.check_gd_step, checks.check_sgd, checks.check_noise_scale])
def test_checks_fail_on_placeholder(check):
    with pytest.raises(CheckFailed, match="not implemented yet"):
        check(_placeholder)


def test_check_gd_step_catches_typical_mistakes():
    def no_two(x, y, w, b, lr):
        r = w * x + b - y
        return w - lr * (r * x).mean(), b - lr * r.mean()

    def uphill(x, y, w, b, lr):
        r = w * x + b - y
        return w + lr * 2 * (r * x).mean(), b + lr * 2 * r.mean()

    def summed(x, y, w, b, lr):
        r = w * x + b - y
        return w - lr * 2 * (r * x).sum(), b - lr * 2 * r.sum()

    with pytest.raises(CheckFailed, match="factor 2"):
        checks.check_gd_step(no_two)
    with pytest.raises(CheckFailed, match="UP the gradient"):
        checks.check_gd_step(uphill)
    with pytest.raises(CheckFailed, match="a sum, not a mean"):
        checks.check_gd_step(summed)


def test_check_sgd_catches_typical_mistakes():
    def full_batch(x, y, w0, b0, lr, steps, batch_size, seed=0):
        return linear_regression.gd(x, y, w0, b0, lr, steps)

    def no_start(x, y, w0, b0, lr, steps, batch_size, seed=0):
        return linear_regression.sgd(x, y, w0, b0, lr, steps, batch_size, seed)[1:]

    def summed(x, y, w0, b0, lr, steps, batch_size, seed=0):
        return linear_regression.sgd(x, y, w0, b0, lr * batch_size, steps, batch_size, seed)

    def same_batch(x, y, w0, b0, lr, steps, batch_size, seed=0):
        path, w, b = [(w0, b0)], w0, b0
        for _ in range(steps):
            idx = next(linear_regression.minibatches(len(x), batch_size, seed))  # a new iterator each step
            w, b = linear_regression.gd_step(x[idx], y[idx], w, b, lr)
            path.append((w, b))
        return torch.tensor(path)

    with pytest.raises(CheckFailed, match="every step used all the data"):
        checks.check_sgd(full_batch)
    with pytest.raises(CheckFailed, match="the start is missing"):
        checks.check_sgd(no_start)
    with pytest.raises(CheckFailed, match="summed, not averaged"):
        checks.check_sgd(summed)
    with pytest.raises(CheckFailed, match="first step is right"):
        checks.check_sgd(same_batch)


def test_check_noise_scale_catches_typical_mistakes():
    def mean_of_ratios(s, g, bs, bb):
        G2, trS = gradient_noise.two_batch_estimates(s, g, bs, bb)
        return float((trS / G2).mean())

    def big_is_true(s, g, bs, bb):
        _, trS = gradient_noise.two_batch_estimates(s, g, bs, bb)
        return float(trS.mean() / g.mean())

    def upside_down(s, g, bs, bb):
        G2, trS = gradient_noise.two_batch_estimates(s, g, bs, bb)
        return float(G2.mean() / trS.mean())

    with pytest.raises(CheckFailed, match="averaged the per-pair ratios"):
        checks.check_noise_scale(mean_of_ratios)
    with pytest.raises(CheckFailed, match="big batch's"):
        checks.check_noise_scale(big_is_true)
    with pytest.raises(CheckFailed, match="upside down"):
        checks.check_noise_scale(upside_down)


# ------------------------------------------------------------------ exercises 4 and 5: hand-written answers and mistakes


def _per_example_vmap(model, loss_fn, x, y, unsqueeze=True):
    from torch.func import functional_call, grad, vmap

    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_one(p, xi, yi):
        if unsqueeze:
            xi, yi = xi.unsqueeze(0), yi.unsqueeze(0)
        return loss_fn(functional_call(model, p, (xi,)), yi)

    g = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, y)
    return torch.cat([t.reshape(len(x), -1) for t in g.values()], dim=1)


def _scale(g, divisor_minus_one=True, correct=True):
    B = g.shape[0]
    mean = g.mean(0)
    trS = ((g - mean) ** 2).sum() / (B - 1 if divisor_minus_one else B)
    G2 = (mean**2).sum() - (trS / B if correct else 0)
    return float(trS / G2)


def _fit(bs, ss):
    k, a = np.polyfit(1 / np.asarray(bs, float), np.asarray(ss, float), 1)
    return float(a), float(k / a)


def test_new_checks_pass_on_hand_written_answers():
    checks.check_per_example_grads(_per_example_vmap)
    checks.check_noise_scale_from_per_example(_scale)
    checks.check_fit_critical_batch(_fit)


@pytest.mark.parametrize(
    "check",
    [checks.check_per_example_grads, checks.check_noise_scale_from_per_example, checks.check_fit_critical_batch],
)
def test_new_checks_fail_on_placeholder(check):
    with pytest.raises(CheckFailed, match="not implemented yet"):
        check(_placeholder)


def test_new_checks_refuse_the_library():
    with pytest.raises(CheckFailed, match="the library's own function"):
        checks.check_per_example_grads(gradient_noise.per_example_grads)
    with pytest.raises(CheckFailed, match="the library's own function"):
        checks.check_fit_critical_batch(batch_sweeps.fit_critical_batch)
    with pytest.raises(CheckFailed, match="called utils.batch_sweeps's own fit_critical_batch"):
        checks.check_fit_critical_batch(lambda bs, ss: batch_sweeps.fit_critical_batch(bs, ss))

    def via_library(g):
        G2, trS = gradient_noise.two_batch_estimates(g[:, 0], g[:, 1], 1, 2)
        return float(trS.mean() / G2.mean())

    with pytest.raises(CheckFailed, match="called utils.gradient_noise's own"):
        checks.check_noise_scale_from_per_example(via_library)
    # the library is restored after a refusal
    assert batch_sweeps.fit_critical_batch([8, 64], [900.0, 200.0])[0] > 0


def test_check_per_example_grads_catches_typical_mistakes():
    def summed(model, loss_fn, x, y):
        gs = torch.autograd.grad(loss_fn(model(x), y), list(model.parameters()))
        return torch.cat([g.reshape(-1) for g in gs])

    def no_unsqueeze(model, loss_fn, x, y):
        return _per_example_vmap(model, loss_fn, x, y, unsqueeze=False)

    def of_the_mean(model, loss_fn, x, y):
        return _per_example_vmap(model, loss_fn, x, y) / len(x)

    def as_dict(model, loss_fn, x, y):
        return dict(zip([k for k, _ in model.named_parameters()], [None] * 10))

    def reversed_order(model, loss_fn, x, y):
        from torch.func import functional_call, grad, vmap

        params = {k: v.detach() for k, v in model.named_parameters()}
        g = vmap(grad(lambda p, a, b: loss_fn(functional_call(model, p, (a[None],)), b[None])), in_dims=(None, 0, 0))(
            params, x, y
        )
        return torch.cat([t.reshape(len(x), -1) for t in reversed(list(g.values()))], dim=1)

    for wrong, expected in [
        (summed, "not one per example"),
        (no_unsqueeze, "lost its batch dimension"),
        (of_the_mean, "batch MEAN loss"),
        (as_dict, "a dict"),
        (reversed_order, "another order"),
    ]:
        with pytest.raises(CheckFailed, match=expected):
            checks.check_per_example_grads(wrong)


def test_check_noise_scale_from_per_example_catches_typical_mistakes():
    for wrong, expected in [
        (lambda g: _scale(g, correct=False), "mean's own noise"),
        (lambda g: _scale(g, divisor_minus_one=False), "population formula"),
        (lambda g: _scale(g, divisor_minus_one=False, correct=False), "both estimates are biased"),
        (lambda g: 1 / _scale(g), "upside down"),
        (lambda g: (_scale(g, correct=False) ** -1 - 1 / g.shape[0]) ** -1 / g.shape[0], "noise of the MEAN"),
        (lambda g: (_scale(g), 1.0), "a tuple"),
    ]:
        with pytest.raises(CheckFailed, match=expected):
            checks.check_noise_scale_from_per_example(wrong)


def test_check_fit_critical_batch_catches_typical_mistakes():
    def against_b(bs, ss):
        k, a = np.polyfit(np.asarray(bs, float), np.asarray(ss, float), 1)
        return float(a), float(k / a)

    def slope_is_bcrit(bs, ss):
        k, a = np.polyfit(1 / np.asarray(bs, float), np.asarray(ss, float), 1)
        return float(a), float(k)

    def through_origin(bs, ss):
        inv = 1 / np.asarray(bs, float)
        k = float((inv * np.asarray(ss)).sum() / (inv**2).sum())
        return 0.0, float("inf") if k else 0.0

    def fewest_steps(bs, ss):
        k, a = np.polyfit(1 / np.asarray(bs, float), np.asarray(ss, float), 1)
        return float(min(ss)), float(k / min(ss))

    def relative_error(bs, ss):  # the weighted fit, written out
        B, S = np.asarray(bs, float), np.asarray(ss, float)
        A = np.stack([np.ones_like(B), 1 / B], 1) / S[:, None]
        (a, k), *_ = np.linalg.lstsq(A, np.ones_like(S), rcond=None)
        return float(a), float(k / a)

    for wrong, expected in [
        (against_b, "against B, not against 1/B"),
        (slope_is_bcrit, "the slope S_min \\* B_crit itself"),
        (through_origin, "intercept was not fitted"),
        (fewest_steps, "intercept was not fitted"),
        (lambda bs, ss: _fit(bs, ss)[::-1], "swapped"),
        (relative_error, "RELATIVE error"),
    ]:
        with pytest.raises(CheckFailed, match=expected):
            checks.check_fit_critical_batch(wrong)


def _dataset_scale(model, loss_fn, x, y, chunk, per_chunk=False, first_only=False):
    gs = [_per_example_vmap(model, loss_fn, x[i : i + chunk], y[i : i + chunk]) for i in range(0, len(x), chunk)]
    if first_only:
        return _scale(gs[0])
    if per_chunk:
        return sum(_scale(g) for g in gs) / len(gs)
    N = len(x)
    mean = sum(g.sum(0) for g in gs) / N
    trS = (sum((g**2).sum() for g in gs) - N * (mean**2).sum()) / (N - 1)
    return float(trS / ((mean**2).sum() - trS / N))


def test_check_dataset_noise_scale():
    checks.check_dataset_noise_scale(_dataset_scale)
    with pytest.raises(CheckFailed, match="not implemented yet"):
        checks.check_dataset_noise_scale(_placeholder)
    with pytest.raises(CheckFailed, match="averaged the per-chunk"):
        checks.check_dataset_noise_scale(lambda *a: _dataset_scale(*a, per_chunk=True))
    with pytest.raises(CheckFailed, match="only the first chunk"):
        checks.check_dataset_noise_scale(lambda *a: _dataset_scale(*a, first_only=True))
    with pytest.raises(CheckFailed, match="called utils.gradient_noise's own"):
        checks.check_dataset_noise_scale(lambda m, f, x, y, c: gradient_noise.per_example_grads(x, y, 1.0, 0.0))


def test_check_examples_to_target():
    checks.check_examples_to_target(lambda bs, s, b: s * b * (1 + np.asarray(bs, float) / b))
    with pytest.raises(CheckFailed, match="not implemented yet"):
        checks.check_examples_to_target(_placeholder)
    with pytest.raises(CheckFailed, match="the steps S\\(B\\)"):
        checks.check_examples_to_target(lambda bs, s, b: s * (1 + b / np.asarray(bs, float)))
    with pytest.raises(CheckFailed, match="perfect scaling"):
        checks.check_examples_to_target(lambda bs, s, b: s * np.asarray(bs, float))


def test_check_steps_to_target():
    checks.check_steps_to_target(lambda bs, s, b: s * (1 + b / np.asarray(bs, float)))
    with pytest.raises(CheckFailed, match="not implemented yet"):
        checks.check_steps_to_target(_placeholder)
    with pytest.raises(CheckFailed, match="swapped"):
        checks.check_steps_to_target(lambda bs, s, b: s * (1 + np.asarray(bs, float) / b))
    with pytest.raises(CheckFailed, match="add the floor"):
        checks.check_steps_to_target(lambda bs, s, b: s * b / np.asarray(bs, float))
    with pytest.raises(CheckFailed, match="the examples E\\(B\\)"):
        checks.check_steps_to_target(lambda bs, s, b: s * (np.asarray(bs, float) + b))


def test_checks_name_the_mistakes_students_made():
    """Mistakes from trial runs, each written out by hand; the oracle is the check's own loop of
    torch.autograd.grad, numpy.polyfit and the hand-made cases."""

    def loop_backward(model, loss_fn, x, y):  # .grad accumulates: no zeroing between examples
        params, rows = list(model.parameters()), []
        for i in range(len(x)):
            loss_fn(model(x[i : i + 1]), y[i : i + 1]).backward()
            rows.append(torch.cat([p.grad.reshape(-1).clone() for p in params]))
        for p in params:
            p.grad = None
        return torch.stack(rows)

    def loop_batch(model, loss_fn, x, y):  # one batch gradient copied to every row
        gs = torch.autograd.grad(loss_fn(model(x), y), list(model.parameters()))
        return torch.cat([g.reshape(-1) for g in gs]).expand(len(x), -1).clone()

    def reshape_order(model, loss_fn, x, y):
        from torch.func import functional_call, grad, vmap

        params = {k: v.detach() for k, v in model.named_parameters()}
        g = vmap(grad(lambda p, a, b: loss_fn(functional_call(model, p, (a[None],)), b[None])), in_dims=(None, 0, 0))(
            params, x, y
        )
        return torch.cat([t.reshape(-1, len(x)) for t in g.values()], dim=0).T

    def per_example_grads_loop(model, loss_fn, x, y):  # the loop exercise's name shows in the message
        return loop_batch(model, loss_fn, x, y)

    for wrong, expected in [
        (loop_backward, "accumulates across .backward"),
        (loop_batch, "same batch gradient"),
        (reshape_order, "flattened in the wrong order"),
        (per_example_grads_loop, "^per_example_grads_loop: "),
    ]:
        with pytest.raises(CheckFailed, match=expected):
            checks.check_per_example_grads(wrong)

    def mean_dim1(g):
        g = g.double()
        m = g.mean(1, keepdim=True)
        tr = ((g - m) ** 2).sum() / (g.shape[0] - 1)
        return float(tr / ((m**2).sum() - tr / g.shape[0]))

    with pytest.raises(CheckFailed, match="wrong dim"):
        checks.check_noise_scale_from_per_example(mean_dim1)

    def polyfit_swapped(bs, ss):
        a, k = np.polyfit(1 / np.asarray(bs, float), np.asarray(ss, float), 1)  # wrong: slope comes first
        return float(a), float(k / a)

    with pytest.raises(CheckFailed, match="highest degree first"):
        checks.check_fit_critical_batch(polyfit_swapped)

    def b_swapped(s, g, bs, bb):
        G2 = (bs * g - bb * s) / (bb - bs)
        tr = (s - g) / (1 / bs - 1 / bb)
        return float(tr.mean() / G2.mean())

    with pytest.raises(CheckFailed, match="swapped in the \\|G\\|\\^2 formula"):
        checks.check_noise_scale(b_swapped)

    def own_sampling(x, y, w0, b0, lr, steps, batch_size, seed=0):
        gen, w, b, path = torch.Generator().manual_seed(seed), w0, b0, [(w0, b0)]
        for _ in range(steps):
            idx = torch.randint(len(x), (batch_size,), generator=gen)
            r = w * x[idx] + b - y[idx]
            w, b = float(w - lr * 2 * (r * x[idx]).mean()), float(b - lr * 2 * r.mean())
            path.append((w, b))
        return torch.tensor(path, dtype=torch.float64)

    with pytest.raises(CheckFailed, match="not on the expected batches"):
        checks.check_sgd(own_sampling)

    def last_chunk_dropped(model, loss_fn, x, y, chunk):
        n = len(x) // chunk * chunk
        return _dataset_scale(model, loss_fn, x[:n], y[:n], chunk)

    with pytest.raises(CheckFailed, match="last, shorter chunk was dropped"):
        checks.check_dataset_noise_scale(last_chunk_dropped)
