"""Lab 0's exercise (solutions/lab0_example.ipynb): the spec of `accuracy`, an example of the engine."""

import torch

from .engine import Case, Exercise, mistake

__all__ = ["check_accuracy", "ACCURACY"]

LAB = "lab0_example"


def _cases() -> list:  # square, taller than wide, and one where the arg-max over the batch would differ
    g = torch.Generator().manual_seed(0)
    logits_a = torch.tensor([[2.0, 1.0, 0.0, 0.0], [0.0, 3.0, 1.0, 0.0], [0.5, 0.2, 0.9, 0.3], [1.0, 3.5, 4.0, 0.1]])
    logits_b = torch.randn(10, 3, generator=g)
    labels_b = logits_b.argmax(dim=1).clone()
    labels_b[:3] = (labels_b[:3] + 1) % 3  # 7 of 10 right
    return [
        Case((logits_a, torch.tensor([0, 1, 0, 1])), label="a batch of 4 examples and 4 classes"),
        Case((logits_b, labels_b), label="a batch of 10 examples and 3 classes"),
        Case(
            (torch.randn(6, 5, generator=g), torch.tensor([0, 1, 2, 3, 4, 0])),
            label="a batch of 6 examples and 5 classes",
        ),
    ]


def _accuracy(logits, labels):
    return (logits.argmax(dim=1) == labels).float().mean().item()


def _correct(logits, labels):
    return (logits.argmax(dim=1) == labels).sum().item()


ACCURACY = Exercise(
    name="accuracy",
    cases=_cases,
    oracle=_accuracy,
    hint="take each row's arg-max over the classes, compare it with the labels, then average the matches",
    passed="3 batches of different shapes",
    # Each mistake: what is wrong, "Try:", what to do, then a variant that makes it (the tests submit it).
    mistakes=[
        mistake(
            "it returns the number of correct predictions, not the fraction. Try: divide the count by the number of "
            "examples",
            _correct,
        ),
        mistake(
            "it returns a percentage. Try: return the fraction in [0, 1], without multiplying by 100",
            lambda logits, labels: 100 * _accuracy(logits, labels),
        ),
        mistake(
            "it returns the error rate, the fraction of WRONG predictions. Try: count the rows whose arg-max equals "
            "the label, not those where it differs",
            lambda logits, labels: 1 - _accuracy(logits, labels),
        ),
        mistake(
            "it divides by the number of classes instead of the number of examples. Try: the number of examples is "
            "the length of the batch dimension (dim 0)",
            lambda logits, labels: _correct(logits, labels) / logits.shape[1],
        ),
        mistake(
            "the arg-max seems to be taken over the batch dimension. Try: the class scores lie along dim 1: take the "
            "arg-max over that dimension",
            lambda logits, labels: (
                (logits.argmax(dim=0)[: len(labels)] == labels[: logits.shape[1]]).float().mean().item()
            ),
        ),
        mistake(
            "it returns a tensor, not a Python float. Try: turn the one-element result into a number with .item()",
            lambda logits, labels: (logits.argmax(dim=1) == labels).float().mean(),
            when=lambda o: torch.is_tensor(o.got),
            mechanism=True,
        ),
    ],
)

check_accuracy = ACCURACY.checker(
    "``accuracy(logits, labels)``: the fraction (a float in [0, 1]) of rows whose arg-max logit equals the label."
)
