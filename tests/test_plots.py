"""Tick labels a reader reads at a glance: plain numbers on log axes, whole numbers on counts."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from utils import plots  # noqa: E402


def _labels(ax, axis):
    ax.figure.canvas.draw()
    ticks = ax.get_xticklabels() if axis == "x" else ax.get_yticklabels()
    lo, hi = sorted(ax.get_xlim() if axis == "x" else ax.get_ylim())
    return [
        t.get_text()
        for t in ticks
        if t.get_text() and lo <= (t.get_position()[0] if axis == "x" else t.get_position()[1]) <= hi
    ]


def test_batch_sizes_on_a_log_axis_read_as_numbers():
    fig, ax = plt.subplots()
    bs = [2, 4, 16, 64, 256, 1024]
    ax.plot(bs, [860, 1350, 1400, 1474, 1500, 1510], "o-")
    ax.set(xscale="log", yscale="log")
    plots.plain_ticks(ax, "x", bs)
    plots.plain_ticks(ax, "y")
    assert _labels(ax, "x") == ["2", "4", "16", "64", "256", "1,024"]
    y = _labels(ax, "y")
    assert len(y) >= 2 and all(l.replace(",", "").replace(".", "").isdigit() for l in y), y
    plt.close(fig)


def test_a_narrow_log_range_still_gets_plain_labels():
    fig, ax = plt.subplots()
    ax.plot([1, 2, 3], [610, 700, 820])
    ax.set_yscale("log")
    plots.plain_ticks(ax, "y")
    y = _labels(ax, "y")
    assert len(y) >= 2 and not any("10" in l and "^" in l or "$" in l for l in y), y
    plt.close(fig)


def test_process_counts_are_whole_numbers():
    fig, ax = plt.subplots()
    ax.plot([1, 2], [100, 93], "o-")
    plots.plain_ticks(ax, "x", [1, 2])
    assert _labels(ax, "x") == ["1", "2"]
    plt.close(fig)


def test_small_values_keep_their_digits():
    assert [plots._plain(v) for v in (0.5, 0.02, 3.0, 2500.0, 0)] == ["0.5", "0.02", "3", "2,500", "0"]
