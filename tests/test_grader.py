"""The assessment grader (utils.grader) with the CI spec: digits, CPU, gloo, 2 processes.

Oracles: the reference solution must pass and the unchanged serial script must fail; every bad
input is graded with its reason, the grader exits normally, and no process of a submission is
left. One graded run of the reference and of the serial script is shared (module fixture,
graded concurrently); the bad inputs are graded in ONE `batch` command. The hostile
submissions (a student who read the grader's source) are in test_grader_attacks.py.
"""

from __future__ import annotations

import csv
import html
import json
import os
import subprocess
import sys
import textwrap
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import utils.models
from utils.grader import batch, sandbox, weights
from utils.grader.batch import gradescope_batch, gradescope_result
from utils.grader.core import grade, write_json
from utils.grader.gradescope import build_zip
from utils.grader.spec import REFERENCE_SOLUTION, ROOT, SERIAL_SCRIPT, SpecError, load_spec
from utils.grader.static import check_source

# Every test grades in the sandbox or starts the grader: sandbox and slow (make check leaves them out).
pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the grader watches /proc"),
]

CI_SPEC = ROOT / "labs" / "assessment" / "spec_ci.toml"


@pytest.fixture(scope="module")
def spec():
    """The CI spec with a hang ceiling for this module: its two graded runs share the 2 cores with
    the class of bad inputs (3 jobs) and, under xdist, another file's graded jobs, up to 16 ranks
    at once; the spec's 90 s is a ceiling for a class graded two at a time."""
    return load_spec(CI_SPEC, time_budget_s=REFERENCE_BUDGET_S)


@pytest.fixture(scope="module")
def batch_run(spec, tmp_path_factory):
    """Start grading the class of bad inputs (one `batch` command, in the background), so that
    it overlaps with the graded runs below; test_batch_... waits for it."""
    tmp_path = tmp_path_factory.mktemp("class")
    subs = tmp_path / "class"
    subs.mkdir()
    for name, code in BAD_SCRIPTS.items():
        (subs / f"{name}.py").write_text(code)
    payloads = _payloads(spec, tmp_path)
    for name in ("pickle_exploit", "wrong_keys", "nan_weights"):
        (subs / name).mkdir()
        (subs / name / "assessment.py").write_text(COPY_PAYLOAD)
        (subs / name / "payload.pt").write_bytes(payloads[name].read_bytes())
    test_spec = tmp_path / "spec.toml"
    test_spec.write_text(
        CI_SPEC.read_text()
        .replace("time_budget_s = 90", f"time_budget_s = {HANG_BUDGET_S}")
        .replace("max_output_mb = 64", "max_output_mb = 2")
    )
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "utils.grader",
        "batch",
        str(subs),
        "--spec",
        str(test_spec),
        "--csv",
        str(out / "gradebook.csv"),
        "--gradescope",
        str(out / "results.json"),
        "--reports",
        str(out / "reports"),
        "--platform-csv",
        str(out / "canvas.csv"),
        "--feedback",
        str(out / "feedback"),
        "--jobs",
        "3",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield proc, tmp_path
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def graded(spec, batch_run):
    """The reference solution and the unchanged serial script, graded once, side by side."""
    with ThreadPoolExecutor(2) as pool:
        ref = pool.submit(grade, REFERENCE_SOLUTION, spec, student="reference")
        serial = pool.submit(grade, SERIAL_SCRIPT, spec, student="serial")
        return {"reference": ref.result(), "serial": serial.result()}


def codes(report) -> set[str]:
    return {r["code"] for r in report["reasons"]}


# ----------------------------------------------------------------------------------------
# The two oracles
# ----------------------------------------------------------------------------------------


def test_reference_solution_passes(graded, spec):
    r = graded["reference"]
    assert r["status"] == "passed", (
        f"the reference solution must pass the CI spec; reasons: {r['reason']}\n"
        f"rank 0 stderr:\n{r['logs'].get('0', {}).get('stderr', '')[-1500:]}"
    )
    assert r["accuracy"] >= spec.target_val_acc
    assert r["ranks_measured"] == spec.nprocs == r["workers_seen"], r["rank_evidence"]
    ev = r["rank_evidence"]
    assert r["data_parallel"] is True and ev["problems"] == [], f"data parallelism was not verified: {ev}"
    assert ev["backend_reported"] == ev["backend_expected"] == "gloo"
    steps = ev["optimizer_steps"]
    assert steps["0"] == steps["1"] > 0 and ev["reduced_bytes"]["0"] >= steps["0"] * ev["grad_bytes"] > 0, ev
    assert ev["loopback_bytes"] >= ev["reduced_bytes"]["0"], "the grader measured less traffic than was synced"
    assert ev["accuracy_when_ddp_wrapped"] < 0.3, "the reference wraps a fresh model in DDP"
    assert r["time_s"] <= spec.time_budget_s
    assert r["leftover_processes"] == [] and r["static_warnings"] == [] and r["review"] == [], r
    assert ev["ddp_fingerprints"], "rank 0's DDP weights at exit should be fingerprinted"
    shard = (1797 - spec.n_val) // spec.nprocs
    assert all(m[0][0] >= shard and m[0][1] == 0 for m in ev["ddp_models"].values()), (
        f"every epoch through DDP, weights changed only by optimizer steps: {ev['ddp_models']}"
    )
    assert "saved" in r["logs"]["0"]["stdout"], "the tail of rank 0's log should be in the report"
    assert r["isolation"]["in_force"] and all(
        len(x) <= 100 for x in r["isolation"]["in_force"] + r["isolation"]["not_in_force"]
    ), "short isolation lines"
    assert len(r["sha256"]) == 64


def test_unchanged_serial_script_fails_on_accuracy_and_ranks(graded, spec):
    r = graded["serial"]
    # Under torchrun both copies of the serial script save through the same model.pt.tmp and
    # os.replace it: when their saves overlap, the second replace finds no file and that rank
    # crashes (seen as a normal user under bwrap on a busy box). Both verdicts are right: failed
    # on accuracy and ranks, or an error naming that crash (the ranks are not judged after one).
    if "crashed" in codes(r):
        assert r["status"] == "error" and codes(r) == {"crashed", "accuracy"}, r["reason"]
        assert "FileNotFoundError" in r["reason"] and "model.pt.tmp" in r["reason"], r["reason"]
    else:
        assert r["status"] == "failed", r["reason"]
        assert {"accuracy", "not_distributed"} <= codes(r), (
            f"the serial script must fail on accuracy and on the measured ranks, got {r['reasons']}"
        )
        assert r["ranks_measured"] == 0 and "init_process_group" in r["reason"]
    assert r["accuracy"] < spec.target_val_acc
    warnings = " ".join(r["static_warnings"])
    assert "init_process_group" in warnings and "every rank" in warnings, r["static_warnings"]


def test_the_platform_gradebook_and_feedback_of_the_reference_and_the_serial_script(graded, spec, tmp_path):
    reports = [dict(graded[k], score=batch.score(graded[k], spec)) for k in ("reference", "serial")]
    batch.write_platform_csv(reports, tmp_path / "grades.csv", spec, platform="generic", id_column="student")
    rows = {r["student"]: r for r in csv.DictReader((tmp_path / "grades.csv").open())}
    assert rows["reference"]["score"] == f"{spec.points:g}" and rows["serial"]["score"] == "0"
    batch.write_feedback(reports, tmp_path / "feedback", spec)
    assert "Every requirement was met" in (tmp_path / "feedback" / "reference.html").read_text()
    serial = (tmp_path / "feedback" / "serial.html").read_text()
    assert html.escape(batch.NEXT_STEP["accuracy"]) in serial and ("Not passed" in serial or "Not graded" in serial)


def test_reports_json_and_gradescope_format(graded, spec, tmp_path):
    write_json(graded["reference"], tmp_path / "r.json")
    back = json.loads((tmp_path / "r.json").read_text())
    assert back["status"] == "passed" and back["ranks_measured"] == 2
    one = gradescope_result(graded["serial"], spec)
    _assert_gradescope(one)
    assert one["score"] == 0 and any(t["status"] == "failed" for t in one["tests"])
    ok = gradescope_result(graded["reference"], spec)
    assert ok["score"] == spec.points == sum(t["score"] for t in ok["tests"])
    assert all(t["status"] == "passed" for t in ok["tests"]), ok["tests"]
    many = gradescope_batch([graded["reference"], graded["serial"]], spec)
    _assert_gradescope(many, per_submission=False)
    assert [t["name"] for t in many["tests"]] == ["reference", "serial"]


def _assert_gradescope(doc, per_submission=True):
    """Gradescope's autograder results.json: tests with name/status/output, numeric scores; one
    submission's file also has score, max_score and visibility on every test, and a top-level
    score equal to the sum of the tests' (nothing contradicts the total)."""
    assert set(doc) <= {
        "score",
        "execution_time",
        "output",
        "output_format",
        "test_output_format",
        "test_name_format",
        "visibility",
        "stdout_visibility",
        "extra_data",
        "tests",
        "leaderboard",
    }, sorted(doc)
    assert isinstance(doc["tests"], list) and doc["tests"]
    for t in doc["tests"]:
        assert set(t) <= {
            "score",
            "max_score",
            "status",
            "name",
            "name_format",
            "number",
            "output",
            "output_format",
            "tags",
            "visibility",
            "extra_data",
        }, sorted(t)
        assert t["status"] in ("passed", "failed") and isinstance(t["name"], str)
        for k in ("score", "max_score"):
            assert k not in t or isinstance(t[k], (int, float))
        if per_submission:
            assert {"name", "score", "max_score", "output", "visibility"} <= set(t), t
            assert (t["status"] == "passed") == (t["score"] == t["max_score"]) or t["max_score"] == 0
    if per_submission:
        assert doc["score"] == sum(t["score"] for t in doc["tests"])
    assert doc.get("visibility", "visible") in ("hidden", "after_due_date", "after_published", "visible")
    json.dumps(doc)


# ----------------------------------------------------------------------------------------
# Spec and static checks (no process started)
# ----------------------------------------------------------------------------------------


def test_spec_validation(tmp_path):
    s = load_spec(CI_SPEC, time_budget_s=5)
    assert s.time_budget_s == 5 and s.nprocs == 2 and s.dataset == "digits"
    assert load_spec(ROOT / "labs" / "assessment" / "spec_gpu.toml").dataset == "cifar10"
    bad = tmp_path / "bad.toml"
    for text, needle in [
        ("[assessment]\nname='x'\n", "missing"),
        (CI_SPEC.read_text() + "colour = 'red'\n", "unknown field"),
        (CI_SPEC.read_text().replace("nprocs = 2", "nprocs = 0"), "nprocs"),
        (CI_SPEC.read_text().replace('dataset = "digits"', 'dataset = "mnist"'), "dataset"),
        ("not toml [", "not valid TOML"),
        ("x = 1\n", "[assessment]"),
    ]:
        bad.write_text(text)
        with pytest.raises(SpecError, match=needle.replace("[", r"\[")):
            load_spec(bad)
    with pytest.raises(SpecError, match="not found"):
        load_spec(tmp_path / "missing.toml")


def test_static_checks_flag_typical_mistakes():
    assert "line 1" in check_source("def main(:\n")["syntax_error"]
    bad = check_source(
        textwrap.dedent("""
        import torch, torch.distributed as dist
        from torch.utils.data import DistributedSampler
        def main():
            dist.init_process_group("gloo")
            sampler = DistributedSampler(ds)
            model = torch.nn.parallel.DistributedDataParallel(net)
            for epoch in range(3):
                pass
            torch.save(model.module.state_dict(), "model.pt")
        """)
    )["warnings"]
    text = " ".join(bad)
    assert "set_epoch" in text and "every rank" in text and "seed" in text, bad
    assert "init_process_group" not in text and "DistributedDataParallel wrapper" not in text, bad
    good = check_source((ROOT / "solutions" / "assessment" / "assessment.py").read_text())
    assert good == {"syntax_error": None, "warnings": []}, good
    early_return = check_source(
        textwrap.dedent("""
        import torch
        def main(rank):
            torch.manual_seed(0)
            sampler.set_epoch(0)
            if rank != 0:
                return
            torch.save(sd, "model.pt")
        """)
    )["warnings"]
    assert not any("every rank" in w for w in early_return), early_return


# ----------------------------------------------------------------------------------------
# The model file, checked without running anything
# ----------------------------------------------------------------------------------------


class _RunsCodeWhenUnpickled:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _good_state(spec):
    from utils.data import load

    shape = load("digits").shape
    return utils.models.build(spec.model, shape, **spec.model_kwargs).state_dict(), shape


def _payloads(spec, tmp_path) -> dict[str, Path]:
    """Model files for each bad case, written with torch.save as a student would."""
    sd, shape = _good_state(spec)
    marker = tmp_path / "CODE_WAS_RUN"
    cases = {
        "pickle_exploit": {**sd, "conv1.weight": _RunsCodeWhenUnpickled(marker)},
        "wrong_keys": utils.models.LinearModel(64, 10).state_dict(),
        "wrong_shapes": utils.models.build(spec.model, shape, width=8).state_dict(),
        "nan_weights": {k: v.clone().fill_(float("nan")) if k == "fc1.weight" else v for k, v in sd.items()},
        "ddp_prefix": {f"module.{k}": v for k, v in sd.items()},
        "whole_model": utils.models.build(spec.model, shape, **spec.model_kwargs),
    }
    paths = {}
    for name, obj in cases.items():
        paths[name] = tmp_path / f"{name}.pt"
        torch.save(obj, paths[name])
    (tmp_path / "not_a_zip.pt").write_bytes(b"\x80\x04K\x01." * 10)
    paths["not_a_zip"] = tmp_path / "not_a_zip.pt"
    with zipfile.ZipFile(tmp_path / "zipbomb.pt", "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", b"\0" * (4 << 20))
    paths["zipbomb"] = tmp_path / "zipbomb.pt"
    return paths


@pytest.mark.parametrize(
    "case, code, words",
    [
        ("pickle_exploit", "unsafe_checkpoint", "NOT executed"),
        ("whole_model", "unsafe_checkpoint", "state_dict()"),
        ("wrong_keys", "wrong_keys", "missing"),
        ("ddp_prefix", "wrong_keys", "model.module.state_dict()"),
        ("wrong_shapes", "wrong_shapes", "conv1.weight"),
        ("nan_weights", "nan_weights", "fc1.weight"),
        ("not_a_zip", "bad_checkpoint", "torch.save"),
        ("zipbomb", "bad_checkpoint", "compressed"),
    ],
)
def test_checkpoint_rejections(spec, tmp_path, case, code, words):
    path = _payloads(spec, tmp_path)[case]
    heldout = load_heldout()
    with pytest.raises(weights.CheckpointRejected) as e:
        sd = weights.load_state_dict(path, 64 << 20)
        weights.evaluate(spec, sd, heldout)
    assert e.value.code == code and words in str(e.value), f"{case}: {e.value.code}: {e.value}"
    assert not (tmp_path / "CODE_WAS_RUN").exists(), "loading the checkpoint ran the attacker's code"
    with pytest.raises(weights.CheckpointRejected, match="over the"):
        weights.load_state_dict(path, 16)


def load_heldout():
    from utils.data import load

    return load("digits").val


# ----------------------------------------------------------------------------------------
# Every bad input, graded in one `batch` command
# ----------------------------------------------------------------------------------------

COPY_PAYLOAD = """
import os, shutil, sys
out = sys.argv[sys.argv.index("--out") + 1]
if os.environ.get("RANK", "0") == "0":
    shutil.copy(os.path.join(os.path.dirname(os.path.abspath(__file__)), "payload.pt"), out)
"""

BAD_SCRIPTS = {
    "syntax_error": "def main(:\n    pass\n",
    "import_error": "import no_such_module_for_the_grader_test\n",
    "one_rank_crash": "import os, time\nif os.environ.get('RANK') == '1':\n"
    "    raise RuntimeError('rank 1 lost its shard')\ntime.sleep(600)\n",
    "hang": "import time\ntime.sleep(600)\n",
    "print_forever": "while True:\n    print('accuracy 1.0 ' * 100)\n",
    "huge_file": "import sys\nout = sys.argv[sys.argv.index('--out') + 1]\nwith open(out, 'wb') as f:\n"
    "    for _ in range(4096):\n        f.write(bytes(1 << 20))    # 4 GiB\n",
    "no_output": "print('final validation accuracy: 0.999')\n",
    "background_child": "import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', "
    "'import time; time.sleep(600)'], start_new_session=True)\n",
    # Exits without a traceback: the student's own last words on stderr are the feedback.
    "system_exit": "raise SystemExit('stopping: CRASH-CAUSE-A lr must be positive')\n",
    "argparse_error": "import argparse\np = argparse.ArgumentParser()\np.add_argument('--data-dir')\n"
    "p.add_argument('--out')\np.add_argument('--epochs', required=True)\np.parse_args()\n",
    "exit_message_long": "import sys\nsys.stderr.write('noise ' * 2000 + '\\n')\n"
    "sys.exit('CRASH-CAUSE-C ' + 'y' * 1000)\n",
}

REFERENCE_BUDGET_S = 300  # the reference and the serial script (spec fixture)
HANG_BUDGET_S = 45  # the bad inputs' budget: long enough for torchrun to start on a busy 2-core box

# student -> (status, reason code that must be among the reasons, words in the reason)
EXPECTED = {
    "syntax_error": ("error", "syntax_error", "line 1"),
    "import_error": ("error", "crashed", "no_such_module_for_the_grader_test"),
    "one_rank_crash": ("error", "crashed", "rank 1: RuntimeError: rank 1 lost its shard (assessment.py, line 3)"),
    "hang": ("error", "timeout", "budget"),
    "print_forever": ("error", "output_limit", "MiB limit"),
    "huge_file": ("error", "output_limit", "MiB limit"),
    "no_output": ("error", "no_output", "without writing model.pt"),
    "background_child": ("error", "background_processes", "still running"),
    "system_exit": (
        "error",
        "crashed",
        "without a Python traceback; the last lines it wrote to stderr: stopping: CRASH-CAUSE-A lr must be positive",
    ),
    "argparse_error": ("error", "crashed", "error: the following arguments are required: --epochs"),
    "exit_message_long": ("error", "crashed", "CRASH-CAUSE-C yyy"),
    "pickle_exploit": ("error", "unsafe_checkpoint", "NOT executed"),
    "wrong_keys": ("error", "wrong_keys", "missing"),
    "nan_weights": ("error", "nan_weights", "NaN"),
}


def test_batch_grades_every_bad_input_with_its_reason(batch_run):
    proc, tmp_path = batch_run
    stdout, stderr = proc.communicate(timeout=300)
    out = tmp_path / "out"
    assert proc.returncode == 0, f"the grader itself must exit normally:\n{stdout}\n{stderr}"
    assert not (tmp_path / "CODE_WAS_RUN").exists(), "the pickled payload was executed"

    rows = {row["student"]: row for row in csv.DictReader((out / "gradebook.csv").open())}
    assert sorted(rows) == sorted(EXPECTED), f"one gradebook row per student, got {sorted(rows)}"
    for student, (status, code, words) in EXPECTED.items():
        report = json.loads((out / "reports" / f"{student}.json").read_text())
        assert rows[student]["status"] == status == report["status"], (student, report["reason"])
        assert code in codes(report), f"{student}: expected reason {code}, got {report['reasons']}"
        assert words in report["reason"], f"{student}: {words!r} not in {report['reason']!r}"
        assert rows[student]["reason"] == report["reason"] and rows[student]["score"] == "0"
        assert report["leftover_processes"] == [] or student == "background_child", (student, report)
    one_rank = json.loads((out / "reports" / "one_rank_crash.json").read_text())
    assert "lost its shard" in one_rank["logs"]["1"]["stderr"], "the tail of each rank's log is reported"
    # The failing rank's own error, the same words in the CSV, the JSON report and Gradescope.
    excerpt = "rank 1: RuntimeError: rank 1 lost its shard (assessment.py, line 3)"
    assert one_rank["error_excerpt"] == excerpt and excerpt in rows["one_rank_crash"]["reason"]
    gs = next(t for t in json.loads((out / "results.json").read_text())["tests"] if t["name"] == "one_rank_crash")
    assert excerpt in gs["output"]
    for student in EXPECTED:
        reason = json.loads((out / "reports" / f"{student}.json").read_text())["reason"]
        assert "rank 1: rank 1:" not in reason and "error: error" not in reason.lower(), reason
    printed = json.loads((out / "reports" / "print_forever.json").read_text())
    assert len(printed["logs"]["0"]["stdout"]) < 4000, "log tails must be capped"
    hang = json.loads((out / "reports" / "hang.json").read_text())
    assert HANG_BUDGET_S <= hang["time_s"] < HANG_BUDGET_S + 10 and hang["timed_out"] and hang["accuracy"] is None
    canvas = list(csv.reader((out / "canvas.csv").open()))
    assert canvas[0][:5] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section"]
    assert sorted(r[0] for r in canvas[2:]) == sorted(EXPECTED) and {r[5] for r in canvas[2:]} == {"0"}
    for student, (_, code, _) in EXPECTED.items():
        page = (out / "feedback" / f"{student}.html").read_text()
        assert "Not graded" in page and html.escape(batch.NEXT_STEP[code]) in page, student
    doc = json.loads((out / "results.json").read_text())
    _assert_gradescope(doc, per_submission=False)
    assert sorted(t["name"] for t in doc["tests"]) == sorted(EXPECTED)
    assert all(t["status"] == "failed" and t["score"] == 0 for t in doc["tests"])


def test_a_rank_exiting_without_a_traceback_gets_its_own_words_back(batch_run, spec):
    """SystemExit('...'), argparse's error, sys.exit('...'): no traceback, so the last lines the
    rank wrote to stderr (its own words, a few lines, each cut short) are the feedback, the same in
    the report, the gradebook and Gradescope's results.json (the class's, and the autograder's for
    one submission), and nothing of another student's or of the grader's is in it."""
    proc, tmp_path = batch_run
    proc.wait(timeout=300)
    out = tmp_path / "out"
    rows = {r["student"]: r for r in csv.DictReader((out / "gradebook.csv").open())}
    tests = {t["name"]: t for t in json.loads((out / "results.json").read_text())["tests"]}
    reports = {p.stem: json.loads(p.read_text()) for p in (out / "reports").glob("*.json")}
    words = {
        "system_exit": "stopping: CRASH-CAUSE-A lr must be positive",
        "argparse_error": "error: the following arguments are required: --epochs",
        "exit_message_long": "CRASH-CAUSE-C yyy",
    }
    for student, said in words.items():
        r = reports[student]
        one = gradescope_result(r, spec)
        surfaces = {
            "report": r["reason"],
            "excerpt": r["error_excerpt"],
            "gradebook": rows[student]["reason"],
            "results.json": tests[student]["output"],
            "autograder": one["output"],
            "autograder test": one["tests"][1]["output"],
        }
        for where, text in surfaces.items():
            assert said in text, (student, where, text)
            assert str(tmp_path) not in text and str(ROOT) not in text and "Traceback" not in text, (where, text)
        assert "rank 0: exited with code" in r["reason"] or "rank 1: exited with code" in r["reason"], r["reason"]
    assert "usage: assessment.py" in reports["argparse_error"]["reason"]
    long = reports["exit_message_long"]["reason"]
    assert "y" * 201 not in long and "noise " * 40 not in long and len(long) < 900, long
    for student, r in reports.items():  # each student's words in their own feedback only
        for other, said in words.items():
            if other != student:
                mark = next((w for w in said.split() if "CRASH" in w), said)
                seen = r["reason"] + rows[student]["reason"] + tests[student]["output"]
                assert mark not in seen, (student, other)


# ----------------------------------------------------------------------------------------
# The command line and calibration, on the shared graded run (no new process)
# ----------------------------------------------------------------------------------------


def test_cli_run_and_calibrate(graded, spec, monkeypatch, tmp_path, capsys):
    import math

    import utils.grader.batch as batch
    import utils.grader.cli as cli
    import utils.grader.core as core

    ref = graded["reference"]
    monkeypatch.setattr(core, "grade", lambda *a, **k: dict(ref))
    # calibrate grades the reference as one process (a spec with nprocs 1) and as two: the fake
    # one-process run takes 3x as long and fails the grade on its ranks, as the real one does
    monkeypatch.setattr(
        batch,
        "grade",
        lambda sub, s, **k: dict(ref, time_s=3 * ref["time_s"], status="failed") if s.nprocs == 1 else dict(ref),
    )
    assert (
        cli.main(
            [
                "run",
                "student.py",
                "--spec",
                str(CI_SPEC),
                "--json",
                str(tmp_path / "r.json"),
                "--gradescope",
                str(tmp_path / "gs.json"),
                "-v",
            ]
        )
        == 0
    )
    shown = capsys.readouterr().out
    assert "PASSED" in shown and "ranks measured 2 of 2" in shown and "sandbox in force" in shown
    assert max(len(line) for line in shown.splitlines() if not line.startswith(("  ---", "train"))) < 200
    assert json.loads((tmp_path / "r.json").read_text())["score"] == spec.points
    _assert_gradescope(json.loads((tmp_path / "gs.json").read_text()))

    assert cli.main(["calibrate", "--spec", str(CI_SPEC), "--repeats", "2", "--json", str(tmp_path / "c.json")]) == 0
    cal = json.loads((tmp_path / "c.json").read_text())
    assert len(cal["serial"]["times_s"]) == len(cal["reference"]["times_s"]) == 2
    assert cal["proposed_budget_s"] == math.floor(math.sqrt(3) * ref["time_s"]), "sqrt(3t x t), rounded down"
    shown = capsys.readouterr().out
    assert "proposed time_budget_s" in shown and f"calibrated_on = {json.dumps(cal['calibrated_on'])}" in shown
    monkeypatch.setattr(batch, "grade", lambda sub, s, **k: dict(ref))  # one process as fast as two
    assert cli.main(["calibrate", "--spec", str(CI_SPEC), "--repeats", "1"]) == 1
    assert "no budget proposed: one process took" in capsys.readouterr().err

    assert cli.main(["run", "x.py", "--spec", str(tmp_path / "nope.toml")]) == 2, "a bad spec is a clear error"
    assert "not found" in capsys.readouterr().err


def test_gpu_spec_without_enough_gpus_is_a_clear_grader_error(spec):
    r = grade(REFERENCE_SOLUTION, spec.replace(device="cuda"), gpus=[0])
    assert r["status"] == "error" and codes(r) == {"grader_error"} and "1 GPU(s)" in r["reason"], r["reason"]


def test_gpus_are_divided_among_jobs(spec, monkeypatch):
    from utils.grader.batch import _gpu_slots

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    gpu_spec = spec.replace(device="cuda")
    assert _gpu_slots(gpu_spec, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert _gpu_slots(gpu_spec, 3) == [[0, 1], [2, 3], [4, 5]]
    assert _gpu_slots(spec, 2) == [None, None], "CPU specs get no GPUs"


def test_model_file_must_be_a_regular_file(tmp_path):
    (tmp_path / "model.pt").symlink_to("/etc/hostname")
    with pytest.raises(weights.CheckpointRejected, match="regular file"):
        weights.load_state_dict(tmp_path / "model.pt", 1 << 20)
    os.mkfifo(tmp_path / "fifo.pt")
    with pytest.raises(weights.CheckpointRejected, match="regular file"):
        weights.load_state_dict(tmp_path / "fifo.pt", 1 << 20)


# ----------------------------------------------------------------------------------------
# The sandbox alone: a hang and escapes, a killed grader
# ----------------------------------------------------------------------------------------


# A plain child, one in its own session, an orphan, and a double-forked daemon in its own session,
# each marked by a distinct sleep so that /proc shows whether it survived.
def _escapes(mark: int) -> str:
    return (
        f"sleep {mark} & setsid sleep {mark} & (sleep {mark} &) ; {sys.executable} -c 'import os, time; "
        f"os.fork() or (os.setsid(), os.fork() or time.sleep({mark}))' ; "
    )


def _marked(mark: int) -> list[int]:
    out = []
    for p in os.listdir("/proc"):
        try:
            cmd = open(f"/proc/{p}/cmdline").read()
        except OSError:
            continue
        if cmd.endswith(f"\x00{mark}\x00") or cmd.endswith(f"sleep({mark})\x00"):
            out.append(int(p))
    return out


def _limits():
    return sandbox.Limits(1 << 30, 64, 1 << 20, 60, 1 << 20)


@pytest.fixture(params=["bwrap", "unshare"])
def tool(request):
    """Each sandbox mechanism in turn (SCALING_LABS_SANDBOX forces one for the grader), skipped
    with the probe's reason where it is not installed or cannot isolate here."""
    try:
        sandbox.probe_isolation(request.param)
    except sandbox.SandboxUnavailable as e:
        pytest.skip(str(e))
    return request.param


def test_a_hanging_job_is_killed_at_its_deadline(tmp_path, tool):
    mark = 600 + os.getpid() % 300 + (tool == "bwrap")
    (tmp_path / "w").mkdir()
    res = sandbox.run(
        ["sh", "-c", _escapes(mark) + f"sleep {mark}"],
        job_dir=tmp_path / "w",
        log_path=tmp_path / "log",
        env={},
        budget_s=1.5,
        limits=_limits(),
        tool=tool,
    )
    assert res.timed_out and res.returncode is None and 1.5 <= res.wall_s < 8
    assert res.remaining == [] and _marked(mark) == [], "a process of the job survived its deadline"


def test_a_killed_grader_takes_the_submission_along(tmp_path, tool):
    """SIGKILL the grading process mid-run: every process of the submission must still die, with
    either mechanism (the outer process's PR_SET_PDEATHSIG, bwrap --die-with-parent or unshare
    --kill-child, then the PID namespace goes)."""
    import time

    mark = 900 + os.getpid() % 300 + (tool == "bwrap")
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        from pathlib import Path
        from utils.grader import sandbox
        d = Path({str(tmp_path)!r})
        (d / "w").mkdir()
        sandbox.run(["sh", "-c", {_escapes(mark) + f"sleep {mark}"!r}], job_dir=d / "w", log_path=d / "log",
                    env={{}}, budget_s=60, limits=sandbox.Limits(1 << 30, 64, 1 << 20, 60, 1 << 20))
        """),
        ],
        cwd=ROOT,
        env={**os.environ, sandbox.FORCE_VAR: tool},
    )
    deadline = time.time() + 30
    while len(_marked(mark)) < 4 and time.time() < deadline:
        time.sleep(0.1)
    assert len(_marked(mark)) >= 4, "the submission did not start"
    child.kill()
    child.wait()
    deadline = time.time() + 10
    while _marked(mark) and time.time() < deadline:
        time.sleep(0.1)
    assert _marked(mark) == [], "the submission outlived its grader"
    # What the next grader does first. The kernel may still be releasing the last exited
    # processes (a cgroup with a task cannot be removed), so a later sweep may be the one.
    deadline = time.time() + 10
    while True:
        sandbox.JobCgroup.sweep_stale()
        left = [
            str(p)
            for m, t, _ in sandbox._mounts()
            if t in ("cgroup", "cgroup2")
            for p in Path(m).rglob(f"grader-{child.pid}-*")
        ]
        if not left or time.time() > deadline:
            break
        time.sleep(0.2)
    assert left == [], f"the dead grader's cgroup was not swept within 10 s: {left}"


def test_fingerprint_is_sha256_of_sorted_keys_and_tensor_bytes():
    """One definition (the probe's, which the grader imports), against hashlib over bytes packed by
    hand with struct: each key, then its values in row-major order, little-endian."""
    import hashlib
    import struct

    from utils.grader._probe import sitecustomize as probe

    assert weights.fingerprint is probe.fingerprint, "the grader hashes with the probe's own function"
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    sd = {"w": w.t(), "step": torch.tensor([7, -1]), "empty": torch.empty(0)}  # a transposed view: not contiguous
    expected = hashlib.sha256(
        b"empty" + b"step" + struct.pack("<2q", 7, -1) + b"w" + struct.pack("<4f", 1.0, 3.0, 2.0, 4.0)
    ).hexdigest()
    assert probe.fingerprint(sd) == expected
    assert probe.fingerprint({**sd, "step": torch.tensor([7, 0])}) != expected


def test_graded_weights_must_be_the_ddp_models():
    """verify_weights on records as the probe sends them: which model, which reason."""
    from utils.grader.core import verify_weights

    ev = {"ddp_fingerprints": ["decoy", "real"], "ddp_models": {"0": [[700, 0], [700, 0]], "1": [[700, 0], [700, 0]]}}
    assert verify_weights(ev, "real", 1400, 2) == (1, [])
    k, why = verify_weights(ev, "elsewhere", 1400, 2)
    assert k is None and why[0][0] == "not_ddp_weights" and "model.module.state_dict()" in why[0][1]
    assert "no DistributedDataParallel model" in verify_weights({"ddp_fingerprints": []}, "x", 1400, 2)[1][0][1]
    ev["ddp_models"] = {"0": [[700, 0], [700, 2]], "1": [[700, 0], [629, 0]]}
    assert [c for c, _ in verify_weights(ev, "real", 1400, 2)[1]] == ["weights_changed", "too_little_data"]
    assert "rank 1 passed 629 training examples" in verify_weights(ev, "real", 1400, 2)[1][1][1]
    ev["ddp_models"] = {"0": [[700, 0], [700, 0]], "1": [[700, 0]]}  # rank 1 wrapped one model only
    assert verify_weights(ev, "real", 1400, 2)[1][0][0] == "not_ddp_weights"


# ----------------------------------------------------------------------------------------
# Gradescope, per submission, in a fake /autograder
# ----------------------------------------------------------------------------------------


def test_gradescope_autograder_in_a_fake_root(graded, spec, tmp_path, monkeypatch):
    import utils.grader.cli as cli
    import utils.grader.core as core

    root = tmp_path / "autograder"
    (root / "submission").mkdir(parents=True)
    (root / "source").mkdir()
    (root / "source" / "spec.toml").write_text(CI_SPEC.read_text())
    # A real run, on a submission that stops before torchrun: the path Gradescope takes.
    (root / "submission" / "assessment.py").write_text("def main(:\n")
    assert cli.main(["gradescope", "--root", str(root)]) == 0
    doc = json.loads((root / "results" / "results.json").read_text())
    _assert_gradescope(doc)
    assert doc["score"] == 0 and "syntax error" in doc["tests"][1]["output"]
    assert all(t["output"].startswith("not checked") for t in doc["tests"][2:4]), doc["tests"]
    # The graded reference, as Gradescope would show it.
    monkeypatch.setattr(core, "grade", lambda *a, **k: dict(graded["reference"]))
    assert cli.main(["gradescope", "--root", str(root)]) == 0
    doc = json.loads((root / "results" / "results.json").read_text())
    _assert_gradescope(doc)
    assert doc["score"] == spec.points and doc["tests"][0]["max_score"] == spec.points


def test_gradescope_zip_has_setup_and_run_autograder_at_its_root(tmp_path):
    out = tmp_path / "ag.zip"
    build_zip(out, CI_SPEC)
    with zipfile.ZipFile(out) as z:
        names = set(z.namelist())
        assert {"setup.sh", "run_autograder", "spec.toml", "utils/grader/core.py", "constraints.txt"} <= names
        assert not any(n.startswith(("solutions/", "notebooks/", "tests/")) for n in names), names
        for n in ("setup.sh", "run_autograder"):
            assert (z.getinfo(n).external_attr >> 16) & 0o111, f"{n} must be executable"
        assert "bubblewrap" in z.read("setup.sh").decode()
        assert "gradescope --root /autograder" in z.read("run_autograder").decode()


def test_feedback_names_the_failing_rank_and_its_own_error():
    """Hand-written torchrun output (the oracle): the rank torchrun names as the root cause, its
    own last exception line and the line of the student's file, with torch.distributed's
    '[rankN]: ' prefixes; a rank killed by a signal says so, nothing is invented."""
    from utils.grader.core import failing_rank

    rank0 = (
        '[rank0]: Traceback (most recent call last):\n[rank0]:   File "/job/assessment.py", line 14, in <module>\n'
        '[rank0]:     main()\n[rank0]:   File "/usr/lib/x.py", line 3, in f\n'
        "[rank0]: ValueError: batch size 0\n"
    )
    rank1 = "[rank1]: Traceback (most recent call last):\n[rank1]: RuntimeError: Connection closed by peer\n"
    launcher = (
        "Failures:\n[1]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : -15 (pid: 8)\n"
        "  traceback : Signal 15 (SIGTERM) received by PID 8\nRoot Cause (first observed failure):\n[0]:\n"
        "  rank      : 0 (local_rank: 0)\n  exitcode  : 1 (pid: 7)\n"
    )
    logs = {"0": {"stdout": "", "stderr": rank0}, "1": {"stdout": "", "stderr": rank1}}
    assert failing_rank(launcher, logs) == ("0", "ValueError: batch size 0 (assessment.py, line 14)")
    killed = launcher.replace("exitcode  : 1 (pid: 7)", "exitcode  : -9 (pid: 7)")
    assert failing_rank(killed, {"0": {"stdout": "", "stderr": ""}, "1": {"stdout": "", "stderr": ""}}) == (
        "0",
        "killed by SIGKILL (out of memory?)",
    )
    # No traceback (argparse, SystemExit): the rank's own last lines on stderr, cut short.
    quiet = launcher.replace("exitcode  : 1 (pid: 7)", "exitcode  : 2 (pid: 7)")
    said = "[rank0]: usage: a.py --epochs E\n[rank0]: a.py: error: the following arguments are required: --epochs\n"
    assert failing_rank(quiet, {"0": {"stdout": "", "stderr": said}, "1": {"stdout": "", "stderr": ""}}) == (
        "0",
        "exited with code 2 without a Python traceback; the last lines it wrote to stderr: usage: a.py "
        "--epochs E | a.py: error: the following arguments are required: --epochs",
    )
    long = "\n".join(f"line {i} " + "x" * 500 for i in range(50))
    _, err = failing_rank(quiet, {"0": {"stdout": "", "stderr": long}})
    assert err.count("line ") == 3 and "line 49 " in err and len(err) < 800, err


def test_a_failed_write_is_named_even_when_the_job_then_ran_out_of_time(spec):
    """A rank whose write hit the file-size limit, in a job that then timed out (its launcher slow
    to notice on a busy machine): the student is told both, the failed write among them."""
    from utils.grader.core import judge_run

    full = "[rank0]: OSError: [Errno 27] File too large\n"
    for timed_out, returncode, want in [(True, None, ["timeout", "output_limit"]), (False, 1, ["output_limit"])]:
        res = sandbox.RunResult(returncode, spec.time_budget_s, timed_out, [], [], [], [])
        report = {"reasons": []}
        judge_run(
            res, {"launcher": "", "0": {"stdout": "", "stderr": full}, "1": {"stdout": "", "stderr": ""}}, spec, report
        )
        assert [r["code"] for r in report["reasons"]] == want, report["reasons"]
        assert f"{spec.max_output_mb} MiB limit" in report["reasons"][-1]["message"]
    res = sandbox.RunResult(None, spec.time_budget_s, True, [], [], [], [])
    report = {"reasons": []}
    judge_run(res, {"launcher": "", "0": {"stdout": "epoch 1\n", "stderr": ""}}, spec, report)
    assert [r["code"] for r in report["reasons"]] == ["timeout"]
