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


_OUTCOMES: dict = {}


def _outcomes(lab: str, ex: engine.Exercise) -> list:
    """One launch of a rank-run exercise on its solution, shared by the tests below."""
    if ex.name not in _OUTCOMES:
        _OUTCOMES[ex.name] = engine.rank_outcomes(ex, *answer(lab, ex))
    return _OUTCOMES[ex.name]


def _source(variant) -> str:
    """The code of an answer (one function or class, or several), as check reads it."""
    return engine._source(variant if isinstance(variant, (tuple, list)) else (variant,))


def replayed_tests_for(lab: str, exercises: list):
    """For rank-run exercises, from one launch each on the solution: the solution passes, and each
    replayed mistake is named when its own outputs (computed on the ranks in that launch, as every
    check computes them) are judged as the answer's. A real submission of the variant would run the
    same function on the same ranks; what these tests leave out (shipping and refusing) the solution
    and placeholder tests cover. Mistakes seen by a predicate need a launch of their own."""
    ids = [ex.name for ex in exercises]
    pairs = [(ex, m) for ex in exercises for m in engine._replayed(ex)]
    pair_ids = [f"{ex.name}-{re.sub(r'[^a-z]+', '_', m.problem.lower())[:40]}" for ex, m in pairs]

    @pytest.mark.parametrize("ex", exercises, ids=ids)
    def test_solution_passes(ex):
        engine.judge_on_ranks(ex, _outcomes(lab, ex), _source(answer(lab, ex)))

    @pytest.mark.parametrize("ex,mistake", pairs, ids=pair_ids)
    def test_replayed_mistake_is_named(ex, mistake):
        j = engine._replayed(ex).index(mistake)
        per_case = _outcomes(lab, ex)
        assert all(reps[j] is not None for _, _, reps, _ in per_case), "the variant ran on every rank"
        as_answer = [(reps[j], want, reps, label) for _, want, reps, label in per_case]
        with pytest.raises(CheckFailed) as e:
            engine.judge_on_ranks(ex, as_answer, _source(mistake.variant))
        text = str(e.value)
        assert mistake.problem.rstrip(".") in text and mistake.hint.rstrip(".") in text, text

    return test_solution_passes, test_replayed_mistake_is_named
