"""The class's JupyterHub (``cluster/hub/jupyterhub_config.py``, ``make hub``): each student's share
of the server's GPUs, the environment their server starts with, and the course copied into their home.

The instructor sets a pool: the ``CUDA_VISIBLE_DEVICES`` values the hub may hand out (GPU indices,
or MIG UUIDs). A share is one slot of the pool, under one of two policies:

* whole GPUs: ``gpus_per_user`` GPUs each (default 1), no one else on them;
* shared GPUs: ``per_gpu`` students on each GPU, time-sliced. Time-slicing gives no memory
  protection: one student's allocations can leave another out of memory.

Slots go round the pool first (slot ``s`` is on GPU ``s mod len(pool)``), so every GPU gets its first
student before any gets a second. A MIG slice is one device to a process, and NCCL cannot run DDP
across slices, so a MIG share is always one slice. With one GPU, the course's multi-rank labs run
their ranks on it with gloo.

Standard library only: the hub's process imports it without torch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

COURSE_FOLDER = "scaling-labs"  # the course's folder in each student's home
# Never copied into a home: the shared environment, build and run outputs.
NOT_COPIED = (".venv", "*.egg-info", "__pycache__", ".ipynb_checkpoints", "runs", "build", ".git")


class PoolFull(RuntimeError):
    """Every share of the pool is taken (JupyterHub shows the message on the student's spawn page)."""


@dataclass(frozen=True)
class Share:
    """A student's GPU share: ``visible`` is their ``CUDA_VISIBLE_DEVICES``, ``line`` what their
    notebook 00 prints about it (``LAB_GPU_SHARE``); ``slot`` is None for a CPU-only server."""

    slot: int | None
    visible: str
    line: str


def parse_pool(text: str) -> list[str]:
    """``"0, 1,2"`` -> ``["0", "1", "2"]``; an empty text is an empty pool (CPU-only servers)."""
    pool = [p.strip() for p in text.split(",") if p.strip()]
    if len(set(pool)) != len(pool):
        raise ValueError(f"hub: the GPU pool {text!r} names a device twice. Try: list each GPU once.")
    return pool


def detect_pool() -> list[str]:
    """The indices of every GPU ``nvidia-smi`` lists; empty without a driver."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return parse_pool(out.stdout.replace("\n", ",")) if out.returncode == 0 else []


def _check_policy(pool: list[str], per_gpu: int, gpus_per_user: int) -> None:
    if per_gpu < 1 or gpus_per_user < 1:
        raise ValueError(
            f"hub: per_gpu={per_gpu} and gpus_per_user={gpus_per_user} must be at least 1. Try: 1 for either."
        )
    if per_gpu > 1 and gpus_per_user > 1:
        raise ValueError(
            "hub: a share is either whole GPUs (gpus_per_user) or part of one GPU (per_gpu), not both. "
            "Try: set one of them to 1."
        )
    if gpus_per_user > 1 and any(p.startswith("MIG-") for p in pool):
        raise ValueError(
            "hub: a process sees only one MIG slice, so a share of several slices runs on one. "
            "Try: gpus_per_user=1 with a MIG pool."
        )


def slot_count(pool: list[str], per_gpu: int = 1, gpus_per_user: int = 1) -> int:
    """How many students the pool serves at once."""
    _check_policy(pool, per_gpu, gpus_per_user)
    return len(pool) // gpus_per_user if gpus_per_user > 1 else len(pool) * per_gpu


def gpu_share(slot: int | None, pool: list[str], per_gpu: int = 1, gpus_per_user: int = 1) -> Share:
    """The share of ``slot`` (0-based; None: no GPU) under the policy, with the line a student reads."""
    n = slot_count(pool, per_gpu, gpus_per_user)
    if slot is None or n == 0:
        return Share(None, "", "no GPU: this server runs on the CPU")
    if not 0 <= slot < n:
        raise ValueError(f"hub: slot {slot} is outside the pool's {n} slots.")
    if gpus_per_user > 1:
        gpus = pool[slot * gpus_per_user : (slot + 1) * gpus_per_user]
        visible = ",".join(gpus)
        seen = ", ".join(f"cuda:{i}" for i in range(len(gpus)))
        return Share(slot, visible, f"the server's GPUs {visible}, yours alone; your programs see them as {seen}")
    gpu = pool[slot % len(pool)]
    kind = "MIG slice" if gpu.startswith("MIG-") else "GPU"
    if per_gpu == 1:
        who = "yours alone"
    else:
        others = "1 other student" if per_gpu == 2 else f"up to {per_gpu - 1} other students"
        who = f"shared with {others}, memory too, so stop the kernels you are done with"
    return Share(slot, gpu, f"the server's {kind} {gpu}, {who}; your programs see it as cuda:0")


def first_free_slot(taken: Iterable[int], n: int) -> int | None:
    """The lowest slot in ``range(n)`` not in ``taken``; None when all are taken."""
    free = sorted(set(range(n)) - set(taken))
    return free[0] if free else None


class SharePool:
    """The hub's record of which server holds which slot: ``take`` on spawn, ``release`` on stop.
    Kept in the hub's memory; the hub stops every server when it stops (JupyterHub's default
    ``cleanup_servers``), so a restarted hub starts with an empty record and no running servers."""

    def __init__(self, pool: list[str], per_gpu: int = 1, gpus_per_user: int = 1):
        self.pool, self.per_gpu, self.gpus_per_user = list(pool), per_gpu, gpus_per_user
        self.n = slot_count(self.pool, per_gpu, gpus_per_user)
        self.held: dict[str, int] = {}  # server key ("user/server name") -> slot

    def take(self, key: str) -> Share:
        """The share of ``key``'s server: the one it holds, else the first free slot's."""
        if self.n == 0:
            return gpu_share(None, self.pool)
        if key not in self.held:
            slot = first_free_slot(self.held.values(), self.n)
            if slot is None:
                raise PoolFull(
                    f"GPU share: all {self.n} shares of this server's GPUs are in use. "
                    "Try: start your server again when a classmate's has stopped, or ask your instructor."
                )
            self.held[key] = slot
        return gpu_share(self.held[key], self.pool, self.per_gpu, self.gpus_per_user)

    def release(self, key: str) -> None:
        """Free ``key``'s slot (nothing happens when it holds none)."""
        self.held.pop(key, None)


def spawn_environment(share: Share, cpu_limit: float | None = None) -> dict[str, str]:
    """What a student's server starts with: its GPUs, the line notebook 00 prints, and, under a CPU
    limit, that many threads for torch (a fair share of the cores, not a cap: the spawner caps, or not)."""
    env = {"CUDA_VISIBLE_DEVICES": share.visible, "LAB_GPU_SHARE": share.line}
    if cpu_limit:
        env["OMP_NUM_THREADS"] = str(max(1, int(cpu_limit)))
    return env


def copy_course(course: Path, home: Path) -> Path | None:
    """Copy the release folder ``course`` into ``home/scaling-labs`` unless it is there already (a
    student's work is never overwritten), as the hub's own user (SimpleLocalProcessSpawner's case).
    Returns the new folder, or None when there was one. A folder holding ``solutions/`` is refused:
    it is not a release."""
    course, dest = _release(course), Path(home) / COURSE_FOLDER
    if os.path.lexists(dest):
        return None
    _copy(course, dest)
    return dest


def copy_course_as(account: tuple[int, int], course: Path, home: Path) -> Path | None:
    """``copy_course`` run as the account (uid, gid) that owns ``home``, from a hub running as root:
    every file is the student's, and nothing the student puts in their home (a link where the copy
    goes) can make root write anywhere else. The student must be able to run this Python and read
    ``course`` (as their server must)."""
    course, dest = _release(course), Path(home) / COURSE_FOLDER
    if os.path.lexists(dest):
        return None
    uid, gid = account
    run = subprocess.run(
        [sys.executable, "-I", __file__, str(course), str(dest)],
        user=uid,
        group=gid,
        extra_groups=[],
        cwd="/",
        env={"PATH": os.defpath},
        capture_output=True,
        text=True,
    )
    if run.returncode != 0:
        last = (run.stderr.strip().splitlines() or ["no message"])[-1]
        raise RuntimeError(f"hub: copying the course into {dest} as uid {uid} failed: {last}")
    return dest


def _release(course: Path) -> Path:
    course = Path(course).resolve()
    if (course / "solutions").exists():
        raise ValueError(
            f"hub: {course} holds solutions/, which students must not get. "
            "Try: make release DEST=<folder> and start the hub from that folder."
        )
    return course


def _copy(course: Path, dest: Path) -> None:
    """Copy into a folder beside ``dest``, renamed into place when complete."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{COURSE_FOLDER}.partial")
    if os.path.lexists(tmp):
        shutil.rmtree(tmp) if tmp.is_dir() and not tmp.is_symlink() else tmp.unlink()
    shutil.copytree(course, tmp, symlinks=True, ignore=shutil.ignore_patterns(*NOT_COPIED))
    tmp.rename(dest)


if __name__ == "__main__":  # copy_course_as runs this file as the student: python -I hub.py COURSE DEST
    _copy(Path(sys.argv[1]), Path(sys.argv[2]))
