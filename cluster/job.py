"""The program every job template runs: ``utils.ddp_train``'s worker, plus a log per rank and a
check that the ranks agree. The same file runs under torchrun (templates 1 and 2) and as one
``srun`` task per rank (template 3): ``utils.parallel.setup()`` reads whichever variables are there.

    python cluster/job.py RUN_DIR [utils.ddp_train options, e.g. --epochs 3 --batch-size 32]

RUN_DIR/ckpt.pt      the checkpoint (rank 0 writes it after every epoch; a requeued job resumes from it)
RUN_DIR/logs/rankN.log   everything rank N prints, appended across requeues

Each rank prints two lines the checker (cluster/slurm_check.py) reads:
``allreduce-check``: the all-reduce of rank+1 over the group, which must be W(W+1)/2 on every rank;
``weights-check``: a SHA-256 of the final weights, which DDP keeps identical on every rank.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import socket
import sys
import time

import torch
import torch.distributed

from utils import ddp_train, parallel


def weights_digest(state: dict) -> str:
    """SHA-256 over the tensors of a state dict, in key order: equal iff the weights are bit-equal."""
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _log_to(path: str) -> None:
    """Send this process's stdout and stderr (Python and C level, e.g. gloo's) to ``path``, appended."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    run_dir, rest = os.path.abspath(argv[0]), argv[1:]
    if "--ckpt" not in rest:
        rest += ["--ckpt", os.path.join(run_dir, "ckpt.pt")]
    cfg = ddp_train.parse_args(rest)
    # --fail-at-step crashes a rank on the first attempt only; torchrun counts attempts in
    # TORCHELASTIC_RESTART_COUNT, and without torchrun SLURM counts requeues: use that instead.
    os.environ.setdefault("TORCHELASTIC_RESTART_COUNT", os.environ.get("SLURM_RESTART_COUNT", "0"))
    env = parallel.rendezvous_env()
    log = os.path.join(run_dir, "logs", f"rank{env.rank}.log")
    print(f"rank {env.rank}/{env.world_size} on {socket.gethostname()}: log in {log}", flush=True)
    _log_to(log)
    print(
        f"=== job {os.environ.get('SLURM_JOB_ID', '-')} restart {os.environ.get('SLURM_RESTART_COUNT', '0')} "
        f"rank {env.rank}/{env.world_size} local {env.local_rank}/{env.local_world_size} "
        f"host {socket.gethostname()} from {env.source} at {time.strftime('%H:%M:%S')} ===",
        flush=True,
    )
    ctx = parallel.setup(cfg.backend or None, device=cfg.device or None)
    # The group works: every rank contributes rank + 1; the sum is W(W+1)/2 everywhere.
    t = torch.tensor([float(ctx.rank + 1)], device=ctx.device)
    torch.distributed.all_reduce(t)
    print(
        f"allreduce-check rank {ctx.rank}/{ctx.world_size}: sum {t.item():.0f} "
        f"expected {ctx.world_size * (ctx.world_size + 1) // 2}",
        flush=True,
    )
    res = ddp_train.train(dataclasses.replace(cfg, return_state=True))  # same group; torn down at its end
    h = res["history"]
    print(
        f"weights-check rank {res['rank']}/{res['world_size']}: sha256 {weights_digest(res['state'])} "
        f"start_epoch {res['start_epoch']} steps {h['steps'] if h else 0}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
