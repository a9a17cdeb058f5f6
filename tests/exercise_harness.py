"""The one form of a lab's exercise tests (not a test file itself).

For every exercise spec of a lab: the solution notebook's answer passes, each named mistake's
variant fails with that mistake's own problem, and the lab's placeholder says "not implemented".
A lab's test file is then::

    pytestmark = ...
    LAB = "lab0_example"
    EXERCISES = [environment.ACCURACY]
    test_solution, test_mistake, test_placeholder = harness.tests_for(LAB, EXERCISES)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from utils.checks import CheckFailed, engine

ROOT = Path(__file__).resolve().parents[1]


def answer(lab: str, ex: engine.Exercise) -> tuple:
    """The solution notebook's answer to ``ex`` (``engine.solution_answer``; make gpu-check uses it too)."""
    return engine.solution_answer(ex, lab)


def _placeholder(*args, **kwargs):
    raise NotImplementedError("Exercise: write this part (see the hint above)")


_placeholder.__module__ = "__main__"


def _as_answer(ex: engine.Exercise, variant) -> tuple:
    return tuple(variant) if isinstance(variant, (tuple, list)) else (variant,)


def tests_for(lab: str, exercises: list):
    """The three parametrized tests of a lab: solution passes, each mistake named, placeholder refused."""
    ids = [ex.name for ex in exercises]
    pairs = [(ex, m) for ex in exercises for m in ex.mistakes]
    pair_ids = [f"{ex.name}-{i}-{re.sub(r'[^a-z]+', '_', m.problem.lower())[:40]}" for i, (ex, m) in enumerate(pairs)]

    @pytest.mark.parametrize("ex", exercises, ids=ids)
    def test_solution_passes(ex, capsys):
        engine.check(ex, *answer(lab, ex))
        assert f"\u2714 {ex.name}: correct" in capsys.readouterr().out

    @pytest.mark.parametrize("ex,mistake", pairs, ids=pair_ids)
    def test_mistake_is_named(ex, mistake):
        assert mistake.variant is not None, "every named mistake carries a variant that makes it"
        with pytest.raises(CheckFailed) as e:
            engine.check(ex, *_as_answer(ex, mistake.variant))
        text = str(e.value)
        assert mistake.problem.rstrip(".") in text and mistake.hint.rstrip(".") in text, text
        assert "\n" not in text and e.value.__suppress_context__, "one line, and no chained traceback"

    @pytest.mark.parametrize("ex", exercises, ids=ids)
    def test_placeholder_is_not_implemented(ex):
        with pytest.raises(CheckFailed, match="not implemented yet"):
            engine.check(ex, *([_placeholder] * len(ex.answer)))

    return test_solution_passes, test_mistake_is_named, test_placeholder_is_not_implemented
