"""Lab 5's exercises (solutions/lab5_memory_and_model_parallel.ipynb) on the exercise engine: the tensor-parallel
split, ZeRO memory, ZeRO-2 by hand on 2 processes (against a reference ZeRO-2, held to one process's torch.optim in
the tests), GPipe's micro-batch loop (against one full-batch step)."""

from collections import defaultdict
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..models import mlp
from ..parallel import tensor_parallel as tp
from ..parallel import zero_bytes
from ..parallel.shard import CommCounter, ring_bytes
from .engine import Case, Exercise, difference
from .engine import mistake as _m

__all__ = ["check_tensor_parallel", "check_zero_memory", "check_zero2", "check_gpipe_microbatches"]
LAB = "lab5_memory_and_model_parallel"


# ---------------------------------------------------------------------------- exercise 1: tensor parallelism
def _tp_run(answer, case):
    """How many times each weight and bias was cut, and every rank's partial output summed (the all-reduce) + b2."""
    (column_shard, row_shard), (block, x, n) = answer, case.args
    out = {"y": block[2].bias.detach().clone(), "shapes": {}}
    for r in range(n):
        (w1, b1), w2 = column_shard(block[0], r, n), row_shard(block[2], r, n)
        for k, t, whole in (("w1", w1, block[0].weight), ("b1", b1, block[0].bias), ("w2", w2, block[2].weight)):
            ok = torch.is_tensor(t) and t.dim() == whole.dim() and 0 not in t.shape
            out[k] = tuple(a // b for a, b in zip(whole.shape, t.shape)) if ok else None
            out["shapes"][k] = tuple(t.shape) if torch.is_tensor(t) else type(t).__name__
        try:
            out["y"] = out["y"] + F.gelu(x @ w1.T + b1) @ w2.T
        except (RuntimeError, TypeError, AttributeError):
            out["y"] = None
    return out


def _tp_compare(got, want):
    """The first piece cut otherwise than world_size asks, by its shape, else whether the partial outputs add up."""
    for k, what in (("w1", "column_shard's weight"), ("b1", "column_shard's bias"), ("w2", "row_shard's weight")):
        if got[k] != want[k]:
            return f"returned {what} of shape {got['shapes'][k]} where {want['shapes'][k]} was expected"
    if got["y"] is None or difference(got["y"], want["y"]) is not None:
        return "gave slices whose partial outputs do not add up to the whole MLP's output"
    return None


def _col(linear, r, n, dim=0, bias=True):
    return linear.weight.detach().chunk(n, dim)[r], linear.bias.detach().chunk(n if bias else 1, 0)[r if bias else 0]


def _row(linear, r, n, dim=1):
    return linear.weight.detach().chunk(n, dim)[r]


def _miscount(o, key, dim):
    """The weight ``key`` is cut along its right dim ``dim`` only, into another number of pieces than world_size."""
    cuts = o.got[key]
    return cuts[1 - dim] == 1 and cuts[dim] not in (1, o.want[key][dim])


TENSOR_PARALLEL = Exercise(
    name="tensor_parallel",
    answer=("column_shard", "row_shard"),
    run=_tp_run,
    compare=_tp_compare,
    cases=lambda: [
        Case(
            (
                mlp(16, 2, in_features=8, out_features=8, activation="gelu", seed=n),
                torch.randn(5, 8, generator=torch.Generator().manual_seed(n)),
                n,
            ),
            label=f"{n} rank" + "s" * (n > 1),
        )
        for n in (1, 2, 4)
    ],
    oracle=(tp.column_shard, tp.row_shard),
    refuse=("utils.parallel.tensor_parallel",),
    hint="rank r keeps the SAME slice r of the hidden units in both layers, in equal contiguous slices (nn.Linear's "
    "weight is [out_features, in_features])",
    passed="1, 2 and 4 ranks: the partial outputs add up to the whole MLP",
    mistakes=[
        _m(
            "column_shard must return a (weight, bias) pair of tensors, row_shard one weight. Try: return this rank's "
            "slices of the weight and bias from column_shard, of the weight from row_shard",
            (lambda lin, r, n: [t.tolist() for t in _col(lin, r, n)], _row),
            lambda o: "unpack" in o.error or str in map(type, o.got["shapes"].values()),
        ),
        _m(
            "a weight is cut into the wrong number of pieces. Try: cut it into world_size equal pieces with "
            "Tensor.chunk(world_size, dim), not into pieces of world_size rows",
            (
                lambda lin, r, n: (lin.weight.detach().split(n)[r], lin.bias.detach().split(n)[r]),
                lambda lin, r, n: lin.weight.detach().split(n, 1)[r],
            ),
            lambda o: None not in (o.got["w1"], o.got["w2"]) and (_miscount(o, "w1", 0) or _miscount(o, "w2", 1)),
        ),
        _m(
            "column_shard's weight is not cut by output features. Try: a column-parallel layer splits the OUTPUT "
            "features (nn.Linear's weight is [out, in])",
            (partial(_col, dim=1, bias=False), _row),
            lambda o: o.got["w1"] and o.got["w1"][0] == 1 != o.want["w1"][0],
        ),
        _m(
            "column_shard's bias is not cut like its weight. Try: keep the bias entries of the hidden units this rank "
            "computes",
            (partial(_col, bias=False), _row),
            lambda o: o.got["b1"] != o.want["b1"],
        ),
        _m(
            "row_shard's weight is not cut by input features. Try: a row-parallel layer splits its INPUT features, the "
            "hidden units this rank computed",
            (_col, partial(_row, dim=0)),
            lambda o: o.got["w2"] and o.got["w2"][1] == 1 != o.want["w2"][1],
        ),
    ],
)
check_tensor_parallel = TENSOR_PARALLEL.checker(
    "``column_shard(linear, rank, world_size) -> (weight, bias)``, ``row_shard(linear, rank, world_size) -> weight``."
)


# ---------------------------------------------------------------------------- exercise 2: ZeRO memory
def _zero(p, n, s, b=2):
    """Mixed-precision Adam's bytes per GPU: ``b``-byte parameters and gradients, 12 bytes of optimizer state."""
    return b * p / (n if s >= 3 else 1) + b * p / (n if s >= 2 else 1) + 12 * p / (n if s >= 1 else 1)


ZERO_MEMORY = Exercise(
    name="zero_memory",
    oracle=lambda p, n, s: zero_bytes(p, n, s)["total"],
    rtol=1e-9,
    atol=0,
    cases=lambda: [Case((10**6 + 3, n, s), label=f"stage {s} on {n} GPU(s)") for n in (1, 2, 8, 64) for s in range(4)],
    hint="bytes per parameter: parameters 2, gradients 2, optimizer state 12; divide by N the parts the stage shards",
    passed="every stage on 1 to 64 GPUs",
    refuse=("utils.parallel.zero_bytes", "utils.diagrams.zero_segments"),
    refuse_hint="add up the bytes of parameters, gradients and optimizer state yourself",
    mistakes=[
        _m(
            "you divided by N at stage 0, but stage 0 is plain DDP. Try: at stage 0 every GPU holds all 16 bytes per "
            "parameter",
            lambda p, n, s: 16 * p / n,
        ),
        _m(
            "the bytes look like fp32 parameters and gradients. Try: in mixed precision they take 2 bytes each; the "
            "fp32 master copy is in the 12 optimizer bytes",
            partial(_zero, b=4),
        ),
        _m(
            "you returned the bytes of another ZeRO stage. Try: stage 1 shards the optimizer state (12 bytes), stage 2 "
            "also the gradients (2), stage 3 also the parameters (2)",
            lambda p, n, s: _zero(p, n, 2 if s == 1 else s),
            lambda o: any(abs(o.got - _zero(*o.case.args[:2], k)) < 1 for k in range(4) if k != o.case.args[2]),
        ),
    ],
)
check_zero_memory = ZERO_MEMORY.checker("``zero_memory(n_params, world_size, stage)``: bytes per GPU, mixed precision.")


# ---------------------------------------------------------------------------- exercise 3: ZeRO-2 by hand
# What a collective says when a tensor's length is no multiple of the world size (gloo's, NCCL's, torch's checks)
_SIZE_ERRORS = ("worldSize", "world_size", "divisible", "tensor size", "sizes")


def _zero2_cases(ctx):
    """Two MLPs, 44 and 57 parameters: on 2 or 3 ranks, one divides by the world size and the other does not."""
    models = {44: (4, 6, 2), 57: (5, 6, 3)}
    odd = lambda n: "" if n % ctx.world_size == 0 else f", which does not divide by {ctx.world_size} ranks,"
    return [
        Case((sizes, kind, ctx), label=f"the {n}-parameter MLP{odd(n)} with {kind} on {ctx.world_size} ranks")
        for n, sizes in models.items()
        for kind in ("SGD", "Adam")
    ]


def _zero2_run(answer, case):
    """3 steps, each on this rank's half of a batch; per step the flat parameters, the bytes the collectives send
    (a ring's), the gradients left on the model; then the optimizer's state bytes."""
    (make_optimizer, step), ((d_in, width, d_out), kind, ctx) = answer, case.args
    model = mlp(width, 2, in_features=d_in, out_features=d_out, activation="tanh", seed=d_in + width).to(ctx.device)
    g, rows, out = torch.Generator().manual_seed(d_in), slice(4 * ctx.rank, 4 * ctx.rank + 4), defaultdict(list)
    try:
        kw = {"lr": 0.1, "momentum": 0.9} if kind == "SGD" else {"lr": 0.01}
        opt = make_optimizer(model, torch.optim.SGD if kind == "SGD" else torch.optim.Adam, **kw)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"zero2_optimizer returned {type(opt).__name__}, not a torch.optim optimizer")
        held = [p for group in opt.param_groups for p in group["params"]]
        for _ in range(3):
            x, y = torch.randn(8, d_in, generator=g), torch.randn(8, d_out, generator=g)
            model.zero_grad(set_to_none=True)
            F.mse_loss(model(x[rows].to(ctx.device)), y[rows].to(ctx.device)).backward()
            with CommCounter(ctx.world_size) as comm:
                step(model, opt)
            out["params"].append(torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()]))
            out["sent"].append(comm.sent)
            out["calls"].append(dict(comm.calls))
            out["grads"].append(sum(p.grad.numel() for p in model.parameters() if p.grad is not None))
    except Exception as e:  # which case: the no-padding mistake raises on the MLP that does not divide only
        raise RuntimeError(f"on {case.label}: {type(e).__name__}: {e}") from e
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    view = sum(p.untyped_storage().nbytes() - p.numel() * p.element_size() for p in held) > 0  # a shard that shares
    return dict(
        out,
        numel=sum(p.numel() for p in model.parameters()),
        held=sum(p.numel() for p in held),
        view=view,
        state=sum(v.numel() * v.element_size() for v in state),
    )


def _flat(tensors, world, pad="end"):
    """One new flat vector padded with zeros to a multiple of ``world`` at the end (mistakes: "front", or "")."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    fill = world - flat.numel() % world if pad == "extra" else -flat.numel() % world  # "extra": a whole shard more
    return F.pad(flat, (fill, 0) if pad == "front" else (0, fill)) if pad else flat


def _copy_back(tensors, full):
    """``full``'s pieces from offset 0 into ``tensors``, in order, in place; the padding, at the end, left out."""
    sizes = [t.numel() for t in tensors]
    with torch.no_grad():
        for t, piece in zip(tensors, full[: sum(sizes)].split(sizes)):
            t.copy_(piece.view_as(t))


def _zero2_optimizer(model, optimizer_class, pad="end", copy=True, whole=False, **kwargs):
    """The reference (the defaults): an optimizer over this rank's own copy of its slice of the padded flat
    parameters; each keyword makes a named mistake (``whole``: over the whole model)."""
    world = dist.get_world_size()
    shard = _flat(model.parameters(), world, pad).chunk(world)[dist.get_rank()]
    return optimizer_class(
        model.parameters() if whole else [(shard.clone() if copy else shard).requires_grad_()], **kwargs
    )


def _zero2_step(
    model, opt, power=1, pad="end", keep=False, first=False, gather=True, copy=True, bcast=False, whole=False, by=None
):
    """The reference (the defaults): reduce-scatter the flat gradient, step the shard, all-gather, copy back.
    Each keyword makes one named mistake (``whole``: average every gradient, then step the whole model; ``by``: a
    divisor written into the code)."""
    world, params, shard = dist.get_world_size(), list(model.parameters()), opt.param_groups[0]["params"][0]
    grads = _flat([p.grad for p in params], world, pad)
    for p in params:
        p.grad = p.grad if keep or whole else None
    shard = grads.new_empty(grads.numel() // world) if whole else shard
    shard.grad = torch.empty_like(shard)
    dist.reduce_scatter_tensor(shard.grad, grads)
    _ = dist.broadcast(torch.zeros_like(shard), 0) if bcast else None
    shard.grad /= (by or world) ** power
    if whole:
        dist.all_gather_into_tensor(grads, shard.grad)
        return _copy_back([p.grad for p in params], grads) or opt.step()
    _ = None if first else opt.step()
    full = torch.empty_like(grads) if gather else _flat(params, world, pad)
    if gather:
        dist.all_gather_into_tensor(full, shard.detach())
    else:  # without the all-gather only my shard is new
        full.chunk(world)[dist.get_rank()].copy_(shard.detach())
    _ = opt.step() if first else None
    _ = _copy_back(params, full) if copy else None


def _zero2_compare(got, want):
    """Which rank's parameters first differ from one process's, after which step; else any other difference."""
    for r, (g, w) in enumerate(zip(got, want)):
        for step, (a, b) in enumerate(zip(g["params"], w["params"])):
            if difference(a, b):
                return f"left parameters on rank {r} that differ from one process's after step {step + 1}"
    return difference(got, want)


_REF, _step = _zero2_optimizer, lambda **wrong: partial(_zero2_step, **wrong)  # partials: the ranks unpickle them
ZERO2 = Exercise(
    name="zero2",
    answer=("zero2_optimizer", "zero2_step"),
    oracle=(_zero2_optimizer, _zero2_step),
    ranks=3,
    cases=_zero2_cases,
    run=_zero2_run,
    timeout_s=180,
    compare=lambda got, want: _SEEN.append(got) or _zero2_compare(got, want),
    refuse=(
        "torch.distributed.all_reduce",
        "torch.distributed.optim.ZeroRedundancyOptimizer",
        "torch.distributed.fsdp.fully_shard",
        "torch.distributed.fsdp.FullyShardedDataParallel",
        "torch.nn.parallel.DistributedDataParallel",
        "utils.parallel",
        "utils.parallel.shard.shard_model",
    ),
    refuse_hint="write the step from dist.reduce_scatter_tensor, an optimizer over your shard, and "
    "dist.all_gather_into_tensor",
    hint="rank r's shard is slice r of the padded flat vector cut into N equal slices, in both the reduce-scatter and "
    "the all-gather, and its gradient is the MEAN over the ranks",
    passed="3 and 2 processes, two MLPs, SGD with momentum and Adam: every step equals one process's, 1/N of the "
    "optimizer state, only the shard's gradient after each step, and DDP's traffic",
    mistakes=[
        _m(
            "your code failed on the MLP whose parameter count does not divide by the number of ranks: a collective "
            "got a buffer that is not padded to a multiple of the world size. Try: pad the flat vectors with zeros at "
            "the end to a multiple of the world size (torch.distributed gives it), and give the all-gather an output "
            "of that padded size",
            (partial(_REF, pad=""), _step(pad="")),
            lambda o: "does not divide" in o.error and any(w in o.error for w in _SIZE_ERRORS),
        ),
        _m(
            "after a step the ranks hold different parameters. Try: all-gather the updated shards and copy the full "
            "vector into the parameters, on every rank",
            (_REF, _step(gather=False)),
            lambda o: any(difference(o.got[0]["params"], r["params"]) for r in o.got[1:]),
        ),
        _m(
            "the model's parameters never change. Try: after the step, all-gather the shards and copy them back into "
            "the parameters in place, without autograd",
            (_REF, _step(copy=False)),
        ),
        _m(
            "the parameters are one step behind: you gathered before stepping. Try: step the optimizer on your shard "
            "first, then all-gather",
            (_REF, _step(first=True)),
        ),
        _m(
            "the parameters moved as if the gradients were N times too large, N the number of ranks: reduce-scatter "
            "sums. Try: divide your shard's gradient by the world size",
            (_REF, _step(power=0)),
        ),
        _m(
            "the parameters moved as if the gradients were N times too small, N the number of ranks: they were "
            "averaged twice. Try: reduce-scatter with a sum, then divide by the world size once",
            (_REF, _step(power=2)),
        ),
        _m(
            "the MLP whose parameter count does not divide by the number of ranks went wrong where the other was "
            "right: the padding sits at the front. Try: pad at the END, so the parameters start at offset 0",
            (partial(_REF, pad="front"), _step(pad="front")),
        ),
        _m(
            "the gradients were divided by 2, not by the number of ranks. Try: divide by the world size: the check "
            "runs on 3 and on 2 processes",
            (_REF, _step(by=2)),
        ),
        _m(
            "a rank's shard is a view into the whole flat vector, which then stays in memory. Try: copy your slice "
            "into a tensor of its own",
            (partial(_REF, copy=False), _zero2_step),
            lambda o: any(r["view"] for r in o.got),
        ),
        _m(
            "a rank's optimizer holds the whole model's state. Try: give the optimizer only your shard, a new leaf "
            "tensor of 1/N of the padded elements",
            (partial(_REF, whole=True), _step(whole=True)),
            lambda o: o.got[0]["held"] >= o.got[0]["numel"],
        ),
        _m(
            "after its step a rank still holds the model's full gradients. Try: free each parameter's gradient once it "
            "is flattened for the reduce-scatter",
            (_REF, _step(keep=True)),
            lambda o: any(any(r["grads"]) for r in o.got),
        ),
        _m(
            "a rank sent more or fewer bytes per step than DDP's all-reduce. Try: one reduce-scatter of the padded "
            "flat gradient and one all-gather of your shard per step, and no other collective",
            (_REF, _step(bcast=True)),
            lambda o: o.got[0]["calls"] != o.want[0]["calls"],
        ),
        _m(
            "your collectives move more padding than needed. Try: pad the flat vectors with the fewest zeros that make "
            "a multiple of the world size (none when it already divides)",
            (partial(_REF, pad="extra"), _step(pad="extra")),
            lambda o: o.got[0]["sent"] != o.want[0]["sent"],
        ),
    ],
)
_SEEN: list = []  # what the answer measured, case by case (the compare sees it): check_zero2 hands back the last


def check_zero2(zero2_optimizer: Callable, zero2_step: Callable) -> dict:
    """ZeRO-2 by hand (Rajbhandari et al. 2019, arXiv 1910.02054) on 3, then 2 processes against one process's
    torch.optim; returns what it measured on 2 processes, on the 57-parameter MLP with Adam."""
    _SEEN.clear()
    ZERO2.checker(world_sizes=(3, 2))(zero2_optimizer, zero2_step)
    last = _SEEN[-1]
    n, numel = len(last), last[0]["numel"]
    return dict(
        world_size=n,
        numel=numel,
        padded=-(-numel // n) * n,
        state_bytes=[r["state"] for r in last],
        full_state_bytes=8 * numel,
        sent_bytes=last[0]["sent"][-1],
        ddp_sent_bytes=ring_bytes("all_reduce", 4 * numel, n),
    )


# ---------------------------------------------------------------------------- exercise 4: GPipe's micro-batch loop
def _gpipe_cases():
    g = torch.Generator().manual_seed(1)
    stages = lambda m: [mlp(12, 2, in_features=6, out_features=o, activation="tanh", seed=m + o) for o in (6, 3)]
    return [
        Case(
            (*stages(m), torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g), m),
            label=f"{m} micro-batch(es)",
        )
        for m in (1, 2, 4)
    ]


def _gpipe_run(answer, case):
    """The step, on stages holding gradients from before: the gradients it added, its loss, and the order of
    stage 0's forwards (F) and backwards (B), and whether stage 1 ever ran on a tensor with stage 0's history."""
    s0, s1, x, y, m = case.args
    params, order, g = [*s0.parameters(), *s1.parameters()], [], torch.Generator().manual_seed(m)
    before = [torch.randn(p.shape, generator=g) for p in params]
    for p, b in zip(params, before):
        p.grad = b.clone()
    hooks = [
        s0.register_forward_pre_hook(lambda *a: order.append("F")),
        params[0].register_hook(lambda _: order.append("B")),
        s1.register_forward_pre_hook(lambda m, a: order.append("" if a[0].is_leaf else "T")),
    ]
    try:
        loss = answer(s0, s1, x, y, m)
    finally:
        [h.remove() for h in hooks]
    added = [((b if p.grad is None else p.grad) - b).flatten() for p, b in zip(params, before)]
    n0 = len(list(s0.parameters()))
    return {
        "loss": loss if loss is None else float(loss),
        "stage0 gradients": torch.cat(added[:n0]),
        "stage1 gradients": torch.cat(added[n0:]),
        "order": "".join(order).replace("T", ""),
        "through": "T" in order,
    }


def _full_batch(s0, s1, x, y, m):
    loss = ((s1(s0(x)) - y) ** 2).mean()
    loss.backward()
    return loss.item()


def _gpipe(s0, s1, x, y, m, cut="leaf", div=True, fb=False, zero=False, back=True, total=False):
    """GPipe's micro-batch loop (the defaults); each keyword makes one named mistake."""
    if zero:
        s0.zero_grad(), s1.zero_grad()
    losses, todo = [], []

    def backward(out0, boundary, loss):
        loss.backward(retain_graph=cut == "retain")
        if back:
            out0.backward(out0.grad if cut == "retain" else boundary.grad)
        losses.append(loss.item())

    for xi, yi in zip(x.chunk(m), y.chunk(m)):
        out0 = s0(xi)
        boundary = {"leaf": out0.detach().requires_grad_(), "none": out0.detach(), "retain": out0}[cut]
        out0.retain_grad() if cut == "retain" else None
        squares = (s1(boundary) - yi) ** 2
        todo.append((out0, boundary, (squares.sum() if total else squares.mean()) / (m if div else 1)))
        if fb:
            backward(*todo.pop())
    for item in todo:
        backward(*item)
    return sum(losses)


_GRADS = ("stage0 gradients", "stage1 gradients")
_NO_BOUNDARY_GRAD = ("implicitly created only for scalar outputs", "does not require grad", "a second time")
GPIPE = Exercise(
    name="gpipe_microbatches",
    cases=_gpipe_cases,
    oracle=_full_batch,
    run=_gpipe_run,
    compare=lambda got, want: difference(*({k: o[k] for k in ("loss", *_GRADS)} for o in (got, want))),
    hint="backpropagate stage 0's output with the gradient of the leaf that stage 1 received, once per micro-batch",
    passed="1, 2 and 4 micro-batches: the GPipe order, and the gradients of one full-batch step",
    mistakes=[
        _m(
            "stage0's backward got no gradient from the boundary: it is not a leaf that requires grad, or stage0's "
            "backward ran before the loss's. Try: make the boundary a leaf that requires grad (cut off stage0's "
            "graph), run the loss's backward, then stage0's with the boundary's .grad",
            partial(_gpipe, cut="none"),
            lambda o: any(k in o.error for k in _NO_BOUNDARY_GRAD),
        ),
        _m(
            "stage0 ran a different number of forwards than there are micro-batches. Try: cut the batch into m equal "
            "micro-batches and run each through stage0 once",
            lambda *a: _gpipe(*a[:4], 1),
            lambda o: o.got["order"].count("F") != o.case.args[4],
            mechanism=True,
        ),
        _m(
            "the forwards and backwards are interleaved, but GPipe runs all m forwards, then all m backwards. Try: a "
            "loop of all forwards, keeping each boundary and loss, then a loop of all backwards",
            partial(_gpipe, fb=True),
            lambda o: "B" in o.got["order"][: o.got["order"].rfind("F")],
            mechanism=True,
        ),
        _m(
            "each micro-batch's loss is a sum over its elements, not their mean. Try: take each micro-batch's mean "
            "squared error, as the full batch's loss does, then divide it by m",
            partial(_gpipe, total=True),
        ),
        _m(
            "the gradients are m times too large. Try: divide each micro-batch's loss by m: the full-batch loss is "
            "their mean",
            partial(_gpipe, div=False),
            lambda o: (
                o.case.args[4] > 1 and all(difference(o.got[k] / o.case.args[4], o.want[k]) is None for k in _GRADS)
            ),
        ),
        _m(
            "stage0's gradients are twice too large: the loss's backward already reached stage0. Try: cut the graph at "
            "the boundary with a new leaf holding stage0's values",
            partial(_gpipe, cut="retain"),
        ),
        _m(
            "stage1 ran on stage0's output itself, so one backward crossed both stages: across two devices it cannot. "
            "Try: hand stage1 a new leaf holding stage0's values, and backpropagate stage0 with that leaf's .grad",
            partial(_gpipe, cut="retain", back=False),
            lambda o: o.got["through"] and GPIPE.differs(o.got, o.want) is None,
            mechanism=True,
        ),
        _m(
            "stage0's parameters got no gradient. Try: after each loss's backward, backpropagate stage0's output with "
            "the gradient that arrived at the boundary",
            partial(_gpipe, back=False),
            lambda o: not o.got["stage0 gradients"].any(),
        ),
        _m(
            "stage1's gradients differ from the full batch's: earlier gradients are gone. Try: do not zero the "
            "gradients inside: the caller zeroes them, and each backward adds to them",
            partial(_gpipe, zero=True),
        ),
        _m(
            "the returned loss differs from the full batch's. Try: return the sum of the m micro-batch losses, each "
            "already divided by m, as a float",
            lambda *a: _gpipe(*a) / a[4],
            lambda o: (
                all(difference(o.got[k], o.want[k]) is None for k in _GRADS)
                and (o.got["loss"] is None or difference(o.got["loss"], o.want["loss"]))
            ),
        ),
    ],
)
check_gpipe_microbatches = GPIPE.checker("``gpipe_microbatches(stage0, stage1, x, y, m)``: one GPipe step, its loss.")
