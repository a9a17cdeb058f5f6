"""SLURM: the variable translation of utils.parallel.env against hand-computed cases, and the job
templates run for real on a local one-node SLURM (cluster/slurm_check.py) when it can start."""

import os
import shutil
import subprocess
import sys

import pytest

from utils.parallel import env as denv

pytestmark = [pytest.mark.slurm, pytest.mark.slow]  # a local one-node SLURM, or skipped with the reason

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "cluster"))
import slurm_check  # noqa: E402

# --- host lists and tasks per node: hand-expanded (the same strings `scontrol show hostnames` expands) ---


@pytest.mark.parametrize(
    "spec, hosts",
    [
        ("vm", ["vm"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("a[1-2],b3", ["a1", "a2", "b3"]),
        ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
        ("n[9-11]", ["n9", "n10", "n11"]),
        ("x,y[3]", ["x", "y3"]),
        ("node[007-009]", ["node007", "node008", "node009"]),
        ("gpu-[1,3],cpu-a", ["gpu-1", "gpu-3", "cpu-a"]),
    ],
)
def test_expand_hostlist(spec, hosts):
    assert denv.expand_hostlist(spec) == hosts


@pytest.mark.parametrize("bad", ["node[01-03", "node01]", "node[a-b]", "node[3-1]", ""])
def test_expand_hostlist_rejects_bad_input(bad):
    with pytest.raises(ValueError, match="host list"):
        denv.expand_hostlist(bad)


@pytest.mark.parametrize(
    "spec, counts",
    [
        ("2", [2]),
        ("2(x3)", [2, 2, 2]),
        ("2(x3),1", [2, 2, 2, 1]),
        ("4,2(x2)", [4, 2, 2]),
    ],
)
def test_expand_tasks_per_node(spec, counts):
    assert denv.expand_tasks_per_node(spec) == counts


def test_expand_tasks_per_node_rejects_bad_input():
    with pytest.raises(ValueError, match="tasks per node"):
        denv.expand_tasks_per_node("2(3)")


# --- rendezvous_env: which variables win, and what SLURM's translate to ---

SLURM_STEP = {  # task 5 of `srun -N 3 -n 7` on node[01-03]: tasks per node 3,2,2; task 5 is node03's first
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "7",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "2",
    "SLURM_TASKS_PER_NODE": "3,2(x2)",
    "SLURM_JOB_NODELIST": "node[01-03]",
}


def test_slurm_step_translates():
    e = denv.rendezvous_env(SLURM_STEP)
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size) == (5, 7, 0, 2)
    assert (e.master_addr, e.master_port, e.source) == ("node01", 20000 + 123456 % 10000, "slurm")
    assert e.master_port == 23456


def test_step_tasks_per_node_wins_over_the_jobs():
    # the job has 4 tasks per node, this srun step only 1 per node
    e = denv.rendezvous_env(
        {
            **SLURM_STEP,
            "SLURM_STEP_TASKS_PER_NODE": "1(x3)",
            "SLURM_TASKS_PER_NODE": "4(x3)",
            "SLURM_PROCID": "2",
            "SLURM_NTASKS": "3",
        }
    )
    assert (e.rank, e.world_size, e.local_world_size) == (2, 3, 1)


def test_explicit_master_addr_and_port_win():
    e = denv.rendezvous_env({**SLURM_STEP, "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "29500"})
    assert (e.master_addr, e.master_port) == ("10.0.0.9", 29500)


def test_torchrun_variables_win_over_slurm():
    # `srun torchrun`: SLURM describes the one torchrun task per node, torchrun the ranks
    e = denv.rendezvous_env(
        {
            **SLURM_STEP,
            "RANK": "3",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "node01",
            "MASTER_PORT": "41000",
        }
    )
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size, e.source) == (3, 8, 1, 4, "torchrun")


def test_batch_script_outside_a_step_is_alone():
    # the batch script itself sees SLURM_NTASKS=7, SLURM_PROCID=0, but is one process (no step id)
    batch = {k: v for k, v in SLURM_STEP.items() if k != "SLURM_STEP_ID"}
    e = denv.rendezvous_env(batch)
    assert (e.rank, e.world_size, e.source) == (0, 1, "alone")


def test_no_variables_is_alone():
    assert denv.rendezvous_env({}).source == "alone"


def test_export_sets_master_for_setup(monkeypatch):
    # a private copy of the environment: what export=True writes must not leak into later tests
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    monkeypatch.setattr(os, "environ", {**env, **SLURM_STEP})
    denv.rendezvous_env(export=True)
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("node01", "23456")


def test_bad_slurm_value_says_which_variable():
    with pytest.raises(ValueError, match="SLURM_PROCID"):
        denv.rendezvous_env({**SLURM_STEP, "SLURM_PROCID": "five"})


# --- the real thing ---


def test_hostlist_matches_scontrol(tmp_path):
    """Our parser against SLURM's own: ``scontrol show hostnames`` needs a slurm.conf, no controller."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        pytest.skip("scontrol not installed (apt-get install slurm-wlm)")
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=parse\nSlurmctldHost=localhost\n")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for spec in ("node[01-03,07]", "a[1-2],b3", "r[1-2]n[01-02]", "n[9-11]", "node[007-009]", "gpu-[1,3],cpu-a"):
        r = subprocess.run([scontrol, "show", "hostnames", spec], capture_output=True, text=True, timeout=30, env=env)
        if r.returncode != 0:
            pytest.skip(f"scontrol show hostnames does not run here: {r.stderr.strip()}")
        assert denv.expand_hostlist(spec) == r.stdout.split(), spec


def test_templates_on_a_local_slurm():
    """Every template runs to completion on a real one-node SLURM; ranks agree; a requeue resumes."""
    reason = slurm_check.why_not()
    if reason:
        print(f"SKIPPED: {reason}")
        pytest.skip(reason)
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "cluster", "slurm_check.py")],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert r.returncode == 0, f"make slurm-check failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    assert "all checks passed" in r.stdout
