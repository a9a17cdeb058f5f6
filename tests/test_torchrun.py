"""The training worker under torchrun, as separate programs: two nodes on one machine, and a
crashed rank recovered by ``--max-restarts`` from the checkpoint. CPU and gloo only."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from utils.parallel import free_port, torchrun

pytestmark = pytest.mark.slow  # torchrun agents and their ranks, a restart after a killed rank

ROOT = Path(__file__).resolve().parent.parent
ARGS = [
    "-m",
    "utils.ddp_train",
    "--n-train",
    "256",
    "--n-val",
    "64",
    "--width",
    "8",
    "--epochs",
    "2",
    "--batch-size",
    "32",
]  # 4 steps per epoch per rank with 2 ranks


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LAB_DIST_BACKEND"):
        env.pop(k, None)
    return env


def _torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", *args]


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """Two torchrun launches (one per 'node'), meeting at a c10d rendezvous on 127.0.0.1."""
    out = tmp_path_factory.mktemp("two_nodes")
    port = free_port()
    procs = [
        subprocess.Popen(
            _torchrun(
                "--nnodes=2",
                f"--node-rank={r}",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=two-nodes-test",
                *ARGS,
                "--out",
                str(out / "final_{rank}.pt"),
            ),
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=150)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"node {r} failed (exit {p.returncode}):\n{log[-3000:]}"
    return [torch.load(out / f"final_{r}.pt", weights_only=True) for r in range(2)]


def test_two_nodes_end_with_identical_weights(two_nodes):
    a, b = two_nodes
    assert _same(a, b), "the two nodes' ranks ended with different weights: DDP must keep replicas identical"


def test_max_restarts_recovers_a_killed_rank_exactly(two_nodes, tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    p = torchrun(
        [
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=1",
            "--monitor-interval=0.2",
            *ARGS,
            "--ckpt",
            ckpt,
            "--fail-at-step",
            "6",
            "--fail-rank",
            "1",
            "--out",
            tmp_path / "final_{rank}.pt",
        ],
        cwd=ROOT,
        env=_env(),
        timeout=150,
    )
    log = p.stdout
    assert p.returncode == 0, f"torchrun did not recover from the injected failure:\n{log[-3000:]}"
    assert "injected failure at step 6" in log, "the failure was not injected: check FailAt in utils/ddp_train.py"
    assert "resumed from" in log and "epoch 1, step 4" in log, (
        f"the restarted ranks did not resume from the end-of-epoch-1 checkpoint:\n{log[-2000:]}"
    )
    final = [torch.load(tmp_path / f"final_{r}.pt", weights_only=True) for r in range(2)]
    assert _same(final[0], final[1]), "after the restart the ranks disagree"
    assert _same(final[0], two_nodes[0]), (
        "the recovered run must end with exactly the weights of the uninterrupted run (same world size)"
    )


# ---------------------------------------------------------------------------- gloo's abort at interpreter exit

# Each rank runs MODE, then shuts down; a rank holding GlooAbortAtExit dies of SIGABRT while the
# interpreter shuts down, with the line gloo's teardown prints (as torch 2.13's gloo does, now and then);
# a rank holding SlowExit is still shutting down when that happens, so torchrun stops it (SIGTERM).
EXIT_SCRIPT = """
import os, sys, time

class GlooAbortAtExit:
    def __del__(self, write=os.write, abort=os.abort):
        write(2, b"terminate called without an active exception\\n")
        abort()

class SlowExit:
    def __del__(self, sleep=time.sleep):
        sleep(60)  # torchrun stops this rank (SIGTERM) when rank 1 aborts

mode, rank = sys.argv[1], int(os.environ["RANK"])
if rank == 0 and mode == "slow_exit":
    slow = SlowExit()
if rank == 0 and mode == "slow_main":
    time.sleep(60)  # still working when rank 1 aborts: stopped before its end
if rank == 1:
    held = GlooAbortAtExit()
    if mode == "raise":
        raise ValueError("rank 1 failed")
    if mode == "exit":
        sys.exit(3)
    if mode == "abort":  # the same line, but before the script's end
        held.__del__()
print(f"rank {rank} ran to its end", flush=True)
"""


@pytest.mark.parametrize(
    "mode, passes",
    [("finish", True), ("slow_exit", True), ("raise", False), ("exit", False), ("abort", False), ("slow_main", False)],
)
def test_an_abort_at_exit_after_the_script_finished_passes_and_any_other_failure_fails(tmp_path, mode, passes):
    script = tmp_path / "script.py"
    script.write_text(EXIT_SCRIPT)
    p = torchrun(["--standalone", "--nproc-per-node=2", script, mode], cwd=tmp_path, env=_env(), timeout=120)
    assert "exitcode  : -6" in p.stdout, f"rank 1 should have died of SIGABRT:\n{p.stdout[-3000:]}"
    assert (p.returncode == 0) == passes, p.stdout[-3000:]
    assert ("parallel.torchrun: every rank finished" in p.stdout) == passes


# Rank 1 runs to its end, then hangs in interpreter shutdown (as gloo's teardown now and then deadlocks
# in torch 2.13), or hangs before its end: the first is stopped after the grace and passes, the second
# runs into the timeout.
HANG_SCRIPT = """
import os, sys, time

class HangAtExit:
    def __del__(self, sleep=time.sleep):
        sleep(600)

if int(os.environ["RANK"]) == 1:
    held = HangAtExit()
    if sys.argv[1] == "before_end":
        time.sleep(600)
print("ran to its end", flush=True)
"""


def test_a_hang_at_exit_after_every_rank_finished_is_stopped_and_a_hang_before_the_end_times_out(tmp_path, monkeypatch):
    from utils.parallel import launcher

    monkeypatch.setattr(launcher, "EXIT_GRACE_S", 3.0)
    script = tmp_path / "script.py"
    script.write_text(HANG_SCRIPT)
    start = time.monotonic()
    p = torchrun(["--nproc-per-node=2", script, "at_exit"], cwd=tmp_path, env=_env(), timeout=120)
    assert p.returncode == 0 and "one then hung at exit" in p.stdout, p.stdout[-3000:]
    assert time.monotonic() - start < 60, "stopped a few seconds after every rank finished, not at the timeout"
    with pytest.raises(subprocess.TimeoutExpired):
        torchrun(["--nproc-per-node=2", script, "before_end"], cwd=tmp_path, env=_env(), timeout=15)


def _python(code, env, cwd):
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True, timeout=60)


def test_the_rank_marker_is_written_only_when_the_script_ran_to_its_end(tmp_path):
    from utils.parallel.launcher import RANK_DONE_SITE

    done = tmp_path / "done"
    done.mkdir()
    other = tmp_path / "other_site"  # a sitecustomize further down the path (a site's own) still runs
    other.mkdir()
    (other / "sitecustomize.py").write_text("print('the next sitecustomize ran')\n")
    env = dict(_env(), PYTHONPATH=f"{RANK_DONE_SITE}{os.pathsep}{other}", LAB_RANK_DONE_DIR=str(done))
    env.update(RANK="1", WORLD_SIZE="2")
    marker = done / "rank1"
    cases = [
        ("print('work')", True),
        ("import sys; sys.exit(0)", True),
        ("import sys; sys.exit(2)", False),
        ("import sys; sys.exit('a message')", False),
        ("raise ValueError('x')", False),
    ]
    for code, written in cases:
        marker.write_text("stale")  # a previous attempt's marker never counts for this one
        r = _python(code, env, tmp_path)
        assert "the next sitecustomize ran" in r.stdout, r.stdout + r.stderr
        assert marker.exists() == written, code
        if written:
            assert marker.read_text() == "2", "the marker holds the world size"
    child = "import os; print('child sees', os.environ.get('LAB_RANK_DONE_DIR'))"
    r = _python(f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])", env, tmp_path)
    assert "child sees None" in r.stdout, "a rank's children never see the marker folder"
    agent = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE")}  # torchrun's agent: no RANK
    marker.unlink()
    r = _python("import os; print(os.environ['LAB_RANK_DONE_DIR'])", agent, tmp_path)
    assert r.stdout.splitlines()[-1] == str(done) and not marker.exists(), "the agent passes it on, writes nothing"


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"  # a zombie holds nothing
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_torchrun_and_its_ranks_stop_when_the_notebooks_kernel_is_killed(tmp_path):
    """A kernel stopped by a restart (SIGKILL) runs no cleanup, and torchrun has a session of its own:
    without the parent-death signal its ranks would keep running, and keep their GPUs."""
    import signal
    import time

    pids = tmp_path / "pids"
    pids.mkdir()
    worker = tmp_path / "worker.py"
    worker.write_text(
        f"import os, time\nopen(os.path.join({str(pids)!r}, str(os.getpid())), 'w').close()\ntime.sleep(600)\n"
    )
    kernel = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from utils import parallel; parallel.torchrun(['--nproc-per-node', '2', {str(worker)!r}], timeout=600)",
        ],
        cwd=ROOT,
        env=_env(),
    )
    try:
        deadline = time.monotonic() + 120
        while len(os.listdir(pids)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        ranks = [int(p) for p in os.listdir(pids)]
        assert len(ranks) == 2, "both ranks started"
        kernel.kill()
        kernel.wait()
        deadline = time.monotonic() + 60
        while not all(map(_gone, ranks)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(map(_gone, ranks)), "the ranks outlived the kernel that started them"
    finally:
        kernel.kill()
        for p in os.listdir(pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(p), signal.SIGKILL)
