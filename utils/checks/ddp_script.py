"""The exercise of lab 3's torchrun script (solutions/lab3_ddp.ipynb): your script FILE runs under
torchrun on the CPU (gloo), on 2 and on 3 processes with different command lines, and rank 0's
saved weights are compared with one process on the same global batches (a simulation of the
serial script). Each rank runs this module's probe as its entry point: it runs your script, without the course's
``utils`` on the path, and records what the rank did (the world it joined, the models DDP
wrapped, the examples its optimizer steps trained on, its checkpoint writes, whether it left the
group). A CPU run cannot see the GPU branch (``set_device``, NCCL): that is not checked here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import torch

from ._common import CheckFailed, message
from .engine import Case, Exercise, Mistake, check, difference, fail

__all__ = ["check_ddp_script", "SERIAL_SCRIPT", "run_script", "SCRIPT"]
LAB = "lab3_ddp"
SCRIPT_TIMEOUT = 240.0  # seconds one torchrun run may take before it counts as hung
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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
N_EXAMPLES = 512  # make_data's default


def _simulate(nproc=1, epochs=3, batch_size=32, lr=0.1, seed=0, *, reshuffle=True, per_rank_batch=None):
    """The serial script's training as ``nproc`` DDP ranks do it (the script's arguments): one
    shuffle per epoch (seeded ``seed + epoch``; epoch 0's every epoch unless ``reshuffle``), padded
    and dealt out as DistributedSampler does, ``per_rank_batch`` (default ``batch_size // nproc``)
    examples per rank and step, gradients averaged over the ranks. Returns the final state dict."""
    ns = {"__name__": "lab3_serial"}
    exec(compile(SERIAL_SCRIPT, "train_serial.py", "exec"), ns)
    data, model = ns["make_data"](), ns["make_model"]()
    x_all, y_all = data.tensors
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    world, b = nproc, per_rank_batch or batch_size // nproc
    for epoch in range(epochs):
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed + (epoch if reshuffle else 0)))
        order = torch.cat([order, order[: -len(order) % world]])
        shards = [order[r::world] for r in range(world)]
        for i in range(0, len(shards[0]), b):
            losses = [
                torch.nn.functional.cross_entropy(model(x_all[s[i : i + b]]), y_all[s[i : i + b]]) for s in shards
            ]
            opt.zero_grad()
            (sum(losses) / world).backward()
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _probe(argv):
    """One rank under torchrun: run the script ``argv[0]`` as __main__ and write what it did to
    ``$LAB3_PROBE_DIR/rank<r>.json``."""
    import runpy
    import traceback

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    rec = {"rank": int(os.environ["RANK"]), "world": 0, "ddp": 0, "examples": 0, "saves": 0, "left": False}
    rec["finished"], pending = False, [0]
    init, save, wrap, forward = dist.init_process_group, torch.save, DDP.__init__, DDP.forward

    def init_(*a, **k):
        init(*a, **k)
        rec["world"] = dist.get_world_size()

    def save_(*a, **k):
        rec["saves"] += 1
        return save(*a, **k)

    def wrap_(self, *a, **k):
        rec["ddp"] += 1
        wrap(self, *a, **k)

    def forward_(self, *a, **k):  # examples count when an optimizer step follows (not evaluation)
        pending[0] += len(a[0]) if torch.is_grad_enabled() and a and hasattr(a[0], "shape") else 0
        return forward(self, *a, **k)

    def stepped(*_):
        rec["examples"], pending[0] = rec["examples"] + pending[0], 0

    register_optimizer_step_pre_hook(stepped)
    dist.init_process_group, torch.save, DDP.__init__, DDP.forward = init_, save_, wrap_, forward_
    sys.argv = list(argv)  # the script runs as on a cluster: its own folder first, no course package
    sys.path[:] = [os.path.dirname(argv[0])] + [p for p in sys.path[1:] if p not in ("", _ROOT)]
    for name in [m for m in sys.modules if m == "utils" or m.startswith("utils.")]:
        del sys.modules[name]
    try:
        runpy.run_path(argv[0], run_name="__main__")
        rec["finished"], rec["left"] = True, not dist.is_initialized()
    except BaseException as e:  # the script's frames on: not runpy's, nor this probe's
        tb = traceback.extract_tb(e.__traceback__)
        mine = [i for i, f in enumerate(tb) if f.filename == argv[0]]
        rec["error"] = "".join(
            ["Traceback (most recent call last):\n", *traceback.format_list(tb[mine[0] if mine else 0 :])]
        )
        rec["error"] += "".join(traceback.format_exception_only(type(e), e)).strip()
        raise
    finally:
        with open(os.path.join(os.environ["LAB3_PROBE_DIR"], f"rank{rec['rank']}.json"), "w") as f:
            json.dump(rec, f)


def run_script(script, nprocs: int = 2, *args, timeout: float = SCRIPT_TIMEOUT):
    """Run ``script`` under torchrun with ``nprocs`` processes on the CPU (gloo); return
    ``(completed_process, records)``: torchrun's output, and what each rank did (None: no record)."""
    from utils import parallel

    with tempfile.TemporaryDirectory() as probe_dir:
        env = dict(os.environ, LAB3_PROBE_DIR=probe_dir, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = _ROOT + os.pathsep + env.get("PYTHONPATH", "")
        probe = "import sys; from utils.checks.ddp_script import _probe; _probe(sys.argv[1:])"
        cmd = ["--nproc-per-node", nprocs, "--max-restarts", 0, "--no-python", sys.executable, "-c", probe]
        proc = parallel.torchrun([*cmd, os.path.abspath(script), *args], timeout=timeout, env=env)
        recs = []
        for r in range(nprocs):
            try:
                with open(os.path.join(probe_dir, f"rank{r}.json")) as f:
                    recs.append(json.load(f))
            except (OSError, ValueError):
                recs.append(None)
    return proc, recs


# Errors a rank raises because ANOTHER rank died: never the first failure.
_PEER_ERRORS = ("Connection closed by peer", "remote worker crashing", "Connection reset by peer", "Broken pipe")


def _first_failure(recs: list, out: str) -> tuple[int, str] | None:
    """The rank that failed first and its traceback (from the probe's records): the root cause that
    torchrun names, else the lowest rank whose error is its own, not a lost peer."""
    import re

    errors = {r["rank"]: r["error"] for r in recs if r and r.get("error")}
    own = {k: tb for k, tb in errors.items() if not any(p in tb.splitlines()[-1] for p in _PEER_ERRORS)} or errors
    root = re.search(r"Root Cause.*?rank\s*:\s*(\d+)", out, re.S)
    r = int(root.group(1)) if root and int(root.group(1)) in own else min(own, default=None)
    return None if r is None else (r, own[r])


class Script:
    """A script as the exercise's answer. The engine takes callables, so this one, called with a
    case, runs the file (or ``text``, written to one) under torchrun and returns what rank 0 saved
    and what each rank did. Its module is ``__main__``, as the student's own code."""

    def __init__(self, path: str | os.PathLike = "", text: str = ""):
        self.path, self.text, self.__module__ = str(path), text, "__main__"

    def __call__(self, nproc: int, **args) -> dict:
        from utils import parallel

        with tempfile.TemporaryDirectory() as d:
            path, ckpt = self.path or os.path.join(d, "ddp_train.py"), os.path.join(d, "ckpt.pt")
            if self.text:
                with open(path, "w") as f:
                    f.write(self.text)
            argv = [s for k, v in args.items() for s in (f"--{k.replace('_', '-')}", v)] + ["--ckpt", ckpt]
            try:
                proc, recs = run_script(path, nproc, *argv, timeout=SCRIPT_TIMEOUT)
            except subprocess.TimeoutExpired:
                return {"hung": True, "failed": False, "first": None, "out": "", "recs": []}
            out, done = proc.stdout or "", all(r and r["finished"] and r["left"] for r in recs)
            got = {"hung": False, "out": out, "recs": recs, "path": path, "weights": None}
            got["failed"] = proc.returncode != 0 and not (done and parallel.GLOO_EXIT_ABORT in out)
            got["first"] = first = _first_failure(recs, out) if got["failed"] else None
            if first and first[1].splitlines()[-1].startswith("NotImplementedError"):
                raise NotImplementedError
            try:
                ck = torch.load(ckpt, weights_only=True)
                got["weights"] = ck.get("model", ck) if isinstance(ck, dict) else None
            except Exception:
                pass
        return got


def _variant(**edit) -> Script:
    """The serial script made data parallel, right unless ``edit`` changes one of its pieces: the
    named mistakes' variants, which the tests submit."""
    p = {
        "init": 'dist.init_process_group("gloo")',
        "wrap": "DDP",
        "sampler": "DistributedSampler(data, world, rank, seed=args.seed)",
        "feed": "sampler",
        "batch": "args.batch_size // world",
        "epoch": "sampler.set_epoch(epoch)",
        "saver": "rank == 0",
        "inner": "model.module",
        "leave": "dist.barrier(); dist.destroy_process_group()",
    } | edit
    text = SERIAL_SCRIPT
    for old, new in (
        ("from torch import nn\n", "from torch import nn\nimport torch.distributed as dist\n"),
        ("import argparse\n", "import argparse\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"),
        ("import argparse\n", "import argparse\nfrom torch.utils.data import DistributedSampler\n"),
        (
            "    data = make_data()\n",
            f"    {p['init']}\n    rank, world = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])\n",
        ),
        ("    model = make_model()\n", f"    data, model = make_data(), ({p['wrap']})(make_model())\n"),
        ("momentum=0.9)\n", f"momentum=0.9)\n    sampler = {p['sampler']}\n"),
        ("batch_size=args.batch_size,", f"batch_size={p['batch']},"),
        ("sampler=order.tolist())", f"sampler={p['feed']})\n        {p['epoch']}"),
        ('        torch.save({"model": model.', f'        if {p["saver"]}: torch.save({{"model": {p["inner"]}.'),
        ('accuracy {acc:.3f}")\n', f'accuracy {{acc:.3f}}")\n    {p["leave"]}\n'),
    ):
        text = text.replace(old, new, 1)
    return Script(text=text)


def _ran(o) -> list:
    """Each rank's record, when every rank ran the script to its end; else []."""
    g = o.got
    return g["recs"] if not (g["hung"] or g["failed"]) and all(g["recs"]) else []


def _crashed_with(text: str):
    return lambda o: o.got["failed"] and text in o.got["out"]


def _matches(**change):
    """Rank 0's weights are those of the simulation with ``change``: a recognisable wrong run."""
    return lambda o: difference(o.got["weights"], _simulate(**{**o.case.kwargs, **change}), 1e-4, 1e-5) is None


def _crashed(got: dict) -> None:
    """The failure of a run that crashed, with the traceback of the rank that failed first."""
    yours = f"!python -m torch.distributed.run --nproc-per-node 2 {got['path']}"
    first = got["first"]
    if first is None:
        problem, hint, shown = "the script failed under torchrun without a Python traceback", "read", got["out"][-3000:]
        text = message(SCRIPT.name, problem, f"{hint} the output below and run the script yourself: {yours}")
        raise CheckFailed(text + "\n\nThe last lines torchrun printed:\n" + shown)
    r, tb = first
    text = message(
        SCRIPT.name,
        f"rank {r} failed first, with {tb.splitlines()[-1]}",
        f"read rank {r}'s traceback below, whose last line in your script is where it failed, and run the "
        f"script yourself: {yours}",
    )
    raise CheckFailed(f"{text}\n\nTraceback from rank {r}:\n{tb}")


def _compare(got: dict, want: dict) -> str | None:
    if got["failed"]:
        _crashed(got)
    if set(got["weights"] or ()) != set(want["weights"]):
        return "saved a checkpoint whose weights are named differently from the serial model's"
    if difference(got["weights"], want["weights"], 1e-4, 1e-5):
        return "saved weights on rank 0 that differ from one process's on the same global batches"
    return None


def _one_process(**case) -> dict:
    return {"weights": _simulate(**case)}


def _cases() -> list:
    """2 and 3 processes, each with its own command line: a script that ignores it fails one."""
    cases = [
        dict(nproc=2, epochs=2, batch_size=32, lr=0.1, seed=3),
        dict(nproc=3, epochs=3, batch_size=48, lr=0.05, seed=5),
    ]
    return [
        Case(
            kwargs=k,
            label=f"{k['nproc']} processes with "
            + " ".join(f"--{a.replace('_', '-')} {v}" for a, v in list(k.items())[1:]),
        )
        for k in cases
    ]


def _m(problem: str, hint: str, variant: Script, when, mechanism: bool = True) -> Mistake:
    return Mistake(problem, hint, variant=variant, when=when, replay=False, mechanism=mechanism)


HARD_CODED = 'dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29511", rank=rank, world_size=world)'
SCRIPT = Exercise(
    name="ddp_script",
    cases=_cases,
    oracle=_one_process,
    compare=_compare,
    timeout_s=SCRIPT_TIMEOUT + 120,
    hint="compare your script with the serial one line by line: the same data, model, seed and optimizer, a "
    "DistributedSampler with the script's seed told every epoch, and batch_size // world_size examples per rank",
    passed="rank 0's weights match one process on the same global batches, on 2 and on 3 CPU processes",
    mistakes=[
        _m(
            "your script imports the course's utils package, which a job on a cluster does not have",
            "write it with torch.distributed and torch.nn.parallel only",
            _variant(init='import utils.ddp_train; dist.init_process_group("gloo")'),
            _crashed_with("No module named 'utils'"),
        ),
        _m(
            "DistributedDataParallel got device_ids for a model on the CPU",
            "pass device_ids only when the model is on a GPU, and leave it out on the CPU",
            _variant(wrap="lambda m: DDP(m, device_ids=[rank])"),
            _crashed_with("device_ids"),
        ),
        _m(
            "a rank used torch.distributed before joining the process group",
            "join the group first, calling init_process_group with the backend alone: torchrun's environment "
            "variables tell it the rest",
            _variant(init="pass"),
            _crashed_with("has not been initialized"),
        ),
        _m(
            "the script hung under torchrun: either the ranks never met, because the group was not joined from "
            "the environment (an address, port, rank or world size written in the script), or some ranks wait in "
            "a collective that the others never reach",
            "join with init_process_group given the backend alone, and make every rank call every collective "
            "(a barrier, the backward of DDP) the same number of times",
            _variant(init=f"rank, world = int(os.environ['RANK']), int(os.environ['WORLD_SIZE']); {HARD_CODED}"),
            lambda o: o.got["hung"],
        ),
        _m(
            "the script never joins the process group, so every process trained alone",
            "call init_process_group with the backend (gloo on the CPU, nccl on GPUs) at the start of main",
            _variant(init="pass", wrap="lambda m: m", inner="model", leave="pass"),
            lambda o: _ran(o) and all(r["world"] == 0 for r in _ran(o)),
        ),
        _m(
            "the model is never wrapped in DistributedDataParallel, so the gradients are not averaged and the "
            "ranks drift apart",
            "wrap the model in DistributedDataParallel once it is on its device",
            _variant(wrap="lambda m: m", inner="model"),
            lambda o: any(r["ddp"] == 0 for r in _ran(o)),
        ),
        _m(
            "every rank trained on the whole dataset every epoch: the loader it iterates deals out no shards, so "
            "the processes repeat each other's work instead of sharing it",
            "give that DataLoader a DistributedSampler with the script's seed in place of its own order, and "
            "batch_size // world_size examples per rank",
            _variant(feed="order.tolist()", batch="args.batch_size"),
            lambda o: any(r["examples"] >= N_EXAMPLES * o.case.kwargs["epochs"] for r in _ran(o)),
        ),
        _m(
            "a rank other than 0 saved a checkpoint too, so several processes wrote the same file at once",
            "save on rank 0 only",
            _variant(saver="True"),
            lambda o: any(r["saves"] for r in _ran(o)[1:]),
        ),
        _m(
            "rank 0 wrote no checkpoint at the path that --ckpt gives",
            "save the checkpoint to args.ckpt on rank 0, as the serial script does",
            _variant(saver="False"),
            lambda o: _ran(o) and o.got["weights"] is None,
        ),
        _m(
            "the saved weights' names start with 'module.', so you saved the DDP wrapper",
            "save the state dict of the model inside DDP (its module attribute), so that the file loads into the "
            "serial model",
            _variant(inner="model"),
            lambda o: _ran(o) and any(k.startswith("module.") for k in o.got["weights"]),
        ),
        _m(
            "the script never leaves the process group",
            "call destroy_process_group at the end of main, on every rank, after a barrier",
            _variant(leave="dist.barrier()"),
            lambda o: any(r["world"] and not r["left"] for r in _ran(o)),
        ),
        _m(
            "every epoch used the same order of examples, because the sampler was never told the epoch",
            "call the sampler's set_epoch with the epoch number at the start of every epoch, on every rank",
            _variant(epoch="pass"),
            _matches(reshuffle=False),
            mechanism=False,
        ),
        _m(
            "the shuffle ignores --seed: it is that of seed 0, the default of DistributedSampler",
            "pass the script's seed to the DistributedSampler",
            _variant(sampler="DistributedSampler(data, world, rank)"),
            _matches(seed=0),
            mechanism=False,
        ),
        _m(
            "each rank took --batch-size examples per step, so the global batch grew with the number of processes",
            "--batch-size is the global batch: give each rank batch_size // world_size examples per step",
            _variant(batch="args.batch_size"),
            lambda o: _matches(per_rank_batch=o.case.kwargs["batch_size"])(o),
            mechanism=False,
        ),
    ],
)


def check_ddp_script(path: str | os.PathLike) -> None:
    """Run the script at ``path`` under torchrun (gloo, CPU) on 2 and on 3 processes, each with its own
    ``--epochs --batch-size --lr --seed --ckpt`` (``--batch-size`` being the GLOBAL batch), and
    compare the weights rank 0 saved with one process on the same global batches."""
    if not os.path.exists(path):
        fail(SCRIPT.name, f"there is no file {path}", "run the %%writefile cell above first")
    check(SCRIPT, Script(path))
