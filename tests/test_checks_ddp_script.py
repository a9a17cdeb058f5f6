"""Lab 3's torchrun script exercise (utils/checks/ddp_script.py) in the harness's form: the script of
solutions/lab3_ddp.ipynb passes, each named mistake's variant fails with that mistake's own problem,
the lab's placeholder says "not implemented"; then what the harness cannot express. The answer is
a FILE, not a function of the notebook, so the harness's solution lookup is replaced by the
notebook's %%writefile cell. Every check runs torchrun (2 and 3 processes): slow."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from utils import authoring
from utils.checks import CheckFailed, check_ddp_script, ddp_script, engine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # each check runs torchrun twice
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ddp_script.SCRIPT
CASE = SCRIPT.cases()[0]


def _solution() -> str:
    cells = json.loads((ROOT / "solutions" / "lab3_ddp.ipynb").read_text())["cells"]
    cell = next("".join(c["source"]) for c in cells if "".join(c["source"]).startswith("%%writefile"))
    return cell.split("\n", 1)[1]


def _write(tmp_path, text, name="ddp_train.py") -> str:
    (tmp_path / name).write_text(text)
    return str(tmp_path / name)


def test_solution_passes(tmp_path, capsys):
    check_ddp_script(_write(tmp_path, _solution()))
    assert "\u2714 ddp_script: correct" in capsys.readouterr().out


def test_a_script_that_ends_with_sys_exit_passes(tmp_path, capsys):
    """``sys.exit(main())`` is a normal end: the ranks left the group, nothing failed."""
    text = _solution().replace(
        'if __name__ == "__main__":\n    main()', 'if __name__ == "__main__":\n    import sys\n\n    sys.exit(main())'
    )
    assert "sys.exit(main())" in text
    check_ddp_script(_write(tmp_path, text))
    assert "\u2714 ddp_script: correct" in capsys.readouterr().out


def _is_hang(m) -> bool:
    return "init_method" in m.variant.text


@pytest.mark.extended
@pytest.mark.parametrize("mistake", SCRIPT.mistakes, ids=[m.problem[:40] for m in SCRIPT.mistakes])
def test_mistake_is_named(mistake, monkeypatch):
    if _is_hang(mistake):
        monkeypatch.setattr(ddp_script, "SCRIPT_TIMEOUT", 40.0)  # it would wait the full timeout
    with pytest.raises(CheckFailed) as e:
        engine.check(SCRIPT, mistake.variant)
    assert mistake.problem.rstrip(".") in str(e.value), str(e.value)


def test_placeholder_is_not_implemented_and_a_missing_file_is_named(tmp_path):
    with pytest.raises(CheckFailed, match="not implemented yet"):
        check_ddp_script(_write(tmp_path, authoring.strip_solutions(_solution())))
    with pytest.raises(CheckFailed, match="there is no file"):
        check_ddp_script(str(tmp_path / "missing.py"))


def test_a_script_without_sharding_trains_the_oracle_weights_and_is_still_named():
    """Every rank on the whole dataset with the full global batch: DDP averages identical gradients,
    so the weights are the oracle's; what names it is the examples each rank trained on."""
    (no_shards,) = [m for m in SCRIPT.mistakes if "whole dataset" in m.problem]
    got = no_shards.variant(**CASE.kwargs)
    want = SCRIPT.oracle(**CASE.kwargs)
    assert not (got["hung"] or got["failed"]), got.get("out", f"hung; the ranks' records: {got['recs']}")[-3000:]
    assert engine.difference(got["weights"], want["weights"], 1e-4, 1e-5) is None
    assert no_shards.when(engine.Outcome(CASE, got, want))
    assert all(r["examples"] == 512 * CASE.kwargs["epochs"] for r in got["recs"])


@pytest.mark.extended
def test_a_script_that_never_joins_and_trains_alone_is_named():
    """No process group at all (no DDP, no collective): every rank runs to its end, alone."""
    alone = ddp_script._variant(init="pass", wrap="lambda m: m", inner="model", leave="pass")
    (joins,) = [m for m in SCRIPT.mistakes if "does not join the process group" in m.problem]
    with pytest.raises(CheckFailed, match=re.escape(joins.problem)):
        engine.check(SCRIPT, alone)


@pytest.mark.extended
def test_a_script_that_overwrites_its_arguments_fails_on_the_other_case(tmp_path):
    text = _solution().replace(
        "    args = ap.parse_args()\n", "    args = ap.parse_args()\n    args.epochs, args.seed = 2, 3\n"
    )
    with pytest.raises(CheckFailed, match="on 3 processes with --epochs 3 .*differ from one process"):
        check_ddp_script(_write(tmp_path, text))


def test_the_first_failing_rank_is_shown_not_its_peer(tmp_path):
    # rank 0 raises after the first epoch; rank 1 then loses its peer in the next collective
    old = "        if rank == 0:\n            torch.save("
    new = '        if rank == 0:\n            raise ValueError("a bug of rank 0")\n            torch.save('
    assert old in _solution()
    with pytest.raises(CheckFailed) as info:
        check_ddp_script(_write(tmp_path, _solution().replace(old, new)))
    first_line, shown = str(info.value).split("\n", 1)
    assert "rank 0 failed first, with ValueError: a bug of rank 0" in first_line
    assert "Traceback from rank 0" in shown and "Connection closed" not in shown
    assert f"--nproc-per-node 2 {tmp_path / 'ddp_train.py'}" in first_line  # the path the check ran


def test_the_oracle_is_the_serial_script(tmp_path):
    """_simulate on one process is the serial script the lab shows, run as a program; on 2
    processes with the same global batches it gives the same weights."""
    path = _write(tmp_path, ddp_script.SERIAL_SCRIPT, "train_serial.py")
    ckpt = tmp_path / "s.pt"
    argv = ["--epochs", "2", "--seed", "3", "--lr", "0.05", "--ckpt", str(ckpt)]
    subprocess.run([sys.executable, path, *argv], check=True, capture_output=True)
    got = torch.load(ckpt, weights_only=True)["model"]
    want = ddp_script._simulate(1, epochs=2, batch_size=32, lr=0.05, seed=3)
    assert all(torch.equal(got[k], want[k]) for k in want)
    two = ddp_script._simulate(2, epochs=2, batch_size=32, lr=0.05, seed=3)
    assert all(torch.allclose(want[k], two[k], atol=1e-5) for k in want)
