"""Students' self-checks: each runs the student's code on a case with a known answer and, when
it is wrong, says what is wrong and where to look, not just "failed".

Usage in a lab, right after an exercise cell::

    utils.checks.check_accuracy(accuracy)

Each ``check_*`` prints one line starting with a tick when everything passes and raises
:class:`CheckFailed` (an AssertionError) with the diagnosis otherwise. Each stage keeps its
checks in its own module here (stage0.py, stage1.py, ...); this package re-exports them all.
"""
from __future__ import annotations

import math
import traceback

import torch


class CheckFailed(AssertionError):
    """A self-check found a mistake; the message says what to fix."""


def _call(name: str, fn, *args, **kwargs):
    """Run the student's ``fn``; turn the placeholder and crashes into readable failures."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        raise CheckFailed(f"{name}: not implemented yet. Replace the `raise NotImplementedError(...)` "
                          f"line in the exercise cell with your code, run that cell, then this one.") from None
    except CheckFailed:
        raise
    except Exception as e:  # the student's code crashed: show where
        tb = traceback.format_exception_only(type(e), e)[-1].strip()
        raise CheckFailed(f"{name}: your code raised {tb}. Run it on the small example in the "
                          f"exercise's text and read the traceback above the check.") from e


def _fail(name: str, problem: str, hint: str):
    raise CheckFailed(f"{name}: {problem}\n  Hint: {hint}")


def _close(got, want, rtol=1e-4, atol=1e-6) -> bool:
    if isinstance(want, torch.Tensor) or isinstance(got, torch.Tensor):
        got_t, want_t = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
        return got_t.shape == want_t.shape and torch.allclose(got_t, want_t, rtol=rtol, atol=atol)
    return math.isclose(float(got), float(want), rel_tol=rtol, abs_tol=atol)


def _passed(name: str, detail: str = "") -> None:
    print(f"\u2714 {name}: correct{' (' + detail + ')' if detail else ''}")


