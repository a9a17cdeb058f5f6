"""Where a process learns its rank: torchrun's (or ``launch()``'s) variables, else SLURM's.

torchrun and :func:`utils.parallel.launch` set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT. A plain ``srun python worker.py`` sets none of them; each task
gets SLURM's instead, which this module translates:

==================== ================================================ ======================
torch name           SLURM source                                     example
==================== ================================================ ======================
RANK                 SLURM_PROCID                                     ``5``
WORLD_SIZE           SLURM_NTASKS                                     ``8``
LOCAL_RANK           SLURM_LOCALID                                    ``1``
LOCAL_WORLD_SIZE     SLURM_STEP_TASKS_PER_NODE / SLURM_NTASKS_PER_NODE ``2(x3),1`` -> node 1: 2
                     / SLURM_TASKS_PER_NODE, entry SLURM_NODEID
MASTER_ADDR          first host of SLURM_JOB_NODELIST                 ``node[01-03,07]`` -> node01
MASTER_PORT          20000 + SLURM_JOB_ID % 10000 (if unset)          job 123456 -> 23456
==================== ================================================ ======================

SLURM counts only inside a job *step* (``srun``, SLURM_STEP_ID set): the batch script itself
sees SLURM_NTASKS=8 and SLURM_PROCID=0 but is one process, and must not wait for seven others.

The derived MASTER_PORT is the same on every task without any exchange, but two jobs whose ids
differ by a multiple of 10,000 get the same one: if they share a node, the second cannot bind it.
Where jobs share nodes, export MASTER_PORT (a free port on the first node) in the job script.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

# MASTER_PORT = PORT_BASE + job id % PORT_SPAN, below Linux's ephemeral range; ids PORT_SPAN apart collide
PORT_BASE, PORT_SPAN = 20000, 10000


@dataclass(frozen=True)
class RendezvousEnv:
    """What a process needs to join its group, and where it came from."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None
    master_port: int | None
    source: str  # "torchrun" (torchrun or launch()), "slurm" or "alone"


def expand_hostlist(hostlist: str) -> list[str]:
    """SLURM's compact host list, expanded: ``"node[01-03,07],gpu1"`` -> node01 node02 node03
    node07 gpu1. Zero padding is kept; several bracket groups multiply (``r[1-2]n[1-2]``: 4 hosts).
    The same as ``scontrol show hostnames``, without needing SLURM installed."""
    hosts = []
    for item in _split_top(hostlist.strip()):
        parts = re.split(r"(\[[^\]]*\])", item)
        names = [""]
        for part in parts:
            if part.startswith("["):
                names = [n + v for n in names for v in _expand_range(part[1:-1], hostlist)]
            elif "[" in part or "]" in part:
                raise ValueError(f"unbalanced brackets in host list {hostlist!r}")
            else:
                names = [n + part for n in names]
        hosts.extend(names)
    if not hosts:
        raise ValueError(f"empty host list {hostlist!r}: expected e.g. 'node[01-03,07]'")
    return hosts


def _split_top(s: str) -> list[str]:
    """Split on commas outside brackets."""
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced brackets in host list {s!r}")
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if depth != 0:
        raise ValueError(f"unbalanced brackets in host list {s!r}")
    out.append(cur)
    return [p for p in (x.strip() for x in out) if p]


def _expand_range(spec: str, whole: str) -> list[str]:
    vals = []
    for r in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", r)
        if not m:
            raise ValueError(f"bad range {r!r} in host list {whole!r}: expected digits like 01-03")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"descending range {r!r} in host list {whole!r}")
        width = len(lo) if lo.startswith("0") else 0
        vals += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    return vals


def expand_tasks_per_node(spec: str) -> list[int]:
    """SLURM_TASKS_PER_NODE expanded to one count per node: ``"2(x3),1"`` -> [2, 2, 2, 1]."""
    counts = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ValueError(f"cannot read tasks per node {spec!r}: expected e.g. '2(x3),1'")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def _int(env, name, default=None):
    v = env.get(name)
    if v in (None, ""):
        return default
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"environment variable {name}={v!r} is not an integer") from None


def rendezvous_env(env: Mapping[str, str] | None = None, *, export: bool = False) -> RendezvousEnv:
    """This process's rank, group sizes and rendezvous address.

    From torchrun's / ``launch()``'s variables when RANK and WORLD_SIZE are set; else from SLURM's
    inside an ``srun`` step; else a group of one. ``env``: a mapping to read (default
    ``os.environ``). ``export=True`` writes MASTER_ADDR / MASTER_PORT derived from SLURM back
    into ``os.environ`` when there is more than one task (``init_process_group`` and NCCL read
    them there)."""
    env = os.environ if env is None else env
    addr, port = env.get("MASTER_ADDR") or None, _int(env, "MASTER_PORT")
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = _int(env, "RANK", 0), _int(env, "WORLD_SIZE", 1)
        return RendezvousEnv(
            rank, world, _int(env, "LOCAL_RANK", rank), _int(env, "LOCAL_WORLD_SIZE", world), addr, port, "torchrun"
        )
    in_step = env.get("SLURM_STEP_ID") not in (None, "") and env.get("SLURM_PROCID") not in (None, "")
    if not in_step:
        return RendezvousEnv(0, 1, 0, 1, addr, port, "alone")
    rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS", 1)
    local_rank = _int(env, "SLURM_LOCALID", 0)
    node = _int(env, "SLURM_NODEID", 0)
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if spec:
        per_node = expand_tasks_per_node(spec)
        local_world = per_node[node] if node < len(per_node) else per_node[-1]
    else:
        local_world = world
    if addr is None:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist and world > 1:
            raise RuntimeError(
                "SLURM set SLURM_PROCID but no SLURM_JOB_NODELIST: set MASTER_ADDR to the "
                "first node's address in the job script"
            )
        addr = expand_hostlist(nodelist)[0] if nodelist else "127.0.0.1"
    if port is None:
        job = _int(env, "SLURM_JOB_ID")
        if job is None and world > 1:
            raise RuntimeError("SLURM set SLURM_PROCID but no SLURM_JOB_ID: set MASTER_PORT in the job script")
        port = PORT_BASE + (job or 0) % PORT_SPAN
    if export and world > 1:  # a one-task step stays a group of one (its own free port)
        os.environ.setdefault("MASTER_ADDR", addr)
        os.environ.setdefault("MASTER_PORT", str(port))
    return RendezvousEnv(rank, world, local_rank, local_world, addr, port, "slurm")
