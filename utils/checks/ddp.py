"""Self-checks for stage 3: data parallelism (solutions/lab3_ddp.ipynb).

The ring all-reduce and gradient averaging must run on real processes, but a function defined
in a notebook cannot be imported by a spawned process. So these checks send the *source* of
your function to the processes, which define it again (with ``torch``, ``dist`` =
``torch.distributed``, ``nn``, ``F``, ``math``, ``os`` in scope; nothing of ``utils.parallel``,
which the exercises build) and call it. Keep your function self-contained: use only those names.

The processes run on the backend the launcher picks (NCCL with a GPU per process), so every
tensor is built on the rank's device (NCCL takes GPU tensors only), with TF32 off.
"""
from __future__ import annotations

import inspect
import math
import os
import tempfile
import textwrap
from unittest import mock

import torch
from torch import nn

from ._common import CheckFailed, _call, _close, _fail, _passed  # noqa: F401

__all__ = ["check_ring_all_reduce", "check_average_gradients", "check_shard_batches", "check_save_on_rank0"]


# ---------------------------------------------------------------------------- shipping source

def _source(name, fn) -> str:
    if not callable(fn):
        _fail(name, f"expected a function, got {type(fn).__name__}", "pass the function itself, without calling it")
    try:
        src = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        _fail(name, "could not read your function's source", "define it with `def` in a notebook cell and run that cell")
    if "NotImplementedError" in src:
        _call(name, _raise_not_implemented)
    return src


def _raise_not_implemented():
    raise NotImplementedError


def _define(source: str, fn_name: str):
    """In a spawned process: define the student's function again, with the lab's names in scope."""
    import torch.nn.functional as F
    import torch.distributed as dist
    scope = {"torch": torch, "dist": dist, "nn": nn, "F": F, "math": math, "os": os}
    exec(compile(source, "<your exercise cell>", "exec"), scope)
    return scope[fn_name]


def _launch(name, worker, nprocs, *args):
    from utils import parallel
    try:
        return parallel.launch(worker, nprocs, *args, timeout=90, stream=False)
    except parallel.LaunchTimeout:
        _fail(name, "your function hung (the processes waited for each other until the timeout)",
              "every send needs a matching receive on the neighbour: post each step's send and receive "
              "together, ops = [dist.P2POp(dist.isend, chunk, right), dist.P2POp(dist.irecv, buf, left)], "
              "then wait() on every request of dist.batch_isend_irecv(ops); and make every rank run the "
              "same number of steps")
    except parallel.LaunchError as e:
        text = str(e)
        if "Timed out" in text:
            _fail(name, "your function hung: a rank waited for a message that never came",
                  "check that rank r sends to (r + 1) % N and receives from (r - 1) % N, the same number of times")
        first = text.split("\n")[0]
        tb = e.remote_traceback.strip().splitlines()
        where = next((line.strip() for line in reversed(tb) if "<your exercise cell>" in line), "")
        raise CheckFailed(f"{name}: your code raised on {first.split(' raised ')[0]}: "
                          f"{first.split(' raised ', 1)[-1].split('. The other ranks')[0]}"
                          f"{'  (' + where + ')' if where else ''}\n  Hint: run it again after reading the "
                          f"message; the traceback from that rank is in the exception's remote_traceback") from None


# ---------------------------------------------------------------------------- ring all-reduce

RING_SIZES = (12, 7, 2)       # divisible by 3 ranks, not divisible, fewer elements than ranks


def _ring_worker(source, fn_name):
    from utils import parallel
    ctx = parallel.setup(timeout=20)
    fn = _define(source, fn_name)
    out = []
    for n in RING_SIZES:
        x = (torch.arange(n, dtype=torch.float32) + 100.0 * (ctx.rank + 1)).to(ctx.device)   # NCCL: GPU tensors
        ret = fn(x)
        out.append({"inplace": x, "returned": ret if isinstance(ret, torch.Tensor) else None})
    return out


def _ring_expected(n, world):
    return sum(torch.arange(n, dtype=torch.float32) + 100.0 * (r + 1) for r in range(world))


def check_ring_all_reduce(ring_all_reduce, world_size: int = 3) -> None:
    """``ring_all_reduce(tensor)``: sum ``tensor`` over all ranks in place (like
    ``dist.all_reduce``), with N-1 reduce-scatter and N-1 all-gather steps, each one send and
    one receive posted together with ``dist.batch_isend_irecv`` (the form that works on NCCL too).
    Run on 3 real processes, for tensors of 12, 7 and 2 elements."""
    name = "ring_all_reduce"
    src = _source(name, ring_all_reduce)
    res = _launch(name, _ring_worker, world_size, src, ring_all_reduce.__name__)
    for n, per_size in zip(RING_SIZES, zip(*res)):
        want = _ring_expected(n, world_size)
        got = [r["inplace"] for r in per_size]
        if all(torch.equal(g, want) for g in got):
            continue
        rets = [r["returned"] for r in per_size]
        if all(r is not None and r.shape == want.shape and torch.allclose(r, want) for r in rets):
            _fail(name, f"the returned tensor is right but the tensor passed in was not changed ({n} elements)",
                  "work in place, like dist.all_reduce: cut the tensor into views with tensor.chunk / "
                  "tensor_split and add into them (chunk += received), then return the tensor")
        own = [torch.arange(n, dtype=torch.float32) + 100.0 * (r + 1) for r in range(world_size)]
        if all(torch.equal(g, o) for g, o in zip(got, own)):
            _fail(name, "every rank still holds its own tensor: nothing was added",
                  "in reduce-scatter, add the received chunk into your own: chunks[i] += buffer")
        chunks_ok = [[torch.equal(gc, wc) for gc, wc in zip(g.tensor_split(world_size), want.tensor_split(world_size))]
                     for g in got]
        if n >= world_size and all(sum(ok) == 1 for ok in chunks_ok):
            _fail(name, f"each rank has exactly one fully summed chunk ({n} elements): the reduce-scatter "
                  "works but the all-gather is missing or wrong",
                  "after N-1 reduce-scatter steps, run N-1 more steps that pass the finished chunks on "
                  "(copy the received chunk into place instead of adding it)")
        if any(torch.allclose(g, want * 2) or torch.allclose(g, want + own[i]) for i, g in enumerate(got)):
            _fail(name, f"some values were added twice ({n} elements)",
                  "in the all-gather phase copy the received chunk (chunk.copy_(buffer)); only "
                  "reduce-scatter adds")
        _fail(name, f"wrong sum for a tensor of {n} elements on {world_size} ranks: rank 0 got "
              f"{got[0].tolist()}, expected {want.tolist()}",
              "at step s, rank r sends chunk (r - s) % N to the right and receives chunk (r - s - 1) % N "
              "from the left; use tensor_split(N) so sizes that do not divide by N work too")
    _passed(name, f"{world_size} processes, {len(RING_SIZES)} tensor sizes, equal to all_reduce")


# ---------------------------------------------------------------------------- gradient averaging

def _grad_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))


def _grad_data(world):
    g = torch.Generator().manual_seed(1)
    return torch.randn(4 * world, 5, generator=g), torch.randint(0, 3, (4 * world,), generator=g)


def _local_grads(x, y):
    model = _grad_model()
    nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def _avg_worker(source, fn_name):
    from utils import parallel
    parallel.exact_fp32()                  # compared with one CPU process to 1e-6: no TF32 on the GPU
    ctx = parallel.setup(timeout=20)
    fn = _define(source, fn_name)
    x, y = _grad_data(ctx.world_size)
    x, y = x.to(ctx.device), y.to(ctx.device)              # NCCL all-reduces GPU tensors only
    model = _grad_model().to(ctx.device)
    nn.functional.cross_entropy(model(x[ctx.rank::ctx.world_size]), y[ctx.rank::ctx.world_size]).backward()
    fn(model)
    return [p.grad.clone() if p.grad is not None else None for p in model.parameters()]


def check_average_gradients(average_gradients, world_size: int = 2) -> None:
    """``average_gradients(model)``: after ``backward()``, replace every parameter's gradient by
    its mean over all ranks (all-reduce, then divide by the world size). Run on 2 processes,
    compared with one process on the whole batch."""
    name = "average_gradients"
    src = _source(name, average_gradients)
    res = _launch(name, _avg_worker, world_size, src, average_gradients.__name__)
    x, y = _grad_data(world_size)
    want = _local_grads(x, y)                           # the mean over the whole batch
    local = [_local_grads(x[r::world_size], y[r::world_size]) for r in range(world_size)]
    for r, grads in enumerate(res):
        if any(g is None for g in grads):
            _fail(name, f"a gradient is None on rank {r}", "average p.grad in place; do not set it to None")
        if all(torch.allclose(g, w, atol=1e-6) for g, w in zip(grads, want)):
            continue
        if all(torch.allclose(g, world_size * w, atol=1e-6) for g, w in zip(grads, want)):
            _fail(name, f"the gradients are {world_size}x too large: they were summed, not averaged",
                  "after dist.all_reduce(p.grad) divide by the world size: p.grad /= dist.get_world_size()")
        if all(torch.allclose(g, l, atol=1e-6) for g, l in zip(grads, local[r])):
            _fail(name, f"rank {r} still has its own local gradient: nothing was exchanged",
                  "call dist.all_reduce(p.grad) for every parameter, on every rank")
        if all(torch.allclose(g, l / world_size, atol=1e-6) for g, l in zip(grads, local[r])):
            _fail(name, "each gradient was divided by the world size but not all-reduced",
                  "all-reduce first (dist.all_reduce(p.grad)), then divide")
        _fail(name, f"the gradients on rank {r} do not match one process on the whole batch",
              "for every parameter p: dist.all_reduce(p.grad); p.grad /= world size; in place, on every rank")
    _passed(name, f"{world_size} processes match one process on the concatenated batch")


# ---------------------------------------------------------------------------- sharding

def _as_lists(batches):
    return [[int(i) for i in (b.tolist() if isinstance(b, torch.Tensor) else b)] for b in batches]


def check_shard_batches(shard_batches) -> None:
    """``shard_batches(n, batch_size, rank, world_size, epoch, seed)``: the list of batches (lists
    of example indices) that ``rank`` trains on in ``epoch``, as a ``DistributedSampler`` with
    ``set_epoch(epoch)`` gives them."""
    name = "shard_batches"
    n, bs, world = 20, 4, 2
    per = {(r, e): _as_lists(_call(name, shard_batches, n, bs, r, world, e, 0)) for r in range(world) for e in (0, 1)}
    flat = {k: [i for b in v for i in b] for k, v in per.items()}
    if any(len(b) > bs for v in per.values() for b in v):
        _fail(name, f"a batch has more than batch_size={bs} indices", "cut each rank's indices into batches of batch_size")
    if len(flat[(0, 0)]) == n:
        _fail(name, f"rank 0 got all {n} examples: the data is not sharded",
              "pass num_replicas=world_size and rank=rank to DistributedSampler")
    if flat[(0, 0)] == flat[(1, 0)]:
        _fail(name, "ranks 0 and 1 got the same indices", "pass rank=rank to DistributedSampler, so each "
              "rank takes its own share")
    if set(flat[(0, 0)]) & set(flat[(1, 0)]):
        _fail(name, "ranks 0 and 1 share examples in the same epoch",
              "every rank must use the SAME seed: the sampler shuffles once and deals the indices out by rank")
    if set(flat[(0, 0)]) | set(flat[(1, 0)]) != set(range(n)):
        _fail(name, "together the ranks do not cover the dataset", "each rank takes every world_size-th index")
    if flat[(0, 0)] == flat[(0, 1)]:
        _fail(name, "epoch 0 and epoch 1 have the same order: the data is never reshuffled",
              "call sampler.set_epoch(epoch) before iterating it")
    again = _as_lists(_call(name, shard_batches, n, bs, 0, world, 1, 0))
    if again != per[(0, 1)]:
        _fail(name, "two calls with the same arguments gave different batches",
              "use the seed argument (DistributedSampler(..., seed=seed)), not the global random state")
    _passed(name)


# ---------------------------------------------------------------------------- rank-0 checkpoint

def check_save_on_rank0(save_on_rank0) -> None:
    """``save_on_rank0(path, model, optimizer, epoch, rank)``: on rank 0 only, save a dict with
    ``model``, ``optimizer`` (their state dicts) and ``epoch`` to ``path``, atomically: write a
    temporary file, then ``os.replace`` it onto ``path``."""
    name = "save_on_rank0"
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ckpt.pt")
        _call(name, save_on_rank0, path, model, opt, 3, 1)
        if os.listdir(d):
            _fail(name, f"rank 1 wrote {os.listdir(d)}", "only rank 0 saves: `if rank != 0: return` first")
        real_replace = os.replace
        calls = []

        def spy(src, dst, *a, **k):
            calls.append((os.fspath(src), os.fspath(dst)))
            return real_replace(src, dst, *a, **k)

        with mock.patch("os.replace", spy), mock.patch("os.rename", spy):
            _call(name, save_on_rank0, path, model, opt, 3, 0)
        if not os.path.exists(path):
            _fail(name, "rank 0 did not write the checkpoint", f"torch.save(...) to a temporary file, then os.replace it to path")
        if not any(dst == path for _, dst in calls):
            _fail(name, "the file was written in place, not atomically: a crash mid-write would leave a "
                  "corrupt checkpoint", "torch.save to path + '.tmp', then os.replace(tmp, path)")
        left = [f for f in os.listdir(d) if f != "ckpt.pt"]
        if left:
            _fail(name, f"temporary files were left behind: {left}", "os.replace moves the temporary file onto path")
        try:
            ck = torch.load(path, weights_only=True)
        except Exception as e:  # noqa: BLE001
            _fail(name, f"the checkpoint cannot be loaded ({e})", "save a dict of state dicts and numbers")
    for key in ("model", "optimizer", "epoch"):
        if key not in ck:
            _fail(name, f"the checkpoint has no {key!r} (keys: {sorted(ck)})",
                  "save {'model': model.state_dict(), 'optimizer': optimizer.state_dict(), 'epoch': epoch}")
    if not all(torch.equal(ck["model"][k], v) for k, v in model.state_dict().items()):
        _fail(name, "the saved weights differ from the model's", "save model.state_dict()")
    if not ck["optimizer"].get("state"):
        _fail(name, "the optimizer state (momentum) is missing", "save optimizer.state_dict(), not its param_groups")
    if ck["epoch"] != 3:
        _fail(name, f"epoch saved as {ck['epoch']!r}, expected 3", "store the epoch argument as given")
    _passed(name)
