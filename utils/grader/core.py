"""Grading one submission: prepare, run under torchrun in the sandbox, measure, evaluate, report.

The report is a plain dict (JSON): ``status`` is ``passed``, ``failed`` (it ran and produced a
model, but missed a requirement) or ``error`` (nothing gradable came out); ``reasons`` lists
``{"code", "message"}`` for every requirement missed, in words that say what to fix.
"""
from __future__ import annotations

import atexit
import datetime
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import traceback
import uuid
from pathlib import Path

from . import sandbox, static
from .spec import ROOT, Spec

PROBE_SITE = Path(__file__).with_name("_probe")
MAX_SUBMISSION_BYTES = 20 << 20        # a submission folder larger than this is refused
LOG_TAIL_BYTES = 3000

# Reasons after which there is no model to grade: the status is "error", not "failed".
ERROR_CODES = {"no_entry", "syntax_error", "too_large_submission", "crashed", "timeout", "output_limit",
               "no_output", "bad_checkpoint", "unsafe_checkpoint", "too_large", "wrong_keys",
               "wrong_shapes", "nan_weights", "grader_error"}


# ----------------------------------------------------------------------------------------
# Data: the training split goes to the submission, the held-out split stays here
# ----------------------------------------------------------------------------------------

_DATA_LOCK = threading.Lock()
_DATA: dict = {}


def prepare_data(spec: Spec):
    """(path of train.npz in a grader-owned cache, held-out TensorDataset), once per process."""
    import numpy as np
    import torch
    from torch.utils.data import TensorDataset

    import utils.data
    key = (spec.dataset, spec.n_train, spec.n_val, spec.seed, spec.data_dir, spec.heldout)
    with _DATA_LOCK:
        if key in _DATA and _DATA[key][0].exists():
            return _DATA[key]
        kw = {"root": spec.data_dir} if spec.data_dir and spec.dataset != "digits" else {}
        splits = utils.data.load(spec.dataset, n_train=spec.n_train or None, n_val=spec.n_val or None,
                                 seed=spec.seed, **kw)
        x, y = splits.train.tensors
        cache = Path(tempfile.mkdtemp(prefix="grader-data-"))
        atexit.register(shutil.rmtree, cache, True)      # CIFAR-10's split is 600 MB: never leave it
        train_npz = cache / "train.npz"
        np.savez(train_npz, x=x.numpy(), y=y.numpy())
        if spec.heldout == "val":
            heldout = splits.val
        else:
            with np.load(spec.heldout) as f:
                hx, hy = torch.from_numpy(f["x"]).float(), torch.from_numpy(f["y"]).long()
            if tuple(hx.shape[1:]) != tuple(x.shape[1:]):
                raise ValueError(f"held-out images {tuple(hx.shape[1:])} differ from the training "
                                 f"images {tuple(x.shape[1:])}: fix heldout in {spec.path}")
            heldout = TensorDataset(hx, hy)
        _DATA[key] = (train_npz, heldout)
        return _DATA[key]


# ----------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------

def find_entry(submission: Path) -> Path:
    """The script to run: the file itself, or in a folder assessment.py, else its only .py."""
    if submission.is_file():
        return submission
    if (submission / "assessment.py").is_file():
        return submission / "assessment.py"
    scripts = sorted(submission.glob("*.py"))
    if len(scripts) == 1:
        return scripts[0]
    raise FileNotFoundError(f"{submission} holds {len(scripts)} .py files and no assessment.py: "
                            "name the training script assessment.py")


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def tail(path: Path, n: int = LOG_TAIL_BYTES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n))
            data = f.read(n)
    except OSError:
        return ""
    text = data.decode(errors="replace")
    return (f"[... {size - n} bytes not shown]\n" if size > n else "") + text


def rank_logs(log_dir: Path, nprocs: int) -> dict:
    out = {}
    for r in range(nprocs):
        files = {kind: sorted(log_dir.glob(f"*/attempt_*/{r}/{kind}.log")) for kind in ("stdout", "stderr")}
        out[str(r)] = {kind: tail(paths[-1]) if paths else "" for kind, paths in files.items()}
    return out


_ERR_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b.*)$")


def last_error(text: str) -> str | None:
    lines = [l for l in text.splitlines() if _ERR_LINE.match(l)]
    return lines[-1].strip()[:300] if lines else None


def read_probe(probe_dir: Path, spec: Spec, workers: list) -> dict:
    """Ranks that joined the process group, as measured: a record from the probe counts only if
    its all-reduce summed to the world size the spec requires AND it matches a worker process
    the grader itself saw (same pid and start time, and torchrun gave it that RANK)."""
    seen = {(w.pid, w.start_ticks): w for w in workers}
    joined, exits, problems = {}, {}, []
    files = sorted(probe_dir.glob("*.json"))[: 8 * spec.nprocs + 8]
    for f in files:
        try:
            if f.stat().st_size > 65536:
                continue
            rec = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(rec, dict):
            continue
        if f.name.startswith("error."):
            problems.append(str(rec.get("error"))[:200])
            continue
        try:
            key = (int(rec["pid"]), int(rec["start_ticks"]))
            rank = int(rec["rank"])
        except (KeyError, TypeError, ValueError):
            continue
        w = seen.get(key)
        if w is None or w.env_rank != str(rank):
            problems.append(f"a record for rank {rank} matches no worker process the grader saw")
            continue
        if f.name.startswith("rank"):
            if rec.get("world_size") == spec.nprocs and rec.get("all_reduce_sum") == spec.nprocs:
                joined[rank] = rec
            else:
                problems.append(f"rank {rank}: world size {rec.get('world_size')}, all-reduce of ones "
                                f"gave {rec.get('all_reduce_sum')} (needs {spec.nprocs})")
        elif f.name.startswith("exit"):
            exits[rank] = rec
    dp = [r for r in joined if r in exits and (int(exits[r].get("collectives") or 0) > 0
                                               or int(exits[r].get("ddp_iterations") or 0) > 0)]
    return {"ranks_joined": sorted(joined), "ranks_with_gradient_sync": sorted(dp),
            "backend": next((r.get("backend") for r in joined.values()), None),
            "ddp_iterations": {str(r): exits[r].get("ddp_iterations") for r in exits},
            "ddp_fingerprints": [str(f) for f in (exits.get(0, {}).get("fingerprints") or [])][:8],
            "collectives": {str(r): exits[r].get("collectives") for r in exits},
            "problems": problems[:10]}


def _env(spec: Spec, job: Path, probe_dir: Path, gpus) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SCALING_LABS_", "TORCHELASTIC_", "PYTHON")) and k not in (
               "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(PROBE_SITE), str(ROOT)])
    env["SCALING_LABS_GRADER_PROBE"] = str(probe_dir)
    env["PYTHONUNBUFFERED"] = "1"
    env["DATA_DIR"] = str(job / "work" / "data")
    env["HOME"] = str(job / "home")
    env["TMPDIR"] = str(job / "tmp")
    env["MPLCONFIGDIR"] = str(job / "tmp")
    if spec.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    return env


def _reason(code: str, message: str) -> dict:
    return {"code": code, "message": message}


def grader_info() -> dict:
    import torch

    import utils
    return {"version": utils.__version__, "torch": torch.__version__, "python": sys.version.split()[0],
            "host": os.uname().nodename, "cpu_cores": os.cpu_count(),
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if torch.cuda.is_available() else []}


# ----------------------------------------------------------------------------------------
# Grading
# ----------------------------------------------------------------------------------------

def grade(submission, spec: Spec, *, student: str | None = None, workroot=None, keep: bool = False,
          gpus=None) -> dict:
    """Grade one submission (a .py file or a folder) against ``spec``; never raises."""
    submission = Path(submission)
    t_start = time.perf_counter()
    report = {
        "student": student or submission.stem, "submission": str(submission), "spec": spec.name,
        "spec_path": spec.path, "status": "error", "reasons": [], "accuracy": None,
        "target_val_acc": spec.target_val_acc, "time_s": None, "time_budget_s": spec.time_budget_s,
        "ranks_measured": 0, "nprocs_required": spec.nprocs, "workers_seen": 0, "data_parallel": None,
        "exit_code": None, "timed_out": False, "static_warnings": [], "review": [], "logs": {}, "rank_evidence": {},
        "isolation": {}, "leftover_processes": [], "started": datetime.datetime.now(
            datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    token = uuid.uuid4().hex
    report["job_token"] = token                          # in the environment of its every process
    job = None
    try:
        _grade(submission, spec, report, token, workroot, gpus)
    except Exception as e:                               # the grader never crashes on a submission
        report["reasons"].append(_reason("grader_error", f"the grader failed: {type(e).__name__}: {e}. "
                                         "Tell the instructor; this is not your fault."))
        report["grader_traceback"] = traceback.format_exc()[-3000:]
    finally:
        for pid in sandbox.processes_with_token(token):  # belt and braces: nothing may survive
            try:
                os.kill(pid, 9)
                report["leftover_processes"].append(sandbox._cmdline(pid))
            except OSError:
                pass
        job = report.pop("_job", None)
        if job and not keep:
            shutil.rmtree(job, ignore_errors=True)
        elif job:
            report["workdir"] = str(job)
    if not report["reasons"] and (report["accuracy"] is None or report["time_s"] is None):
        report["reasons"].append(_reason("grader_error", "no accuracy or time was measured; tell the instructor"))
    codes = [r["code"] for r in report["reasons"]]
    report["status"] = ("passed" if not codes else
                        "error" if any(c in ERROR_CODES for c in codes) else "failed")
    report["reason"] = "; ".join(r["message"] for r in report["reasons"]) or \
        f"passed: accuracy {report['accuracy']:.4f} >= {spec.target_val_acc} in {report['time_s']:.1f} s " \
        f"<= {spec.time_budget_s} s with {report['ranks_measured']} ranks"
    report["grading_s"] = round(time.perf_counter() - t_start, 2)
    try:
        report["grader"] = grader_info()
    except Exception:                                    # provenance is best effort
        pass
    return report


def _grade(submission: Path, spec: Spec, report: dict, token: str, workroot, gpus):
    reasons = report["reasons"]
    if not submission.exists():
        reasons.append(_reason("no_entry", f"{submission} does not exist"))
        return
    try:
        entry = find_entry(submission)
    except FileNotFoundError as e:
        reasons.append(_reason("no_entry", str(e)))
        return
    if _size(submission) > MAX_SUBMISSION_BYTES:
        reasons.append(_reason("too_large_submission", f"the submission is {_size(submission) >> 20} MiB; "
                               f"over {MAX_SUBMISSION_BYTES >> 20} MiB (submit the script, not data or models)"))
        return
    found = static.check_file(entry)
    report["static_warnings"] = found["warnings"]
    if found["syntax_error"]:
        reasons.append(_reason("syntax_error", f"syntax error, nothing was run: {found['syntax_error']}"))
        return

    if spec.device == "cuda":
        have = len(gpus) if gpus is not None else (torch_cuda_count())
        if have < spec.nprocs:
            reasons.append(_reason("grader_error", f"the spec runs {spec.nprocs} ranks on GPUs but this job has "
                                   f"{have} GPU(s): grade on a machine with enough GPUs, lower --jobs, or "
                                   "use a device = \"cpu\" spec. Not the student's fault."))
            return
    train_npz, heldout = prepare_data(spec)
    job = Path(tempfile.mkdtemp(prefix=f"grade-{re.sub(r'[^A-Za-z0-9_.-]', '_', report['student'])[:40]}-",
                                dir=workroot))
    report["_job"] = job
    work, probe_dir, log_dir = job / "work", job / "probe", job / "logs"
    for d in (probe_dir, log_dir, job / "home", job / "tmp"):
        d.mkdir(parents=True)
    if submission.is_dir():
        shutil.copytree(submission, work, symlinks=True)
    else:                       # one file: run it as assessment.py (a student's torch.py must not shadow torch)
        work.mkdir()
        shutil.copy2(submission, work / "assessment.py")
    data = work / "data"
    if data.is_symlink() or data.exists():
        shutil.rmtree(data) if data.is_dir() and not data.is_symlink() else data.unlink()
    data.mkdir()
    shutil.copy(train_npz, data / "train.npz")
    (data / "assessment.json").write_text(json.dumps(spec.public(), indent=1))
    out = work / "model.pt"
    if out.exists():
        out.unlink()                                     # a model must come from this run

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(spec.nprocs), "--monitor-interval", "0.2",
           "--log-dir", str(log_dir), "--redirects", "3",
           str(entry.relative_to(submission) if submission.is_dir() else "assessment.py"),
           "--data-dir", "data", "--out", "model.pt"]
    iso = sandbox.probe_isolation()
    report["isolation"] = sandbox.isolation_summary(iso, spec.device)
    res = sandbox.run(cmd, cwd=work, env=_env(spec, job, probe_dir, gpus), log_path=job / "launcher.log",
                      budget_s=spec.time_budget_s, max_bytes=spec.max_output_mb << 20, token=token,
                      status_path=job / "init.json")
    report["time_s"] = round(res.wall_s, 3)
    report["exit_code"] = res.returncode
    report["timed_out"] = res.timed_out
    report["workers_seen"] = len({w.env_rank for w in res.workers})
    report["leftover_processes"] = res.leftovers + res.remaining
    logs = rank_logs(log_dir, spec.nprocs)
    logs["launcher"] = tail(job / "launcher.log")
    report["logs"] = logs

    # What ran, measured here.
    evidence = read_probe(probe_dir, spec, res.workers)
    evidence["tcp_links"] = res.links
    linked = {r for r in evidence["ranks_joined"] if res.links.get(str(r))}
    evidence["ranks_linked"] = sorted(linked)
    if evidence["backend"] == "gloo" and spec.nprocs > 1:
        # gloo connects every pair of ranks over TCP: a rank that claims to have joined but held
        # no connection to another worker the grader saw did not really join.
        for r in sorted(set(evidence["ranks_joined"]) - linked):
            evidence["problems"].append(f"rank {r} reported joining but held no TCP connection to another rank")
        evidence["ranks_joined"] = sorted(linked)
    report["rank_evidence"] = evidence
    report["ranks_measured"] = len(evidence["ranks_joined"])
    report["data_parallel"] = len(evidence["ranks_with_gradient_sync"]) == spec.nprocs

    limit_hit = any("File too large" in (v.get("stderr", "") + v.get("stdout", ""))
                    for k, v in logs.items() if isinstance(v, dict)) or "File too large" in logs["launcher"]
    if res.timed_out:
        reasons.append(_reason("timeout", f"still running after the {spec.time_budget_s:g} s budget "
                               "(launch to exit, measured by the grader): all its processes were killed"))
    elif res.returncode != 0:
        failed = [(r, last_error(v["stderr"]) or last_error(v["stdout"])) for r, v in logs.items()
                  if isinstance(v, dict) and "Traceback" in v["stderr"] + v["stdout"]]
        detail = "; ".join(f"rank {r}: {e}" for r, e in failed if e) or \
            (last_error(logs["launcher"]) or "see the launcher log")
        if limit_hit:
            reasons.append(_reason("output_limit", f"a file (a log or the model) grew past the "
                                   f"{spec.max_output_mb} MiB limit and the write failed: {detail}"))
        else:
            reasons.append(_reason("crashed", f"torchrun exited with code {res.returncode}: {detail}"))
    if res.stragglers or res.leftovers or res.remaining:
        n = len(res.stragglers) or len(res.leftovers) or len(res.remaining)
        reasons.append(_reason("background_processes", f"{n} process(es) were still running after the "
                               f"submission exited ({', '.join((res.stragglers or res.leftovers)[:3])[:200]}); "
                               "the grader killed them: wait for (join) every process you start"))

    from . import checkpoint
    if not out.exists() and not out.is_symlink():
        if not res.timed_out and res.returncode == 0:
            reasons.append(_reason("no_output", "the script exited without writing model.pt: save "
                                   "model.state_dict() to the path given by --out (from rank 0)"))
    else:
        try:
            sd = checkpoint.load_state_dict(out, spec.max_output_mb << 20)
            device = "cuda" if spec.device == "cuda" and _cuda() else "cpu"
            report["accuracy"] = round(checkpoint.evaluate(spec, sd, heldout, device), 5)
            prints = evidence.get("ddp_fingerprints") or []
            if prints and checkpoint.fingerprint(sd) not in prints:
                report["review"].append("the saved weights are not those of rank 0's DDP model when it "
                                        "exited: fine for an EMA or a best-so-far checkpoint; otherwise "
                                        "check where the weights came from")
        except checkpoint.CheckpointRejected as e:
            reasons.append(_reason(e.code, str(e)))
    if report["accuracy"] is not None and report["accuracy"] < spec.target_val_acc:
        reasons.append(_reason("accuracy", f"held-out accuracy {report['accuracy']:.4f} is below the target "
                               f"{spec.target_val_acc} (measured by the grader on data the script never had)"))
    if not res.timed_out and res.wall_s > spec.time_budget_s:
        reasons.append(_reason("time", f"took {res.wall_s:.1f} s, over the {spec.time_budget_s:g} s budget"))
    crashed = not res.timed_out and res.returncode != 0
    if crashed:
        return                                   # the crash is the thing to fix first
    if report["ranks_measured"] < spec.nprocs:
        why = " (the script never called torch.distributed.init_process_group)" \
            if report["ranks_measured"] == 0 and not evidence["problems"] else \
            f" ({'; '.join(evidence['problems'][:2])})" if evidence["problems"] else ""
        reasons.append(_reason("not_distributed", f"{report['ranks_measured']} of {spec.nprocs} ranks joined "
                               f"the process group, measured by the grader{why}: run as one data-parallel "
                               f"job over {spec.nprocs} processes"))
    elif not report["data_parallel"]:
        reasons.append(_reason("not_data_parallel", "the ranks joined the process group but did not "
                               "synchronise gradients (no DDP training step and no all-reduce was seen): "
                               "wrap the model in DistributedDataParallel"))


def torch_cuda_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def write_json(report: dict, path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    os.replace(tmp, path)
