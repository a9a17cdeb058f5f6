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
        assert c["status"] in ("pass", "fail", "skip") and c["seconds"] >= 0
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


def test_the_budget_stops_a_long_check_and_skips_the_rest_with_reasons(tmp_path, monkeypatch):
    """A subprocess gets what is left of the budget as its timeout: stopped by the budget, it is
    'skip' with the reason (not 'fail', not a 60 s wait); a check with no budget left is not
    started. A check stopped by its OWN limit, with budget to spare, fails."""
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
    assert st["slow"]["status"] == "skip" and "stopped by the time budget" in st["slow"]["detail"], st["slow"]
    assert st["after"]["status"] == "skip" and "time budget (--budget-s 8) is spent" in st["after"]["detail"]
    assert rep["budget_s"] == 8 and code == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-mode behaviour")
def test_make_gpu_check_with_a_tiny_budget_writes_the_report_and_every_skip_says_why(tmp_path, capsys):
    """`make gpu-check` in CPU mode with a budget too small for anything: every check is 'skip'
    with its reason, the report is written, the exit status is 0, within seconds."""
    t0 = time.perf_counter()
    code = gpucheck.main(["--out", str(tmp_path), "--budget-s", "5", "--offline"])
    assert time.perf_counter() - t0 < 60
    rep = json.loads((tmp_path / "report.json").read_text())
    assert len(rep["checks"]) == len(gpucheck.all_checks()) and code == 0
    for c in rep["checks"]:
        assert c["status"] == "skip" and "time budget" in c["detail"], c
    assert rep["profile"] == "smoke" and rep["offline"] is True and rep["profile_reason"]
    assert "budget 5 s" in capsys.readouterr().out


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
