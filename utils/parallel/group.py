"""The process group: setup from torchrun, SLURM or ``launch()``; backend choice; DDP wrap."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ..files import SHM_DIR, shm_free_bytes
from .env import rendezvous_env

if TYPE_CHECKING:
    from ..config import Profile


DEFAULT_TIMEOUT_S = 300.0  # seconds a collective may wait before the group gives up


# ----------------------------------------------------------------------------------------
# The process group
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DistContext:
    """What one process knows about the group it is in."""

    rank: int  # 0 .. world_size-1, unique across all nodes
    world_size: int  # processes in the job
    local_rank: int  # 0 .. local_world_size-1 on this node: picks the GPU
    local_world_size: int
    backend: str  # "nccl" or "gloo"
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
    """NCCL when this process sees at least ``nprocs_per_node`` GPUs (one each), gloo otherwise.

    This is the guess of a process that starts the ranks (``launch``) and sees what they will
    see. A rank that joins a group decides with the others instead (:func:`setup`): under SLURM
    ``--gpus-per-task`` or a per-rank ``CUDA_VISIBLE_DEVICES`` each rank sees one GPU, its own."""
    if torch.cuda.is_available() and dist.is_nccl_available() and torch.cuda.device_count() >= nprocs_per_node:
        return "nccl"
    return "gloo"


def sizes_for_ranks(cfg: Profile, nprocs: int, *, quiet: bool = False) -> Profile:
    """The profile a demo of ``nprocs`` launched ranks should take its sizes from.

    ``cfg`` when every rank gets a GPU of its own (launch picks NCCL), or when ``cfg`` is already
    the smoke profile. Otherwise (one GPU, or none, for two ranks) the ranks fall back to gloo on
    the CPU, one thread each: the gpu profile's sizes would take minutes there and time a CPU, so
    the smoke profile's sizes are returned, and a line says so (``quiet=True``: no line)."""
    from ..config import profile

    backend = choose_backend(nprocs)
    if backend == "nccl" or cfg.name == "smoke":
        return cfg
    if not quiet:
        print(
            f"note: {nprocs} ranks, {visible_gpus()} GPU(s) in sight: the ranks run on gloo on the CPU (one thread "
            f"each), so these multi-rank demos use the smoke profile's sizes, not the {cfg.name} profile's "
            f"(with {nprocs} GPUs, one per rank, they use the {cfg.name} sizes on the GPUs)",
            flush=True,
        )
    return profile("smoke")


def visible_gpus() -> int:
    """GPUs this process can see (after CUDA_VISIBLE_DEVICES), 0 without CUDA."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def rank_device(local_rank: int, device: torch.device | str | None = None) -> torch.device:
    """The device of a rank: ``device`` if it names one fully (``cpu``, ``cuda:1``); a bare
    ``cuda`` (or None with a GPU in sight) becomes ``cuda:(local_rank % visible GPUs)``, so ranks
    that share GPUs spread over them and a rank that sees only its own GPU gets ``cuda:0``.
    (``torch.cuda.set_device`` needs an index: a bare ``torch.device("cuda")`` raises.)"""
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        return dev
    n = visible_gpus()
    if n == 0:
        raise RuntimeError(
            f"device {str(dev)!r} was asked for but this process sees no GPU "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); use device='cpu'"
        )
    if dev.index is None:
        return torch.device("cuda", local_rank % n)
    if dev.index >= n:
        raise RuntimeError(
            f"device {str(dev)!r} does not exist: this process sees {n} GPU(s) (cuda:0 to "
            f"cuda:{n - 1}); pass device='cuda' to let each rank take cuda:(local rank % {n})"
        )
    return dev


def _gpu_identity(dev: torch.device) -> str:
    """Which physical GPU ``dev`` is, the same string in every process that sees it: the node's
    name and the GPU's UUID (an index means different GPUs under different CUDA_VISIBLE_DEVICES)."""
    try:
        uuid = str(torch.cuda.get_device_properties(dev.index).uuid)
    except (AttributeError, RuntimeError, AssertionError):  # torch without .uuid
        entries = [e.strip() for e in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if e.strip()]
        uuid = entries[dev.index] if dev.index < len(entries) else f"index-{dev.index}"
    return f"{socket.gethostname()}/{uuid}"


def _agree_on_gpus(store, rank: int, world: int, identity: str | None, timeout: float) -> tuple[bool, int]:
    """Every rank says which GPU it would use (None: it sees none); returns, on every rank alike,
    (True if every rank has a GPU no other rank uses, how many ranks see none). Store counters
    only, O(1) per rank: each rank counts its GPU's users; a GPU counted twice, or a rank
    without one, vetoes NCCL for the whole group."""
    n = store.add(f"lab/setups/{rank}", 1)  # a worker may call setup() more than once
    key = f"lab/agree{n}/"
    if identity is None:
        store.add(key + "no_gpu", 1)
    elif store.add(key + "gpu/" + identity, 1) > 1:
        store.add(key + "shared", 1)
    if store.add(key + "said", 1) == world:
        store.set(key + "all_said", "1")
    store.wait([key + "all_said"], timedelta(seconds=timeout))
    no_gpu, shared = store.add(key + "no_gpu", 0), store.add(key + "shared", 0)
    return no_gpu == 0 and shared == 0, no_gpu


def setup(
    backend: str | None = None, *, device: torch.device | str | None = None, timeout: float | None = None
) -> DistContext:
    """Join the process group and return this process's :class:`DistContext`.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT, as set by
    torchrun or by :func:`launch`. Without them (``python script.py``) it makes a group of one,
    so the same script runs alone. The GPU is pinned (``torch.cuda.set_device``) *before* the
    group is created, so NCCL never puts two ranks on GPU 0. In an ``srun`` step without
    torchrun it reads SLURM's variables instead (:func:`utils.parallel.env.rendezvous_env`).

    backend: "nccl" or "gloo". Default: decided by all the ranks together from what each one
        sees: NCCL when every rank has a GPU no other rank uses (``cuda:LOCAL_RANK`` when a rank
        sees the node's GPUs; ``cuda:0`` when it sees only its own, as under SLURM
        ``--gpus-per-task=1``), gloo otherwise (more ranks than GPUs, CPU-only nodes, nodes with
        different GPU counts), so every rank picks the same backend.
    device: override the device ("cpu"; "cuda": gloo ranks share the GPUs, rank r on
        ``cuda:(LOCAL_RANK % GPUs)``; "cuda:1"); default the rank's own GPU with NCCL, else CPU.
    timeout: seconds a collective may wait for the other ranks before failing.
    """
    env = rendezvous_env(export=True)  # torchrun's / launch()'s variables, else SLURM's, else alone
    rank, world, local_rank, local_world = env.rank, env.world_size, env.local_rank, env.local_world_size
    alone = world == 1 and "MASTER_PORT" not in os.environ
    if not alone and ("MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ):
        raise RuntimeError(
            "RANK and WORLD_SIZE are set but MASTER_ADDR / MASTER_PORT are not: start the "
            "script with torchrun (or utils.parallel.launch from a notebook), which sets all four"
        )
    if timeout is None:
        timeout = float(os.environ.get("LAB_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))
    backend = (backend or os.environ.get("LAB_DIST_BACKEND") or "").lower() or None
    if backend not in (None, "nccl", "gloo"):
        raise ValueError(f"unknown backend {backend!r}: use 'nccl' (GPUs) or 'gloo' (CPU, or any device)")
    if dist.is_initialized():
        backend = backend or dist.get_backend()
        dev = rank_device(local_rank, device) if (device is not None or backend == "nccl") else torch.device("cpu")
        return DistContext(rank, world, local_rank, local_world, backend, dev)

    # The GPU this rank would own with NCCL: an explicit device, else cuda:(local_rank % visible).
    n = visible_gpus()
    own = None
    if n > 0 and (device is None or torch.device(device).type == "cuda"):
        own = rank_device(local_rank, device)
    store = _store(rank, world, alone, timedelta(seconds=timeout))
    if backend in (None, "nccl") and world > 1:
        ident = _gpu_identity(own) if own is not None else None
        own_gpus, no_gpu = _agree_on_gpus(store, rank, world, ident, timeout)
    else:
        own_gpus, no_gpu = own is not None, 0 if own is not None else 1
    if backend is None:
        backend = "nccl" if own_gpus and dist.is_nccl_available() else "gloo"
    elif backend == "nccl" and not own_gpus:
        why = (
            (f"{no_gpu} rank(s) see no GPU" if no_gpu else "some ranks would share a GPU (NCCL needs one GPU per rank)")
            if world > 1
            else "this process sees no GPU"
        )
        raise RuntimeError(
            f"backend nccl needs a GPU of its own for every rank, but {why} (local rank "
            f"{local_rank} sees {n} GPU(s), {local_world} processes on this node). Start at "
            f"most one process per GPU, or use backend='gloo' (ranks may share a device)."
        )
    if backend == "nccl":
        _check_shm_for_nccl(local_world)
        dev = own
    elif device is not None:
        dev = rank_device(local_rank, device)  # gloo on a GPU: ranks may share it
    else:
        dev = torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # pin the GPU before the group exists
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
    return DistContext(rank, world, local_rank, local_world, backend, dev)


NCCL_MIN_SHM_BYTES = 256 * 2**20  # NCCL's shared-memory transport and proxy buffers between local ranks


def _check_shm_for_nccl(local_world: int) -> None:
    """NCCL ranks on one node talk through segments in /dev/shm. Docker gives a container 64 MB by
    default, and NCCL then dies in its first collective with "Error while creating shared memory
    segment", which names no cure. Refuse before the group exists, and say what to do."""
    free = shm_free_bytes()
    if local_world < 2 or free is None or free >= NCCL_MIN_SHM_BYTES:
        return
    raise RuntimeError(
        f"{SHM_DIR} has {free / 2**20:,.0f} MiB free, but NCCL between the {local_world} processes on this "
        f"node needs at least {NCCL_MIN_SHM_BYTES // 2**20} MiB of shared memory (it would fail with 'Error "
        f"while creating shared memory segment'). In Docker, start the container with a bigger --shm-size "
        f"(e.g. --shm-size=8g) or with --ipc=host; or use backend='gloo'."
    )


def exact_fp32() -> None:
    """Turn TF32 off in this process, for demos that compare GPU ranks with a CPU oracle to 1e-5.

    On Ampere and newer, cuDNN convolutions run in TF32 by default (``torch.backends.cudnn.allow_tf32``)
    and so do float32 matmuls where ``torch.backends.cuda.matmul.allow_tf32`` (or
    ``torch.set_float32_matmul_precision("high")``) is set: inputs rounded to 10 mantissa bits,
    differences of 1e-3, far above the asserts' tolerances. Equivalence workers call this first."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


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


TEARDOWN_TIMEOUT_S = 30.0  # seconds destroy_process_group may take before we stop waiting


def teardown(timeout: float | None = None) -> bool:
    """Leave the process group (safe to call twice, or when there is none), within ``timeout``
    seconds (default LAB_DIST_TEARDOWN_TIMEOUT, else 30).

    ``destroy_process_group`` can block for good: NCCL waits for collectives a dead peer will
    never join, gloo for a peer's goodbye. It runs in a helper thread; if it has not returned in
    time, NCCL's communicators are aborted (which releases the waits) and we return False, so
    the caller can report its error and exit instead of hanging in a ``finally``."""
    if not (dist.is_available() and dist.is_initialized()):
        return True
    if timeout is None:
        timeout = float(os.environ.get("LAB_DIST_TEARDOWN_TIMEOUT", TEARDOWN_TIMEOUT_S))
    nccl = dist.get_backend() == "nccl"
    done = threading.Event()
    errors = []

    def destroy():
        try:
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            done.set()

    threading.Thread(target=destroy, name="lab-teardown", daemon=True).start()
    if done.wait(timeout):
        return not errors
    if nccl:
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None:
            with contextlib.suppress(Exception):
                abort()  # NCCL's ncclCommAbort: unblocks the destroy
            done.wait(min(timeout, 10.0))
    print(
        f"utils.parallel.teardown: destroy_process_group did not return within {timeout:g} s "
        f"({'aborted the NCCL communicators' if nccl else 'left to the exiting process'})",
        file=sys.stderr,
        flush=True,
    )
    return False


def ddp(model: nn.Module, ctx: DistContext, *, channels_last: bool = False, **kwargs) -> nn.Module:
    """``DistributedDataParallel`` on ``ctx.device``: ``device_ids`` only for a CUDA device
    (for the CPU it must be None). ``kwargs`` go to DDP (``bucket_cap_mb``, ...).

    channels_last: convert the model's 4-d weights to channels_last *before* wrapping. DDP lays
    out its gradient buckets as views of the parameters it is given; converting afterwards
    (``fit(..., channels_last=True)`` on the wrapper) leaves the buckets in the old layout, so
    every step copies each gradient and DDP warns that the strides do not match."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = model.to(ctx.device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    if ctx.device.type == "cuda":
        return DDP(model, device_ids=[ctx.device.index], output_device=ctx.device.index, **kwargs)
    return DDP(model, **kwargs)
