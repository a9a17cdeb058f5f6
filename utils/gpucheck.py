"""``make gpu-check OUT=dir``: the instructor's pre-class check of a GPU server, riskiest paths first.

    python -m utils.gpucheck --out gpu-check            # what `make gpu-check OUT=gpu-check` runs
    python -m utils.gpucheck --plan 3                   # which checks each of 3 parts holds, and how long
    python -m utils.gpucheck --out DIR --part 1/3       # the first of 3 parts (one session each) ...
    python -m utils.gpucheck --merge DIR                # ... then every part's report in one
    python -m utils.gpucheck --out DIR --only ddp,ring  # a subset (names contain these words)
    python -m utils.gpucheck --out DIR --budget-s 300   # stop starting checks after 5 minutes
    python -m utils.gpucheck --out DIR --offline        # no network: never wait on a download
    python -m utils.gpucheck --list                     # the checks, in the order they run

It prints the hardware (GPU names, compute capability, memory, driver, CUDA, cuDNN, NCCL,
torch), then runs the checks one by one in this order, the riskiest first:

1. every multi-rank path: the hand ring against ``all_reduce``, DDP with NCCL on all GPUs, gloo
   ranks sharing one GPU, gloo ranks on the CPU, a bit-identical resume (after ``datasets``,
   which takes milliseconds);
2. "lab exercises on ranks": every lab self-check that runs on spawned ranks (``Exercise.ranks``:
   labs 3, 5 and 7) on the solution notebook's answer (``engine.solution_answer``); the engine
   uses NCCL where every rank can have its own GPU;
3. notebooks 05 and 03 (FSDP2, tensor and pipeline parallel, DDP demos on GPU ranks);
4. the bf16 and fp16 AMP steps and the NVML monitor;
5. the grader on the reference solution, then the benchmarks;
6. the other notebooks: the solutions of labs 3, 5 and 7 (they launch ranks and torchrun), the other
   demos, the other solutions.

Each result goes to ``OUT/report.json``::

    {"device": "NVIDIA H100 80GB HBM3 x 1" | "cpu", "mode": "gpu" | "cpu", "profile": ...,
     "hardware": {...}, "finished": bool,
     "checks": [{"name", "status": "pass|fail|skip|not verified", "seconds", "detail"}]}

(rewritten atomically after every check, so a killed run keeps what it measured). Executed
notebooks go to ``OUT/notebooks/``, benchmark output to ``OUT/bench/``. ``skip`` is a check this
hardware cannot run, with the reason (NCCL without a GPU, bf16 before Ampere). ``not verified``
is a check that did not run to its end for want of time: the budget never started it or stopped
it, or its part was not run (see Parts).

**Exit status**: 1 when a check failed; else 3 when any check is not verified (0 with
``--accept-incomplete``); else 0. The last line counts passed, failed, skipped and not verified,
and names the checks not verified. ``--merge`` exits 2 when the part reports cannot be merged.

**Parts**: the whole list takes longer than one 10-minute session on one GPU (its estimates add
up to about 14 minutes in the smoke profile on one H100). ``--part K/N`` runs the K-th of N contiguous slices of the
ordered list, cut where the slices' estimated seconds (``Check.estimate_s``: one H100's figures,
per profile for the notebooks) are most even (``partition``: the largest slice as small as can be;
the same list and profile always give the same cuts), and writes ``OUT/report-part-K-of-N.json``
(with the plan: every part's check names). ``--plan N`` prints the parts, their estimates, and the
fewest parts that each fill at most ``PART_FILL`` of the budget. ``--merge [OUT]`` merges the part
reports in OUT into ``OUT/report.json`` (every check once, in order, with its part): a part with
no report, and each check a killed part never reached, is ``not verified``. Parts of different
plans (another N, ``--only`` or profile) are refused, not mixed.

It fits one session at a time:

* **Time budget** (``--budget-s``, default 500 s, per run or part): a check is started only while
  at least ``MIN_START_S`` of the budget is left; long checks (subprocesses, launched ranks, each
  notebook cell) get timeouts from what is left, and one stopped by the budget is ``not
  verified`` ("stopped by the time budget"), one stopped by its own limit ``fail``.
* **Profile**: ``LAB_PROFILE`` when set; else ``gpu`` only with 2+ GPUs and the datasets on
  disk, else ``smoke`` (the smoke sizes, on the GPU when there is one). Benchmarks run with
  their quick arguments (``--full-bench`` for the full ones).
* **Notebooks**: every demo (``notebooks/``), and a solution notebook (``solutions/labN_*``)
  only where its code differs from its demo's (``notebooks/0N_*``): it has a code cell that,
  with comments, blank lines and surrounding whitespace dropped, is not also a code cell of the
  demo. Each runs in a kernel started by this interpreter (``write_kernelspec``; the kernelspec
  named ``python3`` can name another), with this process's environment and the profile.
* **Offline** (``--offline``, or detected: datasets missing and their host unreachable within
  2 s, name lookup included): the datasets check says which files are missing and where to put
  them, nothing waits on a download (children get an unreachable proxy, so a download fails at
  once), and checks that need the missing datasets skip with that reason.
* **Grader**: the reference solution is graded with a temporary copy of
  ``labs/assessment/spec_gpu.toml`` (a fresh secret ``heldout_seed``, ``nprocs = min(2, GPUs)``;
  skipped without a GPU or without CIFAR-10) or, on the CPU, ``spec_ci.toml``; it fails unless
  the grade's status is ``passed``.

It needs PyTorch, and nbclient + ipykernel for the notebooks: on a GPU server without Jupyter,
install the Jupyter wheels you fetched for it (see README, "Before class") into ``.site``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .files import atomic_write_json

try:
    import torch
except ImportError:  # GPU_PY (or python3) without PyTorch: say what to do, no traceback
    sys.exit(
        f"gpu-check: {sys.executable} has no PyTorch. Run `make gpu-check` (it makes .venv when "
        "python3 has no PyTorch), or point GPU_PY=/path/to/python at an interpreter that has it."
    )

ROOT = Path(__file__).resolve().parents[1]
NOT_VERIFIED = "not verified"  # the budget stopped it or never started it, or its part did not run
STATUSES = ("pass", "fail", "skip", NOT_VERIFIED)
EXIT_FAILED = 1  # a check failed
EXIT_NOT_VERIFIED = 3  # nothing failed, but something is not verified (0 with --accept-incomplete)
ANSI = re.compile(r"\x1b\[[0-9;]*m")


class Skip(Exception):
    """Raised by a check that cannot run on this hardware; the message is the reason."""


@dataclass
class CheckResult:
    name: str
    status: str  # pass | fail | skip | not verified
    seconds: float
    detail: str


UNMEASURED_PROFILE_FACTOR = 3.0  # a notebook's unmeasured profile: this times its smoke seconds


@dataclass
class Check:
    name: str
    fn: object  # fn(ctx) -> detail string; raises Skip or fails by raising
    what: str = ""
    # Seconds on one H100 (docs/gpu-runs/2026-11-26-h100.md), used only to cut the list into parts:
    # a number, or {profile: seconds} for a notebook (a profile not in it: UNMEASURED_PROFILE_FACTOR
    # times the smoke figure; the measured gpu/smoke ratios run from 1.4 to 7.4, median 2.5).
    estimate_s: float | Mapping[str, float] = 30.0

    def estimate(self, profile: str) -> float:
        e = self.estimate_s
        if not isinstance(e, Mapping):
            return float(e)
        return float(e[profile]) if profile in e else UNMEASURED_PROFILE_FACTOR * float(e["smoke"])


# ----------------------------------------------------------------------------------------
# Hardware
# ----------------------------------------------------------------------------------------


def hardware() -> dict:
    """utils.device.describe_hardware() plus NCCL's version and the CPU cores we may use."""
    from .device import describe_hardware

    info = describe_hardware()
    info["nccl"] = None
    if torch.cuda.is_available():
        try:
            v = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001 - a build without NCCL
            info["nccl"] = None
    try:
        info["usable_cores"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        info["usable_cores"] = os.cpu_count()
    info["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    return info


def device_label(info: dict) -> str:
    gpus = info.get("gpus") or []
    if not gpus:
        return "cpu"
    names = sorted({g["name"] for g in gpus})
    return ", ".join(f"{n} x {sum(g['name'] == n for g in gpus)}" for n in names)


def hardware_lines(info: dict) -> list[str]:
    lines = [
        f"torch {info['torch']}  CUDA {info['cuda'] or '-'}  cuDNN {info['cudnn'] or '-'}  "
        f"NCCL {info['nccl'] or '-'}  driver {info['driver'] or '-'}  python {info['python']}",
        f"CPU {info['cpu']}: {info['cpu_cores']} cores, {info['usable_cores']} usable by this process",
    ]
    for g in info.get("gpus") or []:
        lines.append(
            f"GPU {g['index']}: {g['name']}, compute capability {g['capability']}, "
            f"{g['memory_gib']} GiB, {g['multiprocessors']} SMs"
        )
    if not info.get("gpus"):
        lines.append("GPU: none visible (CUDA not available): CPU mode, notebooks in the smoke profile")
    return lines


# ----------------------------------------------------------------------------------------
# Running checks and writing the report
# ----------------------------------------------------------------------------------------


class Report:
    """The checks' results as they come, rewritten atomically to ``out/name`` after each one."""

    def __init__(self, out: Path, info: dict, mode: str, profile: str, name: str = "report.json"):
        self.out, self.info, self.mode, self.profile, self.name = Path(out), info, mode, profile, name
        self.results: list[CheckResult] = []
        self.extra: dict = {}  # profile_reason, offline, datasets_missing, budget_s, part, plan, finished
        self.out.mkdir(parents=True, exist_ok=True)

    def as_dict(self) -> dict:
        return {
            "device": device_label(self.info),
            "mode": self.mode,
            "profile": self.profile,
            **self.extra,
            "hardware": self.info,
            "checks": [asdict(r) for r in self.results],
        }

    def write(self) -> None:
        atomic_write_json(self.out / self.name, self.as_dict())

    @property
    def failed(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == "fail"]

    def run(self, check: Check, ctx: Context) -> CheckResult:
        t0 = time.perf_counter()
        left = ctx.remaining()
        if left < MIN_START_S:
            return self._record(
                check,
                NOT_VERIFIED,
                t0,
                f"not run: the time budget (--budget-s {ctx.budget_s:g}) is "
                f"spent, {ctx.budget_s - left:.0f} s elapsed ({left:.0f} s left, a check starts "
                f"with at least {MIN_START_S:g} s)",
            )
        print(f"[....] {check.name}", flush=True)
        try:
            detail, status = str(check.fn(ctx) or ""), "pass"
        except Skip as e:
            detail, status = str(e), "skip"
        except BaseException as e:  # noqa: BLE001 - a failing check is a result, not a crash
            if isinstance(e, KeyboardInterrupt):
                raise
            if _is_timeout(e) and ctx.remaining() < BUDGET_MARGIN_S + 1:
                return self._record(
                    check,
                    NOT_VERIFIED,
                    t0,
                    f"stopped by the time budget (--budget-s {ctx.budget_s:g}) "
                    f"after {time.perf_counter() - t0:.0f} s: {type(e).__name__}",
                )
            tb = traceback.format_exc().strip().splitlines()
            detail, status = f"{type(e).__name__}: {e}\n" + "\n".join(tb[-12:]), "fail"
            detail = ANSI.sub("", detail)  # a notebook's traceback comes coloured
        return self._record(check, status, t0, detail)

    def _record(self, check: Check, status: str, t0: float, detail: str) -> CheckResult:
        r = CheckResult(check.name, status, round(time.perf_counter() - t0, 2), detail)
        self.results.append(r)
        self.write()
        first = detail.strip().splitlines()[0] if detail.strip() else ""
        tag = "NVER" if status == NOT_VERIFIED else status.upper()
        print(f"[{tag:4s}] {check.name} ({r.seconds:.1f} s){': ' + first[:160] if first else ''}", flush=True)
        return r


def exit_code(statuses: Sequence[str], accept_incomplete: bool = False) -> int:
    """1 when a check failed; else 3 when one is not verified (0 with ``accept_incomplete``); else 0."""
    if "fail" in statuses:
        return EXIT_FAILED
    if NOT_VERIFIED in statuses and not accept_incomplete:
        return EXIT_NOT_VERIFIED
    return 0


MIN_START_S = 10.0  # a check starts only with this much of the budget left
BUDGET_MARGIN_S = 5.0  # a timeout derived from the budget ends this long before it


def _is_timeout(e: BaseException) -> bool:
    """A subprocess, launched ranks or a notebook cell stopped by its timeout."""
    names = {type(e).__name__ for e in (e, e.__cause__, e.__context__) if e is not None}
    return bool(names & {"TimeoutExpired", "LaunchTimeout", "CellTimeoutError", "TimeoutError", "BudgetSpent"})


class BudgetSpent(Exception):
    """Raised by a check that finds too little of the budget left to go on."""


def run_checks(
    checks: list[Check],
    out: str | os.PathLike,
    *,
    info: dict | None = None,
    mode: str | None = None,
    profile: str | None = None,
    ctx_extra: dict[str, Any] | None = None,
    budget_s: float | None = None,
    started: float | None = None,
    report_name: str = "report.json",
    report_extra: dict[str, Any] | None = None,
    accept_incomplete: bool = False,
) -> tuple[Report, int]:
    """Run ``checks`` (a list of :class:`Check`), write ``out/report_name``, return (report, exit code).
    ``budget_s``: seconds for all of them (None: no limit), counted from ``started`` (a
    ``time.perf_counter()`` value; default now); ``report_extra``: more top-level keys of the
    report (a part's number and plan); see the module's docstring for the exit code."""
    info = info if info is not None else hardware()
    mode = mode or ("gpu" if info.get("gpus") else "cpu")
    profile = profile or ("gpu" if mode == "gpu" else "smoke")
    report = Report(out, info, mode, profile, report_name)
    extra = dict(ctx_extra or {})
    report.extra = {k: extra.pop(k) for k in ("profile_reason", "offline", "datasets_missing") if k in extra}
    report.extra["budget_s"] = budget_s
    report.extra.update(report_extra or {})
    report.extra["finished"] = False
    ctx = Context(
        Path(out),
        mode,
        profile,
        info,
        budget_s=budget_s if budget_s is not None else float("inf"),
        t0=started if started is not None else time.perf_counter(),
        **{k: v for k, v in extra.items() if k in ("offline", "missing", "full_bench")},
    )
    report.write()
    for check in checks:
        report.run(check, ctx)
    report.extra["finished"] = True
    report.write()
    return report, exit_code([r.status for r in report.results], accept_incomplete)


@dataclass
class Context:
    out: Path
    mode: str  # "gpu" or "cpu"
    profile: str  # the notebooks' LAB_PROFILE
    info: dict
    budget_s: float = float("inf")  # seconds for the whole run
    offline: bool = False  # no network: nothing may wait on a download
    missing: tuple = ()  # datasets not on disk ("cifar10", "fashion_mnist")
    full_bench: bool = False  # the benchmarks' full arguments (else quick)
    t0: float = field(default_factory=time.perf_counter)

    def remaining(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def timeout(self, cap: float) -> float:
        """A long step's timeout: ``cap`` seconds, or what is left of the budget (less a margin)."""
        left = self.remaining() - BUDGET_MARGIN_S
        if left < 1:
            raise BudgetSpent(f"{self.remaining():.0f} s of the budget left")
        return min(cap, left)

    def deadline(self) -> float:
        """time.perf_counter() value at which the budget (less the margin) runs out."""
        return self.t0 + self.budget_s - BUDGET_MARGIN_S

    @property
    def n_gpus(self) -> int:
        return len(self.info.get("gpus") or [])

    def need_gpus(self, n: int = 1, what: str = "this check") -> None:
        if self.n_gpus < n:
            raise Skip(
                f"{what} needs {n} GPU(s); this machine shows {self.n_gpus}"
                + (" (CUDA not available)" if not torch.cuda.is_available() else "")
            )


# ----------------------------------------------------------------------------------------
# The checks
# ----------------------------------------------------------------------------------------

UNREACHABLE_PROXY = "http://127.0.0.1:9"  # the discard port: nothing listens, a connection is refused at once


def _env_for_children(profile: str, offline: bool = False) -> dict:
    """Environment of notebooks' kernels and subprocesses: the checkout (and .site, where the
    Jupyter wheels go on a server without Jupyter) importable, the profile set. Offline, every
    HTTP(S) request goes to a proxy that refuses it: a download fails at once, with no wait on
    connection timeouts (utils.data then says which file to place where)."""
    env = dict(os.environ)
    paths = [str(ROOT / ".site"), str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p and Path(p).exists()))
    env["LAB_PROFILE"] = profile
    env.setdefault("MPLBACKEND", "Agg")
    if offline:
        for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
            env[k] = UNREACHABLE_PROXY
        for k in ("no_proxy", "NO_PROXY"):
            env.pop(k, None)
    return env


def _normalised_code_cells(path: Path) -> list[str]:
    """The notebook's code cells, comments, blank lines and surrounding whitespace dropped."""
    import json as _json

    out = []
    for cell in _json.loads(path.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        lines = [re.sub(r"(^|\s)#.*$", "", line).strip() for line in "".join(cell["source"]).splitlines()]
        code = "\n".join(line for line in lines if line)
        if code:
            out.append(code)
    return out


def demo_of(solution: Path) -> Path | None:
    """The demo notebook a solution notebook goes with: solutions/labN_* -> notebooks/0N_*."""
    m = re.match(r"lab(\d+)_", solution.name)
    demos = sorted((solution.parents[1] / "notebooks").glob(f"{int(m.group(1)):02d}_*.ipynb")) if m else []
    return demos[0] if demos else None


def solution_differs(solution: Path) -> bool:
    """True when the solution has a code cell (normalised) that its demo does not have, or no demo."""
    demo = demo_of(solution)
    if demo is None:
        return True
    have = set(_normalised_code_cells(demo))
    return any(c not in have for c in _normalised_code_cells(solution))


def notebook_paths() -> list[Path]:
    """Every demo, then the solutions whose code differs from their demo's (see solution_differs)."""
    return sorted((ROOT / "notebooks").glob("*.ipynb")) + [
        p for p in sorted((ROOT / "solutions").glob("*.ipynb")) if solution_differs(p)
    ]


KERNEL_NAME = "gpucheck-python"  # a name no user kernelspec is expected to take; ours comes first anyway


def write_kernelspec(folder: Path) -> str:
    """Write the kernelspec ``KERNEL_NAME`` under ``folder/kernels``: ipykernel started by this very
    interpreter (``sys.executable``), so the notebooks run on the PyTorch and CUDA being checked.
    (The kernel named ``python3`` is whatever the user's or the system's kernelspec folders say,
    which may be another interpreter.) Returns ``folder``, to put first on ``JUPYTER_PATH``."""
    spec = Path(folder) / "kernels" / KERNEL_NAME
    spec.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "gpu-check", "language": "python"}))
    return str(folder)


def execute_notebook(
    src: Path, dest: Path, profile: str, timeout: float = 1200, *, deadline: float | None = None, offline: bool = False
) -> str:
    """Run ``src`` top to bottom in a fresh kernel (nbclient), save it with outputs at ``dest``.
    Raises on the first failing cell, after saving what ran. ``timeout``: seconds per cell;
    ``deadline``: a ``time.perf_counter()`` value no cell may run past (the budget)."""
    try:
        import nbclient
        import nbformat
    except ImportError as e:
        raise RuntimeError(
            f"cannot execute notebooks: {e}. On a server without Jupyter, install the wheels first: "
            "python3 -m pip install -q --no-index --no-deps --no-compile --target .site "
            "<the folder of Jupyter wheels>/*.whl (see README, 'Before class')"
        ) from None
    nb = nbformat.read(str(src), as_version=4)
    saved = dict(os.environ)
    specs = tempfile.mkdtemp(prefix="gpucheck-kernel-")
    env = _env_for_children(profile, offline)  # made from os.environ before it is cleared below
    env["JUPYTER_PATH"] = os.pathsep.join([write_kernelspec(Path(specs)), *filter(None, [env.get("JUPYTER_PATH")])])
    env.pop("MPLBACKEND", None)  # the inline backend: the saved notebook keeps its figures
    os.environ.clear()
    os.environ.update(env)  # the kernel manager finds KERNEL_NAME on JUPYTER_PATH; the kernel inherits all of it

    def cell_timeout(cell):
        left = timeout if deadline is None else deadline - time.perf_counter()
        return max(1, int(min(timeout, left)))

    client = nbclient.NotebookClient(
        nb,
        timeout=timeout,
        timeout_func=cell_timeout,
        kernel_name=KERNEL_NAME,
        resources={"metadata": {"path": str(src.parent)}},
        extra_arguments=["--IPKernelApp.log_level=ERROR"],
    )  # no TCP notice
    try:
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(saved)
        shutil.rmtree(specs, ignore_errors=True)
        dest.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, str(dest))
    stderr = sum(
        1
        for c in nb.cells
        for o in c.get("outputs", [])
        if o.get("output_type") == "stream" and o.get("name") == "stderr"
    )
    code = sum(c.cell_type == "code" for c in nb.cells)
    return f"{code} code cells ran in the {profile} profile; {stderr} stderr output(s); saved {dest}"


def _notebook_check(path: Path) -> Check:
    rel = path.relative_to(ROOT)

    def fn(ctx):
        dest = ctx.out / "notebooks" / f"{rel.parent.name}__{rel.name}"
        ctx.timeout(1200)  # BudgetSpent when too little is left
        if ctx.profile == "gpu" and ctx.missing and ctx.offline:
            raise Skip(
                f"the gpu profile needs {', '.join(ctx.missing)}, missing, and this machine is offline "
                "(see the datasets check); LAB_PROFILE=smoke runs the notebooks without them"
            )
        return execute_notebook(path, dest, ctx.profile, 1200, deadline=ctx.deadline(), offline=ctx.offline)

    stem = str(rel.with_suffix(""))
    estimate = NOTEBOOK_ESTIMATE_S.get(stem, {"smoke": 60.0})
    return Check(f"notebook {rel}", fn, "runs top to bottom (gpu profile on a GPU, smoke without)", estimate)


# Seconds per notebook on one H100 (2026-11-26): the smoke profile measured (01: 35 s estimated, 1.8x
# its H100 figure, the ratio its tuned steps-to-target sweep costs on a CPU); gpu measured on the
# stand-in datasets where given (04: 124 s and more, 150 taken), else Check.estimate's guess.
NOTEBOOK_ESTIMATE_S: dict[str, dict[str, float]] = {
    "notebooks/00_environment": {"smoke": 13},
    "notebooks/01_gd_vs_sgd": {"smoke": 35},
    "notebooks/02_cpu_vs_gpu": {"smoke": 34, "gpu": 253},
    "notebooks/03_ddp": {"smoke": 70, "gpu": 176},
    "notebooks/04_large_batch": {"smoke": 22, "gpu": 150},
    "notebooks/05_memory_and_model_parallel": {"smoke": 73, "gpu": 101},
    "notebooks/06_clusters_and_profiling": {"smoke": 56, "gpu": 121},
    "solutions/lab0_example": {"smoke": 5},
    "solutions/lab1_gd_sgd_batch": {"smoke": 17},
    "solutions/lab2_throughput": {"smoke": 17},
    "solutions/lab3_ddp": {"smoke": 55},
    "solutions/lab4_large_batch": {"smoke": 17},
    "solutions/lab5_memory_and_model_parallel": {"smoke": 24},
    "solutions/lab6_profiling": {"smoke": 20},
}


def _run(cmd, ctx, timeout, log: Path) -> str:
    """Run ``cmd``; its timeout is ``timeout`` or what is left of the budget, whichever is less."""
    log.parent.mkdir(parents=True, exist_ok=True)
    p = subprocess.run(
        cmd,
        cwd=ROOT,
        env=_env_for_children(ctx.profile, ctx.offline),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=ctx.timeout(timeout),
    )
    log.write_text(p.stdout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} exited with {p.returncode}:\n{p.stdout[-2000:]}")
    return p.stdout


# Each benchmark's arguments: quick (it proves the script runs and gives a first figure, within
# the budget), or full (--full-bench: the figures to quote, minutes each on a GPU).
BENCH_ARGS = {
    "throughput": {"quick": ["--quick"], "full": []},
    "train_loop_overhead": {"quick": ["--steps", "10", "--repeats", "3"], "full": ["--steps", "10", "--repeats", "3"]},
    "optimizer_step": {"quick": ["--repeats", "3", "--min-round-s", "0.05"], "full": ["--repeats", "11"]},
}


def _bench_args(name, ctx) -> list[str]:
    return BENCH_ARGS[name]["full" if ctx.full_bench else "quick"]


def check_bench_throughput(ctx: Context) -> str:
    out = ctx.out / "bench" / "throughput.json"
    text = _run(
        [sys.executable, "benchmarks/throughput.py", *_bench_args("throughput", ctx), "--out", str(out)],
        ctx,
        600,
        ctx.out / "bench" / "throughput.txt",
    )
    res = json.loads(out.read_text())
    if not res.get("rows"):
        raise RuntimeError(f"{out} holds no rows")
    last = [line for line in text.strip().splitlines() if line.startswith("speedup")]
    return f"{len(res['rows'])} rows in {out}; {last[-1] if last else ''}"


def check_bench_loop(ctx: Context) -> str:
    text = _run(
        [sys.executable, "benchmarks/train_loop_overhead.py", *_bench_args("train_loop_overhead", ctx)],
        ctx,
        600,
        ctx.out / "bench" / "train_loop_overhead.txt",
    )
    return text.strip().splitlines()[-1] if text.strip() else ""


def check_bench_optimizer(ctx: Context) -> str:
    text = _run(
        [sys.executable, "benchmarks/optimizer_step.py", *_bench_args("optimizer_step", ctx)],
        ctx,
        600,
        ctx.out / "bench" / "optimizer_step.txt",
    )
    return text.strip().splitlines()[-1] if text.strip() else ""


DDP_BATCH = 16  # images per rank and step in the DDP checks
DDP_VAL = 128  # validation images of the DDP checks


def _ddp_cfg(**kw):
    cfg = dict(n_train=512, n_val=DDP_VAL, batch_size=DDP_BATCH, epochs=3, width=16, lr=0.05, evaluate=True)
    cfg.update(kw)
    return cfg


def ddp_nccl_sizes(n_ranks: int, dataset: str = "digits") -> tuple[int, int]:
    """(n_train, n_val) of the "ddp nccl on all GPUs" run on ``n_ranks`` GPUs: 16 batches of 16 per
    rank, capped so that training and validation images fit the dataset, and a multiple of
    ``n_ranks x 16`` so that every rank gets the same whole batches (at least one)."""
    from .data import DATASET_SIZES

    n_tr, n_va = DATASET_SIZES[dataset]
    room = n_tr - DDP_VAL if n_va is None else n_tr  # one pool (digits): validation comes out of it
    step = n_ranks * DDP_BATCH
    n_train = min(16 * step, room // step * step)
    if n_train < step:
        raise ValueError(f"{dataset} has too few images for {n_ranks} ranks of {DDP_BATCH}")
    return n_train, DDP_VAL


def _same_replicas(res) -> bool:
    states = [r["state"] for r in res]
    return all(torch.equal(s[k], states[0][k]) for s in states for k in s)


def check_ddp_nccl(ctx: Context) -> str:
    from . import ddp_train, parallel

    ctx.need_gpus(1, "DDP with NCCL")
    if not torch.distributed.is_nccl_available():
        raise Skip("this PyTorch build has no NCCL")
    n = ctx.n_gpus
    n_train, n_val = ddp_nccl_sizes(n)
    res = parallel.launch(
        ddp_train.train,
        n,
        _ddp_cfg(n_train=n_train, n_val=n_val),
        backend="nccl",
        timeout=ctx.timeout(300),
        stream=False,
    )
    if not all(r["backend"] == "nccl" for r in res) or not _same_replicas(res):
        raise RuntimeError(f"backends {[r['backend'] for r in res]}, replicas identical: {_same_replicas(res)}")
    devs = sorted(r["device"] for r in res)
    if len(set(devs)) != n:
        raise RuntimeError(f"NCCL ranks must each own a GPU, got devices {devs}")
    return f"{n} rank(s) on {devs}, replicas identical, val acc {res[0]['history']['epochs'][-1]['val_acc']:.3f}"


def check_ddp_gloo_shared_gpu(ctx: Context) -> str:
    from . import ddp_train, parallel

    ctx.need_gpus(1, "gloo ranks sharing one GPU")
    res = parallel.launch(
        ddp_train.train, 2, _ddp_cfg(device="cuda:0"), backend="gloo", timeout=ctx.timeout(300), stream=False
    )
    devs = [r["device"] for r in res]
    if devs != ["cuda:0", "cuda:0"] or not _same_replicas(res):
        raise RuntimeError(f"devices {devs}, replicas identical: {_same_replicas(res)}")
    return "2 gloo ranks on cuda:0, replicas identical"


def check_ddp_gloo_cpu(ctx: Context) -> str:
    from . import ddp_train, parallel

    res = parallel.launch(
        ddp_train.train, 2, _ddp_cfg(device="cpu"), backend="gloo", timeout=ctx.timeout(300), stream=False
    )
    if not _same_replicas(res):
        raise RuntimeError("the two replicas differ after training")
    losses = [e["train_loss"] for e in res[0]["history"]["epochs"]]
    if not losses[-1] < losses[0]:
        raise RuntimeError(f"the training loss did not go down: {losses}")
    return (
        f"2 gloo ranks on the CPU, replicas identical, training loss {losses[0]:.3f} -> {losses[-1]:.3f} "
        f"over {res[0]['history']['steps']} steps (a short run: it shows DDP trains, not how well)"
    )


def rank_exercises() -> list:
    """Every lab exercise that runs on spawned ranks (``Exercise.ranks`` set), in the labs' order."""
    from . import checks  # noqa: F401 - importing the package registers every lab's exercises
    from .checks import engine

    return [ex for ex in engine.REGISTRY.values() if ex.ranks and ex.module.startswith("utils.checks.")]


def check_lab_exercises_on_ranks(ctx: Context) -> str:
    """The labs' rank-run self-checks (lab 3's ring, gradient averaging, overlapped DDP and its trace;
    lab 5's ZeRO-2) on the solution notebooks' answers, through the check the lab calls. The
    engine picks NCCL when every rank can have its own GPU, else gloo."""
    import contextlib
    import functools
    import io

    from . import checks, parallel
    from .checks import engine

    done = []
    for ex in rank_exercises():
        ctx.timeout(1)  # BudgetSpent when too little is left to start another launch
        fn = getattr(checks, f"check_{ex.name}", None) or functools.partial(engine.check, ex)
        answer = engine.solution_answer(ex)
        with contextlib.redirect_stdout(io.StringIO()):
            fn(*answer)
        lab = importlib.import_module(ex.module).LAB
        done.append(f"{ex.name} ({lab}, {ex.ranks} ranks, {parallel.choose_backend(ex.ranks)})")
    if not done:
        raise RuntimeError("no lab exercise runs on ranks: utils.checks registered none")
    return f"{len(done)} solutions pass their rank-run checks: " + ", ".join(done)


def ring_worker(sizes: list[int]) -> dict[str, Any]:
    """A rank: the hand ring against torch's all_reduce, on this rank's device."""
    from . import parallel

    ctx = parallel.setup()
    out = []
    for n in sizes:
        g = torch.Generator().manual_seed(1000 * ctx.rank + n)
        x = torch.randn(n, generator=g).to(ctx.device)
        ref = x.clone()
        torch.distributed.all_reduce(ref)
        parallel.ring_all_reduce(x)
        out.append((x - ref).abs().max().item() / max(ref.abs().max().item(), 1e-12))
    return {"backend": ctx.backend, "device": str(ctx.device), "rel_err": out}


def check_ring(ctx: Context) -> str:
    from utils import parallel
    from utils.gpucheck import ring_worker  # by its module name, also when this runs as __main__

    sizes = [1, 7, 1000, 1 << 20]
    if ctx.n_gpus >= 2 and torch.distributed.is_nccl_available():
        n, backend = ctx.n_gpus, "nccl"
    else:
        n, backend = 3, "gloo"
    res = parallel.launch(ring_worker, n, sizes, backend=backend, timeout=ctx.timeout(300), stream=False)
    worst = max(max(r["rel_err"]) for r in res)
    if worst > 1e-5:
        raise RuntimeError(f"ring differs from all_reduce by {worst:.2e} (relative)")
    note = "" if backend == "nccl" else f" (NCCL needs 2+ GPUs; {ctx.n_gpus} here)"
    return f"{n} ranks, {backend}{note}, sizes {sizes}: max relative difference {worst:.1e}"


def check_resume(ctx: Context) -> str:
    """Crash mid-run, resume from the checkpoint, compare with the uninterrupted run, bit for bit
    (utils.ddp_train sets cuDNN/cuBLAS to deterministic; utils.device.set_deterministic)."""
    from . import ddp_train

    saved = {
        k: os.environ.pop(k)
        for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
        if k in os.environ
    }
    dev = "cuda" if ctx.n_gpus else "cpu"
    cfg = dict(n_train=256, n_val=64, batch_size=32, epochs=3, width=16, evaluate=False, device=dev)
    try:
        full = ddp_train.train(cfg)["state"]
        with tempfile.TemporaryDirectory() as d:
            ck = os.path.join(d, "run.pt")
            try:
                ddp_train.train(cfg, ckpt=ck, fail_at_step=13, fail_rank=0, fail_mode="raise")
            except RuntimeError as e:
                if "injected failure" not in str(e):
                    raise
            res = ddp_train.train(cfg, ckpt=ck)
    finally:
        os.environ.update(saved)
    diff = [k for k in full if not torch.equal(full[k], res["state"][k])]
    if diff:
        worst = max((full[k].float() - res["state"][k].float()).abs().max().item() for k in diff)
        raise RuntimeError(f"resumed weights differ from the uninterrupted run in {diff} (max {worst:.2e})")
    return f"on {res['device']}: resumed at epoch {res['start_epoch']}, weights bit-identical to the uninterrupted run"


def _amp_fit(dev, amp_dtype):
    from . import data, models
    from .train import fit

    torch.manual_seed(0)
    ds = data.synthetic(256, shape=(3, 32, 32))
    net = models.Net(32)
    h = fit(
        net,
        data.make_loader(ds, 64, device=dev),
        torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
        epochs=2,
        device=dev,
        amp_dtype=amp_dtype,
        progress=False,
    )
    losses = h.step_loss
    if not all(map(lambda v: v == v and abs(v) < 1e4, losses)):
        raise RuntimeError(f"non-finite losses under {amp_dtype}: {losses}")
    return h


def check_amp_bf16(ctx: Context) -> str:
    from .device import bf16_supported

    dev = torch.device("cuda", 0) if ctx.n_gpus else torch.device("cpu")
    if not bf16_supported(dev):
        cap = ctx.info["gpus"][0]["capability"]
        raise Skip(
            f"{ctx.info['gpus'][0]['name']} (compute capability {cap}) has no native bf16 "
            "(Ampere, 8.0, and newer do); notebook 02 leaves bf16 out there"
        )
    h = _amp_fit(dev, torch.bfloat16)
    return f"bf16 autocast on {dev}: {h.steps} steps, loss {h.step_loss[0]:.3f} -> {h.step_loss[-1]:.3f}"


def check_amp_fp16(ctx: Context) -> str:
    from . import bench, models

    ctx.need_gpus(1, "fp16 with GradScaler")
    dev = torch.device("cuda", 0)
    h = _amp_fit(dev, torch.float16)
    costs = bench.amp_step_costs(models.Net(128), 256, device=dev, steps=10, repeats=5)
    atomic_write_json(ctx.out / "amp_costs.json", costs)
    parts = [f"{k}: {v['syncs_per_step']:.1f} syncs/step, {v['step_s'] * 1e3:.2f} ms/step" for k, v in costs.items()]
    if costs["fp16 + GradScaler"]["syncs_per_step"] < 1:
        raise RuntimeError("expected GradScaler.step to synchronise every step; " + "; ".join(parts))
    return f"fp16 + GradScaler on {dev}: {h.steps} steps, finite losses; " + "; ".join(parts)


def check_monitor(ctx: Context) -> str:
    from . import monitor

    ctx.need_gpus(1, "GPU monitoring")
    dev = torch.device("cuda", 0)
    x = torch.randn(4096, 4096, device=dev)
    with monitor.GPUMonitor(interval=0.05, gpus=[0]) as mon:
        t_end = time.perf_counter() + 1.5
        while time.perf_counter() < t_end:
            x = (x @ x).clamp_(-1, 1)
        torch.cuda.synchronize(dev)
    res = mon.result
    if not res.available:
        raise RuntimeError(f"the monitor could not sample the GPU: {res.reason}")
    if not res.samples:
        raise RuntimeError("the monitor started but took no samples")
    mem = [s["mem_used_mib"] for s in res.samples if s["mem_used_mib"] is not None]
    if not mem:
        raise RuntimeError("no memory readings from NVML")
    return res.summary() + f"; mapping {res.devices}"


GRADER_NPROCS = 2  # ranks of the GPU grading check: min(2, GPUs)


def grader_spec_text(text: str, n_gpus: int, seed: int) -> str:
    """spec_gpu.toml with a fresh secret ``heldout_seed`` (the grader refuses the public 0) and
    ``nprocs = min(2, GPUs)`` (it refuses more ranks than GPUs)."""
    nprocs = min(GRADER_NPROCS, n_gpus)
    text, n_seed = re.subn(r"(?m)^heldout_seed\s*=\s*\d+", f"heldout_seed = {seed}", text)
    text, n_procs = re.subn(r"(?m)^nprocs\s*=\s*\d+", f"nprocs = {nprocs}", text)
    if n_seed != 1 or n_procs != 1:
        raise RuntimeError("spec_gpu.toml must have one `heldout_seed = N` and one `nprocs = N` line")
    return text


def check_grader(ctx: Context) -> str:
    import secrets

    out = ctx.out / "grader.json"
    if ctx.mode == "gpu":
        if ctx.n_gpus < 1:
            raise Skip("grading on the GPU needs at least 1 GPU")
        if "cifar10" in ctx.missing:
            raise Skip(
                "spec_gpu.toml grades on CIFAR-10, which is not on disk"
                + (" and this machine is offline" if ctx.offline else "")
                + " (see the datasets check)"
            )
        tmp = Path(tempfile.mkdtemp(prefix="gpucheck-spec-"))  # the secret seed stays out of OUT
        spec = tmp / "spec_gpu_check.toml"
        spec.write_text(
            grader_spec_text(
                (ROOT / "labs" / "assessment" / "spec_gpu.toml").read_text(), ctx.n_gpus, secrets.randbits(62) or 1
            )
        )
        spec.chmod(0o600)
        label = f"a temporary copy of spec_gpu.toml (fresh secret seed, nprocs {min(GRADER_NPROCS, ctx.n_gpus)})"
    else:
        spec, tmp = ROOT / "labs" / "assessment" / "spec_ci.toml", None
        label = spec.name
    try:
        _run(
            [
                sys.executable,
                "-m",
                "utils.grader",
                "run",
                "solutions/assessment/assessment.py",
                "--spec",
                str(spec),
                "--json",
                str(out),
            ],
            ctx,
            900,
            ctx.out / "grader.txt",
        )
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    rep = json.loads(out.read_text())
    keys = [
        k for k in ("status", "accuracy", "target_val_acc", "time_s", "time_budget_s", "ranks_measured") if k in rep
    ]
    summary = f"reference solution graded with {label}: " + ", ".join(f"{k}={rep[k]}" for k in keys)
    if rep.get("status") != "passed":
        reasons = rep.get("reason") or "; ".join(map(str, rep.get("reasons") or []))
        raise RuntimeError(f"the reference solution must pass, got {summary}; {reasons}"[:3000])
    return summary


def missing_datasets() -> list[str]:
    """The downloadable datasets not on disk (checked without downloading, in milliseconds)."""
    from . import data

    missing = []
    for name, loader in (("cifar10", data.load_cifar10), ("fashion_mnist", data.load_fashion_mnist)):
        try:
            loader(n_train=16, n_val=16, download=False)
        except data.DatasetUnavailable:
            missing.append(name)
    return missing


def network_reachable(host: str = "www.cs.toronto.edu", port: int = 443, timeout: float = 2.0) -> bool:
    """Can this machine open a connection to the datasets' host within ``timeout`` seconds, name
    lookup included? ``create_connection``'s timeout does not cover the DNS lookup, which can hang
    for many seconds without a network; so the probe runs in a daemon thread, waited for
    ``timeout`` seconds, and one still running then is left behind (it holds no lock)."""
    import socket
    import threading

    result: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                result.append(True)
        except OSError:
            result.append(False)

    t = threading.Thread(target=probe, name="gpucheck-network-probe", daemon=True)
    t.start()
    t.join(timeout)
    return bool(result and result[0])


def check_datasets(ctx: Context) -> str:
    from . import data

    data.load("digits", 64, 32)
    if not ctx.missing:
        return f"digits (bundled), cifar10 and fashion_mnist present in {data.data_dir()}"
    where = "\n".join(
        f"{name}: put {', '.join(f.name for f in files)} in {data.data_dir() / name}/"
        for name, files in (("cifar10", data.CIFAR10_FILES), ("fashion_mnist", data.FASHION_MNIST_FILES))
        if name in ctx.missing
    )
    msg = (
        f"{', '.join(ctx.missing)} not on disk{' and this machine is offline' if ctx.offline else ''}; the "
        f"notebooks run in the {ctx.profile} profile. For the gpu profile:\n{where}\n(or set DATA_DIR; online, "
        "python -c 'from utils import data; data.load_cifar10(); data.load_fashion_mnist()' downloads them)"
    )
    if ctx.profile == "gpu":
        raise RuntimeError("the gpu-profile notebooks need these datasets: " + msg)
    raise Skip(msg)


def choose_profile(n_gpus: int, missing: Sequence[str], env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(profile, why): LAB_PROFILE when set; gpu with 2+ GPUs and the datasets; else smoke."""
    env = os.environ if env is None else env
    if env.get("LAB_PROFILE", "").strip():
        return env["LAB_PROFILE"].strip().lower(), "LAB_PROFILE is set"
    if n_gpus == 0:
        return "smoke", "no GPU"
    if missing:
        return "smoke", f"smoke sizes on the GPU: {', '.join(missing)} not on disk"
    if n_gpus < 2:
        return "smoke", (
            "smoke sizes on the GPU: one GPU (the gpu profile's multi-rank runs and every notebook "
            "take 40+ minutes there; LAB_PROFILE=gpu runs them)"
        )
    return "gpu", f"{n_gpus} GPUs and the datasets on disk"


# Notebooks that run right after the multi-rank checks (FSDP2, tensor and pipeline parallel, DDP on
# GPU ranks), and the solutions that lead the remaining notebooks (they launch ranks and torchrun).
RANK_NOTEBOOKS = ("notebooks/05_", "notebooks/03_")
RANK_SOLUTIONS = ("solutions/lab3_", "solutions/lab5_", "solutions/lab7_")


def ordered_notebooks(paths: Sequence[Path]) -> tuple[list[Path], list[Path]]:
    """(the rank notebooks, in RANK_NOTEBOOKS' order; the rest: RANK_SOLUTIONS' solutions, then the
    demos, then the other solutions, each in file order)."""
    rel = {p: str(p.relative_to(ROOT)) for p in paths}
    first = [p for pre in RANK_NOTEBOOKS for p in paths if rel[p].startswith(pre)]
    lead = [p for pre in RANK_SOLUTIONS for p in paths if rel[p].startswith(pre)]
    demos = [p for p in paths if p not in first + lead and rel[p].startswith("notebooks/")]
    rest = [p for p in paths if p not in first + lead + demos]
    return first, lead + demos + rest


def all_checks() -> list[Check]:
    """Every check, riskiest first: each multi-rank path, the labs' rank-run exercises, notebooks 05
    and 03, AMP and the monitor, the grader and the benchmarks, then the other notebooks. Estimates
    are one H100's seconds (docs/gpu-runs/2026-11-26-h100.md); the lab exercises and the grader on
    spec_gpu.toml were not measured there (the grader skipped without CIFAR-10): theirs are guesses."""
    first, rest = ordered_notebooks(notebook_paths())
    return [
        Check("datasets", check_datasets, "the datasets the notebooks' profile needs", 1),
        Check("ring all-reduce vs all_reduce", check_ring, "the hand ring (batched P2P) equals all_reduce", 13),
        Check("ddp nccl on all GPUs", check_ddp_nccl, "one rank per visible GPU, NCCL", 13),
        Check("ddp gloo ranks sharing one GPU", check_ddp_gloo_shared_gpu, "2 gloo ranks on cuda:0", 15),
        Check("ddp gloo on cpu", check_ddp_gloo_cpu, "2 gloo ranks on the CPU", 12),
        Check("resume bit-identical", check_resume, "crash, resume from checkpoint, same weights bit for bit", 5),
        Check(
            "lab exercises on ranks",
            check_lab_exercises_on_ranks,
            "labs 3, 5 and 7: every rank-run self-check passes the solution's answer",
            120,  # a guess: 10 launches of 2 or 3 ranks, each about the ring's 13 s; 200 s on 2 busy CPU cores
        ),
        *[_notebook_check(p) for p in first],
        Check("amp bf16 step", check_amp_bf16, "bf16 autocast trains (native bf16 only)", 2),
        Check("amp fp16 step", check_amp_fp16, "fp16 + GradScaler trains; its syncs counted and timed", 2),
        Check("monitor samples the GPU", check_monitor, "NVML through CUDA_VISIBLE_DEVICES", 3),
        Check("grader on the reference solution", check_grader, "python -m utils.grader run; must pass", 150),
        Check("bench throughput", check_bench_throughput, "benchmarks/throughput.py, JSON kept", 24),
        Check("bench train loop overhead", check_bench_loop, "benchmarks/train_loop_overhead.py", 48),
        Check("bench optimizer step", check_bench_optimizer, "benchmarks/optimizer_step.py", 13),
        *[_notebook_check(p) for p in rest],
    ]


def select(checks: list[Check], only: str | None) -> list[Check]:
    if not only:
        return checks
    words = [w.strip().lower() for w in only.split(",") if w.strip()]
    chosen = [c for c in checks if any(w in c.name.lower() for w in words)]
    if not chosen:
        raise SystemExit(f"--only {only!r} matches no check; see --list")
    return chosen


DEFAULT_BUDGET_S = 500.0  # under 9 minutes: one 10-minute session holds it with the start-up
PART_FILL = 0.8  # --plan proposes the fewest parts whose estimates fill at most this much of the budget

# ----------------------------------------------------------------------------------------
# Parts: the ordered list cut into n contiguous slices, run one per session, merged at the end
# ----------------------------------------------------------------------------------------


def partition(estimates: Sequence[float], n: int) -> list[int]:
    """Where to cut ``estimates`` into ``n`` contiguous, non-empty slices: the largest slice's sum as
    small as can be, then the sum of the slices' squared sums (the others even too), ties to the
    earliest cuts. Returns the n + 1 boundaries ``[0, ..., len(estimates)]``; the same estimates
    always give the same cuts."""
    m = len(estimates)
    if not 1 <= n <= m:
        raise ValueError(f"cannot cut {m} checks into {n} non-empty parts")
    pre = [0.0]
    for e in estimates:
        pre.append(pre[-1] + float(e))
    best: list[list[tuple[float, float] | None]] = [[None] * (m + 1) for _ in range(n + 1)]
    back = [[0] * (m + 1) for _ in range(n + 1)]
    best[0][0] = (0.0, 0.0)
    for j in range(1, n + 1):
        for i in range(j, m - (n - j) + 1):
            for t in range(j - 1, i):
                prev = best[j - 1][t]
                if prev is None:
                    continue
                seg = pre[i] - pre[t]
                cand = (max(prev[0], seg), prev[1] + seg * seg)
                if best[j][i] is None or cand < best[j][i]:
                    best[j][i], back[j][i] = cand, t
    cuts, i = [m], m
    for j in range(n, 0, -1):
        i = back[j][i]
        cuts.append(i)
    return cuts[::-1]


def plan_parts(checks: Sequence[Check], n: int, profile: str) -> list[list[Check]]:
    """The ordered checks cut into ``n`` parts of roughly even estimated seconds (``partition``)."""
    cuts = partition([c.estimate(profile) for c in checks], n)
    return [list(checks[a:b]) for a, b in zip(cuts, cuts[1:])]


def parts_needed(checks: Sequence[Check], profile: str, budget_s: float) -> int:
    """The fewest parts whose estimates each fill at most PART_FILL of ``budget_s`` (or one per check)."""
    for n in range(1, len(checks) + 1):
        if max(sum(c.estimate(profile) for c in p) for p in plan_parts(checks, n, profile)) <= PART_FILL * budget_s:
            return n
    return len(checks)


def parse_part(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise argparse.ArgumentTypeError(f"{text!r}: write K/N with 1 <= K <= N, e.g. 1/3")
    return int(m.group(1)), int(m.group(2))


def part_report_name(k: int, n: int) -> str:
    return f"report-part-{k}-of-{n}.json"


PART_REPORT = re.compile(r"report-part-(\d+)-of-(\d+)\.json")


class MergeError(Exception):
    """The part reports in OUT cannot be merged; the message says why and what to do."""


def merge_parts(out: str | os.PathLike) -> dict:
    """Merge ``out/report-part-K-of-N.json`` into one report (written to ``out/report.json``, returned):
    every planned check once, in plan order, with its part; a part with no report, and the checks a
    killed part never reached, are ``not verified``."""
    out = Path(out)
    files = {}
    for f in sorted(out.glob("report-part-*-of-*.json")):
        m = PART_REPORT.fullmatch(f.name)
        if m:
            files[int(m.group(1)), int(m.group(2))] = f
    if not files:
        raise MergeError(f"{out} holds no report-part-K-of-N.json: run python -m utils.gpucheck --part K/N first")
    ns = sorted({n for _, n in files})
    if len(ns) > 1:
        raise MergeError(
            f"{out} holds parts of plans into {' and '.join(map(str, ns))} parts: delete the stale "
            "report-part-*.json files (or use a fresh --out) and keep one plan"
        )
    n = ns[0]
    reports = {k: json.loads(f.read_text()) for (k, _), f in sorted(files.items())}
    plans = {json.dumps(r.get("plan")) for r in reports.values()}
    if len(plans) != 1 or any(not isinstance(r.get("plan"), list) or len(r["plan"]) != n for r in reports.values()):
        raise MergeError(
            f"the part reports in {out} were cut from different lists of checks (another --only, another "
            "profile, or another version of the checks): run every part with the same options"
        )
    plan = next(iter(reports.values()))["plan"]
    checks, parts = [], []
    for k in range(1, n + 1):
        name, rep = part_report_name(k, n), reports.get(k)
        if rep is None:
            parts.append({"part": k, "file": name, "ran": False, "checks": len(plan[k - 1])})
            checks += [
                {
                    "name": c,
                    "status": NOT_VERIFIED,
                    "seconds": 0.0,
                    "detail": f"part {k}/{n} was not run (no {name} in {out}): "
                    f"python -m utils.gpucheck --part {k}/{n} runs it",
                    "part": k,
                }
                for c in plan[k - 1]
            ]
            continue
        got = {c["name"]: c for c in rep["checks"]}
        parts.append(
            {
                "part": k,
                "file": name,
                "ran": True,
                "finished": bool(rep.get("finished")),
                "device": rep.get("device"),
                "profile": rep.get("profile"),
                "checks": len(plan[k - 1]),
                "seconds": round(sum(c["seconds"] for c in rep["checks"]), 2),
            }
        )
        for c in plan[k - 1]:
            checks.append(
                {**got[c], "part": k}
                if c in got
                else {
                    "name": c,
                    "status": NOT_VERIFIED,
                    "seconds": 0.0,
                    "detail": f"part {k}/{n} stopped before this check ran ({name} ends after "
                    f"{len(rep['checks'])} of its {len(plan[k - 1])} checks)",
                    "part": k,
                }
            )
    ran = list(reports.values())
    merged = {
        "device": " | ".join(dict.fromkeys(r["device"] for r in ran)),
        "mode": " | ".join(dict.fromkeys(r["mode"] for r in ran)),
        "profile": " | ".join(dict.fromkeys(r["profile"] for r in ran)),
        "merged_from": f"{len(reports)} of {n} parts",
        "parts": parts,
        "hardware": ran[0].get("hardware"),
        "checks": checks,
    }
    atomic_write_json(out / "report.json", merged)
    return merged


def print_summary(results: Sequence[Mapping[str, Any]], head: str, report: Path, accept: bool) -> int:
    """The final lines: counts by status, each failure's detail, the checks not verified; returns
    the exit code (``exit_code``)."""
    counts = {st: sum(r["status"] == st for r in results) for st in STATUSES}
    print(
        f"== {counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped, "
        f"{counts[NOT_VERIFIED]} not verified {head}; report: {report} ==",
        flush=True,
    )
    for r in results:
        if r["status"] == "fail":
            print(f"FAILED {r['name']}:\n  " + r["detail"].replace("\n", "\n  ")[:3000], flush=True)
    not_verified = [r["name"] for r in results if r["status"] == NOT_VERIFIED]
    code = exit_code([r["status"] for r in results], accept)
    if not_verified:
        verdict = (
            "accepted (--accept-incomplete)" if accept else f"exit status {EXIT_NOT_VERIFIED} unless a check failed"
        )
        print(f"NOT VERIFIED ({verdict}): " + "; ".join(not_verified), flush=True)
    return code


def print_plan(checks: Sequence[Check], n: int, profile: str, budget_s: float) -> None:
    parts = plan_parts(checks, n, profile)
    for k, part in enumerate(parts, 1):
        total = sum(c.estimate(profile) for c in part)
        over = f", over {PART_FILL:.0%} of the budget" if total > PART_FILL * budget_s else ""
        print(f"part {k}/{n}: about {total:.0f} s ({len(part)} checks{over}): python -m utils.gpucheck --part {k}/{n}")
        for c in part:
            print(f"    {c.name:<56} ~{c.estimate(profile):.0f} s")
    need = parts_needed(checks, profile, budget_s)
    print(
        f"(estimates: one H100, {profile} profile; the fewest parts that each fill at most {PART_FILL:.0%} of "
        f"--budget-s {budget_s:g}: {need}; then python -m utils.gpucheck --merge)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m utils.gpucheck", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("gpu-check"), help="folder for report.json, notebooks, logs")
    ap.add_argument("--only", help="comma-separated words: run only the checks whose names contain one")
    ap.add_argument("--list", action="store_true", help="list the checks, in the order they run, and exit")
    ap.add_argument(
        "--part",
        type=parse_part,
        metavar="K/N",
        help="run the K-th of N parts of the ordered checks (cut by estimated seconds); writes "
        "OUT/report-part-K-of-N.json",
    )
    ap.add_argument("--plan", type=int, metavar="N", help="print which checks go in each of N parts, and exit")
    ap.add_argument(
        "--merge",
        nargs="?",
        const="",
        metavar="OUT",
        help="merge the part reports in OUT (default: --out) into OUT/report.json, print the summary, exit",
    )
    ap.add_argument(
        "--accept-incomplete",
        action="store_true",
        help=f"exit 0 even when checks are not verified (default: exit {EXIT_NOT_VERIFIED})",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=DEFAULT_BUDGET_S,
        help=f"seconds for the whole run or part (default {DEFAULT_BUDGET_S:g}); what is left then is not verified",
    )
    ap.add_argument(
        "--offline",
        action="store_true",
        help="no network: never wait on a download (detected when the datasets are missing)",
    )
    ap.add_argument("--full-bench", action="store_true", help="the benchmarks' full arguments (minutes each)")
    args = ap.parse_args(argv)
    if args.merge is not None:
        out = Path(args.merge) if args.merge else args.out
        try:
            merged = merge_parts(out)
        except MergeError as e:
            print(f"gpu-check --merge: {e}", file=sys.stderr, flush=True)
            return 2
        for p in merged["parts"]:
            state = "not run" if not p["ran"] else ("ran" if p["finished"] else "stopped before its end")
            print(f"part {p['part']}: {p['file']} {state} ({p['checks']} checks)", flush=True)
        head = f"({merged['merged_from']}, {merged['device']}, {merged['profile']} profile)"
        return print_summary(merged["checks"], head, out / "report.json", args.accept_incomplete)
    checks = select(all_checks(), args.only)
    if args.list:
        for c in checks:
            print(f"{c.name:<56} {c.what}")
        return 0
    t0 = time.perf_counter()
    info = hardware()
    n_gpus = len(info.get("gpus") or [])
    missing = missing_datasets()
    if args.plan is not None:
        profile, why = choose_profile(n_gpus, missing)
        if not 1 <= args.plan <= len(checks):
            ap.error(f"--plan takes 1 to {len(checks)} parts")
        print(f"profile {profile} ({why})")
        print_plan(checks, args.plan, profile, args.budget_s)
        return 0
    offline = args.offline or (bool(missing) and not network_reachable())
    profile, why = choose_profile(n_gpus, missing)
    report_name, report_extra, what = "report.json", {}, f"{len(checks)} checks"
    if args.part is not None:
        k, n = args.part
        if n > len(checks):
            ap.error(f"--part {k}/{n}: only {len(checks)} checks to cut into parts")
        parts = plan_parts(checks, n, profile)
        checks = parts[k - 1]
        report_name = part_report_name(k, n)
        report_extra = {"part": {"k": k, "n": n}, "plan": [[c.name for c in p] for p in parts]}
        est = sum(c.estimate(profile) for c in checks)
        what = f"part {k}/{n}: {len(checks)} checks, about {est:.0f} s estimated"
        if est > args.budget_s:
            what += f", more than the budget: --plan {n + 1} cuts smaller parts"
    print(
        "\n".join(
            [
                "== hardware ==",
                *hardware_lines(info),
                f"profile {profile} ({why}); datasets missing: {', '.join(missing) or 'none'}"
                f"{'; offline' if offline else ''}; budget {args.budget_s:g} s",
                f"== checks ({what}) ==",
            ]
        ),
        flush=True,
    )
    extra = {
        "profile_reason": why,
        "offline": offline,
        "datasets_missing": missing,
        "missing": tuple(missing),
        "full_bench": args.full_bench,
    }
    report, _ = run_checks(
        checks,
        args.out,
        info=info,
        profile=profile,
        ctx_extra=extra,
        budget_s=args.budget_s,
        started=t0,
        report_name=report_name,
        report_extra=report_extra,
    )
    head = f"in {time.perf_counter() - t0:.0f} s (budget {args.budget_s:g} s)"
    if args.part is not None:
        head += f"; part {args.part[0]}/{args.part[1]}, then --merge"
    return print_summary([asdict(r) for r in report.results], head, args.out / report_name, args.accept_incomplete)


if __name__ == "__main__":
    sys.exit(main())
