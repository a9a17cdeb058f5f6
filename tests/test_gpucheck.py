"""utils.gpucheck (`make gpu-check`): the report's schema, skip and fail, the exit code, and real
checks in CPU mode. The whole CPU-mode run takes minutes; `make gpu-check` runs it."""
from __future__ import annotations

import json

import pytest
import torch

from utils import gpucheck

CPU_INFO = {"gpus": [], "torch": torch.__version__, "cuda": None, "cudnn": None, "nccl": None, "driver": None,
            "python": "3", "cpu": "test cpu", "cpu_cores": 2, "usable_cores": 2}


def _passes(ctx):
    return "all good"


def _skips(ctx):
    ctx.need_gpus(1, "a GPU-only check")


def _fails(ctx):
    raise AssertionError("\x1b[31mthe ring disagrees\x1b[39m with all_reduce")    # coloured, as nbclient's


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
    assert status["skips"]["status"] == "skip" and "needs 1 GPU" in status["skips"]["detail"], \
        "a skip must say why"
    assert status["fails"]["status"] == "fail" and "AssertionError: the ring disagrees with all_reduce" in status["fails"]["detail"]
    _, code = gpucheck.run_checks(checks[:2], tmp_path / "ok", info=CPU_INFO)
    assert code == 0, "passes and skips only: exit 0"


def test_device_label_names_the_gpus():
    info = dict(CPU_INFO, gpus=[{"name": "NVIDIA H100 80GB HBM3"}] * 2)
    assert gpucheck.device_label(info) == "NVIDIA H100 80GB HBM3 x 2"
    assert gpucheck.device_label(CPU_INFO) == "cpu"


def test_every_required_check_is_listed():
    names = " | ".join(c.name for c in gpucheck.all_checks())
    for want in ("ddp nccl", "sharing one GPU", "ring", "resume", "bf16", "fp16", "monitor", "grader",
                 "bench throughput", "notebook notebooks/02_cpu_vs_gpu.ipynb", "notebook solutions/lab3_ddp.ipynb"):
        assert want in names, f"make gpu-check must run {want!r}"
    with pytest.raises(SystemExit, match="matches no check"):
        gpucheck.select(gpucheck.all_checks(), "no-such-check")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-mode behaviour")
def test_real_checks_in_cpu_mode(tmp_path, capsys):
    """Real checks, through the command line: the resume is bit-identical on the CPU, the GPU-only
    checks skip with a reason, the report is written and the exit status is 0."""
    code = gpucheck.main(["--out", str(tmp_path), "--only", "resume,nccl,monitor,fp16"])
    out = capsys.readouterr().out
    assert "== hardware ==" in out and "torch " + torch.__version__ in out
    rep = json.loads((tmp_path / "report.json").read_text())
    st = {c["name"]: c["status"] for c in rep["checks"]}
    assert st == {"resume bit-identical": "pass", "ddp nccl on all GPUs": "skip",
                  "monitor samples the GPU": "skip", "amp fp16 step": "skip"}, rep["checks"]
    assert code == 0


class _Parsed(Exception):
    pass


@pytest.mark.parametrize("mode", ["cpu", "gpu"])
@pytest.mark.parametrize("name", sorted(gpucheck.BENCH_ARGS))
def test_each_benchmark_accepts_the_arguments_gpucheck_passes(name, mode, monkeypatch):
    """The benchmark's own argparse parses what `make gpu-check` gives it (a renamed option once
    failed the check on every machine); parsing stops before anything is measured."""
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
    code = ("import sys, runpy; sys.modules['torch'] = None; "        # None: `import torch` raises ImportError
            "runpy.run_module('utils.gpucheck', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code, "--list"], capture_output=True, text=True, timeout=60,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 1
    assert "has no PyTorch" in r.stderr and "GPU_PY=" in r.stderr
    assert "Traceback" not in r.stderr
