"""Lab 3's exercises (solutions/lab3_ddp.ipynb) as engine specs. The ring all-reduce, gradient averaging and
overlapped DDP run on ranks that import this module, every tensor on the rank's device (gradient averaging and
overlapped DDP on 2, then 3 processes, so that a fixed divisor fails); sharding and saving run in the notebook."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DistributedSampler

from .engine import Case, Exercise, check, difference, fail
from .engine import mistake as _m

__all__ = [
    f"check_{n}"
    for n in ("ring_all_reduce", "average_gradients", "shard_batches", "save_on_rank0", "overlap_ddp", "overlap_trace")
]
LAB = "lab3_ddp"
_LIBRARY = ("utils.parallel", "torch.nn.parallel.DistributedDataParallel")


class _Watched:
    """A work handle that records being waited for (and calls ``note`` then), else the real one."""

    def __init__(self, work, note=lambda: None):
        self._work, self._note, self.waited = work, note, False

    def __getattr__(self, attr):
        if attr == "get_future":  # waiting on its future waits for the handle
            return lambda: _Watched(self._work.get_future(), self._waited)
        if attr == "wait":
            self._waited()
        return getattr(self._work, attr)

    def _waited(self):
        self._note()
        self.waited = True


@contextlib.contextmanager
def _spying(fn, name: str, spy):
    """``dist.<name>`` replaced by ``spy`` while the answer ``fn`` runs, in c10d too (``P2POp.op is isend`` holds),
    and where the answer's globals hold it by name."""
    real, scope, c10d = getattr(dist, name), getattr(fn, "__globals__", {}), dist.distributed_c10d
    with mock.patch.object(dist, name, spy), mock.patch.object(c10d, name, spy):
        with mock.patch.dict(scope, {k: spy for k, v in scope.items() if v is real}):
            yield


class _Sent(TorchDispatchMode):
    """The elements this rank sends point to point: c10d's send, however the answer called it."""

    elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.elements += sum(t.numel() for t in args[0]) if str(func).startswith("c10d.send") else 0
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------------------- ring all-reduce
RING_SIZES = (12, 7, 2)  # divisible by 3 ranks, not divisible, fewer elements than ranks


def _ring(tensor, *, clone=False, copies=False, reduce_add=True, gather=True, gather_add=False, gather_shift=0, more=0):
    """The ring by hand; each keyword set away from its default makes one named mistake."""
    world, rank, tensor = dist.get_world_size(), dist.get_rank(), tensor.clone() if clone else tensor
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = [c.clone() if copies else c for c in tensor.view(-1).tensor_split(world)]

    def step(send_i, recv_i, add):
        buf = torch.empty_like(chunks[recv_i])
        ops = [dist.P2POp(dist.isend, chunks[send_i], right), dist.P2POp(dist.irecv, buf, left)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        chunks[recv_i].add_(buf) if add else chunks[recv_i].copy_(buf)

    for s in range(world - 1):
        step((rank - s) % world, (rank - s - 1) % world, reduce_add)
    for s in range(world - 1 + more if gather else 0):
        step((rank + 1 + gather_shift - s) % world, (rank + gather_shift - s) % world, gather_add)
    return tensor


def _ring_blocking(tensor):  # its first step: every rank sends before any receives (the mistake under test)
    world, rank, buf = dist.get_world_size(), dist.get_rank(), torch.empty_like(tensor)
    dist.send(tensor, (rank + 1) % world), dist.recv(buf, (rank - 1) % world)  # the mistake under test
    return tensor.add_(buf)


def _ring_no_wait(tensor):  # written out: a crash is recognised from this source (a batch, no wait)
    world, rank = dist.get_world_size(), dist.get_rank()
    chunks, right, left = tensor.view(-1).tensor_split(world), (rank + 1) % world, (rank - 1) % world
    for s in range(2 * (world - 1)):
        i, j = (rank - s) % world, (rank - s - 1) % world
        buf = torch.empty_like(chunks[j])
        dist.batch_isend_irecv([dist.P2POp(dist.isend, chunks[i], right), dist.P2POp(dist.irecv, buf, left)])
        chunks[j].add_(buf) if s < world - 1 else chunks[j].copy_(buf)
    return tensor


def _ring_run(fn, case):
    """The tensor passed in, the one returned, how many requests (of the batches, or the answer's own isend and
    irecv) were never waited for, and how many elements this rank sent."""
    (x,) = case.args
    real, reqs = dist.batch_isend_irecv, []

    def batch(*a, **k):
        works = real(*a, **k)
        reqs.extend(_Watched(w) for w in works)
        return reqs[len(reqs) - len(works) :]

    def direct(send_or_recv):  # a request the answer makes itself; batch_isend_irecv's own calls pass through
        def spy(*a, **k):
            work = send_or_recv(*a, **k)
            if work is None or sys._getframe(1).f_globals is not getattr(fn, "__globals__", None):
                return work
            reqs.append(_Watched(work))
            return reqs[-1]

        return spy

    with _spying(fn, "batch_isend_irecv", batch), _spying(fn, "isend", direct(dist.isend)):
        with _spying(fn, "irecv", direct(dist.irecv)), _Sent() as sent:
            out = fn(x)
    returned = out.detach().cpu() if isinstance(out, torch.Tensor) else None
    return x.detach().cpu(), returned, sum(not r.waited for r in reqs), sent.elements


def _ring_compare(got, want):
    for r, (g, w) in enumerate(zip(got, want)):
        if d := difference(g[0], w[0]):
            return f"{d.replace('returned', 'left', 1)} in the tensor on rank {r}"
        if g[1] is None and w[1] is not None:
            return f"returned None on rank {r}, not the tensor it summed"
    return None


RING_ALL_REDUCE = Exercise(
    name="ring_all_reduce",
    cases=lambda ctx: [
        Case(((torch.arange(n, dtype=torch.float32) + 100.0 * (ctx.rank + 1)).to(ctx.device),), label=f"{n} elements")
        for n in RING_SIZES
    ],
    oracle=lambda tensor: dist.all_reduce(tensor) or tensor,
    run=_ring_run,
    compare=_ring_compare,
    ranks=3,
    timeout_s=90,
    passed="2 and 3 processes, 3 tensor sizes, equal to all_reduce",
    hint="at every step send one chunk to the right and receive your left neighbour's, pass on the chunk you last "
    "received, and cut the tensor with tensor_split(N) so sizes that do not divide by N work too",
    refuse=_LIBRARY
    + tuple(
        f"torch.distributed.{c}"
        for c in "all_reduce all_gather reduce_scatter reduce all_gather_into_tensor reduce_scatter_tensor broadcast "
        "all_to_all all_to_all_single gather scatter all_gather_object broadcast_object_list gather_object "
        "scatter_object_list ProcessGroup.allreduce ProcessGroup.allgather ProcessGroup.reduce_scatter".split()
    ),
    refuse_hint="build it from point-to-point sends and receives (dist.P2POp, dist.batch_isend_irecv)",
    mistakes=[
        _m(
            "deadlock: every rank is blocked in its dist.send, waiting for a receive no rank has posted. Try: post "
            "each step's send and receive together as one batch (dist.P2POp, dist.batch_isend_irecv), then wait on "
            "its requests",
            _ring_blocking,
            lambda o: (
                bool(o.hung or o.error)
                and "dist.send(" in o.source.replace(" ", "")  # the mistake under test
                and "batch_isend_irecv" not in o.source
            ),
        ),
        _m(
            "a request (of dist.batch_isend_irecv, or an isend or irecv) is never waited for, so a chunk may be used "
            "before it arrives or changed before it leaves. Try: call wait() on every request of each step before you "
            "read the received buffer",
            _ring_no_wait,
            lambda o: (
                any(g[2] for g in o.got)
                if o.got
                else (o.hung or o.error) and "batch_isend_irecv" in o.source and ".wait(" not in o.source
            ),
            mechanism=True,
        ),
        _m(
            "your ring sends more than 2(N-1) chunks of 1/N of the tensor per rank: it takes extra steps, or sends "
            "more than a chunk at a time. Try: N-1 reduce-scatter steps, then N-1 all-gather steps, each sending one "
            "chunk",
            partial(_ring, more=1),
            lambda o: (
                bool(o.got)
                and any(g[3] > 2 * (len(o.got) - 1) * -(-g[0].numel() // len(o.got)) for g in o.got)
                and _ring_compare(o.got, o.want) is None
            ),
            mechanism=True,
        ),
        _m(
            "the returned tensor is right but the tensor passed in was not changed. Try: work in place, like "
            "dist.all_reduce: add into views of the tensor, then return it",
            partial(_ring, clone=True),
            lambda o: all(g[1] is not None and difference(g[1], w[0]) is None for g, w in zip(o.got, o.want)),
        ),
        _m(
            "every rank still holds its own tensor: your chunks are copies, not views changed in place. Try: cut with "
            "tensor.view(-1).tensor_split(N), which gives views, and add or copy into them",
            partial(_ring, copies=True),
        ),
        _m(
            "reduce-scatter is right but the all-gather does not pass on the chunk each rank finished. Try: in the "
            "all-gather first send the chunk you finished, then the chunk you just received",
            partial(_ring, gather_shift=1),
        ),
        _m(
            "reduce-scatter is wrong: what a rank receives replaces its chunk instead of being added to it. Try: in "
            "reduce-scatter add what you receive; only the all-gather copies",
            partial(_ring, reduce_add=False),
        ),
        _m(
            "each rank has exactly one fully summed chunk: the all-gather is missing. Try: after N-1 reduce-scatter "
            "steps, run N-1 more steps that pass the finished chunks on and copy them",
            partial(_ring, gather=False),
        ),
        _m(
            "some values were added twice: the all-gather adds what it receives. Try: in the all-gather copy the "
            "received chunk into place; only reduce-scatter adds",
            partial(_ring, gather_add=True),
        ),
        _m(
            "the tensor is summed in place, but your function returned None. Try: once the tensor holds the sum, "
            "return it, as the exercise asks",
            lambda tensor: (_ring(tensor), None)[1],
        ),
    ],
)
check_ring_all_reduce = RING_ALL_REDUCE.checker(
    "``ring_all_reduce(tensor)``: sum ``tensor`` over all ranks in place, with N-1 reduce-scatter and N-1 all-gather "
    "steps of one batched send and receive each; run on 2, then 3 processes for tensors of 12, 7 and 2 elements.",
    (2, 3),
)


# ---------------------------------------------------------------------------- gradient averaging
def _mlp(widths, device, seed=0):
    torch.manual_seed(seed)
    layers = [m for a, b in zip(widths, widths[1:]) for m in (nn.Linear(a, b), nn.Tanh())]
    return nn.Sequential(*layers[:-1]).to(device)


def _batch(ctx, seed, width, classes, rows, shard=True):
    """A batch that every rank draws alike; with ``shard``, this rank's rows of it."""
    g, r, n = torch.Generator().manual_seed(seed), (ctx.rank if shard else 0), (ctx.world_size if shard else 1)
    x, y = torch.randn(rows, width, generator=g), torch.randint(0, classes, (rows,), generator=g)
    return x[r::n].to(ctx.device), y[r::n].to(ctx.device)


def _grad_cases(ctx):
    cases = []
    for seed, width in ((1, 5), (2, 7)):
        model, (x, y) = _mlp((width, 4, 3), ctx.device, seed), _batch(ctx, seed, width, 3, 4 * ctx.world_size)
        nn.functional.cross_entropy(model(x), y).backward()
        cases.append(Case((model,), label=f"a model with {width} inputs on {ctx.world_size} ranks"))
    return cases


def _grads_run(fn, case):
    fn(*case.args)
    return [None if p.grad is None else p.grad.detach().cpu() for p in case.args[0].parameters()]


def _average(model, *, reduce=True, divide=True, by=None, assign=False):
    """The reference (the defaults); each keyword makes one named mistake (``assign``: p.grad = all_reduce's None)."""
    for p in model.parameters():
        done = dist.all_reduce(p.grad) if reduce else None
        if assign:
            p.grad = done
        elif divide:
            p.grad /= by or dist.get_world_size()


AVERAGE_GRADIENTS = Exercise(
    name="average_gradients",
    cases=_grad_cases,
    oracle=_average,
    run=_grads_run,
    ranks=3,
    timeout_s=90,
    hint="sum every parameter's gradient over the ranks with an all-reduce, then divide it in place by the world size",
    refuse=_LIBRARY,
    refuse_hint="write the loop over the parameters yourself with dist.all_reduce",
    passed="2 and 3 processes, equal to the mean over ranks",
    mistakes=[
        _m(
            "a gradient is None after your function. Try: dist.all_reduce works in place and returns None: never "
            "assign its result to p.grad",
            partial(_average, assign=True),
            lambda o: any(g is None for r in o.got for g in r),
        ),
        _m(
            "the gradients were summed, not averaged. Try: divide each one by the world size after the all-reduce",
            partial(_average, divide=False),
        ),
        _m(
            "each rank still has its own local gradient: nothing was exchanged. Try: all-reduce every parameter's "
            "gradient, on every rank, then divide",
            partial(_average, reduce=False),
        ),
        _m(
            "the gradients were divided by 2, not by the number of processes. Try: divide by the world size: the check "
            "runs on 2 and on 3 processes",
            partial(_average, by=2),
        ),
    ],
)
check_average_gradients = AVERAGE_GRADIENTS.checker(
    "``average_gradients(model)``: after backward(), replace every gradient by its mean over the ranks; run on 2, then "
    "3 processes.",
    (2, 3),
)

# ---------------------------------------------------------------------------- overlapped DDP by hand
OVERLAP_CAPS = (0, 72, 10**9)  # one bucket per parameter, a few (the second exactly full: 64 + 8), one bucket
OVERLAP_STEPS = 3
TRACE_CAPS = (0, 70_000)


def _overlap_cases(ctx):
    batches = [_batch(ctx, 10 + step, 6, 3, 4 * ctx.world_size) for step in range(OVERLAP_STEPS)]
    return [Case((_mlp((6, 8, 8, 3), ctx.device), c), {"batches": batches}, f"bucket_numel={c}") for c in OVERLAP_CAPS]


def _trace_cases(ctx):
    batches, mlp = [_batch(ctx, 0, 256, 10, 64, shard=False)] * 2, (256,) * 5 + (10,)
    return [
        Case((_mlp(mlp, ctx.device), c), {"batches": batches, "trace": True}, f"bucket_numel={c}") for c in TRACE_CAPS
    ]


def _overlap_run(fn, case):
    """SGD steps with the answer's hooks and finish(), noting of every dist.all_reduce its step, size, whether it was
    async, launched in backward, waited for before backward ended, and the gradients ready then; a trace profiles."""
    from torch.profiler import ProfilerActivity, profile, record_function

    (model, cap), batches, trace = case.args, case.kwargs["batches"], case.kwargs.get("trace", False)
    params, calls, now, grads0 = list(model.parameters()), [], {"step": 0, "bw": False}, []
    opt, real = torch.optim.SGD(params, lr=0.1), dist.all_reduce

    def spy(tensor, *a, **k):
        c = {**now, "async": bool(k.get("async_op", a[2] if len(a) > 2 else False)), "numel": tensor.numel()}
        c.update(ready=sum(p.grad is not None for p in params), early=False, stale=False)
        calls.append(c)
        work = real(tensor, *a, **k)
        seen = lambda: c.update(early=c["early"] or now["bw"], stale=c["stale"] or now["step"] != c["step"])
        return _Watched(work, seen) if c["async"] else work

    with _spying(fn, "all_reduce", spy):
        finish = fn(model, cap)
        for step, (x, y) in enumerate(batches):
            now["step"] = step
            opt.zero_grad(set_to_none=True)
            with profile(activities=[ProfilerActivity.CPU]) if trace else contextlib.nullcontext() as prof:
                loss = nn.functional.cross_entropy(model(x), y)
                with record_function("backward"):
                    now["bw"] = True
                    loss.backward()
                    now["bw"] = False
                with record_function("finish"):
                    _ = finish() if callable(finish) else None
            grads0 = grads0 or [None if p.grad is None else p.grad.detach().cpu() for p in params]
            opt.step()
    bw, shown = [c for c in calls if c["bw"]], ("backward", "finish")
    events = (
        [e for e in prof.events() if e.name in shown or "allreduce" in e.name.lower().replace("_", "")] if trace else []
    )
    return dict(
        grads0=grads0,
        weights=[p.detach().cpu() for p in params],
        cap=cap,
        finish=callable(finish),
        launches=[sum(c["step"] == s for c in calls) for s in range(len(batches))],
        numels=sorted(c["numel"] for c in calls if c["step"] == 0),
        events=sorted(((e.name, e.time_range.start, e.time_range.end) for e in events), key=lambda e: e[1]),
        calls=len(calls),
        in_bw=len(bw),
        stale=any(c["stale"] for c in calls),
        overlapped=any(c["async"] and not c["early"] for c in bw),
        late=cap == 0 and sum(c["step"] == 0 for c in bw) > 1 and all(c["ready"] == len(params) for c in bw),
    )


def _overlap_compare(got, want):
    for r, (g, w) in enumerate(zip(got, want)):
        if any(x is None for x in g["grads0"]):
            return f"left a gradient None after finish() on rank {r}"
        if difference(g["grads0"], w["grads0"], 1e-5, 1e-6):
            return f"left gradients after finish() on rank {r} that differ from the mean over the ranks"
        if g["launches"] != w["launches"]:
            return (
                f"made {g['launches']} all-reduces per step where buckets of at most {w['cap']} elements make "
                f"{w['launches']}"
            )
        if g["numels"] != w["numels"]:
            return f"all-reduced buckets of {g['numels']} elements where the order of the hooks gives {w['numels']}"
        if difference(g["weights"], w["weights"], 1e-5, 1e-6):
            return f"matched the first step but after {len(w['launches'])} steps the weights differ"
    return None


_TRACED: dict = {}  # bucket_numel -> rank 0's events of the student's traced step
_trace_compare = lambda got, want: _TRACED.update({want[0]["cap"]: got[0]["events"]}) or _overlap_compare(got, want)


def _overlap(model, cap, *, order=reversed, start="ready", divide=True, clear=True, copy=True, wait=False, give=True):
    """Buckets by hand; each keyword away from its default makes one named mistake (``start``: a bucket's
    all-reduce starts when it is "ready", once "all" gradients are, in "finish", or "never")."""
    world, params = dist.get_world_size(), [p for p in model.parameters() if p.requires_grad]
    buckets, size = [[]], 0
    for p in order(params):
        if buckets[-1] and size + p.numel() > cap:
            buckets, size = buckets + [[]], 0
        buckets[-1].append(p)
        size += p.numel()
    bucket_of, ready, pending = {p: i for i, b in enumerate(buckets) for p in b}, [0] * len(buckets), []

    def launch(*which):
        for i in which:
            flat = torch.cat([q.grad.reshape(-1) for q in buckets[i]])
            pending.append((i, flat, dist.all_reduce(flat, async_op=True)))
            _ = pending[-1][2].wait() if wait else None

    def hook(p):
        i = bucket_of[p]
        ready[i] += 1
        if start == "all" and sum(ready) == len(params):
            launch(*range(len(buckets)))
        elif start == "ready" and ready[i] == len(buckets[i]):
            launch(i)

    for p in params:
        p.register_post_accumulate_grad_hook(hook)

    def finish():
        _ = launch(*range(len(buckets))) if start == "finish" else None
        for i, flat, work in pending:
            work.wait()
            flat /= world if divide else 1
            for q, part in zip(buckets[i], flat.split([q.numel() for q in buckets[i]])):
                _ = q.grad.copy_(part.view_as(q.grad)) if copy else None
        if clear:  # "counts": the ready counts only
            _ = pending.clear() if clear is True else None
            ready[:] = [0] * len(buckets)

    return finish if give else None


_got = lambda key, pred=bool: lambda o: bool(o.got) and any(pred(g[key]) for g in o.got)  # for some rank's result
# rows 1 to 4 are the trace's mistakes too; a mistake seen by a predicate is a partial, which a rank can unpickle
_OVERLAP_MISTAKES = [
    _m(
        "overlap_ddp did not return a function. Try: return the inner function that waits for the all-reduces and "
        "averages; the training loop calls it after backward",
        partial(_overlap, give=False),
        _got("finish", lambda f: not f),
        mechanism=True,
    ),
    _m(
        "no dist.all_reduce was called. Try: in each parameter's hook, launch dist.all_reduce on its gradient (or its "
        "bucket's), with async_op=True",
        partial(_overlap, start="never"),
        _got("calls", lambda n: n == 0),
        mechanism=True,
    ),
    _m(
        "every all-reduce started after backward returned, so none overlaps with backward. Try: launch them with "
        "async_op=True from gradient hooks, which fire during backward (Tensor.register_post_accumulate_grad_hook); "
        "finish() only waits",
        partial(_overlap, start="finish"),
        lambda o: bool(o.got) and any(g["calls"] and not g["in_bw"] for g in o.got),
        mechanism=True,
    ),
    _m(
        "each all-reduce finished inside its hook (blocking, or waited for there), so nothing overlaps. Try: pass "
        "async_op=True, keep the work handles and wait() on them only in finish()",
        partial(_overlap, wait=True),
        lambda o: bool(o.got) and any(g["in_bw"] and not g["overlapped"] for g in o.got),
        mechanism=True,
    ),
    _m(
        "your buckets follow the forward order of model.parameters(), but gradients become ready last layer first. "
        "Try: build the buckets walking the parameters in reverse order",
        partial(_overlap, order=list),
    ),
    _m(
        "the all-reduces start only once every gradient is ready, so none overlaps with the rest of backward. Try: "
        "launch a bucket's all-reduce from the hook of its last parameter",
        partial(_overlap, start="all"),
        _got("late"),
        mechanism=True,
    ),
    _m(
        "the gradients were summed, not averaged. Try: in finish(), after waiting, divide by the world size",
        partial(_overlap, divide=False),
    ),
    _m(
        "each rank still has its own local gradient after finish(): the reduced values never reach p.grad. Try: after "
        "waiting, copy the reduced flat buffer back into each p.grad of its bucket",
        partial(_overlap, copy=False),
    ),
    _m(
        "the first step matches but later steps do not: finish() keeps the last step's handles or counts. Try: at the "
        "end of every finish(), forget the handles and reset the ready counts",
        partial(_overlap, clear=False),
    ),
    _m(
        "finish() waits again for the all-reduces of earlier steps: it never forgets their handles, and copies their "
        "old buckets back every step. Try: at the end of every finish(), clear the list of handles",
        partial(_overlap, clear="counts"),
        lambda o: bool(o.got) and any(g["stale"] and g["launches"] == w["launches"] for g, w in zip(o.got, o.want)),
        mechanism=True,
    ),
    _m(
        "you make one all-reduce per parameter whatever bucket_numel is. Try: group parameters, in the order their "
        "gradients arrive, into buckets of at most bucket_numel elements",
        lambda m, c=0: _overlap(m, 0),
    ),
]
_OVERLAP = dict(oracle=_overlap, run=_overlap_run, refuse=_LIBRARY, timeout_s=90)
OVERLAP_DDP = Exercise(
    name="overlap_ddp",
    cases=_overlap_cases,
    compare=_overlap_compare,
    mistakes=_OVERLAP_MISTAKES,
    ranks=3,
    **_OVERLAP,
    hint="each gradient must be the mean over ranks: all-reduce a bucket as soon as its gradients are ready, then in "
    "finish() wait, divide by the world size and copy each slice back to its gradient",
    refuse_hint="write the hooks, the buckets and finish() yourself with dist.all_reduce",
    passed="2 and 3 processes, 3 bucket sizes, equal to the mean over ranks, with backward running while all-reduces "
    "were outstanding",
)
OVERLAP_TRACE = Exercise(
    name="overlap_trace",
    answer=("overlap_ddp",),
    cases=_trace_cases,
    compare=_trace_compare,
    ranks=2,
    **_OVERLAP,
    hint="all-reduce a bucket from the hook of its last parameter, in the order the hooks fire",
    mistakes=_OVERLAP_MISTAKES[1:5],
    passed="2 processes, a traced step with backward running while all-reduces were outstanding",
)
check_overlap_ddp = OVERLAP_DDP.checker(
    "``overlap_ddp(model, bucket_numel)``: hooks that launch an async all-reduce per bucket during backward, and "
    "``finish()`` that waits and averages; 3 SGD steps on 2, then 3 processes, for 3 bucket sizes.",
    (2, 3),
)


def check_overlap_trace(overlap_ddp: Callable[..., Any], bucket_numel: int = 0) -> list:
    """Trace one step of ``overlap_ddp`` with torch.profiler on 2 processes (a 5-layer MLP) and print
    rank 0's backward, finish and all-reduce events; returns them as (name, start_us, end_us), by start."""
    if bucket_numel not in TRACE_CAPS:
        fail(OVERLAP_TRACE.name, f"the check traces bucket_numel in {TRACE_CAPS}", "pass one of those")
    check(OVERLAP_TRACE, overlap_ddp)
    events = _TRACED.pop(bucket_numel, None) or []
    t0 = min((e[1] for e in events), default=0)
    for n, s, e in events:
        if n in ("backward", "finish") or e > s:
            print(f"  {n[:40]:40s} {s - t0:9.0f} us -> {e - t0:9.0f} us")
    return events


# ---------------------------------------------------------------------------- sharding
def _shard(n, b, rank, world, epoch, seed, *, reshuffle=True, drop_last=False, whole=False, rng=False):
    """DistributedSampler's batches; each keyword set away from its default makes one named mistake."""
    s = DistributedSampler(range(n), num_replicas=world, rank=rank, seed=seed, drop_last=drop_last)
    _ = s.set_epoch(epoch) if reshuffle else None
    idx = torch.randperm(n).tolist()[rank::world] if rng else list(s)
    return [idx] if whole else [idx[i : i + b] for i in range(0, len(idx), b)]


def _batches(got) -> list:
    got = list(got)  # a generator too, read once
    if not all(hasattr(b, "__iter__") for b in got):
        raise TypeError("shard_batches returned a flat list of indices, not a list of batches")
    return [[int(i) for i in b] for b in got]


def _shard_run(fn, case):
    n, bs, world, epoch, seed = case.args
    per = [_batches(fn(n, bs, r, world, epoch, seed)) for r in range(world)]
    return per, per[0] == _batches(fn(n, bs, 0, world, epoch, seed))


def _shard_compare(got, want):
    if got == want:
        return None
    if not got[1]:
        return "gave different batches on two calls with the same arguments"
    r = next((r for r, (g, w) in enumerate(zip(got[0], want[0])) if g != w), 0)
    return f"gave rank {r} the batches {got[0][r]} where {want[0][r]} were expected"


SHARD_BATCHES = Exercise(
    name="shard_batches",
    oracle=_shard,
    run=_shard_run,
    compare=_shard_compare,
    cases=lambda: [
        Case((n, b, w, e, s), label=f"{n} examples, batches of {b}, {w} ranks, epoch {e}, seed {s}")
        for n, b, w, e, s in ((20, 4, 2, 0, 0), (20, 4, 2, 1, 0), (11, 3, 3, 2, 5))
    ],
    hint="make one shuffle that every rank computes alike (a DistributedSampler told the world size, this rank and the "
    "seed), tell it the epoch, then cut this rank's indices into batches of batch_size",
    passed="3 cases of sizes, ranks, epochs and seeds, equal to DistributedSampler",
    mistakes=[
        _m(
            "it returns one flat list of indices, not a list of batches. Try: return a list of lists, each one batch "
            "of at most batch_size indices",
            lambda *a: [i for b in _shard(*a) for i in b],
            lambda o: "not a list of batches" in o.error,
        ),
        _m(
            "two calls with the same arguments gave different batches. Try: give the sampler the seed argument instead "
            "of drawing from the global random state",
            partial(_shard, rng=True),
            lambda o: not o.got[1],
        ),
        _m(
            "a batch has more than batch_size indices. Try: cut each rank's indices into batches of batch_size",
            partial(_shard, whole=True),
        ),
        _m(
            "every rank got the same batches: the data is not dealt out by rank. Try: tell DistributedSampler the "
            "world size and this rank (num_replicas, rank)",
            lambda n, b, r, w, e, s: _shard(n, b, 0, w, e, s),
            lambda o: o.got[1] and all(g == o.got[0][0] for g in o.got[0]),
        ),
        _m(
            "the ranks share examples in the same epoch. Try: every rank must use the SAME seed: the sampler shuffles "
            "once and deals the indices out by rank",
            lambda n, b, r, w, e, s: _shard(n, b, r, w, e, s + r),
        ),
        _m(
            "together the ranks do not cover the dataset. Try: keep the sampler's default drop_last=False, which pads "
            "the last share",
            partial(_shard, drop_last=True),
        ),
        _m(
            "the epochs have the same order: the data is never reshuffled. Try: call the sampler's set_epoch with the "
            "epoch number before iterating it",
            partial(_shard, reshuffle=False),
        ),
    ],
)
check_shard_batches = SHARD_BATCHES.checker(
    "``shard_batches(n, batch_size, rank, world_size, epoch, seed)``: the batches (lists of indices) that ``rank`` "
    "trains on in ``epoch``, as DistributedSampler with set_epoch gives them."
)


# ---------------------------------------------------------------------------- rank-0 checkpoint
def _save_cases():
    out = []
    for width, epoch in ((3, 3), (5, 7)):
        model = _mlp((width, 2), "cpu", width)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.ones(1, width)).sum().backward()
        opt.step()  # a step with momentum: the optimizer has state to save
        out.append(Case((model, opt, epoch), label=f"a Linear({width}, 2) at epoch {epoch}"))
    return out


def _save_run(fn, case):
    """What rank 1 and then rank 0 wrote, and what a restart can load from it."""
    model, opt, epoch = case.args
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ckpt.pt")
        _ = [fn(path, model, opt, epoch, r) for r in (1, 2)]
        out = {"ranks 1 and 2 wrote": sorted(os.listdir(d))}
        with mock.patch("os.replace", wraps=os.replace) as moves, mock.patch("os.rename", wraps=os.rename) as renames:
            fn(path, model, opt, epoch, 0)
        atomic = path in [os.fspath(c.args[1]) for c in moves.call_args_list + renames.call_args_list]
        out.update(written=os.path.exists(path), atomic=atomic, left=sorted(set(os.listdir(d)) - {"ckpt.pt"}))
        ck = None
        with contextlib.suppress(Exception):  # no file, or one that does not load: what the check reports
            ck = torch.load(path, weights_only=True)
    ck = ck if isinstance(ck, dict) else {}
    state = ck.get("model") if isinstance(ck.get("model"), dict) else {}
    keys = sorted({"model", "optimizer", "epoch"} & set(ck))  # what it must hold; more keys are allowed
    out.update(loads=bool(ck), keys=keys, epoch=ck.get("epoch"))
    out["weights"] = all(k in state and torch.equal(state[k], v) for k, v in model.state_dict().items())
    out["momentum"] = bool(isinstance(ck.get("optimizer"), dict) and ck["optimizer"].get("state"))
    return out


def _save(path, model, optimizer, epoch, rank, /, *, every_rank=False, in_place=False, leave_tmp=False, **change):
    """Rank 0's atomic save; each keyword away from its default (``change``: a saved key replaced, None drops it) makes a mistake."""
    if rank != 0 and not every_rank:
        return
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch} | change
    tmp = path if in_place else f"{path}.tmp"
    torch.save({k: v for k, v in state.items() if v is not None}, tmp)
    _ = torch.save({}, f"{path}.tmp2") if leave_tmp else None
    _ = os.replace(tmp, path) if tmp != path else None


SAVE_ON_RANK0 = Exercise(
    name="save_on_rank0",
    cases=_save_cases,
    oracle=_save,
    run=_save_run,
    compare=lambda got, want: next(
        (f"gave {k}={got[k]!r} where {w!r} was expected" for k, w in want.items() if got[k] != w), None
    ),
    hint="on rank 0 only, torch.save the dict of both state dicts and the epoch to a temporary file, then os.replace "
    "it onto path",
    passed="2 models and epochs: rank 0 alone writes, atomically, everything a restart needs",
    mistakes=[
        _m(
            "a rank other than 0 wrote a file too. Try: only rank 0 saves: return first when rank is not 0",
            partial(_save, every_rank=True),
            lambda o: o.got["ranks 1 and 2 wrote"] != [],
        ),
        _m(
            "rank 0 did not write the checkpoint. Try: torch.save(...) to a temporary file, then os.replace it to path",
            lambda *a: None,
        ),
        _m(
            "the file was written in place, not atomically: a crash mid-write would corrupt it. Try: save to a "
            "temporary file in the same folder, then os.replace it onto the target",
            partial(_save, in_place=True),
        ),
        _m(
            "temporary files were left behind. Try: os.replace moves the temporary file onto path",
            partial(_save, leave_tmp=True),
        ),
        _m(
            "the checkpoint cannot be loaded with weights_only=True. Try: save state dicts and numbers, not objects",
            lambda *a: _save(*a, model=a[1]),
        ),
        _m(
            "the checkpoint lacks the optimizer's state (its momentum). Try: save optimizer.state_dict() under "
            "'optimizer'",
            partial(_save, optimizer=None),
        ),
        _m(
            "the epoch saved is not the one given. Try: store the epoch argument as given",
            lambda p, m, o, e, r: _save(p, m, o, e + 1, r),
        ),
    ],
)
check_save_on_rank0 = SAVE_ON_RANK0.checker(
    "``save_on_rank0(path, model, optimizer, epoch, rank)``: on rank 0 only, save model, optimizer and epoch to "
    "``path`` atomically (a temporary file, then os.replace)."
)
