"""Running a submission in a sandbox of its own: Linux namespaces, read-only system, private
job dir and tmpfs, cleared environment, resource caps, a channel for evidence, nothing left
behind. Threat model and limits: utils/grader/README.md.

A job runs as

    _sandbox_init --outer (dies with the grader, joins the job's cgroups)
        -> bwrap (or unshare + _sandbox_init's mount setup)
        -> _sandbox_init.py (rlimits, subreaper, non-dumpable) -> torchrun -> ranks

with new user, PID, IPC, UTS, network (loopback only) and mount namespaces; the system, the
Python installation, the venv and the project's ``utils`` package bound read-only; ``/job`` (the
job dir, mode 0700) the one writable place on disk; private size-capped tmpfs on ``/tmp``,
``/var/tmp`` and ``/dev/shm``; no capability in any namespace the grader lives in. Where neither
bwrap nor ``unshare`` can build that here, :func:`probe_isolation` raises
:class:`SandboxUnavailable` and nothing is graded.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

INIT = Path(__file__).with_name("_sandbox_init.py")
PROJECT = Path(__file__).resolve().parents[2]
PACKAGE = PROJECT / "utils"  # the only part of the project a job sees
JOB_DIR = "/job"  # the job dir, as the job sees it
JOB_UID = 65534  # the job's uid inside its user namespace (nobody)
CHANNEL_FD_VAR = "SCALING_LABS_GRADER_FD"  # the evidence channel's fd number, in the job
FORCE_VAR = "SCALING_LABS_SANDBOX"  # bwrap | unshare: use only that one (tests, debugging)
MAX_CHANNEL_BYTES = 8 << 20  # the grader reads at most this much evidence per job
HOSTNAME = "grader-job"
PROC_READ_ONLY = (
    "/proc/sys",
    "/proc/sysrq-trigger",
    "/proc/irq",
    "/proc/bus",
    "/proc/fs",
    "/proc/mtrr",
    "/proc/acpi",
    "/proc/driver",
    "/proc/tty",
    "/proc/scsi",
)
HOSTS = f"127.0.0.1 localhost {HOSTNAME}\n::1 localhost ip6-localhost {HOSTNAME}\n"
ETC_FILES = (
    "passwd",
    "group",
    "nsswitch.conf",
    "host.conf",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "alternatives",
)


class SandboxUnavailable(RuntimeError):
    """Neither bwrap nor unshare can isolate a submission on this machine: grading is refused."""


# ----------------------------------------------------------------------------------------
# /proc, read from the grader's side
# ----------------------------------------------------------------------------------------

PF_EXITING = 0x4  # /proc/PID/stat's flags: the process is in exit()


def _stat(pid: int):
    """(ppid, state, start_ticks) of ``pid`` or None; state "X" for a process already in exit()
    (its SIGKILL delivered, its memory going: no code of it runs again, only the kernel's teardown,
    which on a busy box can outlast the grader's grace period)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
        rest = raw[raw.rindex(")") + 2 :].split()
        return int(rest[1]), "X" if int(rest[6]) & PF_EXITING else rest[0], int(rest[19])
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
            return f.read(200).replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _pidns(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _netns(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _cgroups(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            return f.read()
    except OSError:
        return ""


def alive(pid: int, start_ticks: int) -> bool:
    st = _stat(pid)
    return st is not None and st[2] == start_ticks and st[1] not in ("Z", "X")


def processes_in_pidns(ns: str | None) -> list[int]:
    """Every live process of the PID namespace ``ns`` (as /proc/PID/ns/pid names it)."""
    if not ns:
        return []
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and _pidns(name) == ns:
            st = _stat(int(name))
            if st and st[1] not in ("Z", "X"):
                found.append(int(name))
    return found


@dataclass
class Seen:
    pid: int
    start_ticks: int
    cmd: str
    env_rank: str | None
    worker: bool  # torchrun's environment for a rank (TORCHELASTIC_RUN_ID and RANK set)
    ppid: int = 0
    cgroup: str = ""  # /proc/PID/cgroup when first seen


def _pin_pidns(pid: int, start_ticks: int) -> tuple[str, int] | None:
    """(name, fd) of the PID namespace of process ``pid`` (started at ``start_ticks``), held open.
    The kernel gives a freed namespace's number to the next new one within a second or so, and
    another grader's job may be that one: while this fd is open the number stays this job's."""
    try:
        fd = os.open(f"/proc/{pid}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    st = _stat(pid)
    if st is None or st[2] != start_ticks:  # the pid was reused before the open: not the job's
        os.close(fd)
        return None
    return f"pid:[{os.fstat(fd).st_ino}]", fd


class Watch:
    """Every process below ``root`` (the sandbox's outermost process), one /proc scan per tick:
    pid, start time, rank, cgroup membership, and the job's PID namespace (held open until
    :meth:`close`, so that its name cannot come to mean another job's)."""

    def __init__(self, root: int):
        self.root = root
        self.seen: dict[tuple[int, int], Seen] = {}
        self.pidns: str | None = None
        self._pidns_fd: int | None = None
        self.host_ns = _pidns("self")
        self.host_net = _netns("self")
        self.loopback_octets = 0  # the job's network namespace: IP bytes in, loopback only
        self.rlimits: dict = {}  # of the first rank seen, as the kernel reports them

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
        # nearest the root first: the job's own namespace is the first one met, never one that a
        # process of the job made below it
        below, todo = {}, [self.root]
        while todo:
            for c in children.get(todo.pop(0), []):
                if c not in below:
                    below[c] = None
                    todo.append(c)
        sample = None
        for pid in below:
            ppid, _, start = table[pid]
            key = (pid, start)
            if self.pidns is None and _pidns(pid) not in (None, self.host_ns):
                pinned = _pin_pidns(pid, start)
                if pinned is not None and pinned[0] != self.host_ns:
                    self.pidns, self._pidns_fd = pinned
                elif pinned is not None:
                    os.close(pinned[1])
            if sample is None and _netns(pid) not in (None, self.host_net):
                sample = pid
            if key in self.seen and self.seen[key].worker:
                continue  # a process seen between fork and exec is looked at again
            env = _environ(pid)
            self.seen[key] = Seen(
                pid,
                start,
                _cmdline(pid),
                env.get("RANK"),
                "TORCHELASTIC_RUN_ID" in env and "RANK" in env,
                ppid,
                _cgroups(pid),
            )
            if self.seen[key].worker and not self.rlimits:
                self.rlimits = _rlimits(pid)
        if sample is not None:
            self.loopback_octets = max(self.loopback_octets, _in_octets(sample))

    def workers(self) -> list[Seen]:
        """The ranks torchrun started: processes with a rank's environment whose parent has none
        (a rank's own children, DataLoader workers for instance, inherit the environment)."""
        ranks = [s for s in self.seen.values() if s.worker]
        rank_pids = {s.pid for s in ranks}
        return [s for s in ranks if s.ppid not in rank_pids]

    def still_alive(self) -> list[Seen]:
        return [s for s in self.seen.values() if alive(s.pid, s.start_ticks)]

    def job_processes(self) -> list[int]:
        """The live processes of the job's PID namespace; [] where it was never seen (then the
        job had ended before a tick, and its init's exit emptied the namespace)."""
        return processes_in_pidns(self.pidns) if self._pidns_fd is not None else []

    def close(self) -> None:
        if self._pidns_fd is not None:
            os.close(self._pidns_fd)
            self._pidns_fd = None


def _rlimits(pid: int) -> dict:
    """{'Max address space': '3221225472', ...}: the soft limits /proc/PID/limits shows."""
    out = {}
    try:
        with open(f"/proc/{pid}/limits") as f:
            for line in f.read().splitlines()[1:]:
                name, soft = line[:26].strip(), line[26:47].strip()
                if name in ("Max address space", "Max processes", "Max file size", "Max cpu time"):
                    out[name] = soft
    except OSError:
        pass
    return out


def _in_octets(pid: int) -> int:
    """IPv4 + IPv6 bytes received in the network namespace ``pid`` lives in: the kernel's count
    (IpExt InOctets, Ip6InOctets), not the job's. With loopback only, all of it is the job's own."""
    total = 0
    try:
        with open(f"/proc/{pid}/net/netstat") as f:
            lines = f.read().splitlines()
        for head, values in zip(lines[::2], lines[1::2]):
            if head.startswith("IpExt:"):
                total += int(dict(zip(head.split()[1:], values.split()[1:])).get("InOctets", 0))
    except (OSError, ValueError):
        pass
    try:
        with open(f"/proc/{pid}/net/snmp6") as f:
            for line in f:
                k, _, v = line.partition(" ")
                if k == "Ip6InOctets":
                    total += int(v)
    except (OSError, ValueError):
        pass
    return total


# ----------------------------------------------------------------------------------------
# Resource caps: a cgroup per job where the grader may create one, rlimits always
# ----------------------------------------------------------------------------------------


@dataclass
class Limits:
    memory_bytes: int  # the whole job (cgroup); also RLIMIT_AS per process on the CPU
    processes: int  # pids.max; RLIMIT_NPROC (threads count)
    file_bytes: int  # RLIMIT_FSIZE: any one file the job writes
    cpu_seconds: int  # RLIMIT_CPU per process (the deadline is the grader's clock)
    tmpfs_bytes: int  # size of each private tmpfs
    address_space: bool = True  # False for CUDA jobs (the driver reserves huge address ranges)


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fstype, super options) of the grader's mount namespace."""
    out = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                parts, rparts = left.split(), right.split()
                if len(parts) >= 5 and len(rparts) >= 3:
                    out.append((parts[4], rparts[0], set(rparts[2].split(","))))
    except OSError:
        pass
    return out


def _own_cgroups() -> dict[str, str]:
    """{controller or '' for v2: path of the grader's own cgroup}."""
    out = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                hid, ctrls, path = line.rstrip("\n").split(":", 2)
                for c in ctrls.split(",") if ctrls else [""]:
                    out[c] = path
    except (OSError, ValueError):
        pass
    return out


def _write(path: Path, value) -> bool:
    try:
        path.write_text(str(value))
        return True
    except OSError:
        return False


class JobCgroup:
    """A cgroup per job: v2 (memory.max, cpu.weight, pids.max) where the grader's cgroup may
    delegate those controllers, else v1 (memory.limit_in_bytes, cpu.shares, pids.max). Every
    process of the job is in it from its first instruction, so its setsid'd processes share one
    CPU weight (the scheduler's autogroups apply only to the root cgroup)."""

    def __init__(self, dirs: list[Path], version: int, applied: list[str]):
        self.dirs, self.version, self.applied = dirs, version, applied

    @staticmethod
    def create(name: str, limits: Limits) -> JobCgroup | None:
        if os.environ.get("SCALING_LABS_NO_CGROUP") == "1":
            return None
        own = _own_cgroups()
        mounts = _mounts()
        v2 = next((m for m, t, _ in mounts if t == "cgroup2"), None)
        if v2 is not None and "" in own:
            parent = Path(v2 + own[""])
            try:
                available = set((parent / "cgroup.controllers").read_text().split())
            except OSError:
                available = set()
            want = {"memory", "cpu", "pids"} & available
            if {"memory", "pids"} <= want:
                try:
                    enabled = set((parent / "cgroup.subtree_control").read_text().split())
                except OSError:
                    enabled = set()
                for c in want - enabled:
                    _write(parent / "cgroup.subtree_control", f"+{c}")
                d = parent / name
                try:
                    d.mkdir()
                except OSError:
                    d = None
                if d is not None:
                    ok = []
                    if _write(d / "memory.max", limits.memory_bytes):
                        ok.append(f"memory.max {limits.memory_bytes >> 20} MiB")
                    _write(d / "memory.swap.max", 0)
                    if _write(d / "pids.max", limits.processes):
                        ok.append(f"pids.max {limits.processes}")
                    if _write(d / "cpu.weight", 100):
                        ok.append("cpu.weight 100")
                    if "memory.max" in " ".join(ok):
                        return JobCgroup([d], 2, ok)
                    _rmdir(d)
        dirs, ok = [], []
        for ctrl, files in (
            ("memory", [("memory.limit_in_bytes", limits.memory_bytes)]),
            ("cpu", [("cpu.shares", 1024)]),
            ("pids", [("pids.max", limits.processes)]),
        ):
            mount = next((m for m, t, opts in mounts if t == "cgroup" and ctrl in opts), None)
            if mount is None or ctrl not in own:
                continue
            d = Path(mount + own[ctrl]) / name
            try:
                d.mkdir()
            except OSError:
                continue
            if all(_write(d / f, v) for f, v in files):
                dirs.append(d)
                ok += [f"{f} {v >> 20} MiB" if f.startswith("memory") else f"{f} {v}" for f, v in files]
                if ctrl == "memory":
                    _write(d / "memory.memsw.limit_in_bytes", limits.memory_bytes)  # no swap either
            else:
                _rmdir(d)
        if not any("memory" in o for o in ok):
            for d in dirs:
                _rmdir(d)
            return None
        return JobCgroup(dirs, 1, ok)

    @staticmethod
    def sweep_stale() -> int:
        """Remove the empty cgroups of graders that died (SIGKILL leaves their job's cgroup):
        named grader-PID-..., the PID no longer alive. A cgroup with a process is never removed."""
        own = _own_cgroups()
        removed = 0
        for mount, fstype, opts in _mounts():
            if fstype not in ("cgroup", "cgroup2"):
                continue
            ctrl = "" if fstype == "cgroup2" else next((c for c in ("memory", "cpu", "pids") if c in opts), None)
            if ctrl is None or ctrl not in own:
                continue
            for d in Path(mount + own[ctrl]).glob("grader-*-*"):
                pid = d.name.split("-")[1]
                if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                    try:
                        d.rmdir()
                        removed += 1
                    except OSError:
                        pass
        return removed

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def members(self, live_only: bool = False) -> set[int]:
        """The job's processes in its cgroup; ``live_only``: not those already in exit() or dead."""
        pids = set()
        for d in self.dirs:
            try:
                pids |= {int(p) for p in (d / "cgroup.procs").read_text().split()}
            except (OSError, ValueError):
                pass
        if live_only:
            pids = {p for p in pids if (_stat(p) or (0, "X"))[1] not in ("Z", "X")}
        return pids

    def contains(self, cgroup_text: str) -> bool:
        """Is a process whose /proc/PID/cgroup reads ``cgroup_text`` in this job's cgroup?"""
        return any(f"/{d.name}\n" in cgroup_text + "\n" for d in self.dirs)

    def kill_and_remove(self) -> list[int]:
        left = []
        for _ in range(100):
            pids = self.members()
            if not pids:
                break
            left = sorted(pids)
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.02)
        for d in self.dirs:
            _rmdir(d)
        return [p for p in left if (_stat(p) or (0, "X"))[1] not in ("Z", "X")]


def _rmdir(d: Path) -> None:
    for _ in range(50):
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)


# ----------------------------------------------------------------------------------------
# The sandbox's command line
# ----------------------------------------------------------------------------------------


def _python_roots() -> list[str]:
    """The interpreter, its standard library and the venv: bound read-only at their own paths."""
    roots = {
        os.path.realpath(p)
        for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable)))
    }
    roots |= {os.path.realpath(os.path.dirname(os.path.dirname(sys.executable)))}
    out = []
    for r in sorted(roots, key=len):
        if r in ("/", "/usr") or r.startswith("/usr/") or any(r.startswith(o + "/") for o in out):
            continue
        out.append(r)
    return out


SYS_PATH_VAR = "SCALING_LABS_SYS_PATH"  # the grader's import path, for the probe to rebuild in the job


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _in_venv(path: str, below: str) -> bool:
    """Is ``path`` inside a virtual environment (a folder with pyvenv.cfg) strictly below ``below``?"""
    d = path
    while _under(d, below) and d != below:
        if os.path.isfile(os.path.join(d, "pyvenv.cfg")):
            return True
        d = os.path.dirname(d)
    return False


def import_path(hidden: Iterable = ()) -> dict:
    """The grader's whole import path, for the job: every existing entry of ``sys.path`` that
    the binds of the system, the Python installation and ``utils/`` do not hold already (a
    folder a ``.pth`` file adds, the user site, ``PYTHONPATH``) is bound read-only at its real
    path, unless it would show the job more than packages: a folder holding (or being) the
    project, the grader's home or working directory, the temp dir (job dirs, the data cache),
    the datasets, or a path of ``hidden`` (the spec, its held-out file). Returns
    ``{"bind": [...], "path": [...] (sys.path order, real paths the job will see),
    "refused": {entry: why}}``."""
    home = os.path.expanduser("~")
    import tempfile

    protected = {
        str(PROJECT),
        home,
        tempfile.gettempdir(),
        os.getcwd(),
        os.environ.get("DATA_DIR") or os.path.join(home, ".cache"),
    }
    protected |= {str(h) for h in hidden if h}
    protected = {os.path.realpath(os.path.abspath(p)) for p in protected}
    covered = ["/usr", str(PACKAGE)] + _python_roots()
    out = {"bind": [], "path": [], "refused": {}}
    for entry in sys.path:
        if not entry or not os.path.exists(entry):
            continue
        real = os.path.realpath(entry)
        if any(_under(real, c) for c in covered):
            out["path"].append(real)
            continue
        inside = [p for p in protected if _under(p, real)]
        if inside:
            out["refused"][entry] = f"it holds {inside[0]}"
        elif _under(real, str(PROJECT)) and not _in_venv(real, str(PROJECT)):
            out["refused"][entry] = (
                f"it is part of the project {PROJECT} (only utils/ and virtual environments are bound)"
            )
        elif real.startswith("/proc") or real.startswith("/dev") or real.startswith("/sys"):
            out["refused"][entry] = "not a folder of Python packages"
        else:
            if real not in out["bind"]:
                out["bind"].append(real)
            out["path"].append(real)
    return out


def unbound_modules(imports: dict, modules: Iterable[str] = ("torch", "numpy")) -> list[str]:
    """Why a module the job needs would not be found in it: where the grader imports it from
    is neither bound nor held by a bind (``imports``: :func:`import_path`)."""
    import importlib.util

    seen = [*imports["path"], str(PACKAGE)]
    why = []
    for name in modules:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        origin = (
            (spec.submodule_search_locations or [None])[0]
            if spec and spec.submodule_search_locations
            else (spec.origin if spec else None)
        )
        if not origin:
            continue  # not importable here either: nothing to bind
        real = os.path.realpath(origin)
        if not any(_under(real, p) for p in seen):
            entry = next((e for e in sys.path if e and _under(real, os.path.realpath(e))), os.path.dirname(real))
            why.append(f"{name} (from {entry}: {imports['refused'].get(entry, 'not on the import path')})")
    return why


def _system_layout(job_dir: Path, extra=()) -> list[tuple[str, str, str]]:
    """(kind, source, destination) for the read-only system: /usr, the /bin-/lib links or dirs,
    a few files of /etc (not /etc as a whole: /etc/shadow and friends stay out), and an
    /etc/hosts of the grader's that names the sandbox's host name (torchrun resolves it)."""
    plan = [("ro", "/usr", "/usr")]
    hosts = job_dir.parent / (job_dir.name + ".hosts")
    hosts.write_text(HOSTS)
    plan.append(("ro", str(hosts), "/etc/hosts"))
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            plan.append(("symlink", os.readlink(top), top))
        elif os.path.isdir(top):
            plan.append(("ro", top, top))
    for name in ETC_FILES:
        if os.path.exists(f"/etc/{name}"):
            plan.append(("ro", f"/etc/{name}", f"/etc/{name}"))
    for r in _python_roots():
        plan.append(("ro", r, r))
    plan.append(("ro", str(PACKAGE), str(PACKAGE)))
    for r in extra:  # the rest of the grader's import path (import_path)
        plan.append(("ro", r, r))
    return plan


DEVICE_NODES = {"null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8), "urandom": (1, 9), "tty": (5, 0)}


@functools.cache
def private_devices() -> str | None:
    """A folder of the grader's own /dev/null, zero, ... (root only). A job whose uid outside is
    root owns the host's device nodes and could chmod them (chmod 000 /dev/null breaks the
    machine); bound instead, these copies are all it can touch. None where mknod or opening
    the copies is not possible (then the host's nodes are bound, as bwrap --dev does)."""
    if os.geteuid() != 0:
        return None
    import atexit
    import tempfile

    d = tempfile.mkdtemp(prefix="grader-dev-")
    atexit.register(shutil.rmtree, d, True)
    try:
        for name, (major, minor) in DEVICE_NODES.items():
            os.mknod(f"{d}/{name}", 0o666 | 0o020000, os.makedev(major, minor))
            os.chmod(f"{d}/{name}", 0o666)
        with open(f"{d}/null", "w") as f:
            f.write("x")
        return d
    except OSError:
        return None


def _dev_nodes() -> list[tuple[str, str]]:
    """(source, destination) of the job's device nodes."""
    own = private_devices()
    return [
        (f"{own}/{n}" if own else f"/dev/{n}", f"/dev/{n}")
        for n in DEVICE_NODES
        if os.path.exists(f"{own}/{n}" if own else f"/dev/{n}")
    ]


def _devices(minors) -> list[str]:
    """The device nodes of a CUDA job: the driver's, and /dev/nvidiaN for each device minor N."""
    if minors is None:
        return []
    nodes = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset"]
    nodes += [f"/dev/nvidia{m}" for m in minors]
    return [n for n in nodes if os.path.exists(n)]


NVIDIA_GPUS = "/proc/driver/nvidia/gpus"


def _nvml_gpus() -> list[dict]:
    """The same table from NVML (nvidia-ml-py), where /proc/driver/nvidia is hidden; [] without it."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return []
    out = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid, bus = pynvml.nvmlDeviceGetUUID(h), pynvml.nvmlDeviceGetPciInfo(h).busId
            out.append(
                {
                    "bus": (bus.decode() if isinstance(bus, bytes) else bus).lower(),
                    "uuid": uuid.decode() if isinstance(uuid, bytes) else uuid,
                    "minor": int(pynvml.nvmlDeviceGetMinorNumber(h)),
                }
            )
    except Exception:
        return []
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return sorted(out, key=lambda g: g["bus"])


def nvidia_gpus(proc_dir: str = NVIDIA_GPUS, nvml: bool = True) -> list[dict]:
    """The driver's GPUs in PCI bus order: {"bus", "uuid", "minor"}, from each GPU's
    ``information`` file (``GPU UUID:``, ``Device Minor:``), else from NVML; [] without either."""
    out = []
    try:
        buses = sorted(os.listdir(proc_dir))
    except OSError:
        return _nvml_gpus() if nvml else out
    for bus in buses:
        fields = {}
        try:
            with open(os.path.join(proc_dir, bus, "information")) as f:
                for line in f:
                    k, sep, v = line.partition(":")
                    if sep:
                        fields[k.strip()] = v.strip()
            out.append({"bus": bus.lower(), "uuid": fields["GPU UUID"], "minor": int(fields["Device Minor"])})
        except (OSError, KeyError, ValueError):
            continue
    return out or (_nvml_gpus() if nvml else out)


def visible_gpus(table: list[dict], cuda_visible: str | None) -> list[dict]:
    """``table``'s GPUs as the grader's CUDA numbers them under its CUDA_VISIBLE_DEVICES: an
    integer is an index in PCI bus order (CUDA's with CUDA_DEVICE_ORDER=PCI_BUS_ID, or GPUs of one
    model), ``GPU-...`` a UUID or an unambiguous prefix of one; as CUDA does, the first invalid
    entry ends the list and a repeated one empties it."""
    if cuda_visible is None:
        return list(table)
    out = []
    for item in cuda_visible.split(","):
        item = item.strip()
        if item.isdigit():
            found = [table[int(item)]] if int(item) < len(table) else []
        else:
            found = [g for g in table if item and g["uuid"].lower().startswith(item.lower())]
        if len(found) != 1:
            break
        if found[0] in out:
            return []
        out.append(found[0])
    return out


def gpu_binding(
    gpus: list[int], uuids: list[str] | None = None, table: list[dict] | None = None, cuda_visible: str | None = None
) -> tuple[list[int], str]:
    """(device minors to bind, CUDA_VISIBLE_DEVICES for the job) for the grader's CUDA indices
    ``gpus``. A CUDA index is not a device minor (the grader's own CUDA_VISIBLE_DEVICES and
    CUDA's ordering renumber the GPUs), and inside the sandbox CUDA numbers what it sees from 0:
    the job gets the GPUs' UUIDs, which name the same devices whatever CUDA enumerates there.
    ``uuids``: the UUID of each of the grader's CUDA indices (from torch, when CUDA is up); else
    they come from ``table`` (:func:`nvidia_gpus`) under ``cuda_visible`` (the grader's
    CUDA_VISIBLE_DEVICES). Without the driver's table: the indices as minors, and 0..k-1."""
    table = nvidia_gpus() if table is None else table
    by_uuid = {g["uuid"].lower(): g for g in table}
    if uuids is None:
        seen = visible_gpus(table, cuda_visible)
        uuids = [g["uuid"] for g in seen]
    picked = []
    for i in gpus:
        g = by_uuid.get(uuids[i].lower()) if 0 <= i < len(uuids) else None
        if g is None:
            break
        picked.append(g)
    if len(picked) == len(gpus) and picked:
        return [g["minor"] for g in picked], ",".join(g["uuid"] for g in picked)
    return list(gpus), ",".join(str(k) for k in range(len(gpus)))


@functools.cache
def _bwrap_help() -> str:
    try:
        return subprocess.run([shutil.which("bwrap"), "--help"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError, TypeError):
        return ""


def bwrap_command(job_dir: Path, limits: Limits, gpus: list[int] | None = None, extra: Iterable = ()) -> list[str]:
    bwrap = shutil.which("bwrap")
    cmd = [
        bwrap,
        "--unshare-user",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-net",
        "--unshare-cgroup-try",
        "--die-with-parent",
        "--new-session",
        "--as-pid-1",
        "--uid",
        str(JOB_UID),
        "--gid",
        str(JOB_UID),
        "--hostname",
        HOSTNAME,
        "--clearenv",
    ]
    if "--disable-userns" in _bwrap_help():  # bubblewrap >= 0.8: no user namespace in the job
        cmd.insert(1, "--disable-userns")
    # The private tmpfs first: the binds below may live under /tmp (a project checked out there).
    cmd += ["--proc", "/proc", "--tmpfs", "/dev"]
    for src, dst in _dev_nodes():
        cmd += ["--dev-bind", src, dst]
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        cmd += ["--symlink", target, f"/dev/{name}"]
    # The job's uid outside is the grader's (root, often), and the kernel lets that uid write
    # global sysctls (kernel.core_pattern: code run as root on the host): /proc/sys read-only.
    for d in PROC_READ_ONLY:
        cmd += ["--ro-bind-try", d, d]
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        cmd += ["--perms", "1777", "--size", str(limits.tmpfs_bytes), "--tmpfs", d]
    for kind, src, dst in _system_layout(job_dir, extra):
        cmd += ["--symlink", src, dst] if kind == "symlink" else ["--ro-bind", src, dst]
    for node in _devices(gpus):
        cmd += ["--dev-bind", node, node]
    if gpus is not None:
        cmd += ["--ro-bind", "/sys", "/sys"]
    cmd += ["--bind", str(job_dir), JOB_DIR, "--chdir", JOB_DIR]
    return cmd


def unshare_command(
    job_dir: Path, limits: Limits, gpus: list[int] | None = None, extra: Iterable = ()
) -> tuple[list[str], dict]:
    """unshare's namespaces; _sandbox_init builds the same file system inside (``--setup``)."""
    cmd = [
        shutil.which("unshare"),
        "--user",
        "--map-root-user",
        "--mount",
        "--pid",
        "--fork",
        "--kill-child",
        "--net",
        "--ipc",
        "--uts",
    ]
    newroot = job_dir.parent / (job_dir.name + ".root")  # an empty mount point, grader-owned
    newroot.mkdir(mode=0o700, exist_ok=True)
    plan = {
        "layout": _system_layout(job_dir, extra),
        "hostname": HOSTNAME,
        "proc_read_only": PROC_READ_ONLY,
        "dev_nodes": _dev_nodes(),
        "devices": _devices(gpus),
        "sys": gpus is not None,
        "newroot": str(newroot),
        "job": str(job_dir),
        "job_dest": JOB_DIR,
        "tmpfs_bytes": limits.tmpfs_bytes,
    }
    return cmd, plan


# ----------------------------------------------------------------------------------------
# What this machine allows: probed once, never assumed
# ----------------------------------------------------------------------------------------

_CHECK = r"""
import json, os, socket, sys
out = {"caps": open("/proc/self/status").read().split("CapEff:")[1].split()[0],
       "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
       "interfaces": sorted(n for _, n in socket.if_nameindex()), "uid": os.getuid()}
try:
    out["package_readable"] = len(open(sys.argv[1]).read()) > 0
except OSError:
    out["package_readable"] = False
try:
    open(sys.argv[1], "a").close(); out["package_writable"] = True
except OSError:
    out["package_writable"] = False
try:
    open("/job/.probe", "w").close(); out["job_writable"] = True
except OSError:
    out["job_writable"] = False
out["sysctl_writable"] = os.access("/proc/sys/kernel/core_pattern", os.W_OK)
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(); out["loopback"] = True
print(json.dumps(out))
"""


def _check_ok(out: dict) -> str | None:
    """Why the sandbox's self-report shows that it does not isolate, or None."""
    if int(out.get("caps", "1"), 16) != 0:
        return "the job kept capabilities"
    if out.get("package_readable") is not True:
        return "the project's utils/ was not readable in the job"
    if out.get("package_writable") is not False:
        return "the project was writable from the job"
    if out.get("sysctl_writable") is not False:
        return "global sysctls (/proc/sys) were writable from the job"
    if out.get("job_writable") is not True:
        return "the job dir was not writable"
    if set(out.get("interfaces") or []) - {"lo"}:
        return f"network interfaces other than loopback: {out.get('interfaces')}"
    if len(out.get("pids") or []) > 4:
        return "processes outside the job were visible"
    return None


@functools.cache
def probe_isolation(tool: str | None = None) -> dict:
    """The first sandbox that really isolates here (bwrap, then unshare; only ``tool`` or
    $SCALING_LABS_SANDBOX where given), checked by running a probe inside it; raises
    :class:`SandboxUnavailable` when none does."""
    import tempfile

    if not sys.platform.startswith("linux"):
        raise SandboxUnavailable("the grader's sandbox needs Linux namespaces; grade on Linux")
    forced = tool or os.environ.get(FORCE_VAR)
    tools = [t for t in ("bwrap", "unshare") if not forced or t == forced]
    tried = []
    for tool in tools:
        if not shutil.which(tool):
            tried.append(f"{tool}: not installed")
            continue
        with tempfile.TemporaryDirectory(prefix="grader-probe-") as d:
            job = Path(d) / "job"
            job.mkdir(mode=0o700)
            res = run(
                [sys.executable, "-I", "-c", _CHECK, str(PACKAGE / "__init__.py")],
                job_dir=job,
                log_path=Path(d) / "log",
                env={},
                budget_s=30,
                limits=Limits(1 << 30, 64, 1 << 20, 30, 1 << 20),
                tool=tool,
                cgroup=False,
            )
            text = (Path(d) / "log").read_bytes()[-2000:].decode(errors="replace")
            try:
                out = json.loads(text.strip().splitlines()[-1])
            except (ValueError, IndexError):
                tried.append(
                    f"{tool}: {text.strip().splitlines()[-1][:150] if text.strip() else 'no output'}"
                    f" (exit {res.returncode})"
                )
                continue
        why = _check_ok(out)
        if why:
            tried.append(f"{tool}: {why}")
            continue
        JobCgroup.sweep_stale()
        cg = JobCgroup.create(f"grader-{os.getpid()}-probe-{uuid.uuid4().hex[:8]}", Limits(1 << 30, 64, 1, 1, 1))
        cgroup = None
        if cg is not None:
            cgroup = f"cgroup v{cg.version}"
            cg.kill_and_remove()
        return {"tool": tool, "cgroup": cgroup, "tried": tried}
    raise SandboxUnavailable(
        "refusing to grade: no sandbox can isolate a submission on this machine ("
        + "; ".join(tried)
        + "). Install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap) or "
        "allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, "
        "user.max_user_namespaces > 0); see utils/grader/README.md"
    )


def isolation_summary(iso: dict, cgroup: dict | None, limits: Limits, spec_device: str) -> dict:
    """What was, and was not, in force: short lines for the report."""
    tool = iso["tool"]
    inforce = [
        f"{tool}: new user, PID, IPC, UTS, mount and network namespaces",
        "network: loopback only",
        "no capabilities; "
        + ("uid 65534" if tool == "bwrap" else "uid 0, all capabilities dropped,")
        + " in its own user namespace",
        "system, Python, venv, the grader's import path and utils/ read-only; nothing else of the host",
        "writable: its job dir (0700) and private tmpfs /tmp, /var/tmp, /dev/shm",
        "environment cleared, then an allowlist",
        "evidence over a socket the grader created; exit status from the grader's wait",
        f"rlimits: FSIZE {limits.file_bytes >> 20} MiB, NPROC {limits.processes}, "
        f"CPU {limits.cpu_seconds} s" + (f", AS {limits.memory_bytes >> 20} MiB" if limits.address_space else ""),
        "wall-clock deadline on the grader's clock, then SIGKILL",
    ]
    not_inforce = []
    if cgroup:
        inforce.append(f"cgroup v{cgroup['version']}: " + ", ".join(cgroup["applied"]))
    else:
        not_inforce.append("no cgroup (not permitted here): memory by RLIMIT_AS only")
        not_inforce.append("no per-job CPU share: setsid processes get their own autogroup")
        if os.geteuid() == 0:
            not_inforce.append("RLIMIT_NPROC does not bind: the job's uid outside is root")
    if not limits.address_space:
        not_inforce.append("no RLIMIT_AS (CUDA needs the address space)")
    if os.geteuid() == 0 and not private_devices():
        not_inforce.append("host /dev nodes bound: a job mapped to root could chmod them")
    if spec_device == "cpu":
        inforce.append("GPUs hidden")
    else:
        not_inforce.append("no GPU-memory cap")
    return {"in_force": inforce, "not_in_force": not_inforce, "tool": tool}


# ----------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------


@dataclass
class RunResult:
    returncode: int | None  # of the sandbox's outermost process, as the grader waited on it
    wall_s: float
    timed_out: bool
    messages: list  # (sender's host pid or None, decoded JSON) from the channel
    workers: list[Seen]
    stragglers: list[str]  # processes left running after torchrun exited (killed)
    leftovers: list[str]  # processes the grader itself had to kill at the end
    remaining: list[str] = field(default_factory=list)  # alive after all that (never expected)
    loopback_octets: int = 0
    pidns: str | None = None
    seen: list[Seen] = field(default_factory=list)
    cgroup_escapes: list[str] = field(default_factory=list)  # processes seen outside the job's cgroup
    cgroup: dict | None = None  # {"version", "applied"} of the job's cgroup, None without one
    rlimits: dict = field(default_factory=dict)  # a rank's, read by the grader


class Channel:
    """The evidence channel: a SOCK_SEQPACKET pair the grader creates. The job gets one end as
    an inherited fd (never a file it could pre-write); the grader reads the other in a thread,
    with each message's sender pid from the kernel (SCM_CREDENTIALS), up to a byte cap."""

    def __init__(self):
        self.r, self.w = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.r.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.messages, self.bytes = [], 0
        self._thread = threading.Thread(target=self._read, daemon=True)

    def start(self) -> None:
        self.w.close()  # the job holds the only writing end now
        self._thread.start()

    def _read(self):
        space = socket.CMSG_SPACE(struct.calcsize("iII"))
        while True:
            try:
                msg, anc, _, _ = self.r.recvmsg(1 << 18, space)
            except OSError:
                return
            if not msg:
                return
            self.bytes += len(msg)
            if self.bytes > MAX_CHANNEL_BYTES:
                continue  # keep draining, keep nothing more
            pid = None
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = struct.unpack("iII", data[:12])[0]
            try:
                rec = json.loads(msg)
            except ValueError:
                continue
            if isinstance(rec, dict):
                self.messages.append((pid, rec))

    def finish(self, timeout: float = 5.0) -> list:
        self._thread.join(timeout)
        try:
            self.r.close()
        except OSError:
            pass
        return list(self.messages)


def allowed_env(extra: dict | None = None) -> dict:
    """The job's whole environment: nothing of the grader's except what is listed here."""
    env = {
        "PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin",
        "HOME": f"{JOB_DIR}/home",
        "TMPDIR": "/tmp",
        "USER": "student",
        "LOGNAME": "student",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONNOUSERSITE": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        "MPLCONFIGDIR": "/tmp",
        "OMP_NUM_THREADS": "1",
    }
    env.update(extra or {})
    return env


def run(
    cmd: list[str],
    *,
    job_dir: Path,
    log_path: Path,
    env: dict,
    budget_s: float,
    limits: Limits,
    tool: str | None = None,
    gpus: list[int] | None = None,
    cgroup: bool = True,
    channel: bool = False,
    tick_s: float = 0.1,
    name: str | None = None,
    extra_ro: Iterable = (),
) -> RunResult:
    """Run ``cmd`` in a fresh sandbox until it exits or ``budget_s`` passes; leave nothing behind.
    ``job_dir`` becomes /job (its cwd); ``env`` is added to :func:`allowed_env`; ``gpus``: the
    device minors of the GPUs to bind (:func:`gpu_binding`); ``extra_ro``: more folders bound
    read-only at their own paths (:func:`import_path`)."""
    tool = tool or probe_isolation()["tool"]
    job_dir.chmod(0o700)
    cg = JobCgroup.create(f"grader-{os.getpid()}-{name or uuid.uuid4().hex[:12]}", limits) if cgroup else None
    chan = Channel() if channel else None
    inner_env = allowed_env(env)
    if chan is not None:
        inner_env[CHANNEL_FD_VAR] = str(chan.w.fileno())
    # The init's own report (what it killed) comes over a socket only the init holds: it closes
    # it on exec, and being non-dumpable, nothing of the job can reach its file descriptors.
    status_r, status_w = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    init = [
        sys.executable,
        "-I",
        str(INIT),
        "--fsize",
        str(limits.file_bytes),
        "--nproc",
        str(limits.processes),
        "--cpu",
        str(limits.cpu_seconds),
        "--status-fd",
        str(status_w.fileno()),
    ]
    if limits.address_space:
        init += ["--as", str(limits.memory_bytes)]
    if tool == "bwrap":
        prefix = bwrap_command(job_dir, limits, gpus, extra_ro)
        for k, v in inner_env.items():
            prefix += ["--setenv", k, v]
        prefix += ["--"]
    else:
        prefix, plan = unshare_command(job_dir, limits, gpus, extra_ro)
        init += ["--setup", json.dumps(plan)]
        # unshare keeps the environment it is given: pass only the allowlist
    # First, outside: die with the grader (a SIGKILLed grader takes the sandbox along, unshare's
    # as well as bwrap's), and join the job's cgroup(s) before anything of the job starts.
    full = (
        [sys.executable, "-I", "-S", str(INIT), "--outer", str(os.getpid())]
        + (cg.procs_files if cg is not None else [])
        + ["--"]
        + prefix
        + init
        + ["--"]
        + cmd
    )
    pass_fds = ((chan.w.fileno(),) if chan is not None else ()) + (status_w.fileno(),)
    with open(log_path, "wb") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            full,
            cwd="/",
            env=inner_env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            pass_fds=pass_fds,
        )
    status_w.close()
    if chan is not None:
        chan.start()
    watch = Watch(proc.pid)
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
            os.killpg(proc.pid, signal.SIGKILL)  # the sandbox's outer process: the kernel then
        except (ProcessLookupError, PermissionError):  # kills its PID namespace (--die-with-parent)
            pass
        proc.wait()
    # The init's own report: what it killed, and its PID namespace (a job that ends between two
    # ticks is never seen in it from outside).
    stragglers, reported_ns = [], None
    status_r.setblocking(False)
    try:
        rec = json.loads(status_r.recv(1 << 16))
        stragglers = [str(x)[:120] for x in (rec.get("stragglers") or [])][:20]
        ns = rec.get("pidns")
        if isinstance(ns, str) and ns.startswith("pid:[") and ns != watch.host_ns:
            reported_ns = ns  # for the report only: the namespace is gone, its number free again
    except (OSError, ValueError, AttributeError):
        pass
    status_r.close()
    # Everything of the job is in its PID namespace (and cgroup): whatever is still alive there
    # once the sandbox's first process is gone is killed, then looked for again.
    leftovers = []
    grace = time.perf_counter() + 3.0
    while time.perf_counter() < grace and watch.job_processes():
        time.sleep(0.05)
    for _ in range(50):
        live = watch.job_processes() + [s.pid for s in watch.still_alive()]
        if cg is not None:
            live += list(cg.members(live_only=True))
        live = sorted(set(live))
        if not live:
            break
        leftovers += [_cmdline(p) for p in live]
        for p in live:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.02)
    remaining = [_cmdline(p) for p in watch.job_processes()]
    watch.close()
    if cg is not None:
        remaining += [_cmdline(p) for p in cg.kill_and_remove()]
    messages = chan.finish() if chan is not None else []
    escapes = []
    if cg is not None:
        # (an exiting process shows the root cgroup, and no command line: not an escape; the outer
        # step is the grader's own child, which may be seen before it moves itself into the cgroup)
        escapes = [
            s.cmd for s in watch.seen.values() if s.pid != proc.pid and s.cmd and s.cgroup and not cg.contains(s.cgroup)
        ]
    return RunResult(
        None if timed_out else proc.returncode,
        wall,
        timed_out,
        messages,
        watch.workers(),
        stragglers,
        sorted(set(leftovers)),
        remaining,
        watch.loopback_octets,
        watch.pidns or reported_ns,
        list(watch.seen.values()),
        escapes,
        {"version": cg.version, "applied": cg.applied} if cg is not None else None,
        watch.rlimits,
    )
