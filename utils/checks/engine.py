"""The exercise engine: every self-check in the labs is a short spec run by :func:`check`.

An :class:`Exercise` declares what the student writes, two or more ``cases`` with different answers, an ``oracle``
with the student's signature, how an answer is ``run`` on a case and where (here, or on ``ranks`` spawned processes),
its named ``mistakes`` (known-wrong variants, each with a one-line problem and hint) and what it ``refuse``s (the
library's own version). When an output differs from the oracle's (``torch.testing.assert_close``), the mistakes'
variants are replayed on that case to name the one the answer made, or a mistake's ``when`` recognises it. A
rank-run answer's source travels to the ranks (a notebook's function cannot be imported there); each rank runs the
oracle, the replayed mistakes and the answer on cases built on its own device, and the outputs are compared here.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import importlib
import inspect
import io
import linecache
import math
import pickle
import pkgutil
import re
import signal
import sys
import textwrap
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..rank_failures import is_peer_error
from ._common import CheckFailed, fail, message, student_frames_only

REGISTRY: dict[str, Exercise] = {}
STARTUP_S = 120.0  # allowance for spawning ranks and importing torch on a loaded machine


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
    """A known-wrong answer: ``variant`` (the answer's signature) makes it, and the tests expect ``problem`` back.
    It is replayed on a failing case unless ``replay=False`` (its output is no fingerprint) or ``when(outcome)``
    recognises it (then it is never replayed, so it may hang); ``mechanism=True`` tries ``when`` on every case."""

    problem: str
    hint: str
    variant: Any = None
    when: Callable[[Outcome], bool] | None = None
    replay: bool = True
    mechanism: bool = False


def mistake(text: str, variant: Any = None, when: Callable[[Outcome], bool] | None = None, **kw: Any) -> Mistake:
    """A :class:`Mistake` from its one line, ``"problem. Try: hint"``."""
    problem, hint = text.split(". Try: ")
    return Mistake(problem, hint, variant, when, **kw)


@dataclasses.dataclass
class Exercise:
    name: str
    cases: Callable[..., list]  # () -> [Case] in the notebook; (ctx) -> [Case] on a rank
    oracle: Any
    hint: str  # what to do when no named mistake matches
    answer: tuple = ()  # the names of what the student passes; default (name,)
    mistakes: Sequence[Mistake] = ()
    run: Callable[[Any, Case], Any] = lambda answer, case: answer(*case.args, **case.kwargs)
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

    def checker(self, doc: str = "", world_sizes: tuple = ()) -> Callable[..., Any]:
        """The ``check_*`` function a lab calls with the student's answer. A rank-run exercise runs on each of
        ``world_sizes`` processes in turn, so that a world size written into the answer fails; the last run's
        tick is shown."""

        def check_fn(*answer):
            sizes, ranks = world_sizes or (self.ranks,), self.ranks
            try:
                for i, self.ranks in enumerate(sizes):
                    with contextlib.redirect_stdout(io.StringIO()) if i < len(sizes) - 1 else contextlib.nullcontext():
                        check(self, *answer)
            finally:
                self.ranks = ranks

        check_fn.__name__ = check_fn.__qualname__ = f"check_{self.name}"
        check_fn.__doc__ = doc or f"Check {', '.join(self.answer)} (see the exercise above)."
        check_fn.__module__ = "utils.checks"
        return check_fn

    def differs(self, got: Any, want: Any) -> str | None:
        return self.compare(got, want) if self.compare else difference(got, want, self.rtol, self.atol)


# ---------------------------------------------------------------------------------------- comparing


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _plain(x, like=None):
    """``x`` shaped like ``like``: numbers as Python numbers, arrays as CPU tensors, containers item by item."""
    if type(x).__module__ == "numpy":
        x = x.item() if getattr(x, "shape", None) == () else torch.as_tensor(x)
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
    want = _plain(want)
    got = _plain(got, want)
    kinds = f"returned {_kind(got)} where {_kind(want)} was expected"
    if _number(want) and _number(got):
        close = math.isclose(float(got), float(want), rel_tol=rtol, abs_tol=atol)
        digits = next(n for n in (6, 9, 12, 17) if f"{got:.{n}g}" != f"{want:.{n}g}" or n == 17)  # enough to differ
        return None if close else f"returned {got:.{digits}g} where {want:.{digits}g} was expected"
    shapes = {tuple(t.shape) for t in (got, want) if isinstance(t, torch.Tensor)}
    if _category(got) != _category(want) or len(shapes) == 2:
        return kinds
    if isinstance(want, dict) and got.keys() != want.keys():
        missing, extra = [k for k in want if k not in got], [k for k in got if k not in want]
        return f"returned a dict whose keys differ from the expected ones (missing: {missing}, unexpected: {extra})"
    nested = isinstance(want, (list, tuple)) and len(got) == len(want) and any(isinstance(w, dict) for w in want)
    if isinstance(want, dict) or nested:  # part by part, in the expected order: the first part that differs
        diffs = (
            (k, difference(got[k], want[k], rtol, atol)) for k in (want if isinstance(want, dict) else range(len(want)))
        )
        k, diff = next(((k, d) for k, d in diffs if d is not None), (None, None))
        rest = (diff or "").removeprefix("returned")  # a nested dict's own ", at [...]" joins the path
        return (
            None if diff is None else f"returned, at [{k!r}]" + (rest[5:] if rest.startswith(", at [") else f",{rest}")
        )
    if isinstance(want, (str, bool)) or want is None:
        return None if got == want else f"returned {got!r} where {want!r} was expected"
    try:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, check_dtype=False, check_device=False)
    except (TypeError, ValueError, RuntimeError):  # no comparison handles the pair (a bool against a number)
        return f"returned {got!r} where {want!r} was expected" if len(f"{got!r}{want!r}") < 160 else kinds
    except AssertionError as e:
        first = str(e).strip().splitlines()[0].rstrip(".!")
        first = first[0].lower() + first[1:]
        if isinstance(want, torch.Tensor) and want.numel() <= 12:
            return f"returned {got.tolist()} where {want.tolist()} was expected ({first})"
        at = re.search(r"failure occurred for item (.+)", str(e))  # e.g. ['input grad'][0]
        where = f" at {at.group(1).rstrip('.:')}" if at else ""
        return f"returned values that differ from the expected ones{where} ({first})"
    return None


# ---------------------------------------------------------------------------------------- refusing


class _Refused(types.ModuleType):
    """What the answer holds in place of a refused module or class: using it, or any attribute of it, refuses.
    In a package, in place of its refused submodule (``real``), only the code of namespaces in ``own`` is refused."""

    def __init__(self, name: str, raise_: Callable[[str], None], real=None, own=frozenset()):
        super().__init__(name)
        self.raise_, self.real, self.own = raise_, real, own

    def __getattr__(self, attr):
        if self.real is not None and id(sys._getframe(1).f_globals) not in self.own:
            return getattr(self.real, attr)
        self.raise_(f"{self.__name__}.{attr}")

    def __call__(self, *args, **kwargs):
        if self.real is not None and id(sys._getframe(1).f_globals) not in self.own:
            return self.real(*args, **kwargs)
        self.raise_(self.__name__)


def _functions(obj) -> list:
    """A function itself, or a class's methods (their globals are the notebook's); nothing of other callables."""
    if hasattr(obj, "__code__"):
        return [obj]
    methods = [getattr(v, "__func__", v) for v in vars(obj).values()] if inspect.isclass(obj) else []
    return [m for m in methods if hasattr(m, "__code__")]


def _patches(ex: Exercise, answer: Sequence, scopes: Sequence[dict]) -> list:
    """[(holder, attribute, replacement)] while the answer runs. What ``ex.refuse`` names (a module: the public
    callables it defines) raises in the module that holds it, in the one that defines it, and wherever the answer
    holds it: its globals, closures and default arguments, ``scopes``, a partial of it there; a class named there
    also refuses to make an instance of a subclass. A refused module's private callables (the library uses
    them) are refused only where the answer holds them, with the answer's own subclasses of them. The functions
    of a refused module's submodules, a refused function of the library's modules, the spec's own module's (its
    oracles, reached through their module) and an oracle that is a library function are guarded: a call from the
    answer's code raises, the library's own calls go through. Only the answer's own namespaces are patched."""

    def raise_(what: str, *args, **kwargs):
        problem = f"your code uses {what}, which this exercise asks you to write yourself"
        raise CheckFailed(message(ex.name, problem, ex.refuse_hint))

    fns = [f for a in answer for f in _functions(a)]
    homes = [vars(sys.modules[a.__module__]) for a in answer if inspect.isclass(a) and a.__module__ in sys.modules]
    scopes = list({id(s): s for s in [fn.__globals__ for fn in fns] + homes}.values()) + list(scopes)
    lib = lambda scope: str(scope.get("__name__", "")).split(".")[0] in ("utils", "torch")
    own = {id(s) for s in scopes if not lib(s)}  # the answer's namespaces
    scopes = [s for s in scopes if id(s) in own]
    mine = lambda v: inspect.isclass(v) and str(v.__module__).split(".")[0] not in ("utils", "torch")  # its classes
    cells = [c for fn in fns for c in (fn.__closure__ or ())]
    modules = [m for m in map(pkgutil.resolve_name, ex.refuse) if isinstance(m, types.ModuleType)]
    refused = []  # (holder, attribute, object, guarded)
    for dotted in ex.refuse:
        obj = pkgutil.resolve_name(dotted)
        if isinstance(obj, types.ModuleType):  # its private callables only where the answer holds them ("scope")
            defined = [
                (a, v)
                for a, v in vars(obj).items()
                if callable(v) and str(getattr(v, "__module__", "")).startswith(obj.__name__)
            ]
            refused += [(obj, a, v, "scope" if a.startswith("_") else False) for a, v in defined]
        else:
            holder, attr = pkgutil.resolve_name(dotted.rsplit(".", 1)[0]), dotted.rsplit(".", 1)[1]
            refused.append((holder, attr, obj, dotted.startswith("utils.") and inspect.ismodule(holder) or None))
    spec = sys.modules.get(ex.module)
    if spec is not None and own and not any(lib(fn.__globals__) for fn in fns):  # the oracles: no student's answer
        ours = [(a, v) for a, v in vars(spec).items() if (inspect.isfunction(v) or inspect.isclass(v))]
        ours = [(a, v) for a, v in ours if v.__module__ == ex.module]
        ours.sort(key=lambda av: av[0] == av[1].__name__)  # an alias's patch first, so that the name wins
        refused += [(spec, a, v, "spec" if inspect.isfunction(v) else "scope") for a, v in ours]
        # and an oracle that is the library's own function (utils.linear_regression.gd_step)
        oracles = ex.oracle if isinstance(ex.oracle, tuple) else (ex.oracle,)
        at = lambda o: sys.modules[o.__module__] if re.match(r"utils\.(?!checks\b)", o.__module__) else None
        refused += [(at(o), o.__name__, o, True) for o in oracles if inspect.isfunction(o) and at(o)]
    for holder, _, obj, guarded in list(refused):  # a re-exported function, where it is defined
        home = sys.modules.get(getattr(obj, "__module__", None) or "")
        name = getattr(obj, "__name__", "")
        if home not in (None, holder) and not isinstance(guarded, str) and vars(home).get(name) is obj:
            refused.append((home, name, obj, guarded is True or (guarded is False and inspect.isfunction(obj))))

    def guard(real, no):
        return lambda *a, **k: no() if id(sys._getframe(1).f_globals) in own else real(*a, **k)

    out = []
    for holder, attr, obj, guarded in refused:
        no = functools.partial(raise_, f"{getattr(holder, '__name__', holder)}.{attr}")
        if guarded == "spec":  # through its module, or where the answer holds it
            out += [(holder, attr, guard(obj, no))] + [
                (s, k, guard(obj, no)) for s in scopes for k, v in s.items() if v is obj
            ]
            continue
        if guarded == "scope":  # a private callable: the answer's own subclasses of it are refused with it
            held = lambda v, obj=obj: v is obj or (mine(v) and inspect.isclass(obj) and issubclass(v, obj))
            _ = no() if any(held(a) for a in answer) else None
            stand_in = _Refused(f"{holder.__name__}.{attr}", raise_) if inspect.isclass(obj) else no
            out += [(s, k, stand_in) for s in scopes for k, v in s.items() if held(v)]
            continue
        out += [(holder, attr, guard(obj, no) if guarded else no)] + [
            (s, k, no) for s in scopes for k, v in s.items() if v is obj
        ]
        out += [(c, "cell_contents", no) for c in cells if _try(getattr, c, "cell_contents") is obj]  # empty: None
        partial_of = lambda v, obj=obj: isinstance(v, functools.partial) and v.func is obj
        out += [(s, k, functools.partial(no)) for s in scopes for k, v in s.items() if partial_of(v)]
        out += [
            (c, "cell_contents", functools.partial(no)) for c in cells if partial_of(_try(getattr, c, "cell_contents"))
        ]
        out += [
            (f, "__defaults__", tuple(no if d is obj else d for d in f.__defaults__))
            for f in fns
            if any(d is obj for d in f.__defaults__ or ())
        ]
        out += [(f.__kwdefaults__, k, no) for f in fns for k, d in (f.__kwdefaults__ or {}).items() if d is obj]
        named = f"{getattr(holder, '__name__', '')}.{attr}" in ex.refuse
        if inspect.isclass(obj) and "__init__" in vars(obj) and named:
            out.append((obj, "__init__", lambda self, *a, _no=no, **k: _no()))
    if own and not any(lib(fn.__globals__) for fn in fns):  # the exercise's own oracle, reached through it
        name = f"the check's own oracle for {ex.name}"
        stand_in = lambda o: _Refused(name, raise_, o, own) if inspect.isclass(o) else guard(o, lambda: raise_(name))
        oracle = tuple(map(stand_in, ex.oracle)) if isinstance(ex.oracle, tuple) else stand_in(ex.oracle)
        out.append((ex, "oracle", oracle))
    mods = [(s, k, v) for s in scopes for k, v in s.items() if any(v is m for m in modules)]
    parents = [(sys.modules[m.__name__.rpartition(".")[0]], m) for m in modules if "." in m.__name__]
    parents = [(p, m) for p, m in parents if vars(p).get(m.__name__.rpartition(".")[2]) is m]
    out += [(p, m.__name__.rpartition(".")[2], _Refused(m.__name__, raise_, m, own)) for p, m in parents]
    return out + [(s, k, _Refused(v.__name__, raise_)) for s, k, v in mods]


def _swap(holder, attr, value):
    """Set ``holder``'s ``attr`` (a dict's key, or an attribute) to ``value``; return what it was (a class's own
    descriptor, so that a C++ method put back still binds its instance)."""
    if isinstance(holder, dict):
        old, holder[attr] = holder[attr], value
        return old
    old = inspect.getattr_static(holder, attr) if inspect.isclass(holder) else getattr(holder, attr)
    setattr(holder, attr, value)
    return old


@contextlib.contextmanager
def patched(patches: Sequence[tuple]) -> Iterator[None]:
    """Each ``(holder, attribute, value)`` of ``patches`` set while the block runs; everything put back after."""
    saved = []
    try:
        for holder, attr, value in patches:
            saved.append((holder, attr, _swap(holder, attr, value)))
        yield
    finally:
        for holder, attr, old in reversed(saved):
            _swap(holder, attr, old)


def refusing(ex: Exercise, answer: Sequence, scopes: Sequence[dict] = ()) -> contextlib.AbstractContextManager:
    """While the answer runs, what ``ex.refuse`` names raises :class:`CheckFailed` wherever the answer can reach
    it; everything is put back afterwards."""
    return patched(_patches(ex, answer, scopes))


# ---------------------------------------------------------------------------------------- the answer


def _strip(source: str) -> str:
    """The code without its comments and strings (as ``ast.unparse`` writes it): what it does, not what it says."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return source
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            node.value = ""
    return ast.unparse(tree)


def getsource(obj: Any) -> str:
    """``inspect.getsource``, which also finds a class defined in a notebook cell: before Python 3.13 ``inspect``
    looks for a class only in its module's file, so it is read from the cell of its methods, or (a class with
    none) from the last cell that defines a class of its name."""
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        cells = [f for f in linecache.cache if "ipykernel_" in f or f.startswith("<ipython-input")][::-1]
        at = [(fn.__code__.co_filename, fn.__code__.co_firstlineno) for fn in _functions(obj)] or [
            (f, 0) for f in cells
        ]
        for file, line in at if inspect.isclass(obj) else ():
            text = "".join(linecache.getlines(file))
            for node in ast.walk(_try(ast.parse, text) or ast.Module([], [])):
                if (
                    isinstance(node, ast.ClassDef)
                    and node.name == obj.__name__
                    and (not line or node.lineno <= line <= node.end_lineno)
                ):
                    start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
                    return "".join(text.splitlines(keepends=True)[start - 1 : node.end_lineno])
        raise


def _source(answer: Sequence) -> str:
    """The answer's code as ``Outcome.source`` holds it ("" when it cannot be read)."""
    try:
        return "\n".join(_strip(textwrap.dedent(getsource(a))) for a in answer)
    except (OSError, TypeError):
        return ""


def _code_names(code, kind: str = "co_names") -> set:
    return set(getattr(code, kind)).union(*(_code_names(c, kind) for c in code.co_consts if hasattr(c, "co_names")))


_HISTORY = re.compile(r"_+|_i+\d*|_\d+|_oh|_ih|_dh")  # IPython's own globals: outputs and inputs


def _travels(value) -> bool:
    """Whether a spawned rank can unpickle ``value``: nothing in it is the notebook's own."""
    try:
        return b"__main__" not in pickle.dumps(value)
    except Exception:  # noqa: BLE001 - whatever pickling raises, the value stays behind
        return False


def _notebook_defined(obj) -> bool:
    where = getattr(obj, "__module__", None) in ("__main__", "__mp_main__")
    return where and (hasattr(obj, "__code__") or inspect.isclass(obj))


@dataclasses.dataclass
class Shipment:
    """The student's answer as source, for a spawned rank: notebook helpers first, then the answer, and the
    imports it reads (name -> module, or (module, attribute)). ``answer`` holds names to define, or objects
    the ranks unpickle as they are (a ``functools.partial`` of a module's function: the checks' variants)."""

    sources: list  # [(name, source)]
    imports: dict
    constants: dict
    answer: tuple

    def define(self) -> tuple[tuple, dict]:
        """In the rank: define everything again; return the answer and its scope."""
        scope = {"torch": torch, "dist": torch.distributed, "nn": torch.nn, "F": torch.nn.functional, "math": math}
        scope["__name__"] = "__main__"
        for name, target in self.imports.items():
            with contextlib.suppress(ImportError, AttributeError):
                module = importlib.import_module(target if isinstance(target, str) else target[0])
                scope[name] = module if isinstance(target, str) else getattr(module, target[1])
        scope.update(self.constants)
        for name, src in self.sources:
            exec(compile(src, f"<your {name}>", "exec"), scope)
        return tuple(scope[a] if isinstance(a, str) else a for a in self.answer), scope


def ship(name: str, answer: tuple) -> Shipment:
    """The answer's source and everything of the notebook it uses, or a CheckFailed saying why not."""
    seen, sources, imports, constants = set(), [], {}, {}

    def visit(obj):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        fns = _functions(obj)  # a function's names, or a class's methods' (a notebook's namespace)
        for base in obj.__bases__ if inspect.isclass(obj) else ():  # a class of the notebook it subclasses, first
            _ = visit(base) if _notebook_defined(base) else None
        glb = fns[0].__globals__ if fns else vars(inspect.getmodule(obj) or types.ModuleType("x"))
        names = set().union(*(_code_names(f.__code__) for f in fns))
        local = set().union(*(_code_names(f.__code__, "co_varnames") for f in fns))
        # and the names its source reads outside the code: a class's bases and body, default arguments
        with contextlib.suppress(OSError, TypeError, SyntaxError):
            tree = ast.parse(textwrap.dedent(getsource(obj)))
            names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} - local
        for n, v in [(n, glb[n]) for n in sorted(names) if n in glb]:
            if isinstance(v, types.ModuleType):
                imports[n] = v.__name__
            elif _notebook_defined(v):
                visit(v)
            elif inspect.ismethod(v) and _notebook_defined(v.__self__):  # an alias, f = CopyToTP.apply
                visit(v.__self__)
                sources.append((n, f"{n} = {v.__self__.__name__}.{v.__name__}\n"))
            elif isinstance(v, (int, float, str, bool, tuple)) and not _HISTORY.fullmatch(n):
                constants[n] = v
            elif getattr(v, "__module__", None) and hasattr(v, "__name__"):
                imports[n] = (v.__module__, v.__name__)
            elif not _HISTORY.fullmatch(n) and _travels(v):  # a dict or list of plain values: a copy per rank
                constants[n] = v
        try:
            sources.append((obj.__name__, textwrap.dedent(getsource(obj))))
        except (OSError, TypeError):
            what = getattr(obj, "__name__", obj)
            hint = "define it with `def` (or `class`) in a notebook cell, run that cell, then this one"
            fail(name, f"the source of {what} could not be read", hint)

    # the checks' own variants (a spec module's function, a partial of a module's function) are pickled as they are
    own = lambda a: inspect.isfunction(a) and str(a.__module__).startswith("utils.checks.")
    mine = [
        a if own(a) or isinstance(a, functools.partial) and not _notebook_defined(a.func) else visit(a) or a.__name__
        for a in answer
    ]
    return Shipment(sources, imports, constants, tuple(mine))


def _validate_answer(ex: Exercise, answer: tuple) -> None:
    names = ", ".join(ex.answer)
    if len(answer) != len(ex.answer):
        problem = f"this check takes {len(ex.answer)} argument(s) ({names}), got {len(answer)}"
        fail(ex.name, problem, f"pass {names} themselves, as the exercise's check cell does")
    for want, got in zip(ex.answer, answer):
        if not callable(got):
            hint = "pass the function itself, without calling it (no parentheses)"
            fail(ex.name, f"{want} should be a function or class, got {_kind(got)}", hint)
        mod = getattr(got, "__module__", "") or ""
        if (mod.split(".")[0] in ("utils", "torch") and not mod.startswith("utils.checks")) or got is ex.oracle:
            problem = f"{mod}.{getattr(got, '__qualname__', got)} is the library's own code, not yours"
            fail(ex.name, problem, "write it yourself in the exercise cell and pass that")


def _not_implemented(ex: Exercise) -> None:
    hint = (
        "replace the `raise NotImplementedError(...)` line in the exercise cell with your code, run that cell, then "
        "this one"
    )
    fail(ex.name, "it is not implemented yet", hint)


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


def _one(answer: tuple):
    return answer[0] if len(answer) == 1 else answer


def _replayed(ex: Exercise) -> list:
    return [m for m in ex.mistakes if m.replay and m.variant is not None and m.when is None]


def _rank_worker(module: str, name: str, shipment: Shipment) -> dict:
    """One rank of a rank-run exercise: the oracle, each replayed mistake (None where it raised), then the answer."""
    from utils import parallel

    importlib.import_module(module)
    ex = REGISTRY[name]
    parallel.exact_fp32()
    ctx = parallel.setup(timeout=ex.timeout_s)

    def run_all(fn, answer=(), scope=None):  # an answer's run is refused the forbidden names
        cases = ex.cases(ctx)
        with refusing(ex, answer, [scope]) if answer else contextlib.nullcontext():
            return [ex.run(fn, case) for case in cases]

    try:
        out = {"oracle": run_all(ex.oracle), "labels": [c.label for c in ex.cases(ctx)]}
        out["mistakes"] = [_try(run_all, m.variant) for m in _replayed(ex)]
        answer, scope = shipment.define()
        return out | {"student": run_all(_one(answer), answer, scope)}
    finally:
        parallel.teardown()


def _hung(ex: Exercise, source: str, case: Case | None = None) -> None:
    """A mistake seen in the hang, else where to look: on ranks (no ``case``), a message that never came."""
    _diagnose(ex, Outcome(case, hung=True, source=source), [])
    late = f"your code did not finish within {ex.timeout_s:.0f} s"
    if case is None:
        hint = "every rank must make the same calls in the same order, and every send needs a matching receive"
        fail(ex.name, f"{late}: a rank waited for a message that never came", hint)
    hint = (
        "look for a loop that never ends (a new iterator made on every pass, a condition never met) and run your code "
        "by hand on a tiny input"
    )
    fail(ex.name, late, hint)


def _rank_failed(ex: Exercise, e, source: str) -> None:
    """Say why a launch failed: a CheckFailed or a placeholder on a rank, a hang, a named mistake, or the crash."""
    tb = e.remote_traceback or ""
    last = tb.strip().splitlines()[-1] if tb.strip() else str(e).split("\n")[0]
    if "CheckFailed: " in last:
        raise CheckFailed(last.split("CheckFailed: ", 1)[1]) from None
    if "NotImplementedError" in last:
        _not_implemented(ex)
    if "timeout" in last.lower() or "timed out" in last.lower():
        _hung(ex, source)
    _diagnose(ex, Outcome(None, error=last, source=source), [])
    rank = f"rank {e.rank}" if e.rank is not None else "a rank"
    if not tb:
        hint = (
            "run your code's steps by hand on paper for each rank: a rank that waits forever, a send and a receive "
            "that do not pair up, or a write past a tensor's end stops like this"
        )
        first = str(e).splitlines()[0].split(". ")[0]
        aborted = f"{rank} aborted in native code (signal 6), as gloo does when a send and its receive differ in size"
        fail(ex.name, aborted if "signal 6 " in first else first, hint)
    if is_peer_error(last):  # no rank's own error: one left, or called something else, while another waited
        problem = f"{rank} lost its connection to a rank that had left the collective, or was making another call"
        hint = (
            "every rank must make the same collective calls in the same order: look for a return, or a branch, that "
            "only some ranks take"
        )
        fail(ex.name, problem, hint)
    hint = "read that rank's traceback, printed below, fix the line it names, then rerun both cells"
    text = message(ex.name, f"your code raised on {rank}: {last}", hint) + f"\n\nTraceback from {rank}:\n{tb}"
    raise CheckFailed(text) from None


def _on_ranks(ex: Exercise, answer: tuple, source: str) -> list:
    """Run on ``ex.ranks`` processes; per case (answer, oracle, each replayed mistake: lists over ranks; label)."""
    from utils import parallel

    shipment = ship(ex.name, answer)
    try:
        # A collective that waits longer than ex.timeout_s raises in its rank (the process group's timeout); the
        # launch's own limit adds the ranks' start-up, which a busy machine stretches.
        limit = 2 * ex.timeout_s + STARTUP_S
        res = parallel.launch(_rank_worker, ex.ranks, ex.module, ex.name, shipment, timeout=limit, stream=False)
    except parallel.LaunchTimeout:
        _hung(ex, source)
    except parallel.LaunchError as e:
        _rank_failed(ex, e, source)
    n, col = len(res[0]["student"]), lambda key, i: [r[key][i] for r in res]
    reps = [col("mistakes", j) for j in range(len(res[0]["mistakes"]))]  # per mistake, over ranks: per case, or None
    case_reps = [[None if None in rep else [r[i] for r in rep] for rep in reps] for i in range(n)]
    return [
        (col("student", i), col("oracle", i), case_reps[i], res[0]["labels"][i] or f"case {i + 1} of {n}")
        for i in range(n)
    ]


def _try(fn, *args):
    """``fn(*args)``, or None where it raises (a mistake's variant; a ``when`` on an outcome it does not expect)."""
    try:
        return fn(*args)
    except Exception:
        return None


def _diagnose(ex: Exercise, o: Outcome, replays: list) -> None:
    """Name the first mistake that matches the outcome: by its ``when``, else by its replayed output."""
    replayed = _replayed(ex)
    for m in ex.mistakes:
        if m.when is not None and _try(m.when, o):
            fail(ex.name, m.problem, m.hint)
        if m.when is None and m in replayed and replays and not (o.error or o.hung):
            other = replays[replayed.index(m)]
            if other is not None and ex.differs(o.got, other) is None:
                fail(ex.name, m.problem, m.hint)


def check(ex: Exercise, *answer) -> Any:
    """Run the exercise on the student's answer: print a tick, or raise CheckFailed naming the mistake."""
    _validate_answer(ex, answer)
    source = _source(answer)
    if ex.ranks:
        try:  # what the answer is or holds of a refused name is refused here too, before its source travels
            _patches(ex, answer, ())
        except CheckFailed as e:
            raise e.with_traceback(None) from None
        judge_on_ranks(ex, _on_ranks(ex, answer, source), source)
    cases = [] if ex.ranks else ex.cases()
    for i, case in enumerate(cases):
        try:  # on a fresh copy of the case, bounded in time, refused the forbidden names
            with refusing(ex, answer), _deadline(ex.timeout_s):
                got = ex.run(_one(answer), ex.cases()[i])
        except _Hung:
            _hung(ex, source, case)
        except CheckFailed as e:  # a refusal
            raise e.with_traceback(None) from None
        except NotImplementedError:
            _not_implemented(ex)
        except Exception as e:  # the student's code crashed: a named mistake, else where it failed
            last = traceback.format_exception_only(type(e), e)[-1].strip()
            _diagnose(ex, Outcome(case, error=last, source=source), [])
            hint = (
                "read the traceback of your code above (the last line in your cell is where it failed), fix it, then "
                "rerun both cells"
            )
            err = CheckFailed(message(ex.name, f"your code raised {last}", hint))
            raise err from e.with_traceback(student_frames_only(e.__traceback__))
        want = ex.run(ex.oracle, ex.cases()[i])
        _judge(
            ex,
            Outcome(case, got, want, source=source),
            None,
            case.label or f"case {i + 1} of {len(cases)}",
            (i, answer),
        )
    print(f"\u2714 {ex.name}: correct" + (f" ({ex.passed})" if ex.passed else ""))


def rank_outcomes(ex: Exercise, *answer) -> list:
    """One launch of a rank-run exercise on ``answer``, unjudged: per case, the answer's output on each rank, the
    oracle's, each replayed mistake's (in ``_replayed`` order) and the case's label. What :func:`check` judges; a
    test can also judge each replayed mistake's outputs as if it had been submitted (:func:`judge_on_ranks`)."""
    _validate_answer(ex, answer)
    return _on_ranks(ex, answer, "")


def judge_on_ranks(ex: Exercise, per_case: list, source: str = "") -> None:
    """Judge a rank-run exercise's outcomes (:func:`rank_outcomes`): raise CheckFailed as check does. A replayed
    mistake is kept only where the answer matches it on every case, when one does: two variants can agree with
    each other on one small case, but not on all of them."""
    n = len(per_case[0][2]) if per_case else 0
    same = [all(c[2][j] is not None and ex.differs(c[0], c[2][j]) is None for c in per_case) for j in range(n)]
    for got, want, reps, label in per_case:
        reps = [r if same[j] else None for j, r in enumerate(reps)] if any(same) else reps
        _judge(ex, Outcome(None, got, want, source=source), reps, label)


def _judge(ex: Exercise, o: Outcome, reps, label: str, at: tuple = ()) -> None:
    """Fail on a mechanism mistake, or on a difference from the oracle (naming the mistake if one matches). In the
    notebook (``at``: the case's index and the answer), a replayed mistake that matches this case is kept only
    where the answer also matches it on every other case that both finish."""
    for m in ex.mistakes:
        if m.mechanism and m.when is not None and _try(m.when, o):
            fail(ex.name, m.problem, m.hint)
    diff = ex.differs(o.got, o.want)
    if diff is None:
        return
    if reps is None:
        (i, answer), others = at, {}
        reps = [_try(ex.run, m.variant, ex.cases()[i]) for m in _replayed(ex)]
        reps = [
            r if r is None or ex.differs(o.got, r) is not None or _everywhere(ex, answer, m, i, others) else None
            for m, r in zip(_replayed(ex), reps)
        ]
    _diagnose(ex, o, reps)
    fail(ex.name, f"on {label}, your code {diff}", ex.hint)


def _everywhere(ex: Exercise, answer: tuple, m: Mistake, i: int, others: dict) -> bool:
    """Whether the answer's output equals mistake ``m``'s on every case but ``i`` where both finish and ``m``'s
    equals itself (no NaN); the answer's outputs are kept in ``others``."""
    for j in range(len(ex.cases())):
        if j != i and j not in others:
            with contextlib.suppress(Exception, _Hung), refusing(ex, answer), _deadline(ex.timeout_s):
                others[j] = None
                others[j] = ex.run(_one(answer), ex.cases()[j])
        theirs = _try(ex.run, m.variant, ex.cases()[j]) if j != i and others[j] is not None else None
        if theirs is not None and ex.differs(theirs, theirs) is None and ex.differs(others[j], theirs) is not None:
            return False
    return True


def __getattr__(name: str):  # solution_answer, solution_namespace: utils.authoring's, imported when first asked for
    if name in ("solution_answer", "solution_namespace"):
        return getattr(importlib.import_module("utils.authoring"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
