"""Figures shared by several notebooks: training curves and throughput bars. Every axis has a
title, labels and units."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import matplotlib.pyplot as plt

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def _as_dict(histories):
    return histories if isinstance(histories, dict) else {"run": histories}


def plot_history(histories: Any, title: str = "Training curves", axes: Sequence[Axes] | None = None) -> Figure:
    """Loss per optimizer step and validation accuracy per epoch, for one History or a
    {label: History} dict. Returns the figure."""
    histories = _as_dict(histories)
    if axes is None:
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    else:
        fig = axes[0].figure
    ax_loss, ax_acc = axes
    for label, h in histories.items():
        ax_loss.plot(range(1, len(h.step_loss) + 1), h.step_loss, label=label, alpha=0.85)
        pts = [(e["step"], e["val_acc"]) for e in h.epochs if e.get("val_acc") is not None]
        pts += [(e["step"], e["val_acc"]) for e in h.evals if e.get("val_acc") is not None]
        if pts:
            pts = sorted(set(pts))
            ax_acc.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=label)
    ax_loss.set(title="Training loss", xlabel="optimizer step", ylabel="cross-entropy loss (nats)")
    ax_acc.set(title="Validation accuracy", xlabel="optimizer step", ylabel="accuracy (%)")
    for ax in axes:
        ax.grid(alpha=0.3)
        if len(histories) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def throughput_bars(
    results: dict, title: str = "Training throughput", ax: Axes | None = None, unit: str = "images/s"
) -> Figure:
    """Horizontal bars of {label: images/s} (or {label: (median, spread)}), values printed."""
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 0.5 + 0.45 * len(results)))
    labels = list(results)
    vals = [v[0] if isinstance(v, (tuple, list)) else v for v in results.values()]
    errs = [v[1] if isinstance(v, (tuple, list)) else 0 for v in results.values()]
    ax.barh(labels, vals, xerr=errs if any(errs) else None, color="tab:blue", alpha=0.8)
    for i, v in enumerate(vals):
        ax.text(v, i, f" {v:,.0f}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set(title=title, xlabel=f"throughput ({unit})")
    ax.grid(axis="x", alpha=0.3)
    ax.figure.tight_layout()
    return ax.figure


def _plain(value, pos=None) -> str:
    """A tick label a reader reads at a glance: 2, 64, 1,024, 0.5, 0.02 (never 10^k or 2x10^1)."""
    if value == 0:
        return "0"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if float(value).is_integer():
        return f"{value:.0f}"
    return f"{value:.3g}"


def _log_ticks(lo: float, hi: float) -> list:
    """1-2-5 ticks between lo and hi (all nine per decade when that gives too few)."""
    import math

    lo, hi = min(lo, hi), max(lo, hi)
    if lo <= 0:
        return []
    for subs in ((1, 2, 5), (1, 2, 3, 4, 5, 6, 7, 8, 9)):
        ticks = [
            m * 10.0**k
            for k in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
            for m in subs
            if lo <= m * 10.0**k <= hi
        ]
        if len(ticks) >= 3:
            return ticks
    return ticks


def plain_ticks(ax: Axes, axis: str = "x", values: Iterable[float] | None = None) -> Axes:
    """Plain-number tick labels on a linear or log axis; call it after plotting.

    ``values``: exactly these ticks (batch sizes, widths, process counts: an axis of counts then
    shows only whole numbers, never "1.5 processes"). Without them a log axis gets 1-2-5 ticks
    inside the current limits and a linear one keeps matplotlib's ticks, with minor labels off."""
    import matplotlib.ticker as mticker
    import numpy as np

    a = ax.xaxis if axis == "x" else ax.yaxis
    log = (ax.get_xscale() if axis == "x" else ax.get_yscale()) == "log"
    if values is not None:
        ticks = sorted({float(v) for v in values})
    elif log:
        ticks = _log_ticks(*(ax.get_xlim() if axis == "x" else ax.get_ylim()))
        if len(ticks) < 2:  # less than a factor 2 in view: evenly spaced plain ticks
            lo, hi = ax.get_xlim() if axis == "x" else ax.get_ylim()
            ticks = list(mticker.MaxNLocator(4).tick_values(lo, hi))
            ticks = [t for t in ticks if min(lo, hi) <= t <= max(lo, hi)] or [float(np.sqrt(lo * hi))]
    else:
        ticks = None
    if ticks is not None:
        a.set_major_locator(mticker.FixedLocator(ticks))
    a.set_major_formatter(mticker.FuncFormatter(_plain))
    a.set_minor_formatter(mticker.NullFormatter())
    return ax
