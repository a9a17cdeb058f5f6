"""What the labs' self-checks share: :class:`CheckFailed`, the one message form ("name: what is wrong. Try: what to
do."), tracebacks without the checks' own frames in Jupyter, ``check_prediction``, and :class:`HostReads`."""

from __future__ import annotations

import contextlib
import math
import types
from typing import NoReturn

import torch
from torch.overrides import TorchFunctionMode


class CheckFailed(AssertionError):
    """A self-check found a mistake; the message says what to fix."""


def student_frames_only(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback without the frames of utils.checks: the line that called the check is what a student needs."""
    kept = []
    while tb is not None:
        if not tb.tb_frame.f_globals.get("__name__", "").startswith(__name__.rsplit(".", 1)[0]):
            kept.append(tb)
        tb = tb.tb_next
    new = None
    for t in reversed(kept):
        new = types.TracebackType(new, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return new


def _show(shell, etype, value, tb, tb_offset=None):
    """In IPython, a CheckFailed shows the usual traceback minus the checks' own frames."""
    shell.showtraceback((etype, value, student_frames_only(tb)), tb_offset=tb_offset)


with contextlib.suppress(ImportError):
    from IPython import get_ipython

    if get_ipython() is not None and not get_ipython().custom_exceptions:
        get_ipython().set_custom_exc((CheckFailed,), _show)


def message(name: str, problem: str, hint: str) -> str:
    """The one form of every check's diagnosis: "name: what is wrong. Try: what to do." """
    return f"{name}: {problem.strip().rstrip('.')}. Try: {hint.strip().rstrip('.')}."


def fail(name: str, problem: str, hint: str) -> NoReturn:
    raise CheckFailed(message(name, problem, hint)) from None


def check_prediction(
    prediction: object, measured: float, what: str, *, unit: str = "", rel_tol: float = 0.25, if_off: str = ""
) -> float:
    """Compare a number the student wrote BEFORE measuring with the measurement. A missing prediction fails (the
    point is to commit to a number first); a wrong one prints how far off it was and, off by more than ``rel_tol``,
    ``if_off``: the likely slip. Returns measured / prediction."""
    name = f"prediction of {what}"
    if prediction is None:
        hint = "write your number in the cell above (replace None), run it, then run this cell"
        fail(name, "you have not written a prediction yet", hint)
    try:
        p = float(prediction)
    except (TypeError, ValueError):
        fail(name, f"your prediction {prediction!r} is not a number", "write a plain number, e.g. 4 or 0.25")
    if not math.isfinite(p) or p == 0:
        fail(name, f"your prediction {p} cannot be compared", "write a finite, non-zero number")
    ratio, u = float(measured) / p, f" {unit}" if unit else ""
    said = f"{name}: you predicted {p:.4g}{u}, measured {float(measured):.4g}{u}"
    if abs(ratio - 1) <= rel_tol:
        print(f"\u2714 {said} (within {rel_tol:.0%})")
    else:
        print(f"\u2717 {said}, {ratio:.3g} x your number." + (f" Likely: {if_off}" if if_off else ""))
    return ratio


class HostReads(TorchFunctionMode):
    """Counts the tensors read back to the host (each read waits for the device on a GPU), however made:
    ``.cpu().tolist()`` reads one, ``torch.tensor`` of a list of tensors reads each."""

    READS = {"item", "tolist", "numpy", "cpu", "__float__", "__int__", "__bool__", "__index__"}

    def __init__(self):
        super().__init__()
        self.n, self.read = 0, set()  # reads in all the blocks it ran; the tensors read in the current one

    def __enter__(self):
        self.read = set()
        return super().__enter__()

    def __exit__(self, *exc):
        self.n += len(self.read)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        to_cpu = func.__name__ == "to" and any(str(a) == "cpu" for a in (*args[1:], *(kwargs or {}).values()))
        if func.__name__ in self.READS or to_cpu:
            self.read.add(id(args[0]))  # .cpu() of a tensor on the CPU is the tensor itself: one read
        if func.__name__ in ("tensor", "as_tensor") and args and isinstance(args[0], (list, tuple)):
            self.read |= {id(t) for t in args[0] if isinstance(t, torch.Tensor)}
        return func(*args, **(kwargs or {}))
