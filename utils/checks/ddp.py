"""Self-checks for stage 3: data parallelism (solutions/lab3_ddp.ipynb).

The ring all-reduce and gradient averaging must run on real processes, but a function defined
in a notebook cannot be imported by a spawned process. So these checks send the *source* of
your function to the processes, which define it again (with ``torch``, ``dist`` =
``torch.distributed``, ``nn``, ``F``, ``math``, ``os`` in scope) and call it. Helper functions you
defined in other cells of the notebook travel with it.

Checks refuse the course's own implementations (``utils.parallel``) and, where the exercise is
to build a collective, that collective itself. ``check_ddp_script`` (in ddp_script.py) runs your
script FILE under torchrun.

The processes run on the backend the launcher picks (NCCL with a GPU per process), so every
tensor is built on the rank's device (NCCL takes GPU tensors only), with TF32 off.
"""

from __future__ import annotations

import inspect
import math
import os
import tempfile
import textwrap
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
from torch import nn

from ._common import CheckFailed, _call, _close, _fail, _passed, global_names  # noqa: F401

__all__ = [
    "check_ring_all_reduce",
    "check_average_gradients",
    "check_shard_batches",
    "check_save_on_rank0",
    "check_overlap_ddp",
    "check_overlap_trace",
]


# ---------------------------------------------------------------------------- shipping source


def _code_names(code) -> set:
    """Every global/attribute name and string constant used by a code object and those nested in it."""
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, str):
            names.add(c)
        elif hasattr(c, "co_names"):
            names |= _code_names(c)
    return names


def _helpers(fn, seen) -> list:
    """Sources of the functions defined in the notebook (``__main__``) that ``fn`` uses, found by
    name in its code; each is collected once, its own helpers first."""
    out = []
    glb = getattr(fn, "__globals__", {})
    for n in sorted(_code_names(fn.__code__)):
        obj = glb.get(n)
        if (
            callable(obj)
            and getattr(obj, "__module__", None) in ("__main__", "__mp_main__")
            and hasattr(obj, "__code__")
            and obj is not fn
            and n not in seen
        ):
            seen.add(n)
            out += _helpers(obj, seen)
            try:
                out.append(textwrap.dedent(inspect.getsource(obj)))
            except (OSError, TypeError):
                pass
    return out


_LIBRARY = ("utils", "parallel", "ddp_train", "DistributedDataParallel", "DDP")


def _source(name, fn, forbidden=()) -> str:
    """The function's source plus its notebook helpers', after refusing what it must not use."""
    if not callable(fn):
        _fail(name, f"expected a function, got {type(fn).__name__}", "pass the function itself, without calling it")
    mod = getattr(fn, "__module__", "") or ""
    if mod.startswith("utils") or mod.startswith("torch"):
        _fail(
            name,
            f"this is {mod}.{getattr(fn, '__name__', fn)}, the library's own implementation, not yours",
            "write the function yourself in the exercise cell and pass that",
        )
    try:
        src = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        _fail(
            name, "could not read your function's source", "define it with `def` in a notebook cell and run that cell"
        )
    if "NotImplementedError" in src:
        _call(name, _raise_not_implemented)
    helpers = _helpers(fn, {fn.__name__})
    used = _code_names(fn.__code__)
    for h in [g for g in (getattr(fn, "__globals__", {}).get(n) for n in used) if hasattr(g, "__code__")]:
        used |= _code_names(h.__code__)
    glb = getattr(fn, "__globals__", {})
    read = global_names(fn.__code__)  # x.device is an attribute, not the notebook's `device` module
    for h in [g for g in (glb.get(n) for n in read) if hasattr(g, "__code__")]:
        read |= global_names(h.__code__)
    for n in sorted(read):
        obj = glb.get(n)
        omod = getattr(obj, "__module__", None) or getattr(obj, "__name__", "") if obj is not None else ""
        if isinstance(omod, str) and omod.startswith("utils.") and obj is not None and n not in ("utils",):
            _fail(
                name,
                f"your code uses {n}, which comes from the course's {omod}",
                "write the steps yourself with torch.distributed; the library's version is what this "
                "exercise asks you to build",
            )
    bad = [n for n in _LIBRARY + tuple(forbidden) if n in used]
    if bad:
        what = ", ".join(sorted(set(bad)))
        _fail(
            name,
            f"your code calls {what}, which this exercise asks you to build yourself",
            f"remove {what}; build it from the pieces the exercise names"
            + (" (point-to-point sends and receives)" if "all_reduce" in bad else ""),
        )
    return "\n\n".join(helpers + [src])


def _raise_not_implemented():
    raise NotImplementedError


def _define(source: str, fn_name: str):
    """In a spawned process: define the student's function again, with the lab's names in scope."""
    import torch.distributed as dist
    import torch.nn.functional as F

    scope = {"torch": torch, "dist": dist, "nn": nn, "F": F, "math": math, "os": os}
    exec(compile(source, "<your exercise cell>", "exec"), scope)
    return scope[fn_name]


def _blocking_p2p(source: str) -> bool:
    """Does the code send with blocking ``dist.send`` / ``dist.recv`` rather than one batch?"""
    import re

    return (
        bool(re.search(r"\bdist\.send\s*\(|\bsend\s*\(\s*[^)]*\bdst\b", source)) and "batch_isend_irecv" not in source
    )


def _launch(name, worker, nprocs, *args, source: str = ""):
    from utils import parallel

    try:
        return parallel.launch(worker, nprocs, *args, timeout=90, stream=False)
    except parallel.LaunchTimeout:
        if _blocking_p2p(source):
            _fail(
                name,
                "deadlock: every rank is blocked in its dist.send, waiting for a receive that no rank "
                "has posted yet (each one sends first and receives second)",
                "post each step's send and receive together, as one batch of point-to-point operations "
                "(look up dist.P2POp and dist.batch_isend_irecv), then wait on every request it returns",
            )
        _fail(
            name,
            "your function hung (the processes waited for each other until the timeout)",
            "every send needs a matching receive on the neighbour, posted together in one batch; and every "
            "rank must run the same number of steps",
        )
    except parallel.LaunchError as e:
        text = str(e)
        if _blocking_p2p(source):
            _fail(
                name,
                "deadlock: every rank is blocked in its dist.send, waiting for a receive that no rank has posted yet",
                "post each step's send and receive together as one batch (dist.P2POp, "
                "dist.batch_isend_irecv), then wait on every request",
            )
        if "Timed out" in text:
            _fail(
                name,
                "your function hung: a rank waited for a message that never came",
                "check that rank r sends to (r + 1) % N and receives from (r - 1) % N, the same number of times",
            )
        first = text.split("\n")[0]
        if not e.remote_traceback:
            _fail(
                name,
                f"a process stopped without a Python exception ({first.split('. The other')[0]})",
                "run your function's steps by hand on paper for 3 ranks: a rank that waits forever, or "
                "writes past a tensor's end, stops like this",
            )
        tb = e.remote_traceback.strip().splitlines()
        where = next((line.strip() for line in reversed(tb) if "<your exercise cell>" in line), "")
        err = CheckFailed(
            f"{name}: your code raised on {first.split(' raised ')[0]}: "
            f"{first.split(' raised ', 1)[-1].split('. The other ranks')[0]}"
            f"{'  (' + where + ')' if where else ''}. Try: read that rank's traceback, "
            f"printed below, fix the line it names, rerun both cells"
            f"\n\nTraceback from {first.split(' raised ')[0]}:\n{e.remote_traceback}"
        )
        err.remote_traceback = e.remote_traceback
        raise err from None


# ---------------------------------------------------------------------------- ring all-reduce

_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "reduce",
)
RING_SIZES = (12, 7, 2)  # divisible by 3 ranks, not divisible, fewer elements than ranks


def _ring_worker(source, fn_name):
    import torch.distributed as dist

    from utils import parallel

    ctx = parallel.setup(timeout=20)
    fn = _define(source, fn_name)
    out = []
    for n in RING_SIZES:
        x = (torch.arange(n, dtype=torch.float32) + 100.0 * (ctx.rank + 1)).to(ctx.device)  # NCCL: GPU tensors
        # The tensor as it stands when step N starts (N-1 exchanges done): the end of reduce-scatter,
        # when each step is one batch_isend_irecv of a send and a receive (or one blocking send).
        seen = {"steps": 0, "after_rs": None}

        def spy(real, *a, _seen=seen, _x=x, _step=True, **k):
            if _step:
                if _seen["steps"] == ctx.world_size - 1:
                    _seen["after_rs"] = _x.detach().clone()
                _seen["steps"] += 1
            return real(*a, **k)

        def batch(ops, *a, _r=dist.batch_isend_irecv, **k):
            return spy(_r, ops, *a, _step=len(ops) >= 2, **k)

        with (
            mock.patch.object(dist, "batch_isend_irecv", batch),
            mock.patch.object(dist, "send", lambda *a, _r=dist.send, **k: spy(_r, *a, **k)),
        ):
            ret = fn(x)
        out.append(
            {"inplace": x, "returned": ret if isinstance(ret, torch.Tensor) else None, "after_rs": seen["after_rs"]}
        )
    return out


def _ring_expected(n, world):
    return sum(torch.arange(n, dtype=torch.float32) + 100.0 * (r + 1) for r in range(world))


def check_ring_all_reduce(ring_all_reduce: Callable[..., Any], world_size: int = 3) -> None:
    """``ring_all_reduce(tensor)``: sum ``tensor`` over all ranks in place (like
    ``dist.all_reduce``), with N-1 reduce-scatter and N-1 all-gather steps, each one send and
    one receive posted together with ``dist.batch_isend_irecv`` (the form that works on NCCL too).
    Run on 3 real processes, for tensors of 12, 7 and 2 elements."""
    name = "ring_all_reduce"
    src = _source(name, ring_all_reduce, forbidden=_COLLECTIVES)
    res = _launch(name, _ring_worker, world_size, src, ring_all_reduce.__name__, source=src)
    for n, per_size in zip(RING_SIZES, zip(*res)):
        want = _ring_expected(n, world_size)
        got = [r["inplace"] for r in per_size]
        if all(torch.equal(g, want) for g in got):
            continue
        rets = [r["returned"] for r in per_size]
        if all(r is not None and r.shape == want.shape and torch.allclose(r, want) for r in rets):
            _fail(
                name,
                f"the returned tensor is right but the tensor passed in was not changed ({n} elements)",
                "work in place, like dist.all_reduce: cut the tensor into views with tensor.chunk / "
                "tensor_split and add into them (chunk += received), then return the tensor",
            )
        own = [torch.arange(n, dtype=torch.float32) + 100.0 * (r + 1) for r in range(world_size)]
        if all(torch.equal(g, o) for g, o in zip(got, own)):
            _fail(
                name,
                "every rank still holds its own tensor: what it received never landed in `tensor`, so "
                "your chunks are probably copies (clone, cat, a list of new tensors) or were rebound "
                "(chunk = chunk + buffer), not views of `tensor` changed in place",
                "cut with tensor.view(-1).tensor_split(N), which gives views, and add in place into them "
                "(chunks[i] += buffer; all-gather: chunks[i].copy_(buffer))",
            )
        chunks_ok = [
            [torch.equal(gc, wc) for gc, wc in zip(g.tensor_split(world_size), want.tensor_split(world_size))]
            for g in got
        ]
        after_rs = [r["after_rs"] for r in per_size]
        if n >= world_size and all(a is not None for a in after_rs):
            rs_done = [
                [torch.equal(ac, wc) for ac, wc in zip(a.tensor_split(world_size), want.tensor_split(world_size))]
                for a in after_rs
            ]
            finished = [ok.index(True) for ok in rs_done if sum(ok) == 1]
            rs_right = len(finished) == world_size and sorted(finished) == list(range(world_size))
            if rs_right and not all(sum(ok) == 1 for ok in chunks_ok):
                full = "; ".join(
                    f"rank {r}: {[i for i, ok in enumerate(c) if ok] or 'none'}" for r, c in enumerate(chunks_ok)
                )
                _fail(
                    name,
                    f"reduce-scatter is right (after N-1 steps each rank held the full sum of one chunk) but "
                    f"the all-gather is wrong: at the end each rank holds the full sum only for some of the "
                    f"{world_size} chunks, or none (fully summed chunks: {full}; {n} elements)",
                    "in the all-gather, a rank first sends the chunk it finished (the one it added to last), "
                    "then passes on the chunk it just received, and copies what it receives into place",
                )
            if not rs_right and not any(sum(ok) for ok in rs_done):
                _fail(
                    name,
                    f"reduce-scatter is wrong: after its N-1 steps no rank held the full sum of any chunk "
                    f"({n} elements)",
                    "at step 0 each rank sends a different chunk; at every later step it sends on the chunk "
                    "it received and added to at the step before; add what it receives into the same-numbered chunk",
                )
        if n >= world_size and all(sum(ok) == 1 for ok in chunks_ok):
            _fail(
                name,
                f"each rank has exactly one fully summed chunk ({n} elements): the reduce-scatter "
                "works but the all-gather is missing or wrong",
                "after N-1 reduce-scatter steps, run N-1 more steps that pass the finished chunks on "
                "(copy the received chunk into place instead of adding it)",
            )
        if any(torch.allclose(g, want * 2) or torch.allclose(g, want + own[i]) for i, g in enumerate(got)):
            _fail(
                name,
                f"some values were added twice ({n} elements)",
                "in the all-gather phase copy the received chunk (chunk.copy_(buffer)); only reduce-scatter adds",
            )
        _fail(
            name,
            f"wrong sum for a tensor of {n} elements on {world_size} ranks: rank 0 got "
            f"{got[0].tolist()}, expected {want.tolist()}",
            "at every step send one chunk to the right and receive the chunk your left neighbour sends; "
            "after the first step, pass on the chunk you last received; use tensor_split(N) so sizes "
            "that do not divide by N work too",
        )
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

    parallel.exact_fp32()  # compared with one CPU process to 1e-6: no TF32 on the GPU
    ctx = parallel.setup(timeout=20)
    fn = _define(source, fn_name)
    x, y = _grad_data(ctx.world_size)
    x, y = x.to(ctx.device), y.to(ctx.device)  # NCCL all-reduces GPU tensors only
    model = _grad_model().to(ctx.device)
    nn.functional.cross_entropy(model(x[ctx.rank :: ctx.world_size]), y[ctx.rank :: ctx.world_size]).backward()
    fn(model)
    return [p.grad.clone() if p.grad is not None else None for p in model.parameters()]


def check_average_gradients(average_gradients: Callable[..., Any], world_size: int = 2) -> None:
    """``average_gradients(model)``: after ``backward()``, replace every parameter's gradient by
    its mean over all ranks (all-reduce, then divide by the world size). Run on 2 processes,
    compared with one process on the whole batch."""
    name = "average_gradients"
    src = _source(name, average_gradients)
    res = _launch(name, _avg_worker, world_size, src, average_gradients.__name__, source=src)
    x, y = _grad_data(world_size)
    want = _local_grads(x, y)  # the mean over the whole batch
    local = [_local_grads(x[r::world_size], y[r::world_size]) for r in range(world_size)]
    for r, grads in enumerate(res):
        if any(g is None for g in grads):
            _fail(name, f"a gradient is None on rank {r}", "average p.grad in place; do not set it to None")
        if all(torch.allclose(g, w, atol=1e-6) for g, w in zip(grads, want)):
            continue
        if all(torch.allclose(g, world_size * w, atol=1e-6) for g, w in zip(grads, want)):
            _fail(
                name,
                f"the gradients are {world_size}x too large: they were summed, not averaged",
                "the all-reduce sums the gradients: divide each one by the world size after it, in place",
            )
        if all(torch.allclose(g, l, atol=1e-6) for g, l in zip(grads, local[r])):
            _fail(
                name,
                f"rank {r} still has its own local gradient: nothing was exchanged",
                "all-reduce every parameter's gradient, on every rank",
            )
        if all(torch.allclose(g, l / world_size, atol=1e-6) for g, l in zip(grads, local[r])):
            _fail(
                name,
                "each gradient was divided by the world size but not all-reduced",
                "all-reduce first, then divide",
            )
        _fail(
            name,
            f"the gradients on rank {r} do not match one process on the whole batch",
            "sum every parameter's gradient over the ranks with an all-reduce, then divide it by the world size, in place, on every rank",
        )
    _passed(name, f"{world_size} processes match one process on the concatenated batch")


# ---------------------------------------------------------------------------- sharding


def _as_lists(batches):
    return [[int(i) for i in (b.tolist() if isinstance(b, torch.Tensor) else b)] for b in batches]


def check_shard_batches(shard_batches: Callable[..., Any]) -> None:
    """``shard_batches(n, batch_size, rank, world_size, epoch, seed)``: the list of batches (lists
    of example indices) that ``rank`` trains on in ``epoch``, as a ``DistributedSampler`` with
    ``set_epoch(epoch)`` gives them."""
    name = "shard_batches"
    n, bs, world = 20, 4, 2
    per = {(r, e): _as_lists(_call(name, shard_batches, n, bs, r, world, e, 0)) for r in range(world) for e in (0, 1)}
    flat = {k: [i for b in v for i in b] for k, v in per.items()}
    if any(len(b) > bs for v in per.values() for b in v):
        _fail(
            name, f"a batch has more than batch_size={bs} indices", "cut each rank's indices into batches of batch_size"
        )
    if len(flat[(0, 0)]) == n:
        _fail(
            name,
            f"rank 0 got all {n} examples: the data is not sharded",
            "pass num_replicas=world_size and rank=rank to DistributedSampler",
        )
    if flat[(0, 0)] == flat[(1, 0)]:
        _fail(
            name,
            "ranks 0 and 1 got the same indices",
            "pass rank=rank to DistributedSampler, so each rank takes its own share",
        )
    if set(flat[(0, 0)]) & set(flat[(1, 0)]):
        _fail(
            name,
            "ranks 0 and 1 share examples in the same epoch",
            "every rank must use the SAME seed: the sampler shuffles once and deals the indices out by rank",
        )
    if set(flat[(0, 0)]) | set(flat[(1, 0)]) != set(range(n)):
        _fail(name, "together the ranks do not cover the dataset", "each rank takes every world_size-th index")
    if flat[(0, 0)] == flat[(0, 1)]:
        _fail(
            name,
            "epoch 0 and epoch 1 have the same order: the data is never reshuffled",
            "call the sampler's set_epoch with the epoch number before iterating it",
        )
    again = _as_lists(_call(name, shard_batches, n, bs, 0, world, 1, 0))
    if again != per[(0, 1)]:
        _fail(
            name,
            "two calls with the same arguments gave different batches",
            "use the seed argument (DistributedSampler(..., seed=seed)), not the global random state",
        )
    _passed(name)


# ---------------------------------------------------------------------------- rank-0 checkpoint


def check_save_on_rank0(save_on_rank0: Callable[..., Any]) -> None:
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
            _fail(
                name,
                "rank 0 did not write the checkpoint",
                "torch.save(...) to a temporary file, then os.replace it to path",
            )
        if not any(dst == path for _, dst in calls):
            _fail(
                name,
                "the file was written in place, not atomically: a crash mid-write would leave a corrupt checkpoint",
                "save to a temporary file in the same folder, then rename it over the target with os.replace (one step, atomic)",
            )
        left = [f for f in os.listdir(d) if f != "ckpt.pt"]
        if left:
            _fail(name, f"temporary files were left behind: {left}", "os.replace moves the temporary file onto path")
        try:
            ck = torch.load(path, weights_only=True)
        except Exception as e:  # noqa: BLE001
            _fail(name, f"the checkpoint cannot be loaded ({e})", "save a dict of state dicts and numbers")
    for key in ("model", "optimizer", "epoch"):
        if key not in ck:
            _fail(
                name,
                f"the checkpoint has no {key!r} (keys: {sorted(ck)})",
                "save {'model': model.state_dict(), 'optimizer': optimizer.state_dict(), 'epoch': epoch}",
            )
    if not all(torch.equal(ck["model"][k], v) for k, v in model.state_dict().items()):
        _fail(name, "the saved weights differ from the model's", "save model.state_dict()")
    if not ck["optimizer"].get("state"):
        _fail(name, "the optimizer state (momentum) is missing", "save optimizer.state_dict(), not its param_groups")
    if ck["epoch"] != 3:
        _fail(name, f"epoch saved as {ck['epoch']!r}, expected 3", "store the epoch argument as given")
    _passed(name)


# ---------------------------------------------------------------------------- overlapped DDP by hand


def _overlap_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def _overlap_batch(step, world, rank):
    g = torch.Generator().manual_seed(10 + step)
    x, y = torch.randn(4 * world, 6, generator=g), torch.randint(0, 3, (4 * world,), generator=g)
    return x[rank::world], y[rank::world]


OVERLAP_CAPS = (0, 80, 10**9)  # one bucket per parameter, a few buckets, one bucket
OVERLAP_STEPS = 3


def _overlap_worker(source, fn_name):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from utils import parallel

    ctx = parallel.setup(timeout=20)
    fn = _define(source, fn_name)
    out = {}
    for cap in OVERLAP_CAPS:
        model, ref = _overlap_model(), DistributedDataParallel(_overlap_model())
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
        params = list(model.parameters())
        state = {"in_backward": False, "step": 0}
        calls, grads0 = [], None
        real = dist.all_reduce

        def spy(tensor, *a, _calls=calls, _state=state, _params=params, _real=real, **k):
            async_op = k.get("async_op", a[2] if len(a) > 2 else False)
            _calls.append(
                {
                    "step": _state["step"],
                    "async": bool(async_op),
                    "in_backward": _state["in_backward"],
                    "ready": sum(p.grad is not None for p in _params),
                    "numel": tensor.numel(),
                }
            )
            return _real(tensor, *a, **k)

        with mock.patch.object(dist, "all_reduce", spy):
            finish = fn(model, cap)
            for step in range(OVERLAP_STEPS):
                state["step"] = step
                x, y = _overlap_batch(step, ctx.world_size, ctx.rank)
                opt.zero_grad(set_to_none=True)
                loss = nn.functional.cross_entropy(model(x), y)
                state["in_backward"] = True
                loss.backward()
                state["in_backward"] = False
                if callable(finish):
                    finish()
                if step == 0:
                    grads0 = [p.grad.clone() if p.grad is not None else None for p in params]
                opt.step()
        local0 = _overlap_model()
        x, y = _overlap_batch(0, ctx.world_size, ctx.rank)
        nn.functional.cross_entropy(local0(x), y).backward()
        ref_grads0 = None
        for step in range(OVERLAP_STEPS):
            x, y = _overlap_batch(step, ctx.world_size, ctx.rank)
            ref_opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(ref(x), y).backward()
            if step == 0:
                ref_grads0 = [p.grad.clone() for p in ref.parameters()]
            ref_opt.step()
        out[cap] = {
            "finish": callable(finish),
            "calls": calls,
            "nparams": len(params),
            "sizes": [p.numel() for p in params],
            "weights": [p.detach().clone() for p in params],
            "ref": [p.detach().clone() for p in ref.module.parameters()],
            "grads0": grads0,
            "ref_grads0": ref_grads0,
            "local0": [p.grad.clone() for p in local0.parameters()],
        }
    return out


def _bucket_numels(sizes, cap) -> list:
    """Elements per bucket when ``sizes`` are grouped greedily in that order, at most ``cap`` each."""
    out, current = [], 0
    for k in sizes:
        if current and current + k > cap:
            out.append(current)
            current = 0
        current += k
    return out + [current]


def _forward_buckets(launched, sizes, cap) -> bool:
    """Were the all-reduced buckets (their element counts) built in forward order, not in the order
    backward produces gradients (reversed)?"""
    fwd, bwd = sorted(_bucket_numels(sizes, cap)), sorted(_bucket_numels(sizes[::-1], cap))
    return fwd != bwd and sorted(launched) == fwd


_FORWARD_ORDER = (
    "your buckets follow the forward order of model.parameters(); but gradients become ready last "
    "layer first, so a bucket that holds the first layer's parameters fills only at the very end of "
    "backward, and its all-reduce waits for the whole backward instead of overlapping with it",
    "build the buckets walking reversed(list(model.parameters())), the order in which the hooks fire",
)


def check_overlap_ddp(overlap_ddp: Callable[..., Any], world_size: int = 2) -> None:
    """``overlap_ddp(model, bucket_numel)``: register a hook on every parameter that launches an
    asynchronous all-reduce of its gradient (grouped in buckets of at most ``bucket_numel``
    elements; 0: one per parameter) as soon as the gradients of its bucket are ready, and return
    ``finish()``, which waits for them and leaves the averaged gradients in ``p.grad``. Run on 2
    processes for 3 SGD steps, against torch's DistributedDataParallel on the same inputs."""
    name = "overlap_ddp"
    src = _source(name, overlap_ddp)
    res = _launch(name, _overlap_worker, world_size, src, overlap_ddp.__name__, source=src)
    for cap in OVERLAP_CAPS:
        for r, out in enumerate(res):
            out = out[cap]
            calls, n = out["calls"], out["nparams"]
            if not out["finish"]:
                _fail(
                    name,
                    "overlap_ddp did not return a function",
                    "return the inner function that waits for "
                    "the all-reduces and averages; the training loop calls it after backward()",
                )
            if not calls:
                _fail(
                    name,
                    "no dist.all_reduce was called",
                    "in each parameter's hook, launch dist.all_reduce "
                    "on its gradient (or its bucket's), with async_op=True",
                )
            if not any(c["in_backward"] for c in calls):
                _fail(
                    name,
                    "every all-reduce started after backward() returned: none started during backward, so "
                    "communication cannot overlap with it",
                    "launch the all-reduces from gradient hooks, which fire during backward (look up "
                    "Tensor.register_post_accumulate_grad_hook), with async_op=True; finish() only waits",
                )
            if not all(c["async"] for c in calls):
                _fail(
                    name,
                    "an all-reduce was blocking (async_op not set): backward stops at every hook until "
                    "that all-reduce is done, so nothing overlaps",
                    "pass async_op=True, keep the work handle it returns, and wait() on it in finish()",
                )
            if cap == 0 and all(c["ready"] == n for c in calls if c["in_backward"]):
                _fail(
                    name,
                    "the all-reduces start only once every gradient is ready, so none overlaps with the "
                    "rest of backward",
                    "launch a parameter's all-reduce from ITS OWN hook, as soon as its gradient is accumulated",
                )
            g, want, local = out["grads0"], out["ref_grads0"], out["local0"]
            ok = all(a is not None and torch.allclose(a, b, atol=1e-6) for a, b in zip(g, want))
            if not ok:
                if any(a is None for a in g):
                    _fail(
                        name, f"after finish() a gradient is None on rank {r}", "leave the averaged gradient in p.grad"
                    )
                if all(torch.allclose(a, world_size * b, atol=1e-6) for a, b in zip(g, want)):
                    _fail(
                        name,
                        f"the gradients are {world_size}x DDP's: they were summed, not averaged",
                        "in finish(), after waiting, divide by the world size",
                    )
                if all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g, local)):
                    _fail(
                        name,
                        f"rank {r} still has its own local gradient after finish()",
                        "wait() on every work handle in finish(); with buckets, copy the reduced flat buffer "
                        "back into each p.grad after waiting",
                    )
                _fail(
                    name,
                    f"with bucket_numel={cap}, the gradients after finish() on rank {r} differ from "
                    "DistributedDataParallel's",
                    "each gradient must be the mean over ranks: all-reduce "
                    "(sum), wait, divide by the world size, and (buckets) copy each slice back to its p.grad",
                )
            if not all(torch.allclose(a, b, atol=1e-5) for a, b in zip(out["weights"], out["ref"])):
                _fail(
                    name,
                    f"step 0 matched DDP but after {OVERLAP_STEPS} steps the weights differ (bucket_numel={cap})",
                    "reset what finish() keeps (handles, bucket counters) at the end "
                    "of every finish(), so the next backward starts clean",
                )
            per_step = [sum(1 for c in calls if c["step"] == s) for s in range(OVERLAP_STEPS)]
            launched = sorted(c["numel"] for c in calls if c["step"] == 0)
            if 0 < cap < 10**9 and _forward_buckets(launched, out["sizes"], cap):
                _fail(name, *_FORWARD_ORDER)
            if cap == 0 and any(k != n for k in per_step):
                _fail(
                    name,
                    f"with bucket_numel=0 you made {per_step[0]} all-reduces per step for {n} parameters",
                    "bucket_numel=0 means one bucket (one all-reduce) per parameter",
                )
            if cap >= 10**9 and any(k != 1 for k in per_step):
                _fail(
                    name,
                    f"with bucket_numel={cap} (more than the model) you made {per_step[0]} all-reduces per step",
                    "fill a bucket until adding the next parameter would pass bucket_numel; "
                    "the whole model fits in one, so one all-reduce per step",
                )
            if 0 < cap < 10**9 and not all(1 < k < n for k in per_step):
                _fail(
                    name,
                    f"with bucket_numel={cap} you made {per_step[0]} all-reduces per step for {n} parameters",
                    "group parameters in the order their gradients arrive (last layer first) "
                    "into buckets of at most bucket_numel elements",
                )
    _passed(
        name,
        f"{world_size} processes, {len(OVERLAP_CAPS)} bucket sizes, equal to DistributedDataParallel, "
        "all-reduces launched during backward",
    )


def _trace_worker(source, fn_name, bucket_numel):
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    from utils import parallel

    ctx = parallel.setup(timeout=20)
    fn = _define(source, fn_name)
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(256, 256), nn.Tanh())], nn.Linear(256, 10))
    numels = []
    real = dist.all_reduce

    def spy(tensor, *a, **k):
        numels.append(tensor.numel())
        return real(tensor, *a, **k)

    with mock.patch.object(dist, "all_reduce", spy):
        finish = fn(model, bucket_numel)
        x = torch.randn(64, 256)
        for _ in range(2):  # warm-up, then the traced step
            numels.clear()
            model.zero_grad(set_to_none=True)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                loss = model(x).pow(2).mean()
                with record_function("backward"):
                    loss.backward()
                with record_function("finish"):
                    finish()
    forward = 0 < bucket_numel < 10**9 and _forward_buckets(
        numels, [p.numel() for p in model.parameters()], bucket_numel
    )
    events = [
        (e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.name in ("backward", "finish") or "allreduce" in e.name.lower().replace("_", "")
    ]
    if ctx.rank == 0:
        return sorted(events, key=lambda e: e[1]), forward
    return None


def check_overlap_trace(overlap_ddp: Callable[..., Any], bucket_numel: int = 0, world_size: int = 2) -> list:
    """Trace one step of ``overlap_ddp`` with torch.profiler on 2 processes (an MLP of 5 layers)
    and check the order of its events: at least one all-reduce is launched before backward ends.
    Returns rank 0's events, (name, start_us, end_us), sorted by start."""
    name = "overlap trace"
    src = _source(name, overlap_ddp)
    events, forward = _launch(name, _trace_worker, world_size, src, overlap_ddp.__name__, bucket_numel, source=src)[0]
    t0 = min(e[1] for e in events)
    bw = [e for e in events if e[0] == "backward"]
    ar = [e for e in events if e[0] not in ("backward", "finish")]
    for n, s, e in events:
        if n in ("backward", "finish") or e - s > 0:
            print(f"  {n[:40]:40s} {s - t0:9.0f} us -> {e - t0:9.0f} us")
    if forward:
        _fail(name, *_FORWARD_ORDER)
    if not bw or not ar:
        _fail(
            name,
            "the trace has no all-reduce" if bw else "the trace has no backward",
            "make sure overlap_ddp launches dist.all_reduce from its hooks",
        )
    # Judge the launches (your calls, c10d::allreduce_): when the backend's thread then moves the
    # bytes is up to the scheduler, and on a busy CPU it may come only after backward.
    comm = [e for e in ar if "gloo" not in e[0].lower() and "nccl" not in e[0].lower()] or ar
    started_inside = [e for e in comm if e[1] < bw[0][2]]
    if not started_inside:
        _fail(
            name,
            "every all-reduce in the trace starts after backward ended: no overlap",
            "launch the all-reduces from the gradient hooks, with async_op=True",
        )
    _passed(name, f"{len(started_inside)} of {len(comm)} all-reduces were launched before backward ended")
    return events
