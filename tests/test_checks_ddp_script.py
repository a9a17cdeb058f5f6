"""Lab 3's torchrun script check (utils/checks/ddp_script.py): it FAILS on the lab's placeholder,
on the course's own implementation, and on the likely mistakes written out below, with a message
that names the mistake; and PASSES on the answer in solutions/lab3_ddp.ipynb (taken from the
notebook itself, so the test follows the lab)."""

import json
from pathlib import Path

import pytest
import torch

from utils import checks
from utils.checks import CheckFailed

ROOT = Path(__file__).resolve().parents[1]
LAB = ROOT / "solutions" / "lab3_ddp.ipynb"


def _cells():
    return ["".join(c["source"]) for c in json.loads(LAB.read_text())["cells"] if c["cell_type"] == "code"]


def _script_answer():
    cell = next(c for c in _cells() if c.startswith("%%writefile"))
    return cell.split("\n", 1)[1]


MISTAKES = {  # name: (text replaced in the answer, replacement, regex of the message)
    "no_set_epoch": ("sampler.set_epoch(epoch)", "pass", "same order of examples.*set_epoch"),
    "no_sampler": (
        "loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size // world, sampler=sampler)",
        "loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size // world, shuffle=True)",
        "ALL the data",
    ),
    "every_rank_saves": (
        "        if rank == 0:\n            torch.save(",
        "        if True:\n            torch.save(",
        "rank 1 saved a checkpoint too",
    ),
    "batch_not_divided": ("batch_size=args.batch_size // world", "batch_size=args.batch_size", "global batch was 64"),
    "saves_the_wrapper": ("model.module.state_dict()", "model.state_dict()", "start with 'module.'"),
    "ignores_seed": (", shuffle=True, seed=args.seed)", ", shuffle=True)", "--seed 3.*ignores --seed"),
    "device_ids_on_cpu": (
        'device_ids=[local_rank] if device.type == "cuda" else None',
        "device_ids=[local_rank]",
        "device_ids on a CPU model",
    ),
}


def _write(tmp_path, text, name="ddp_train.py"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_script_check_passes_on_the_answer(tmp_path):
    checks.check_ddp_script(_write(tmp_path, _script_answer()))


def test_script_check_on_the_placeholder_and_the_library(tmp_path):
    from utils import authoring

    lab_text = authoring.strip_solutions(_script_answer())
    with pytest.raises(CheckFailed, match="not implemented"):
        checks.check_ddp_script(_write(tmp_path, lab_text))
    with pytest.raises(CheckFailed, match="uses the course's `utils`"):
        checks.check_ddp_script(_write(tmp_path, "from utils import ddp_train\nddp_train.main()\n"))
    with pytest.raises(CheckFailed, match="there is no file"):
        checks.check_ddp_script(str(tmp_path / "missing.py"))


@pytest.mark.extended
@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_script_check_names_the_mistake(tmp_path, mistake):
    old, new, message = MISTAKES[mistake]
    text = _script_answer()
    assert old in text, f"the answer changed: update MISTAKES[{mistake!r}]"
    with pytest.raises(CheckFailed, match=message):
        checks.check_ddp_script(_write(tmp_path, text.replace(old, new)))


def test_script_check_shows_the_first_failing_rank_not_its_peer(tmp_path):
    # no DDP: rank 0 crashes on model.module when it saves; rank 1 then loses its peer in the barrier
    old, new = (
        'model = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)',
        "pass",
    )
    with pytest.raises(CheckFailed) as info:
        checks.check_ddp_script(_write(tmp_path, _script_answer().replace(old, new)))
    msg = str(info.value)
    first_line, shown = msg.split("\n", 1)
    assert "Connection closed" not in first_line and "Traceback from rank 0" in shown
    assert "AttributeError" in shown and "Connection closed by peer" not in shown
    assert "rank 0 failed first, with AttributeError" in first_line
    assert f"--nproc-per-node 2 {tmp_path / 'ddp_train.py'}" in first_line  # the path the check ran


HARD_CODED = 'dist.init_process_group(backend, rank=local_rank, world_size=2, init_method="tcp://127.0.0.1:29511")'


def test_script_check_refuses_a_hard_coded_rendezvous_before_running(tmp_path, monkeypatch):
    from utils.checks import ddp_script

    monkeypatch.setattr(ddp_script, "run_script", lambda *a, **k: pytest.fail("the script should not have run"))
    text = _script_answer().replace("dist.init_process_group(backend)", HARD_CODED)
    with pytest.raises(CheckFailed, match="fixed address .init_method='tcp://127.0.0.1:29511'.*no init_method"):
        checks.check_ddp_script(_write(tmp_path, text))


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.timeout(200)
def test_script_check_names_the_causes_of_a_hang(tmp_path, monkeypatch):
    from utils.checks import ddp_script

    monkeypatch.setattr(ddp_script, "SCRIPT_TIMEOUT", 20.0)
    # built at run time, so the static check cannot see it: under torchrun nobody serves this address
    hidden = 'addr = "tcp://127.0.0.1:" + "29511"\n    dist.init_process_group(backend, rank=local_rank, world_size=2, init_method=addr)'
    text = _script_answer().replace("dist.init_process_group(backend)", hidden)
    with pytest.raises(CheckFailed, match="hung under torchrun.*not joined from the environment.*`if rank == 0:`"):
        checks.check_ddp_script(_write(tmp_path, text))


def test_the_oracle_is_the_serial_script(tmp_path):
    """_simulate(world=1) must be the serial script the lab shows, run as a program."""
    import subprocess
    import sys

    path = _write(tmp_path, checks.SERIAL_SCRIPT, "train_serial.py")
    ckpt = tmp_path / "s.pt"
    subprocess.run([sys.executable, path, "--epochs", "2", "--ckpt", str(ckpt)], check=True, capture_output=True)
    got = torch.load(ckpt, weights_only=True)["model"]
    from utils.checks.ddp_script import _simulate

    want = _simulate(2, 32, 1)
    assert all(torch.allclose(got[k], want[k], atol=1e-6) for k in want)
    assert all(torch.allclose(want[k], _simulate(2, 32, 2)[k], atol=1e-5) for k in want)  # same global batches
