"""Data parallelism: the process group (from torchrun or from a notebook), ``launch()`` for
notebooks, collective helpers, and checkpoints that resume exactly.

One worker, two ways to start it::

    # in a notebook: spawn 2 processes, get each rank's return value back
    results = utils.dist.launch(utils.ddp_train.train, 2, {"epochs": 2})

    # in a shell, on one node or several: the same worker under torchrun
    torchrun --nproc-per-node 2 -m utils.ddp_train --epochs 2

A worker calls :func:`setup` first (it reads torchrun's environment, or the one ``launch``
prepared), builds a loader sharded by ``ctx.rank``, wraps its model with :func:`ddp` and calls
``utils.train.fit``. Backend: NCCL when every local rank can have its own GPU, gloo otherwise
(CPU-only laptops, CI, more processes than GPUs).
"""
from __future__ import annotations

import contextlib
import importlib
import io
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import random
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "DistContext", "setup", "teardown", "choose_backend", "free_port", "ddp", "launch",
    "LaunchError", "LaunchTimeout", "WorkerNotImportable", "ring_all_reduce", "average_gradients",
    "rng_state", "set_rng_state", "save_checkpoint", "load_checkpoint", "EpochOffset",
    "Checkpointer", "ring_allreduce_bytes", "alpha_beta_fit", "torchrun",
]

DEFAULT_TIMEOUT_S = 300.0   # seconds a collective may wait before the group gives up


# ----------------------------------------------------------------------------------------
# The process group
# ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DistContext:
    """What one process knows about the group it is in."""
    rank: int            # 0 .. world_size-1, unique across all nodes
    world_size: int      # processes in the job
    local_rank: int      # 0 .. local_world_size-1 on this node: picks the GPU
    local_world_size: int
    backend: str         # "nccl" or "gloo"
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that prints, saves and logs."""
        return self.rank == 0


def free_port() -> int:
    """A TCP port nobody listens on now (the OS picks it: port 0), for MASTER_PORT."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def choose_backend(nprocs_per_node: int) -> str:
    """NCCL when this node has at least ``nprocs_per_node`` GPUs (one each), gloo otherwise."""
    if torch.cuda.is_available() and dist.is_nccl_available() and torch.cuda.device_count() >= nprocs_per_node:
        return "nccl"
    return "gloo"


def _env_int(name, default):
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else default


def setup(backend: str | None = None, *, device=None, timeout: float | None = None) -> DistContext:
    """Join the process group and return this process's :class:`DistContext`.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT, as set by
    torchrun or by :func:`launch`. Without them (``python script.py``) it makes a group of one,
    so the same script runs alone. The GPU is pinned (``torch.cuda.set_device``) *before* the
    group is created, so NCCL never puts two ranks on GPU 0.

    backend: "nccl" or "gloo"; default NCCL when every local rank can have its own GPU.
    device: override the device (e.g. "cpu"); default ``cuda:LOCAL_RANK`` with NCCL, else CPU.
    timeout: seconds a collective may wait for the other ranks before failing.
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
        local_rank = _env_int("LOCAL_RANK", rank)
        local_world = _env_int("LOCAL_WORLD_SIZE", world)
    else:                                   # started alone: a group of one
        rank, world, local_rank, local_world = 0, 1, 0, 1
    alone = world == 1 and "MASTER_PORT" not in os.environ
    if not alone and ("MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ):
        raise RuntimeError("RANK and WORLD_SIZE are set but MASTER_ADDR / MASTER_PORT are not: start the "
                           "script with torchrun (or utils.dist.launch from a notebook), which sets all four")
    backend = (backend or os.environ.get("LAB_DIST_BACKEND") or choose_backend(local_world)).lower()
    if backend == "nccl":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n <= local_rank:
            raise RuntimeError(f"backend nccl needs one GPU per local rank, but local rank {local_rank} "
                               f"has none (this node has {n} GPU(s) for {local_world} processes). Start "
                               f"fewer processes (at most {n} per node) or use backend='gloo'.")
        dev = torch.device("cuda", local_rank) if device is None else torch.device(device)
        torch.cuda.set_device(dev)          # pin the GPU before the group exists
    elif backend == "gloo":
        dev = torch.device(device) if device is not None else torch.device("cpu")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
    else:
        raise ValueError(f"unknown backend {backend!r}: use 'nccl' (GPUs) or 'gloo' (CPU, or any device)")
    if timeout is None:
        timeout = float(os.environ.get("LAB_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))
    if not dist.is_initialized():
        dist.init_process_group(backend, store=_store(rank, world, alone, timedelta(seconds=timeout)),
                                rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
    return DistContext(rank, world, local_rank, local_world, backend, dev)


def _store(rank: int, world: int, alone: bool, timeout: timedelta):
    """The key-value store the ranks meet in.

    Alone: our own, on a port the OS picks. From :func:`launch`: the notebook already holds it (it
    chose the port by binding it, so no other program can take it meanwhile). Under torchrun:
    the agent's store when it offers one, with a prefix per restart, so restarted ranks never
    read the addresses a crashed attempt left there; else rank 0 hosts it (env:// style)."""
    if alone:
        return dist.TCPStore("127.0.0.1", 0, 1, True, timeout)
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if os.environ.get("LAB_DIST_PARENT_STORE") == "1":
        return dist.TCPStore(host, port, world, False, timeout)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return dist.PrefixStore(f"/attempt-{restart}/", dist.TCPStore(host, port, world, False, timeout))
    return dist.TCPStore(host, port, world, rank == 0, timeout)


def teardown() -> None:
    """Leave the process group (safe to call twice, or when there is none)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def ddp(model: nn.Module, ctx: DistContext, **kwargs) -> nn.Module:
    """``DistributedDataParallel`` on ``ctx.device``: ``device_ids`` only for a CUDA device
    (for the CPU it must be None). ``kwargs`` go to DDP (``bucket_cap_mb``, ...)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = model.to(ctx.device)
    if ctx.device.type == "cuda":
        return DDP(model, device_ids=[ctx.device.index], output_device=ctx.device.index, **kwargs)
    return DDP(model, **kwargs)


# ----------------------------------------------------------------------------------------
# launch(): processes from a notebook
# ----------------------------------------------------------------------------------------

class LaunchError(RuntimeError):
    """A rank failed; ``rank`` says which, ``remote_traceback`` holds its traceback."""

    def __init__(self, message, rank=None, remote_traceback=""):
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


class LaunchTimeout(LaunchError):
    """The ranks did not all finish within ``timeout`` seconds (usually a hang)."""


class WorkerNotImportable(ValueError):
    """The worker cannot be imported by a spawned process (defined in the notebook, a lambda...)."""


_NOT_IMPORTABLE = (
    "launch() cannot use {what}: the processes it starts are fresh Python interpreters (start method "
    "'spawn'), and they find the worker by importing it by module and name. A function defined in a "
    "notebook lives in its __main__, which a new process cannot import. Either put the worker in a file "
    "and import it from there (in a notebook: a cell starting `%%writefile my_worker.py`, then "
    "`from my_worker import worker`), or use a worker that ships with utils (e.g. utils.ddp_train.train).")


def _check_worker(worker) -> None:
    fn = getattr(worker, "func", worker)          # functools.partial
    if not callable(fn):
        raise TypeError(f"launch() needs a function, got {type(worker).__name__}")
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module in (None, "__main__", "__mp_main__"):
        raise WorkerNotImportable(_NOT_IMPORTABLE.format(what=f"{qualname or fn!r}, defined in __main__"))
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise WorkerNotImportable(_NOT_IMPORTABLE.format(
            what=f"{qualname}, a lambda or a function defined inside another function"))
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise WorkerNotImportable(_NOT_IMPORTABLE.format(
            what=f"{module}.{qualname} (importing it failed: {e})")) from None


def _to_cpu(obj):
    """Tensors in a (nested) result moved to the CPU, so the notebook never touches CUDA."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return type(obj)((k, _to_cpu(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _write_atomic_bytes(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _watch_parent(parent_pid: int) -> None:
    """Exit if the notebook that started us goes away (kernel restart): never an orphan."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(3)


def _entry(worker, args, kwargs, rank, nprocs, port, backend, threads, workdir, parent_pid, timeout):
    """Runs in each spawned process: the environment torchrun would set, then the worker."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpgrp()            # own process group: the parent can stop our children too
    log = open(os.path.join(workdir, f"rank{rank}.log"), "w", buffering=1)
    os.dup2(log.fileno(), 1)    # the notebook's kernel cannot see our fds: the parent relays them
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs),
                      LOCAL_WORLD_SIZE=str(nprocs), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), LAB_DIST_BACKEND=backend, LAB_DIST_PARENT_STORE="1",
                      LAB_DIST_TIMEOUT=str(timeout), OMP_NUM_THREADS=str(threads))
    torch.set_num_threads(threads)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    code = 0
    result_path = os.path.join(workdir, f"rank{rank}.result")
    try:
        out = ("ok", _to_cpu(worker(*args, **kwargs)))
        try:
            payload = pickle.dumps(out)
        except Exception as e:
            raise TypeError(f"rank {rank}'s worker returned a value that cannot be sent back to the "
                            f"notebook ({e}); return tensors, numbers, lists and dicts") from e
    except BaseException as e:  # noqa: BLE001 - everything goes back to the notebook
        code = 1
        tb = traceback.format_exc()     # goes back to the notebook inside the LaunchError
        payload = pickle.dumps(("error", time.time(), type(e).__name__, str(e), tb))
        _write_atomic_bytes(result_path, payload)   # before teardown wakes the peers up with errors
    finally:
        with contextlib.suppress(Exception):
            teardown()
    _write_atomic_bytes(result_path, payload)
    log.flush()
    if code:
        os._exit(code)          # failed: exit now, whatever state the group and threads are in
    sys.exit(0)                 # a normal exit: semaphores and temporary files are released


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
                line = line.split("\r")[-1]           # progress bars: keep the last state
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
                os.killpg(p.pid, sig)               # the rank and its DataLoader workers
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


def _read_result(workdir, rank):
    path = os.path.join(workdir, f"rank{rank}.result")
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except FileNotFoundError:
        return None


def launch(worker, nprocs: int, *args, backend: str | None = None, timeout: float = 600.0,
           threads: int | None = None, stream: bool = True, **kwargs) -> list:
    """Run ``worker(*args, **kwargs)`` in ``nprocs`` new processes and return their results,
    a list indexed by rank.

    Each process is started with 'spawn' (safe after CUDA is initialised), gets the environment
    torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT on a free
    port) and calls the worker, which calls :func:`setup`. The backend is NCCL when there are at
    least ``nprocs`` GPUs (one per rank), gloo otherwise. Each rank's output is printed here
    with a ``[rank N]`` prefix (``stream=False`` to hide it).

    If a rank raises, :class:`LaunchError` names the rank and carries its traceback; if the
    ranks have not all finished after ``timeout`` seconds (a hang), :class:`LaunchTimeout`.
    Either way every process is stopped before this returns, so the next launch works.
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
            raise ValueError(f"backend='nccl' needs one GPU per process: {nprocs} processes but {n} GPU(s). "
                             f"Use nprocs <= {n}, or backend='gloo' (several processes may share a device).")
    threads = threads or 1      # more would oversubscribe the cores: each rank is one busy process
    ctx = mp.get_context("spawn")
    workdir = tempfile.mkdtemp(prefix="launch-")
    # The ranks meet in a store held here, on a port the OS assigns as it is bound: no window in
    # which another program could take the port (as with "find a free port, pass it on").
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout + 60.0),
                          wait_for_workers=False)
    port = store.port
    procs = []
    relay = _LogRelay(workdir, nprocs, stream)
    try:
        for rank in range(nprocs):
            p = ctx.Process(target=_entry, name=f"rank{rank}",
                            args=(worker, args, kwargs, rank, nprocs, port, backend, threads, workdir,
                                  os.getpid(), timeout + 60.0))
            p.start()
            procs.append(p)
        return _supervise(procs, workdir, timeout, relay)
    finally:
        _stop(procs)
        relay.pump(final=True)
        shutil.rmtree(workdir, ignore_errors=True)
        del store


EXIT_GRACE_S = 15.0   # a rank that sent its result but has not exited by then is stopped


def _supervise(procs, workdir, timeout, relay) -> list:
    deadline = time.monotonic() + timeout
    all_reported = None
    while True:
        pending = [p for p in procs if p.exitcode is None]
        failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if pending and not failed and all(
                (res := _read_result(workdir, r)) is not None and res[0] == "ok" for r in range(len(procs))):
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
            raise _failure(procs, workdir, [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)])
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
                "an all-reduce or a checkpoint save that synchronises.", rank=running[0] if running else None)
        mp.connection.wait([p.sentinel for p in pending], timeout=min(0.25, max(left, 0.01)))
        relay.pump()


_CONSEQUENCES = ("connection closed", "connection reset", "broken pipe", "connection refused")


def _failure(procs, workdir, failed) -> LaunchError:
    """The error to show: the rank that failed first, judged by what each rank reported."""
    errors = []
    for r in range(len(procs)):                   # a rank still exiting may have reported already
        res = _read_result(workdir, r)
        if res is not None and res[0] == "error":
            _, t, name, msg, tb = res
            secondary = any(c in msg.lower() for c in _CONSEQUENCES)   # "my peer vanished"
            errors.append((secondary, t, r, name, msg, tb))
    reported = {e[2] for e in errors}
    silent = [r for r in failed if r not in reported]       # killed or crashed: no Python exception
    primary = [e for e in errors if not e[0]]
    if silent and not primary:
        r = silent[0]
        code = procs[r].exitcode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        then = f" Rank(s) {sorted(reported)} lost their connection to it." if reported else ""
        return LaunchError(f"rank {r} {how} without a Python exception (killed, out of memory, or a crash "
                           f"in native code; its output is above).{then} The other ranks were stopped.", rank=r)
    if errors:
        _, t, r, name, msg, tb = min(errors)      # primary before secondary, then the earliest
        others = sorted(e[2] for e in errors if e[2] != r) + silent
        extra = f" (rank(s) {others} failed too, after it)" if others else ""
        return LaunchError(f"rank {r} raised {name}: {msg}{extra}. The other ranks were stopped.\n\n"
                           f"Traceback from rank {r}:\n{tb}", rank=r, remote_traceback=tb)
    return LaunchError("a rank failed without reporting why; the other ranks were stopped", rank=None)


def torchrun(args, *, timeout: float = 600.0, env: dict | None = None, cwd=None):
    """Run ``python -m torch.distributed.run ARGS`` (torchrun) and return the CompletedProcess
    (``stdout`` holds stdout and stderr). The agent and its workers get their own session, so a
    timeout stops all of them, not only the agent; then ``subprocess.TimeoutExpired`` is raised."""
    import subprocess
    env = dict(os.environ if env is None else env)
    env.setdefault("OMP_NUM_THREADS", "1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "LAB_DIST_PARENT_STORE", "LAB_DIST_BACKEND", "LAB_DIST_TIMEOUT"):
        env.pop(k, None)        # torchrun sets the first ones; launch()'s own must not leak into it
    cmd = [sys.executable, "-m", "torch.distributed.run", *map(str, args)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         cwd=cwd, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except BaseException:
        workers = _descendants(p.pid)                 # torchrun puts workers in sessions of their own
        p.terminate()                                 # SIGTERM: the agent stops its workers itself
        try:
            p.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            pass
        for pid in [p.pid, *workers]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        p.communicate()
        raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, None)


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


# ----------------------------------------------------------------------------------------
# Collectives by hand
# ----------------------------------------------------------------------------------------

def ring_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks, in place, with a ring of point-to-point messages.

    The tensor is cut into N chunks. Reduce-scatter (N-1 steps): each rank sends one chunk to
    its right neighbour and adds the chunk coming from its left, so afterwards rank r holds the
    full sum of chunk (r+1) % N. All-gather (N-1 steps): the finished chunks travel round the
    ring once more. Each rank sends 2(N-1) chunks of size 1/N: 2(N-1)/N of the tensor, whatever N.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return tensor
    rank = dist.get_rank(group)
    right, left = (rank + 1) % world, (rank - 1) % world
    if group is not None:                       # send/recv take global ranks
        right = dist.get_global_rank(group, right)
        left = dist.get_global_rank(group, left)
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)
    chunks = list(flat.tensor_split(world))
    buf = torch.empty_like(chunks[0]) if len(chunks[0]) else None
    for step in range(world - 1):               # reduce-scatter
        send_i, recv_i = (rank - step) % world, (rank - step - 1) % world
        req = dist.isend(chunks[send_i].contiguous(), right, group=group)
        incoming = buf[: len(chunks[recv_i])] if buf is not None else chunks[recv_i].clone()
        dist.recv(incoming, left, group=group)
        req.wait()
        chunks[recv_i] += incoming
    for step in range(world - 1):               # all-gather
        send_i, recv_i = (rank + 1 - step) % world, (rank - step) % world
        req = dist.isend(chunks[send_i].contiguous(), right, group=group)
        incoming = buf[: len(chunks[recv_i])] if buf is not None else chunks[recv_i].clone()
        dist.recv(incoming, left, group=group)
        req.wait()
        chunks[recv_i].copy_(incoming)
    if not tensor.is_contiguous():
        tensor.copy_(flat.view_as(tensor))
    return tensor


def average_gradients(model: nn.Module, group=None) -> None:
    """DDP by hand: after ``backward()``, replace every gradient with its mean over the ranks."""
    world = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
            p.grad /= world


def ring_allreduce_bytes(nbytes: float, world_size: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``nbytes``: 2(N-1)/N of it."""
    return 2.0 * (world_size - 1) / world_size * nbytes if world_size > 1 else 0.0


def alpha_beta_fit(nbytes, seconds):
    """Least-squares fit of ``t = alpha + nbytes / bandwidth`` to measured times.

    Returns (alpha in seconds, bandwidth in bytes/s). The latency alpha dominates small
    messages, the bandwidth term large ones."""
    x = np.asarray(nbytes, dtype=float)
    y = np.asarray(seconds, dtype=float)
    if len(x) < 2:
        raise ValueError("alpha_beta_fit needs timings for at least two message sizes")
    a = np.stack([np.ones_like(x), x], axis=1)
    w = 1.0 / y                               # relative errors: small messages count as much as big
    (alpha, beta), *_ = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)
    alpha = max(float(alpha), 0.0)
    beta = max(float(beta), 1e-15)
    return alpha, 1.0 / beta


# ----------------------------------------------------------------------------------------
# Checkpoints: rank 0 writes, atomically; every rank resumes
# ----------------------------------------------------------------------------------------

def rng_state() -> dict:
    """Every random generator a run may use: torch (CPU and CUDA), NumPy, Python."""
    np_state = np.random.get_state()
    state = {"torch": torch.get_rng_state(),
             "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
             "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"].cpu())
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.cpu().numpy().astype(np.uint32), *rest))
    random.setstate(_tuples(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def _rank_world():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _unwrap(model):
    return getattr(model, "module", model)


def save_checkpoint(path, model: nn.Module, optimizer=None, scheduler=None, *, epoch: int = 0,
                    step: int = 0, sampler_epoch: int | None = None, extra: dict | None = None) -> bool:
    """Save everything needed to resume exactly; only rank 0 writes. Call it on EVERY rank.

    Holds the model (unwrapped from DDP), optimizer, scheduler, ``epoch`` (epochs completed),
    ``step`` (optimizer steps taken), ``sampler_epoch`` (the next ``set_epoch`` value) and
    every rank's RNG states (gathered, so each rank gets its own back). Written to a temporary
    file and renamed, so a crash mid-save never leaves a half-written checkpoint; all ranks
    wait at a barrier until the file is complete. Returns True on the rank that wrote.
    """
    rank, world = _rank_world()
    rngs = [rng_state()]
    if world > 1:
        rngs = [None] * world
        dist.all_gather_object(rngs, rng_state())    # collective: every rank must call this
    wrote = False
    if rank == 0:
        state = {"model": _unwrap(model).state_dict(),
                 "optimizer": optimizer.state_dict() if optimizer is not None else None,
                 "scheduler": scheduler.state_dict() if scheduler is not None else None,
                 "epoch": int(epoch), "step": int(step),
                 "sampler_epoch": int(epoch if sampler_epoch is None else sampler_epoch),
                 "world_size": world, "rng": rngs, "extra": extra or {}}
        path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        buf = io.BytesIO()
        torch.save(state, buf)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(buf.getvalue())
            f.flush()
            os.fsync(f.fileno())                        # the bytes are on disk before the rename
        os.replace(tmp, path)                           # atomic: old or new, never half
        wrote = True
    if world > 1:
        dist.barrier()                                  # nobody reads it before it is complete
    return wrote


def load_checkpoint(path, model: nn.Module, optimizer=None, scheduler=None, *, map_location=None,
                    restore_rng: bool = True) -> dict:
    """Load a :func:`save_checkpoint` file on every rank and restore what was saved.

    map_location: default the model's device (each rank its own GPU, or the CPU), so a
    checkpoint written from cuda:0 never lands every rank's copy on GPU 0. Returns the
    checkpoint dict (``epoch``, ``step``, ``sampler_epoch``, ``extra``...)."""
    if map_location is None:
        try:
            map_location = next(_unwrap(model).parameters()).device
        except StopIteration:
            map_location = "cpu"
    ckpt = torch.load(os.fspath(path), map_location=map_location, weights_only=True)
    _unwrap(model).load_state_dict(ckpt["model"])
    if optimizer is not None and ckpt.get("optimizer") is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
    if scheduler is not None and ckpt.get("scheduler") is not None:
        scheduler.load_state_dict(ckpt["scheduler"])
    if restore_rng and ckpt.get("rng"):
        rank, world = _rank_world()
        rngs = ckpt["rng"]
        if len(rngs) != world:
            raise RuntimeError(f"{path} was saved by {len(rngs)} rank(s) but {world} are resuming: RNG "
                               "states cannot be matched (pass restore_rng=False to resume anyway)")
        set_rng_state(rngs[rank])
    return ckpt


class EpochOffset:
    """A loader seen by ``fit`` as starting at epoch 0, while its sampler gets the real epoch
    ``offset + e``: a resumed run reshuffles exactly as the uninterrupted one did."""

    def __init__(self, loader, offset: int):
        self.loader, self.offset = loader, int(offset)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(self.offset + epoch)

    def __iter__(self):
        return iter(self.loader)

    def __len__(self):
        return len(self.loader)

    def __getattr__(self, name):
        return getattr(self.loader, name)


class Checkpointer:
    """A ``fit`` callback that saves a checkpoint at the end of every ``every`` epochs (all ranks
    call it; rank 0 writes). ``start_epoch`` / ``start_step``: where a resumed run began."""

    def __init__(self, path, optimizer=None, scheduler=None, *, every: int = 1, start_epoch: int = 0,
                 start_step: int = 0):
        self.path, self.optimizer, self.scheduler = path, optimizer, scheduler
        self.every, self.start_epoch, self.start_step = every, start_epoch, start_step
        self.saved = []

    def on_step_end(self, state):
        pass

    def on_epoch_end(self, state):
        epoch = self.start_epoch + state.epoch + 1          # epochs completed so far
        if epoch % self.every == 0:
            save_checkpoint(self.path, state.model, self.optimizer or state.optimizer, self.scheduler,
                            epoch=epoch, step=self.start_step + state.step, sampler_epoch=epoch)
            self.saved.append(epoch)
