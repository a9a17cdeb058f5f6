"""utils.batch_sweeps: the learning-rate walk and pick against synthetic steps tables whose best rate
is known, the critical-batch fit against curves of known S_min and B_crit, and real runs at smoke scale."""

import math

import numpy as np
import pytest

from utils import batch_sweeps, data

GRID = [0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32]


def table_runner(table):
    """steps_at(lr, limit) for a table {lr: steps or None}: a run stops at its limit, as fit does."""
    calls = []

    def steps_at(lr, limit):
        calls.append((lr, limit))
        s = table[lr]
        return s if s is not None and s <= limit else None

    return steps_at, calls


@pytest.mark.parametrize(
    "start, best",
    [(0.01, 0.04), (0.16, 0.04), (0.04, 0.04), (0.0025, 0.04)],
)
def test_search_finds_the_best_rate_of_a_unimodal_table_from_any_start(start, best):
    # steps fall by 1.5x per doubling up to 0.04, then rise; 0.32 never reaches the target
    table = {lr: round(100 * 1.5 ** abs(math.log2(lr / 0.04))) for lr in GRID}
    table[0.32] = None
    steps_at, calls = table_runner(table)
    trials = batch_sweeps.search_rate(steps_at, GRID, start, max_steps=1000)
    pick = batch_sweeps.pick_rate(trials, GRID)
    assert pick["lr"] == best and pick["steps"] == 100 and pick["bracketed"] and pick["ties"] == []
    assert calls[0] == (start, 1000), "the first trial starts at the given rate with the full step budget"
    for k in range(1, len(trials)):
        done = [u["steps"] for u in trials[:k] if u["steps"] is not None]
        assert calls[k][1] == trials[k]["limit"] == (min(done) if done else 1000), "limited to the best so far"
    assert len(trials) <= abs(round(math.log2(start / best))) + 3, "the walk tries the path to the best and one past"


def test_search_starts_at_the_grid_rate_nearest_the_start_and_tries_three_rates():
    table = dict.fromkeys(GRID, 50)
    table[0.02] = 40
    steps_at, calls = table_runner(table)
    trials = batch_sweeps.search_rate(steps_at, GRID, 0.023, max_steps=500)
    assert [t["lr"] for t in trials] == [0.02, 0.04, 0.01]
    assert batch_sweeps.pick_rate(trials, GRID) == {"lr": 0.02, "steps": 40, "ties": [], "bracketed": True}


def test_pick_reports_ties_keeps_the_first_tried_and_says_when_nothing_reached():
    trials = [
        {"lr": 0.01, "steps": 368, "limit": 500},
        {"lr": 0.02, "steps": None, "limit": 368},
        {"lr": 0.005, "steps": 368, "limit": 368},
    ]
    assert batch_sweeps.pick_rate(trials, GRID) == {"lr": 0.01, "steps": 368, "ties": [0.005], "bracketed": True}
    none = [{"lr": lr, "steps": None, "limit": 500} for lr in (0.01, 0.02, 0.005)]
    assert batch_sweeps.pick_rate(none, GRID) == {"lr": None, "steps": None, "ties": [], "bracketed": False}


def test_a_best_rate_at_the_end_of_the_grid_is_not_bracketed_nor_fitted():
    table = {lr: round(1000 * lr**-0.5) for lr in GRID}  # the higher the better, all the way up
    steps_at, _ = table_runner(table)
    trials = batch_sweeps.search_rate(steps_at, GRID, 0.04, max_steps=10_000)
    pick = batch_sweeps.pick_rate(trials, GRID)
    assert pick["lr"] == GRID[-1] and not pick["bracketed"]
    rows = [
        {"batch_size": 8, "steps_to_target": 300, "bracketed": True},
        {"batch_size": 32, "steps_to_target": 100, "bracketed": False},
        {"batch_size": 128, "steps_to_target": None, "bracketed": False},
    ]
    assert [r["batch_size"] for r in batch_sweeps.tuned_rows(rows)] == [8]


def test_fit_critical_batch_recovers_model_curve():
    B = [2, 8, 32, 128, 512]
    S = [100 * (1 + 20 / b) for b in B]
    s_min, b_crit = batch_sweeps.fit_critical_batch(B, S)
    assert math.isclose(s_min, 100, rel_tol=1e-9) and math.isclose(b_crit, 20, rel_tol=1e-9)


def test_fit_critical_batch_through_noise_of_known_size():
    # 10% multiplicative noise on the four batch sizes of a sweep: the fit lands near the truth
    rng = np.random.default_rng(0)
    B = np.array([4, 16, 64, 256])
    fits = []
    for _ in range(200):
        S = 40 * (1 + 30 / B) * np.exp(rng.normal(0, 0.1, size=B.size))
        fits.append(batch_sweeps.fit_critical_batch(B, S))
    s_min, b_crit = np.median(np.array(fits), axis=0)
    assert abs(math.log(s_min / 40)) < 0.1 and abs(math.log(b_crit / 30)) < 0.2


@pytest.mark.slow  # trains to a target at two batch sizes, a few rates each
def test_tuning_at_smoke_scale_reaches_the_target_at_each_batch():
    splits = data.load("digits", n_train=300, n_val=100)
    grid = [0.0125, 0.025, 0.05, 0.1, 0.2]
    rows = batch_sweeps.tune_steps_to_target(
        splits, [64, 16], grid, 0.05, target_acc=0.5, max_steps=60, width=8, device="cpu", progress=False
    )
    assert [r["batch_size"] for r in rows] == [16, 64]
    for r in rows:
        assert r["lr"] in grid and r["steps_to_target"] is not None and r["steps_to_target"] <= 60, r
        assert r["eval_every"] == max(1, 32 // r["batch_size"])
        assert len(r["trials"]) >= 2 and r["trials"][0]["limit"] == 60
        # the pick is the fewest steps among the trials that reached the target
        assert r["steps_to_target"] == min(t["steps"] for t in r["trials"] if t["steps"] is not None)
    # the same seed, rate and batch give the same run: one trial repeated alone takes the same steps
    r = rows[0]
    again = batch_sweeps.steps_to_target(
        splits, 16, r["lr"], target_acc=0.5, max_steps=60, width=8, device="cpu", progress=False
    )
    assert again["steps_to_target"] == r["steps_to_target"]


def test_images_per_s_in_turns_alternates_the_order_and_drops_the_untimed_round(monkeypatch):
    from utils import train

    calls, real_fit = [], train.fit

    def spy(model, loader, opt, **kw):
        hist = real_fit(model, loader, opt, **kw)
        calls.append((loader.batch_size, kw["steps"], id(model), opt.param_groups[0]["lr"], hist.images_per_s))
        return hist

    monkeypatch.setattr(train, "fit", spy)
    splits = data.load("digits", n_train=200, n_val=50)
    rates = batch_sweeps.images_per_s_in_turns(
        splits, (8, 32), lambda b: 0.001 * b, rounds=3, images=100, width=8, device="cpu"
    )
    # one untimed round, then three: the order reverses each round; about 100 images each, at least 2 steps
    assert [(b, steps) for b, steps, *_ in calls] == [
        (32, 3),
        (8, 12),
        (8, 12),
        (32, 3),
        (32, 3),
        (8, 12),
        (8, 12),
        (32, 3),
    ]
    assert {b: lr for b, _, _, lr, _ in calls} == {8: 0.008, 32: 0.032}
    assert len({i for b, _, i, _, _ in calls if b == 8}) == 1, "each batch size keeps training one model"
    timed = calls[2:]
    assert rates == {b: [r for c, *_, r in timed if c == b] for b in (8, 32)}
    assert all(r > 0 for rs in rates.values() for r in rs)
    with pytest.raises(ValueError, match="rounds >= 1"):
        batch_sweeps.images_per_s_in_turns(splits, (8,), lambda b: 0.01, rounds=0, images=10)


@pytest.mark.slow  # one short run and four noise-scale measurements
def test_noise_scale_along_run_measures_the_kept_copies():
    import torch

    from utils import gradient_noise, models

    splits = data.load("digits", n_train=300, n_val=100)
    points = batch_sweeps.noise_scale_along_run(
        splits, 16, 0.05, [0, 5, 10], b_small=4, b_big=64, draws=4, width=8, device="cpu"
    )
    assert [p["step"] for p in points] == [0, 5, 10]
    # step 0 is the initial model: the same seed builds it again, and the estimator agrees exactly
    torch.manual_seed(0)
    init = models.net_for(splits.shape, 8)
    ns = gradient_noise.measure_noise_scale(init, splits.train, 4, 64, 4, device="cpu")
    assert math.isclose(points[0]["b_simple"], ns.b_simple, rel_tol=1e-9)
    assert points[1]["G2"] != points[0]["G2"], "later points measure trained weights"


def test_plot_draws_tuned_rows_filled_and_fits_only_them():
    import matplotlib

    matplotlib.use("Agg")
    rows = [
        {"batch_size": 4, "lr": 0.01, "steps_to_target": 400, "bracketed": True},
        {"batch_size": 16, "lr": 0.02, "steps_to_target": 110, "bracketed": True},
        {"batch_size": 64, "lr": 0.04, "steps_to_target": 60, "bracketed": True},
        {"batch_size": 256, "lr": 0.32, "steps_to_target": 500, "bracketed": False},
    ]
    fig, fitted = batch_sweeps.plot_steps_to_target(rows)
    ax = fig.axes[0]
    hollow = [ln for ln in ax.get_lines() if ln.get_label() == "best rate at the grid's end"]
    assert len(hollow) == 1 and list(hollow[0].get_xdata()) == [256]
    filled = [ln for ln in ax.get_lines() if ln.get_label() == "measured, rate tuned"]
    assert sorted(filled[0].get_xdata()) == [4, 16, 64]
    assert (fitted["s_min"], fitted["b_crit"]) == batch_sweeps.fit_critical_batch([4, 16, 64], [400, 110, 60])


def test_noise_scale_plot_draws_each_positive_estimate_against_its_step_with_labels():
    import matplotlib

    matplotlib.use("Agg")
    points = [
        {"step": 0, "b_simple": 160.0, "log_se": 0.1},
        {"step": 90, "b_simple": 25.0, "log_se": 0.3},
        {"step": 180, "b_simple": math.inf, "log_se": math.inf},  # |G|^2 estimated at 0: no point
        {"step": 360, "b_simple": 50.0, "log_se": 0.3},
    ]
    ax = batch_sweeps.plot_noise_scale_along_run(points, title="B_simple along a run").axes[0]
    line = ax.get_lines()[0]
    assert list(line.get_xdata()) == [0, 90, 360] and list(line.get_ydata()) == [160, 25, 50]
    assert ax.get_title() == "B_simple along a run" and "step" in ax.get_xlabel() and "images" in ax.get_ylabel()
    assert ax.get_yscale() == "log"


def test_tuned_rates_plot_shows_every_trial_the_picks_and_the_linear_rule():
    import matplotlib

    matplotlib.use("Agg")
    rows = [
        {"batch_size": 4, "lr": 0.01, "trials": [{"lr": 0.01, "steps": 368}, {"lr": 0.02, "steps": None}]},
        {"batch_size": 16, "lr": 0.02, "trials": [{"lr": 0.01, "steps": 162}, {"lr": 0.02, "steps": 124}]},
    ]
    ax = batch_sweeps.plot_tuned_rates(rows, linear=lambda b: 0.0025 * b).axes[0]
    by_label = {ln.get_label(): ln for ln in ax.get_lines()}
    assert list(by_label["tuned"].get_xdata()) == [4, 16] and list(by_label["tuned"].get_ydata()) == [0.01, 0.02]
    assert list(by_label["linear scaling rule"].get_ydata()) == [0.01, 0.04]
    trial_marks = [ln for ln in ax.get_lines() if ln.get_label().startswith("_") and len(ln.get_xdata()) == 1]
    assert sorted((float(ln.get_xdata()[0]), float(ln.get_ydata()[0])) for ln in trial_marks) == [
        (4, 0.01),
        (4, 0.02),
        (16, 0.01),
        (16, 0.02),
    ]


def test_fit_critical_batch_with_one_point_says_what_to_change():
    with pytest.raises(ValueError, match=r"1 batch size\(s\) reached the target.*Try: raise sgd_max_steps"):
        batch_sweeps.fit_critical_batch([16], [120])
