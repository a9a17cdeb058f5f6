"""Self-checks for stage 5: memory and model parallelism (solutions/lab5_memory_and_model_parallel.ipynb).

Three run in this process, in a second or so: the tensor-parallel check adds the ranks' partial
sums itself (that is what the all-reduce does), the pipeline check runs both stages here.
:func:`check_zero2` runs ZeRO-2 on 2 real processes: like lab 3's checks (``utils/checks/ddp.py``)
it sends the source of your functions, and of the notebook helpers they call, to the processes,
which define them again with ``torch``, ``dist`` (``torch.distributed``), ``nn``, ``F``, ``math``
and ``os`` in scope.
"""

from __future__ import annotations

import inspect
import math
import re
import textwrap
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..models import mlp
from ._common import CheckFailed, _call, _close, _fail, _passed, global_names  # noqa: F401

__all__ = ["check_tensor_parallel", "check_zero_memory", "check_zero2", "check_gpipe_microbatches"]


# ---------------------------------------------------------------------------- exercise 1


def _mlp(d, hidden, seed):
    torch.manual_seed(seed)  # the weights, then the check's inputs, from the global RNG
    return mlp(hidden, 2, in_features=d, out_features=d, activation="gelu")


def check_tensor_parallel(column_shard: Callable[..., Any], row_shard: Callable[..., Any]) -> None:
    """``column_shard(linear, rank, world_size) -> (weight, bias)`` and
    ``row_shard(linear, rank, world_size) -> weight``: the Megatron split of an MLP. The check
    runs every rank's part here, adds the partial outputs (the all-reduce g) and compares with
    the whole MLP, for 1, 2 and 4 ranks."""
    name = "tensor parallel MLP"
    d, hidden = 8, 16
    for world in (1, 2, 4):
        block = _mlp(d, hidden, seed=world)
        x = torch.randn(5, d)
        want = block(x).detach()
        partial = torch.zeros(5, d)
        for rank in range(world):
            w1, b1 = _call(name, column_shard, block[0], rank, world)
            w2 = _call(name, row_shard, block[2], rank, world)
            if not (torch.is_tensor(w1) and torch.is_tensor(b1) and torch.is_tensor(w2)):
                _fail(
                    name,
                    "column_shard must return (weight, bias) and row_shard a weight, all tensors",
                    "return this rank's slice of the weight and of the bias from column_shard, and this rank's "
                    "slice of the weight from row_shard",
                )
            if tuple(w1.shape) != (hidden // world, d):
                hint = (
                    "you split the input dimension: a column-parallel layer splits the OUTPUT features, "
                    "so each rank computes some hidden units from the whole input; nn.Linear stores its "
                    "weight as [out, in], so cut the dimension that counts the outputs"
                    if tuple(w1.shape) == (hidden, d // world)
                    else "each rank keeps hidden/N of the output features and every input feature"
                )
                _fail(
                    name,
                    f"column shard of a Linear({d}, {hidden}) on {world} ranks has shape {tuple(w1.shape)}, "
                    f"expected {(hidden // world, d)}",
                    hint,
                )
            if tuple(b1.shape) != (hidden // world,):
                _fail(
                    name,
                    f"column shard's bias has shape {tuple(b1.shape)}, expected {(hidden // world,)}",
                    "the bias belongs to the output features: each rank adds only the entries of the "
                    "hidden units it computes, cut the same way as the weight",
                )
            if tuple(w2.shape) != (d, hidden // world):
                hint = (
                    "you split the output dimension: a row-parallel layer splits its INPUT features, the "
                    "hidden units this rank computed, so that it returns a partial sum of every output"
                    if tuple(w2.shape) == (d // world, hidden)
                    else "each rank multiplies only its hidden/N hidden units, and produces every output feature"
                )
                _fail(
                    name,
                    f"row shard of a Linear({hidden}, {d}) on {world} ranks has shape {tuple(w2.shape)}, "
                    f"expected {(d, hidden // world)}",
                    hint,
                )
            h = nn.functional.gelu(x @ w1.detach().T + b1.detach())
            partial += h @ w2.detach().T
        got = partial + block[2].bias.detach()
        if not _close(got, want, rtol=1e-5, atol=1e-5):
            _fail(
                name,
                f"on {world} ranks the summed partial outputs differ from the whole MLP by "
                f"{(got - want).abs().max().item():.3g}",
                "rank r must take the SAME slice r of the hidden units in both layers: its outputs of the "
                "first layer (weight and bias) and its inputs of the second, in equal contiguous slices",
            )
    _passed(name, "1, 2 and 4 ranks: partial sums add up to the whole MLP")


# ---------------------------------------------------------------------------- exercise 2


def _zero(p, n, stage, param=2, grad=2):
    return (
        param * p / (n if stage >= 3 else 1) + grad * p / (n if stage >= 2 else 1) + 12 * p / (n if stage >= 1 else 1)
    )


def check_zero_memory(zero_memory: Callable[..., Any]) -> None:
    """``zero_memory(n_params, world_size, stage)``: bytes per GPU for mixed-precision Adam (2-byte
    parameters, 2-byte gradients, 12 bytes of fp32 optimizer state per parameter) under ZeRO
    stage 0 (DDP), 1, 2 or 3."""
    name = "zero_memory"
    P = 1_000_000
    for n in (1, 2, 8, 64):
        for stage in (0, 1, 2, 3):
            got = _call(name, zero_memory, P, n, stage)
            want = _zero(P, n, stage)
            if got is None:
                _fail(name, "returned None", "return the number of bytes")
            if _close(got, want, rtol=1e-9, atol=0):
                continue
            where = f"stage {stage}, {n} GPUs"
            if stage == 0 and _close(got, 16 * P / n, rtol=1e-9, atol=0):
                _fail(
                    name,
                    f"{where}: you divided by N, but stage 0 is plain DDP",
                    "at stage 0 every GPU holds all 16 bytes per parameter",
                )
            if _close(got, _zero(P, n, stage, param=4, grad=4), rtol=1e-9, atol=0):
                _fail(
                    name,
                    f"{where}: {got:,.0f} bytes looks like fp32 parameters and gradients",
                    "in mixed precision the parameters and gradients are bf16/fp16: 2 bytes each; the fp32 master copy is part of the 12 optimizer bytes",
                )
            for other in (0, 1, 2, 3):
                if other != stage and _close(got, _zero(P, n, other), rtol=1e-9, atol=0):
                    _fail(
                        name,
                        f"{where}: you returned stage {other}'s value ({got:,.0f} bytes, expected {want:,.0f})",
                        "stage 1 shards the optimizer state (12 bytes), stage 2 also the gradients (2), stage 3 also the parameters (2)",
                    )
            _fail(
                name,
                f"{where}: got {got:,.0f} bytes, expected {want:,.0f}",
                "bytes per parameter: parameters 2, gradients 2, optimizer state 12; divide by N the parts the stage shards",
            )
    _passed(
        name,
        f"every stage on 1 to 64 GPUs; e.g. 7B parameters, stage 3 on 8 GPUs: {_zero(7e9, 8, 3) / 1e9:.0f} GB each",
    )


# ---------------------------------------------------------------------------- exercise 3: ZeRO-2 by hand

ZERO2_WORLD = 2
ZERO2_STEPS = 3
# (label, (in, hidden, out) of a two-layer MLP): 44 parameters divide by 2 ranks, 57 do not
ZERO2_MODELS = (("44-parameter MLP", (4, 6, 2)), ("57-parameter MLP", (5, 6, 3)))
ZERO2_OPTIMIZERS = ("sgd", "adam")  # SGD with momentum 0.9, Adam
STATE_BYTES_PER_ELEMENT = {"sgd": 4, "adam": 8}  # fp32: the momentum; Adam's two moments
_ZERO2_BATCH = 8
_CASE = "zero2 case "
_REFUSED = {  # names in your code -> what they are
    "ZeroRedundancyOptimizer": "ZeroRedundancyOptimizer (PyTorch's ZeRO-1)",
    "fully_shard": "fully_shard (FSDP2, PyTorch's ZeRO-3)",
    "FSDP": "FSDP (PyTorch's ZeRO-3)",
    "FullyShardedDataParallel": "FullyShardedDataParallel (PyTorch's ZeRO-3)",
    "DistributedDataParallel": "DistributedDataParallel (DDP)",
    "DDP": "DistributedDataParallel (DDP)",
    "all_reduce": "dist.all_reduce",
}


def _zero2_model(sizes):
    d_in, width, d_out = sizes
    return mlp(width, 2, in_features=d_in, out_features=d_out, activation="tanh", seed=sum(sizes))


def _zero2_optimizer_args(kind):
    if kind == "sgd":
        return torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}
    return torch.optim.Adam, {"lr": 0.01}


def _zero2_batches(sizes):
    g = torch.Generator().manual_seed(7 + sum(sizes))
    return [
        (torch.randn(_ZERO2_BATCH, sizes[0], generator=g), torch.randn(_ZERO2_BATCH, sizes[2], generator=g))
        for _ in range(ZERO2_STEPS)
    ]


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


def _zero2_reference(sizes, kind, grad_scale=1.0):
    """One process, ``torch.optim`` over the whole model, the whole batch: the flat parameters
    before training (index 0) and after each step. ``grad_scale``: a mistake's gradients."""
    model = _zero2_model(sizes)
    cls, kw = _zero2_optimizer_args(kind)
    opt = cls(model.parameters(), **kw)
    out = [_flat(model)]
    for x, y in _zero2_batches(sizes):
        opt.zero_grad(set_to_none=True)
        (grad_scale * nn.functional.mse_loss(model(x), y)).backward()
        opt.step()
        out.append(_flat(model))
    return out


def _names(code) -> set:
    """Global and attribute names a code object (and those nested in it) uses; strings left out,
    so a docstring that mentions all_reduce is no call to it."""
    names = set(code.co_names)
    for c in code.co_consts:
        if hasattr(c, "co_names"):
            names |= _names(c)
    return names


def _notebook_functions(fns) -> list:
    """``fns`` and the functions defined in the notebook (``__main__``) they call, helpers first."""
    out, seen = [], set()

    def visit(fn):
        if id(fn) in seen:
            return
        seen.add(id(fn))
        glb = getattr(fn, "__globals__", {})
        for n in sorted(global_names(fn.__code__)):
            obj = glb.get(n)
            if getattr(obj, "__module__", None) in ("__main__", "__mp_main__") and hasattr(obj, "__code__"):
                visit(obj)
        out.append(fn)

    for fn in fns:
        visit(fn)
    return out


def _zero2_source(name, fns) -> list:
    """[(function name, source)] of ``fns`` and their notebook helpers, after refusing what they
    must not use."""
    for fn in fns:
        mod = getattr(fn, "__module__", "") or ""
        if mod.startswith(("utils", "torch")):
            _fail(
                name,
                f"{mod}.{getattr(fn, '__qualname__', fn)} is the library's code, not yours",
                "write the function yourself in the exercise cell and pass that",
            )
        if not callable(fn) or not hasattr(fn, "__code__"):
            _fail(
                name, f"expected a function, got {type(fn).__name__}", "pass your function itself, without calling it"
            )
    funcs = _notebook_functions(fns)
    sources = []
    for fn in funcs:
        try:
            sources.append((fn.__name__, textwrap.dedent(inspect.getsource(fn))))
        except (OSError, TypeError):
            _fail(
                name,
                f"could not read the source of {fn.__name__}",
                "define it with `def` in a notebook cell and run that cell",
            )
    if any("NotImplementedError" in src for _, src in sources):
        _call(name, _raise_not_implemented)
    for fn in funcs:
        glb = fn.__globals__
        for n in sorted(_names(fn.__code__)):
            if n in _REFUSED:
                what = _REFUSED[n]
                if n == "all_reduce":
                    _fail(
                        name,
                        f"{fn.__name__} calls dist.all_reduce, which ZeRO-2 replaces",
                        "reduce-scatter the gradients (dist.reduce_scatter_tensor), step your shard, then "
                        "all-gather the parameters (dist.all_gather_into_tensor)",
                    )
                _fail(
                    name,
                    f"{fn.__name__} uses {what}, the library's version of what this exercise builds",
                    "remove it; write the step from dist.reduce_scatter_tensor, an optimizer over your "
                    "shard, and dist.all_gather_into_tensor",
                )
        if "utils" in _names(fn.__code__):
            _fail(
                name,
                f"{fn.__name__} uses the course's utils",
                "write the steps yourself with torch and torch.distributed",
            )
        for n in sorted(global_names(fn.__code__)):
            obj = glb.get(n)
            omod = getattr(obj, "__module__", None) or getattr(obj, "__name__", "")
            if obj is not None and isinstance(omod, str) and omod.startswith("utils"):
                _fail(
                    name,
                    f"{fn.__name__} uses {n} from the course's utils",
                    "write the steps yourself with torch and torch.distributed",
                )
    return sources


def _raise_not_implemented():
    raise NotImplementedError


def _scope(sources: list) -> dict:
    """In a spawned process: define the student's functions again, with the lab's names in scope;
    each from its own source, so a traceback's line numbers count from its ``def``."""
    import math
    import os

    import torch.distributed as dist
    import torch.nn.functional as F

    scope = {"torch": torch, "dist": dist, "nn": nn, "F": F, "math": math, "os": os}
    for fn_name, source in sources:
        exec(compile(source, f"<your function {fn_name}>", "exec"), scope)
    return scope


def _zero2_worker(sources: list, optimizer_name: str, step_name: str) -> list:
    """One rank: every model and optimizer of the check, ZERO2_STEPS steps each, on this rank's
    half of the batch; per step the flat parameters, the collectives (CommCounter) and the bytes
    of gradients left on the model; at the end the optimizer's state bytes."""
    from utils import parallel
    from utils.parallel.shard import CommCounter

    parallel.exact_fp32()  # compared with one CPU process: no TF32 on a GPU
    ctx = parallel.setup(timeout=30)
    scope = _scope(sources)
    make_optimizer, step = scope[optimizer_name], scope[step_name]
    out = []
    for label, sizes in ZERO2_MODELS:
        for kind in ZERO2_OPTIMIZERS:
            try:
                model = _zero2_model(sizes).to(ctx.device)
                cls, kw = _zero2_optimizer_args(kind)
                opt = make_optimizer(model, cls, **kw)
                if not isinstance(opt, torch.optim.Optimizer):
                    raise TypeError(f"returned {type(opt).__name__}, not a torch.optim optimizer")
                rec = {"model": label, "optimizer": kind, "params": [], "traffic": [], "grad_bytes": []}
                held = [p for group in opt.param_groups for p in group["params"]]
                # a view keeps the whole flat vector it was cut from alive: more storage than elements
                rec["shard_storage"] = sum(p.untyped_storage().nbytes() for p in held)
                rec["shard_bytes"] = sum(p.numel() * p.element_size() for p in held)
                for x, y in _zero2_batches(sizes):
                    n = len(x) // ctx.world_size
                    rows = slice(ctx.rank * n, (ctx.rank + 1) * n)
                    model.zero_grad(set_to_none=True)
                    nn.functional.mse_loss(model(x[rows].to(ctx.device)), y[rows].to(ctx.device)).backward()
                    with CommCounter(ctx.world_size) as comm:
                        step(model, opt)
                    rec["params"].append(_flat(model))
                    rec["traffic"].append({"calls": dict(comm.calls), "sent": comm.sent})
                    rec["grad_bytes"].append(
                        sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
                    )
                rec["state_bytes"] = sum(
                    v.numel() * v.element_size()
                    for st in opt.state.values()
                    for v in st.values()
                    if torch.is_tensor(v) and v.dim() > 0
                )
                rec["optimizer_numel"] = sum(p.numel() for g in opt.param_groups for p in g["params"])
            except Exception as e:
                raise RuntimeError(f"{_CASE}[{label}, {kind}] {type(e).__name__}: {e}") from e
            out.append(rec)
    return out


def _zero2_launch(name, sources, optimizer_name, step_name):
    from utils import parallel

    try:
        return parallel.launch(
            _zero2_worker, ZERO2_WORLD, sources, optimizer_name, step_name, timeout=180, stream=False
        )
    except parallel.LaunchTimeout:
        _fail(
            name,
            "your functions hung: a rank waited in a collective the other rank never joined",
            "every rank must call the same collectives in the same order with tensors of the same size: "
            "one reduce-scatter, then one all-gather, per step",
        )
    except parallel.LaunchError as e:
        _zero2_crash(name, e)


def _zero2_crash(name, e):
    """Name the likely mistake behind a rank's exception, else show its traceback."""
    text = re.sub(r" \(rank\(s\) \[[\d, ]*\] failed too, after it\)", "", str(e).split("\n")[0])
    tb = (e.remote_traceback or "").split("\n\nThe above exception was the direct cause")[0]
    case = text.split(_CASE, 1)[1].split("]")[0] + "]" if _CASE in text else ""
    error = text.split("] ", 1)[1].split(". The other ranks")[0] if _CASE in text else text
    if "not a torch.optim optimizer" in text:
        _fail(
            name,
            f"zero2_optimizer {error.split(': ', 1)[-1]}",
            "return optimizer_class([your shard], **kwargs): an optimizer that holds only your shard",
        )
    if "AVG" in text:
        _fail(
            name,
            f"a reduce-scatter with ReduceOp.AVG failed on {case}: this backend cannot average",
            "reduce-scatter with the default op (a sum), then divide the shard's gradient by the world size",
        )
    if case.startswith("[57"):
        _fail(
            name,
            f"your code ran on the 44-parameter MLP but raised on the 57-parameter one ({error}): 57 does "
            f"not divide by {ZERO2_WORLD} ranks",
            "pad the flat vectors with zeros at the end, to a multiple of the world size, so every rank's "
            "shard has the same size (reduce-scatter and all-gather need equal shards); leave the padding "
            "out when you copy back into the parameters",
        )
    lines = re.findall(r'File "<your function (\w+)>", line (\d+)', tb)
    where = f" (line {lines[-1][1]} of {lines[-1][0]})" if lines else ""
    err = CheckFailed(
        f"{name}: your code raised on {case or 'a rank'}: {error}{where}. "
        f"Try: read the traceback printed below, fix the line it names, rerun the cells"
        + (f"\n\nTraceback from the rank:\n{tb}" if tb else "")
    )
    err.remote_traceback = tb
    raise err from None


def check_zero2(zero2_optimizer: Callable[..., Any], zero2_step: Callable[..., Any]) -> dict:
    """ZeRO-2 by hand (Rajbhandari et al. 2019, arXiv 1910.02054) on 2 processes.

    ``zero2_optimizer(model, optimizer_class, **kwargs)``: once, on every rank: an optimizer over
    this rank's 1/N shard of the model's flat parameters (padded with zeros to a multiple of N).
    ``zero2_step(model, optimizer)``: after ``loss.backward()`` on the rank's half of the batch:
    reduce-scatter the flat gradient (each rank gets the mean of its shard), free the model's
    gradients, step the shard, all-gather the shards back into every parameter.

    Two MLPs (44 and 57 parameters: 57 does not divide by 2), SGD with momentum and Adam, 3 steps
    each, compared after every step with one process running ``torch.optim`` on the whole batch.
    Also measured per rank: the bytes the collectives move (a ring's, ``CommCounter``), which
    must equal DDP's all-reduce of the padded vector; the optimizer state, which must be the
    ZeRO-2 share (state / N, plus padding); and the model's gradients after the step (none).
    Returns what it measured for the 57-parameter MLP with Adam."""
    from utils.parallel.shard import ring_bytes

    name = "zero2"
    sources = _zero2_source(name, (zero2_optimizer, zero2_step))
    ranks = _zero2_launch(name, sources, zero2_optimizer.__name__, zero2_step.__name__)
    world = ZERO2_WORLD
    i = 0
    for label, sizes in ZERO2_MODELS:
        numel = sum(p.numel() for p in _zero2_model(sizes).parameters())
        padded = -(-numel // world) * world
        for kind in ZERO2_OPTIMIZERS:
            recs = [r[i] for r in ranks]
            i += 1
            opt_name = "SGD with momentum" if kind == "sgd" else "Adam"
            where = f"{label}, {opt_name}"
            want = _zero2_reference(sizes, kind)
            for k in range(ZERO2_STEPS):
                got = [rec["params"][k] for rec in recs]
                if not _close(got[0], got[1], rtol=1e-5, atol=1e-7):
                    _fail(
                        name,
                        f"{where}: after step {k + 1} the two ranks hold different parameters",
                        "all-gather the updated shards into one full flat vector (dist.all_gather_into_tensor) "
                        "and copy it into every parameter, on every rank",
                    )
                if _close(got[0], want[k + 1]):
                    continue
                seen = recs[0]["params"]
                if all(_close(p, want[0]) for p in seen):
                    _fail(
                        name,
                        f"{where}: the model's parameters never change",
                        "after the optimizer's step, all-gather the shards and copy the full vector back into "
                        "the parameters in place, without autograd",
                    )
                if k == 0 and _close(got[0], want[0]):  # unchanged by the first step, changed later
                    _fail(
                        name,
                        f"{where}: the first step left the parameters as they were, and later steps are one "
                        "step behind: you gathered before stepping",
                        "step the optimizer on your shard first, then all-gather the updated shards",
                    )
                if kind == "sgd" and _close(got[0], _zero2_reference(sizes, kind, grad_scale=world)[k + 1]):
                    _fail(
                        name,
                        f"{where}: the parameters moved as if the gradients were {world}x too large: "
                        "reduce-scatter sums, it does not average",
                        "divide your shard's gradient by the world size after the reduce-scatter",
                    )
                if kind == "sgd" and _close(got[0], _zero2_reference(sizes, kind, grad_scale=1 / world)[k + 1]):
                    _fail(
                        name,
                        f"{where}: the parameters moved as if the gradients were {world}x too small: they were "
                        "averaged twice",
                        "divide once: reduce-scatter with its default operation (a sum), then divide by the world "
                        "size (not ReduceOp.AVG as well)",
                    )
                if numel % world:
                    _fail(
                        name,
                        f"{where}: the parameters differ from one process's after step {k + 1}, but the "
                        f"44-parameter MLP was right: {numel} does not divide by {world} ranks",
                        "pad the flat vectors with zeros at the END, to a multiple of the world size, so the "
                        "parameters start at offset 0 and the padding is the tail you leave out when you "
                        "copy back; every rank's shard has the same size",
                    )
                _fail(
                    name,
                    f"{where}: after step {k + 1} the parameters differ from one process's by "
                    f"{(got[0] - want[k + 1]).abs().max().item():.3g}",
                    "rank r's shard is elements [r * S, (r + 1) * S) of the padded flat vector (S = its length "
                    "/ N) in both the reduce-scatter and the all-gather; the shard's gradient is the MEAN over ranks",
                )
            for r, rec in enumerate(recs):
                if rec.get("shard_storage", 0) > rec.get("shard_bytes", 0):
                    _fail(
                        name,
                        f"{where}: rank {r}'s shard is a view into the whole padded flat vector "
                        f"({rec['shard_storage']} bytes kept alive for a {rec['shard_bytes']}-byte shard), "
                        "so every rank still holds a full copy of the parameters",
                        "make the shard a tensor of its own: copy your slice, so the full flat vector can be freed",
                    )
            per_element = STATE_BYTES_PER_ELEMENT[kind]
            state_want = per_element * padded // world
            for r, rec in enumerate(recs):
                if rec["state_bytes"] == state_want:
                    continue
                if rec["optimizer_numel"] >= numel or rec["state_bytes"] >= per_element * numel:
                    _fail(
                        name,
                        f"{where}: rank {r}'s optimizer holds {rec['state_bytes']} bytes of state, the whole "
                        f"model's ({per_element} x {numel}): you step the full parameters, not your shard",
                        f"give the optimizer only your shard (a new leaf tensor of {padded // world} elements) and "
                        "step only it; the all-gather brings the other ranks' updates",
                    )
                _fail(
                    name,
                    f"{where}: rank {r}'s optimizer holds {rec['state_bytes']} bytes of state, expected "
                    f"{state_want} ({per_element} bytes x {padded} padded elements / {world} ranks)",
                    "build the optimizer over one tensor: your shard of the padded flat parameters",
                )
            for r, rec in enumerate(recs):
                if any(rec["grad_bytes"]):
                    _fail(
                        name,
                        f"{where}: after the step rank {r} still holds the model's full gradients "
                        f"({rec['grad_bytes'][0]} bytes); ZeRO-2 keeps only its shard's",
                        "once the gradients are flattened for the reduce-scatter, free each parameter's "
                        "gradient (set p.grad to None)",
                    )
            sent_want = ring_bytes("all_reduce", 4 * padded, world)
            for r, rec in enumerate(recs):
                for k, t in enumerate(rec["traffic"]):
                    other = sorted(set(t["calls"]) - {"reduce_scatter", "all_gather"})
                    if other:
                        _fail(
                            name,
                            f"{where}: step {k + 1} on rank {r} called {', '.join(other)}",
                            "ZeRO-2's step needs exactly two collectives: a reduce-scatter of the gradients "
                            "and an all-gather of the parameters",
                        )
                    if not math.isclose(t["sent"], sent_want, rel_tol=1e-9):
                        _fail(
                            name,
                            f"{where}: rank {r} sent {t['sent']:.0f} bytes in step {k + 1} "
                            f"({t['calls']}); ZeRO-2 sends {sent_want:.0f}, as much as DDP's all-reduce of the "
                            f"{padded} padded elements",
                            "one reduce-scatter of the whole padded flat gradient and one all-gather of your "
                            "shard, per step, in float32",
                        )
    numel = sum(p.numel() for p in _zero2_model(ZERO2_MODELS[-1][1]).parameters())
    padded = -(-numel // world) * world
    last = [r[-1] for r in ranks]
    _passed(
        name,
        f"{world} processes, MLPs of 44 and 57 parameters, SGD with momentum and Adam: every step equals one "
        "process's; each rank holds 1/N of the optimizer state and gradients, and sends what DDP's all-reduce sends",
    )
    return {
        "world_size": world,
        "numel": numel,
        "padded": padded,
        "optimizer": "adam",
        "state_bytes": [rec["state_bytes"] for rec in last],
        "full_state_bytes": STATE_BYTES_PER_ELEMENT["adam"] * numel,
        "sent_bytes": last[0]["traffic"][-1]["sent"],
        "ddp_sent_bytes": ring_bytes("all_reduce", 4 * numel, world),
    }


# ---------------------------------------------------------------------------- exercise 4


def _stages(seed):
    torch.manual_seed(seed)
    return (
        mlp(12, 2, in_features=6, out_features=6, activation="tanh"),
        mlp(12, 2, in_features=6, out_features=3, activation="tanh"),
    )


def _loss(out, y):
    return (out - y).pow(2).mean()


# what autograd says when the boundary is no leaf that requires grad (its .grad is None)
_NO_BOUNDARY_GRAD = (
    "implicitly created only for scalar outputs",
    "does not require grad",
    "backward through the graph a second time",
)


def _lost(params, reference) -> bool:
    """True when the gradients held before the call were dropped: some parameter's gradient equals
    what the full batch alone gives, not what was there plus it."""
    for p, r in zip(params, reference):
        if p.grad is not None and _close(p.grad, r.grad, rtol=1e-4, atol=1e-6):
            return True
    return False


def check_gpipe_microbatches(gpipe_microbatches: Callable[..., Any]) -> None:
    """``gpipe_microbatches(stage0, stage1, x, y, m)``: one GPipe step in one process: all m
    forwards (each through stage0, across the boundary, through stage1, loss / m), then all m
    backwards (stage1, then the boundary's gradient into stage0). Returns the summed loss; the
    gradients in both stages equal one full-batch step's."""
    name = "gpipe_microbatches"
    for m in (1, 2, 4):
        s0, s1 = _stages(m)
        r0, r1 = _stages(m)
        g = torch.Generator().manual_seed(m)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        want_loss = _loss(r1(r0(x)), y)
        want_loss.backward()
        events = []
        first = next(s0.parameters())  # its gradient is computed once per stage-0 backward
        hooks = [
            s0.register_forward_pre_hook(lambda mod, inp, ev=events: ev.append("F")),
            first.register_hook(lambda grad, ev=events: ev.append("B")),
        ]
        params = [*s0.parameters(), *s1.parameters()]
        before = [torch.randn(p.shape, generator=g) for p in params]  # gradients from before the call
        for p, b in zip(params, before):
            p.grad = b.clone()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got_loss = _call(name, gpipe_microbatches, s0, s1, x, y, m)
        except CheckFailed as e:
            cause = str(e.__cause__ or "")
            if any(k in cause for k in _NO_BOUNDARY_GRAD):
                _fail(
                    name,
                    f"with m={m}, stage0's backward got no gradient from the boundary "
                    f"({type(e.__cause__).__name__}: {cause.splitlines()[0]})",
                    "the boundary activation must be a leaf that requires grad, so its .grad can be sent back: "
                    "cut it off stage0's graph, then ask it to require a gradient",
                )
            raise
        finally:
            for h in hooks:
                h.remove()
        for w in caught:  # anything else the student's code warned about is shown as usual
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        if any(p.grad is None for p in (*s0.parameters(), *s1.parameters())):
            which = "stage0" if any(p.grad is None for p in s0.parameters()) else "stage1"
            _fail(
                name,
                f"with m={m}, {which}'s parameters got no gradient",
                "backpropagate each micro-batch's loss through stage1, then stage0's output with the "
                "gradient that arrived at the boundary",
            )
        if _lost(params, (*r0.parameters(), *r1.parameters())):
            _fail(
                name,
                f"with m={m}, the gradients the stages held before the call are gone: your function zeroed them",
                "do not zero the gradients inside: the caller zeroes them once before the step, and the "
                "micro-batches accumulate into whatever is there",
            )
        n0 = sum(1 for _ in s0.parameters())
        g0 = torch.cat([(p.grad - b).flatten() for p, b in zip(params[:n0], before[:n0])])
        g1 = torch.cat([(p.grad - b).flatten() for p, b in zip(params[n0:], before[n0:])])
        w0 = torch.cat([p.grad.flatten() for p in r0.parameters()])
        w1 = torch.cat([p.grad.flatten() for p in r1.parameters()])
        if events.count("F") != m:
            _fail(
                name,
                f"with m={m}, stage0 ran {events.count('F')} forwards, expected {m}",
                "cut the batch into m equal micro-batches and run each through stage0 once",
            )
        if m > 1 and events != ["F"] * m + ["B"] * m:
            _fail(
                name,
                f"with m={m}, the order was {''.join(events)}; GPipe runs {'F' * m}{'B' * m}",
                "first a loop of all forwards (keep each micro-batch's boundary and loss in lists), then a loop of all backwards",
            )
        if _close(g1, m * w1, rtol=1e-4, atol=1e-6) and m > 1:
            _fail(
                name,
                f"with m={m}, the gradients are {m} times too large",
                "divide each micro-batch's loss by m: the full-batch loss is the mean of the m micro-batch losses",
            )
        if _close(g0, 2 * w0, rtol=1e-4, atol=1e-6):
            _fail(
                name,
                f"with m={m}, stage0's gradients are twice too large",
                "cut the graph at the boundary (a new leaf with stage0's values): otherwise the loss's "
                "backward already reaches stage0, and stage0's own backward adds its gradient a second time",
            )
        if not _close(g1, w1, rtol=1e-4, atol=1e-6):
            _fail(
                name,
                f"with m={m}, stage1's gradients differ from the full batch's by {(g1 - w1).abs().max().item():.3g}",
                "zero the gradients once before the step, not inside the loop; gradients must ACCUMULATE over micro-batches",
            )
        if not _close(g0, w0, rtol=1e-4, atol=1e-6):
            _fail(
                name,
                f"with m={m}, stage0's gradients differ from the full batch's by {(g0 - w0).abs().max().item():.3g}",
                "backpropagate stage0's output with the gradient of the leaf that stage1 received, once per "
                "micro-batch",
            )
        if got_loss is None or not _close(float(got_loss), want_loss.item(), rtol=1e-4, atol=1e-6):
            _fail(
                name,
                f"with m={m}, returned loss {got_loss} but the full batch's is {want_loss.item():.6f}",
                "return the sum of the m micro-batch losses, each already divided by m (use .item() or .detach())",
            )
    _passed(name, "m = 1, 2, 4: GPipe order, gradients equal the full batch's")
