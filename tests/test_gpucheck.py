"""utils.gpucheck (`make gpu-check`): the report's schema, skip and fail, the exit code, and real
checks in CPU mode. The whole CPU-mode run takes minutes; `make gpu-check` runs it."""

from __future__ import annotations

import json
import time

import pytest
import torch

from utils import gpucheck

CPU_INFO = {
    "gpus": [],
    "torch": torch.__version__,
    "cuda": None,
    "cudnn": None,
    "nccl": None,
    "driver": None,
    "python": "3",
    "cpu": "test cpu",
    "cpu_cores": 2,
    "usable_cores": 2,
}


def _passes(ctx):
    return "all good"


def _skips(ctx):
    ctx.need_gpus(1, "a GPU-only check")


def _fails(ctx):
    raise AssertionError("\x1b[31mthe ring disagrees\x1b[39m with all_reduce")  # coloured, as nbclient's


def test_report_schema_skip_fail_and_exit_code(tmp_path):
    checks = [gpucheck.Check("passes", _passes), gpucheck.Check("skips", _skips), gpucheck.Check("fails", _fails)]
    report, code = gpucheck.run_checks(checks, tmp_path, info=CPU_INFO)
    assert code == 1, "any failed check must make the command exit non-zero"
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["device"] == "cpu" and rep["mode"] == "cpu" and rep["profile"] == "smoke"
    assert [c["name"] for c in rep["checks"]] == ["passes", "skips", "fails"]
    for c in rep["checks"]:
        assert set(c) == {"name", "status", "seconds", "detail"}
        assert c["status"] in gpucheck.STATUSES and c["seconds"] >= 0
    status = {c["name"]: c for c in rep["checks"]}
    assert status["passes"]["status"] == "pass" and status["passes"]["detail"] == "all good"
    assert status["skips"]["status"] == "skip" and "needs 1 GPU" in status["skips"]["detail"], "a skip must say why"
    assert (
        status["fails"]["status"] == "fail"
        and "AssertionError: the ring disagrees with all_reduce" in status["fails"]["detail"]
    )
    _, code = gpucheck.run_checks(checks[:2], tmp_path / "ok", info=CPU_INFO)
    assert code == 0, "passes and skips only: exit 0"


def test_device_label_names_the_gpus():
    info = dict(CPU_INFO, gpus=[{"name": "NVIDIA H100 80GB HBM3"}] * 2)
    assert gpucheck.device_label(info) == "NVIDIA H100 80GB HBM3 x 2"
    assert gpucheck.device_label(CPU_INFO) == "cpu"


def test_every_required_check_is_listed():
    names = " | ".join(c.name for c in gpucheck.all_checks())
    for want in (
        "ddp nccl",
        "sharing one GPU",
        "ring",
        "resume",
        "bf16",
        "fp16",
        "monitor",
        "grader",
        "bench throughput",
        "notebook notebooks/02_cpu_vs_gpu.ipynb",
        "notebook solutions/lab3_ddp.ipynb",
        "lab exercises on ranks",
    ):
        assert want in names, f"make gpu-check must run {want!r}"
    with pytest.raises(SystemExit, match="matches no check"):
        gpucheck.select(gpucheck.all_checks(), "no-such-check")


@pytest.mark.slow  # the resume check trains on 2 ranks
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-mode behaviour")
def test_real_checks_in_cpu_mode(tmp_path, capsys):
    """Real checks, through the command line: the resume is bit-identical on the CPU, the GPU-only
    checks skip with a reason, the report is written and the exit status is 0."""
    code = gpucheck.main(["--out", str(tmp_path), "--only", "resume,nccl,monitor,fp16", "--offline"])
    out = capsys.readouterr().out
    assert "== hardware ==" in out and "torch " + torch.__version__ in out
    rep = json.loads((tmp_path / "report.json").read_text())
    st = {c["name"]: c["status"] for c in rep["checks"]}
    assert st == {
        "resume bit-identical": "pass",
        "ddp nccl on all GPUs": "skip",
        "monitor samples the GPU": "skip",
        "amp fp16 step": "skip",
    }, rep["checks"]
    assert code == 0


class _Parsed(Exception):
    pass


@pytest.mark.parametrize("mode", ["quick", "full"])
@pytest.mark.parametrize("name", sorted(gpucheck.BENCH_ARGS))
def test_each_benchmark_accepts_the_arguments_gpucheck_passes(name, mode, monkeypatch):
    """The benchmark's own argparse parses what `make gpu-check` gives it (an option renamed in one
    and not the other fails the check on every machine); parsing stops before anything is measured."""
    import argparse
    import importlib

    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        parse(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    module = importlib.import_module(f"benchmarks.{name}")
    args = gpucheck.BENCH_ARGS[name][mode] + (["--out", "x.json"] if name == "throughput" else [])
    with pytest.raises(_Parsed):
        module.main(args)


def test_an_interpreter_without_torch_gets_a_message_not_a_traceback():
    """GPU_PY pointing at a Python without PyTorch: one line that says what to do, exit 1."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, runpy; sys.modules['torch'] = None; "  # None: `import torch` raises ImportError
        "runpy.run_module('utils.gpucheck', run_name='__main__')"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, "--list"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert r.returncode == 1
    assert "has no PyTorch" in r.stderr and "GPU_PY=" in r.stderr
    assert "Traceback" not in r.stderr


# ---------------------------------------------------------------------------- the time budget


def _slow_subprocess(ctx):
    import sys

    gpucheck._run([sys.executable, "-c", "import time; time.sleep(60)"], ctx, 600, ctx.out / "slow.txt")


def _own_limit(ctx):
    import sys

    gpucheck._run([sys.executable, "-c", "import time; time.sleep(60)"], ctx, 1, ctx.out / "limit.txt")


def test_the_budget_stops_a_long_check_and_the_rest_are_not_verified(tmp_path, monkeypatch):
    """A subprocess gets what is left of the budget as its timeout: stopped by the budget, it is
    'not verified' with the reason (not 'fail', not a 60 s wait); a check with no budget left is not
    started, and is 'not verified' too. A check stopped by its OWN limit, with budget to spare, fails."""
    monkeypatch.setattr(gpucheck, "MIN_START_S", 3.0)
    monkeypatch.setattr(gpucheck, "BUDGET_MARGIN_S", 1.0)
    checks = [
        gpucheck.Check("own limit", _own_limit),
        gpucheck.Check("slow", _slow_subprocess),
        gpucheck.Check("after", _passes),
    ]
    t0 = time.perf_counter()
    report, code = gpucheck.run_checks(checks, tmp_path, info=CPU_INFO, budget_s=8)
    assert time.perf_counter() - t0 < 30, "the budget must bound the run"
    rep = json.loads((tmp_path / "report.json").read_text())
    st = {c["name"]: c for c in rep["checks"]}
    assert st["own limit"]["status"] == "fail" and "TimeoutExpired" in st["own limit"]["detail"]
    assert st["slow"]["status"] == "not verified" and "stopped by the time budget" in st["slow"]["detail"]
    assert st["after"]["status"] == "not verified" and "time budget (--budget-s 8) is spent" in st["after"]["detail"]
    assert rep["budget_s"] == 8 and code == 1, "a failure outranks what is not verified"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-mode behaviour")
def test_make_gpu_check_with_a_tiny_budget_verifies_nothing_and_exits_3(tmp_path, capsys):
    """`make gpu-check` in CPU mode with a budget too small for anything: every check is 'not
    verified' with its reason, the report is written, the exit status is 3 (0 only with
    --accept-incomplete), within seconds."""
    t0 = time.perf_counter()
    code = gpucheck.main(["--out", str(tmp_path), "--budget-s", "5", "--offline"])
    assert time.perf_counter() - t0 < 60
    rep = json.loads((tmp_path / "report.json").read_text())
    assert len(rep["checks"]) == len(gpucheck.all_checks()) and code == 3
    for c in rep["checks"]:
        assert c["status"] == "not verified" and "time budget" in c["detail"], c
    assert rep["profile"] == "smoke" and rep["offline"] is True and rep["profile_reason"] and rep["finished"]
    out = capsys.readouterr().out
    assert "budget 5 s" in out and f"0 passed, 0 failed, 0 skipped, {len(rep['checks'])} not verified" in out
    assert gpucheck.main(["--out", str(tmp_path), "--budget-s", "5", "--offline", "--accept-incomplete"]) == 0


def test_the_makefile_passes_gpu_check_args():
    import subprocess
    from pathlib import Path

    r = subprocess.run(
        ["make", "-n", "gpu-check", "OUT=/tmp/x", "GPU_CHECK_ARGS=--budget-s 42", "GPU_PY=python3"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        timeout=60,
    )
    assert '--out "/tmp/x" --budget-s 42' in r.stdout, r.stdout + r.stderr


# ---------------------------------------------------------------------------- profile, notebooks, offline, grader


@pytest.mark.parametrize(
    "gpus, missing, env, want",
    [
        (0, [], {}, "smoke"),
        (1, [], {}, "smoke"),
        (2, ["cifar10"], {}, "smoke"),
        (8, [], {}, "gpu"),
        (1, ["cifar10"], {"LAB_PROFILE": "gpu"}, "gpu"),
        (8, [], {"LAB_PROFILE": "cpu"}, "cpu"),
    ],
)
def test_profile_smoke_on_one_gpu_or_without_datasets_and_lab_profile_wins(gpus, missing, env, want):
    profile, why = gpucheck.choose_profile(gpus, missing, env)
    assert profile == want and why


def test_a_solution_runs_only_where_its_code_differs_from_its_demo(tmp_path):
    import nbformat

    (tmp_path / "notebooks").mkdir()
    (tmp_path / "solutions").mkdir()

    def nb(path, *cells):
        n = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
        nbformat.write(n, str(path))
        return path

    nb(tmp_path / "notebooks" / "03_ddp.ipynb", "import torch\nx = 1  # one", "print(x)")
    same = nb(tmp_path / "solutions" / "lab3_ddp.ipynb", "# a comment only\nimport torch\n\nx = 1", "  print(x)  ")
    assert gpucheck.demo_of(same) == tmp_path / "notebooks" / "03_ddp.ipynb"
    assert not gpucheck.solution_differs(same), "the same code, comments and blank lines aside: not run twice"
    own = nb(tmp_path / "solutions" / "lab3_ddp.ipynb", "import torch", "def ring(t):\n    return t")
    assert gpucheck.solution_differs(own)
    assert gpucheck.solution_differs(nb(tmp_path / "solutions" / "lab9_new.ipynb", "print(1)")), "no demo: run it"


def test_offline_children_fail_a_download_at_once():
    """Offline, a child's download is refused at once by the unreachable proxy, not after
    connection timeouts (utils.data tries each mirror with a 60 s timeout)."""
    import subprocess
    import sys

    code = (
        "import time, urllib.request\nt = time.time()\ntry:\n    urllib.request.urlopen("
        "'https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz', timeout=60)\nexcept Exception as e:\n"
        "    print(type(e).__name__, round(time.time() - t, 1))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        env=gpucheck._env_for_children("smoke", offline=True),
        capture_output=True,
        text=True,
        timeout=60,
    )
    name, seconds = r.stdout.split()
    assert name == "URLError" and float(seconds) < 5, r.stdout + r.stderr


def test_the_gpu_grading_spec_has_a_secret_seed_and_fits_the_gpus():
    from pathlib import Path

    from utils.grader.spec import load_spec

    root = Path(__file__).resolve().parents[1]
    text = (root / "labs" / "assessment" / "spec_gpu.toml").read_text()
    for gpus, nprocs in ((1, 1), (2, 2), (8, 2)):
        out = gpucheck.grader_spec_text(text, gpus, 123456789)
        path = Path(__import__("tempfile").mkdtemp()) / "spec.toml"
        path.write_text(out)
        spec = load_spec(path)
        assert spec.heldout_seed == 123456789 and spec.nprocs == nprocs


def test_the_grader_check_skips_without_cifar10_and_fails_unless_passed(tmp_path, monkeypatch):
    info = dict(CPU_INFO, gpus=[{"name": "Fake H100"}])
    ctx = gpucheck.Context(tmp_path, "gpu", "smoke", info, missing=("cifar10",), offline=True)
    with pytest.raises(gpucheck.Skip, match="CIFAR-10.*offline"):
        gpucheck.check_grader(ctx)
    seen = {}

    def fake_run(cmd, ctx, timeout, log):
        spec = cmd[cmd.index("--spec") + 1]
        seen["spec"] = open(spec).read()
        (ctx.out / "grader.json").write_text(json.dumps({"status": "failed", "accuracy": 0.3, "reason": "too slow"}))
        return ""

    monkeypatch.setattr(gpucheck, "_run", fake_run)
    ctx = gpucheck.Context(tmp_path, "gpu", "smoke", info)
    with pytest.raises(RuntimeError, match="must pass.*status=failed"):
        gpucheck.check_grader(ctx)
    assert "nprocs = 1" in seen["spec"] and "heldout_seed = 0" not in seen["spec"]


# ---------------------------------------------------------------------------- order, parts, not verified, merge


def test_the_riskiest_paths_come_first():
    """Every multi-rank path, then the labs' rank-run exercises, notebooks 05 and 03, AMP and the
    monitor, the grader and the benchmarks, then every other notebook and solution."""
    names = [c.name for c in gpucheck.all_checks()]
    groups = [
        ["ring all-reduce vs all_reduce", "ddp nccl on all GPUs", "ddp gloo ranks sharing one GPU"],
        ["ddp gloo on cpu", "resume bit-identical"],
        ["lab exercises on ranks"],
        ["notebook notebooks/05_memory_and_model_parallel.ipynb"],
        ["notebook notebooks/03_ddp.ipynb"],
        ["amp bf16 step", "amp fp16 step", "monitor samples the GPU"],
        ["grader on the reference solution", "bench throughput", "bench train loop overhead", "bench optimizer step"],
    ]
    at = [[names.index(n) for n in g] for g in groups]
    for earlier, later in zip(at, at[1:]):
        assert max(earlier) < min(later), [names[i] for i in earlier + later]
    others = [n for n in names if n.startswith("notebook ") and n not in sum(groups, [])]
    assert len(others) == len(gpucheck.notebook_paths()) - 2 and min(map(names.index, others)) > max(at[-1])
    assert len(set(names)) == len(names), "each check has its own name: the merged report is keyed by it"


def _brute_force_min_max(est, n):
    """The smallest possible largest part, over every way to cut ``est`` into n contiguous non-empty parts."""
    import itertools

    best = None
    for cuts in itertools.combinations(range(1, len(est)), n - 1):
        b = [0, *cuts, len(est)]
        worst = max(sum(est[i:j]) for i, j in zip(b, b[1:]))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize(
    "est", [[13, 13, 15, 12, 5, 90, 73, 70, 2, 2, 3, 150, 24, 48, 13], [1, 1, 1, 50, 1], [5, 5, 5, 5], [7]]
)
def test_parts_are_contiguous_and_their_largest_is_as_small_as_any_cut(est):
    for n in range(1, len(est) + 1):
        cuts = gpucheck.partition(est, n)
        assert cuts[0] == 0 and cuts[-1] == len(est) and all(a < b for a, b in zip(cuts, cuts[1:])), cuts
        worst = max(sum(est[a:b]) for a, b in zip(cuts, cuts[1:]))
        assert worst == _brute_force_min_max(est, n), (n, cuts)
        assert gpucheck.partition(list(est), n) == cuts, "the same estimates always give the same parts"
    with pytest.raises(ValueError):
        gpucheck.partition(est, len(est) + 1)


@pytest.mark.parametrize("profile", ["smoke", "gpu"])
def test_the_plan_cuts_the_ordered_list_and_uses_each_profiles_estimates(profile):
    checks = gpucheck.all_checks()
    for n in (1, 2, 3, 5):
        parts = gpucheck.plan_parts(checks, n, profile)
        assert len(parts) == n and all(parts) and [c.name for p in parts for c in p] == [c.name for c in checks]
    nb02 = next(c for c in checks if c.name == "notebook notebooks/02_cpu_vs_gpu.ipynb")
    assert (nb02.estimate("smoke"), nb02.estimate("gpu")) == (34, 253)  # the H100 run's figures
    lab0 = next(c for c in checks if c.name == "notebook solutions/lab0_example.ipynb")
    assert lab0.estimate("gpu") == gpucheck.UNMEASURED_PROFILE_FACTOR * 5, "no gpu figure: a multiple of smoke's"
    need = gpucheck.parts_needed(checks, profile, 500)
    fill = [sum(c.estimate(profile) for c in p) for p in gpucheck.plan_parts(checks, need, profile)]
    assert max(fill) <= gpucheck.PART_FILL * 500
    if need > 1:
        fewer = gpucheck.plan_parts(checks, need - 1, profile)
        assert max(sum(c.estimate(profile) for c in p) for p in fewer) > gpucheck.PART_FILL * 500


def test_exit_codes():
    assert gpucheck.exit_code(["pass", "skip"]) == 0
    assert gpucheck.exit_code(["pass", "not verified"]) == 3
    assert gpucheck.exit_code(["pass", "not verified"], accept_incomplete=True) == 0
    assert gpucheck.exit_code(["not verified", "fail"], accept_incomplete=True) == 1
    assert gpucheck.exit_code([]) == 0


def _spends_the_budget(ctx):
    time.sleep(max(0.0, ctx.remaining() - 0.5))  # leaves less than MIN_START_S for the next check
    return "slept"


FAKE = {"passes": _passes, "fails": _fails, "spends": _spends_the_budget}


def _fake_checks(monkeypatch, *names):
    """all_checks() as ``names`` (each a FAKE function), 10 s estimated each."""
    monkeypatch.setattr(gpucheck, "all_checks", lambda: [gpucheck.Check(n, FAKE[n.split()[0]], "", 10) for n in names])


def _main(tmp_path, *args):
    return gpucheck.main(["--out", str(tmp_path), "--offline", *args])


def test_parts_merge_into_one_report_and_the_exit_status_says_what_is_not_verified(tmp_path, monkeypatch, capsys):
    """Three parts of six 10-s checks: two each. Merged with part 3 missing: its checks are not
    verified (exit 3; 0 with --accept-incomplete); with every part: exit 0; a failure: exit 1."""
    _fake_checks(monkeypatch, "passes a", "passes b", "passes c", "passes d", "fails e", "passes f")
    for k in (1, 2):
        assert _main(tmp_path, "--part", f"{k}/3") == 0
    assert sorted(p.name for p in tmp_path.glob("report-part-*")) == [
        "report-part-1-of-3.json",
        "report-part-2-of-3.json",
    ]
    part1 = json.loads((tmp_path / "report-part-1-of-3.json").read_text())
    assert [c["name"] for c in part1["checks"]] == ["passes a", "passes b"] and part1["part"] == {"k": 1, "n": 3}
    assert part1["plan"] == [["passes a", "passes b"], ["passes c", "passes d"], ["fails e", "passes f"]]
    capsys.readouterr()

    assert _main(tmp_path, "--merge") == 3
    out = capsys.readouterr().out
    merged = json.loads((tmp_path / "report.json").read_text())
    names = [c["name"] for c in merged["checks"]]
    assert names == ["passes a", "passes b", "passes c", "passes d", "fails e", "passes f"], "each check once"
    st = {c["name"]: (c["status"], c["part"]) for c in merged["checks"]}
    assert st["passes d"] == ("pass", 2) and st["fails e"] == st["passes f"] == ("not verified", 3)
    assert "part 3/3 was not run" in merged["checks"][4]["detail"]
    assert [p["ran"] for p in merged["parts"]] == [True, True, False] and merged["merged_from"] == "2 of 3 parts"
    assert "4 passed, 0 failed, 0 skipped, 2 not verified" in out and "NOT VERIFIED" in out
    assert gpucheck.main(["--merge", str(tmp_path), "--accept-incomplete"]) == 0, "--merge OUT, accepted"

    assert _main(tmp_path, "--part", "3/3") == 1
    assert _main(tmp_path, "--merge") == 1
    assert _main(tmp_path, "--merge", "--accept-incomplete") == 1, "a failure is never accepted"
    _fake_checks(monkeypatch, "passes a", "passes b", "passes c", "passes d", "passes e", "passes f")
    assert _main(tmp_path, "--part", "3/3") == 0
    assert _main(tmp_path, "--merge") == 2, "parts 1 and 2 were cut from another list of checks: no merge"
    for k in (1, 2):
        assert _main(tmp_path, "--part", f"{k}/3") == 0
    assert _main(tmp_path, "--merge") == 0
    assert "6 passed, 0 failed, 0 skipped, 0 not verified" in capsys.readouterr().out


def test_a_part_stopped_by_its_budget_or_killed_is_not_verified_in_the_merge(tmp_path, monkeypatch):
    monkeypatch.setattr(gpucheck, "MIN_START_S", 1.0)
    _fake_checks(monkeypatch, "spends a", "passes b", "passes c", "passes d")
    assert _main(tmp_path, "--part", "1/2", "--budget-s", "5") == 3, "the budget left 'passes b' unverified"
    part = json.loads((tmp_path / "report-part-1-of-2.json").read_text())
    assert [c["status"] for c in part["checks"]] == ["pass", "not verified"] and part["finished"]
    assert _main(tmp_path, "--part", "2/2") == 0
    killed = json.loads((tmp_path / "report-part-2-of-2.json").read_text())
    killed["checks"], killed["finished"] = killed["checks"][:1], False  # as a run killed after its first check
    (tmp_path / "report-part-2-of-2.json").write_text(json.dumps(killed))
    assert _main(tmp_path, "--merge") == 3
    merged = json.loads((tmp_path / "report.json").read_text())
    assert [c["status"] for c in merged["checks"]] == ["pass", "not verified", "pass", "not verified"]
    assert "stopped before this check ran" in merged["checks"][3]["detail"]
    (tmp_path / "report-part-1-of-3.json").write_text(json.dumps(part))
    assert _main(tmp_path, "--merge") == 2, "parts of two plans (2 and 3 parts) are not merged"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-mode behaviour")
def test_real_checks_in_parts_then_merged_in_cpu_mode(tmp_path, capsys):
    """The real command line: the GPU-only checks and the datasets check cut into 3 parts; part 1
    alone merges to exit 3 with parts 2 and 3 listed as not run; all three merge to exit 0."""
    only = ["--only", "datasets,nccl,sharing,fp16,monitor", "--budget-s", "60"]
    assert _main(tmp_path, *only, "--part", "1/3") == 0
    assert _main(tmp_path, "--merge") == 3
    merged = json.loads((tmp_path / "report.json").read_text())
    want = [
        "datasets",
        "ddp nccl on all GPUs",
        "ddp gloo ranks sharing one GPU",
        "amp fp16 step",
        "monitor samples the GPU",
    ]
    assert [c["name"] for c in merged["checks"]] == want
    plan = json.loads((tmp_path / "report-part-1-of-3.json").read_text())["plan"]
    for c in merged["checks"]:
        if c["name"] in plan[0]:
            assert c["status"] in ("skip", "pass") and c["part"] == 1 and c["detail"], c  # no GPU here
        else:
            assert c["status"] == "not verified" and "was not run" in c["detail"], c
    assert [p["ran"] for p in merged["parts"]] == [True, False, False]
    for k in (2, 3):
        assert _main(tmp_path, *only, "--part", f"{k}/3") == 0
    assert _main(tmp_path, "--merge") == 0
    merged = json.loads((tmp_path / "report.json").read_text())
    assert [c["name"] for c in merged["checks"]] == want
    assert {c["status"] for c in merged["checks"]} <= {"skip", "pass"}
    capsys.readouterr()
    assert _main(tmp_path, *only, "--plan", "3") == 0
    out = capsys.readouterr().out
    assert all(f"part {k}/3" in out for k in (1, 2, 3)) and all(n in out for n in want)


# ---------------------------------------------------------------------------- three findings of the first H100 run


def test_the_nccl_check_fits_digits_on_any_gpu_count_up_to_16():
    """At 8 GPUs the old size, 64 x 8 x 4 = 2,048 training images, does not fit digits' 1,797 with
    128 for validation; every size now does, and every rank gets the same whole batches."""
    from utils import data

    with pytest.raises(ValueError, match="digits has 1,797 images"):
        data.check_sizes("digits", 64 * 8 * 4, 128)
    for n in range(1, 17):
        n_train, n_val = gpucheck.ddp_nccl_sizes(n)
        data.check_sizes("digits", n_train, n_val)  # raises when they do not fit
        assert n_train % (n * gpucheck.DDP_BATCH) == 0 and n_train // n >= gpucheck.DDP_BATCH, (n, n_train)
        assert n_train + n_val <= 1797
    assert gpucheck.ddp_nccl_sizes(2) == (512, 128), "where it fits, 16 batches per rank, as before"


def _fake_user_python3(tmp_path, monkeypatch):
    """A user kernelspec named python3 whose interpreter is not this one (and does not exist)."""
    spec = tmp_path / "userdata" / "kernels" / "python3"
    spec.mkdir(parents=True)
    argv = [str(tmp_path / "other" / "python3"), "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "other", "language": "python"}))
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "userdata"))
    monkeypatch.setenv("JUPYTER_PREFER_ENV_PATH", "0")  # the user's folder before the environment's, as outside a venv
    return argv[0]


def test_the_notebooks_kernel_is_this_interpreter_whatever_python3_says(tmp_path, monkeypatch):
    import sys

    from jupyter_client.kernelspec import KernelSpecManager

    other = _fake_user_python3(tmp_path, monkeypatch)
    assert KernelSpecManager().get_kernel_spec("python3").argv[0] == other, "the fake user spec is in effect"
    monkeypatch.setenv("JUPYTER_PATH", gpucheck.write_kernelspec(tmp_path / "ours"))
    assert KernelSpecManager().get_kernel_spec(gpucheck.KERNEL_NAME).argv[0] == sys.executable


@pytest.mark.slow  # starts a kernel
def test_a_notebook_runs_on_this_interpreter_and_environment_when_the_users_python3_points_elsewhere(
    tmp_path, monkeypatch
):
    """The kernel is this interpreter, and it inherits this process's environment (DATA_DIR,
    CUDA_VISIBLE_DEVICES, PATH...) plus the profile, even with a user kernelspec named python3 that
    names another interpreter."""
    import sys

    import nbformat

    _fake_user_python3(tmp_path, monkeypatch)
    monkeypatch.setenv("GPUCHECK_PROBE", "inherited")
    code = "import os, sys\nprint(sys.executable, os.environ.get('GPUCHECK_PROBE'), os.environ.get('LAB_PROFILE'))"
    figure = "import matplotlib.pyplot as plt\nplt.plot([0, 1])\nplt.show()"
    cells = [nbformat.v4.new_code_cell(code), nbformat.v4.new_code_cell(figure)]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), str(tmp_path / "probe.ipynb"))
    monkeypatch.setenv("MPLBACKEND", "Agg")  # as a headless server often has it
    gpucheck.execute_notebook(tmp_path / "probe.ipynb", tmp_path / "out.ipynb", "cpu", 120)
    ran = nbformat.read(str(tmp_path / "out.ipynb"), as_version=4)
    assert ran.cells[0].outputs[0]["text"].split() == [sys.executable, "inherited", "cpu"]
    assert any("image/png" in o.get("data", {}) for o in ran.cells[1].outputs), "the saved notebook keeps its figure"


def test_the_network_probe_is_bounded_even_when_name_lookup_hangs(monkeypatch):
    import socket

    def hangs(*args, **kwargs):
        time.sleep(30)
        raise socket.gaierror("name lookup gave up")

    monkeypatch.setattr(socket, "getaddrinfo", hangs)
    t0 = time.perf_counter()
    assert gpucheck.network_reachable(timeout=2.0) is False
    assert time.perf_counter() - t0 < 10, "a 30 s name lookup must not hold the probe past its 2 s"


def test_lab_exercises_on_ranks_hand_every_rank_run_check_the_solutions_answer(tmp_path, monkeypatch):
    """The check calls each rank-run exercise's own check (what the lab calls) with the solution
    notebook's functions; a CheckFailed from one fails the check. The checks are replaced by
    recorders here: the real ones spawn ranks (tests/test_checks_ddp.py, test_checks_model_parallel.py)."""
    from utils import checks

    names = {ex.name: ex.answer for ex in gpucheck.rank_exercises()}
    assert names == {
        "ring_all_reduce": ("ring_all_reduce",),
        "average_gradients": ("average_gradients",),
        "overlap_ddp": ("overlap_ddp",),
        "overlap_trace": ("overlap_ddp",),
        "zero2": ("zero2_optimizer", "zero2_step"),
        "tp_operators": ("CopyToTP", "ReduceFromTP"),
        "tp_block": ("TPBlock",),
        "sp_block": ("SPBlock",),
    }, "lab 3's, lab 5's and lab 7's exercises that run on ranks"
    seen = {}
    for name in names:
        monkeypatch.setattr(checks, f"check_{name}", lambda *a, _n=name: seen.setdefault(_n, a))
    ctx = gpucheck.Context(tmp_path, "cpu", "smoke", CPU_INFO)
    detail = gpucheck.check_lab_exercises_on_ranks(ctx)
    assert set(seen) == set(names) and "8 solutions pass" in detail
    for name, answer in seen.items():
        assert [f.__name__ for f in answer] == list(names[name]) and all(f.__module__ == "__main__" for f in answer)

    def fails(*answer):
        raise checks.CheckFailed("zero2: the shards differ. Try: something.")

    monkeypatch.setattr(checks, "check_zero2", fails)
    with pytest.raises(checks.CheckFailed, match="zero2: the shards differ"):
        gpucheck.check_lab_exercises_on_ranks(ctx)
