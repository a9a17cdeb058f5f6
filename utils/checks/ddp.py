"""Lab 3's exercises (solutions/lab3_ddp.ipynb) as engine specs: the ring all-reduce, gradient
averaging and DDP overlapped with backward run on real ranks (every tensor on the rank's device:
NCCL takes GPU tensors only); sharding batches and saving on rank 0 run in the notebook.

Gradient averaging and overlapped DDP run on 2 processes, then on 3, so a fixed divisor fails.
``run`` measures how an answer communicates: each async all-reduce's handle records whether it
was waited for before backward ended (waited inside the hook: nothing overlaps).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import tempfile
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

from . import ddp_variants as v
from ._common import CheckFailed  # noqa: F401
from .engine import Case, Exercise, Mistake, check, difference

__all__ = [
    "check_ring_all_reduce",
    "check_average_gradients",
    "check_shard_batches",
    "check_save_on_rank0",
    "check_overlap_ddp",
    "check_overlap_trace",
]

LAB = "lab3_ddp"
_LIBRARY = ("utils.parallel", "torch.nn.parallel.DistributedDataParallel")

# ---------------------------------------------------------------------------- ring all-reduce

RING_SIZES = (12, 7, 2)  # divisible by 3 ranks, not divisible, fewer elements than ranks


def _ring_cases(ctx):
    return [
        Case(((torch.arange(n, dtype=torch.float32) + 100.0 * (ctx.rank + 1)).to(ctx.device),), label=f"{n} elements")
        for n in RING_SIZES
    ]


class _Watched:
    """A work handle that notes when it is waited for (``note(handle)``), then behaves as the real one."""

    def __init__(self, work, note):
        self._work, self._note, self.waited = work, note, False

    def wait(self, *a, **k):
        self._note(self)
        self.waited = True
        return self._work.wait(*a, **k)

    def get_future(self):
        self._note(self)
        return self._work.get_future()

    def __getattr__(self, attr):
        return getattr(self._work, attr)


def _ring_run(fn, case):
    (x,) = case.args
    real, reqs = dist.batch_isend_irecv, []

    def batch(ops, *a, **k):
        reqs.extend(_Watched(w, lambda h: None) for w in real(ops, *a, **k))
        return reqs[len(reqs) - len(ops) :]

    with mock.patch.object(dist, "batch_isend_irecv", batch):
        out = fn(x)
    returned = out.detach().cpu() if isinstance(out, torch.Tensor) else None
    return x.detach().cpu(), returned, sum(not r.waited for r in reqs)


def _ring_compare(got, want):
    for r, (g, w) in enumerate(zip(got, want)):
        d = difference(g[0], w[0])
        if d:
            return f"{d.replace('returned', 'left', 1)} in the tensor on rank {r}"
    return None


def _blocking_sends(o):
    blocking = "dist.send(" in o.source.replace(" ", "")  # the mistake under test
    return bool(o.hung or o.error) and blocking and "batch_isend_irecv" not in o.source


def _unwaited(o):
    if o.got:
        return any(g[2] for g in o.got)
    return (o.hung or o.error) and "batch_isend_irecv" in o.source and ".wait(" not in o.source


RING_ALL_REDUCE = Exercise(
    name="ring_all_reduce",
    cases=_ring_cases,
    oracle=v._ring_oracle,
    run=_ring_run,
    compare=_ring_compare,
    hint="at every step send one chunk to the right and receive your left neighbour's, pass on the chunk you last "
    "received, and cut the tensor with tensor_split(N) so sizes that do not divide by N work too",
    mistakes=[
        Mistake(
            "deadlock: every rank is blocked in its dist.send, waiting for a receive that no rank has posted yet",
            "post each step's send and receive together as one batch (dist.P2POp, dist.batch_isend_irecv), "
            "then wait on every request it returns",
            variant=v._ring_blocking,
            when=_blocking_sends,
            replay=False,
        ),
        Mistake(
            "the requests that dist.batch_isend_irecv returns are never waited for, so a chunk is used before "
            "it has arrived (and a rank may wait forever)",
            "call wait() on every request the batch returns before you read the received buffer",
            variant=v._ring_no_wait,
            when=_unwaited,
            replay=False,
            mechanism=True,
        ),
        Mistake(
            "the returned tensor is right but the tensor passed in was not changed",
            "work in place, like dist.all_reduce: cut the tensor into views and add into them, then return it",
            variant=v._ring_out_of_place,
            when=lambda o: all(g[1] is not None and difference(g[1], w[0]) is None for g, w in zip(o.got, o.want)),
        ),
        Mistake(
            "every rank still holds its own tensor: your chunks are copies or were rebound, not views of `tensor` "
            "changed in place",
            "cut with tensor.view(-1).tensor_split(N), which gives views, and add or copy in place into them",
            variant=v._ring_copies,
        ),
        Mistake(
            "reduce-scatter is right but the all-gather is wrong: it does not pass on the chunk each rank finished",
            "in the all-gather a rank first sends the chunk it finished, then passes on the chunk it just received",
            variant=v._ring_gather_shifted,
        ),
        Mistake(
            "reduce-scatter is wrong: what a rank receives replaces its chunk instead of being added to it",
            "in reduce-scatter add what you receive into the same-numbered chunk; only the all-gather copies",
            variant=v._ring_reduce_copies,
        ),
        Mistake(
            "each rank has exactly one fully summed chunk: the reduce-scatter works but the all-gather is missing",
            "after N-1 reduce-scatter steps, run N-1 more steps that pass the finished chunks on and copy them",
            variant=v._ring_no_gather,
        ),
        Mistake(
            "some values were added twice: the all-gather adds what it receives",
            "in the all-gather copy the received chunk into place (copy_); only reduce-scatter adds",
            variant=v._ring_gather_adds,
        ),
    ],
    refuse=_LIBRARY + tuple(f"torch.distributed.{c}" for c in ("all_reduce", "all_gather", "reduce_scatter", "reduce")),
    refuse_hint="build it from point-to-point sends and receives (dist.P2POp, dist.batch_isend_irecv)",
    ranks=3,
    timeout_s=90,
    passed="3 processes, 3 tensor sizes, equal to all_reduce",
)

# ---------------------------------------------------------------------------- gradient averaging


def _grad_cases(ctx):
    cases, r, n = [], ctx.rank, ctx.world_size
    for seed, width in ((1, 5), (2, 7)):
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(4 * n, width, generator=g), torch.randint(0, 3, (4 * n,), generator=g)
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(width, 4), nn.Tanh(), nn.Linear(4, 3)).to(ctx.device)
        nn.functional.cross_entropy(model(x[r::n].to(ctx.device)), y[r::n].to(ctx.device)).backward()
        cases.append(Case((model,), label=f"a model with {width} inputs on {n} ranks"))
    return cases


def _grads_run(fn, case):
    fn(*case.args)
    return [None if p.grad is None else p.grad.detach().cpu() for p in case.args[0].parameters()]


_WORLD_SIZES = (2, 3)


def _at_world_sizes(ex: Exercise, doc: str):
    """The check runs ``ex`` on each of _WORLD_SIZES processes; only the last run's tick is shown."""

    def check_fn(answer):
        try:
            for n in _WORLD_SIZES:
                ex.ranks = n
                with contextlib.redirect_stdout(io.StringIO()) if n != _WORLD_SIZES[-1] else contextlib.nullcontext():
                    check(ex, answer)
        finally:
            ex.ranks = _WORLD_SIZES[-1]

    check_fn.__name__ = check_fn.__qualname__ = f"check_{ex.name}"
    check_fn.__doc__, check_fn.__module__ = doc, "utils.checks"
    return check_fn


AVERAGE_GRADIENTS = Exercise(
    name="average_gradients",
    cases=_grad_cases,
    oracle=v._average_oracle,
    run=_grads_run,
    atol=1e-6,
    hint="sum every parameter's gradient over the ranks with an all-reduce, then divide it in place by the world size",
    mistakes=[
        Mistake(
            "a gradient is None after your function",
            "average p.grad in place; do not set it to None",
            variant=v._average_none,
            when=lambda o: any(g is None for r in o.got for g in r),
        ),
        Mistake(
            "the gradients were summed, not averaged",
            "divide each one by the world size after the all-reduce",
            variant=v._average_sums,
        ),
        Mistake(
            "each rank still has its own local gradient: nothing was exchanged",
            "all-reduce every parameter's gradient, on every rank",
            variant=v._average_nothing,
        ),
        Mistake(
            "each gradient was divided by the world size but not all-reduced",
            "all-reduce first, then divide",
            variant=v._average_unreduced,
        ),
        Mistake(
            "the gradients were divided by 2, not by the number of processes",
            "divide by the number of processes, the world size: the check runs on 2 and on 3 processes",
            variant=v._average_by_two,
        ),
    ],
    refuse=_LIBRARY,
    refuse_hint="write the loop over the parameters yourself with dist.all_reduce",
    ranks=_WORLD_SIZES[-1],
    timeout_s=90,
    passed="2 and 3 processes, equal to the mean over ranks",
)

check_ring_all_reduce = RING_ALL_REDUCE.checker(
    "``ring_all_reduce(tensor)``: sum ``tensor`` over all ranks in place, with N-1 reduce-scatter and N-1 "
    "all-gather steps of one batched send and receive each; run on 3 processes for tensors of 12, 7 and 2 elements."
)
check_average_gradients = _at_world_sizes(
    AVERAGE_GRADIENTS,
    "``average_gradients(model)``: after backward(), replace every gradient by its mean over the ranks; "
    "run on 2, then 3 processes.",
)

# ---------------------------------------------------------------------------- overlapped DDP by hand

OVERLAP_CAPS = (0, 80, 10**9)  # one bucket per parameter, a few buckets, one bucket
OVERLAP_STEPS = 3
TRACE_CAPS = (0, 70_000)


def _mlp(widths, device):
    torch.manual_seed(0)
    layers = [m for a, b in zip(widths, widths[1:]) for m in (nn.Linear(a, b), nn.Tanh())]
    return nn.Sequential(*layers[:-1]).to(device)


def _overlap_cases(ctx):
    r, n, batches = ctx.rank, ctx.world_size, []
    for step in range(OVERLAP_STEPS):
        g = torch.Generator().manual_seed(10 + step)
        x, y = torch.randn(4 * n, 6, generator=g), torch.randint(0, 3, (4 * n,), generator=g)
        batches.append((x[r::n].to(ctx.device), y[r::n].to(ctx.device)))
    return [
        Case((_mlp((6, 8, 8, 3), ctx.device), cap), {"batches": batches}, label=f"bucket_numel={cap}")
        for cap in OVERLAP_CAPS
    ]


def _trace_cases(ctx):
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)).to(ctx.device)
    return [
        Case((_mlp((256,) * 5 + (10,), ctx.device), cap), {"x": x}, label=f"bucket_numel={cap}") for cap in TRACE_CAPS
    ]


@contextlib.contextmanager
def _watching(params, state):
    """Note every dist.all_reduce: its step, async or not, launched in backward or not, how many
    gradients were ready, its size, and whether its handle was waited for before backward ended."""
    calls, real = [], dist.all_reduce

    def spy(tensor, *a, **k):
        c = {"step": state["step"], "async": bool(k.get("async_op", a[2] if len(a) > 2 else False))}
        c.update(bw=state["bw"], ready=sum(p.grad is not None for p in params), numel=tensor.numel(), early=False)
        calls.append(c)
        work = real(tensor, *a, **k)
        return _Watched(work, lambda h: c.update(early=c["early"] or state["bw"])) if c["async"] else work

    with mock.patch.object(dist, "all_reduce", spy):
        yield calls


def _summary(calls, params, cap, finish) -> dict:
    bw = [c for c in calls if c["bw"]]
    return {
        "cap": cap,
        "finish": callable(finish),
        "calls": len(calls),
        "in_bw": len(bw),
        "blocking": any(not c["async"] for c in calls),
        "overlapped": any(c["async"] and not c["early"] for c in bw),
        "late": cap == 0 and bool(bw) and all(c["ready"] == len(params) for c in bw),
    }


def _overlap_run(fn, case):
    model, cap = case.args
    params, state, grads0 = list(model.parameters()), {"step": 0, "bw": False}, []
    opt = torch.optim.SGD(params, lr=0.1)
    with _watching(params, state) as calls:
        finish = fn(model, cap)
        for step, (x, y) in enumerate(case.kwargs["batches"]):
            state["step"] = step
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x), y)
            state["bw"] = True
            loss.backward()
            state["bw"] = False
            _ = finish() if callable(finish) else None
            if step == 0:
                grads0 = [None if p.grad is None else p.grad.detach().cpu() for p in params]
            opt.step()
    return {
        "grads0": grads0,
        "weights": [p.detach().cpu() for p in params],
        "launches": [sum(c["step"] == s for c in calls) for s in range(OVERLAP_STEPS)],
        "numels": sorted(c["numel"] for c in calls if c["step"] == 0),
        **_summary(calls, params, cap, finish),
    }


def _overlap_compare(got, want):
    for r, (g, w) in enumerate(zip(got, want)):
        if any(x is None for x in g["grads0"]):
            return f"left a gradient None after finish() on rank {r}"
        if difference(g["grads0"], w["grads0"], 1e-5, 1e-6):
            return f"left gradients after finish() on rank {r} that differ from the mean over the ranks"
        if g["launches"] != w["launches"]:
            return f"made {g['launches']} all-reduces per step where buckets of at most {w['cap']} elements make {w['launches']}"
        if g["numels"] != w["numels"]:
            return f"all-reduced buckets of {g['numels']} elements where the order of the hooks gives {w['numels']}"
        if difference(g["weights"], w["weights"], 1e-5, 1e-6):
            return f"matched the first step but after {OVERLAP_STEPS} steps the weights differ"
    return None


def _trace_run(fn, case):
    from torch.profiler import ProfilerActivity, profile, record_function

    model, cap = case.args
    params, state = list(model.parameters()), {"step": 0, "bw": False}
    with _watching(params, state) as calls:
        finish = fn(model, cap)
        for step in range(2):  # a warm-up step, then the traced one
            state["step"] = step
            model.zero_grad(set_to_none=True)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                loss = model(case.kwargs["x"]).pow(2).mean()
                with record_function("backward"):
                    state["bw"] = True
                    loss.backward()
                    state["bw"] = False
                with record_function("finish"):
                    _ = finish() if callable(finish) else None
    names = ("backward", "finish")
    events = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()]
    events = sorted(
        (e for e in events if e[0] in names or "allreduce" in e[0].lower().replace("_", "")), key=lambda e: e[1]
    )
    last = [c for c in calls if c["step"] == 1]
    return {
        "launches": len(last),
        "numels": sorted(c["numel"] for c in last),
        "events": events if dist.get_rank() == 0 else None,
        **_summary(last, params, cap, finish),
    }


_TRACED: dict = {}  # bucket_numel -> rank 0's events of the student's traced step


def _trace_compare(got, want):
    g, w = got[0], want[0]
    _TRACED[w["cap"]] = g["events"]
    if g["launches"] != w["launches"]:
        return f"launched {g['launches']} all-reduces where buckets of at most {w['cap']} elements make {w['launches']}"
    if g["numels"] != w["numels"]:
        return f"all-reduced buckets of {g['numels']} elements where the order of the hooks gives {w['numels']}"
    return None


def _got(key, pred=bool):
    """A predicate on the outcome: ``pred`` holds for ``key`` of some rank's result."""
    return lambda o: bool(o.got) and any(pred(g[key]) for g in o.got)


_NO_FINISH = Mistake(
    "overlap_ddp did not return a function",
    "return the inner function that waits for the all-reduces and averages; the training loop calls it after backward",
    variant=v._overlap_no_finish,
    when=_got("finish", lambda f: not f),
    mechanism=True,
)
_NO_CALLS = Mistake(
    "no dist.all_reduce was called",
    "in each parameter's hook, launch dist.all_reduce on its gradient (or its bucket's), with async_op=True",
    variant=v._overlap_silent,
    when=_got("calls", lambda n: n == 0),
    mechanism=True,
)
_AFTER_BACKWARD = Mistake(
    "every all-reduce started after backward returned: none overlaps with backward, so there is no overlap",
    "launch the all-reduces from gradient hooks, which fire during backward (look up "
    "Tensor.register_post_accumulate_grad_hook), with async_op=True; finish() only waits",
    variant=v._overlap_after_backward,
    when=lambda o: bool(o.got) and any(g["calls"] and not g["in_bw"] for g in o.got),
    mechanism=True,
)
_BLOCKING = Mistake(
    "an all-reduce was blocking (async_op not set): backward stops at every hook until it is done, so nothing overlaps",
    "pass async_op=True, keep the work handle it returns, and wait() on it in finish()",
    variant=v._overlap_blocking,
    when=_got("blocking"),
    mechanism=True,
)
_WAITS_IN_HOOK = Mistake(
    "each all-reduce is waited for before backward goes on: backward never runs while a reduction is "
    "outstanding, so nothing overlaps",
    "keep the work handles in the hooks and wait() on them only in finish(), after backward",
    variant=v._overlap_waits_in_hook,
    when=lambda o: bool(o.got) and any(g["in_bw"] and not g["overlapped"] for g in o.got),
    mechanism=True,
)
_FORWARD = Mistake(
    "your buckets follow the forward order of model.parameters(), but gradients become ready last layer first, "
    "so a bucket with the first layer's parameters fills only at the end of backward",
    "build the buckets walking the parameters in reverse order, the order in which backward's hooks fire",
    variant=v._overlap_forward,
)
OVERLAP_DDP = Exercise(
    name="overlap_ddp",
    cases=_overlap_cases,
    oracle=v._overlap_oracle,
    run=_overlap_run,
    compare=_overlap_compare,
    hint="each gradient must be the mean over ranks: all-reduce a bucket as soon as its gradients are ready, "
    "then in finish() wait, divide by the world size and copy each slice back to its gradient",
    mistakes=[
        _NO_FINISH,
        _NO_CALLS,
        _AFTER_BACKWARD,
        _BLOCKING,
        _WAITS_IN_HOOK,
        Mistake(
            "the all-reduces start only once every gradient is ready, so none overlaps with the rest of backward",
            "launch a bucket's all-reduce from the hook of its last parameter, as soon as that gradient is accumulated",
            variant=v._overlap_holds,
            when=_got("late"),
            mechanism=True,
        ),
        _FORWARD,
        Mistake(
            "the gradients were summed, not averaged",
            "in finish(), after waiting, divide by the world size",
            variant=v._overlap_sums,
        ),
        Mistake(
            "each rank still has its own local gradient after finish(): the reduced values never reach p.grad",
            "after waiting, copy the reduced flat buffer back into each p.grad of its bucket",
            variant=v._overlap_no_copy,
        ),
        Mistake(
            "the first step matches but later steps do not: finish() keeps the last step's handles or counts",
            "at the end of every finish(), forget the handles and reset the ready counts, so the next backward "
            "starts clean",
            variant=v._overlap_never_clears,
        ),
        Mistake(
            "you make one all-reduce per parameter whatever bucket_numel is",
            "group parameters in the order their gradients arrive into buckets of at most bucket_numel elements",
            variant=v._overlap_one_per_param,
        ),
        Mistake(
            "a gradient is None after finish()",
            "leave the averaged gradient in p.grad",
            variant=v._overlap_none,
            when=_got("grads0", lambda gs: any(x is None for x in gs)),
        ),
    ],
    refuse=_LIBRARY,
    refuse_hint="write the hooks, the buckets and finish() yourself with dist.all_reduce",
    ranks=_WORLD_SIZES[-1],
    timeout_s=90,
    passed="2 and 3 processes, 3 bucket sizes, equal to the mean over ranks, with backward running while "
    "all-reduces were outstanding",
)
OVERLAP_TRACE = Exercise(
    name="overlap_trace",
    answer=("overlap_ddp",),
    cases=_trace_cases,
    oracle=v._overlap_oracle,
    run=_trace_run,
    compare=_trace_compare,
    hint="all-reduce a bucket from the hook of its last parameter, in the order the hooks fire",
    mistakes=[
        _NO_CALLS,
        dataclasses.replace(
            _AFTER_BACKWARD, problem="every all-reduce in the trace starts after backward ended: no overlap"
        ),
        _BLOCKING,
        _WAITS_IN_HOOK,
        _FORWARD,
    ],
    refuse=_LIBRARY,
    ranks=2,
    timeout_s=90,
    passed="2 processes, a traced step with backward running while all-reduces were outstanding",
)
check_overlap_ddp = _at_world_sizes(
    OVERLAP_DDP,
    "``overlap_ddp(model, bucket_numel)``: hooks that launch an async all-reduce per bucket during backward, and "
    "``finish()`` that waits and averages; 3 SGD steps on 2, then 3 processes, for 3 bucket sizes.",
)


def check_overlap_trace(overlap_ddp: Callable[..., Any], bucket_numel: int = 0) -> list:
    """Trace one step of ``overlap_ddp`` with torch.profiler on 2 processes (a 5-layer MLP) and print
    rank 0's backward, finish and all-reduce events; returns them as (name, start_us, end_us), by start."""
    if bucket_numel not in TRACE_CAPS:
        raise CheckFailed(f"overlap_trace: the check traces bucket_numel in {TRACE_CAPS}. Try: pass one of those.")
    check(OVERLAP_TRACE, overlap_ddp)
    events = _TRACED.pop(bucket_numel, None) or []
    t0 = min((e[1] for e in events), default=0)
    for n, s, e in events:
        if n in ("backward", "finish") or e > s:
            print(f"  {n[:40]:40s} {s - t0:9.0f} us -> {e - t0:9.0f} us")
    return events


# ---------------------------------------------------------------------------- sharding


def _shard_cases():
    return [
        Case((20, 4, 2, 0, 0), label="20 examples, batches of 4, 2 ranks, epoch 0"),
        Case((20, 4, 2, 1, 0), label="20 examples, batches of 4, 2 ranks, epoch 1"),
        Case((11, 3, 3, 2, 5), label="11 examples, batches of 3, 3 ranks, epoch 2, seed 5"),
    ]


def _shard_run(fn, case):
    n, bs, world, epoch, seed = case.args
    per = [[[int(i) for i in b] for b in fn(n, bs, r, world, epoch, seed)] for r in range(world)]
    return per, per[0] == [[int(i) for i in b] for b in fn(n, bs, 0, world, epoch, seed)]


SHARD_BATCHES = Exercise(
    name="shard_batches",
    cases=_shard_cases,
    oracle=v._shard,
    run=_shard_run,
    compare=lambda got, want: (
        None
        if got == want
        else (
            "gave different batches on two calls with the same arguments"
            if not got[1]
            else f"gave rank 0 the batches {got[0][0]} where {want[0][0]} were expected"
        )
    ),
    hint="make one shuffle that every rank computes alike (a DistributedSampler told the world size, this "
    "rank and the seed), tell it the epoch, then cut this rank's indices into batches of batch_size",
    mistakes=[
        Mistake(
            "two calls with the same arguments gave different batches",
            "give the sampler the seed argument instead of drawing from the global random state",
            variant=v._shard_global_rng,
            when=lambda o: not o.got[1],
        ),
        Mistake(
            "a batch has more than batch_size indices",
            "cut each rank's indices into batches of batch_size",
            variant=lambda *a: v._shard(*a, whole=True),
        ),
        Mistake(
            "every rank got all the examples: the data is not sharded",
            "tell DistributedSampler the world size and this rank (num_replicas, rank)",
            variant=lambda *a: v._shard(*a, replicas=1) if a[2] == 0 else v._shard(a[0], a[1], 0, *a[3:], replicas=1),
        ),
        Mistake(
            "every rank got the same indices",
            "give DistributedSampler this rank's number, so each rank takes its own share",
            variant=lambda n, b, r, w, e, s: v._shard(n, b, 0, w, e, s),
        ),
        Mistake(
            "the ranks share examples in the same epoch",
            "every rank must use the SAME seed: the sampler shuffles once and deals the indices out by rank",
            variant=lambda n, b, r, w, e, s: v._shard(n, b, r, w, e, s + r),
        ),
        Mistake(
            "together the ranks do not cover the dataset",
            "keep the sampler's default drop_last=False, which pads the last share so every example is used",
            variant=lambda *a: v._shard(*a, drop_last=True),
        ),
        Mistake(
            "the epochs have the same order: the data is never reshuffled",
            "call the sampler's set_epoch with the epoch number before iterating it",
            variant=lambda *a: v._shard(*a, reshuffle=False),
        ),
    ],
    passed="3 cases of sizes, ranks, epochs and seeds, equal to DistributedSampler",
)
check_shard_batches = SHARD_BATCHES.checker(
    "``shard_batches(n, batch_size, rank, world_size, epoch, seed)``: the batches (lists of indices) that "
    "``rank`` trains on in ``epoch``, as DistributedSampler with set_epoch gives them."
)

# ---------------------------------------------------------------------------- rank-0 checkpoint


def _save_cases():
    out = []
    for width, epoch in ((3, 3), (5, 7)):
        torch.manual_seed(width)
        model = nn.Linear(width, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.ones(1, width)).sum().backward()
        opt.step()
        out.append(Case((model, opt, epoch), label=f"a Linear({width}, 2) at epoch {epoch}"))
    return out


def _save_run(fn, case):
    model, opt, epoch = case.args
    replaced, real = [], os.replace

    def spy(src, dst, *a, **k):
        replaced.append(os.fspath(dst))
        return real(src, dst, *a, **k)

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ckpt.pt")
        fn(path, model, opt, epoch, 1)
        out = {"rank 1 wrote": sorted(os.listdir(d))}
        with mock.patch("os.replace", spy), mock.patch("os.rename", spy):
            fn(path, model, opt, epoch, 0)
        out.update(written=os.path.exists(path), atomic=path in replaced, left=sorted(set(os.listdir(d)) - {"ckpt.pt"}))
        try:
            ck = torch.load(path, weights_only=True)
        except Exception:  # noqa: BLE001
            ck = None
    ck = ck if isinstance(ck, dict) else {}
    state = ck.get("model") if isinstance(ck.get("model"), dict) else {}
    out.update(loads=bool(ck), keys=sorted(ck), epoch=ck.get("epoch"))
    out["weights"] = all(k in state and torch.equal(state[k], v) for k, v in model.state_dict().items())
    out["momentum"] = bool(isinstance(ck.get("optimizer"), dict) and ck["optimizer"].get("state"))
    return out


def _save_compare(got, want):
    for k, w in want.items():
        if got[k] != w:
            return f"gave {k}={got[k]!r} where {w!r} was expected"
    return None


SAVE_ON_RANK0 = Exercise(
    name="save_on_rank0",
    cases=_save_cases,
    oracle=v._save,
    run=_save_run,
    compare=_save_compare,
    hint="on rank 0 only, torch.save the dict of both state dicts and the epoch to a temporary file, then "
    "os.replace it onto path",
    mistakes=[
        Mistake(
            "rank 1 wrote a file too",
            "only rank 0 saves: return first when rank is not 0",
            variant=lambda *a: v._save(*a, every_rank=True),
        ),
        Mistake(
            "rank 0 did not write the checkpoint",
            "torch.save(...) to a temporary file, then os.replace it to path",
            variant=lambda *a: None,
        ),
        Mistake(
            "the file was written in place, not atomically: a crash mid-write would leave a corrupt checkpoint",
            "save to a temporary file in the same folder, then rename it over the target with os.replace "
            "(one step, atomic)",
            variant=lambda *a: v._save(*a, in_place=True),
        ),
        Mistake(
            "temporary files were left behind",
            "os.replace moves the temporary file onto path",
            variant=lambda *a: v._save(*a, leave_tmp=True),
        ),
        Mistake(
            "the checkpoint cannot be loaded with weights_only=True",
            "save state dicts and numbers, not objects",
            variant=lambda p, m, o, e, r: v._save(
                p, m, o, e, r, state={"model": m, "optimizer": o.state_dict(), "epoch": e}
            ),
        ),
        Mistake(
            "the checkpoint has no 'optimizer'",
            "save {'model': model.state_dict(), 'optimizer': optimizer.state_dict(), 'epoch': epoch}",
            variant=lambda p, m, o, e, r: v._save(p, m, o, e, r, state={"model": m.state_dict(), "epoch": e}),
        ),
        Mistake(
            "the saved weights differ from the model's",
            "save model.state_dict()",
            variant=lambda p, m, o, e, r: v._save(
                p,
                m,
                o,
                e,
                r,
                state={"model": {k: 0 * v for k, v in m.state_dict().items()}, "optimizer": o.state_dict(), "epoch": e},
            ),
        ),
        Mistake(
            "the optimizer state (momentum) is missing",
            "save optimizer.state_dict(), not its param_groups",
            variant=lambda p, m, o, e, r: v._save(
                p,
                m,
                o,
                e,
                r,
                state={
                    "model": m.state_dict(),
                    "optimizer": {"param_groups": o.state_dict()["param_groups"]},
                    "epoch": e,
                },
            ),
        ),
        Mistake(
            "the epoch saved is not the one given",
            "store the epoch argument as given",
            variant=lambda p, m, o, e, r: v._save(p, m, o, e + 1, r),
        ),
    ],
    passed="2 models and epochs: rank 0 alone writes, atomically, everything a restart needs",
)
check_save_on_rank0 = SAVE_ON_RANK0.checker(
    "``save_on_rank0(path, model, optimizer, epoch, rank)``: on rank 0 only, save model, optimizer and epoch "
    "to ``path`` atomically (a temporary file, then os.replace)."
)
