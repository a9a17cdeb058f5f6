"""Stage 1 (utils.sgd, utils.checks.stage1): the science at smoke scale, against closed forms."""
import math

import pytest
import torch

from utils import checks, data, sgd
from utils.checks import CheckFailed

PROBLEM = sgd.LinearProblem()


@pytest.fixture(scope="module")
def points():
    return PROBLEM.sample(256, seed=0)


# ---------------------------------------------------------------- the linear problem

def test_full_batch_gd_reaches_least_squares(points):
    x, y = points
    w_star, b_star = sgd.least_squares(x, y)
    path = sgd.gd(x, y, -1.0, 3.0, lr=0.2, steps=300)
    assert abs(path[-1, 0] - w_star) < 1e-3 and abs(path[-1, 1] - b_star) < 1e-3, (
        f"full-batch GD ended at {path[-1].tolist()}, least squares is ({w_star}, {b_star}): "
        "check mse_grad (2 mean(r x), 2 mean(r)) and gd_step's sign")
    assert path.shape == (301, 2)


def test_least_squares_matches_torch_lstsq(points):
    x, y = points
    A = torch.stack([x, torch.ones_like(x)], 1)
    want = torch.linalg.lstsq(A, y[:, None]).solution.flatten()
    assert torch.allclose(torch.tensor(sgd.least_squares(x, y), dtype=torch.float64), want, atol=1e-10)


def test_mse_grad_matches_autograd(points):
    x, y = points
    w = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(-0.2, dtype=torch.float64, requires_grad=True)
    ((w * x + b - y) ** 2).mean().backward()
    dw, db = sgd.mse_grad(x, y, 0.7, -0.2)
    assert math.isclose(dw, w.grad.item(), rel_tol=1e-12) and math.isclose(db, b.grad.item(), rel_tol=1e-12)


def test_sgd_with_whole_dataset_is_gd_and_small_batches_are_noisy(points):
    x, y = points
    gd_path = sgd.gd(x, y, -1.0, 3.0, 0.1, 40)
    assert torch.allclose(sgd.sgd(x, y, -1.0, 3.0, 0.1, 40, len(x)), gd_path), "batch_size=n must be GD"
    one = sgd.sgd(x, y, -1.0, 3.0, 0.1, 40, 1)
    assert one.shape == (41, 2) and not torch.allclose(one, gd_path)


def test_minibatches_cover_each_epoch_once():
    it = sgd.minibatches(10, 3, seed=1)
    epoch = torch.cat([next(it) for _ in range(3)])           # 3 batches of 3; the 10th index dropped
    assert len(set(epoch.tolist())) == 9
    with pytest.raises(ValueError, match="batch_size"):
        next(sgd.minibatches(10, 11))


def test_loss_surface_matches_direct_mse(points):
    x, y = points
    wg, bg = torch.linspace(-1, 3, 5), torch.linspace(-2, 2, 4)
    L = sgd.loss_surface(x, y, wg, bg)
    assert L.shape == (4, 5)
    assert math.isclose(float(L[1, 3]), sgd.mse(x, y, float(wg[3]), float(bg[1])), rel_tol=1e-9)


# ---------------------------------------------------------------- gradient noise

def test_gradient_variance_falls_as_one_over_batch(points):
    x, y = points
    r = sgd.gradient_variance(x, y, -1.0, 3.0, [1, 2, 4, 8, 16, 32, 64, 128], draws=200, seed=0)
    slope = sgd.loglog_slope(r["batch_sizes"], r["measured"])
    assert -1.2 <= slope <= -0.8, f"log-log slope of gradient variance vs batch size is {slope:.2f}, theory -1"


def test_closed_form_gradient_stats_match_monte_carlo():
    x, y = PROBLEM.sample(400_000, seed=1)
    G2, trS = PROBLEM.gradient_stats(2.2, -0.8)
    G2_mc, trS_mc, _ = sgd.dataset_noise_scale(x, y, 2.2, -0.8)
    assert math.isclose(G2, G2_mc, rel_tol=0.03) and math.isclose(trS, trS_mc, rel_tol=0.03)


def test_two_batch_estimator_recovers_known_noise_scale():
    w, b = 2.3, -1.0
    exact = PROBLEM.noise_scale(w, b)                # tr(Sigma)/|G|^2 in closed form: 3.07
    s, g = sgd.linear_grad_sq_norms(PROBLEM, w, b, 4, 128, draws=4000, seed=0)
    est = sgd.noise_scale(s, g, 4, 128)
    G2, trS = PROBLEM.gradient_stats(w, b)
    assert abs(est.b_simple / exact - 1) < 0.2, f"B_simple estimated {est.b_simple:.3f}, exact {exact:.3f}"
    assert abs(est.G2 / G2 - 1) < 0.2 and abs(est.tr_sigma / trS - 1) < 0.2


def test_two_batch_estimator_is_exact_on_expected_norms():
    # Feed the expectations themselves: E|G_B|^2 = |G|^2 + tr(Sigma)/B -> exact recovery.
    G2, trS = 0.5, 30.0
    ns = sgd.noise_scale([G2 + trS / 8], [G2 + trS / 256], 8, 256)
    assert math.isclose(ns.b_simple, 60.0, rel_tol=1e-12)
    with pytest.raises(ValueError):
        sgd.two_batch_estimates([1.0], [1.0], 8, 8)


def test_noise_scale_ema_smooths_numerator_and_denominator_separately():
    ema = sgd.NoiseScaleEMA(4, 64, beta=0.5)
    for s, g in [(6.0, 1.2), (16.0, 2.5)]:
        ema.update(s, g)
    G2, trS = sgd.two_batch_estimates([6.0, 16.0], [1.2, 2.5], 4, 64)
    w = torch.tensor([0.5 * 0.5, 0.5], dtype=torch.float64) / 0.75   # bias-corrected EMA weights
    want = float((w * trS).sum() / (w * G2).sum())
    assert math.isclose(ema.value.b_simple, want, rel_tol=1e-12)


def test_cnn_noise_scale_is_positive_and_leaves_parameters_alone():
    torch.manual_seed(0)
    splits = data.load("digits", n_train=200, n_val=50)
    from utils.models import net_for
    model = net_for(splits.shape, 8)
    before = [p.detach().clone() for p in model.parameters()]
    ns = sgd.measure_noise_scale(model, splits.train, 4, 64, draws=4, device="cpu")
    assert ns.G2 > 0 and ns.tr_sigma > 0 and ns.b_simple > 0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())


# ---------------------------------------------------------------- batch-size sweeps

def test_lr_rules():
    assert sgd.lr_for_batch(64, 0.01, 16) == pytest.approx(0.04)
    assert sgd.lr_for_batch(64, 0.01, 16, "sqrt") == pytest.approx(0.02)
    assert sgd.lr_for_batch(1024, 0.01, 16, max_lr=0.1) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="LR rule"):
        sgd.lr_for_batch(64, 0.01, 16, "cubic")


def test_fit_critical_batch_recovers_model_curve():
    B = [2, 8, 32, 128, 512]
    S = [100 * (1 + 20 / b) for b in B]
    s_min, b_crit = sgd.fit_critical_batch(B, S)
    assert math.isclose(s_min, 100, rel_tol=1e-9) and math.isclose(b_crit, 20, rel_tol=1e-9)


def test_steps_to_target_sweep_smoke():
    splits = data.load("digits", n_train=300, n_val=100)
    rows = sgd.sweep_steps_to_target(splits, [16, 64], lambda B: 0.05, target_acc=0.5, max_steps=60,
                                     hidden=8, device="cpu", progress=False)
    assert [r["batch_size"] for r in rows] == [16, 64]
    for r in rows:
        assert r["steps_to_target"] is not None and r["steps_to_target"] <= 60, r
        assert r["eval_every"] == max(1, 32 // r["batch_size"])


# ---------------------------------------------------------------- self-checks

def _placeholder(*args, **kwargs):
    raise NotImplementedError("Exercise: write this part (see the hint above)")


def test_checks_pass_on_reference():
    checks.check_gd_step(sgd.gd_step)
    checks.check_sgd(sgd.sgd)
    checks.check_noise_scale(lambda s, g, bs, bb: sgd.noise_scale(s, g, bs, bb).b_simple)


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
        return sgd.gd(x, y, w0, b0, lr, steps)

    def no_start(x, y, w0, b0, lr, steps, batch_size, seed=0):
        return sgd.sgd(x, y, w0, b0, lr, steps, batch_size, seed)[1:]

    def summed(x, y, w0, b0, lr, steps, batch_size, seed=0):
        return sgd.sgd(x, y, w0, b0, lr * batch_size, steps, batch_size, seed)

    def same_batch(x, y, w0, b0, lr, steps, batch_size, seed=0):
        path, w, b = [(w0, b0)], w0, b0
        for _ in range(steps):
            idx = next(sgd.minibatches(len(x), batch_size, seed))     # a new iterator each step
            w, b = sgd.gd_step(x[idx], y[idx], w, b, lr)
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
        G2, trS = sgd.two_batch_estimates(s, g, bs, bb)
        return float((trS / G2).mean())

    def big_is_true(s, g, bs, bb):
        _, trS = sgd.two_batch_estimates(s, g, bs, bb)
        return float(trS.mean() / g.mean())

    def upside_down(s, g, bs, bb):
        G2, trS = sgd.two_batch_estimates(s, g, bs, bb)
        return float(G2.mean() / trS.mean())

    with pytest.raises(CheckFailed, match="averaged the per-pair ratios"):
        checks.check_noise_scale(mean_of_ratios)
    with pytest.raises(CheckFailed, match="big batch's"):
        checks.check_noise_scale(big_is_true)
    with pytest.raises(CheckFailed, match="upside down"):
        checks.check_noise_scale(upside_down)
