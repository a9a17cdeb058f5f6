"""A class at a time: submissions found in a folder, graded K at a time (GPUs divided among the
jobs), a CSV gradebook, Gradescope's results.json, a gradebook a learning platform imports
(Canvas's, or a generic one), one feedback page per student; and calibration of the time budget."""

from __future__ import annotations

import csv
import datetime
import html
import io
import json
import math
import queue
import statistics
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..files import atomic_write
from . import sandbox
from .core import MODEL_CODES, RUN_CODES, grade, grader_info, prepare_data, write_json
from .spec import CALIBRATE_MARGIN, CALIBRATE_REPEATS, REFERENCE_SOLUTION, Spec

GRADEBOOK_FIELDS = [
    "student",
    "status",
    "accuracy",
    "target_val_acc",
    "time_s",
    "time_budget_s",
    "ranks_measured",
    "nprocs_required",
    "score",
    "reason",
    "sha256",
]


def find_submissions(folder: str | Path) -> list[tuple[str, Path]]:
    """(student, path) for every ``*.py`` file and every sub-folder of ``folder``, by name."""
    folder = Path(folder)
    if not folder.is_dir():
        raise NotADirectoryError(f"{folder} is not a folder of submissions (one .py file or one folder per student)")
    subs = []
    for p in sorted(folder.iterdir()):
        if p.name.startswith((".", "_")) or p.is_symlink():  # a link could point anywhere
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


def grade_many(
    subs: list[tuple[str, Path]],
    spec: Spec,
    *,
    jobs: int = 1,
    report_dir: str | Path | None = None,
    workroot: str | Path | None = None,
    progress: Callable[[str], Any] = print,
) -> list[dict]:
    """Grade every submission, ``jobs`` at a time. Before the first job: the sandbox is probed
    (grading is refused without one) and the data prepared; every grader module is already
    imported (core imports them at its top). The per-student reports are written only after
    every job has ended, each atomically."""
    sandbox.probe_isolation()
    prepare_data(spec)
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
        if progress:
            progress(f"{student:<24} {r['status']:<7} {r['reason'][:110]}")
        return r

    with ThreadPoolExecutor(max_workers=len(slots)) as pool:
        reports = list(pool.map(one, subs))
    if report_dir:
        for r in reports:
            write_json(r, Path(report_dir) / f"{r['student']}.json")
    return reports


def _fmt(key, v):
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4f}" if key in ("accuracy", "target_val_acc") else f"{v:g}" if key == "score" else f"{v:.2f}"
    return v


def write_gradebook(reports: list[dict], path: str | Path) -> None:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=GRADEBOOK_FIELDS, extrasaction="ignore")
    w.writeheader()
    for r in reports:
        w.writerow({k: _fmt(k, r.get(k)) for k in GRADEBOOK_FIELDS})
    atomic_write(path, buf.getvalue())


CANVAS_IDS = ("ID", "SIS User ID", "SIS Login ID")  # the columns Canvas matches a row to a student by


def write_platform_csv(
    reports: list[dict],
    path: str | Path,
    spec: Spec,
    *,
    platform: str = "canvas",
    id_column: str = "SIS Login ID",
    assignment: str = "Scaling Labs assessment",
) -> None:
    """The grades as a learning platform imports them, one row per student with the score out of
    ``spec.points``; the student is the submission's name (its file or folder), put in ``id_column``.

    ``canvas``: Canvas's gradebook columns (Student, ID, SIS User ID, SIS Login ID, Section), a
    "Points Possible" row, then one column for the assignment; ``id_column`` is one of
    :data:`CANVAS_IDS`, the one the submissions are named by. ``generic``: ``id_column``, score,
    points possible, status."""
    buf = io.StringIO()
    w = csv.writer(buf)
    if platform == "canvas":
        if id_column not in CANVAS_IDS:
            raise ValueError(f"Canvas matches students by one of {', '.join(CANVAS_IDS)}, not {id_column!r}")
        w.writerow(["Student", *CANVAS_IDS, "Section", assignment])
        w.writerow(["Points Possible", "", "", "", "", f"{spec.points:g}"])
        for r in reports:
            ids = [r["student"] if c == id_column else "" for c in CANVAS_IDS]
            w.writerow([r["student"], *ids, "", f"{r['score']:g}"])
    elif platform == "generic":
        w.writerow([id_column, "score", "points_possible", "status"])
        for r in reports:
            w.writerow([r["student"], f"{r['score']:g}", f"{spec.points:g}", r["status"]])
    else:
        raise ValueError(f"unknown platform {platform!r}: canvas or generic")
    atomic_write(path, buf.getvalue())


NEXT_STEP = {
    "no_entry": "hand in assessment.py (one file, or a folder with it at its top)",
    "syntax_error": "run `python -m py_compile assessment.py` and fix the line it names",
    "too_large_submission": "hand in your code only: no data, checkpoints or virtual environments",
    "crashed": "run the command in the brief on your machine and fix the error above, on every rank",
    "timeout": "make it finish sooner: time one epoch with the brief's command and cut epochs or work",
    "output_limit": "print less (a line per epoch) and write only model.pt",
    "grader_error": "tell your instructor: the grader, not your code, failed",
    "no_output": "save model.state_dict() to the path given by --out, on rank 0 only",
    "bad_checkpoint": "save with torch.save(model.state_dict(), path): a dict of tensors",
    "unsafe_checkpoint": "save plain tensors only (model.state_dict()), never pickled objects",
    "too_large": "save the model's state_dict only, not the optimizer or the data",
    "wrong_keys": "save the state_dict of the model the brief names, unwrapped from DDP (model.module)",
    "wrong_shapes": "keep the brief's model and its sizes",
    "nan_weights": "lower the learning rate or add warmup: training diverged",
    "time": "spend the speed-up: train on every rank, so each epoch takes less time",
    "accuracy": "train longer or tune the learning rate for your global batch",
    "background_processes": "let every process you start end before your script does",
    "not_distributed": "join the process group on every rank (init_process_group) and train on each",
    "not_data_parallel": "wrap the model in DistributedDataParallel and give each rank its own shard",
    "not_ddp_weights": "save the weights of the model DDP trained (model.module.state_dict())",
    "weights_changed": "save the weights right after training, unchanged",
    "too_little_data": "train on the whole training split: shard it across ranks, do not cut it",
}


def feedback_page(report: dict, spec: Spec) -> str:
    """One student's grade as an HTML page: the result, each reason with what to do next."""
    e = html.escape
    rows = [
        ("accuracy", report.get("accuracy"), f"target {spec.target_val_acc}"),
        ("time", report.get("time_s"), f"budget {spec.time_budget_s:g} s"),
        ("ranks measured", report.get("ranks_measured"), f"required {spec.nprocs}"),
    ]
    table = "".join(
        f"<tr><td>{e(k)}</td><td>{'not measured' if v is None else e(f'{v:.4g}' if isinstance(v, float) else str(v))}"
        f"</td><td>{e(want)}</td></tr>"
        for k, v, want in rows
    )
    reasons = "".join(
        f"<li><p>{e(r['message'])}</p><p><b>Next:</b> {e(NEXT_STEP.get(r['code'], 'read the brief again, or ask your instructor'))}</p></li>"
        for r in report.get("reasons", [])
    )
    verdict = (
        "Passed" if report["status"] == "passed" else "Not passed" if report["status"] == "failed" else "Not graded"
    )
    body = f"<ol>{reasons}</ol>" if reasons else "<p>Every requirement was met.</p>"
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{e(report['student'])}: {verdict}</title></head>"
        f"<body><h1>{e(report['student'])}: {verdict}, {report['score']:g} of {spec.points:g} points</h1>"
        f"<table><tr><th></th><th>yours</th><th>needed</th></tr>{table}</table><h2>Why</h2>{body}</body></html>\n"
    )


def write_feedback(reports: list[dict], folder: str | Path, spec: Spec) -> None:
    """One ``<student>.html`` per report in ``folder``, each written atomically."""
    for r in reports:
        atomic_write(Path(folder) / f"{r['student']}.html", feedback_page(r, spec))


DP_CODES = {"not_distributed", "not_data_parallel", "not_ddp_weights", "weights_changed", "too_little_data"}


def gradescope_tests(report: dict, spec: Spec) -> list[dict]:
    """The overall result (it carries the points), then one zero-point line per requirement.
    A requirement that could not be checked says so, and what stopped it, never 'passed'."""
    msg = {r["code"]: r["message"] for r in report["reasons"]}
    codes = set(msg)
    ran = not codes & RUN_CODES
    first_run_failure = next((msg[c] for c in msg if c in RUN_CODES), "")
    model_ok = ran and not codes & MODEL_CODES
    acc, t = report.get("accuracy"), report.get("time_s")
    ev = report.get("rank_evidence") or {}
    steps = (ev.get("optimizer_steps") or {}).get("0")

    def test(name, ok, output, points=0.0):
        return {
            "name": name,
            "score": points if ok else 0.0,
            "max_score": points,
            "status": "passed" if ok else "failed",
            "output": output,
            "visibility": "visible",
        }

    not_checked = "not checked: the script did not run to completion"
    tests = [
        test(
            "assessment passed (every requirement below)",
            report["status"] == "passed",
            report["reason"],
            float(spec.points),
        )
    ]
    tests.append(
        test("runs under torchrun to completion", ran, first_run_failure or f"exit code {report.get('exit_code')}")
    )
    tests.append(
        test(
            "writes a valid state dict of the assessment's model",
            model_ok,
            "; ".join(m for c, m in msg.items() if c in MODEL_CODES)
            or ("loaded with torch.load(weights_only=True); keys and shapes match" if ran else not_checked),
        )
    )
    dp_ok = ran and not codes & DP_CODES and report["ranks_measured"] == spec.nprocs
    tests.append(
        test(
            f"{spec.nprocs} ranks train data-parallel (measured by the grader)",
            dp_ok,
            "; ".join(m for c, m in msg.items() if c in DP_CODES)
            or (
                f"{report['ranks_measured']} ranks joined; every rank took {steps} optimizer steps "
                "with the same synchronised gradients"
                if ran
                else not_checked
            ),
        )
    )
    tests.append(
        test(
            f"held-out accuracy >= {spec.target_val_acc}",
            acc is not None and acc >= spec.target_val_acc,
            f"held-out accuracy {acc:.4f}" if acc is not None else "not checked: no gradable model",
        )
    )
    tests.append(
        test(
            f"within the {spec.time_budget_s:g} s budget",
            t is not None and not codes & {"timeout", "time"},
            msg.get("timeout") or msg.get("time") or (f"{t:.1f} s, launch to exit" if t is not None else "not run"),
        )
    )
    return tests


def gradescope_result(report: dict, spec: Spec) -> dict:
    """Gradescope's autograder results.json for ONE submission (the file Gradescope reads from
    /autograder/results/results.json): the score, then the tests."""
    lines = [f"{report['status'].upper()}: {report['reason']}"]
    lines += [f"Note: {w}" for w in report.get("static_warnings", [])]
    if report.get("budget_note"):
        lines.append(f"Note: {report['budget_note']}")
    return {
        "score": score(report, spec),
        "output": "\n".join(lines),
        "execution_time": round(report.get("grading_s") or 0),
        "tests": gradescope_tests(report, spec),
        "visibility": "visible",
        "stdout_visibility": "hidden",
    }


def gradescope_batch(reports: list[dict], spec: Spec) -> dict:
    """A class in Gradescope's results.json format: one test per student (name = the student,
    score = the student's score, output = status and reason)."""
    return {
        "output": f"Graded {len(reports)} submission(s) against {spec.name} "
        f"(target {spec.target_val_acc}, budget {spec.time_budget_s:g} s, {spec.nprocs} processes)",
        "execution_time": round(sum(r.get("grading_s") or 0 for r in reports)),
        "tests": [
            {
                "name": r["student"],
                "score": score(r, spec),
                "max_score": float(spec.points),
                "status": "passed" if r["status"] == "passed" else "failed",
                "output": f"{r['status']}: {r['reason']}",
                "visibility": "after_published",
            }
            for r in reports
        ],
        "visibility": "after_published",
        "stdout_visibility": "hidden",
    }


def write_gradescope(doc: dict, path: str | Path) -> None:
    atomic_write(path, json.dumps(doc, indent=1))


class NoBudget(ValueError):
    """No time budget separates the one-process run from the reference: the reason, in words."""


def propose_budget(serial_s: float, reference_s: float, margin: float) -> int:
    """The time budget, in whole seconds, that fails a run taking ``serial_s`` and passes one taking
    ``reference_s``: their geometric mean sqrt(serial_s x reference_s), rounded down, so that it sits
    as many times above the reference as below the serial run. Proposed only when it leaves both at
    least ``margin`` away, reference_s x margin <= budget <= serial_s / margin (which needs
    serial_s / reference_s >= margin ** 2); otherwise :class:`NoBudget` says why."""
    if not (serial_s > 0 and reference_s > 0 and margin >= 1):
        raise ValueError(f"times must be > 0 and margin >= 1, got {serial_s}, {reference_s}, {margin}")
    budget = math.floor(math.sqrt(serial_s * reference_s))
    if reference_s * margin <= budget and budget * margin <= serial_s:
        return budget
    raise NoBudget(
        f"one process took {serial_s:.1f} s, {serial_s / reference_s:.2f}x the reference's {reference_s:.1f} s, "
        f"and a budget {margin:g}x away from both needs {margin * margin:.2f}x or more. Try: a spec where "
        "training outweighs start-up (more data, a wider model or more epochs in the reference)"
    )


def _spread(times: list[float]) -> dict:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "times_s": times}


def summarize_calibration(serial: list[dict], reference: list[dict], spec: Spec, margin: float) -> dict:
    """The calibration from graded reports: ``serial`` (the reference graded as one process) and
    ``reference`` (as ``spec.nprocs`` processes). The budget is :func:`propose_budget` of the FASTEST
    one-process run and the SLOWEST reference run; ``problem`` says why there is none."""
    out: dict = {"spec": spec.name, "nprocs": spec.nprocs, "margin": margin}
    ref_ok = [r for r in reference if r["status"] == "passed"]
    ser_ok = [r for r in serial if r["exit_code"] == 0 and not r["timed_out"] and r["accuracy"] is not None]
    if not reference or not serial:
        out["problem"] = "nothing was timed: give at least one repeat"
        return out
    if len(ref_ok) < len(reference):
        bad = next(r for r in reference if r["status"] != "passed")
        out["problem"] = f"the reference solution must pass every run, and one did not: {bad['reason']}"
        return out
    if len(ser_ok) < len(serial):  # it fails the ranks check by design; it must still run to the end
        bad = next(r for r in serial if r["exit_code"] != 0 or r["timed_out"] or r["accuracy"] is None)
        out["problem"] = f"the one-process run of the reference did not complete: {bad['reason']}"
        return out
    out["reference"] = {**_spread([r["time_s"] for r in ref_ok]), "min_accuracy": min(r["accuracy"] for r in ref_ok)}
    out["serial"] = {**_spread([r["time_s"] for r in ser_ok]), "min_accuracy": min(r["accuracy"] for r in ser_ok)}
    try:
        out["proposed_budget_s"] = propose_budget(out["serial"]["min_s"], out["reference"]["max_s"], margin)
    except NoBudget as e:
        out["problem"] = str(e)
    return out


def calibrate(
    spec: Spec,
    *,
    repeats: int = CALIBRATE_REPEATS,
    solution: str | Path = REFERENCE_SOLUTION,
    margin: float = CALIBRATE_MARGIN,
    progress: Callable[[str], Any] = print,
) -> dict:
    """Time the reference solution on this machine, under the spec's rules with a loose deadline,
    ``repeats`` times each way, alternating: as ONE process (the spec with nprocs = 1: the same
    script, data and epochs, the serial baseline) and as ``spec.nprocs`` processes. Then
    :func:`summarize_calibration`, plus this machine's description and a ``calibrated_on`` line."""
    loose = spec.replace(time_budget_s=max(spec.time_budget_s * 10, 600))
    runs: dict[str, list] = {"serial": [], "reference": []}
    for i in range(repeats):
        for kind, s in (("serial", loose.replace(nprocs=1)), ("reference", loose)):
            r = grade(solution, s, student=f"{kind}-{i}")
            runs[kind].append(r)
            if progress:
                acc = r["accuracy"] if r["accuracy"] is not None else float("nan")
                progress(
                    f"{kind:<9} run {i + 1}/{repeats}: {s.nprocs} process(es), {r['status']:<7} "
                    f"{r['time_s'] or float('nan'):7.1f} s  accuracy {acc:.4f}"
                )
    out = summarize_calibration(runs["serial"], runs["reference"], spec, margin)
    out["hardware"] = info = grader_info()
    if "proposed_budget_s" in out:
        where = ", ".join(info["gpus"]) or f"{info['cpu_cores']} CPU cores"
        out["calibrated_on"] = (
            f"{where}, torch {info['torch']}, {datetime.date.today()}: one process "
            f"{out['serial']['min_s']:.1f}-{out['serial']['max_s']:.1f} s, reference "
            f"{out['reference']['min_s']:.1f}-{out['reference']['max_s']:.1f} s, margin {margin:g}"
        )
    return out
