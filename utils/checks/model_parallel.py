"""Lab 5's exercises (solutions/lab5_memory_and_model_parallel.ipynb) as specs on the exercise engine: tensor
parallelism, ZeRO memory, ZeRO-2 by hand on 2 processes, and GPipe's micro-batch loop. Each named mistake is one
row: its problem and hint, the known-wrong variant that makes it, and how it is recognised."""

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..models import mlp
from ..parallel import tensor_parallel as tp
from ..parallel import zero_bytes
from ..parallel.shard import CommCounter, ring_bytes
from . import engine
from .engine import Case, Exercise, Mistake

__all__ = ["check_tensor_parallel", "check_zero_memory", "check_zero2", "check_gpipe_microbatches"]
LAB = "lab5_memory_and_model_parallel"


# ---------------------------------------------------------------------------- exercise 1: tensor parallelism
def _tp_cases():
    g = torch.Generator().manual_seed(0)
    return [Case((mlp(16, 2, in_features=8, out_features=8, activation="gelu", seed=n), torch.randn(5, 8, generator=g), n), label=f"{n} rank(s)") for n in (1, 2, 4)]  # fmt: skip


def _tp_run(answer, case):
    """How many times each weight and bias was cut, and every rank's partial output summed (the all-reduce) + b2."""
    (column_shard, row_shard), (block, x, n) = answer, case.args
    out = {"y": block[2].bias.detach().clone()}
    for r in range(n):
        (w1, b1), w2 = column_shard(block[0], r, n), row_shard(block[2], r, n)
        for k, t, whole in (("w1", w1, block[0].weight), ("b1", b1, block[0].bias), ("w2", w2, block[2].weight)):
            ok = torch.is_tensor(t) and t.dim() == whole.dim() and 0 not in t.shape
            out[k] = tuple(a // b for a, b in zip(whole.shape, t.shape)) if ok else None
        try:
            out["y"] = out["y"] + F.gelu(x @ w1.T + b1) @ w2.T
        except (RuntimeError, TypeError, AttributeError):
            out["y"] = None
    return out


def _col(linear, r, n, dim=0, k=1):
    return linear.weight.detach().chunk(n * k, dim)[r], linear.bias.detach().chunk(n, 0)[r]


def _row(linear, r, n, dim=1, k=1):
    return linear.weight.detach().chunk(n * k, dim)[r]


# one row per named mistake: its problem and hint, then its variant and how it is recognised
TENSOR_PARALLEL = Exercise(
    name="tensor_parallel",
    answer=("column_shard", "row_shard"),
    cases=_tp_cases,
    run=_tp_run,
    oracle=(tp.column_shard, tp.row_shard),
    refuse=("utils.parallel.tensor_parallel",),
    hint="rank r keeps slice r of the hidden units in both layers, in equal contiguous slices",
    passed="1, 2 and 4 ranks: the partial outputs add up to the whole MLP",
    mistakes=[
        Mistake(
            "column_shard must return a (weight, bias) pair of tensors and row_shard one weight tensor",
            "return this rank's slice of the weight and of the bias from column_shard, and of the weight from row_shard",
            variant=(lambda lin, r, n: [t.tolist() for t in _col(lin, r, n)], _row),
            when=lambda o: "unpack" in o.error or None in (o.got["w1"], o.got["b1"], o.got["w2"]),
        ),
        Mistake(
            "column_shard's weight is not cut into hidden/N output features by every input feature",
            "a column-parallel layer splits the OUTPUT features, each rank computing some hidden units from the whole input; nn.Linear stores its weight as [out, in]",
            variant=(lambda lin, r, n: (_col(lin, r, n, dim=1)[0], lin.bias.detach()), _row),
            when=lambda o: o.got["w1"] != o.want["w1"],
        ),
        Mistake(
            "column_shard's bias is not cut like its weight",
            "the bias belongs to the output features: keep the entries of the hidden units this rank computes",
            variant=(lambda lin, r, n: (_col(lin, r, n)[0], lin.bias.detach()), _row),
            when=lambda o: o.got["b1"] != o.want["b1"],
        ),
        Mistake(
            "row_shard's weight is not cut into every output feature by hidden/N input features",
            "a row-parallel layer splits its INPUT features, the hidden units this rank computed, so it returns a partial sum of every output",
            variant=(_col, lambda lin, r, n: _row(lin, r, n, dim=0)),
            when=lambda o: o.got["w2"] != o.want["w2"],
        ),
        Mistake(
            "the shapes are right but the summed partial outputs differ from the whole MLP",
            "rank r must take the SAME slice r of the hidden units in both layers: its outputs of the first layer and its inputs of the second",
            variant=(_col, lambda lin, r, n: _row(lin, n - 1 - r, n)),
            when=lambda o: all(o.got[k] == o.want[k] for k in ("w1", "b1", "w2")),
        ),
    ],
)
check_tensor_parallel = TENSOR_PARALLEL.checker(
    "``column_shard(linear, rank, world_size) -> (weight, bias)``, ``row_shard(linear, rank, world_size) -> weight``: "
    "the Megatron split of an MLP, checked by summing every rank's partial output."
)


# ---------------------------------------------------------------------------- exercise 2: ZeRO memory
def _zero(p, n, s, b=2):
    """Mixed-precision Adam's bytes per GPU: ``b``-byte parameters and gradients, 12 bytes of optimizer state."""
    return b * p / (n if s >= 3 else 1) + b * p / (n if s >= 2 else 1) + 12 * p / (n if s >= 1 else 1)


def _another_stage(o) -> bool:
    p, n, s = o.case.args
    return any(abs(o.got - _zero(p, n, k)) < 1 for k in range(4) if k != s)


ZERO_MEMORY = Exercise(
    name="zero_memory",
    oracle=lambda p, n, s: zero_bytes(p, n, s)["total"],
    rtol=1e-9,
    atol=0,
    cases=lambda: [Case((10**6, n, s), label=f"stage {s} on {n} GPU(s)") for n in (1, 2, 8, 64) for s in range(4)],
    hint="bytes per parameter: parameters 2, gradients 2, optimizer state 12; divide by N the parts the stage shards",
    passed="every stage on 1 to 64 GPUs",
    refuse=("utils.parallel.zero_bytes",),
    refuse_hint="add up the bytes of parameters, gradients and optimizer state yourself",
    mistakes=[
        Mistake(
            "you divided by N at stage 0, but stage 0 is plain DDP",
            "at stage 0 every GPU holds all 16 bytes per parameter",
            variant=lambda p, n, s: 16 * p / n,
        ),
        Mistake(
            "the bytes look like fp32 parameters and gradients",
            "in mixed precision the parameters and gradients take 2 bytes each; the fp32 master copy is part of the 12 optimizer bytes",
            variant=lambda p, n, s: _zero(p, n, s, b=4),
        ),
        Mistake(
            "you returned the bytes of another ZeRO stage than the one asked for",
            "stage 1 shards the optimizer state (12 bytes), stage 2 also the gradients (2), stage 3 also the parameters (2)",
            variant=lambda p, n, s: _zero(p, n, 2 if s == 1 else s),
            when=_another_stage,
        ),
    ],
)
check_zero_memory = ZERO_MEMORY.checker(
    "``zero_memory(n_params, world_size, stage)``: bytes per GPU of mixed-precision Adam's model states under a "
    "ZeRO stage (no activations)."
)


# ---------------------------------------------------------------------------- exercise 3: ZeRO-2 by hand
def _zero2_cases(ctx):
    models = (("44-parameter MLP", (4, 6, 2)), ("57-parameter MLP", (5, 6, 3)))  # 57 does not divide by 2 ranks
    return [Case((sizes, kind, ctx), label=f"the {m} with {kind}") for m, sizes in models for kind in ("SGD", "Adam")]


def _zero2_run(answer, case):
    (make_optimizer, step), ((d_in, width, d_out), kind, ctx) = answer, case.args
    model = mlp(width, 2, in_features=d_in, out_features=d_out, activation="tanh", seed=d_in + width).to(ctx.device)
    try:
        kw = {"lr": 0.1, "momentum": 0.9} if kind == "SGD" else {"lr": 0.01}
        opt = make_optimizer(model, torch.optim.SGD if kind == "SGD" else torch.optim.Adam, **kw)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"zero2_optimizer returned {type(opt).__name__}, not a torch.optim optimizer")
        return _zero2_train(model, opt, step, (d_in, d_out), ctx)
    except Exception as e:  # which case: the no-padding mistake raises on the 57-parameter MLP only
        raise RuntimeError(f"on {case.label}: {type(e).__name__}: {e}") from e


def _zero2_train(model, opt, step, sizes, ctx):
    """3 steps, each on this rank's half of a batch; per step the flat parameters, the bytes the collectives send
    (a ring's), the other collectives, the gradients left on the model; then the optimizer's state bytes."""
    g, rows = torch.Generator().manual_seed(sizes[0]), slice(4 * ctx.rank, 4 * ctx.rank + 4)
    held = [p for group in opt.param_groups for p in group["params"]]
    out = {"numel": sum(p.numel() for p in model.parameters()), "held": sum(p.numel() for p in held)}
    out |= {"view": sum(p.untyped_storage().nbytes() - p.numel() * p.element_size() for p in held) > 0}
    out |= {"params": [], "sent": [], "other": [], "grads": []}
    for x, y in [(torch.randn(8, sizes[0], generator=g), torch.randn(8, sizes[1], generator=g)) for _ in range(3)]:
        model.zero_grad(set_to_none=True)
        F.mse_loss(model(x[rows].to(ctx.device)), y[rows].to(ctx.device)).backward()
        with CommCounter(ctx.world_size) as comm:
            step(model, opt)
        out["params"].append(torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()]))
        out["sent"].append(comm.sent)
        out["other"].append(sum(v for k, v in comm.calls.items() if k not in ("reduce_scatter", "all_gather")))
        out["grads"].append(sum(p.grad.numel() for p in model.parameters() if p.grad is not None))
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return out | {"state": sum(v.numel() * v.element_size() for v in state)}


def _flat(tensors, world, mode="end"):
    """One new flat vector padded with zeros at the end to a multiple of ``world``; the mistakes' modes: "front",
    "none" (no padding), "cut" (truncated to a multiple)."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    fill = -flat.numel() % world
    if mode in ("end", "front"):
        return F.pad(flat, (0, fill) if mode == "end" else (fill, 0))
    return flat if mode == "none" else flat[: flat.numel() - flat.numel() % world]


def _copy_back(tensors, full):
    """``full``'s pieces from offset 0 into ``tensors``, in order, in place; the padding, at the end, left out."""
    n = sum(t.numel() for t in tensors)
    full = F.pad(full, (0, max(n - full.numel(), 0)))  # a vector cut short (a mistake) reads as zeros
    with torch.no_grad():
        for t, piece in zip(tensors, full.split([t.numel() for t in tensors] + [full.numel() - n])):
            t.copy_(piece.view_as(t))


def _zero2_optimizer(model, optimizer_class, mode="end", copy=True, **kwargs):
    world = dist.get_world_size()
    shard = _flat(model.parameters(), world, mode).chunk(world)[dist.get_rank()]
    return optimizer_class([(shard.clone() if copy else shard).requires_grad_()], **kwargs)


def _zero2_step(model, opt, power=1, mode="end", keep=False, first=False, gather=True, copy=True, op=None, more=""):
    """The reference (the defaults): reduce-scatter the flat gradient, step the shard, all-gather, copy back.
    Each keyword makes one named mistake."""
    world, params, shard = dist.get_world_size(), list(model.parameters()), opt.param_groups[0]["params"][0]
    grads = _flat([p.grad for p in params], world, mode)
    for p in params:
        p.grad = p.grad if keep else None
    shard.grad = torch.empty_like(shard)
    dist.reduce_scatter_tensor(shard.grad, grads, op=op or dist.ReduceOp.SUM)
    if more == "reduce_scatter":
        dist.reduce_scatter_tensor(torch.empty_like(shard), grads)
    elif more == "broadcast":
        dist.broadcast(torch.zeros_like(shard), 0)
    shard.grad /= world**power
    if not first:
        opt.step()
    full = torch.empty_like(grads) if gather else _flat(params, world, mode)
    if gather:
        dist.all_gather_into_tensor(full, shard.detach())
    else:  # only this rank's shard is new
        full.chunk(world)[dist.get_rank()].copy_(shard.detach())
    if first:
        opt.step()
    if copy:
        _copy_back(params, full)


def _full_step(model, opt):
    world, params = dist.get_world_size(), list(model.parameters())
    grads = _flat([p.grad for p in params], world)
    mine = grads.new_empty(grads.numel() // world)
    dist.reduce_scatter_tensor(mine, grads)
    dist.all_gather_into_tensor(grads, mine / world)
    for p in params:
        p.grad = torch.zeros_like(p)
    _copy_back([p.grad for p in params], grads)
    opt.step()


# the known-wrong answers, one a line, defined at module level so that a rank can be sent their source
def _no_division(model, opt):
    _zero2_step(model, opt, power=0)


def _averaged_twice(model, opt):
    _zero2_step(model, opt, power=2)


def _no_padding(model, opt):
    _zero2_step(model, opt, mode="none")


def _front_step(model, opt):
    _zero2_step(model, opt, mode="front")


def _cut_step(model, opt):
    _zero2_step(model, opt, mode="cut")


def _gathers_first(model, opt):
    _zero2_step(model, opt, first=True)


def _keeps_gradients(model, opt):
    _zero2_step(model, opt, keep=True)


def _no_all_gather(model, opt):
    _zero2_step(model, opt, gather=False)


def _no_copy_back(model, opt):
    _zero2_step(model, opt, copy=False)


def _extra_reduce_scatter(model, opt):
    _zero2_step(model, opt, more="reduce_scatter")


def _extra_broadcast(model, opt):
    _zero2_step(model, opt, more="broadcast")


def _front_optimizer(model, optimizer_class, **kwargs):
    return _zero2_optimizer(model, optimizer_class, mode="front", **kwargs)


def _cut_optimizer(model, optimizer_class, **kwargs):
    return _zero2_optimizer(model, optimizer_class, mode="cut", **kwargs)


def _view_optimizer(model, optimizer_class, **kwargs):
    return _zero2_optimizer(model, optimizer_class, copy=False, **kwargs)


def _full_optimizer(model, optimizer_class, **kwargs):
    return optimizer_class(model.parameters(), **kwargs)


def _not_an_optimizer(model, optimizer_class, **kwargs):
    return [_zero2_optimizer(model, optimizer_class, **kwargs)]


_REF = _zero2_optimizer
ZERO2 = Exercise(
    name="zero2",
    answer=("zero2_optimizer", "zero2_step"),
    oracle=(_zero2_optimizer, _zero2_step),
    ranks=2,
    cases=_zero2_cases,
    run=_zero2_run,
    compare=lambda got, want: _SEEN.append(got) or engine.difference(got, want),
    timeout_s=180,
    refuse=(
        "torch.distributed.all_reduce",
        "torch.distributed.optim.ZeroRedundancyOptimizer",
        "torch.distributed.fsdp.fully_shard",
        "torch.distributed.fsdp.FullyShardedDataParallel",
        "torch.nn.parallel.DistributedDataParallel",
        "utils.parallel",
        "utils.parallel.shard.shard_model",
    ),
    refuse_hint="write the step from dist.reduce_scatter_tensor, an optimizer over your shard, and dist.all_gather_into_tensor",
    hint="rank r's shard is slice r of the padded flat vector cut into N equal slices, in both the reduce-scatter and the all-gather, and its gradient is the MEAN over the ranks",
    passed="2 processes, two MLPs, SGD with momentum and Adam: every step equals one process's, 1/N of the optimizer state, only the shard's gradient after each step, and DDP's traffic",
    mistakes=[
        Mistake(
            "zero2_optimizer returned something that is not a torch.optim optimizer",
            "return the optimizer class built over a list holding only your shard, with the keyword arguments",
            variant=(_not_an_optimizer, _zero2_step),
            when=lambda o: "not a torch.optim optimizer" in o.error,
            replay=False,
        ),
        Mistake(
            "your code ran on the 44-parameter MLP but raised on the 57-parameter one: 57 does not divide by 2 ranks",
            "pad the flat vectors with zeros at the end, to a multiple of the world size, so every rank's shard has the same size; leave the padding out when you copy back into the parameters",
            variant=(_REF, _no_padding),
            when=lambda o: "57-parameter" in o.error,
            replay=False,
        ),
        Mistake(
            "after a step the two ranks hold different parameters",
            "all-gather the updated shards into one full flat vector and copy it into every parameter, on every rank",
            variant=(_REF, _no_all_gather),
            when=lambda o: engine.difference(o.got[0]["params"], o.got[1]["params"]),
            replay=False,
        ),
        Mistake(
            "the model's parameters never change",
            "after the optimizer's step, all-gather the shards and copy the full vector back into the parameters in place, without autograd",
            variant=(_REF, _no_copy_back),
        ),
        Mistake(
            "the first step left the parameters as they were, and later steps are one step behind: you gathered before stepping",
            "step the optimizer on your shard first, then all-gather the updated shards",
            variant=(_REF, _gathers_first),
        ),
        Mistake(
            "the parameters moved as if the gradients were 2x too large: reduce-scatter sums, it does not average",
            "divide your shard's gradient by the world size after the reduce-scatter",
            variant=(_REF, _no_division),
        ),
        Mistake(
            "the parameters moved as if the gradients were 2x too small: they were averaged twice",
            "divide once: reduce-scatter with its default operation (a sum), then divide by the world size",
            variant=(_REF, _averaged_twice),
        ),
        Mistake(
            "the 57-parameter MLP went wrong where the 44-parameter one was right: the padding sits at the front, so every parameter is read one element off",
            "pad the flat vectors with zeros at the END, so the parameters start at offset 0 and the padding is the tail you leave out when you copy back",
            variant=(_front_optimizer, _front_step),
        ),
        Mistake(
            "the parameters differ from one process's on the 57-parameter MLP, but the 44-parameter MLP was right: 57 does not divide by 2 ranks",
            "pad the flat vectors with zeros at the END, to a multiple of the world size, so every rank's shard has the same size; the padding is the tail you leave out when you copy back",
            variant=(_cut_optimizer, _cut_step),
            when=lambda o: o.got[0]["numel"] % 2 and engine.difference(o.got[0]["params"], o.want[0]["params"]),
            replay=False,
        ),
        Mistake(
            "a rank's shard is a view into the whole padded flat vector, so every rank still holds a full copy of the parameters",
            "make the shard a tensor of its own: copy your slice, so the full flat vector can be freed",
            variant=(_view_optimizer, _zero2_step),
            when=lambda o: any(r["view"] for r in o.got),
            replay=False,
        ),
        Mistake(
            "a rank's optimizer holds the whole model's state: you step the full parameters, not your shard",
            "give the optimizer only your shard (a new leaf tensor of 1/N of the padded elements) and step only it; the all-gather brings the other ranks' updates",
            variant=(_full_optimizer, _full_step),
            when=lambda o: o.got[0]["held"] >= o.got[0]["numel"],
            replay=False,
        ),
        Mistake(
            "after its step a rank still holds the model's full gradients, where ZeRO-2 keeps only its shard's once the step is done",
            "once the gradients are flattened for the reduce-scatter, free each parameter's gradient",
            variant=(_REF, _keeps_gradients),
            when=lambda o: any(any(r["grads"]) for r in o.got),
            replay=False,
        ),
        Mistake(
            "a step called a collective other than the reduce-scatter and the all-gather",
            "ZeRO-2's step needs exactly two collectives: a reduce-scatter of the gradients and an all-gather of the parameters",
            variant=(_REF, _extra_broadcast),
            when=lambda o: any(any(r["other"]) for r in o.got),
            replay=False,
        ),
        Mistake(
            "a rank sent more or fewer bytes per step than DDP's all-reduce of the padded vector",
            "one reduce-scatter of the whole padded flat gradient and one all-gather of your shard, per step, in float32",
            variant=(_REF, _extra_reduce_scatter),
            when=lambda o: o.got[0]["sent"] != o.want[0]["sent"],
            replay=False,
        ),
    ],
)
_SEEN: list = []  # what the answer measured, case by case (the compare sees it): check_zero2 hands back the last


def check_zero2(zero2_optimizer: Callable[..., Any], zero2_step: Callable[..., Any]) -> dict:
    """ZeRO-2 by hand (Rajbhandari et al. 2019, arXiv 1910.02054) on 2 processes against one process's torch.optim;
    returns what it measured on the 57-parameter MLP with Adam."""
    _SEEN.clear()
    engine.check(ZERO2, zero2_optimizer, zero2_step)
    last, numel = _SEEN[-1], _SEEN[-1][0]["numel"]
    n = len(last)
    return dict(world_size=n, numel=numel, padded=-(-numel // n) * n, state_bytes=[r["state"] for r in last],
                full_state_bytes=8 * numel, sent_bytes=last[0]["sent"][-1], ddp_sent_bytes=ring_bytes("all_reduce", 4 * numel, n))  # fmt: skip


# ---------------------------------------------------------------------------- exercise 4: GPipe's micro-batch loop
def _gpipe_cases():
    g = torch.Generator().manual_seed(1)
    stages = [
        (mlp(12, 2, in_features=6, out_features=o, activation="tanh", seed=m + o) for o in (6, 3)) for m in (1, 2, 4)
    ]
    return [Case((*s, torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g), m), label=f"{m} micro-batch(es)") for s, m in zip(stages, (1, 2, 4))]  # fmt: skip


def _gpipe_run(answer, case):
    """The step, on stages holding gradients from before: the gradients it added, its loss, and the order of
    stage 0's forwards (F) and backwards (B)."""
    s0, s1, x, y, m = case.args
    params, order, g = [*s0.parameters(), *s1.parameters()], [], torch.Generator().manual_seed(m)
    before = [torch.randn(p.shape, generator=g) for p in params]
    for p, b in zip(params, before):
        p.grad = b.clone()
    hooks = [s0.register_forward_pre_hook(lambda *a: order.append("F")), params[0].register_hook(lambda _: order.append("B"))]  # fmt: skip
    try:
        loss = answer(s0, s1, x, y, m)
    finally:
        [h.remove() for h in hooks]
    added = [((b if p.grad is None else p.grad) - b).flatten() for p, b in zip(params, before)]
    n0 = len(list(s0.parameters()))
    return {"loss": loss if loss is None else float(loss), "stage0": torch.cat(added[:n0]), "stage1": torch.cat(added[n0:]), "order": "".join(order)}  # fmt: skip


def _full_batch(s0, s1, x, y, m):
    loss = ((s1(s0(x)) - y) ** 2).mean()
    loss.backward()
    return loss.item()


def _gpipe(s0, s1, x, y, m, cut="leaf", div=True, fb=False, zero="", sign=1.0):
    """GPipe's micro-batch loop (the defaults); each keyword makes one named mistake."""
    if zero == "both":
        s0.zero_grad(), s1.zero_grad()
    losses, todo = [], []

    def backward(out0, boundary, loss):
        s1.zero_grad() if zero == "stage1" else None
        loss.backward(retain_graph=cut == "retain")
        grad = out0.grad if cut == "retain" else boundary.grad
        if sign:
            out0.backward(None if grad is None else sign * grad)
        losses.append(loss.item())

    for xi, yi in zip(x.chunk(m), y.chunk(m)):
        out0 = s0(xi)
        boundary = {"leaf": out0.detach().requires_grad_(), "none": out0.detach(), "retain": out0}[cut]
        out0.retain_grad() if cut == "retain" else None
        todo.append((out0, boundary, ((s1(boundary) - yi) ** 2).mean() / (m if div else 1)))
        if fb:
            backward(*todo.pop())
    for item in todo:
        backward(*item)
    return sum(losses)


_NO_BOUNDARY_GRAD = ("implicitly created only for scalar outputs", "does not require grad", "a second time")
GPIPE = Exercise(
    name="gpipe_microbatches",
    cases=_gpipe_cases,
    oracle=_full_batch,
    run=_gpipe_run,
    compare=lambda got, want: (
        engine.difference(got["loss"], want["loss"])
        or engine.difference((got["stage0"], got["stage1"]), (want["stage0"], want["stage1"]))
    ),
    hint="backpropagate stage 0's output with the gradient of the leaf that stage 1 received, once per micro-batch",
    passed="1, 2 and 4 micro-batches: the GPipe order, and the gradients of one full-batch step",
    mistakes=[
        Mistake(
            "stage0's backward got no gradient from the boundary",
            "the boundary activation must be a leaf that requires grad, so its .grad can be sent back: cut it off stage0's graph, then ask it to require a gradient",
            variant=lambda *a: _gpipe(*a, cut="none"),
            when=lambda o: any(k in o.error for k in _NO_BOUNDARY_GRAD),
        ),
        Mistake(
            "stage0 ran a different number of forwards than there are micro-batches",
            "cut the batch into m equal micro-batches and run each through stage0 once",
            variant=lambda *a: _full_batch(*a),
            when=lambda o: o.got["order"].count("F") != o.case.args[4],
            mechanism=True,
        ),
        Mistake(
            "the forwards and backwards are interleaved, but GPipe runs all m forwards, then all m backwards",
            "first a loop of all forwards (keep each micro-batch's boundary and loss in lists), then a loop of all backwards",
            variant=lambda *a: _gpipe(*a, fb=True),
            when=lambda o: "B" in o.got["order"][: o.got["order"].rfind("F")],
            mechanism=True,
        ),
        Mistake(
            "the gradients the stages held before the call are gone: your function zeroed them",
            "do not zero the gradients inside: the caller zeroes them once before the step, and the micro-batches accumulate into whatever is there",
            variant=lambda *a: _gpipe(*a, zero="both"),
        ),
        Mistake(
            "the gradients are m times too large",
            "divide each micro-batch's loss by m: the full-batch loss is the mean of the m micro-batch losses",
            variant=lambda *a: _gpipe(*a, div=False),
        ),
        Mistake(
            "stage0's gradients are twice too large",
            "cut the graph at the boundary (a new leaf with stage0's values): otherwise the loss's backward already reaches stage0, and stage0's own backward adds its gradient a second time",
            variant=lambda *a: _gpipe(*a, cut="retain"),
        ),
        Mistake(
            "stage0's parameters got no gradient",
            "backpropagate each micro-batch's loss through stage1, then stage0's output with the gradient that arrived at the boundary",
            variant=lambda *a: _gpipe(*a, sign=0),
            when=lambda o: not o.got["stage0"].any(),
        ),
        Mistake(
            "stage1's gradients differ from the full batch's",
            "zero the gradients once before the step, not inside the loop: gradients must ACCUMULATE over micro-batches",
            variant=lambda *a: _gpipe(*a, zero="stage1"),
            when=lambda o: engine.difference(o.got["stage1"], o.want["stage1"]),
        ),
        Mistake(
            "stage0's gradients differ from the full batch's",
            "backpropagate stage0's output with the gradient of the leaf that stage1 received, once per micro-batch",
            variant=lambda *a: _gpipe(*a, sign=-1.0),
            when=lambda o: engine.difference(o.got["stage0"], o.want["stage0"]),
        ),
        Mistake(
            "the returned loss differs from the full batch's",
            "return the sum of the m micro-batch losses, each already divided by m, as a float",
            variant=lambda *a: _gpipe(*a) / a[4],
            when=lambda o: o.got["loss"] is None or engine.difference(o.got["loss"], o.want["loss"]),
        ),
    ],
)
check_gpipe_microbatches = GPIPE.checker(
    "``gpipe_microbatches(stage0, stage1, x, y, m)``: one GPipe step in one process; returns the summed loss and "
    "leaves in both stages the gradients of one full-batch step."
)
