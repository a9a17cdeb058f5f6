"""A class at a time: submissions found in a folder, graded K at a time (GPUs divided among the
jobs), a CSV gradebook, Gradescope's results.json; and calibration of the time budget."""
from __future__ import annotations

import csv
import io
import json
import math
import os
import queue
import statistics
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .core import grade, grader_info, write_json
from .spec import REFERENCE_SOLUTION, Spec

GRADEBOOK_FIELDS = ["student", "status", "accuracy", "target_val_acc", "time_s", "time_budget_s",
                    "ranks_measured", "nprocs_required", "score", "reason"]


def find_submissions(folder) -> list[tuple[str, Path]]:
    """(student, path) for every ``*.py`` file and every sub-folder of ``folder``, by name."""
    folder = Path(folder)
    if not folder.is_dir():
        raise NotADirectoryError(f"{folder} is not a folder of submissions (one .py file or one "
                                 "folder per student)")
    subs = []
    for p in sorted(folder.iterdir()):
        if p.name.startswith((".", "_")):
            continue
        if p.is_dir() or p.suffix == ".py":
            subs.append((p.stem if p.is_file() else p.name, p))
    return subs


def _gpu_slots(spec: Spec, jobs: int):
    """One list of GPU indices per concurrent job (None when the spec runs on the CPU)."""
    if spec.device != "cuda":
        return [None] * jobs
    try:
        import torch
        n = torch.cuda.device_count()
    except Exception:
        n = 0
    if n == 0:
        return [None] * jobs
    per = max(1, n // jobs)
    return [list(range(i * per, (i + 1) * per)) for i in range(min(jobs, max(1, n // per)))]


def score(report: dict, spec: Spec) -> float:
    return float(spec.points) if report["status"] == "passed" else 0.0


def grade_many(subs: list[tuple[str, Path]], spec: Spec, *, jobs: int = 1, report_dir=None,
               workroot=None, progress=print) -> list[dict]:
    slots = _gpu_slots(spec, max(1, jobs))
    free: queue.Queue = queue.Queue()
    for s in slots:
        free.put(s)

    def one(item):
        student, path = item
        gpus = free.get()
        try:
            r = grade(path, spec, student=student, workroot=workroot, gpus=gpus)
        finally:
            free.put(gpus)
        r["score"] = score(r, spec)
        if report_dir:
            write_json(r, Path(report_dir) / f"{student}.json")
        if progress:
            progress(f"{student:<24} {r['status']:<7} {r['reason'][:110]}")
        return r

    with ThreadPoolExecutor(max_workers=len(slots)) as pool:
        return list(pool.map(one, subs))


def _fmt(key, v):
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4f}" if key in ("accuracy", "target_val_acc") else f"{v:g}" if key == "score" else f"{v:.2f}"
    return v


def write_gradebook(reports: list[dict], path) -> None:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=GRADEBOOK_FIELDS, extrasaction="ignore")
    w.writeheader()
    for r in reports:
        w.writerow({k: _fmt(k, r.get(k)) for k in GRADEBOOK_FIELDS})
    _atomic(path, buf.getvalue())


def gradescope_tests(report: dict, spec: Spec) -> list[dict]:
    """One Gradescope test per requirement of the assessment."""
    codes = {r["code"] for r in report["reasons"]}
    ran = not (codes & {"no_entry", "syntax_error", "too_large_submission", "crashed", "timeout",
                        "output_limit", "grader_error"})
    model_ok = ran and not (codes & {"no_output", "bad_checkpoint", "unsafe_checkpoint", "too_large",
                                     "wrong_keys", "wrong_shapes", "nan_weights"})

    def test(name, ok, output):
        return {"name": name, "status": "passed" if ok else "failed", "output": output}

    msg = {r["code"]: r["message"] for r in report["reasons"]}
    acc, t = report.get("accuracy"), report.get("time_s")
    return [
        test("runs under torchrun to completion", ran,
             "; ".join(m for c, m in msg.items() if c in {"syntax_error", "crashed", "timeout", "output_limit",
                                                           "no_entry", "too_large_submission", "grader_error"})
             or f"exit code {report.get('exit_code')}"),
        test("writes a valid state dict of the assessment's model", model_ok,
             "; ".join(m for c, m in msg.items() if c in {"no_output", "bad_checkpoint", "unsafe_checkpoint",
                                                           "too_large", "wrong_keys", "wrong_shapes",
                                                           "nan_weights"}) or "loaded with weights_only=True"),
        test(f"{spec.nprocs} ranks train data-parallel (measured by the grader)",
             not codes & {"not_distributed", "not_data_parallel"} and report["ranks_measured"] == spec.nprocs,
             msg.get("not_distributed") or msg.get("not_data_parallel")
             or f"{report['ranks_measured']} ranks joined the process group"),
        test(f"held-out accuracy >= {spec.target_val_acc}", acc is not None and acc >= spec.target_val_acc,
             f"accuracy {acc:.4f}" if acc is not None else "no accuracy (no gradable model)"),
        test(f"within the {spec.time_budget_s:g} s budget", t is not None and not codes & {"timeout", "time"},
             f"{t:.1f} s, launch to exit" if t is not None else "not run"),
    ]


def gradescope_result(report: dict, spec: Spec) -> dict:
    """Gradescope's autograder results.json for ONE submission (the file Gradescope reads from
    /autograder/results/results.json): the score, then one test per requirement."""
    lines = [f"Status: {report['status']}. {report['reason']}"]
    lines += [f"Note: {w}" for w in report.get("static_warnings", [])]
    return {"score": score(report, spec), "output": "\n".join(lines),
            "execution_time": round(report.get("grading_s") or 0),
            "tests": gradescope_tests(report, spec),    # status only: the score is the top-level one
            "visibility": "visible", "stdout_visibility": "hidden"}


def gradescope_batch(reports: list[dict], spec: Spec) -> dict:
    """A class in Gradescope's results.json format: one test per student (name = the student,
    score = the student's score, output = status and reason)."""
    return {"output": f"Graded {len(reports)} submission(s) against {spec.name} "
                      f"(target {spec.target_val_acc}, budget {spec.time_budget_s:g} s, {spec.nprocs} processes)",
            "execution_time": round(sum(r.get("grading_s") or 0 for r in reports)),
            "tests": [{"name": r["student"], "score": score(r, spec), "max_score": float(spec.points),
                       "status": "passed" if r["status"] == "passed" else "failed",
                       "output": f"{r['status']}: {r['reason']}"} for r in reports],
            "visibility": "after_published", "stdout_visibility": "hidden"}


def _atomic(path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w", newline="") as f:
        f.write(text)
    os.replace(tmp, path)


def write_gradescope(doc: dict, path) -> None:
    _atomic(path, json.dumps(doc, indent=1))


def calibrate(spec: Spec, *, runs: int = 3, solution=REFERENCE_SOLUTION, margin: float = 1.5,
              progress=print) -> dict:
    """Grade the reference solution ``runs`` times with a generous deadline; propose a budget of
    ``margin`` x the slowest run, rounded up to 5 s."""
    loose = spec.replace(time_budget_s=max(spec.time_budget_s * 10, 600))
    reports = []
    for i in range(runs):
        r = grade(solution, loose, student=f"reference-{i}")
        reports.append(r)
        if progress:
            progress(f"run {i + 1}/{runs}: {r['status']:<7} {r['time_s'] or float('nan'):7.1f} s  "
                     f"accuracy {r['accuracy'] if r['accuracy'] is not None else float('nan'):.4f}")
    times = [r["time_s"] for r in reports if r["status"] == "passed"]
    accs = [r["accuracy"] for r in reports if r["status"] == "passed"]
    out = {"spec": spec.name, "runs": runs, "passed": len(times), "times_s": times, "accuracies": accs,
           "hardware": grader_info()}
    if times:
        out.update(min_s=min(times), median_s=statistics.median(times), max_s=max(times),
                   proposed_budget_s=int(5 * math.ceil(margin * max(times) / 5)),
                   min_accuracy=min(accs))
    else:
        out["problem"] = "the reference solution did not pass once: " + reports[0]["reason"]
    return out
