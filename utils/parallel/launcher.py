"""``launch()``: spawn ranks from a notebook, relay their output, name the rank that failed; ``torchrun()``."""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..files import atomic_write
from ..rank_failures import exit_abort_after_success, first_failure, torchrun_summary
from .group import choose_backend, teardown

# ----------------------------------------------------------------------------------------
# launch(): processes from a notebook
# ----------------------------------------------------------------------------------------


class LaunchError(RuntimeError):
    """A rank failed; ``rank`` says which, ``remote_traceback`` holds its traceback."""

    def __init__(self, message: str, rank: int | None = None, remote_traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


class LaunchTimeout(LaunchError):
    """The ranks did not all finish within ``timeout`` seconds (usually a hang)."""


class WorkerNotImportable(ValueError):
    """The worker cannot be imported by a spawned process (defined in the notebook, a lambda...)."""


_NOT_IMPORTABLE = (
    "launch() cannot use {what}: the processes it starts do not share the notebook's memory, and they "
    "find the worker by importing it by module and name. A function defined in a "
    "notebook lives in its __main__, which a new process cannot import. Either put the worker in a file "
    "and import it from there (in a notebook: a cell starting `%%writefile my_worker.py`, then "
    "`from my_worker import worker`), or use a worker that ships with utils (e.g. utils.ddp_train.train)."
)


def _check_worker(worker) -> None:
    fn = getattr(worker, "func", worker)  # functools.partial
    if not callable(fn):
        raise TypeError(f"launch() needs a function, got {type(worker).__name__}")
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module in (None, "__main__", "__mp_main__"):
        raise WorkerNotImportable(_NOT_IMPORTABLE.format(what=f"{qualname or fn!r}, defined in __main__"))
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise WorkerNotImportable(
            _NOT_IMPORTABLE.format(what=f"{qualname}, a lambda or a function defined inside another function")
        )
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise WorkerNotImportable(
            _NOT_IMPORTABLE.format(what=f"{module}.{qualname} (importing it failed: {e})")
        ) from None


def _to_cpu(obj):
    """Tensors in a (nested) result moved to the CPU, so the notebook never touches CUDA."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return type(obj)((k, _to_cpu(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _watch_parent(parent_pid: int) -> None:
    """Exit if the notebook that started us goes away (kernel restart): never an orphan. Our parent is
    the notebook (spawn) or the fork server, which exits with the notebook (forkserver): either way it
    changes when the notebook is gone."""
    ppid = os.getppid()
    while True:
        time.sleep(1.0)
        try:
            os.kill(parent_pid, 0)
        except OSError:  # gone, or the number reused by another user's process
            os._exit(3)
        if os.getppid() != ppid:
            os._exit(3)


# Ranks start from a fork server that has imported these once: a rank is ready in well under a second,
# where a fresh interpreter spends seconds importing torch. The server is an interpreter of its own (it
# never touched CUDA), started at the first launch and stopped with the notebook.
PRELOAD = ["torch", "torch.distributed", "utils.parallel"]


def _context():
    """The multiprocessing context ranks start from: 'forkserver', or 'spawn' where there is none (Windows)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _entry(worker, args, kwargs, rank, nprocs, port, backend, threads, workdir, parent_pid, timeout, where):
    """Runs in each rank: the notebook's environment, path and folder (``where``: a rank forked from the
    fork server starts with the server's), the variables torchrun would set, then the worker."""
    env, path, cwd = where
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = path
    with contextlib.suppress(OSError):
        os.chdir(cwd)
    with contextlib.suppress(OSError, AttributeError):
        os.setpgrp()  # own process group: the parent can stop our children too
    log = open(os.path.join(workdir, f"rank{rank}.log"), "w", buffering=1)
    os.dup2(log.fileno(), 1)  # the notebook's kernel cannot see our fds: the parent relays them
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        LAB_DIST_BACKEND=backend,
        LAB_DIST_PARENT_STORE="1",
        LAB_DIST_TIMEOUT=str(timeout),
        OMP_NUM_THREADS=str(threads),
    )
    torch.set_num_threads(threads)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    code = 0
    result_path = os.path.join(workdir, f"rank{rank}.result")
    try:
        out = ("ok", _to_cpu(worker(*args, **kwargs)))
        try:
            payload = pickle.dumps(out)
        except Exception as e:
            raise TypeError(
                f"rank {rank}'s worker returned a value that cannot be sent back to the "
                f"notebook ({e}); return tensors, numbers, lists and dicts"
            ) from e
    except BaseException as e:  # noqa: BLE001 - everything goes back to the notebook
        code = 1
        tb = traceback.format_exc()  # goes back to the notebook inside the LaunchError
        payload = pickle.dumps(("error", time.time(), type(e).__name__, str(e), tb))
        # First the report, before the teardown (which can block, or wake the peers up with
        # errors of their own): the parent reads this file and stops every rank at once.
        atomic_write(result_path, payload, fsync=False)
        atomic_write(os.path.join(workdir, f"rank{rank}.failed"), b"", fsync=False)  # the flag the parent polls
    finally:
        with contextlib.suppress(Exception):
            teardown(timeout=5.0 if code else None)  # bounded: a stuck NCCL destroy cannot hang us
    atomic_write(result_path, payload, fsync=False)
    log.flush()
    if code:
        os._exit(code)  # failed: exit now, whatever state the group and threads are in
    sys.exit(0)  # a normal exit: semaphores and temporary files are released


class _LogRelay:
    """Copies each rank's new output lines to the notebook, prefixed with the rank."""

    def __init__(self, workdir, nprocs, enabled):
        self.paths = [os.path.join(workdir, f"rank{r}.log") for r in range(nprocs)]
        self.pos = [0] * nprocs
        self.partial = [""] * nprocs
        self.enabled = enabled

    def pump(self, final=False):
        if not self.enabled:
            return
        for r, path in enumerate(self.paths):
            try:
                with open(path, errors="replace") as f:
                    f.seek(self.pos[r])
                    text = f.read()
                    self.pos[r] = f.tell()
            except OSError:
                continue
            text = self.partial[r] + text
            lines = text.split("\n")
            self.partial[r] = "" if final else lines.pop()
            for line in lines:
                line = line.split("\r")[-1]  # progress bars: keep the last state
                if line.strip():
                    print(f"[rank {r}] {line}", flush=True)


def _stop(procs, grace: float = 3.0) -> None:
    """Terminate every process still running (and its children), then kill what is left."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        alive = [p for p in procs if p.is_alive()]
        if not alive:
            break
        for p in alive:
            try:
                os.killpg(p.pid, sig)  # the rank and its DataLoader workers
            except (ProcessLookupError, PermissionError, AttributeError, OSError):
                with contextlib.suppress(Exception):
                    p.terminate() if sig == signal.SIGTERM else p.kill()
        end = time.monotonic() + wait
        for p in alive:
            p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        # A rank that exited normally may have left a DataLoader worker in its group.
        with contextlib.suppress(Exception):
            os.killpg(p.pid, signal.SIGKILL)
        p.join(1.0)


def _reported_error(workdir, rank) -> bool:
    """The rank wrote its error report (it may still be tearing down: no need to wait for it)."""
    return os.path.exists(os.path.join(workdir, f"rank{rank}.failed"))


def _read_result(workdir, rank):
    path = os.path.join(workdir, f"rank{rank}.result")
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except FileNotFoundError:
        return None


def launch(
    worker: Callable[..., Any],
    nprocs: int,
    *args: Any,
    backend: str | None = None,
    timeout: float = 600.0,
    threads: int | None = None,
    stream: bool = True,
    **kwargs: Any,
) -> list:
    """Run ``worker(*args, **kwargs)`` in ``nprocs`` new processes and return their results,
    a list indexed by rank.

    Each process is forked from a fork server that imported torch once ('spawn' where there is none;
    either is safe after CUDA is initialised), gets the notebook's environment plus what
    torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT on a free
    port) and calls the worker, which calls :func:`setup`. The backend is NCCL when there are at
    least ``nprocs`` GPUs (one per rank), gloo otherwise. Each rank's output is printed here
    with a ``[rank N]`` prefix (``stream=False`` to hide it).

    If a rank raises, :class:`LaunchError` names the rank and carries its traceback; if the
    ranks have not all finished after ``timeout`` seconds (a hang), :class:`LaunchTimeout`.
    Either way every process is stopped before this returns, so the next launch works. A rank
    that sent its result and then died of gloo's abort at interpreter exit (torch 2.13 on a CPU,
    now and then) has finished.
    ``threads``: torch (OpenMP) threads per process, default 1: with several ranks on a few
    cores, more threads make every small operation wait for a descheduled thread.
    """
    _check_worker(worker)
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    backend = (backend or choose_backend(nprocs)).lower()
    if backend == "nccl":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n < nprocs:
            raise ValueError(
                f"backend='nccl' needs one GPU per process: {nprocs} processes but {n} GPU(s). "
                f"Use nprocs <= {n}, or backend='gloo' (several processes may share a device)."
            )
    threads = threads or 1  # more would oversubscribe the cores: each rank is one busy process
    ctx = _context()
    where = (dict(os.environ), list(sys.path), os.getcwd())
    workdir = tempfile.mkdtemp(prefix="launch-")
    # The ranks meet in a store held here, on a port the OS assigns as it is bound: no window in
    # which another program could take the port (as with "find a free port, pass it on").
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout + 60.0), wait_for_workers=False)
    port = store.port
    procs = []
    relay = _LogRelay(workdir, nprocs, stream)
    try:
        for rank in range(nprocs):
            p = ctx.Process(
                target=_entry,
                name=f"rank{rank}",
                args=(
                    worker,
                    args,
                    kwargs,
                    rank,
                    nprocs,
                    port,
                    backend,
                    threads,
                    workdir,
                    os.getpid(),
                    timeout + 60.0,
                    where,
                ),
            )
            p.start()
            procs.append(p)
        return _supervise(procs, workdir, timeout, relay)
    finally:
        _stop(procs)
        relay.pump(final=True)
        shutil.rmtree(workdir, ignore_errors=True)
        del store


EXIT_GRACE_S = 15.0  # a rank that sent its result but has not exited by then is stopped


def _failed(procs, workdir) -> list:
    """Ranks that failed: exited non-zero (but for gloo's abort at exit after sending a result), or
    reported an error and are perhaps still stuck tearing down."""
    return [
        r
        for r, p in enumerate(procs)
        if (p.exitcode not in (None, 0) and not _aborted_after_success(workdir, r, p.exitcode))
        or _reported_error(workdir, r)
    ]


def _aborted_after_success(workdir, rank, exitcode) -> bool:
    """The rank sent its result, then gloo's teardown aborted it at interpreter exit."""
    if exitcode != -signal.SIGABRT:
        return False
    res = _read_result(workdir, rank)
    try:
        with open(os.path.join(workdir, f"rank{rank}.log"), errors="replace") as f:
            log = f.read()
    except OSError:
        log = ""
    return exit_abort_after_success(exitcode, res is not None and res[0] == "ok", log)


def _supervise(procs, workdir, timeout, relay) -> list:
    deadline = time.monotonic() + timeout
    all_reported = None
    while True:
        pending = [p for p in procs if p.exitcode is None]
        failed = _failed(procs, workdir)
        if (
            pending
            and not failed
            and all((res := _read_result(workdir, r)) is not None and res[0] == "ok" for r in range(len(procs)))
        ):
            # Every rank has sent its result; one may still be stuck exiting (a process-group
            # destructor can block at interpreter shutdown). Its work is done: don't wait forever.
            all_reported = all_reported or time.monotonic()
            if time.monotonic() - all_reported > EXIT_GRACE_S:
                pending = []
        if failed:
            # The peers of a failed rank usually fail within moments (their connections close):
            # give them a little time, so the report names the rank that failed FIRST.
            grace = time.monotonic() + 2.0
            while any(p.exitcode is None for p in procs) and time.monotonic() < grace:
                mp.connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=0.1)
            relay.pump()
            raise _failure(procs, workdir, _failed(procs, workdir), relay.enabled)
        if not pending:
            relay.pump()
            out = []
            for r in range(len(procs)):
                res = _read_result(workdir, r)
                if res is None or res[0] != "ok":
                    raise LaunchError(f"rank {r} exited without sending a result back", rank=r)
                out.append(res[1])
            return out
        left = deadline - time.monotonic()
        if left <= 0:
            relay.pump()
            running = [r for r, p in enumerate(procs) if p.exitcode is None]
            done = [r for r in range(len(procs)) if r not in running]
            raise LaunchTimeout(
                f"launch timed out after {timeout:g} s: rank(s) {running} were still running"
                + (f" while rank(s) {done} had finished" if done else "")
                + ". They were stopped. A hang usually means the ranks disagree on the collectives "
                "they call: one rank has more batches than another (uneven inputs: pad them, or wrap "
                "the loop in torch.distributed.algorithms.Join), or only some ranks call a barrier, "
                "an all-reduce or a checkpoint save that synchronises.",
                rank=running[0] if running else None,
            )
        mp.connection.wait([p.sentinel for p in pending], timeout=min(0.25, max(left, 0.01)))
        relay.pump()


def _failure(procs, workdir, failed, stream: bool = True) -> LaunchError:
    """The error to show: the rank that failed first, judged by what each rank reported
    (``stream``: the ranks' output was printed, so the message may point to it)."""
    reports = {}
    for r in range(len(procs)):  # a rank still exiting may have reported already
        res = _read_result(workdir, r)
        if res is not None and res[0] == "error":
            reports[r] = res[1:]  # time, exception name, message, traceback
    first = first_failure(
        ranks={r: tb for r, (_, _, _, tb) in reports.items()},
        exitcodes={r: procs[r].exitcode for r in failed},
        times={r: t for r, (t, _, _, _) in reports.items()},
    )
    if first is None:
        return LaunchError("a rank failed without reporting why; the other ranks were stopped", rank=None)
    r = first.rank
    if r not in reports:  # killed or crashed: no Python exception
        code = first.exitcode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        then = f" Rank(s) {sorted(reports)} lost their connection to it." if reports else ""
        above = "; its output is above" if stream else ""
        return LaunchError(
            f"rank {r} {how} without a Python exception (killed, out of memory, or a crash "
            f"in native code{above}).{then} The other ranks were stopped.",
            rank=r,
        )
    _, name, msg, tb = reports[r]
    others = sorted((set(reports) | set(failed)) - {r})
    extra = f" (rank(s) {others} failed too, after it)" if others else ""
    return LaunchError(
        f"rank {r} raised {name}: {msg}{extra}. The other ranks were stopped.\n\nTraceback from rank {r}:\n{tb}",
        rank=r,
        remote_traceback=tb,
    )


def torchrun(
    args: Sequence[str], *, timeout: float = 600.0, env: dict | None = None, cwd: str | os.PathLike | None = None
) -> subprocess.CompletedProcess:
    """Run ``python -m torch.distributed.run ARGS`` (torchrun) and return the CompletedProcess
    (``stdout`` holds stdout and stderr). The agent and its workers get their own session, so a
    timeout stops all of them, not only the agent; then ``subprocess.TimeoutExpired`` is raised.

    gloo's teardown in torch 2.13 sometimes aborts a rank at interpreter exit, after its work is
    done. Such a run counts as finished (exit status 0, and a line at the end of ``stdout`` says
    so) when every rank of the run ran its script to the end, and every rank torchrun reports as
    failed died of that abort, or was stopped by torchrun (SIGTERM) after it. The evidence that a script ran to its end is a marker each rank
    writes from the ``sitecustomize`` this launcher puts on its PYTHONPATH (``_rank_done/``). Any
    other failure keeps torchrun's exit status."""
    env = dict(os.environ if env is None else env)
    env.setdefault("OMP_NUM_THREADS", "1")
    for k in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "LAB_DIST_PARENT_STORE",
        "LAB_DIST_BACKEND",
        "LAB_DIST_TIMEOUT",
    ):
        env.pop(k, None)  # torchrun sets the first ones; launch()'s own must not leak into it
    cmd = [sys.executable, "-m", "torch.distributed.run", *standalone_unless_told(args)]
    with tempfile.TemporaryDirectory(prefix="torchrun-") as done_dir:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (RANK_DONE_SITE, env.get("PYTHONPATH")) if p)
        env["LAB_RANK_DONE_DIR"] = done_dir
        out, code = _run_torchrun(cmd, env, cwd, timeout, lambda: _all_done(done_dir))
        if code is None:
            out += f"parallel.torchrun: every rank finished; one then hung at exit for {EXIT_GRACE_S:.0f} s: stopped, exit status 0\n"
            code = 0
        elif code != 0 and _only_exit_aborts(out, done_dir):
            out += "parallel.torchrun: every rank finished; gloo's teardown then aborted one at exit: exit status 0\n"
            code = 0
    return subprocess.CompletedProcess(cmd, code, out, None)


_RENDEZVOUS_FLAGS = ("--standalone", "--rdzv-endpoint", "--rdzv_endpoint", "--master-port", "--master_port", "--nnodes")


def standalone_unless_told(args: Sequence[str]) -> list[str]:
    """``args`` as strings, with ``--standalone`` in front when they name no rendezvous of their own.
    Without it torchrun meets on port 29500, so two students' runs on one server collide;
    ``--standalone`` meets on a free port of this machine."""
    args = [str(a) for a in args]
    script = next(
        (i for i, a in enumerate(args) if not a.startswith("-") and (i == 0 or not _takes_value(args[i - 1]))),
        len(args),
    )
    told = any(a.split("=")[0] in _RENDEZVOUS_FLAGS for a in args[:script])
    return args if told else ["--standalone", *args]


def _takes_value(flag: str) -> bool:
    """Does torchrun option ``flag`` take the next argument as its value (``--nproc-per-node 2``)?"""
    return (
        flag.startswith("--")
        and "=" not in flag
        and flag not in ("--standalone", "-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path")
    )


def _die_with_parent(parent: int) -> Callable[[], None]:
    """What the child runs before torchrun: ask Linux for SIGTERM when the notebook's kernel (pid
    ``parent``) dies, by a restart or a kill. torchrun has a session of its own, so nothing else
    reaches it then and its ranks would keep their GPUs; on SIGTERM it stops them itself."""

    def guard() -> None:
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # no prctl: the timeout and the interrupt handler still stop it
            return
        if os.getppid() != parent:  # the kernel died before the request was made
            os._exit(1)

    return guard


RANK_DONE_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_rank_done")


EXIT_GRACE_S = 30.0  # how long a run whose ranks all finished may take to exit before it is stopped


def _all_done(done_dir: str) -> bool:
    """Did every rank of the run write its marker (its script ran to its end)?"""
    done = {}
    for name in os.listdir(done_dir):
        with contextlib.suppress(OSError, ValueError), open(os.path.join(done_dir, name)) as f:
            done[int(name.removeprefix("rank"))] = f.read()
    worlds = set(done.values())
    return len(worlds) == 1 and (world := worlds.pop()).isdigit() and set(done) == set(range(int(world)))


def _only_exit_aborts(out: str, done_dir: str) -> bool:
    """Did every rank write its marker (its script ran to its end), did at least one rank die of
    gloo's abort at interpreter exit, and was every other rank torchrun reports as failed only
    stopped by torchrun (SIGTERM) after that abort?"""
    _, failed = torchrun_summary(out)
    if not failed or not _all_done(done_dir):
        return False
    aborted = {r for r, code in failed.items() if exit_abort_after_success(code, True, out)}  # every rank finished
    stopped = {r for r, code in failed.items() if code == -signal.SIGTERM}
    return bool(aborted) and aborted | stopped == set(failed)


def _run_torchrun(cmd, env, cwd, timeout, all_done=lambda: False) -> tuple[str, int | None]:
    """torchrun's output and exit status; on a timeout (or an interrupt) every process is stopped. A run
    still there ``EXIT_GRACE_S`` after ``all_done()`` (every rank's script ran to its end) is stopped,
    and its status is None: gloo's teardown can deadlock a rank at interpreter exit, after its work."""
    parent = os.getpid()
    p = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=cwd,
        start_new_session=True,
        preexec_fn=_die_with_parent(parent) if sys.platform == "linux" else None,
    )
    end, finished = time.monotonic() + timeout, None
    try:
        while True:
            try:
                out, _ = p.communicate(timeout=min(1.0, max(end - time.monotonic(), 0.01)))
                return out, p.returncode
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                finished = finished or (now if all_done() else None)
                if finished and now - finished > EXIT_GRACE_S:
                    return _stop_torchrun(p), None
                if now >= end:
                    raise subprocess.TimeoutExpired(cmd, timeout) from None
    except BaseException:
        _stop_torchrun(p)
        raise


def _stop_torchrun(p: subprocess.Popen) -> str:
    """Stop torchrun's agent and every worker; return what they printed."""
    workers = _descendants(p.pid)  # torchrun puts workers in sessions of their own
    p.terminate()  # SIGTERM: the agent stops its workers itself
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.communicate(timeout=15)
    for pid in [p.pid, *workers]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return p.communicate()[0] or ""


def _descendants(pid: int) -> list:
    """PIDs of every process below ``pid`` (from /proc; empty where there is none)."""
    children = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out
