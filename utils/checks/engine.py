"""The exercise engine: every self-check in the labs is a short spec run by :func:`check`.

An :class:`Exercise` says

* what the student writes (``answer``: one function or class, or several, by name);
* its ``cases``: at least two, with different answers, so that no constant or near-miss passes;
* its ``oracle``: a reference with the student's signature (a closed form, PyTorch's own, a
  one-process run);
* how an answer is run on a case (``run``; by default ``answer(*case.args, **case.kwargs)``) and
  where: in the notebook's process, or on ``ranks`` spawned processes;
* its named ``mistakes``: known-wrong variants, each with a one-line problem and hint;
* what the exercise forbids (``refuse``): the library's own version of what is being built.

When the answer's output differs from the oracle's on a case, the engine replays each mistake's
variant on that case and names the first whose output the answer matches (or whose ``when``
predicate holds); else it reports the plain difference. Outputs are compared with
``torch.testing.assert_close``. A mistake marked ``mechanism=True`` is looked for on every case,
right or wrong: it catches answers whose numbers are right for the wrong reason (a host sync every
step, an all-reduce waited for inside the hook).

Rank-run exercises send the student's source, once, to every rank (a function defined in a notebook
cannot be imported by a spawned process), with the notebook helpers and imports it uses. Each rank
builds its cases on its own device (NCCL takes GPU tensors only) and runs the oracle, the mistakes
and then the answer; the results come back here, where they are compared.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import inspect
import io
import json
import math
import re
import signal
import sys
import tempfile
import textwrap
import threading
import time
import tokenize
import traceback
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ._common import CheckFailed, message, student_frames_only

REGISTRY: dict[str, Exercise] = {}


@dataclasses.dataclass
class Case:
    """One input of an exercise. ``label`` names it in a failure message ("a 7-element tensor")."""

    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)
    label: str = ""


@dataclasses.dataclass
class Outcome:
    """What one run of the student's answer on one case gave, as a ``Mistake.when`` sees it."""

    case: Case | None
    got: Any = None
    want: Any = None
    error: str = ""  # the exception's last line, when the answer raised
    hung: bool = False  # the answer did not finish within the exercise's timeout
    source: str = ""  # the answer's source, comments and strings removed


@dataclasses.dataclass(frozen=True)
class Mistake:
    """A known-wrong answer and what to say about it.

    ``variant`` has the answer's signature and makes the mistake; the tests submit it and expect
    ``problem`` back. It is replayed on a failing case, unless ``replay=False`` (a variant whose
    output is no fingerprint) or a ``when(outcome) -> bool`` recognises the mistake instead (then
    the variant is never replayed, so it may hang); with ``mechanism=True`` ``when`` is tried on
    every case, right or wrong.
    """

    problem: str
    hint: str
    variant: Any = None
    when: Callable[[Outcome], bool] | None = None
    replay: bool = True
    mechanism: bool = False


def _default_run(answer, case: Case):
    return answer(*case.args, **case.kwargs)


@dataclasses.dataclass
class Exercise:
    name: str
    cases: Callable[..., list]  # () -> [Case] in the notebook; (ctx) -> [Case] on a rank
    oracle: Any
    hint: str  # what to do when no named mistake matches
    answer: tuple = ()  # the names of what the student passes; default (name,)
    mistakes: Sequence[Mistake] = ()
    run: Callable[[Any, Case], Any] = _default_run
    compare: Callable[[Any, Any], str | None] | None = None  # None: assert_close with rtol/atol
    rtol: float = 1e-4
    atol: float = 1e-6
    refuse: tuple = ()  # dotted names the answer may not use: "torch.distributed.all_reduce", "utils.bench"
    refuse_hint: str = "write it yourself from the pieces the exercise names"
    ranks: int = 0  # 0: in the notebook's process; N: on N spawned processes
    timeout_s: float = 60.0
    passed: str = ""  # what a pass means, in a few words; never the answer

    def __post_init__(self) -> None:
        self.answer = tuple(self.answer) or (self.name,)
        self.module: str = sys._getframe(2).f_globals.get("__name__", "")  # where the spec lives: a rank imports it
        if self.name in REGISTRY and REGISTRY[self.name].module != self.module:
            raise ValueError(f"two exercises are named {self.name!r}")
        REGISTRY[self.name] = self

    def checker(self, doc: str = "") -> Callable[..., Any]:
        """The ``check_*`` function a lab calls with the student's answer."""

        def check_fn(*answer):
            return check(self, *answer)

        check_fn.__name__ = check_fn.__qualname__ = f"check_{self.name}"
        check_fn.__doc__ = doc or f"Check {', '.join(self.answer)} (see the exercise above)."
        check_fn.__module__ = "utils.checks"
        return check_fn


def fail(name: str, problem: str, hint: str) -> None:
    raise CheckFailed(message(name, problem, hint)) from None


# ---------------------------------------------------------------------------------------- comparing


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _from_numpy(x):
    if type(x).__module__ != "numpy":
        return x
    return x.item() if getattr(x, "shape", None) == () else torch.as_tensor(x)


def _plain(x, like):
    """``x`` shaped like ``like``: numbers as Python numbers, arrays as CPU tensors, containers item by item."""
    x = _from_numpy(x)
    if _number(like):
        return x.item() if isinstance(x, torch.Tensor) and x.numel() == 1 else x
    if isinstance(like, torch.Tensor) and isinstance(x, torch.Tensor):
        return x.detach().to("cpu")
    if isinstance(like, (list, tuple)) and isinstance(x, (list, tuple)) and len(x) == len(like):
        return type(like)(_plain(a, b) for a, b in zip(x, like))
    if isinstance(like, dict) and isinstance(x, dict):
        return {k: _plain(v, like[k]) if k in like else v for k, v in x.items()}
    return x


def _kind(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return "None" if x is None else f"a {type(x).__name__}"


def _category(x) -> str:
    if _number(x):
        return "number"
    if isinstance(x, (list, tuple)):
        return "sequence"
    return type(x).__name__ if x is None or isinstance(x, (bool, torch.Tensor, dict, str)) else "other"


def difference(got: Any, want: Any, rtol: float = 1e-4, atol: float = 1e-6) -> str | None:
    """None when ``got`` equals ``want`` within the tolerances, else what differs, in words."""
    want = _from_numpy(want)
    got = _plain(got, want)
    if _number(want) and _number(got):
        close = math.isclose(float(got), float(want), rel_tol=rtol, abs_tol=atol)
        return None if close else f"returned {got:.6g} where {want:.6g} was expected"
    shapes = [tuple(t.shape) for t in (got, want) if isinstance(t, torch.Tensor)]
    if _category(got) != _category(want) or (len(shapes) == 2 and shapes[0] != shapes[1]):
        return f"returned {_kind(got)} where {_kind(want)} was expected"
    if isinstance(want, (str, bool)) or want is None:
        return None if got == want else f"returned {got!r} where {want!r} was expected"
    return _assert_close(got, want, rtol, atol)


def _assert_close(got, want, rtol: float, atol: float) -> str | None:
    try:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, check_dtype=False, check_device=False)
        return None
    except (TypeError, ValueError):
        return f"returned {_kind(got)} where {_kind(want)} was expected"
    except AssertionError as e:
        first = str(e).strip().splitlines()[0].rstrip(".!")
        first = first[0].lower() + first[1:]
        if isinstance(want, torch.Tensor) and want.numel() <= 12:
            return f"returned {got.tolist()} where {want.tolist()} was expected ({first})"
        at = re.search(r"failure occurred for item (\S+)", str(e))
        where = f" at {at.group(1).rstrip('.:')}" if at else ""
        return f"returned values that differ from the expected ones{where} ({first})"


# ---------------------------------------------------------------------------------------- refusing


def _resolve(dotted: str):
    """'a.b.c' -> (the module or object holding c, 'c', the object), importing what is needed."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        holder, name = None, None
        for p in parts[i:]:
            holder, name, obj = obj, p, getattr(obj, p)
        return holder, name, obj
    raise ImportError(dotted)


def _refused_objects(refuse) -> list:
    """[(holder, attribute, object)] for every name refused; a module stands for its public callables."""
    out = []
    for dotted in refuse:
        holder, name, obj = _resolve(dotted)
        if isinstance(obj, types.ModuleType):
            for attr, value in vars(obj).items():
                if not attr.startswith("_") and callable(value) and not isinstance(value, types.ModuleType):
                    if getattr(value, "__module__", "").startswith(obj.__name__):
                        out.append((obj, attr, value))
        else:
            out.append((holder, name, obj))
    return out


class _RefusedModule(types.ModuleType):
    def __init__(self, real: types.ModuleType, raise_: Callable[[str], None]):
        super().__init__(real.__name__)
        self._real, self._raise = real, raise_

    def __getattr__(self, attr):
        self._raise(f"{self._real.__name__}.{attr}")


def _methods(cls) -> list:
    """The functions defined in a class answer's body (their globals are the notebook's)."""
    return [v for v in vars(cls).values() if hasattr(v, "__code__")] if inspect.isclass(cls) else []


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _reach(answer: Sequence, scopes: Sequence[dict]) -> tuple[list, list]:
    """The namespaces and closure cells through which the answer's code finds its names."""
    fns = [f for a in answer for f in ([a] if hasattr(a, "__code__") else _methods(a))]
    cells = [c for fn in fns for c in (getattr(fn, "__closure__", None) or ())]
    return list({id(fn.__globals__): fn.__globals__ for fn in fns}.values()) + list(scopes), cells


def _patches(ex: Exercise, answer: Sequence, scopes: Sequence[dict]) -> list:
    """[(holder, attribute, replacement)]: each refused object in its module, and wherever the
    answer holds it (its globals, its closures, a class answer's methods' globals, ``scopes``)."""

    def raise_(what: str):
        problem = f"your code uses {what}, which this exercise asks you to write yourself"
        raise CheckFailed(message(ex.name, problem, ex.refuse_hint))

    def refuser(what):
        return lambda *a, **k: raise_(what)

    scopes, cells = _reach(answer, scopes)
    modules = [m for m in (_resolve(d)[2] for d in ex.refuse) if isinstance(m, types.ModuleType)]
    out = []
    for holder, attr, obj in _refused_objects(ex.refuse):
        what = f"{getattr(holder, '__name__', holder)}.{attr}"
        out.append((holder, attr, refuser(what)))
        out += [(scope, k, refuser(what)) for scope in scopes for k, v in scope.items() if v is obj]
        out += [(cell, "cell_contents", refuser(what)) for cell in cells if _cell_value(cell) is obj]
    for scope in scopes:
        out += [(scope, k, _RefusedModule(v, raise_)) for k, v in scope.items() if any(v is m for m in modules)]
    return out


def _get(holder, attr):
    return holder[attr] if isinstance(holder, dict) else getattr(holder, attr)


def _set(holder, attr, value) -> None:
    if isinstance(holder, dict):
        holder[attr] = value
    else:
        setattr(holder, attr, value)


@contextlib.contextmanager
def refusing(ex: Exercise, answer: Sequence, scopes: Sequence[dict] = ()) -> Iterator[None]:
    """While the answer runs, what ``ex.refuse`` names raises :class:`CheckFailed` wherever the
    answer can reach it; everything is put back afterwards."""
    saved = []
    try:
        for holder, attr, value in _patches(ex, answer, scopes) if ex.refuse else ():
            saved.append((holder, attr, _get(holder, attr)))
            _set(holder, attr, value)
        yield
    finally:
        for holder, attr, old in reversed(saved):
            _set(holder, attr, old)


# ---------------------------------------------------------------------------------------- the answer


def _strip(source: str) -> str:
    """The source with comments and strings blanked out: what the code does, not what it says."""
    lines = source.splitlines(keepends=True)
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return source
    for tok in reversed(tokens):
        if tok.type in (tokenize.COMMENT, tokenize.STRING) and tok.start[0] == tok.end[0]:
            row, (c0, c1) = tok.start[0] - 1, (tok.start[1], tok.end[1])
            lines[row] = lines[row][:c0] + " " * (c1 - c0) + lines[row][c1:]
        elif tok.type == tokenize.STRING:  # a string over several lines (a docstring)
            for row in range(tok.start[0] - 1, tok.end[0]):
                lines[row] = "\n"
    return "".join(lines)


def _code_names(code) -> set:
    names = set(code.co_names)
    for c in code.co_consts:
        if hasattr(c, "co_names"):
            names |= _code_names(c)
    return names


def _notebook_defined(obj) -> bool:
    return getattr(obj, "__module__", None) in ("__main__", "__mp_main__") and (
        hasattr(obj, "__code__") or inspect.isclass(obj)
    )


def _code_of(obj):
    if hasattr(obj, "__code__"):
        return [obj.__code__]
    return [v.__code__ for v in vars(obj).values() if hasattr(v, "__code__")]


@dataclasses.dataclass
class Shipment:
    """The student's answer as source, for a spawned rank: notebook helpers first, then the answer,
    and the imports it reads (name -> module, or (module, attribute))."""

    sources: list  # [(name, source)]
    imports: dict
    constants: dict
    answer: tuple

    def define(self) -> tuple[tuple, dict]:
        """In the rank: define everything again; return the answer and its scope."""
        import math as _math
        import os

        import torch.distributed as dist
        import torch.nn.functional as F
        from torch import nn

        scope = {"torch": torch, "dist": dist, "nn": nn, "F": F, "math": _math, "os": os, "__name__": "__main__"}
        for name, target in self.imports.items():
            try:
                if isinstance(target, str):
                    scope[name] = importlib.import_module(target)
                else:
                    scope[name] = getattr(importlib.import_module(target[0]), target[1])
            except (ImportError, AttributeError):
                pass
        scope.update(self.constants)
        for name, src in self.sources:
            exec(compile(src, f"<your {name}>", "exec"), scope)
        return tuple(scope[n] for n in self.answer), scope


def ship(name: str, answer: tuple) -> Shipment:
    """The answer's source and everything of the notebook it uses, or a CheckFailed saying why not."""
    seen, sources, imports, constants = set(), [], {}, {}

    def visit(obj):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        glb = getattr(obj, "__globals__", None) or vars(inspect.getmodule(obj) or types.ModuleType("x"))
        for n in sorted(set().union(*(_code_names(c) for c in _code_of(obj)))):
            if n not in glb:
                continue
            v = glb[n]
            if isinstance(v, types.ModuleType):
                imports[n] = v.__name__
            elif _notebook_defined(v):
                visit(v)
            elif isinstance(v, (int, float, str, bool, tuple)) and not n.startswith("_"):
                constants[n] = v
            elif getattr(v, "__module__", None) and hasattr(v, "__name__") and not _notebook_defined(v):
                imports[n] = (v.__module__, v.__name__)
        try:
            sources.append((obj.__name__, textwrap.dedent(inspect.getsource(obj))))
        except (OSError, TypeError):
            fail(
                name,
                f"the source of {getattr(obj, '__name__', obj)} could not be read",
                "define it with `def` (or `class`) in a notebook cell, run that cell, then this one",
            )

    for obj in answer:
        visit(obj)
    return Shipment(sources, imports, constants, tuple(a.__name__ for a in answer))


def _validate_answer(ex: Exercise, answer: tuple) -> None:
    if len(answer) != len(ex.answer):
        fail(
            ex.name,
            f"this check takes {len(ex.answer)} argument(s) ({', '.join(ex.answer)}), got {len(answer)}",
            f"pass {', '.join(ex.answer)} themselves, as the exercise's check cell does",
        )
    for want, got in zip(ex.answer, answer):
        if not callable(got):
            fail(
                ex.name,
                f"{want} should be a function or class, got {_kind(got)}",
                "pass the function itself, without calling it (no parentheses)",
            )
        mod = getattr(got, "__module__", "") or ""
        library = mod.split(".")[0] in ("utils", "torch") and not mod.startswith("utils.checks")
        if library or got is ex.oracle:
            fail(
                ex.name,
                f"{mod}.{getattr(got, '__qualname__', got)} is the library's own code, not yours",
                "write it yourself in the exercise cell and pass that",
            )


def _not_implemented(ex: Exercise) -> None:
    fail(
        ex.name,
        "it is not implemented yet",
        "replace the `raise NotImplementedError(...)` line in the exercise cell with your code, run that cell, "
        "then this one",
    )


def _raised(ex: Exercise, e: BaseException, where: str = "") -> None:
    if isinstance(e, CheckFailed):
        raise e.with_traceback(None) from None
    if isinstance(e, NotImplementedError):
        _not_implemented(ex)
    last = traceback.format_exception_only(type(e), e)[-1].strip()
    err = CheckFailed(
        message(
            ex.name,
            f"your code raised {last}{where}",
            "read the traceback of your code above (the last line in your cell is where it failed), fix it, "
            "then rerun both cells",
        )
    )
    raise err from e.with_traceback(student_frames_only(e.__traceback__))


class _Hung(BaseException):
    """Raised into the answer by the alarm: it ran past the exercise's timeout."""


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Interrupt the answer after ``seconds`` (main thread only: a notebook cell runs there)."""
    if threading.current_thread() is not threading.main_thread() or seconds <= 0:
        yield
        return

    def alarm(signum, frame):
        raise _Hung

    outer, _ = signal.getitimer(signal.ITIMER_REAL)  # another alarm (pytest-timeout's): kept, and restored
    start = time.monotonic()
    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, min(seconds, outer) if outer else seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - start), 0.01))


# ---------------------------------------------------------------------------------------- running


def _one(answer):
    return answer[0] if len(answer) == 1 else answer


def _run_all(ex: Exercise, answer, cases_fn, *, student: bool, scopes=()) -> list:
    """``ex.run`` over every case (on a rank); the student's run is refused the forbidden names."""
    outs = []
    for case in cases_fn():
        with refusing(ex, (answer,) if callable(answer) else answer, scopes) if student else contextlib.nullcontext():
            outs.append(ex.run(answer, case))
    return outs


def _replayed(ex: Exercise) -> list:
    return [m for m in ex.mistakes if m.replay and m.variant is not None and m.when is None]


def _rank_worker(module: str, name: str, shipment: Shipment) -> dict:
    """One rank of a rank-run exercise: the oracle, each replayed mistake, then the answer."""
    from utils import parallel

    importlib.import_module(module)
    ex = REGISTRY[name]
    parallel.exact_fp32()
    ctx = parallel.setup(timeout=ex.timeout_s)
    try:
        out = {"oracle": _run_all(ex, ex.oracle, lambda: ex.cases(ctx), student=False), "mistakes": []}
        out["labels"] = [c.label for c in ex.cases(ctx)]
        for m in _replayed(ex):
            try:
                out["mistakes"].append(_run_all(ex, m.variant, lambda: ex.cases(ctx), student=False))
            except Exception:
                out["mistakes"].append(None)
        answer, scope = shipment.define()
        out["student"] = _run_all(ex, _one(answer), lambda: ex.cases(ctx), student=True, scopes=[scope])
        return out
    finally:
        parallel.teardown()


STARTUP_S = 120.0  # allowance for spawning ranks and importing torch on a loaded machine


def _hung(ex: Exercise, source: str) -> None:
    _diagnose(ex, Outcome(None, hung=True, source=source), [])
    fail(
        ex.name,
        f"your code did not finish within {ex.timeout_s:.0f} s: a rank waited for a message that never came",
        "every rank must make the same calls in the same order, and every send needs a matching receive",
    )


def _on_ranks(ex: Exercise, answer: tuple, source: str):
    """Run on ``ex.ranks`` processes; per case (answer, oracle, each replayed mistake: lists over ranks; label)."""
    from utils import parallel

    shipment = ship(ex.name, answer)
    try:
        # A collective that waits longer than ex.timeout_s raises in its rank (the process group's
        # timeout); the launch's own limit adds the ranks' start-up, which a busy machine stretches.
        res = parallel.launch(
            _rank_worker, ex.ranks, ex.module, ex.name, shipment, timeout=2 * ex.timeout_s + STARTUP_S, stream=False
        )
    except parallel.LaunchTimeout:
        _hung(ex, source)
    except parallel.LaunchError as e:
        tb = e.remote_traceback or ""
        last = tb.strip().splitlines()[-1] if tb.strip() else str(e).split("\n")[0]
        if "CheckFailed: " in last:
            raise CheckFailed(last.split("CheckFailed: ", 1)[1]) from None
        if "NotImplementedError" in last:
            _not_implemented(ex)
        if "timed out" in last.lower() or "timeout" in last.lower():
            _hung(ex, source)
        _diagnose(ex, Outcome(None, error=last, source=source), [])
        rank = f"rank {e.rank}" if e.rank is not None else "a rank"
        if not tb:
            fail(
                ex.name,
                f"{rank} stopped without a Python exception ({str(e).splitlines()[0]})",
                "run your code's steps by hand on paper for each rank: a rank that waits forever, or writes "
                "past a tensor's end, stops like this",
            )
        err = CheckFailed(
            message(
                ex.name,
                f"your code raised on {rank}: {last}",
                "read that rank's traceback, printed below, fix the line it names, then rerun both cells",
            )
            + f"\n\nTraceback from {rank}:\n{tb}"
        )
        raise err from None
    per_case = []
    for i in range(len(res[0]["student"])):
        mistakes = [
            None if any(r["mistakes"][j] is None for r in res) else [r["mistakes"][j][i] for r in res]
            for j in range(len(res[0]["mistakes"]))
        ]
        label = res[0]["labels"][i] or f"case {i + 1} of {len(res[0]['student'])}"
        per_case.append(([r["student"][i] for r in res], [r["oracle"][i] for r in res], mistakes, label))
    return per_case


def _differs(ex: Exercise, got, want) -> str | None:
    if ex.compare is not None:
        return ex.compare(got, want)
    return difference(got, want, ex.rtol, ex.atol)


def _diagnose(ex: Exercise, o: Outcome, replays: list) -> None:
    """Name the first mistake that matches the outcome: by its ``when``, else by its replayed output."""
    replayed = _replayed(ex)
    for m in ex.mistakes:
        if m.when is not None:
            if _safe(m.when, o):
                fail(ex.name, m.problem, m.hint)
        elif m in replayed and replays and not (o.error or o.hung):
            other = replays[replayed.index(m)]
            if other is not None and _differs(ex, o.got, other) is None:
                fail(ex.name, m.problem, m.hint)


def _safe(pred, o: Outcome) -> bool:
    try:
        return bool(pred(o))
    except Exception:
        return False


def check(ex: Exercise, *answer) -> Any:
    """Run the exercise on the student's answer: print a tick, or raise CheckFailed naming the mistake."""
    _validate_answer(ex, answer)
    try:
        source = "\n".join(_strip(textwrap.dedent(inspect.getsource(a))) for a in answer)
    except (OSError, TypeError):
        source = ""
    if ex.ranks:
        judge_on_ranks(ex, _on_ranks(ex, answer, source), source)
    else:
        cases = ex.cases()
        for i, case in enumerate(cases):
            got = _student_run(ex, _one(answer), i, source)
            want = ex.run(ex.oracle, ex.cases()[i])
            label = case.label or f"case {i + 1} of {len(cases)}"
            _judge(ex, Outcome(case, got, want, source=source), None, label, i)
    print(f"\u2714 {ex.name}: correct" + (f" ({ex.passed})" if ex.passed else ""))
    return None


def rank_outcomes(ex: Exercise, *answer) -> list:
    """One launch of a rank-run exercise on ``answer``, unjudged: per case, the answer's output on
    each rank, the oracle's, each replayed mistake's (in ``_replayed`` order) and the case's label.
    What :func:`check` judges; a test can also judge each replayed mistake's outputs as if it had
    been submitted (:func:`judge_on_ranks`), from this one launch."""
    _validate_answer(ex, answer)
    return _on_ranks(ex, answer, "")


def judge_on_ranks(ex: Exercise, per_case: list, source: str = "") -> None:
    """Judge a rank-run exercise's outcomes (:func:`rank_outcomes`): raise CheckFailed as check does."""
    for got, want, reps, label in _consistent(ex, per_case):
        _judge(ex, Outcome(None, got, want, source=source), reps, label)


def _consistent(ex: Exercise, per_case: list) -> list:
    """Keep a replayed mistake only where the answer matches it on every case, when one does: two
    variants can agree with each other on one small case, but not on all of them."""
    n = len(per_case[0][2]) if per_case else 0
    same = [all(c[2][j] is not None and _differs(ex, c[0], c[2][j]) is None for c in per_case) for j in range(n)]
    if not any(same):
        return per_case
    return [
        (got, want, [r if same[j] else None for j, r in enumerate(reps)], label) for got, want, reps, label in per_case
    ]


def _student_run(ex: Exercise, answer, i: int, source: str):
    """The answer on case ``i`` (a fresh copy), bounded in time, refused the forbidden names."""
    case = ex.cases()[i]
    try:
        with refusing(ex, (answer,) if callable(answer) else answer), _deadline(ex.timeout_s):
            return ex.run(answer, case)
    except _Hung:
        _diagnose(ex, Outcome(case, hung=True, source=source), [])
        fail(
            ex.name,
            f"your code did not finish within {ex.timeout_s:.0f} s",
            "look for a loop that never ends (a new iterator made on every pass, a condition never met) and "
            "run your code by hand on a tiny input",
        )
    except Exception as e:  # the student's code crashed: a named mistake, else where it failed
        if not isinstance(e, (CheckFailed, NotImplementedError)):
            last = traceback.format_exception_only(type(e), e)[-1].strip()
            _diagnose(ex, Outcome(case, error=last, source=source), [])
        _raised(ex, e)


def _judge(ex: Exercise, o: Outcome, reps, label: str, i: int | None = None) -> None:
    """Fail on a mechanism mistake, or on a difference from the oracle (naming the mistake if one matches)."""
    for m in ex.mistakes:
        if m.mechanism and m.when is not None and _safe(m.when, o):
            fail(ex.name, m.problem, m.hint)
    diff = _differs(ex, o.got, o.want)
    if diff is None:
        return
    if reps is None:
        reps = [_replay(ex, m, i) for m in _replayed(ex)]
    _diagnose(ex, o, reps)
    fail(ex.name, f"on {label}, your code {diff}", ex.hint)


def _replay(ex: Exercise, m: Mistake, i: int):
    try:
        return ex.run(m.variant, ex.cases()[i])
    except Exception:
        return None


# ---------------------------------------------------------------------------------------- the solutions' answers

SOLUTIONS = Path(__file__).resolve().parents[2] / "solutions"
_SOLUTION_NAMESPACES: dict[str, dict] = {}


def solution_namespace(lab: str) -> dict:
    """The imports, literal constants, functions and classes of ``solutions/<lab>.ipynb``, defined
    from a file (so ``inspect.getsource`` works, as in a notebook) in a module named ``__main__``.
    Nothing else of the notebook runs: no training, no check calls. Read once per lab."""
    if lab in _SOLUTION_NAMESPACES:
        return _SOLUTION_NAMESPACES[lab]
    cells = json.loads((SOLUTIONS / f"{lab}.ipynb").read_text())["cells"]
    kept = []
    for cell in cells:
        src = "".join(cell["source"])
        if cell["cell_type"] != "code" or src.startswith("%%"):
            continue
        src = "\n".join(line for line in src.splitlines() if not line.lstrip().startswith(("%", "!")))
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        lines = src.splitlines()
        for node in tree.body:
            keep = isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef))
            if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
                try:
                    ast.literal_eval(node.value)
                    keep = True
                except ValueError:
                    pass
            if keep:
                start = node.decorator_list[0].lineno if getattr(node, "decorator_list", None) else node.lineno
                kept.append("\n".join(lines[start - 1 : node.end_lineno]))
    path = Path(tempfile.mkdtemp(prefix=f"{lab}-")) / f"{lab}_answers.py"
    path.write_text("\n\n".join(kept) + "\n")
    ns = {"__name__": "__main__"}
    exec(compile(path.read_text(), str(path), "exec"), ns)
    _SOLUTION_NAMESPACES[lab] = ns
    return ns


def solution_answer(ex: Exercise, lab: str | None = None) -> tuple:
    """What the solution notebook hands to ``ex``'s check: the objects named in ``ex.answer``, from
    ``solutions/<lab>.ipynb`` (default: the ``LAB`` of the module that holds the spec)."""
    ns = solution_namespace(lab or importlib.import_module(ex.module).LAB)
    return tuple(ns[name] for name in ex.answer)
