"""Self-check of the example exercise (solutions/lab0_example.ipynb)."""

from collections.abc import Callable
from typing import Any

import torch

from ._common import _call, _close, _fail, _passed

__all__ = ["check_accuracy"]


def check_accuracy(accuracy: Callable[..., Any]) -> None:
    """``accuracy(logits, labels)``: the fraction (a float in [0, 1]) of rows whose arg-max
    logit equals the label."""
    name = "accuracy"
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.0], [0.0, 3.0, 1.0, 0.0], [0.5, 0.2, 0.9, 0.3], [1.0, 3.5, 4.0, 0.1]])
    labels = torch.tensor([0, 1, 0, 1])
    got = _call(name, accuracy, logits, labels)
    if isinstance(got, torch.Tensor):
        if got.numel() != 1:
            _fail(
                name,
                f"returned a tensor of shape {tuple(got.shape)}, expected one number",
                "reduce the per-example comparison with .float().mean()",
            )
        got = got.item()
    if not isinstance(got, (int, float)):
        _fail(name, f"returned {type(got).__name__}, expected a float", "return .item() of the mean")
    if _close(got, 2):
        _fail(
            name,
            "returned 2, the number of correct predictions, not the fraction",
            "divide by the number of examples (or use .float().mean())",
        )
    if _close(got, 50):
        _fail(name, "returned 50, a percentage", "return the fraction in [0, 1]: do not multiply by 100")
    if _close(got, 0.25):
        _fail(
            name,
            "returned 0.25: the arg-max seems to be taken over the batch dimension",
            "the class scores are along dim=1: logits.argmax(dim=1)",
        )
    if not _close(got, 0.5):
        _fail(
            name,
            f"returned {got}, expected 0.5 on a 4-example, 4-class case",
            "compare logits.argmax(dim=1) with labels, then average",
        )
    _passed(name)
