"""The first process of a graded submission (standard library only, run as a script).

    python _sandbox_init.py [--status FILE] [--pidns] [--lo-up] [--fsize BYTES] [--pdeathsig] -- COMMAND...

It makes itself a child subreaper (so that processes the submission starts and abandons, even
double-forked or in their own session, stay in its tree), brings the loopback interface up when
it runs in a fresh network namespace (torchrun's rendezvous needs localhost), runs COMMAND,
and waits for it. When COMMAND exits, anything still running below it is a straggler: its
command lines go into FILE, it is killed (SIGKILL) and reaped, and this process exits with
COMMAND's status. On SIGTERM it kills the whole tree first. With ``--pdeathsig`` it gets that
SIGTERM when the grader that started it dies, so a killed grader leaves nothing running (the
grader starts one outside ``unshare`` for this, and one inside as the namespace's first process).
"""
import ctypes
import json
import os
import signal
import sys
import time

PR_SET_CHILD_SUBREAPER = 36
PR_SET_PDEATHSIG = 1


def _host_pid():
    with open("/proc/self/stat") as f:
        return int(f.read().split(None, 1)[0])


def _table():
    """{pid: (ppid, cmdline)} for every process, as /proc shows them."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                raw = f.read()
            state, ppid = raw[raw.rindex(")") + 2:].split()[:2]
            if state in ("Z", "X"):                 # dead, waiting to be reaped: not running
                continue
            ppid = int(ppid)
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read(300).replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError, IndexError):
            continue
        out[int(name)] = (ppid, cmd)
    return out


def descendants(root):
    table = _table()
    children = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, [root]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in found:
                found[c] = table[c][1]
                todo.append(c)
    return found


def kill_tree(me, pidns):
    """SIGKILL everything below this process until nothing is left; return what was found."""
    seen = {}
    for _ in range(50):
        alive = descendants(me)
        if not alive:
            break
        seen.update(alive)
        if pidns:
            try:
                os.kill(-1, signal.SIGKILL)    # every process of this PID namespace but its init
            except ProcessLookupError:
                pass
        else:
            for pid in alive:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        reap()
        time.sleep(0.02)
    reap()
    return seen


def reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def lo_up():
    import fcntl
    import socket
    import struct
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(s, siocgifflags, req))[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sh", b"lo", flags | iff_up))


def main(argv):
    if "--" not in argv:
        print("usage: _sandbox_init.py --status FILE [--pidns] [--lo-up] -- COMMAND...", file=sys.stderr)
        return 2
    opts, cmd = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    status_file = opts[opts.index("--status") + 1] if "--status" in opts else None
    pidns, want_lo = "--pidns" in opts, "--lo-up" in opts
    if "--fsize" in opts:                       # cap every file the submission writes
        import resource
        cap = int(opts[opts.index("--fsize") + 1])
        resource.setrlimit(resource.RLIMIT_FSIZE, (cap, cap))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    status = {"subreaper": False, "loopback_up": None, "rc": None, "stragglers": []}
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        status["subreaper"] = libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
        if "--pdeathsig" in opts:
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except OSError:
        pass
    if want_lo:
        try:
            lo_up()
            status["loopback_up"] = True
        except OSError as e:
            status["loopback_up"] = f"failed: {e}"
    me = _host_pid()

    def write_status():
        if status_file:
            tmp = status_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump(status, f)
            os.replace(tmp, status_file)

    def on_term(signum, frame):
        status["killed_by_grader"] = True
        kill_tree(me, pidns)
        write_status()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    if "--pdeathsig" in opts and os.getppid() != parent:     # the grader died before prctl
        on_term(signal.SIGTERM, None)
    if not cmd:            # probe mode: report what this sandbox can do
        import socket
        status["interfaces"] = sorted(name for _, name in socket.if_nameindex())
        status["rc"] = 0
        write_status()
        return 0
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
            pid, st = os.wait()                 # reaps abandoned orphans as well
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if pid == child:
            rc = os.waitstatus_to_exitcode(st) if hasattr(os, "waitstatus_to_exitcode") else st >> 8
    rc = 0 if rc is None else rc
    status["rc"] = rc
    found = kill_tree(me, pidns)
    status["stragglers"] = sorted(set(found.values()))[:20]
    status["n_stragglers"] = len(found)
    write_status()
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
