"""``python -m utils.grader run|batch|gradescope|zip|calibrate|data``: the grader's command line.

Exit status: 0 when the submission(s) were graded, whatever the grade (a failing grade is a
result, written to the report, not an error of the command); 2 for a usage or spec error;
3 when no sandbox can isolate a submission on this machine (nothing was run). ``run --strict``
exits 1 when the one submission did not pass, for scripts that want that."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .spec import CALIBRATE_MARGIN, CALIBRATE_REPEATS, REFERENCE_SOLUTION, SpecError, default_spec_path, load_spec


def _spec(args):
    overrides = {}
    if getattr(args, "budget", None) is not None:
        overrides["time_budget_s"] = args.budget
    spec = load_spec(args.spec, **overrides)
    if spec.secret_missing():
        raise SpecError(spec.secret_missing())
    return spec


def cmd_run(args: argparse.Namespace) -> int:
    from .batch import gradescope_result, score, write_gradescope
    from .core import grade, write_json

    spec = _spec(args)
    r = grade(args.submission, spec, keep=args.keep, workroot=args.workroot)
    r["score"] = score(r, spec)
    if args.json:
        write_json(r, args.json)
    if args.gradescope:
        write_gradescope(gradescope_result(r, spec), args.gradescope)
    print(summary(r, verbose=args.verbose))
    return 1 if args.strict and r["status"] != "passed" else 0


def summary(r: dict, verbose: bool = False) -> str:
    acc = f"{r['accuracy']:.4f}" if r["accuracy"] is not None else "-"
    t = f"{r['time_s']:.1f} s" if r["time_s"] is not None else "-"
    lines = [
        f"{r['student']}: {r['status'].upper()}",
        f"  accuracy {acc} (target {r['target_val_acc']}), time {t} (budget {r['time_budget_s']:g} s), "
        f"ranks measured {r['ranks_measured']} of {r['nprocs_required']}",
    ]
    lines += [f"  - {x['message']}" for x in r["reasons"]] or [f"  {r['reason']}"]
    lines += [f"  note: {w}" for w in r.get("static_warnings", [])]
    if r.get("budget_note"):
        lines.append(f"  note: {r['budget_note']}")
    iso = r.get("isolation") or {}
    if iso:
        lines.append("  sandbox in force:")
        lines += [f"    {x}" for x in iso.get("in_force", [])]
        if iso.get("not_in_force"):
            lines.append("  sandbox NOT in force:")
            lines += [f"    {x}" for x in iso["not_in_force"]]
    if verbose:
        for rank, logs in sorted((r.get("logs") or {}).items()):
            if isinstance(logs, dict):
                for kind in ("stdout", "stderr"):
                    if logs.get(kind, "").strip():
                        lines.append(f"  --- rank {rank} {kind} (tail) ---\n{logs[kind].rstrip()}")
    return "\n".join(lines)


def cmd_batch(args: argparse.Namespace) -> int:
    from .batch import (
        CANVAS_IDS,
        find_submissions,
        grade_many,
        gradescope_batch,
        write_feedback,
        write_gradebook,
        write_gradescope,
        write_platform_csv,
    )

    spec = _spec(args)
    if args.platform_csv and args.platform == "canvas" and args.id_column not in CANVAS_IDS:
        print(f"--id-column: Canvas matches students by one of {', '.join(CANVAS_IDS)}", file=sys.stderr)
        return 2
    subs = find_submissions(args.folder)
    if not subs:
        print(f"no submissions in {args.folder} (expected one .py file or one folder per student)", file=sys.stderr)
        return 2
    print(f"grading {len(subs)} submission(s) with {spec.name}, {args.jobs} at a time", flush=True)
    if spec.budget_note():
        print(f"note: {spec.budget_note()}", flush=True)
    reports = grade_many(
        subs,
        spec,
        jobs=args.jobs,
        report_dir=args.reports,
        workroot=args.workroot,
        progress=lambda s: print(s, flush=True),
    )
    write_gradebook(reports, args.csv)
    print(f"gradebook: {args.csv}")
    if args.gradescope:
        write_gradescope(gradescope_batch(reports, spec), args.gradescope)
        print(f"Gradescope results: {args.gradescope}")
    if args.platform_csv:
        write_platform_csv(reports, args.platform_csv, spec, platform=args.platform, id_column=args.id_column)
        print(f"{args.platform} gradebook: {args.platform_csv}")
    if args.feedback:
        write_feedback(reports, args.feedback, spec)
        print(f"feedback pages: {args.feedback}/<student>.html")
    passed = sum(r["status"] == "passed" for r in reports)
    print(f"{passed} of {len(reports)} passed")
    return 0


def cmd_gradescope(args: argparse.Namespace) -> int:
    from .gradescope import run

    spec_path = args.spec or (Path(args.root) / "source" / "spec.toml")
    spec = load_spec(spec_path if Path(spec_path).exists() or args.spec else None)
    if spec.secret_missing():
        raise SpecError(spec.secret_missing())
    doc = run(args.root, spec)
    print(f"{Path(args.root) / 'results' / 'results.json'}: score {doc['score']:g}")
    return 0 if doc.get("tests") else 3


def cmd_zip(args: argparse.Namespace) -> int:
    from .gradescope import build_zip

    spec = load_spec(args.spec)  # validated before it is packed
    names = build_zip(args.out, spec.path)
    print(
        f"wrote {args.out} ({len(names)} files; setup.sh and run_autograder at its root, spec "
        f"{spec.path} as spec.toml): upload it as the assignment's autograder on Gradescope"
    )
    if spec.secret_missing():
        print(f"warning: {spec.secret_missing()}", file=sys.stderr)
    return 0


def calibration_text(out: dict, spec_path: str, target: float) -> str:
    """What ``calibrate`` prints: both runs' times (median and spread), the proposed budget and the
    rule, and the two lines to put in the spec; or why no budget can be proposed."""
    lines = []
    for kind, what in (("serial", "one process"), ("reference", f"reference, {out['nprocs']} processes")):
        t = out.get(kind)
        if t:
            lines.append(
                f"{what + ':':<28} median {t['median_s']:.1f} s, spread {t['min_s']:.1f}-{t['max_s']:.1f} s "
                f"over {len(t['times_s'])} run(s), lowest accuracy {t['min_accuracy']:.4f}"
            )
    if "proposed_budget_s" not in out:
        lines.append(f"no budget proposed: {out['problem']}")
        return "\n".join(lines)
    m = out["margin"]
    lines.append(
        f"proposed time_budget_s = {out['proposed_budget_s']}: the geometric mean of the fastest one-process "
        f"run and the slowest reference run, rounded down, at least {m:g}x from each"
    )
    if out["serial"]["min_accuracy"] < target:
        lines.append(f"  (one process stayed below the target {target}: it needs longer still)")
    elif out["reference"]["min_accuracy"] - target > 0.05:
        lines.append(
            f"  (the reference reaches {out['reference']['min_accuracy']:.4f}, well above the target {target}: "
            "a one-process script that trains less may fit the budget; raise the target or cut the reference's epochs)"
        )
    lines += [
        f"set in {spec_path}:",
        f"time_budget_s = {out['proposed_budget_s']}",
        f"calibrated_on = {json.dumps(out['calibrated_on'])}",
    ]
    return "\n".join(lines)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from .batch import calibrate

    spec = _spec(args)
    out = calibrate(
        spec, repeats=args.repeats, solution=args.solution, margin=args.margin, progress=lambda s: print(s, flush=True)
    )
    if args.json:
        from .core import write_json

        write_json(out, args.json)
    text = calibration_text(out, spec.path, spec.target_val_acc)
    if "proposed_budget_s" in out:
        print(text)
        return 0
    print(text, file=sys.stderr)
    return 1


def cmd_data(args: argparse.Namespace) -> int:
    import shutil

    from .core import prepare_data

    spec = _spec(args)
    out = Path(args.folder)
    out.mkdir(parents=True, exist_ok=True)
    train_npz, _ = prepare_data(spec)
    shutil.copy(train_npz, out / "train.npz")
    (out / "assessment.json").write_text(json.dumps(spec.public(), indent=1))
    print(
        f"wrote {out / 'train.npz'} and {out / 'assessment.json'} (the training split only, as the "
        f"grader gives it); now: torchrun --standalone --nproc-per-node {spec.nprocs} "
        f"assessment.py --data-dir {out} --out model.pt"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m utils.grader", description="Grade the assessment: convert a serial script to DDP."
    )
    sub = p.add_subparsers(dest="command", required=True)
    spec_help = f"assessment spec (TOML; default {default_spec_path().name} for this profile)"

    r = sub.add_parser("run", help="grade one submission")
    r.add_argument("submission", help="the student's .py file, or a folder with assessment.py")
    r.add_argument("--spec", help=spec_help)
    r.add_argument("--json", help="write the full report here")
    r.add_argument("--gradescope", help="write Gradescope's results.json here")
    r.add_argument("--budget", type=float, help="override the spec's time budget (seconds)")
    r.add_argument("--keep", action="store_true", help="keep the working directory")
    r.add_argument("--workroot", help="where job dirs go (default: the system temp dir)")
    r.add_argument("-v", "--verbose", action="store_true", help="print the tail of each rank's log")
    r.add_argument("--strict", action="store_true", help="exit 1 when the submission did not pass")
    r.set_defaults(fn=cmd_run)

    b = sub.add_parser("batch", help="grade a folder of submissions (one .py or folder per student)")
    b.add_argument("folder")
    b.add_argument("--spec", help=spec_help)
    b.add_argument("--csv", required=True, help="the gradebook to write")
    b.add_argument("--gradescope", help="write a Gradescope-format results.json for the class")
    b.add_argument("--reports", help="folder for one JSON report per student")
    b.add_argument("--platform-csv", help="write the grades as a learning platform imports them")
    b.add_argument("--platform", choices=("canvas", "generic"), default="canvas", help="that file's format")
    b.add_argument(
        "--id-column",
        default="SIS Login ID",
        help="the column holding the submission's name: for canvas one of ID, SIS User ID, SIS Login ID",
    )
    b.add_argument("--feedback", help="folder for one HTML feedback page per student")
    b.add_argument("--jobs", type=int, default=1, help="submissions graded at once (GPUs are divided)")
    b.add_argument("--budget", type=float, help="override the spec's time budget (seconds)")
    b.add_argument("--workroot", help="where job dirs go (default: the system temp dir)")
    b.set_defaults(fn=cmd_batch)

    g = sub.add_parser(
        "gradescope", help="inside a Gradescope autograder: grade ROOT/submission, write ROOT/results/results.json"
    )
    g.add_argument("--root", default="/autograder")
    g.add_argument("--spec", help="default: ROOT/source/spec.toml, else " + default_spec_path().name)
    g.set_defaults(fn=cmd_gradescope)

    z = sub.add_parser("zip", help="build the Gradescope autograder zip (make gradescope)")
    z.add_argument("--spec", help=spec_help)
    z.add_argument("--out", default="build/gradescope-autograder.zip")
    z.set_defaults(fn=cmd_zip)

    c = sub.add_parser(
        "calibrate",
        help="time the reference as one process and as nprocs processes; propose a budget between them",
    )
    c.add_argument("--spec", help=spec_help)
    c.add_argument("--repeats", type=int, default=CALIBRATE_REPEATS, help="runs of each kind (default %(default)s)")
    c.add_argument(
        "--margin",
        type=float,
        default=CALIBRATE_MARGIN,
        help="how far the budget must sit from each kind's worst run, as a factor (default %(default)s)",
    )
    c.add_argument("--solution", default=str(REFERENCE_SOLUTION))
    c.add_argument("--json", help="write the measurements here")
    c.set_defaults(fn=cmd_calibrate)

    d = sub.add_parser("data", help="write the training split the grader gives, to run your script yourself")
    d.add_argument("folder")
    d.add_argument("--spec", help=spec_help)
    d.set_defaults(fn=cmd_data)

    args = p.parse_args(argv)
    if getattr(args, "jobs", 1) < 1:
        p.error("--jobs must be >= 1")
    if getattr(args, "repeats", 1) < 1 or getattr(args, "margin", 1.0) < 1.0:
        p.error("--repeats must be >= 1 and --margin >= 1")
    from .sandbox import SandboxUnavailable

    try:
        return args.fn(args)
    except (SpecError, NotADirectoryError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SandboxUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
