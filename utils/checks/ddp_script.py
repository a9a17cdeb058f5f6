"""Lab 3's torchrun script exercise (solutions/lab3_ddp.ipynb): the answer is a script FILE, run under torchrun on the
CPU (gloo) on 2 and 3 processes with different command lines, each rank from :func:`_probe`, which records what it
did; rank 0's saved weights are compared with one process on the same global batches. The GPU branch is not run."""

from __future__ import annotations

import contextlib
import importlib.abc
import json
import os
import subprocess
import sys
import tempfile

import torch

from ..rank_failures import is_peer_error
from ._common import CheckFailed, message
from .engine import Case, Exercise, check, difference, fail, mistake

__all__ = ["check_ddp_script", "SERIAL_SCRIPT", "SCRIPT"]
LAB = "lab3_ddp"
SCRIPT_TIMEOUT = 240.0  # seconds one torchrun run may take before it counts as hung
_PROBE = ["--no-python", sys.executable, "-c", "import sys, utils.checks.ddp_script as s; s._probe(*sys.argv[1:])"]
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the course's root

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


def _simulate(nproc=1, epochs=3, batch_size=32, lr=0.1, seed=0, *, reshuffle=True, divide=True):
    """The serial script's training as ``nproc`` DDP ranks do it (DistributedSampler's shards, ``batch_size //
    nproc`` examples per rank and step, gradients averaged), or with one named mistake. Returns the state dict."""
    ns = {"__name__": "lab3_serial"}
    exec(compile(SERIAL_SCRIPT, "train_serial.py", "exec"), ns)
    (x, y), model = ns["make_data"]().tensors, ns["make_model"]()
    opt, b = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9), batch_size // (nproc if divide else 1)
    for epoch in range(epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed + (epoch if reshuffle else 0)))
        shards = [torch.cat([order, order[: -len(x) % nproc]])[r::nproc] for r in range(nproc)]
        for i in range(0, len(shards[0]), b):
            opt.zero_grad()
            losses = [torch.nn.functional.cross_entropy(model(x[s[i : i + b]]), y[s[i : i + b]]) for s in shards]
            (sum(losses) / nproc).backward()
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class _NoCourse(importlib.abc.MetaPathFinder):
    """In a rank: the course's package cannot be imported (as on a cluster); a utils of the script's own can."""

    def find_spec(self, name, path=None, target=None):
        if name != "utils":
            return None
        spec = next(filter(None, (f.find_spec(name, path, target) for f in sys.meta_path[1:])), None)
        if spec and spec.origin == os.path.join(_ROOT, "utils", "__init__.py"):
            raise ModuleNotFoundError("No module named 'utils'", name=name)
        return spec


def _probe(script: str, *args: str) -> None:
    """One rank under torchrun: run ``script`` as __main__ (its folder first on the path, the course's package not
    importable, as on a cluster) and write what the rank did to ``$LAB3_PROBE_DIR/rank<r>.json``."""
    import runpy
    import traceback

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    rec = dict(rank=int(os.environ["RANK"]), init=0, ddp=0, saves=0, pending=0, examples=0, left=False, error="")

    def counted(fn, key, n=lambda *a, **k: 1):
        return lambda *a, **k: rec.update({key: rec[key] + n(*a, **k)}) or fn(*a, **k)

    def batch(self, x=None, *a, **k):  # examples through DDP that an optimizer step then trains on
        return len(x) if torch.is_grad_enabled() and hasattr(x, "shape") else 0

    # Every DDP wrapper stays alive to the end, which comes by os._exit once the record is written: freeing the
    # wrapper or gloo's group at interpreter exit can deadlock a rank in torch 2.13, after the script's work.
    kept, init = [], DDP.__init__
    dist.init_process_group, torch.save = counted(dist.init_process_group, "init"), counted(torch.save, "saves")
    DDP.__init__ = counted(lambda self, *a, **k: kept.append(self) or init(self, *a, **k), "ddp")
    DDP.forward = counted(DDP.forward, "pending", batch)
    register_optimizer_step_pre_hook(lambda *_: rec.update(examples=rec["examples"] + rec["pending"], pending=0))
    sys.argv, sys.path[0] = [script, *args], os.path.dirname(script)
    sys.meta_path.insert(0, _NoCourse())
    for name in [m for m in sys.modules if m.split(".")[0] == "utils"]:
        del sys.modules[name]
    try:
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:  # sys.exit(main()) with main returning None: the script's normal end
            if e.code not in (None, 0):
                raise
        rec["left"] = not dist.is_initialized()
    except BaseException:
        tb = traceback.format_exc()
        mine = tb.find(f'  File "{script}"')  # from the script's first frame: not runpy's, nor this probe's
        rec["error"] = tb if mine < 0 else "Traceback (most recent call last):\n" + tb[mine:].rstrip()
        raise
    finally:
        with open(os.path.join(os.environ["LAB3_PROBE_DIR"], f"rank{rec['rank']}.json"), "w") as f:
            json.dump(rec, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the script ran to its end; no teardown (see ``kept``)


def _read(path: str, load=json.load):
    with contextlib.suppress(Exception), open(path, "rb") as f:  # None: no file, or a torn one
        return load(f)


class Script:
    """A script as the exercise's answer: called with a case, it runs the file (or ``text``, written to one)
    under torchrun and returns rank 0's checkpoint and each rank's record. Its module is ``__main__``."""

    def __init__(self, path: str | os.PathLike = "", text: str = ""):
        self.path, self.text, self.__module__ = str(path), text, "__main__"

    def __call__(self, nproc: int, **args) -> dict:
        from utils import parallel

        with tempfile.TemporaryDirectory() as d:
            path, ckpt = os.path.abspath(self.path or os.path.join(d, "ddp_train.py")), os.path.join(d, "ckpt.pt")
            if self.text:
                with open(path, "w") as f:
                    f.write(self.text)
            env = dict(os.environ, LAB3_PROBE_DIR=d, CUDA_VISIBLE_DEVICES="", PYTHONPATH=_ROOT)
            argv = [s for k, v in args.items() for s in (f"--{k.replace('_', '-')}", v)] + ["--ckpt", ckpt]
            argv = ["--nproc-per-node", nproc, *_PROBE, path, *argv]
            got = dict(run=f"!python -m torch.distributed.run --nproc-per-node 2 {path}", hung=False, failed=False)
            records = lambda: [_read(os.path.join(d, f"rank{r}.json")) for r in range(nproc)]
            try:
                proc = parallel.torchrun(argv, timeout=SCRIPT_TIMEOUT, env=env)
            except subprocess.TimeoutExpired:  # the records the ranks wrote say how far each got
                return got | {"hung": True, "recs": records()}
            got.update(out=proc.stdout or "", recs=records(), failed=proc.returncode != 0)
            # the first failure is the lowest rank whose error is its own, not a lost connection to a rank that crashed
            errors = {r["rank"]: r["error"] for r in got["recs"] if r and r["error"]} if got["failed"] else {}
            own = {k: tb for k, tb in errors.items() if not is_peer_error(tb.splitlines()[-1])}
            got["first"] = min((own or errors).items(), default=None)
            if got["first"] and got["first"][1].splitlines()[-1].startswith("NotImplementedError"):
                raise NotImplementedError
            ck = _read(ckpt, torch.load)
        return got | {"weights": ck.get("model", ck) if isinstance(ck, dict) else None}


def _compare(got: dict, want: dict) -> str | None:
    """How rank 0's weights differ from the oracle's; a run that crashed fails here, with the
    traceback of the rank that failed first (no named mistake matched it)."""
    if got["failed"]:
        r, tb = got["first"] or ("", got["out"][-3000:])
        who, shown = (f"rank {r} failed first", f"Traceback from rank {r}") if r != "" else ("a rank failed", "Output")
        hint = (
            "read the traceback below (its last line in your script is where it failed), then run the script yourself: "
            f"{got['run']}"
        )
        text = message(SCRIPT.name, f"{who}, with {tb.strip().splitlines()[-1]}", hint)
        raise CheckFailed(f"{text}\n\n{shown}:\n{tb}")
    if set(got["weights"] or ()) != set(want["weights"]):
        return "saved a checkpoint whose weights are named differently from the serial model's"
    if difference(got["weights"], want["weights"], 1e-4, 1e-5):
        return "saved weights on rank 0 that differ from one process's on the same global batches"
    return None


def _cases() -> list:
    """2 and 3 processes, each with its own command line: a script that ignores it fails one."""
    cases = [dict(epochs=2, batch_size=32, lr=0.1, seed=3), dict(epochs=3, batch_size=48, lr=0.05, seed=5)]
    flags = [" ".join(f"--{k.replace('_', '-')} {v}" for k, v in c.items()) for c in cases]
    return [Case(kwargs=dict(nproc=n, **c), label=f"{n} processes with {f}") for n, c, f in zip((2, 3), cases, flags)]


def _variant(**edit) -> Script:
    """The serial script made data parallel, right unless ``edit`` changes one of its pieces: the
    named mistakes' variants, which the tests submit."""
    p = dict(init='dist.init_process_group("gloo")', wrap="DDP", feed="sampler", batch="args.batch_size // world")
    p |= dict(sampler="DistributedSampler(data, world, rank, seed=args.seed)", epoch="sampler.set_epoch(epoch)")
    p |= dict(saver="rank == 0", inner="model.module", leave="dist.barrier(); dist.destroy_process_group()") | edit
    text = SERIAL_SCRIPT
    for old, new in (
        (
            "import argparse\n",
            "import argparse\nimport torch.distributed as dist\nfrom torch.nn.parallel import DistributedDataParallel "
            "as DDP\nfrom torch.utils.data import DistributedSampler\n",
        ),
        (
            "    data = make_data()\n",
            f"    {p['init']}\n    rank, world = map(int, (os.environ['RANK'], os.environ['WORLD_SIZE']))\n",
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


# How a run shows a mistake: each rank's record when every rank ran the script to its end (else []), a crash whose
# output holds ``text``, rank 0's weights equal to those of the simulation with ``change``.
_ran = lambda o: o.got["recs"] if not (o.got["hung"] or o.got["failed"]) and all(o.got["recs"]) else []
_crashed_with = lambda text: lambda o: o.got["failed"] and text in o.got["out"]
_matches = lambda **change: (
    lambda o: difference(o.got["weights"], _simulate(**o.case.kwargs | change), 1e-4, 1e-5) is None
)
# under torchrun nobody serves that address: the ranks wait
_HANG = (
    'dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29511", rank=int(os.environ["RANK"]), '
    'world_size=int(os.environ["WORLD_SIZE"]))'
)
# A row per mistake: "problem. Try: hint", the variant's edit of the right script and how the run shows it. That of
# _MISTAKES is looked for on every case (a run can be right for a wrong reason); that of _WEIGHT_MISTAKES, only on a
# case whose weights differ from the oracle's.
_MISTAKES = [
    (
        "your script imports the course's utils package, which a job on a cluster does not have. Try: write it with "
        "torch.distributed and torch.nn.parallel only",
        {"init": "import utils.ddp_train"},
        _crashed_with("No module named 'utils'"),
    ),
    (
        "DistributedDataParallel got device_ids for a model on the CPU. Try: pass device_ids only when the model is on "
        "a GPU",
        {"wrap": "lambda m: DDP(m, device_ids=[rank])"},
        _crashed_with("device_ids"),
    ),
    (
        "the script does not join the process group (init_process_group) before it uses torch.distributed or trains. "
        "Try: call init_process_group with the backend alone at the start of main: torchrun's environment gives the "
        "rest",
        {"init": "pass"},
        lambda o: _crashed_with("has not been initialized")(o) or (_ran(o) and not any(r["init"] for r in _ran(o))),
    ),
    (
        "the script hung under torchrun: the ranks never met (an address, port, rank or world size written in the "
        "script), or some wait in a collective the others never reach. Try: join with init_process_group given the "
        "backend alone, and make every rank call every collective",
        {"init": _HANG},
        lambda o: o.got["hung"],
    ),
    (
        "the model is never wrapped in DistributedDataParallel, which this script is to train with. Try: wrap the "
        "model in DistributedDataParallel once it is on its device",
        {"wrap": "lambda m: m", "inner": "model"},
        lambda o: any(not r["ddp"] for r in _ran(o)),
    ),
    (
        "every rank trained on the whole dataset every epoch, repeating the others' work. Try: give the DataLoader a "
        "DistributedSampler with the script's seed, and batch_size // world_size examples per rank",
        {"feed": "order.tolist()", "batch": "args.batch_size"},
        lambda o: any(r["examples"] >= 512 * o.case.kwargs["epochs"] for r in _ran(o)),
    ),
    (
        "a rank other than 0 saved a checkpoint too, so several processes wrote the same file. Try: save on rank 0 only",
        {"saver": "True"},
        lambda o: any(r["saves"] for r in _ran(o)[1:]),
    ),
    (
        "rank 0 wrote no checkpoint at the path that --ckpt gives. Try: save the checkpoint to args.ckpt on rank 0, as "
        "the serial script does",
        {"saver": "False"},
        lambda o: _ran(o) and o.got["weights"] is None,
    ),
    (
        "the saved weights' names start with 'module.', so you saved the DDP wrapper. Try: save the state dict of the "
        "model inside DDP (its module attribute)",
        {"inner": "model"},
        lambda o: _ran(o) and any(k.startswith("module.") for k in o.got["weights"]),
    ),
    (
        "the script never leaves the process group. Try: call destroy_process_group at the end of main, on every rank, "
        "after a barrier",
        {"leave": "dist.barrier()"},
        lambda o: any(r["init"] and not r["left"] for r in _ran(o)),
    ),
]
_WEIGHT_MISTAKES = [
    (
        "every epoch used the same order of examples: the sampler was never told the epoch. Try: call the sampler's "
        "set_epoch with the epoch number at the start of every epoch",
        {"epoch": "pass"},
        _matches(reshuffle=False),
    ),
    (
        "the shuffle ignores --seed: it is that of seed 0, DistributedSampler's default. Try: pass the script's seed "
        "to the DistributedSampler",
        {"sampler": "DistributedSampler(data, world, rank)"},
        _matches(seed=0),
    ),
    (
        "each rank took --batch-size examples per step, so the global batch grew with the processes. Try: --batch-size "
        "is the global batch: give each rank batch_size // world_size",
        {"batch": "args.batch_size"},
        _matches(divide=False),
    ),
]
SCRIPT = Exercise(
    name="ddp_script",
    cases=_cases,
    oracle=lambda **case: {"weights": _simulate(**case)},
    compare=_compare,
    timeout_s=SCRIPT_TIMEOUT + 120,
    hint="compare your script with the serial one line by line: the same data, model, seed and optimizer, a "
    "DistributedSampler with the script's seed told every epoch, and batch_size // world_size examples per rank",
    passed="rank 0's weights match one process on the same global batches, on 2 and on 3 CPU processes",
    mistakes=[mistake(t, _variant(**edit), when, mechanism=True) for t, edit, when in _MISTAKES]
    + [mistake(t, _variant(**edit), when) for t, edit, when in _WEIGHT_MISTAKES],
)


def check_ddp_script(path: str | os.PathLike) -> None:
    """Run the script at ``path`` under torchrun (gloo, CPU) on 2 and on 3 processes, each with its own
    ``--epochs --batch-size --lr --seed --ckpt`` (``--batch-size`` being the GLOBAL batch), and
    compare the weights rank 0 saved with one process on the same global batches."""
    if not os.path.exists(path):
        fail(SCRIPT.name, f"there is no file {path}", "run the %%writefile cell above first")
    check(SCRIPT, Script(path))
