"""The first process of a graded job inside its sandbox (standard library only, run as a script).

    python -I _sandbox_init.py [--fsize B] [--nproc N] [--cpu S] [--as B] [--setup JSON] -- COMMAND...
    python -I -S _sandbox_init.py --outer GRADER_PID [CGROUP_PROCS_FILE...] -- bwrap|unshare ...

``--outer`` runs outside the sandbox, between the grader and bwrap or unshare: it asks the kernel
for SIGKILL when the grader dies (PR_SET_PDEATHSIG, kept across the exec), joins the job's
cgroups, and execs the sandbox. A SIGKILLed grader thus takes unshare along, and unshare's
--kill-child takes this init, whose death empties its PID namespace (bwrap: --die-with-parent).

With ``--setup`` (the ``unshare`` fallback, where bubblewrap is missing) it first builds the
sandbox's file system itself, as bwrap would: a tmpfs root holding read-only binds of the
system, Python and the project's package, a fresh /proc, a minimal /dev, private tmpfs /tmp,
/var/tmp and /dev/shm, the job dir on /job; then pivot_root, loopback up, and every
capability dropped for good (bounding set, securebits, no_new_privs).

Then, in both cases: the resource limits, non-dumpable (so nothing of the job can ptrace it or
read its memory), child subreaper; it runs COMMAND with the evidence channel's fd inherited, and
waits. When COMMAND exits, whatever still runs in the job is a straggler: the init names them on
its own status socket (one the job never holds), kills them, and exits with COMMAND's status, which the grader gets by waiting on
the sandbox's outermost process (never from a file).
"""

import ctypes
import json
import os
import resource
import signal
import socket
import sys
import time

PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_SECUREBITS = 1, 4, 24, 28
PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 36, 38, 47, 4
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1,
    2,
    4,
    8,
    32,
    4096,
    16384,
    1 << 18,
)
MNT_DETACH = 2
# libc through the interpreter's own symbols: find_library would run `ldconfig -p`, a process outside the
# job's cgroup while this runs.
_LIBC = ctypes.CDLL(None, use_errno=True)


def _check(ret, what):
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def mount(src: str | None, dst: str, fstype: str | None = None, flags: int = 0, data: str | None = None) -> None:
    _check(
        _LIBC.mount(
            src.encode() if src else None,
            dst.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {src} on {dst}",
    )


def _bind(src, dst, writable=False):
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    mount(src, dst, None, MS_BIND | MS_REC)
    if not writable:  # a bind's read-only flag needs a remount, keeping the locked flags
        st = os.statvfs(dst)
        keep = st.f_flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC)
        mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)


def build_root(plan: dict) -> None:
    """The same file system bwrap builds (sandbox.bwrap_command), by hand, then pivot_root."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    new = plan["newroot"]
    mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    for d in ("/tmp", "/var/tmp"):  # first: the binds below may live under /tmp
        os.makedirs(new + d, exist_ok=True)
        mount("tmpfs", new + d, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={plan['tmpfs_bytes']}")
    for kind, src, dst in plan["layout"]:
        target = new + dst
        if kind == "symlink":
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.symlink(src, target)
        elif os.path.exists(src):
            _bind(src, target)
    os.makedirs(new + "/proc")
    mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for d in plan["proc_read_only"]:  # global sysctls and friends: read-only, as bwrap
        if os.path.exists(new + d):
            mount(new + d, new + d, None, MS_BIND | MS_REC)
            mount(None, new + d, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.makedirs(new + "/dev")
    mount("tmpfs", new + "/dev", "tmpfs", MS_NOSUID, "mode=0755,size=64k")
    for src, dst in plan["dev_nodes"] + [(n, n) for n in plan["devices"]]:
        if os.path.exists(src):
            _bind(src, new + dst, writable=True)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, f"{new}/dev/{name}")
    os.makedirs(new + "/dev/shm")
    mount("tmpfs", new + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={plan['tmpfs_bytes']}")
    if plan.get("sys"):
        _bind("/sys", new + "/sys")
    _bind(plan["job"], new + plan["job_dest"], writable=True)
    os.chdir(new)
    _check(_LIBC.syscall(155 if os.uname().machine == "x86_64" else 41, b".", b"."), "pivot_root")
    _check(_LIBC.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(plan["job_dest"])


def lo_up() -> None:
    import fcntl
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(s, siocgifflags, req))[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sh", b"lo", flags | iff_up))


def drop_capabilities() -> None:
    """No capability now or after any exec, in this user namespace or any other."""
    for cap in range(64):
        _LIBC.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    _LIBC.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    _LIBC.prctl(PR_SET_SECUREBITS, 0x2F, 0, 0, 0)  # NOROOT, NO_SETUID_FIXUP, each locked
    _check(_LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    _check(_LIBC.capset(ctypes.byref(Header(0x20080522, 0)), (Data * 2)()), "capset")


def _table():
    """{pid: cmdline} of every live process this init can see, itself excluded."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                raw = f.read()
            if raw[raw.rindex(")") + 2 :].split()[0] in ("Z", "X"):
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                out[int(name)] = f.read(200).replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError, IndexError):
            continue
    return out


def _mine(table):
    """Processes of the job: all but the PID namespace's own init (bwrap's pid 1), which is not ours."""
    return {p: c for p, c in table.items() if p != 1 or os.getpid() == 1}


def kill_all() -> list:
    """SIGKILL every other process of the job until none is left; return their command lines."""
    seen = {}
    for _ in range(100):
        alive = _mine(_table())
        if not alive:
            break
        seen.update(alive)
        try:
            os.kill(-1, signal.SIGKILL)  # every process of this PID namespace we may signal
        except OSError:
            pass
        reap()
        time.sleep(0.02)
    reap()
    return seen


def reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _opt(opts, name, default=None):
    return opts[opts.index(name) + 1] if name in opts else default


def outer(opts: list[str], cmd: list[str]) -> int:
    """Outside the sandbox: die with the grader, join the job's cgroups, exec bwrap or unshare."""
    _check(_LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "PR_SET_PDEATHSIG")
    if os.getppid() != int(_opt(opts, "--outer")):  # the grader died before the line above
        return 125
    for path in opts[opts.index("--outer") + 2 :]:  # before anything of the job starts
        try:
            with open(path, "w") as f:
                f.write(str(os.getpid()))
        except OSError as e:
            print(f"could not join the job's cgroup {path}: {e}", file=sys.stderr)
            return 125
    try:
        os.execv(cmd[0], cmd)
    except OSError as e:
        print(f"could not start {cmd[0]}: {e}", file=sys.stderr)
    return 127


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print("usage: _sandbox_init.py [options] -- COMMAND...", file=sys.stderr)
        return 2
    opts, cmd = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    if "--outer" in opts:
        return outer(opts, cmd)
    setup = _opt(opts, "--setup")
    if setup:
        try:
            plan = json.loads(setup)
            build_root(plan)
            socket.sethostname(plan["hostname"])
            lo_up()
            drop_capabilities()
        except OSError as e:
            print(f"sandbox setup failed: {e}", file=sys.stderr)
            return 125
    for flag, which in (
        ("--fsize", resource.RLIMIT_FSIZE),
        ("--nproc", resource.RLIMIT_NPROC),
        ("--cpu", resource.RLIMIT_CPU),
        ("--as", resource.RLIMIT_AS),
    ):
        value = _opt(opts, flag)
        if value is not None:
            resource.setrlimit(which, (int(value), int(value)))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # A fresh, empty session keyring: the grader's (inherited across fork) stays out of reach.
    _LIBC.syscall({"x86_64": 250, "aarch64": 219}.get(os.uname().machine, -1), 1, None)
    _LIBC.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # the job cannot ptrace or read this process
    _LIBC.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans (double forks, setsid) come here
    chan_fd = os.environ.get("SCALING_LABS_GRADER_FD")
    if chan_fd:  # the probes' channel: for the job's processes
        os.set_inheritable(int(chan_fd), True)
    status_fd = _opt(opts, "--status-fd")  # the init's own: closed on exec, never the job's
    status = socket.socket(fileno=int(status_fd)) if status_fd else None
    if status is not None:
        os.set_inheritable(status.fileno(), False)

    def on_term(signum, frame):
        kill_all()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    child = os.fork()
    if child == 0:
        try:
            os.execvp(cmd[0], cmd)
        except OSError as e:
            print(f"could not start {cmd[0]}: {e}", file=sys.stderr)
        os._exit(127)
    rc = None
    while rc is None:
        try:
            pid, st = os.wait()  # reaps abandoned orphans as well
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if pid == child:
            rc = os.waitstatus_to_exitcode(st)
    rc = 0 if rc is None else rc
    found = kill_all()
    if status is not None:
        try:
            status.send(
                json.dumps(
                    {
                        "rc": rc,
                        "stragglers": sorted(set(found.values()))[:20],
                        "pidns": os.readlink("/proc/self/ns/pid"),
                    }
                ).encode()
            )
        except OSError:
            pass
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
