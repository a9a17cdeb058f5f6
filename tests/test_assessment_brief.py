"""The assessment's brief (labs/assessment/README.md), its spec files and the grader agree.

Cheap text checks: each number the brief states for a spec is that spec's, and what it says about
the time budget is what the specs and the grader enforce (an uncalibrated budget is called one,
and every report says so). Plus one graded run: on the CI spec a serial script whose epochs were
raised until it reaches the target still fails, on the ranks the grader measures (the spec's
comments record why the CI budget cannot be what stops it: digits train in seconds, the rest is
start-up, and `calibrate` proposes no budget there).
"""

from __future__ import annotations

import re
import sys

import pytest

from utils.data import DATASET_SIZES
from utils.grader.batch import propose_budget
from utils.grader.spec import CALIBRATE_MARGIN, CALIBRATE_REPEATS, ROOT, SERIAL_SCRIPT, load_spec

BRIEF = (ROOT / "labs" / "assessment" / "README.md").read_text()
FLAT = " ".join(BRIEF.split())
CI_SPEC = ROOT / "labs" / "assessment" / "spec_ci.toml"
GPU_SPEC = ROOT / "labs" / "assessment" / "spec_gpu.toml"


def _table_row(name):
    row = next(line for line in BRIEF.splitlines() if line.startswith(f"| `{name}`"))
    return [c.strip() for c in row.strip("|").split("|")]


def _number(text: str) -> int:
    return int(text.replace(",", ""))


@pytest.mark.parametrize("path", [CI_SPEC, GPU_SPEC], ids=lambda p: p.name)
def test_brief_table_agrees_with_the_spec(path):
    spec = load_spec(path)
    _, dataset, procs, target, budget = _table_row(path.name)
    assert dataset.lower().replace("-", "").startswith(spec.dataset) and int(procs) == spec.nprocs
    assert float(target) == spec.target_val_acc
    train, held = re.findall(r"\d[\d,]*", dataset[dataset.index("(") :])[:2]  # "(1,400 train / 397 held out"
    pool = sum(n or 0 for n in DATASET_SIZES[spec.dataset])  # a secret split draws from train + test
    assert spec.heldout == "secret_split" and _number(held) == spec.n_val
    assert _number(train) == (spec.n_train or pool - spec.n_val)
    if spec.calibrated_on:
        assert budget == f"{spec.time_budget_s:g} s", "a calibrated budget is stated as the spec's"
    elif path == CI_SPEC:
        assert budget == f"{spec.time_budget_s:g} s, not calibrated"
    else:  # the placeholder is replaced in the instructor's copy: the brief names no number for it
        assert not re.search(r"\d", budget) and "calibration" in budget, budget


def test_every_number_the_brief_quotes_from_a_spec_is_the_specs():
    ci, gpu = load_spec(CI_SPEC), load_spec(GPU_SPEC)
    assert f"a GPU server with at least {gpu.nprocs} GPUs" in FLAT
    assert f"any machine with {ci.nprocs} CPU cores" in FLAT
    # the failure messages it quotes come from the practice spec
    assert re.search(r"below the target (\S+)`", FLAT).group(1) == f"{ci.target_val_acc}"
    assert re.search(r"still running after the (\S+) s budget", FLAT).group(1) == f"{ci.time_budget_s:g}"
    assert f"`0 of {ci.nprocs} ranks joined the process group" in FLAT
    assert f"`--repeats` times (default {CALIBRATE_REPEATS})" in FLAT
    assert f"at least `--margin` (default {CALIBRATE_MARGIN:g}) from each" in FLAT


def test_what_the_brief_says_about_the_budget_is_what_is_enforced():
    ci, gpu = load_spec(CI_SPEC), load_spec(GPU_SPEC)
    assert "cannot reach the target in the budget" not in FLAT
    # "The practice spec is one of those [not calibrated]": the CI spec's budget is not calibrated,
    # and a report with it carries the line the brief names.
    assert not ci.calibrated_on and "The practice spec is one of those" in FLAT
    for spec in (ci, gpu):
        if not spec.calibrated_on:
            assert spec.budget_note().startswith("time budget:"), "the brief names the line `time budget:`"
    assert "a line starting `time budget:`" in FLAT
    # "a budget between the two times, with a margin on both sides": what calibrate proposes
    for serial_s, reference_s in ((130.0, 60.0), (300.0, 100.0), (90.0, 40.0)):
        budget = propose_budget(serial_s, reference_s, CALIBRATE_MARGIN)
        assert reference_s * CALIBRATE_MARGIN <= budget <= serial_s / CALIBRATE_MARGIN
    assert "proposes a budget between the two times, with a margin on both sides" in FLAT


def test_brief_lists_concepts_not_calls():
    for call in (
        "init_process_group(",
        "set_device(",
        "DistributedDataParallel(model",
        "torch.save(model.module",
        "make_loader(train",
    ):
        assert call not in BRIEF, f"the brief spells out the call {call!r}; name the concept instead"


def test_brief_does_not_say_seeding_makes_ranks_start_equal():
    assert not re.search(r"seed[^.]*so every rank starts from the same weights", FLAT, re.I)
    assert "copies rank 0's weights to every rank" in FLAT


def test_brief_and_instructors_notes_agree_on_the_graded_weights():
    flat = FLAT
    assert "the weights of rank 0's DDP model as they stand after its last optimizer step" in flat
    for fails in ("exponential moving average (EMA)", "best epoch's copy"):
        assert fails in flat
    assert "fine for an EMA" not in flat, "the grader fails an EMA or best-so-far model (not_ddp_weights)"
    assert "fails (`not_ddp_weights`) by design" in flat


@pytest.mark.sandbox
@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the grader watches /proc")
def test_serial_script_with_more_epochs_reaches_the_target_and_still_fails(tmp_path):
    from utils.grader.core import grade

    spec = load_spec(CI_SPEC)
    src = SERIAL_SCRIPT.read_text()
    assert '"epochs": 2, ' in src
    script = tmp_path / "assessment.py"
    script.write_text(src.replace('"epochs": 2, ', '"epochs": 10,', 1))
    r = grade(script, spec, student="serial_more_epochs")
    assert r["status"] == "failed" and r["ranks_measured"] == 0, r["reasons"]
    assert r["accuracy"] >= spec.target_val_acc, "raising the epochs alone reaches the CI target"
