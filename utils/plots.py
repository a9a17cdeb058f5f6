"""Figures shared by several notebooks: training curves and throughput bars. Every axis has a
title, labels and units."""
from __future__ import annotations

import matplotlib.pyplot as plt


def _as_dict(histories):
    return histories if isinstance(histories, dict) else {"run": histories}


def plot_history(histories, title: str = "Training curves", axes=None):
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


def throughput_bars(results: dict, title: str = "Training throughput", ax=None, unit: str = "images/s"):
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
