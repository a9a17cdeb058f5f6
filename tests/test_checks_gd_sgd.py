"""utils.checks.gd_sgd: lab 1's self-checks pass on the references and name typical mistakes."""

import pytest
import torch

from utils import checks, gradient_noise, linear_regression
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
