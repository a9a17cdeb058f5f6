"""Oracle from outside the project: the gradient noise scale of a problem whose per-example
gradients have a covariance we choose, against its closed form.

Per-example loss ``l_i(theta) = a_i . theta`` with ``a_i ~ N(G, Sigma)``: the per-example gradient
is ``a_i`` itself, so the true gradient is ``G`` and the per-example covariance ``Sigma``, and
McCandlish et al. (2018)'s simple noise scale is exactly ``B_simple = tr(Sigma) / |G|^2``.
utils.gradient_noise estimates it the way their appendix A does: squared norms of the gradients of
a small and a big batch, the unbiased estimators

    |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

averaged over many pairs, then divided. The oracle is the closed form, not the estimator.
"""

import math

import torch
from torch import nn
from torch.utils.data import TensorDataset

from utils import gradient_noise

D = 10
G_TRUE = torch.full((D,), 0.5, dtype=torch.float64)  # |G|^2 = 2.5
VARIANCES = torch.linspace(5.0, 20.0, D, dtype=torch.float64)  # tr(Sigma) = 125
ROTATION = torch.linalg.qr(
    torch.randn(D, D, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
).Q  # a non-diagonal Sigma
SIGMA = ROTATION @ torch.diag(VARIANCES) @ ROTATION.T


def _dataset(n, seed):
    """n examples a_i ~ N(G, Sigma) (float32 inputs, as a model sees them); the targets are unused."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, D, generator=gen, dtype=torch.float64)
    a = G_TRUE + z @ torch.linalg.cholesky(SIGMA).T
    return TensorDataset(a.float(), torch.zeros(n, dtype=torch.long))


def _mean_output(out, y):
    """The batch loss: mean over examples of l_i = a_i . theta, the model's output."""
    return out.mean()


def test_closed_form_of_the_synthetic_problem():
    ds = _dataset(200_000, seed=1)
    a = ds.tensors[0].double()
    assert torch.allclose(a.mean(0), G_TRUE, atol=0.03), "the sample mean should approach G"
    assert torch.allclose(torch.cov(a.T), SIGMA, atol=0.3), "the sample covariance should approach Sigma"
    # the per-example gradient of l_i = a_i . theta is a_i, whatever theta is
    theta = nn.Linear(D, 1, bias=False).double()
    x = a[:3]
    grads = [torch.autograd.grad(theta(x[i : i + 1]).sum(), theta.weight)[0].flatten() for i in range(3)]
    assert torch.allclose(torch.stack(grads), x)


def test_two_batch_estimator_recovers_b_simple_within_10_percent():
    true_b = float(SIGMA.trace() / (G_TRUE @ G_TRUE))  # 125 / 2.5 = 50
    assert math.isclose(true_b, 50.0, rel_tol=1e-9)
    torch.manual_seed(0)
    model = nn.Linear(D, 1, bias=False)
    small, big = gradient_noise.grad_sq_norms(
        model, _dataset(200_000, seed=2), b_small=16, b_big=256, draws=1500, seed=3, loss_fn=_mean_output, device="cpu"
    )
    est = gradient_noise.noise_scale(small, big, 16, 256)
    assert abs(est.G2 / 2.5 - 1) < 0.1, f"|G|^2 estimated {est.G2:.3f}, true 2.5"
    assert abs(est.tr_sigma / 125.0 - 1) < 0.1, f"tr(Sigma) estimated {est.tr_sigma:.2f}, true 125"
    assert abs(est.b_simple / true_b - 1) < 0.1, (
        f"B_simple estimated {est.b_simple:.2f}, the closed form tr(Sigma)/|G|^2 is {true_b:.2f}"
    )
    # the one-step estimates are unbiased, not each right: single pairs scatter widely
    G2, trS = gradient_noise.two_batch_estimates(small, big, 16, 256)
    assert float(trS.std()) > 0.2 * 125.0, "single pairs should be noisy; averaging is what makes it work"


def test_estimator_is_exact_on_the_expected_squared_norms():
    """With E|G_B|^2 = |G|^2 + tr(Sigma)/B fed in (no sampling noise), the two-batch formulas
    must return the closed form exactly, for any pair of batch sizes."""
    G2, trS = float(G_TRUE @ G_TRUE), float(SIGMA.trace())
    for bs, bb in [(1, 2), (16, 256), (3, 1000)]:
        ns = gradient_noise.noise_scale([G2 + trS / bs], [G2 + trS / bb], bs, bb)
        assert math.isclose(ns.b_simple, trS / G2, rel_tol=1e-12)
        assert math.isclose(ns.G2, G2, rel_tol=1e-12) and math.isclose(ns.tr_sigma, trS, rel_tol=1e-12)


def _pair_sq_norms(pairs, b_small, b_big, gen):
    """Squared norms of (small, big) batch gradients drawn exactly: a batch mean of B examples
    a_i ~ N(G, Sigma) is N(G, Sigma / B), and the small batch is the big one's first b_small."""
    chol = torch.linalg.cholesky(SIGMA)
    head = G_TRUE + torch.randn(pairs, D, generator=gen, dtype=torch.float64) @ chol.T / math.sqrt(b_small)
    rest = G_TRUE + torch.randn(pairs, D, generator=gen, dtype=torch.float64) @ chol.T / math.sqrt(b_big - b_small)
    big = (b_small * head + (b_big - b_small) * rest) / b_big
    return (head**2).sum(1), (big**2).sum(1)


def test_bootstrap_standard_error_matches_the_spread_of_independent_repeats():
    """The oracle is the estimator run again: the standard deviation of log B_simple over 400
    independent sets of 300 pairs, against the bootstrap's standard error from single sets."""
    gen = torch.Generator().manual_seed(11)
    repeats = [gradient_noise.noise_scale(*_pair_sq_norms(300, 4, 64, gen), 4, 64).b_simple for _ in range(400)]
    spread = float(torch.tensor(repeats).log().std())
    boot = [gradient_noise.bootstrap_log_se(*_pair_sq_norms(300, 4, 64, gen), 4, 64, seed=s) for s in range(10)]
    assert 0.8 < sum(boot) / len(boot) / spread < 1.2, (boot, spread)


def test_bootstrap_standard_error_is_infinite_when_g2_can_vanish():
    """Per-pair |G|^2 estimates of both signs: some resample averages to |G|^2 <= 0, where B_simple is
    unbounded, and so is its error."""
    sq_small, sq_big = [1.0, 1.0, 1.0], [0.8, 0.05, 0.05]  # |G|^2 per pair at b 2 and 4: +0.6, -0.9, -0.9
    G2, _ = gradient_noise.two_batch_estimates(sq_small, sq_big, 2, 4)
    assert G2.min() < 0 < G2.max()
    assert gradient_noise.bootstrap_log_se(sq_small, sq_big, 2, 4) == math.inf
