"""A run stopped early on purpose (a callback sets state.stop) ends with a green notebook
progress bar, not the red one tqdm.notebook shows for an interrupted loop."""

import pytest
import torch
from torch import nn

from utils import train

notebook = pytest.importorskip("tqdm.notebook")


class StopAfter(train.Callback):
    def __init__(self, steps):
        self.steps = steps

    def on_step_end(self, state):
        state.stop = state.step >= self.steps


def test_an_early_stop_leaves_a_green_bar(monkeypatch):
    bars = []

    class Recorded(notebook.tqdm):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            bars.append(self)

    monkeypatch.setattr(train, "tqdm", Recorded)
    torch.manual_seed(0)
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    loader = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 64, 8)]
    model = nn.Linear(4, 2)
    h = train.fit(
        model, loader, torch.optim.SGD(model.parameters(), lr=0.1), epochs=3, progress=True, callbacks=[StopAfter(5)]
    )
    assert h.steps == 5
    (bar,) = bars
    widget = bar.container.children[-2]
    assert widget.bar_style == "success", f"bar style {widget.bar_style!r} after an early stop"
    assert (widget.value, widget.max) == (5, 5)
