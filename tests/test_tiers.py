"""The test tiers: each test file sets its own marks, and a test that starts processes leaves `make check`.

`make check` runs the tests that carry none of the tier marks (`slow`, `sandbox`, `slurm`, `extended`). A
test that starts processes (ranks through `parallel.launch` or torchrun, a Python interpreter, a sandbox)
costs seconds each time, so it carries one of those marks, or it is named in FAST_TIER_PROCESSES with why
the fast loop keeps it. The oracle for "starts processes" is the source itself, read without running it:
a call to `subprocess`, to `multiprocessing`'s `Process` or `spawn`, or `os.fork`, made by the test, by a
fixture or helper of its file, or by any function of `utils`, `benchmarks` or `cluster` it calls or hands
on, followed through imports and re-exports to the function that makes it. Processes started inside torch
(DataLoader workers) are not seen, and a call that a test replaces with a fake is still counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIERS = {"slow", "sandbox", "slurm", "extended"}

# Tests that start processes (or that the scan cannot tell from ones that do) and still run in `make check`,
# each with what starts and why it stays. CPU seconds were measured with the children's time included.
IN_PROCESS = "an in-process exercise spec: engine.check starts no process for it"
FAST_TIER_PROCESSES = {
    "test_authoring.py::test_a_release_holds_no_answer": "one `git ls-files`",
    "test_authoring.py::test_generate_then_check_then_detect_drift": "authoring.main starts git only for --release, "
    "which this test does not pass",
    "test_oracle_ddp.py::test_ddp_step_equals_one_process_on_the_union": "2 ranks (4 is slow): the one "
    "DDP-equals-one-process run `make check` keeps, about 13 s of CPU",
    "test_packaging.py::test_labs_are_up_to_date_with_solutions": "one `python -m utils.authoring --check`: "
    "a stale labs/ fails here first",
    "test_readme.py::test_each_command_works_from_a_fresh_shell": "the README's untagged lines, each one "
    "interpreter (make labs, make check-labs, a profile summary, --help); a slow line is tagged and not run",
    "test_gpucheck.py::test_an_interpreter_without_torch_gets_a_message_not_a_traceback": "one `python -c`",
    "test_hub.py::test_the_course_is_copied_as_the_student_whatever_they_put_in_their_home": "root only: a "
    "`python -c` probe or two and two short copies as another account (well under a second)",
    "test_gpucheck.py::test_offline_children_fail_a_download_at_once": "one `python -c` that fails at once",
    "test_gpucheck.py::test_the_makefile_passes_gpu_check_args": "`make -n`: prints the command, runs nothing",
    "test_gpucheck.py::test_every_required_check_is_listed": "lists the checks, runs none",
    "test_gpucheck.py::test_make_gpu_check_with_a_tiny_budget_verifies_nothing_and_exits_3": "a 5 s budget, "
    "twice: every check is not verified before it starts",
    "test_gpucheck.py::test_the_budget_stops_a_long_check_and_the_rest_are_not_verified": "two `python -c` "
    "sleeps, stopped by an 8 s budget: the budget's own test",
    "test_gpucheck.py::test_the_grader_check_skips_without_cifar10_and_fails_unless_passed": "gpucheck._run is "
    "replaced by a fake: nothing starts",
    "test_gpucheck.py::test_the_riskiest_paths_come_first": "lists the checks, runs none",
    "test_gpucheck.py::test_the_plan_cuts_the_ordered_list_and_uses_each_profiles_estimates": "lists the checks "
    "and cuts them into parts, runs none",
    "test_gpucheck.py::test_parts_merge_into_one_report_and_the_exit_status_says_what_is_not_verified": "all_checks "
    "is replaced by in-process fakes: nothing starts",
    "test_gpucheck.py::test_a_part_stopped_by_its_budget_or_killed_is_not_verified_in_the_merge": "all_checks is "
    "replaced by in-process fakes: nothing starts",
    "test_gpucheck.py::test_real_checks_in_parts_then_merged_in_cpu_mode": "the checks it selects load digits in "
    "process or skip without a GPU before they start anything",
    "test_gpucheck.py::test_lab_exercises_on_ranks_hand_every_rank_run_check_the_solutions_answer": "the rank-run "
    "checks are replaced by in-process recorders: nothing starts",
    # Exercises checked in the notebook's own process: engine.check starts ranks only for a spec with
    # ranks=N, and those tests are slow or extended.
    "test_checks_gd_sgd.py::test_the_library_per_example_grads_is_refused_and_the_loop_refusal_names_a_loop": IN_PROCESS,
    "test_exercise_engine.py::test_an_oracle_that_is_a_library_function_is_refused_to_the_answer_and_put_back_after": IN_PROCESS,
    "test_exercise_engine.py::test_a_refused_module_reached_through_its_package_and_a_specs_function_held_by_name_are_refused": IN_PROCESS,
    "test_exercise_engine.py::test_the_exercises_own_oracle_reached_through_the_registry_is_refused_and_put_back": IN_PROCESS,
    "test_checks_large_batch.py::test_a_placeholder_in_step_alone_says_not_implemented": IN_PROCESS,
    "test_checks_large_batch.py::test_independent_hand_written_classes_pass": IN_PROCESS,
    "test_checks_large_batch.py::test_passing_the_library_class_itself_is_refused": IN_PROCESS,
    "test_checks_large_batch.py::test_the_library_is_refused_however_it_is_reached": IN_PROCESS,
    "test_checks_profiling.py::test_the_library_trace_readers_are_refused": IN_PROCESS,
    "test_exercise_engine.py::test_a_refused_function_raises_inside_a_class_answers_static_methods": IN_PROCESS,
    "test_exercise_engine.py::test_a_comment_does_not_count_as_code": IN_PROCESS,
    "test_exercise_engine.py::test_a_mistake_is_named_only_where_the_answer_makes_it_on_every_case": IN_PROCESS,
    "test_exercise_engine.py::test_a_crash_names_the_error_and_a_placeholder_says_not_implemented": IN_PROCESS,
    "test_exercise_engine.py::test_a_hang_is_reported_within_the_timeout": IN_PROCESS,
    "test_exercise_engine.py::test_a_mechanism_mistake_fails_even_when_the_number_is_right": IN_PROCESS,
    "test_exercise_engine.py::test_a_refused_function_raises_wherever_the_answer_reaches_it": IN_PROCESS,
    "test_exercise_engine.py::test_a_refused_function_raises_through_a_partial_a_default_and_the_module_that_defines_it": IN_PROCESS,
    "test_exercise_engine.py::test_a_refused_class_refuses_a_subclass_and_a_right_answer_passes_beside_a_hostile_global": IN_PROCESS,
    "test_exercise_engine.py::test_a_refused_modules_private_class_is_refused_to_the_answer_and_its_subclass_not_to_the_library": IN_PROCESS,
    "test_exercise_engine.py::test_a_replayed_mistake_is_named_and_a_constant_fails_on_the_second_case": IN_PROCESS,
    "test_exercise_engine.py::test_a_right_answer_passes_and_the_success_line_names_no_target": IN_PROCESS,
    "test_exercise_engine.py::test_the_library_itself_and_the_oracle_are_refused": IN_PROCESS,
}


def _dotted(node: ast.AST) -> str | None:
    """`a.b.c` for a name or an attribute chain on a name, else None (a call's result, a subscript...)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


class Module:
    """A module's top-level functions, and what each name it imports stands for (a dotted name)."""

    def __init__(self, path: Path, name: str | None = None):
        self.name = name or _module_name(path)
        self.package = self.name if path.name == "__init__.py" else self.name.rpartition(".")[0]
        self.tree = ast.parse(path.read_text(), str(path))
        self.functions = {n.name: n for n in self.tree.body if isinstance(n, ast.FunctionDef)}
        self.aliases: dict[str, str] = {}
        self.stars: list[str] = []
        for node in ast.walk(self.tree):  # imports inside functions too: the course imports lazily
            if isinstance(node, ast.Import):
                for a in node.names:
                    self.aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = self.package.split(".")[: len(self.package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                for a in node.names:
                    if a.name == "*":
                        self.stars.append(base)
                    else:
                        self.aliases[a.asname or a.name] = f"{base}.{a.name}"


def _library() -> dict[str, Module]:
    files = [p for d in ("utils", "benchmarks", "cluster") for p in sorted((ROOT / d).rglob("*.py"))]
    return {m.name: m for m in map(Module, files)}


def _resolve(dotted: str, lib: dict[str, Module], seen: frozenset = frozenset()) -> tuple[str, str] | None:
    """The (module, function) a fully qualified dotted name stands for, through re-exports; else None."""
    if dotted in seen:
        return None
    seen = seen | {dotted}
    mod, _, name = dotted.rpartition(".")
    if mod in lib and name:
        m = lib[mod]
        if name in m.functions:
            return mod, name
        if name in m.aliases:
            return _resolve(m.aliases[name], lib, seen)
        for star in m.stars:
            if (found := _resolve(f"{star}.{name}", lib, seen)) is not None:
                return found
    return None


def _qualify(dotted: str, module: Module) -> str:
    """A name as written in `module`, made fully qualified through its imports and its own functions."""
    head, _, rest = dotted.partition(".")
    if head in module.aliases:
        return ".".join(filter(None, [module.aliases[head], rest]))
    return f"{module.name}.{dotted}"


SUBPROCESS_STARTERS = {f"subprocess.{f}" for f in ("run", "Popen", "call", "check_call", "check_output", "getoutput")}
OS_STARTERS = {"os.fork", "os.forkpty", "os.posix_spawn", "os.posix_spawnp", "os.system", "os.popen"}
MP_STARTERS = {"Process", "Pool", "spawn", "start_processes"}  # multiprocessing's, and torch.multiprocessing's


def _starts_directly(call: ast.Call, module: Module) -> bool:
    name = _dotted(call.func)
    if name is None:  # mp.get_context("spawn").Process(...)
        return isinstance(call.func, ast.Attribute) and call.func.attr in MP_STARTERS
    full = _qualify(name, module)
    if full in SUBPROCESS_STARTERS or full in OS_STARTERS:
        return True
    if full.split(".")[0] in ("multiprocessing", "torch") and full.rsplit(".", 1)[-1] in MP_STARTERS:
        return True
    return "." in name and name.rsplit(".", 1)[-1] == "Process"  # ctx.Process(...), ctx a context


def _callees(fn: ast.FunctionDef, module: Module) -> tuple[bool, set[str]]:
    """Whether `fn` starts a process itself, and the qualified names of everything else it calls or
    hands on (a function passed as a value, `Check("resume", check_resume)`, may be called later)."""
    direct = any(_starts_directly(n, module) for n in ast.walk(fn) if isinstance(n, ast.Call))
    names = {_qualify(d, module) for n in ast.walk(fn) if isinstance(n, (ast.Name, ast.Attribute)) if (d := _dotted(n))}
    return direct, names


def _starters(modules: dict[str, Module], lib: dict[str, Module], known=frozenset()) -> set[tuple[str, str]]:
    """`known` and every (module, function) of `modules` that starts a process, itself or through what
    it calls (a function of `modules`, or one of `lib` in `known`)."""
    edges, found = {}, set(known)
    for m in modules.values():
        for name, fn in m.functions.items():
            direct, names = _callees(fn, m)
            edges[m.name, name] = {r for n in names if (r := _resolve(n, modules) or _resolve(n, lib)) is not None}
            if direct:
                found.add((m.name, name))
    while True:
        more = {f for f, calls in edges.items() if f not in found and calls & found}
        if not more:
            return found
        found |= more


def _marks(exprs: list[ast.expr]) -> set[str]:
    """The X of each `pytest.mark.X` or `pytest.mark.X(...)` in `exprs` (decorators, or a pytestmark
    value and the items of its list); a mark inside an argument (`pytest.param(..., marks=...)`)
    covers that case only, not the test."""
    out = set()
    for e in exprs:
        items = e.elts if isinstance(e, (ast.List, ast.Tuple)) else [e]
        for item in items:
            name = _dotted(item.func if isinstance(item, ast.Call) else item) or ""
            if name.startswith("pytest.mark.") and name.count(".") == 2:
                out.add(name.rsplit(".", 1)[-1])
    return out


def _file_marks(tree: ast.Module) -> set[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            return _marks([node.value])
    return set()


def unmarked_process_tests(paths: list[Path]) -> dict[str, str]:
    """{"file::test": the first process-starting function it reaches} for each test of `paths` that
    starts processes and carries no tier mark (its own, or its file's `pytestmark`)."""
    lib = _library()
    lib_starters = _starters(lib, lib)
    out = {}
    for path in paths:
        m = Module(path, f"tests.{path.stem}")
        own = {m.name: m}
        found = _starters(own, lib, lib_starters)
        if _file_marks(m.tree) & TIERS:
            continue
        for name, fn in m.functions.items():
            if not name.startswith("test_") or _marks(fn.decorator_list) & TIERS:
                continue
            direct, calls = _callees(fn, m)
            calls |= {f"{m.name}.{a.arg}" for a in fn.args.args if a.arg in m.functions}  # its file's fixtures
            hits = sorted(".".join(r) for n in calls if (r := _resolve(n, own) or _resolve(n, lib)) in found)
            if direct or hits:
                out[f"{path.name}::{name}"] = hits[0] if hits else "a process started in the test itself"
    return out


def test_every_test_that_starts_processes_is_in_a_tier_or_says_why_not():
    found = unmarked_process_tests(sorted((ROOT / "tests").glob("test_*.py")))
    unexplained = {k: v for k, v in found.items() if k not in FAST_TIER_PROCESSES}
    assert not unexplained, (
        "these tests start processes but carry no tier mark, so `make check` runs them: mark each "
        "@pytest.mark.slow (or its file's pytestmark), or add it to FAST_TIER_PROCESSES with why:\n"
        + "\n".join(f"  {k}  (through {v})" for k, v in sorted(unexplained.items()))
    )
    stale = sorted(set(FAST_TIER_PROCESSES) - set(found))
    assert not stale, f"FAST_TIER_PROCESSES names tests that start no process or are tiered now: {stale}"


PROBE = """
import subprocess, sys
import multiprocessing as mp
from utils import parallel
from utils.checks.engine import check
from utils.grader.core import grade

def _helper():
    subprocess.run([sys.executable, "-c", "pass"])

@pytest.fixture
def ranks():
    return parallel.launch(print, 2)

def test_subprocess_in_a_helper():
    _helper()

def test_ranks_in_a_fixture(ranks):
    pass

def test_a_process_of_a_context():
    mp.get_context("spawn").Process(target=print).start()

def test_a_check_that_spawns_ranks():
    check(None, None)

def test_the_sandbox():
    grade("x.py", None)

@pytest.mark.slow
def test_marked():
    parallel.torchrun(["-m", "x"])

@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.extended
def test_marked_under_another_decorator(n):
    parallel.launch(print, n)

@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_one_case_marked(n):
    parallel.launch(print, n)

def test_arithmetic():
    assert parallel.ring_bytes(4, 2) > 0
"""


def test_the_scan_sees_each_way_of_starting_processes(tmp_path):
    """Tests written for this check: each way of starting a process is seen, through a helper, a
    fixture, a multiprocessing context, a lab check and the grader; marks are read from decorators
    and from a file's pytestmark; a test of arithmetic is left alone."""
    probe, tiered = tmp_path / "test_probe.py", tmp_path / "test_tiered.py"
    probe.write_text(PROBE)
    tiered.write_text(
        "import pytest\nfrom utils import parallel\npytestmark = [pytest.mark.slow]\n"
        "def test_ranks():\n    parallel.launch(print, 2)\n"
    )
    found = unmarked_process_tests([probe, tiered])
    assert sorted(found) == [
        f"test_probe.py::{t}"
        for t in (
            "test_a_check_that_spawns_ranks",
            "test_a_process_of_a_context",
            "test_one_case_marked",
            "test_ranks_in_a_fixture",
            "test_subprocess_in_a_helper",
            "test_the_sandbox",
        )
    ], found
    assert found["test_probe.py::test_the_sandbox"] == "utils.grader.core.grade", found
    assert found["test_probe.py::test_ranks_in_a_fixture"] == "tests.test_probe.ranks", found
