"""The self-check of lab 3's torchrun script (solutions/lab3_ddp.ipynb): ``check_ddp_script`` runs
your script FILE under torchrun on 2 processes; this module is also the probe each of those
processes runs (``python -m utils.checks.ddp_script --probe SCRIPT ARGS``)."""

from __future__ import annotations

import os
import subprocess
import tempfile

import torch
from torch import nn

from ._common import CheckFailed, _call, _fail, _passed

__all__ = ["check_ddp_script", "SERIAL_SCRIPT", "run_script"]


def _raise_not_implemented():
    raise NotImplementedError


# ---------------------------------------------------------------------------- the torchrun script

SERIAL_SCRIPT = '''\
"""train_serial.py: one process trains a small classifier. Run: python train_serial.py --epochs 3"""
import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn


def make_data(n=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :3].sum(dim=1) > 0).long() + (x[:, 3] > 1).long()      # 3 classes
    return torch.utils.data.TensorDataset(x, y)


def make_model(seed=1):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)      # examples per optimizer step
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt", default="ckpt.pt")
    args = ap.parse_args()

    data = make_data()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for epoch in range(args.epochs):
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(args.seed + epoch))
        loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size,
                                             sampler=order.tolist())    # a new shuffle every epoch
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        torch.save({"model": model.state_dict(), "epoch": epoch}, args.ckpt)
    x, y = data.tensors
    acc = (model(x).argmax(1) == y).float().mean().item()
    print(f"trained {args.epochs} epochs, batch {args.batch_size}: train accuracy {acc:.3f}")


if __name__ == "__main__":
    main()
'''


def _script_namespace():
    ns = {"__name__": "lab3_serial"}
    exec(compile(SERIAL_SCRIPT, "train_serial.py", "exec"), ns)
    return ns


def _simulate(epochs, batch, world=1, *, shard=True, reshuffle=True, average=True, per_rank_batch=None, lr=0.1, seed=0):
    """The serial script's training, and the ways a distributed version of it goes wrong:
    ``shard=False`` every rank trains on all the data; ``reshuffle=False`` epoch 0's order every
    epoch; ``average=False`` rank 0 alone on its shard (no DDP); ``per_rank_batch`` the batch each
    rank takes. Returns rank 0's final state dict (every rank's, when they agree)."""
    ns = _script_namespace()
    data, model = ns["make_data"](), ns["make_model"]()
    x_all, y_all = data.tensors
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    b = per_rank_batch or batch // world
    for epoch in range(epochs):
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed + (epoch if reshuffle else 0)))
        shards = [order[r::world] if shard else order for r in range(world)]
        if not average:
            shards = shards[:1]
        for i in range(0, len(shards[0]), b):
            opt.zero_grad()
            grads = []
            for s in shards:
                idx = s[i : i + b]
                model.zero_grad()
                F_loss = nn.functional.cross_entropy(model(x_all[idx]), y_all[idx])
                grads.append(torch.autograd.grad(F_loss, list(model.parameters())))
            for p, *gs in zip(model.parameters(), *grads):
                p.grad = sum(gs) / len(gs)
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


_PROBE_DOC = "python -m utils.checks.ddp_script --probe SCRIPT ARGS: run SCRIPT as __main__ and record what it calls"


def _probe(argv):
    """One rank under torchrun: run the student's script and note which ranks save, whether the
    sampler's set_epoch, init/destroy_process_group and DistributedDataParallel were called."""
    import json
    import runpy
    import sys

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DistributedSampler as DS

    script, rest = argv[0], argv[1:]
    rec = {
        "rank": int(os.environ.get("RANK", "0")),
        "saves": 0,
        "set_epoch": [],
        "ddp": [],
        "init": 0,
        "destroy": 0,
        "sampler": 0,
        "loaders": [],
    }
    real_save, real_set_epoch = torch.save, DS.set_epoch
    real_init, real_destroy = dist.init_process_group, dist.destroy_process_group
    real_ddp, real_ds = DistributedDataParallel.__init__, DS.__init__

    def save(*a, **k):
        rec["saves"] += 1
        return real_save(*a, **k)

    def set_epoch(self, epoch):
        rec["set_epoch"].append(int(epoch))
        return real_set_epoch(self, epoch)

    def init(*a, **k):
        rec["init"] += 1
        return real_init(*a, **k)

    def destroy(*a, **k):
        rec["destroy"] += 1
        return real_destroy(*a, **k)

    def ddp_init(self, module, *a, **k):
        rec["ddp"].append(repr(k.get("device_ids", a[0] if a else None)))
        return real_ddp(self, module, *a, **k)

    def ds_init(self, *a, **k):
        rec["sampler"] += 1
        return real_ds(self, *a, **k)

    from torch.utils.data import DataLoader

    real_iter = DataLoader.__iter__

    def loader_iter(self):
        rec["loaders"].append(isinstance(getattr(self.batch_sampler, "sampler", self.sampler), DS))
        return real_iter(self)

    DataLoader.__iter__ = loader_iter
    torch.save, DS.set_epoch = save, set_epoch
    dist.init_process_group, dist.destroy_process_group = init, destroy
    DistributedDataParallel.__init__, DS.__init__ = ddp_init, ds_init
    sys.argv = [script, *rest]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        with open(os.path.join(os.environ["LAB3_PROBE_DIR"], f"rank{rec['rank']}.json"), "w") as f:
            json.dump(rec, f)


def run_script(
    script: str | os.PathLike, nprocs: int = 2, *args: str, timeout: float = 240.0
) -> tuple[subprocess.CompletedProcess, list]:
    """Run ``script`` under torchrun with ``nprocs`` processes on the CPU (gloo) and return
    ``(completed_process, records)``: torchrun's output, and what each rank called (the probe)."""
    import json
    import sys

    from utils import parallel

    with tempfile.TemporaryDirectory() as probe_dir:
        env = dict(os.environ, LAB3_PROBE_DIR=probe_dir, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        del sys
        proc = parallel.torchrun(
            [
                "--nproc-per-node",
                nprocs,
                "--max-restarts",
                0,
                "-m",
                "utils.checks.ddp_script",
                "--probe",
                os.path.abspath(script),
                *args,
            ],
            timeout=timeout,
            env=env,
        )
        recs = []
        for r in range(nprocs):
            try:
                with open(os.path.join(probe_dir, f"rank{r}.json")) as f:
                    recs.append(json.load(f))
            except (OSError, ValueError):
                recs.append(None)
    return proc, recs


SCRIPT_EPOCHS, SCRIPT_BATCH = 2, 32
SCRIPT_SEED = 3  # not the script's default (0): a script that ignores --seed trains on other batches
SCRIPT_TIMEOUT = 240.0

# Errors a rank raises because ANOTHER rank died: never the first failure.
_PEER_ERRORS = (
    "Connection closed by peer",
    "remote worker crashing",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "SIGTERM",
)


def _first_failure(out: str) -> tuple[int, str] | None:
    """The rank that failed first and its Python traceback, from torchrun's output (each worker's
    stderr line starts with ``[rankN]:``): the first rank whose error is its own, not a lost
    connection to a rank that crashed."""
    import re

    lines: dict[int, list] = {}
    for line in out.splitlines():
        m = re.match(r"\[rank(\d+)\]:(.*)", line)
        if m:
            lines.setdefault(int(m.group(1)), []).append(m.group(2)[1:] if m.group(2).startswith(" ") else m.group(2))
    tracebacks = {}
    for r, ls in sorted(lines.items()):
        starts = [i for i, ln in enumerate(ls) if ln.startswith("Traceback (most recent call last)")]
        if starts:
            tb = ls[starts[0] :]
            # drop the probe's own frames (runpy, this module) above the script's first frame
            first = next(
                (
                    i
                    for i, ln in enumerate(tb)
                    if ln.startswith('  File "') and "<frozen runpy>" not in ln and "utils/checks" not in ln
                ),
                1,
            )
            tracebacks[r] = "\n".join(tb[:1] + tb[first:])
    if not tracebacks:
        return None
    own = {r: tb for r, tb in tracebacks.items() if not any(p in tb.strip().splitlines()[-1] for p in _PEER_ERRORS)}
    m = re.search(r"Root Cause.*?rank\s*:\s*(\d+)", out, re.S)
    root = int(m.group(1)) if m else None
    pick = own or tracebacks
    r = root if root in pick else min(pick)
    return r, pick[r]


def _hard_coded_rendezvous(src: str) -> str:
    """The literal address of an ``init_method="tcp://..."`` (or file://) in the script, or ''."""
    import re

    m = re.search(r"init_method\s*=\s*[fr]?([\"'])((?:tcp|file)://[^\"']*)\1", src)
    return m.group(2) if m else ""


def _script_failed(name, problem, hint, output="", heading="The last lines torchrun printed"):
    err = CheckFailed(
        f"{name}: {problem.rstrip('.')}. Try: {hint}" + (f"\n\n{heading}:\n{output[-3000:]}" if output else "")
    )
    err.output = output
    raise err from None


def check_ddp_script(path: str | os.PathLike) -> None:
    """Run the script at ``path`` under torchrun on 2 processes (gloo, CPU) with
    ``--epochs 2 --batch-size 32 --seed 3 --ckpt <tmp>``, ``--batch-size`` being the GLOBAL batch, and
    compare the weights rank 0 saved with one process of the serial script on the same global
    batches. Also reads the script, and records on each rank what it called."""
    import re
    import subprocess

    name = "ddp script"
    if not os.path.exists(path):
        _fail(name, f"there is no file {path}", "run the %%writefile cell above first")
    with open(path) as f:
        src = f.read()
    if "NotImplementedError" in src:
        _call(name, _raise_not_implemented)
    if re.search(r"^\s*(?:import|from)\s+utils\b|(?<![\w.])utils\s*\.", src, re.M):
        _fail(
            name,
            "your script uses the course's `utils`",
            "write it with torch.distributed and torch.nn.parallel only: it is the script you would take to a cluster",
        )
    fixed = _hard_coded_rendezvous(src)
    if fixed:
        _fail(
            name,
            f"your script joins the group at a fixed address (init_method={fixed!r}): under torchrun the "
            "ranks then wait for a rendezvous at an address nobody serves, and hang",
            "call init_process_group with the backend alone, no init_method, rank or world_size: torchrun's "
            "environment variables give all three",
        )
    with tempfile.TemporaryDirectory() as d:
        ckpt = os.path.join(d, "ckpt.pt")
        try:
            proc, recs = run_script(
                path,
                2,
                "--epochs",
                SCRIPT_EPOCHS,
                "--batch-size",
                SCRIPT_BATCH,
                "--seed",
                SCRIPT_SEED,
                "--ckpt",
                ckpt,
                timeout=SCRIPT_TIMEOUT,
            )
        except subprocess.TimeoutExpired:
            _fail(
                name,
                f"the script hung under torchrun (stopped after {SCRIPT_TIMEOUT:.0f} s). The likely causes: "
                "(1) the ranks never met, because the group was not joined from the environment (an "
                "init_method, MASTER_PORT, rank or world_size written in the script); (2) a collective "
                "that only some ranks reach, e.g. a barrier or an all-reduce inside `if rank == 0:`",
                "join with init_process_group given the backend alone; make every rank call every collective "
                "(dist.barrier, DDP's backward) the same number of times",
            )
        out = proc.stdout or ""
        finished = all(r is not None and r["destroy"] for r in recs)
        if proc.returncode != 0 and finished and "terminate called without an active exception" in out:
            pass  # every rank ran to its end and left the group; one then aborted at interpreter exit
        elif proc.returncode != 0:
            if "terminate called without an active exception" in out:
                _script_failed(
                    name,
                    "a process aborted while leaving the group: one rank tore the group down "
                    "while another was still working in it",
                    "at the end, let every rank meet the others at a barrier, then leave the group",
                    out,
                )
            if "device_ids" in out:
                _script_failed(
                    name,
                    "DistributedDataParallel got device_ids on a CPU model",
                    "pass device_ids=[local_rank] only when the model is on a GPU "
                    "(torch.cuda.is_available()); on the CPU leave it out",
                    out,
                )
            if "process group has not been initialized" in out or "init_process_group" in out:
                _script_failed(
                    name,
                    "a rank used torch.distributed before joining the process group",
                    "join the group first (init_process_group with the backend); torchrun's environment variables tell it the rest",
                    out,
                )
            first = _first_failure(out)
            if first:
                r, tb = first
                last = tb.strip().splitlines()[-1]
                _script_failed(
                    name,
                    f"rank {r} failed first, with {last}",
                    f"read rank {r}'s traceback below: the last line in your script is where it failed; "
                    f"run the script yourself: !python -m torch.distributed.run --nproc-per-node 2 {path}",
                    tb,
                    heading=f"Traceback from rank {r}",
                )
            _script_failed(
                name,
                f"the script failed under torchrun (exit status {proc.returncode})",
                "read the output below (each line starts with [rank]: ...); run the script "
                f"yourself: !python -m torch.distributed.run --nproc-per-node 2 {path}",
                out,
            )
        if any(r is None for r in recs):
            _script_failed(name, "a rank did not finish the script", "read the output below", out)
        if not all(r["init"] for r in recs):
            _fail(
                name,
                "the script never calls dist.init_process_group: the two processes trained alone",
                "join the group at the start: init_process_group with the backend, gloo on the CPU, nccl on GPUs",
            )
        if recs[1]["saves"]:
            _fail(
                name,
                f"rank 1 saved a checkpoint too ({recs[1]['saves']} torch.save calls): every rank wrote "
                "the same file at once",
                "save on rank 0 only: if dist.get_rank() == 0: torch.save(...)",
            )
        if not all(r["ddp"] for r in recs):
            _fail(
                name,
                "the model was never wrapped in DistributedDataParallel: the gradients are not "
                "averaged, and the ranks drift apart",
                "wrap it after moving it to its device: "
                "model = DistributedDataParallel(model, device_ids=... on GPUs only)",
            )
        if not os.path.exists(ckpt):
            _script_failed(
                name,
                "rank 0 wrote no checkpoint at --ckpt",
                "torch.save the checkpoint to args.ckpt on rank 0, as the serial script does",
                out,
            )
        ck = torch.load(ckpt, weights_only=True)
    state = ck.get("model", ck) if isinstance(ck, dict) else {}
    if any(k.startswith("module.") for k in state):
        _fail(
            name,
            "the saved weights' names start with 'module.': you saved the DDP wrapper",
            "save model.module.state_dict() (the model inside DDP), so the file loads in a serial model",
        )
    want = _simulate(SCRIPT_EPOCHS, SCRIPT_BATCH, 2, seed=SCRIPT_SEED)

    def same(a):
        return set(a) == set(state) and all(torch.allclose(state[k].float(), a[k], atol=1e-5) for k in a)

    if not set(state) or set(state) != set(want):
        _fail(
            name,
            f"the checkpoint's model has keys {sorted(state)[:4]}..., expected {sorted(want)}",
            "save {'model': model.module.state_dict(), 'epoch': epoch}, as the serial script does",
        )
    if not same(want):
        if (
            same(_simulate(SCRIPT_EPOCHS, SCRIPT_BATCH, 2, shard=False, seed=SCRIPT_SEED))
            or not all(r["sampler"] for r in recs)
            or not all(r["loaders"] and all(r["loaders"]) for r in recs)
        ):
            _fail(
                name,
                "each rank trained on ALL the data, not on its half: the DataLoader you iterate has no "
                "DistributedSampler",
                "give that DataLoader sampler=DistributedSampler(dataset, seed=args.seed), instead of its own shuffle",
            )
        if same(_simulate(SCRIPT_EPOCHS, SCRIPT_BATCH, 2, reshuffle=False, seed=SCRIPT_SEED)) or not all(
            r["set_epoch"] for r in recs
        ):
            _fail(
                name,
                "every epoch used the same order of examples: the sampler was never told the epoch",
                "call the sampler's set_epoch with the epoch number at the start of every epoch, on every rank",
            )
        if same(_simulate(SCRIPT_EPOCHS, SCRIPT_BATCH, 2)):  # the default seed, 0
            _fail(
                name,
                f"the check ran your script with --seed {SCRIPT_SEED}, but it shuffled as with seed 0: the "
                "sampler ignores --seed (DistributedSampler's default seed is 0)",
                "pass the script's seed to the sampler: DistributedSampler(..., seed=args.seed)",
            )
        if same(_simulate(SCRIPT_EPOCHS, SCRIPT_BATCH, 2, per_rank_batch=SCRIPT_BATCH, seed=SCRIPT_SEED)):
            _fail(
                name,
                f"each rank took --batch-size={SCRIPT_BATCH} examples per step, so the global batch was "
                f"{2 * SCRIPT_BATCH}",
                "--batch-size is the global batch: each rank takes batch_size // world_size",
            )
        _fail(
            name,
            "rank 0's final weights differ from one process on the same global batches",
            "compare your script with the serial one line by line: same data, model, seed, optimizer; "
            "DistributedSampler(dataset, seed=args.seed) with set_epoch; batch_size // world_size per rank",
        )
    if not re.search(r"\bset_device\s*\(", src):
        _fail(
            name,
            "the weights match, but the script never calls torch.cuda.set_device: on a GPU server "
            "every rank would use GPU 0",
            "when torch.cuda.is_available(), call "
            "pin the process to its GPU (set_device, with LOCAL_RANK from the environment) before init_process_group",
        )
    if not all(r["destroy"] for r in recs):
        _fail(
            name,
            "the weights match, but the script never calls dist.destroy_process_group",
            "call it at the end of main(), on every rank, so each process leaves the group cleanly",
        )
    _passed(name, "2 processes under torchrun match one process on the same global batches")


if __name__ == "__main__":
    import sys

    if len(sys.argv) > 2 and sys.argv[1] == "--probe":
        _probe(sys.argv[2:])
    else:
        print(_PROBE_DOC)
