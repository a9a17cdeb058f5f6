"""The time budget's calibration, on numbers: no process starts here.

Oracles: hand-computed budgets for the rule (the geometric mean of the fastest one-process run and
the slowest reference run, rounded down, at least `margin` from each); and the grader's own
verdict (core.judge_run, core.judge_result, core.verdict) on runs that take the measured times,
which must fail the one-process time and pass the reference's under the proposed budget.
"""

from __future__ import annotations

import math

import pytest

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from utils.grader import core, sandbox
from utils.grader.batch import NoBudget, gradescope_result, propose_budget, summarize_calibration
from utils.grader.cli import calibration_text, summary
from utils.grader.spec import ROOT, load_spec

GPU_SPEC = ROOT / "labs" / "assessment" / "spec_gpu.toml"
CI_SPEC = ROOT / "labs" / "assessment" / "spec_ci.toml"


# ----------------------------------------------------------------------------------------
# The rule, on hand-computed values
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "serial_s, reference_s, margin, budget",
    [
        (200.0, 50.0, 1.5, 100),  # sqrt(10,000) = 100: 75 <= 100 and 150 <= 200
        (90.0, 40.0, 1.5, 60),  # sqrt(3,600) = 60: exactly 1.5x from each (60 = 40 x 1.5, 90 = 60 x 1.5)
        (120.0, 65.0, 1.2, 88),  # sqrt(7,800) = 88.3, down to 88: 78 <= 88 and 105.6 <= 120
    ],
)
def test_the_budget_is_the_geometric_mean_rounded_down(serial_s, reference_s, margin, budget):
    assert propose_budget(serial_s, reference_s, margin) == budget


@pytest.mark.parametrize(
    "serial_s, reference_s, margin",
    [
        (100.0, 80.0, 1.2),  # 1.25x apart, under 1.2^2 = 1.44
        (14.3, 27.6, 1.2),  # one process faster than two (spec_ci.toml's measurement)
        (59.9, 26.6, 1.5),  # 2.25x apart, but sqrt = 39.9 rounds down to 39 < 26.6 x 1.5 = 39.9
    ],
)
def test_no_budget_is_proposed_when_none_leaves_the_margin(serial_s, reference_s, margin):
    with pytest.raises(NoBudget, match=r"needs .*x or more\. Try: "):
        propose_budget(serial_s, reference_s, margin)


def test_nonsense_inputs_are_refused():
    for args in ((0.0, 10.0, 1.2), (10.0, -1.0, 1.2), (100.0, 10.0, 0.9)):
        with pytest.raises(ValueError):
            propose_budget(*args)


def _report(time_s: float, status: str = "passed", accuracy: float = 0.62, exit_code: int = 0) -> dict:
    return {
        "time_s": time_s,
        "status": status,
        "accuracy": accuracy,
        "exit_code": exit_code,
        "timed_out": False,
        "reason": f"{status} in {time_s} s",
    }


def test_the_calibration_takes_the_fastest_one_process_run_and_the_slowest_reference():
    spec = load_spec(CI_SPEC)
    # The one-process runs fail the grade (1 rank, no DDP) but run to the end: only that counts.
    serial = [_report(t, "failed", 0.64) for t in (130.0, 121.0, 125.0)]
    reference = [_report(t, accuracy=a) for t, a in ((60.0, 0.63), (66.0, 0.61), (63.0, 0.62))]
    out = summarize_calibration(serial, reference, spec, 1.2)
    assert out["serial"]["median_s"] == 125.0 and (out["serial"]["min_s"], out["serial"]["max_s"]) == (121.0, 130.0)
    assert out["reference"]["median_s"] == 63.0 and out["reference"]["min_accuracy"] == 0.61
    # sqrt(121 x 66) = sqrt(7,986) = 89.4, down to 89: 66 x 1.2 = 79.2 <= 89 and 89 x 1.2 = 106.8 <= 121
    assert out["proposed_budget_s"] == 89 and "problem" not in out


def test_the_calibration_refuses_a_failing_reference_or_an_unfinished_one_process_run():
    spec = load_spec(CI_SPEC)
    ok_serial, ok_ref = [_report(120.0, "failed")], [_report(60.0)]
    out = summarize_calibration(ok_serial, [_report(60.0, "failed", 0.4)], spec, 1.2)
    assert "proposed_budget_s" not in out and "reference solution must pass" in out["problem"]
    out = summarize_calibration([_report(120.0, "error", None, exit_code=1)], ok_ref, spec, 1.2)
    assert "proposed_budget_s" not in out and "did not complete" in out["problem"]
    out = summarize_calibration([_report(70.0, "failed")], ok_ref, spec, 1.2)
    assert "proposed_budget_s" not in out and "1.17x the reference's 60.0 s" in out["problem"]


# ----------------------------------------------------------------------------------------
# The rule through the grader's own verdict
# ----------------------------------------------------------------------------------------


def graded(needs_s: float, spec, accuracy: float) -> dict:
    """The grader's report on a run that needs ``needs_s`` seconds and is otherwise right: every
    rank measured, data-parallel, the given accuracy. The sandbox kills a job at its budget, so a
    run that needs longer ends timed out at the budget with no exit code (test_grader's
    test_a_hanging_job_is_killed_at_its_deadline holds sandbox.run to that)."""
    over = needs_s > spec.time_budget_s
    res = sandbox.RunResult(
        returncode=None if over else 0,
        wall_s=spec.time_budget_s if over else needs_s,
        timed_out=over,
        messages=[],
        workers=[],
        stragglers=[],
        leftovers=[],
    )
    report = {
        "reasons": [],
        "accuracy": accuracy,
        "time_s": res.wall_s,
        "ranks_measured": spec.nprocs,
        "data_parallel": True,
    }
    logs = {"launcher": "", **{str(r): {"stdout": "", "stderr": ""} for r in range(spec.nprocs)}}
    core.judge_run(res, logs, spec, report)
    core.judge_result(res, {"problems": []}, [], spec, report)
    core.verdict(report, spec)
    return report


@pytest.mark.parametrize(
    "serial_times, reference_times",
    [
        ([130.0, 121.0, 125.0], [60.0, 66.0, 63.0]),
        ([200.0, 210.0], [50.0, 52.0]),
        ([90.0], [40.0]),  # the budget exactly 1.5x from each at margin 1.5
    ],
)
def test_under_the_proposed_budget_the_one_process_time_fails_and_the_reference_passes(serial_times, reference_times):
    """Even granted every rank and the target, a run as slow as one process fails on time; the
    reference, at its slowest, passes."""
    base = load_spec(GPU_SPEC)
    margin = 1.5 if serial_times == [90.0] else 1.2
    out = summarize_calibration(
        [_report(t, "failed") for t in serial_times], [_report(t) for t in reference_times], base, margin
    )
    spec = base.replace(time_budget_s=out["proposed_budget_s"], calibrated_on="measured")
    above = spec.target_val_acc + 0.05
    for t in serial_times:
        r = graded(t, spec, above)
        assert r["status"] != "passed" and [x["code"] for x in r["reasons"]] == ["timeout"], r["reason"]
        assert f"after the {spec.time_budget_s:g} s budget" in r["reason"]
    for t in reference_times:
        r = graded(t, spec, above)
        assert r["status"] == "passed", r["reason"]
        assert f"<= {spec.time_budget_s:g} s with {spec.nprocs} ranks" in r["reason"]
    # The margin is real: a one-process run up to margin x faster than the fastest measured still
    # fails, and a reference run up to margin x slower than the slowest measured still passes.
    assert graded(min(serial_times) / margin + 0.01, spec, above)["status"] != "passed"
    assert graded(max(reference_times) * margin, spec, above)["status"] == "passed"


def test_a_run_that_ends_past_the_budget_without_being_killed_fails_on_time():
    spec = load_spec(GPU_SPEC).replace(time_budget_s=89, calibrated_on="measured")
    report = {"reasons": [], "accuracy": 0.7, "time_s": 89.4, "ranks_measured": 2, "data_parallel": True}
    res = sandbox.RunResult(0, 89.4, False, [], [], [], [])  # it exited between two of the sandbox's ticks
    core.judge_result(res, {"problems": []}, [], spec, report)
    core.verdict(report, spec)
    assert report["status"] == "failed" and [x["code"] for x in report["reasons"]] == ["time"], report


# ----------------------------------------------------------------------------------------
# What the instructor sees
# ----------------------------------------------------------------------------------------


def test_calibrate_prints_both_times_the_rule_and_the_lines_to_paste():
    spec = load_spec(GPU_SPEC)
    out = summarize_calibration(
        [_report(t, "failed", 0.64) for t in (130.0, 121.0, 125.0)],
        [_report(t) for t in (60.0, 66.0, 63.0)],
        spec,
        1.2,
    )
    out["calibrated_on"] = "2 x NVIDIA H100, torch 2.11, 2025-06-01: one process 121.0-130.0 s, reference 60.0-66.0 s"
    text = calibration_text(out, "spec_gpu.toml", spec.target_val_acc)
    assert "one process:" in text and "median 125.0 s, spread 121.0-130.0 s over 3 run(s)" in text
    assert "reference, 2 processes:" in text and "median 63.0 s, spread 60.0-66.0 s" in text
    assert "proposed time_budget_s = 89: the geometric mean" in text and "at least 1.2x from each" in text
    pasted = tomllib.loads("\n".join(text.splitlines()[-2:]))  # the last two lines are TOML for the spec
    assert pasted == {"time_budget_s": 89, "calibrated_on": out["calibrated_on"]}
    calibrated = spec.replace(**pasted)
    assert calibrated.budget_note() is None


def test_calibrate_says_why_it_proposes_nothing():
    out = summarize_calibration([_report(14.3, "failed")], [_report(27.6)], load_spec(CI_SPEC), 1.2)
    text = calibration_text(out, "spec_ci.toml", 0.95)
    assert "proposed time_budget_s" not in text and "no budget proposed: one process took 14.3 s" in text


def test_every_report_says_when_the_budget_is_not_calibrated():
    for path in (GPU_SPEC, CI_SPEC):  # both leave calibrated_on empty (their comments say why)
        spec = load_spec(path)
        note = spec.budget_note()
        assert note and f"{spec.time_budget_s:g} s was not calibrated" in note and "utils.grader calibrate" in note
        report = {
            "student": "s",
            "status": "passed",
            "accuracy": 0.99,
            "target_val_acc": spec.target_val_acc,
            "time_s": 20.0,
            "time_budget_s": spec.time_budget_s,
            "ranks_measured": spec.nprocs,
            "nprocs_required": spec.nprocs,
            "reasons": [],
            "reason": "passed",
            "budget_note": note,
        }
        shown = summary(report)
        assert f"  note: {note}" in shown.splitlines() and report["status"] == "passed"
        assert max(len(line) for line in shown.splitlines()) < 200
        assert note in gradescope_result(report, spec)["output"]
    assert math.isclose(load_spec(GPU_SPEC).time_budget_s, 120), "spec_gpu.toml keeps its placeholder"
