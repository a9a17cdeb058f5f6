"""Data parallelism: the process group (from torchrun, SLURM or a notebook), ``launch()`` for
notebooks, collective helpers, and checkpoints that resume exactly.

One worker, two ways to start it::

    # in a notebook: spawn 2 processes, get each rank's return value back
    results = utils.parallel.launch(utils.ddp_train.train, 2, {"epochs": 2})

    # in a shell, on one node or several: the same worker under torchrun
    torchrun --nproc-per-node 2 -m utils.ddp_train --epochs 2

A worker calls :func:`setup` first (it reads torchrun's environment, or the one ``launch``
prepared), builds a loader sharded by ``ctx.rank``, wraps its model with :func:`ddp` and calls
``utils.train.fit``. Backend: NCCL when every local rank can have its own GPU, gloo otherwise
(CPU-only laptops, CI, more processes than GPUs).

One module per concern:

=============== ==========================================================================
``group``       the process group: ``setup``/``teardown``, backend choice, ``ddp`` wrap
``launcher``    ``launch()`` from a notebook, ``torchrun()`` from Python
``collectives`` the ring all-reduce by hand, gradient averaging, the alpha-beta model
``checkpoint``  RNG state, atomic rank-0 checkpoints, exact resume
``shard``       ZeRO/FSDP2 wrapping, bytes per rank, collectives counted, sharded (DCP) checkpoints
``tensor_parallel`` the Megatron column/row split by hand, and with ``parallelize_module``
``pipeline``    GPipe/1F1B schedules and their bubble, the micro-batch loop by hand
``env``         rank and rendezvous from torchrun's variables, else SLURM's (``srun`` alone)
=============== ==========================================================================

The experiments the notebooks launch with these (``shard_demo``, ``tp_demo``, ``pp_demo``, ...)
live in :mod:`utils.demos`; nothing here imports them.
"""

from .checkpoint import Checkpointer, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from .collectives import (
    allreduce_time,
    alpha_beta_fit,
    average_gradients,
    ddp_efficiency,
    parameter_server_bytes,
    ring_all_reduce,
    ring_allreduce_bytes,
    ring_alpha_beta_fit,
)
from .env import RendezvousEnv, expand_hostlist, expand_tasks_per_node, rendezvous_env
from .group import (
    DEFAULT_TIMEOUT_S,
    DistContext,
    choose_backend,
    ddp,
    exact_fp32,
    free_port,
    setup,
    sizes_for_ranks,
    teardown,
)
from .launcher import LaunchError, LaunchTimeout, WorkerNotImportable, launch, torchrun
from .pipeline import bubble_fraction, gpipe_step, schedule
from .shard import CommCounter, rank_bytes, ring_bytes, zero_bytes
from .tensor_parallel import TPMLP, column_shard, row_shard

__all__ = [
    "DistContext",
    "setup",
    "teardown",
    "exact_fp32",
    "sizes_for_ranks",
    "choose_backend",
    "free_port",
    "ddp",
    "launch",
    "LaunchError",
    "LaunchTimeout",
    "WorkerNotImportable",
    "ring_all_reduce",
    "average_gradients",
    "rng_state",
    "set_rng_state",
    "save_checkpoint",
    "load_checkpoint",
    "Checkpointer",
    "ring_allreduce_bytes",
    "alpha_beta_fit",
    "ring_alpha_beta_fit",
    "allreduce_time",
    "ddp_efficiency",
    "parameter_server_bytes",
    "torchrun",
    "DEFAULT_TIMEOUT_S",
    "zero_bytes",
    "rank_bytes",
    "ring_bytes",
    "CommCounter",
    "column_shard",
    "row_shard",
    "TPMLP",
    "bubble_fraction",
    "schedule",
    "gpipe_step",
    "rendezvous_env",
    "RendezvousEnv",
    "expand_hostlist",
    "expand_tasks_per_node",
]
