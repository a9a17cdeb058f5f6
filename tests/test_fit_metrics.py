"""fit's per-epoch and per-step records, reduced once per epoch on the device, against a hand
computation: with lr = 0 the model never changes, so every number can be recomputed directly."""

import pytest
import torch
from torch import nn

from utils.train import fit


def test_epoch_loss_accuracy_and_step_losses_equal_a_direct_computation():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    sizes = [8, 8, 8, 5]  # an uneven last batch: weighted by size
    batches = [(torch.randn(n, 6), torch.randint(0, 4, (n,))) for n in sizes]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    hist = fit(model, batches, opt, epochs=2, progress=False)
    with torch.no_grad():
        outs = [model(x) for x, _ in batches]
        losses = [nn.functional.cross_entropy(o, y).item() for o, (_, y) in zip(outs, batches)]
        correct = sum(int((o.argmax(1) == y).sum()) for o, (_, y) in zip(outs, batches))
    n = sum(sizes)
    want_loss = sum(l * s for l, s in zip(losses, sizes)) / n
    assert hist.step_loss == pytest.approx(losses * 2, rel=1e-6), "step_loss: one entry per optimizer step"
    for e in hist.epochs:
        assert e["train_loss"] == pytest.approx(want_loss, rel=1e-6), "train_loss: mean over examples"
        assert e["train_acc"] == pytest.approx(correct / n), "train_acc: correct / examples, over the epoch"
        assert e["images"] == n


def test_progress_bar_counts_every_step(capsys):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    batches = [(torch.randn(4, 3), torch.randint(0, 2, (4,))) for _ in range(7)]
    fit(model, batches, torch.optim.SGD(model.parameters(), lr=0.1), epochs=3, progress=True)
    err = capsys.readouterr().err
    assert "21/21" in err, "the bar, told at most every 0.1 s, must still end at the number of steps"
    fit(model, batches, torch.optim.SGD(model.parameters(), lr=0.1), epochs=3, start_epoch=1, progress=True)
    err = capsys.readouterr().err
    assert "14/14" in err, "a run resumed at epoch 1 of 3 has 2 epochs of 7 steps left"
