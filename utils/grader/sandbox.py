"""Running a submission: isolation probed (never assumed), a watched process tree, a hard
deadline, and nothing left running afterwards.

Layers, outermost first (each one is used only where this machine allows it):

1. ``unshare --pid --fork --kill-child --net`` (as root, or with ``--user --map-root-user``):
   a PID namespace, so that when its first process dies the kernel kills every process in it,
   and a network namespace with only the loopback interface (no network).
2. ``_sandbox_init.py``: a child subreaper that runs torchrun, and kills and reports every
   process still running below it when torchrun exits.
3. ``start_new_session``: the submission's own session and process group, killed as a whole.
4. The grader's own watch: every tick it records the processes below the launcher and those
   carrying this job's token in their environment; at the end it SIGKILLs any that is still
   alive (checked by start time, so a recycled pid is never hit).
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

INIT = Path(__file__).with_name("_sandbox_init.py")
TOKEN_VAR = "SCALING_LABS_GRADER_JOB"


# ----------------------------------------------------------------------------------------
# /proc
# ----------------------------------------------------------------------------------------

def _stat(pid: int):
    """(ppid, state, start_ticks) of ``pid`` or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
        rest = raw[raw.rindex(")") + 2:].split()
        return int(rest[1]), rest[0], int(rest[19])
    except (OSError, ValueError, IndexError):
        return None


def _environ(pid: int) -> dict:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read(1 << 20)
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            env[k.decode(errors="replace")] = v.decode(errors="replace")
    return env


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read(400).replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def alive(pid: int, start_ticks: int) -> bool:
    st = _stat(pid)
    return st is not None and st[2] == start_ticks and st[1] not in ("Z", "X")


def processes_with_token(token: str) -> list[int]:
    """Every live process whose environment carries ``token`` (used by tests, too)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            st = _stat(int(name))
            if st and st[1] not in ("Z", "X") and _environ(int(name)).get(TOKEN_VAR) == token:
                found.append(int(name))
    return found


@dataclass
class Seen:
    pid: int
    start_ticks: int
    cmd: str
    env_rank: str | None
    worker: bool            # torchrun's environment for a rank (TORCHELASTIC_RUN_ID and RANK set)
    ppid: int = 0


def _tcp_links(pid: int) -> list[tuple[str, str]]:
    """(local, remote) endpoints of the ESTABLISHED TCP connections that ``pid`` holds, read from
    its own network namespace's tables and matched to its file descriptors by socket inode."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    except OSError:
        return []
    links = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if len(parts) > 9 and parts[3] == "01" and parts[9] in inodes:
                        links.append((parts[1], parts[2]))
        except (OSError, StopIteration):
            continue
    return links


class Watch:
    """Records every process below ``root`` or carrying ``token``, one /proc scan per tick, and
    which torchrun workers hold TCP connections to each other (the process group's links)."""

    def __init__(self, root: int, token: str):
        self.root, self.token = root, token
        self.seen: dict[tuple[int, int], Seen] = {}
        self._checked: set[tuple[int, int]] = set()
        self.links: dict[str, set[str]] = {}     # worker RANK -> RANKs of workers it is connected to

    def _links_tick(self) -> None:
        workers = [s for s in self.workers() if s.env_rank is not None and alive(s.pid, s.start_ticks)]
        if len(workers) < 2:
            return
        ends = {w.env_rank: _tcp_links(w.pid) for w in workers}
        owner = {local: rank for rank, pairs in ends.items() for local, _ in pairs}
        for rank, pairs in ends.items():
            for _, remote in pairs:
                peer = owner.get(remote)
                if peer is not None and peer != rank:
                    self.links.setdefault(rank, set()).add(peer)

    def tick(self) -> None:
        table = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                st = _stat(int(name))
                if st and st[1] not in ("Z", "X"):
                    table[int(name)] = st
        children: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        below, todo = set(), [self.root]
        while todo:
            for c in children.get(todo.pop(), []):
                if c not in below:
                    below.add(c)
                    todo.append(c)
        for pid, (ppid, _, start) in table.items():
            key = (pid, start)
            if key in self.seen and (self.seen[key].worker or pid not in below):
                continue                 # a process seen between fork and exec is looked at again
            if key in self._checked and pid not in below:
                continue
            env = None
            if pid not in below:
                self._checked.add(key)
                env = _environ(pid)
                if env.get(TOKEN_VAR) != self.token:
                    continue
            env = env if env is not None else _environ(pid)
            self.seen[key] = Seen(pid, start, _cmdline(pid), env.get("RANK"),
                                  "TORCHELASTIC_RUN_ID" in env and "RANK" in env, ppid)
        self._links_tick()

    def workers(self) -> list[Seen]:
        """The ranks torchrun started: processes with a rank's environment whose parent has none
        (a rank's own children, DataLoader workers for instance, inherit the environment)."""
        ranks = [s for s in self.seen.values() if s.worker]
        rank_pids = {s.pid for s in ranks}
        return [s for s in ranks if s.ppid not in rank_pids]

    def still_alive(self) -> list[Seen]:
        return [s for s in self.seen.values() if alive(s.pid, s.start_ticks)]


# ----------------------------------------------------------------------------------------
# What this machine allows
# ----------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def probe_isolation() -> dict:
    """Try each unshare layer once with a do-nothing init; keep the strongest that works.
    ``SCALING_LABS_NO_UNSHARE=1`` skips them (to test, or where unshare misbehaves)."""
    unshare = None if os.environ.get("SCALING_LABS_NO_UNSHARE") == "1" else shutil.which("unshare")
    candidates = []
    if unshare and sys.platform.startswith("linux"):
        user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
        pid = ["--pid", "--fork", "--kill-child"]
        candidates = [(pid + ["--net"], True, True), (["--net"], False, True), (pid, True, False)]
        candidates = [([unshare] + user + flags, p, n) for flags, p, n in candidates]
    for prefix, pidns, netns in candidates:
        with tempfile.TemporaryDirectory(prefix="grader-probe-") as d:
            status = Path(d) / "status.json"
            cmd = prefix + [sys.executable, str(INIT), "--status", str(status)]
            cmd += (["--pidns"] if pidns else []) + (["--lo-up"] if netns else []) + ["--"]
            try:
                r = subprocess.run(cmd, capture_output=True, timeout=20)
                st = json.loads(status.read_text()) if status.exists() else {}
            except (OSError, subprocess.TimeoutExpired, ValueError):
                continue
            if r.returncode != 0 or (netns and st.get("loopback_up") is not True):
                continue
            if netns and set(st.get("interfaces") or []) - {"lo"}:
                continue
            return {"prefix": prefix, "pidns": pidns, "netns": netns}
    return {"prefix": [], "pidns": False, "netns": False}


def isolation_summary(iso: dict, spec_device: str) -> dict:
    """What was, and was not, in force: said plainly for the report."""
    inforce = ["a fresh working directory holding only the submission and the training split",
               "its own process session and process group (start_new_session), killed as a whole",
               "a child subreaper that kills any process left running when torchrun exits, and dies "
               "with the grader (PR_SET_PDEATHSIG), taking the submission along",
               "a grader-side watch of the process tree and of this job's environment token",
               "RLIMIT_FSIZE on every file the submission writes (logs included)",
               "wall-clock deadline measured by the grader, SIGKILL past it"]
    not_inforce = ["the submission runs as the grader's user: it can read any file that user can "
                   "(public datasets in DATA_DIR or scikit-learn included, and the working directories of "
                   "submissions graded at the same time) and write the probe's records",
                   "no CPU, memory or GPU-memory limits beyond the deadline",
                   "no filesystem isolation (no chroot or mount namespace)"]
    if iso["pidns"]:
        inforce.append("a PID namespace: the submission cannot signal processes outside it, and when "
                       "it ends the kernel kills every process in it")
    else:
        not_inforce.append("no PID namespace (unshare --pid unavailable here): the submission could "
                           "see and signal other processes of the grader's user, the grader included")
    if iso["netns"]:
        inforce.append("no network: a network namespace with only the loopback interface")
    else:
        not_inforce.append("network access NOT blocked (unshare --net unavailable here)")
    if spec_device == "cpu":
        inforce.append("GPUs hidden (CUDA_VISIBLE_DEVICES empty)")
    return {"in_force": inforce, "not_in_force": not_inforce,
            "unshare": " ".join(Path(a).name if i == 0 else a for i, a in enumerate(iso["prefix"])) or None}


# ----------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------

@dataclass
class RunResult:
    returncode: int | None
    wall_s: float
    timed_out: bool
    init_status: dict
    workers: list[Seen]
    links: dict                    # worker RANK -> RANKs it held TCP connections to
    stragglers: list[str]          # processes left running after torchrun exited (killed)
    leftovers: list[str]           # processes the grader itself had to kill at the end
    remaining: list[str] = field(default_factory=list)   # still alive after all that (never expected)


def _kill(seen: list[Seen]) -> None:
    for s in seen:
        if alive(s.pid, s.start_ticks):
            try:
                os.kill(s.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def run(cmd: list[str], *, cwd: Path, env: dict, log_path: Path, budget_s: float, max_bytes: int,
        token: str, status_path: Path, tick_s: float = 0.1, isolation: dict | None = None) -> RunResult:
    """Run ``cmd`` in the sandbox until it exits or ``budget_s`` passes; leave nothing behind.
    ``isolation``: the unshare layers to use (default: :func:`probe_isolation`)."""
    iso = isolation if isolation is not None else probe_isolation()
    init = [sys.executable, str(INIT), "--status", str(status_path), "--fsize", str(int(max_bytes))]
    init += (["--pidns"] if iso["pidns"] else []) + (["--lo-up"] if iso["netns"] else [])
    if iso["prefix"]:     # a guard outside the namespaces: it dies with the grader, taking all along
        full = [sys.executable, str(INIT), "--pdeathsig", "--"] + iso["prefix"] + init + ["--"] + cmd
    else:
        full = init + ["--pdeathsig", "--"] + cmd
    env = {**env, TOKEN_VAR: token}
    with open(log_path, "wb") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(full, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    watch = Watch(proc.pid, token)
    timed_out = False
    while True:
        watch.tick()
        try:
            proc.wait(timeout=tick_s)
            break
        except subprocess.TimeoutExpired:
            pass
        if time.perf_counter() - t0 > budget_s:
            timed_out = True
            break
    wall = time.perf_counter() - t0
    if timed_out:
        watch.tick()
        try:
            os.killpg(proc.pid, signal.SIGKILL)     # the session's group: unshare, init, torchrun, ranks
        except (ProcessLookupError, PermissionError):
            pass
        _kill(watch.still_alive())                 # and those that left the group (setsid)
        proc.wait()
    # Processes just killed (the PID namespace's teardown, the group's SIGKILL) take a moment
    # to disappear from /proc; whatever is still alive after that escaped: kill it.
    grace = time.perf_counter() + 3.0
    while time.perf_counter() < grace:
        watch.tick()
        if not watch.still_alive():
            break
        time.sleep(0.05)
    leftovers = []
    for _ in range(50):
        watch.tick()
        live = watch.still_alive() + [Seen(p, _stat(p)[2], _cmdline(p), None, False)
                                      for p in processes_with_token(token)
                                      if _stat(p) and (p, _stat(p)[2]) not in watch.seen]
        if not live:
            break
        leftovers += [s.cmd for s in live]
        _kill(live)
        time.sleep(0.02)
    remaining = [s.cmd for s in watch.still_alive()] + [_cmdline(p) for p in processes_with_token(token)]
    try:
        init_status = json.loads(status_path.read_text())
    except (OSError, ValueError):
        init_status = {}
    rc = proc.returncode
    if not timed_out and init_status.get("rc") is not None:
        rc = init_status["rc"]
    return RunResult(None if timed_out else rc, wall, timed_out, init_status, watch.workers(),
                     {k: sorted(v) for k, v in watch.links.items()},
                     list(init_status.get("stragglers") or []), sorted(set(leftovers)), remaining)
