"""utils.batch_sweeps: the critical-batch fit and a steps-to-target sweep at smoke scale."""

import math

import pytest

from utils import batch_sweeps, data


def test_fit_critical_batch_recovers_model_curve():
    B = [2, 8, 32, 128, 512]
    S = [100 * (1 + 20 / b) for b in B]
    s_min, b_crit = batch_sweeps.fit_critical_batch(B, S)
    assert math.isclose(s_min, 100, rel_tol=1e-9) and math.isclose(b_crit, 20, rel_tol=1e-9)


@pytest.mark.slow  # trains to a target at two batch sizes
def test_steps_to_target_sweep_smoke():
    splits = data.load("digits", n_train=300, n_val=100)
    rows = batch_sweeps.sweep_steps_to_target(
        splits, [16, 64], lambda B: 0.05, target_acc=0.5, max_steps=60, width=8, device="cpu", progress=False
    )
    assert [r["batch_size"] for r in rows] == [16, 64]
    for r in rows:
        assert r["steps_to_target"] is not None and r["steps_to_target"] <= 60, r
        assert r["eval_every"] == max(1, 32 // r["batch_size"])


def test_plot_marks_the_rows_at_the_rate_cap():
    import matplotlib

    matplotlib.use("Agg")
    rows = [
        {"batch_size": b, "lr": min(0.01 * b / 4, 0.05), "steps_to_target": s}
        for b, s in [(4, 400), (16, 110), (64, 60), (256, 50)]
    ]
    fig, fitted = batch_sweeps.plot_steps_to_target(rows, lr_cap=0.05)
    ax = fig.axes[0]
    hollow = [ln for ln in ax.get_lines() if ln.get_label().startswith("measured, rate capped")]
    assert len(hollow) == 1 and sorted(hollow[0].get_xdata()) == [64, 256], "the rows at the cap are 64 and 256"
    filled = [ln for ln in ax.get_lines() if ln.get_label() == "measured"]
    assert sorted(filled[0].get_xdata()) == [4, 16]
    assert fitted["b_crit"] > 0
