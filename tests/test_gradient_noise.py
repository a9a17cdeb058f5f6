"""utils.gradient_noise: gradient variance and the noise scale, against closed forms (smoke scale)."""

import math

import pytest
import torch

from utils import data, gradient_noise, linear_regression

PROBLEM = linear_regression.LinearProblem()


@pytest.fixture(scope="module")
def points():
    return PROBLEM.sample(256, seed=0)


def test_gradient_variance_falls_as_one_over_batch(points):
    x, y = points
    r = gradient_noise.gradient_variance(x, y, -1.0, 3.0, [1, 2, 4, 8, 16, 32, 64, 128], draws=200, seed=0)
    slope = gradient_noise.loglog_slope(r["batch_sizes"], r["measured"])
    assert -1.2 <= slope <= -0.8, f"log-log slope of gradient variance vs batch size is {slope:.2f}, theory -1"


def test_closed_form_gradient_stats_match_monte_carlo():
    x, y = PROBLEM.sample(400_000, seed=1)
    G2, trS = PROBLEM.gradient_stats(2.2, -0.8)
    G2_mc, trS_mc, _ = gradient_noise.dataset_noise_scale(x, y, 2.2, -0.8)
    assert math.isclose(G2, G2_mc, rel_tol=0.03) and math.isclose(trS, trS_mc, rel_tol=0.03)


def test_two_batch_estimator_recovers_known_noise_scale():
    w, b = 2.3, -1.0
    exact = PROBLEM.noise_scale(w, b)  # tr(Sigma)/|G|^2 in closed form: 3.07
    s, g = gradient_noise.linear_grad_sq_norms(PROBLEM, w, b, 4, 128, draws=4000, seed=0)
    est = gradient_noise.noise_scale(s, g, 4, 128)
    G2, trS = PROBLEM.gradient_stats(w, b)
    assert abs(est.b_simple / exact - 1) < 0.2, f"B_simple estimated {est.b_simple:.3f}, exact {exact:.3f}"
    assert abs(est.G2 / G2 - 1) < 0.2 and abs(est.tr_sigma / trS - 1) < 0.2


def test_two_batch_estimator_is_exact_on_expected_norms():
    # Feed the expectations themselves: E|G_B|^2 = |G|^2 + tr(Sigma)/B -> exact recovery.
    G2, trS = 0.5, 30.0
    ns = gradient_noise.noise_scale([G2 + trS / 8], [G2 + trS / 256], 8, 256)
    assert math.isclose(ns.b_simple, 60.0, rel_tol=1e-12)
    with pytest.raises(ValueError):
        gradient_noise.two_batch_estimates([1.0], [1.0], 8, 8)


def test_noise_scale_ema_smooths_numerator_and_denominator_separately():
    ema = gradient_noise.NoiseScaleEMA(4, 64, beta=0.5)
    for s, g in [(6.0, 1.2), (16.0, 2.5)]:
        ema.update(s, g)
    G2, trS = gradient_noise.two_batch_estimates([6.0, 16.0], [1.2, 2.5], 4, 64)
    w = torch.tensor([0.5 * 0.5, 0.5], dtype=torch.float64) / 0.75  # bias-corrected EMA weights
    want = float((w * trS).sum() / (w * G2).sum())
    assert math.isclose(ema.value.b_simple, want, rel_tol=1e-12)


def test_cnn_noise_scale_is_positive_and_leaves_parameters_alone():
    torch.manual_seed(0)
    splits = data.load("digits", n_train=200, n_val=50)
    from utils.models import net_for

    model = net_for(splits.shape, 8)
    before = [p.detach().clone() for p in model.parameters()]
    ns = gradient_noise.measure_noise_scale(model, splits.train, 4, 64, draws=4, device="cpu")
    assert ns.G2 > 0 and ns.tr_sigma > 0 and ns.b_simple > 0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
