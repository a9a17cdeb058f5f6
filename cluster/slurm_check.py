"""Start a one-node SLURM on this machine, run every job template on it, check them, stop it.

    python cluster/slurm_check.py [--keep] [--epochs 4]        (make slurm-check)

What it starts, all under one temporary directory, each process by its pid: ``munged`` (its own
key and socket), ``slurmctld`` and ``slurmd`` (a minimal slurm.conf: proctrack/linuxproc,
task/none, select/cons_tres, no accounting, the node as ``slurmd -C`` describes it). Then:

1. ``single_node.sbatch`` (srun + torchrun --standalone, 2 ranks),
2. ``multi_node.sbatch`` with ``-N 1`` (srun + torchrun, c10d rendezvous on the first node),
3. ``srun_tasks.sbatch`` (``srun -n 2``: each task one rank, from SLURM's variables),
4. ``srun_tasks.sbatch`` again, with rank 1 killed in epoch 3 (``--fail-at-step``: a lost node);
   the job fails, ``scontrol requeue`` reruns it, and the second run (SLURM_RESTART_COUNT=1) must
   resume from the epoch-2 checkpoint;
5. ``notebook.sbatch`` on notebook 00 in the smoke profile: the executed copy, with outputs;
6. ``jupyter.sbatch``: JupyterLab on the node answers its REST API with the token the job printed,
   through the address of the tunnel command it printed; then the job is cancelled.

Checks, against oracles outside the code under test: every rank's all-reduce of rank+1 equals
W(W+1)/2; every rank of a job ends with bit-identical weights (DDP's promise); the same training
started three ways (torchrun standalone, torchrun c10d, srun tasks) ends with the same weights;
and the requeued job, resumed from its checkpoint, ends with the weights of the uninterrupted one.

Needs root (slurmd starts job steps as the submitting user) and slurm-wlm + munge
(``apt-get install slurm-wlm munge``). Exit status 0 when every check passed, 1 when one failed,
77 when the check cannot run here (the reason is printed).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

SKIP = 77  # exit status: cannot run here (automake's convention)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBIN = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin", "/sbin"])
TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo")


def why_not() -> str | None:
    """Why the check cannot run on this machine, or None when it can."""
    missing = [t for t in TOOLS if shutil.which(t, path=SBIN) is None]
    if missing:
        return (
            f"SLURM is not installed (missing {', '.join(missing)}): as root, "
            "`apt-get install -y slurm-wlm munge` (Debian/Ubuntu), then run `make slurm-check` again"
        )
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return (
            "the local SLURM needs root (slurmd starts each job step as the user who submitted it): "
            "run `sudo make slurm-check`, or skip it"
        )
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalSlurm:
    """munged + slurmctld + slurmd in ``tmp``; ``stop()`` ends exactly the processes it started."""

    def __init__(self, tmp: str, python_bin: str):
        self.tmp, self.procs = tmp, []
        self.env = dict(
            os.environ,
            SLURM_CONF=os.path.join(tmp, "slurm.conf"),
            PATH=os.pathsep.join([python_bin, SBIN]),
            LAB_ROOT=ROOT,
            OMP_NUM_THREADS="1",
        )  # as torchrun sets it: every launcher does the same float math
        # sbatch passes the submitting environment on to the job: start from a clean one (no
        # SLURM job of ours, no torchrun/launch() rendezvous variables of a surrounding run)
        drop = ("SLURM_", "SBATCH_", "SRUN_", "TORCHELASTIC_", "LAB_DIST_")
        rdzv = (
            "MASTER_ADDR",
            "MASTER_PORT",
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "ROLE_RANK",
            "ROLE_WORLD_SIZE",
        )
        for k in [k for k in self.env if (k.startswith(drop) and k != "SLURM_CONF") or k in rdzv]:
            del self.env[k]

    def _start(self, name, argv):
        log = open(os.path.join(self.tmp, "log", f"{name}.out"), "wb")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        log.close()
        self.procs.append((name, p))
        return p

    def run(self, *argv, check=True, timeout=60):
        r = subprocess.run(argv, env=self.env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
        return r.stdout

    def start(self):
        t = self.tmp
        for d in ("munge", "state", "spool", "log"):
            os.makedirs(os.path.join(t, d), exist_ok=True)
        os.chmod(t, 0o711)  # munged wants its socket's directories searchable
        os.chmod(os.path.join(t, "munge"), 0o711)
        key = os.path.join(t, "munge", "munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
            f.write(os.urandom(1024))
        sock = os.path.join(t, "munge", "munge.sock")
        self._start(
            "munged",
            [
                shutil.which("munged", path=SBIN),
                "--foreground",
                "--force",
                f"--socket={sock}",
                f"--key-file={key}",
                f"--pid-file={t}/munge/munged.pid",
                f"--seed-file={t}/munge/seed",
                f"--log-file={t}/log/munged.log",
            ],
        )
        self._wait(lambda: os.path.exists(sock), 20, "munged to create its socket")
        node = self.run(shutil.which("slurmd", path=SBIN), "-C").splitlines()[0]
        name = re.search(r"NodeName=(\S+)", node).group(1)
        mem = int(re.search(r"RealMemory=(\d+)", node).group(1))
        node = re.sub(r"RealMemory=\d+", f"RealMemory={max(1, mem * 9 // 10)}", node)  # slack: never drained
        conf = f"""# written by cluster/slurm_check.py: one node, this machine; removed when the check ends
ClusterName=labcheck
SlurmctldHost={name}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock},cred_expire=10
StateSaveLocation={t}/state
SlurmdSpoolDir={t}/spool
SlurmctldPidFile={t}/slurmctld.pid
SlurmdPidFile={t}/slurmd.pid
SlurmctldLogFile={t}/log/slurmctld.log
SlurmdLogFile={t}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
PlugStackConfig=/dev/null
ReturnToService=2
JobRequeue=1
MinJobAge=600
KillWait=5
InactiveLimit=0
{node} NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=check Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        with open(self.env["SLURM_CONF"], "w") as f:
            f.write(conf)
        self._start("slurmctld", [shutil.which("slurmctld", path=SBIN), "-D", "-c", "-f", self.env["SLURM_CONF"]])
        self._start("slurmd", [shutil.which("slurmd", path=SBIN), "-D", "-f", self.env["SLURM_CONF"]])
        self._wait(
            lambda: self.run("sinfo", "-h", "-o", "%t", check=False).strip() == "idle",
            60,
            "the node to be idle in sinfo",
        )
        return name

    def _wait(self, cond, timeout, what):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for n, p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{n} exited ({p.returncode}) while waiting for {what}; see {self.tmp}/log")
            if cond():
                return
            time.sleep(0.3)
        raise TimeoutError(f"timed out after {timeout}s waiting for {what}; see {self.tmp}/log")

    def job(self, jid):
        out = self.run("scontrol", "show", "job", "-o", str(jid), check=False)
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, jid, timeout):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            j = self.job(jid)
            if j.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                return j
            time.sleep(0.5)
        raise TimeoutError(f"job {jid} did not end within {timeout}s (state {self.job(jid).get('JobState')})")

    def stop(self):
        """Cancel our jobs, then end our daemons by pid (TERM, then KILL after a grace period)."""
        try:
            if any(n == "slurmctld" and p.poll() is None for n, p in self.procs):
                self.run("scancel", "--full", "--partition=check", check=False, timeout=20)
                end = time.monotonic() + 20
                while time.monotonic() < end and self.run("squeue", "-h", check=False, timeout=20).strip():
                    time.sleep(0.5)
        except (subprocess.SubprocessError, OSError):
            pass
        for _name, p in reversed(self.procs):  # slurmd, slurmctld, then munged
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.procs.clear()


def read_rank_logs(run_dir: str) -> dict[int, str]:
    logs = {}
    d = os.path.join(run_dir, "logs")
    for f in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        m = re.fullmatch(r"rank(\d+)\.log", f)
        if m:
            with open(os.path.join(d, f)) as fh:
                logs[int(m.group(1))] = fh.read()
    return logs


def check_run(run_dir: str, world: int, attempts: int = 1) -> dict:
    """The checks on one job's per-rank logs; returns the last attempt's weights digest and start epoch."""
    logs = read_rank_logs(run_dir)
    if sorted(logs) != list(range(world)):
        raise AssertionError(f"{run_dir}: expected logs of ranks 0..{world - 1}, found {sorted(logs)}")
    digests, starts = set(), set()
    for r, text in logs.items():
        heads = re.findall(r"^=== job .* restart (\d+) rank (\d+)/(\d+)", text, re.M)
        if len(heads) != attempts or any(int(w) != world or int(rr) != r for _, rr, w in heads):
            raise AssertionError(
                f"{run_dir} rank {r}: expected {attempts} attempt(s) as rank {r}/{world}, "
                f"log says {heads}:\n{text[-2000:]}"
            )
        sums = re.findall(r"^allreduce-check rank \d+/\d+: sum (\d+) expected (\d+)", text, re.M)
        if len(sums) != attempts or any(int(s) != world * (world + 1) // 2 for s, _ in sums):
            raise AssertionError(
                f"{run_dir} rank {r}: all-reduce of rank+1 should be {world * (world + 1) // 2} "
                f"on every attempt, log has {sums}:\n{text[-2000:]}"
            )
        last = re.findall(r"^weights-check rank \d+/\d+: sha256 (\w+) start_epoch (\d+)", text, re.M)
        if not last:
            raise AssertionError(f"{run_dir} rank {r}: no weights-check line (did training crash?):\n{text[-3000:]}")
        digests.add(last[-1][0])
        starts.add(int(last[-1][1]))
    if len(digests) != 1:
        raise AssertionError(f"{run_dir}: the ranks ended with different weights: {digests}")
    return {"digest": digests.pop(), "start_epoch": starts.pop(), "logs": logs}


def _submit(slurm: LocalSlurm, out: str, name: str, *argv: str) -> str:
    return slurm.run("sbatch", "--parsable", "-N1", "-c1", f"--output={out}/{name}-%j.out", *argv).strip().split(";")[0]


def check_notebook_job(slurm: LocalSlurm, tmp: str, out: str, step) -> None:
    """notebook.sbatch executes notebook 00 (smoke) on the node and keeps the executed copy."""
    import json

    dest = os.path.join(tmp, "executed", "00_environment.ipynb")
    nb = os.path.join(ROOT, "notebooks", "00_environment.ipynb")
    jid = _submit(slurm, out, "notebook", os.path.join(ROOT, "cluster", "notebook.sbatch"), nb, dest, "smoke")
    j = slurm.wait_job(jid, 600)
    log = (
        open(os.path.join(out, f"notebook-{jid}.out")).read()
        if os.path.exists(os.path.join(out, f"notebook-{jid}.out"))
        else ""
    )
    if j.get("JobState") != "COMPLETED" or not os.path.exists(dest):
        raise AssertionError(f"notebook job {jid} ended {j.get('JobState')} without {dest}:\n{log[-3000:]}")
    cells = json.load(open(dest))["cells"]
    outputs = sum(len(c.get("outputs", [])) for c in cells if c["cell_type"] == "code")
    errors = [o for c in cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    if not outputs or errors:
        raise AssertionError(f"the executed notebook has {outputs} outputs and {len(errors)} errors")
    step(f"job {jid} notebook: COMPLETED; notebook 00 executed on the node, {outputs} outputs kept in {dest}")


def check_jupyter_job(slurm: LocalSlurm, out: str, step) -> None:
    """jupyter.sbatch starts JupyterLab on the node; it answers with the printed token at the
    tunnel's target (NODE:PORT); scancel ends it."""
    import json
    import urllib.request

    jid = _submit(slurm, out, "jupyter", os.path.join(ROOT, "cluster", "jupyter.sbatch"))
    path = os.path.join(out, f"jupyter-{jid}.out")
    pattern = re.compile(r"ssh -N -L (\d+):(\S+):\d+ .*\n.*http://localhost:\d+/lab\?token=(\w+)")
    found: list = []

    def ready():
        text = open(path).read() if os.path.exists(path) else ""
        m = pattern.search(text)
        if not m:
            return False
        port, node, token = m.groups()
        try:
            req = urllib.request.Request(
                f"http://{node}:{port}/api/status", headers={"Authorization": f"token {token}"}
            )
            with urllib.request.urlopen(req, timeout=5) as r:
                found.append(json.load(r))
            return True
        except OSError:
            return False

    try:
        slurm._wait(ready, 180, f"JupyterLab of job {jid} to answer")
    finally:
        slurm.run("scancel", jid, check=False)
    if "started" not in found[0]:
        raise AssertionError(f"JupyterLab's /api/status answered {found[0]}")
    j = slurm.wait_job(jid, 60)
    if j.get("JobState") != "CANCELLED":
        raise AssertionError(f"the JupyterLab job {jid} should end CANCELLED by scancel, it ended {j.get('JobState')}")
    step(f"job {jid} jupyter: JupyterLab answered at the tunnel's target with the printed token; scancel ended it")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=4, help="epochs of every job (the requeue test needs >= 3)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, run dirs)")
    ap.add_argument("--timeout", type=float, default=240, help="seconds each job may take")
    args = ap.parse_args(argv)
    reason = why_not()
    if reason:
        print(f"slurm-check skipped: {reason}", flush=True)
        return SKIP
    if args.epochs < 3:
        ap.error("--epochs must be >= 3 (the requeue test crashes the job in its third epoch)")
    t0 = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="slurm-check-")
    slurm = LocalSlurm(tmp, os.path.dirname(sys.executable))
    ok = False
    # Tiny training, the same everywhere, so weights can be compared across launchers.
    work = [
        "--epochs",
        str(args.epochs),
        "--n-train",
        "256",
        "--n-val",
        "64",
        "--width",
        "8",
        "--batch-size",
        "16",
        "--backend",
        "gloo",
        "--device",
        "cpu",
    ]

    def step(msg):
        print(f"[{time.monotonic() - t0:5.1f}s] {msg}", flush=True)

    try:
        node = slurm.start()
        step(f"SLURM up: node {node}, config {slurm.env['SLURM_CONF']}")
        out = os.path.join(tmp, "out")
        os.makedirs(out)
        # name: (template, sbatch options, template arguments before the training options). The
        # requeue job goes first, so it fails (and is requeued) while the others wait their turn.
        fail_step = 2 * (256 // (2 * 16)) + 3  # 8 steps per epoch: epoch 3, after 2 checkpoints
        jobs = {
            "requeue": ("srun_tasks.sbatch", ["-N1", "-n2", "-c1"], []),
            "single_node": ("single_node.sbatch", ["-N1", "-c2"], ["2"]),
            "multi_node": ("multi_node.sbatch", ["-N1", "-c2"], ["2"]),
            "srun_tasks": ("srun_tasks.sbatch", ["-N1", "-n2", "-c1"], []),
        }
        ids = {}
        for name, (script, opts, pre) in jobs.items():
            run = os.path.join(tmp, "runs", name)
            ids[name] = (
                slurm.run(
                    "sbatch",
                    "--parsable",
                    *opts,
                    f"--output={out}/{name}-%j.out",
                    os.path.join(ROOT, "cluster", script),
                    run,
                    *pre,
                    *work,
                    *(["--fail-at-step", str(fail_step)] if name == "requeue" else []),
                )
                .strip()
                .split(";")[0]
            )
            step(
                f"submitted {name}: job {ids[name]} (sbatch {' '.join(opts)} cluster/{script} RUN_DIR {' '.join(pre)})"
            )
        # The requeue: the first run loses rank 1 (SIGKILL, like a lost node) in its third epoch,
        # after two checkpoints; the job fails. `scontrol requeue` puts it back to PENDING; it may
        # start again once the old job credential has expired (cred_expire=10 in slurm.conf above;
        # SLURM's default is 120 s, and forcing StartTime=now gets "Job credential revoked").
        j = slurm.wait_job(ids["requeue"], args.timeout)
        if j.get("JobState") != "FAILED":
            raise AssertionError(
                f"job {ids['requeue']} should have failed (rank 1 killed at step {fail_step}), "
                f"it ended {j.get('JobState')}"
            )
        slurm.run("scontrol", "requeue", ids["requeue"])
        slurm._wait(lambda: slurm.job(ids["requeue"]).get("JobState") == "PENDING", 60, "the requeued job to pend")
        step(f"job {ids['requeue']} failed at step {fail_step} as planned; requeued it")
        results = {}
        for name, jid in ids.items():
            j = slurm.wait_job(jid, args.timeout * 2)
            text = (
                open(os.path.join(out, f"{name}-{jid}.out")).read()
                if os.path.exists(os.path.join(out, f"{name}-{jid}.out"))
                else ""
            )
            if j.get("JobState") != "COMPLETED" or j.get("ExitCode") != "0:0":
                raise AssertionError(
                    f"job {jid} ({name}) ended {j.get('JobState')} exit {j.get('ExitCode')}:\n"
                    f"{text[-3000:]}\nrank logs: {os.path.join(tmp, 'runs', name, 'logs')}"
                )
            attempts = 2 if name == "requeue" else 1
            if name == "requeue" and j.get("Restarts") != "1":
                raise AssertionError(f"job {jid}: expected Restarts=1 after the requeue, got {j.get('Restarts')}")
            results[name] = check_run(os.path.join(tmp, "runs", name), 2, attempts)
            step(
                f"job {jid} {name}: COMPLETED; 2 ranks, all-reduce sums 3, weights agree "
                f"({results[name]['digest'][:12]}), started at epoch {results[name]['start_epoch']}"
            )
        rq = results["requeue"]
        if rq["start_epoch"] < 1:
            raise AssertionError(
                "the requeued job did not resume: its second run started at epoch 0:\n" + rq["logs"][0][-2000:]
            )
        ck = os.path.join(tmp, "runs", "requeue", "ckpt.pt")
        if f"resumed from {ck}: epoch {rq['start_epoch']}" not in rq["logs"][0]:
            raise AssertionError("rank 0 of the requeued job does not say it resumed:\n" + rq["logs"][0][-2000:])
        if "restart 1 rank" not in rq["logs"][0]:
            raise AssertionError("the second run of the requeued job did not see SLURM_RESTART_COUNT=1")
        if rq["start_epoch"] != 2 or len(re.findall(r"^weights-check", rq["logs"][0], re.M)) != 1:
            raise AssertionError(
                "the requeued job should resume from the epoch-2 checkpoint its first run "
                f"left, having never finished before: rank 0 log:\n{rq['logs'][0][-2000:]}"
            )
        step(f"requeued job resumed from epoch {rq['start_epoch']} of {args.epochs} (SLURM_RESTART_COUNT=1)")
        base = results["srun_tasks"]["digest"]
        differ = {n: r["digest"][:12] for n, r in results.items() if r["digest"] != base}
        if differ:
            raise AssertionError(f"the same training ended with different weights: srun_tasks {base[:12]}, {differ}")
        step("the same weights from torchrun --standalone, torchrun c10d, srun tasks and the resumed job")
        check_notebook_job(slurm, tmp, out, step)
        check_jupyter_job(slurm, out, step)
        ok = True
    except (AssertionError, RuntimeError, TimeoutError, subprocess.SubprocessError, OSError) as e:
        print(f"slurm-check FAILED: {e}", file=sys.stderr, flush=True)
        print(f"logs kept in {tmp}", file=sys.stderr, flush=True)
    finally:
        slurm.stop()
        if ok and not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        step(
            f"SLURM stopped; {'all checks passed' if ok else 'FAILED'}"
            + (f"; files in {tmp}" if (args.keep or not ok) else "")
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
