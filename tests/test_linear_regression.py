"""utils.linear_regression: GD and SGD on the linear problem, against closed forms."""

import math

import pytest
import torch

from utils import linear_regression

PROBLEM = linear_regression.LinearProblem()


@pytest.fixture(scope="module")
def points():
    return PROBLEM.sample(256, seed=0)


def test_full_batch_gd_reaches_least_squares(points):
    x, y = points
    w_star, b_star = linear_regression.least_squares(x, y)
    path = linear_regression.gd(x, y, -1.0, 3.0, lr=0.2, steps=300)
    assert abs(path[-1, 0] - w_star) < 1e-3 and abs(path[-1, 1] - b_star) < 1e-3, (
        f"full-batch GD ended at {path[-1].tolist()}, least squares is ({w_star}, {b_star}): "
        "check mse_grad (2 mean(r x), 2 mean(r)) and gd_step's sign"
    )
    assert path.shape == (301, 2)


def test_least_squares_matches_torch_lstsq(points):
    x, y = points
    A = torch.stack([x, torch.ones_like(x)], 1)
    want = torch.linalg.lstsq(A, y[:, None]).solution.flatten()
    assert torch.allclose(torch.tensor(linear_regression.least_squares(x, y), dtype=torch.float64), want, atol=1e-10)


def test_mse_grad_matches_autograd(points):
    x, y = points
    w = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(-0.2, dtype=torch.float64, requires_grad=True)
    ((w * x + b - y) ** 2).mean().backward()
    dw, db = linear_regression.mse_grad(x, y, 0.7, -0.2)
    assert math.isclose(dw, w.grad.item(), rel_tol=1e-12) and math.isclose(db, b.grad.item(), rel_tol=1e-12)


def test_sgd_with_whole_dataset_is_gd_and_small_batches_are_noisy(points):
    x, y = points
    gd_path = linear_regression.gd(x, y, -1.0, 3.0, 0.1, 40)
    assert torch.allclose(linear_regression.sgd(x, y, -1.0, 3.0, 0.1, 40, len(x)), gd_path), "batch_size=n must be GD"
    one = linear_regression.sgd(x, y, -1.0, 3.0, 0.1, 40, 1)
    assert one.shape == (41, 2) and not torch.allclose(one, gd_path)


def test_minibatches_cover_each_epoch_once():
    it = linear_regression.minibatches(10, 3, seed=1)
    epoch = torch.cat([next(it) for _ in range(3)])  # 3 batches of 3; the 10th index dropped
    assert len(set(epoch.tolist())) == 9
    with pytest.raises(ValueError, match="batch_size"):
        next(linear_regression.minibatches(10, 11))


def test_loss_surface_matches_direct_mse(points):
    x, y = points
    wg, bg = torch.linspace(-1, 3, 5), torch.linspace(-2, 2, 4)
    L = linear_regression.loss_surface(x, y, wg, bg)
    assert L.shape == (4, 5)
    assert math.isclose(float(L[1, 3]), linear_regression.mse(x, y, float(wg[3]), float(bg[1])), rel_tol=1e-9)


def test_gd_threshold_is_two_over_the_largest_hessian_eigenvalue(points):
    """Oracle: autograd's Hessian of the MSE and torch's symmetric eigensolver; then GD itself
    converges just below the threshold and diverges just above it."""
    x, y = points
    H = torch.autograd.functional.hessian(
        lambda v: ((v[0] * x + v[1] - y) ** 2).mean(), torch.zeros(2, dtype=torch.float64)
    )
    assert torch.allclose(linear_regression.hessian(x), H, rtol=1e-12)
    threshold = linear_regression.gd_lr_threshold(x)
    assert math.isclose(threshold, 2 / torch.linalg.eigvalsh(H).max().item(), rel_tol=1e-12)
    w_star, b_star = linear_regression.least_squares(x, y)
    below = linear_regression.gd(x, y, -1.0, 3.0, 0.95 * threshold, 2000)[-1]
    above = linear_regression.gd(x, y, -1.0, 3.0, 1.05 * threshold, 2000)[-1]
    assert abs(below[0] - w_star) < 1e-6 and abs(below[1] - b_star) < 1e-6
    assert not torch.isfinite(above).all() or above.abs().max() > 1e6


def test_panel_slider_reaches_past_the_divergence_threshold(points, monkeypatch):
    pytest.importorskip("ipywidgets")
    import matplotlib

    matplotlib.use("Agg")
    monkeypatch.setattr("IPython.display.display", lambda *a, **k: None)
    x, y = points
    box = linear_regression.trajectory_panel(x, y, -1.0, 3.0, lr=0.1, steps=5, batch_size=16)
    lr_slider = box.children[1]
    assert lr_slider.max > 1.2 * linear_regression.gd_lr_threshold(x)
