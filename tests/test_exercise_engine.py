"""The exercise engine (utils/checks/engine.py), and every spec the labs declare on it.

The engine's own behaviour is tested on small specs defined here (rank-run ones on 2 real gloo
processes); then every registered exercise is held to the rules a spec must keep: two or more
cases whose answers differ, a variant for every named mistake that really is wrong, messages
that read as sentences, and, for rank-run exercises, the solution passing with every rank under
the fake NCCL device rule (tests/fake_gpu.py), as on a GPU server.
"""

import functools
import importlib
import inspect
import linecache
import re
import sys
import types

import exercise_harness as harness
import pytest
import torch
import torch.distributed as dist

from utils import checks, memory, parallel
from utils.checks import CheckFailed, engine

# ---------------------------------------------------------------------------- small specs for the engine's tests


def _mean_cases():
    return [engine.Case((torch.tensor([1.0, 2.0, 6.0]),), label="3 numbers"), engine.Case((torch.arange(8.0),))]


MEAN = engine.Exercise(
    name="engine_test_mean",
    cases=_mean_cases,
    oracle=lambda x: x.mean().item(),
    hint="add the numbers and divide by how many there are",
    mistakes=[
        engine.Mistake("it returns the sum", "divide by the count", variant=lambda x: x.sum().item()),
        engine.Mistake(
            "it makes a host sync per element",
            "work on the whole tensor at once",
            variant=lambda x: sum(v.item() for v in x) / len(x),
            when=lambda o: ".item" in o.source and "for" in o.source,
            mechanism=True,
        ),
    ],
    refuse=("utils.memory.parameter_bytes",),
    timeout_s=2,
)


def _sum_cases(ctx):
    return [
        engine.Case((torch.arange(4.0).to(ctx.device) + ctx.rank,), label="4 elements"),
        engine.Case((torch.ones(3).to(ctx.device) * (ctx.rank + 1),), label="3 elements"),
    ]


def _sum_oracle(t):
    dist.all_reduce(t)
    return t


def _sum_twice(t):
    dist.all_reduce(t)
    return t * 2


RANK_SUM = engine.Exercise(
    name="engine_test_rank_sum",
    cases=_sum_cases,
    oracle=_sum_oracle,
    hint="sum the tensor over all ranks",
    mistakes=[engine.Mistake("the sum is doubled", "add each rank's tensor once", variant=_sum_twice)],
    ranks=2,
    timeout_s=60,
)

RANK_SUM_BY_HAND = engine.Exercise(
    name="engine_test_rank_sum_by_hand",
    cases=_sum_cases,
    oracle=_sum_oracle,
    hint="exchange the tensors with send and receive",
    refuse=("torch.distributed.all_reduce",),
    refuse_hint="exchange the tensors with point-to-point sends and receives",
    ranks=2,
    timeout_s=60,
)


# ---------------------------------------------------------------------------- in the notebook's process


def test_a_right_answer_passes_and_the_success_line_names_no_target(capsys):
    def mean(x):
        return (x.sum() / x.numel()).item()

    engine.check(MEAN, mean)
    out = capsys.readouterr().out
    assert out.startswith("\u2714 engine_test_mean: correct") and "3.0" not in out


def test_a_replayed_mistake_is_named_and_a_constant_fails_on_the_second_case():
    with pytest.raises(CheckFailed, match="it returns the sum. Try: divide by the count."):
        engine.check(MEAN, lambda x: float(x.sum()))
    with pytest.raises(CheckFailed, match=r"on case 2 of 2, your code returned 3 where 3.5 was expected"):
        engine.check(MEAN, lambda x: 3.0)  # right on the first case only


def test_a_mistake_is_named_only_where_the_answer_makes_it_on_every_case():
    # the sum on the first case (9), the mean on the second: it matches "the sum" on one case only
    with pytest.raises(CheckFailed, match=r"on 3 numbers, your code returned 9 where 3 was expected. Try: add") as e:
        engine.check(MEAN, lambda x: float(x.sum()) if len(x) == 3 else x.mean().item())
    assert "it returns the sum" not in str(e.value)


@pytest.mark.skipif(sys.version_info >= (3, 13), reason="from Python 3.13 inspect finds a class's source itself")
def test_the_source_of_a_class_without_methods_is_read_from_its_notebook_cell():
    cell, name = "class Plain(int):\n    pass\n", "/tmp/ipykernel_0/0.py"  # a cell as ipykernel files it
    linecache.cache[name] = (len(cell), None, cell.splitlines(True), name)
    scope = {"__name__": "__main__"}
    exec(compile(cell, name, "exec"), scope)
    try:
        assert engine.getsource(scope["Plain"]) == cell
    finally:
        del linecache.cache[name]


def test_a_mechanism_mistake_fails_even_when_the_number_is_right():
    def mean(x):
        return sum(v.item() for v in x) / len(x)

    with pytest.raises(CheckFailed, match="host sync per element"):
        engine.check(MEAN, mean)


def test_a_comment_does_not_count_as_code():
    def mean(x):
        # for each v: v.item() would be slow
        return x.mean().item()

    engine.check(MEAN, mean)


def test_a_refused_function_raises_wherever_the_answer_reaches_it():
    from utils.memory import parameter_bytes  # as a notebook's `from ... import` binds it

    def by_module(x):
        memory.parameter_bytes(torch.nn.Linear(1, 1))
        return x.mean().item()

    def by_name(x):
        parameter_bytes(torch.nn.Linear(1, 1))
        return x.mean().item()

    for answer in (by_module, by_name):
        with pytest.raises(CheckFailed, match="uses utils.memory.parameter_bytes, which this exercise asks"):
            engine.check(MEAN, answer)
    assert memory.parameter_bytes(torch.nn.Linear(1, 1)) == 8, "restored after the check"


def test_a_refused_function_raises_inside_a_class_answers_static_methods():
    """A class answer's static methods (``__new__`` here; an autograd Function's forward and backward) are
    the answer's code too: the refused function is replaced in what they reach."""
    from utils.memory import parameter_bytes

    class Mean:
        def __new__(cls, x):  # an implicit static method
            parameter_bytes(torch.nn.Linear(1, 1))
            return x.mean().item()

    with pytest.raises(CheckFailed, match="uses utils.memory.parameter_bytes, which this exercise asks"):
        engine.check(MEAN, Mean)


class _NoSuchSize:  # like a profile: an unknown attribute raises KeyError, not AttributeError
    def __getattr__(self, name):
        raise KeyError(name)


PROFILE_LIKE = _NoSuchSize()  # in the answers' globals, which a refusal searches


def test_a_refused_function_raises_through_a_partial_a_default_and_the_module_that_defines_it():
    from utils.memory import parameter_bytes

    via_partial = functools.partial(parameter_bytes)

    def by_partial(x):
        via_partial(torch.nn.Linear(1, 1))
        return x.mean().item()

    def by_default(x, count=parameter_bytes):
        count(torch.nn.Linear(1, 1))
        return x.mean().item()

    def by_keyword_default(x, *, count=parameter_bytes):
        count(torch.nn.Linear(1, 1))
        return x.mean().item()

    for answer in (by_partial, by_default, by_keyword_default):
        with pytest.raises(CheckFailed, match="uses utils.memory.parameter_bytes, which this exercise asks"):
            engine.check(MEAN, answer)
    assert by_default.__defaults__ == (parameter_bytes,) and via_partial.func is parameter_bytes, "restored"
    # a function refused where it is re-exported is refused where it is defined too
    ex = engine.Exercise("engine_test_reexport", _mean_cases, MEAN.oracle, "add and divide", refuse=("torch.distributed.all_reduce",))  # fmt: skip

    def by_home(x):
        importlib.import_module("torch.distributed.distributed_c10d").all_reduce(x)
        return x.mean().item()

    with pytest.raises(CheckFailed, match="uses torch.distributed.distributed_c10d.all_reduce"):
        engine.check(ex, by_home)


def test_a_refused_class_refuses_a_subclass_and_a_right_answer_passes_beside_a_hostile_global():
    from utils.schedules import WarmupDecay

    ex = engine.Exercise("engine_test_class", _mean_cases, MEAN.oracle, "add and divide", refuse=("utils.schedules.WarmupDecay",))  # fmt: skip

    class Mine(WarmupDecay):
        pass

    def by_subclass(x):
        Mine(0.1, 1.0, 2, 10)
        return x.mean().item()

    with pytest.raises(CheckFailed, match="uses utils.schedules.WarmupDecay"):
        engine.check(ex, by_subclass)
    assert Mine(0.1, 1.0, 2, 10).lr(1) == pytest.approx(0.55), "restored after the check"
    engine.check(ex, lambda x: x.mean().item() + 0 * len(dir(PROFILE_LIKE)))


def test_a_refused_modules_private_class_is_refused_to_the_answer_and_its_subclass_not_to_the_library():
    ex = engine.Exercise("engine_test_private", _mean_cases, MEAN.oracle, "add and divide", refuse=("utils.parallel.tensor_parallel",))  # fmt: skip
    ns = {"__name__": "__main__"}
    cell = "from utils.parallel.tensor_parallel import _CopyToTP\nclass Mine(_CopyToTP):\n    pass\n"
    exec(cell + "def answer(x):\n    return Mine.apply(x).mean().item()\n", ns)
    with pytest.raises(CheckFailed, match="uses utils.parallel.tensor_parallel._CopyToTP.apply, which this exercise"):
        engine.check(ex, ns["answer"])
    with pytest.raises(CheckFailed, match="uses utils.parallel.tensor_parallel._CopyToTP, which this exercise"):
        engine.check(ex, ns["Mine"])
    assert ns["Mine"].__mro__[1].__name__ == "_CopyToTP", "restored after the check"
    # the module keeps its private class while the answer runs, for its own functions to use
    module = importlib.import_module("utils.parallel.tensor_parallel")
    engine.check(ex, lambda x: x.mean().item() + 0 * len(module._CopyToTP.__name__))


def test_the_library_itself_and_the_oracle_are_refused():
    with pytest.raises(CheckFailed, match="the library's own code"):
        engine.check(MEAN, torch.mean)
    with pytest.raises(CheckFailed, match="the library's own code, not yours"):
        engine.check(MEAN, MEAN.oracle)


def test_an_oracle_that_is_a_library_function_is_refused_to_the_answer_and_put_back_after():
    from utils import linear_regression as lr

    points = [
        (torch.tensor([1.0, 2.0]), torch.tensor([3.0, 5.0]), 0.0, 0.0, 0.1),
        (torch.ones(3), torch.ones(3), 1.0, 0.5, 0.2),
    ]
    ex = engine.Exercise(name="engine_test_library_oracle", cases=lambda: [engine.Case(a) for a in points],
                         oracle=lr.gd_step, hint="move against the gradient")  # fmt: skip
    step = lr.gd_step
    for answer in (lambda *a: step(*a), lambda *a: lr.gd_step(*a)):  # held by name, reached through its module
        with pytest.raises(
            CheckFailed, match="uses utils.linear_regression.gd_step, which this exercise asks you to write"
        ):
            engine.check(ex, answer)
    engine.check(ex, lambda x, y, w, b, r: tuple(v - r * d for v, d in zip((w, b), lr.mse_grad(x, y, w, b))))
    assert lr.gd_step is step and lr.gd(*points[0][:4], 0.1, 2).shape == (3, 2)  # the library works as before


def test_a_refused_module_reached_through_its_package_and_a_specs_function_held_by_name_are_refused():
    from utils.checks import model_parallel, transformer

    ex = engine.Exercise("engine_test_dotted", _mean_cases, MEAN.oracle, "add and divide", refuse=("utils.parallel.tensor_parallel",))  # fmt: skip
    ns, lib = {"__name__": "__main__"}, {"__name__": "utils.a_library_module"}
    dotted = "import utils.parallel\ndef {}(x):\n    return utils.parallel.tensor_parallel._CopyToTP.apply(x).mean().item()\n"
    exec(dotted.format("answer"), ns)
    exec(dotted.format("library_mean"), lib)
    with pytest.raises(CheckFailed, match="uses utils.parallel.tensor_parallel._CopyToTP, which this exercise"):
        engine.check(ex, ns["answer"])
    engine.check(ex, lambda x: lib["library_mean"](x))  # the library's own code reaches it through the package
    assert type(vars(ns["utils"].parallel)["tensor_parallel"]) is types.ModuleType, "put back after the check"
    exec("from utils.checks.model_parallel import _col, _row\ncol, row = (lambda *a: _col(*a)), (lambda *a: _row(*a))\n", ns)  # fmt: skip
    with pytest.raises(CheckFailed, match="uses utils.checks.model_parallel._col, which this exercise asks you"):
        engine.check(model_parallel.TENSOR_PARALLEL, ns["col"], ns["row"])
    assert ns["_col"] is vars(model_parallel)["_col"], "put back after the check"
    exec(
        "from utils.checks.transformer import COPY, REDUCE\nclass F(COPY):\n    pass\nclass G(REDUCE):\n    pass\n", ns
    )
    with pytest.raises(CheckFailed, match="uses utils.checks.transformer.COPY, which"):  # before any rank starts
        engine.check(transformer.TP_OPERATORS, ns["F"], ns["G"])


def test_the_exercises_own_oracle_reached_through_the_registry_is_refused_and_put_back():
    from utils.checks import gd_sgd

    oracle = gd_sgd.GD_STEP.oracle
    with pytest.raises(CheckFailed, match="uses the check's own oracle for gd_step, which this exercise asks you"):
        engine.check(gd_sgd.GD_STEP, lambda *a: engine.REGISTRY["gd_step"].oracle(*a))
    assert gd_sgd.GD_STEP.oracle is oracle


def test_a_refused_cpp_method_is_put_back_as_the_descriptor_it_was():
    """ProcessGroup.allreduce (pybind) put back as what getattr returns would no longer bind its group."""
    from utils.checks import ddp

    before = inspect.getattr_static(dist.ProcessGroup, "allreduce")
    with engine.refusing(ddp.RING_ALL_REDUCE, (lambda tensor: tensor,)):
        assert inspect.getattr_static(dist.ProcessGroup, "allreduce") is not before
    assert inspect.getattr_static(dist.ProcessGroup, "allreduce") is before


def test_a_hang_is_reported_within_the_timeout():
    def mean(x):
        while True:
            pass

    with pytest.raises(CheckFailed, match="did not finish within 2 s"):
        engine.check(MEAN, mean)


def test_a_crash_names_the_error_and_a_placeholder_says_not_implemented():
    with pytest.raises(CheckFailed, match="your code raised ZeroDivisionError"):
        engine.check(MEAN, lambda x: 1 / 0)
    with pytest.raises(CheckFailed, match="it is not implemented yet"):
        engine.check(MEAN, lambda x: (_ for _ in ()).throw(NotImplementedError()))
    with pytest.raises(CheckFailed, match="should be a function or class"):
        engine.check(MEAN, 2.0)


@pytest.mark.parametrize(
    "got,want,words",
    [
        (torch.zeros(3), torch.zeros(4), "a tensor of shape (3,) where a tensor of shape (4,)"),
        (None, 1.0, "returned None where a float"),
        (torch.tensor(2.0), 2.0, None),
        (2, 2.0, None),
        ([torch.ones(2), 1.0], [torch.ones(2), 1.0], None),
        ({"a": torch.ones(2)}, {"a": torch.zeros(2)}, "returned"),
        ({"input grad": torch.ones(20)}, {"input grad": torch.zeros(20)}, "at ['input grad']"),
        # the first part that differs in the expected order, not in sorted order (assert_close sorts keys)
        ({"y": torch.ones(20), "a": torch.ones(20)}, {"y": torch.zeros(20), "a": torch.zeros(20)}, "at ['y'], values"),
        ([{"y": 1.0, "g": {"b": 2.0}}], [{"y": 1.0, "g": {"b": 3.0}}], "returned, at [0]['g']['b'], 2 where 3 was"),
        ({"params": 1, "optimizer": 2}, {"params": 1, "grads": 2}, "(missing: ['grads'], unexpected: ['optimizer'])"),
        ([True, False], [0.5, 1.0], "returned [True, False] where [0.5, 1.0] was expected"),
    ],
)
def test_difference_against_assert_close(got, want, words):
    d = engine.difference(got, want)
    assert (d is None) if words is None else (words in d or words.lower() in d.lower()), d


# ---------------------------------------------------------------------------- on ranks


def test_two_numbers_that_differ_are_printed_with_digits_enough_to_differ():
    assert engine.difference(5500015.0, 5500016.5, rtol=1e-9, atol=0) == "returned 5500015 where 5500016.5 was expected"


@pytest.mark.slow
def test_a_rank_run_exercise_passes_names_a_mistake_and_names_a_crashing_rank(capsys):
    def total(t):
        dist.all_reduce(t)
        return t

    def doubled(t):
        dist.all_reduce(t)
        return t + t

    def crashes(t):
        if dist.get_rank() == 1:
            raise ValueError("boom on rank 1")
        dist.all_reduce(t)
        return t

    engine.check(RANK_SUM, total)
    assert "correct" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match="the sum is doubled"):
        engine.check(RANK_SUM, doubled)
    with pytest.raises(CheckFailed, match="raised on rank 1: ValueError: boom on rank 1"):
        engine.check(RANK_SUM, crashes)


def test_a_rank_that_lost_its_peer_or_aborted_is_told_what_that_means():
    tb = (
        "Traceback (most recent call last):\nRuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer\n"
    )
    lost = parallel.LaunchError("rank 0 raised RuntimeError", rank=0, remote_traceback=tb)
    with pytest.raises(CheckFailed, match="rank 0 lost its connection to a rank that had left the collective") as e:
        engine._rank_failed(RANK_SUM, lost, "")
    assert "the same collective calls in the same order" in str(e.value)
    killed = (
        "rank 1 was killed by signal 6 without a Python exception (killed, out of memory, or a crash in native code)"
    )
    with pytest.raises(CheckFailed, match=r"rank 1 aborted in native code \(signal 6\), as gloo does when a send"):
        engine._rank_failed(RANK_SUM, parallel.LaunchError(killed + ". The other ranks were stopped.", rank=1), "")


@pytest.mark.slow
def test_a_refusal_holds_on_the_ranks():
    def sneaky(t):
        dist.all_reduce(t)
        return t

    with pytest.raises(CheckFailed, match="uses torch.distributed.all_reduce, which this exercise asks"):
        engine.check(RANK_SUM_BY_HAND, sneaky)


# ---------------------------------------------------------------------------- every spec of every lab


def _lab_exercises():
    engine_test = {MEAN.name, RANK_SUM.name, RANK_SUM_BY_HAND.name}
    importlib.import_module("utils.checks")
    return [ex for name, ex in sorted(engine.REGISTRY.items()) if name not in engine_test]


EXERCISES = _lab_exercises()


def _lab_of(ex) -> str:
    return importlib.import_module(ex.module).LAB


def _is_sentence(text: str) -> list:
    """What keeps ``text`` from reading as one sentence, or []."""
    problems = []
    words = re.findall(r"[A-Za-z']+", text)
    doubled = [a for a, b in zip(words, words[1:]) if a.lower() == b.lower() and a.lower() not in ("that", "had")]
    if doubled:
        problems.append(f"doubled word {doubled[0]!r}")
    for a, b in ("()", "[]", "{}"):
        if text.count(a) != text.count(b):
            problems.append(f"unbalanced {a}{b}")
    if text.count("`") % 2:
        problems.append("unbalanced backtick")
    if len(text) < 12 or not re.search(r"[a-z]{3}", text):
        problems.append("too short to say anything")
    if re.search(r"\{\w*\}", text):
        problems.append("an unformatted placeholder")
    return problems


def test_the_labs_declare_their_exercises():
    assert {"accuracy"} <= {ex.name for ex in EXERCISES}


@pytest.mark.parametrize("ex", EXERCISES, ids=[ex.name for ex in EXERCISES])
def test_every_spec_keeps_the_rules(ex):
    assert ex.hint and not _is_sentence(ex.hint), _is_sentence(ex.hint)
    for m in ex.mistakes:
        assert m.variant is not None, f"{m.problem!r} has no variant for the tests to submit"
        text = engine.message(ex.name, m.problem, m.hint)
        assert text.count(" Try: ") == 1 and text.endswith("."), text
        assert not _is_sentence(m.problem) and not _is_sentence(m.hint), (text, _is_sentence(text))
    if ex.ranks:
        return
    cases = ex.cases()
    assert len(cases) >= 2, "at least two cases, so that no guess passes"
    answers = [ex.run(ex.oracle, c) for c in cases]
    assert any(engine.difference(a, answers[0]) for a in answers[1:]), "the cases must have different answers"
    for m in ex.mistakes:
        if m.replay and m.when is None:
            outs = []
            for i in range(len(cases)):
                try:
                    outs.append(ex.run(m.variant, ex.cases()[i]))
                except Exception:
                    outs.append(None)
            assert any(
                o is None or ex.compare and ex.compare(o, a) or engine.difference(o, a, ex.rtol, ex.atol)
                for o, a in zip(outs, answers)
            ), f"{m.problem!r}: its variant gives the oracle's answers"


# ---------------------------------------------------------------------------- rank-run exercises under NCCL's device rule


def fake_nccl_rank_worker(*args):
    """A rank that sees 3 GPUs, one per rank, and a NCCL (on gloo) that refuses CPU tensors."""
    from fake_gpu import install_in_rank, install_nccl_device_rule

    install_in_rank(3, ["gpu-a", "gpu-b", "gpu-c"])
    install_nccl_device_rule(setattr)
    return _real_rank_worker(*args)


_real_rank_worker = engine._rank_worker
# The fake GPU cannot run scaled_dot_product_attention's CPU decomposition: it makes its causal mask as a plain
# CPU tensor beside the fake-GPU ones. On a real GPU, make gpu-check runs these exercises on their solutions.
_SDPA = "SDPA's CPU decomposition mixes a CPU mask with fake-GPU tensors"
_FAKE_CANNOT = {"tp_block": _SDPA, "sp_block": _SDPA}
RANKED = [
    pytest.param(ex, marks=pytest.mark.xfail(strict=True, reason=_FAKE_CANNOT[ex.name]))
    if ex.name in _FAKE_CANNOT
    else ex
    for ex in EXERCISES
    if ex.ranks
]


@pytest.mark.slow
@pytest.mark.parametrize("ex", RANKED, ids=[ex.name for ex in EXERCISES if ex.ranks])
def test_rank_run_exercises_pass_their_solution_under_nccl(ex, monkeypatch, capsys):
    from fake_gpu import FakeCuda

    FakeCuda(3).install(monkeypatch.setattr, nccl_on_gloo=True)  # the notebook sees 3 GPUs: launch picks NCCL
    monkeypatch.setattr(engine, "_rank_worker", fake_nccl_rank_worker)
    check = getattr(checks, f"check_{ex.name}", None) or functools.partial(engine.check, ex)  # what the lab calls
    check(*harness.answer(_lab_of(ex), ex))
    assert "correct" in capsys.readouterr().out


def test_the_checks_package_exports_a_check_per_exercise():
    for ex in EXERCISES:
        assert callable(getattr(checks, f"check_{ex.name}", None)) or ex.name in _CHECKED_TOGETHER, ex.name


_CHECKED_TOGETHER = set()  # exercises whose check function takes another name (none yet)
