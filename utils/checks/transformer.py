"""Lab 7's exercises (solutions/lab7_tensor_parallel_transformer.ipynb) on the exercise engine: the f and g
operators, a transformer block's weights split over ranks, its tensor-parallel forward on 2 processes and the same
with sequence parallelism, each against one process. Each known-wrong answer is a reference with one keyword changed."""

import copy
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..gpt import Block, GPTConfig
from ..parallel.shard import CommCounter
from .engine import Case, Exercise, difference
from .engine import mistake as _m

__all__ = ["check_tp_operators", "check_shard_block", "check_tp_block", "check_sp_block"]
LAB = "lab7_tensor_parallel_transformer"
REFUSE = (
    "utils.parallel.tensor_parallel",
    "torch.distributed.tensor.parallel.parallelize_module",
    "torch.distributed.tensor.distribute_tensor",
    "torch.distributed.nn",
    "torch.distributed.nn.functional",
    "torch.distributed._functional_collectives",
)
REFUSE_HINT = (
    "write the collectives yourself with torch.distributed (all_reduce, all_gather_into_tensor, reduce_scatter_tensor)"
)


def _op(fwd, bwd):
    """An autograd Function: ``fwd`` and ``bwd`` each one of "id", "all_reduce", "gather", "scatter" (dim 1)."""

    def apply(kind, t):
        t, n = t.contiguous(), dist.get_world_size()
        if kind == "gather":  # every rank's sequence shard, side by side in rank order
            return _gather(t, 1)
        if kind == "gather_sum":  # every rank's whole partial sum gathered, added up here, this rank's shard kept
            return torch.stack(_gather(t[None], 0).unbind()).sum(0).chunk(n, 1)[dist.get_rank()]
        out = t.new_empty(t.shape[0], t.shape[1] // n, *t.shape[2:]) if kind == "scatter" else t.clone()
        if kind == "scatter":  # rank r gets the sum over the ranks of sequence shard r
            dist.reduce_scatter_tensor(out, torch.cat(t.chunk(n, 1), 0).contiguous())
        elif kind == "all_reduce":  # a copy: never the caller's tensor, in place
            dist.all_reduce(out)
        return out

    class Op(torch.autograd.Function):
        forward = staticmethod(lambda ctx, t: apply(fwd, t))
        backward = staticmethod(lambda ctx, grad: apply(bwd, grad))

    return Op


def _gather(t, dim):
    dist.all_gather(parts := [torch.empty_like(t) for _ in range(dist.get_world_size())], t.contiguous())
    return torch.cat(parts, dim)


COPY, REDUCE, NONE = _op("id", "all_reduce"), _op("all_reduce", "id"), _op("id", "id")  # f, g, neither
GATHER, SCATTER = _op("gather", "scatter"), _op("scatter", "gather")  # sequence parallelism's f and g
GATHER_SUM = _op("gather_sum", "gather")  # g's result, for N times the traffic of a reduce-scatter


# ---------------------------------------------------------------------------- exercise 1: f and g
def _ops_run(answer, case):
    """y = g(f(x) @ W_rank) on every rank, with the gradient of sum(y * probe) for x."""
    (f, g), (rows, d, seed, ctx) = answer, case.args
    gen = torch.Generator().manual_seed(seed)
    x, w, probe = (torch.randn(*s, generator=gen).to(ctx.device) for s in ((rows, d), (2, d, d), (rows, d)))
    x.requires_grad_()
    y = getattr(g, "apply", g)(getattr(f, "apply", f)(x) @ w[ctx.rank])
    (y * probe).sum().backward()
    return {"output": y.detach(), "input grad": x.grad}


TP_OPERATORS = Exercise(
    name="tp_operators",
    answer=("CopyToTP", "ReduceFromTP"),
    oracle=(COPY, REDUCE),
    ranks=2,
    run=_ops_run,
    cases=lambda ctx: [Case((r, d, r + d, ctx), label=f"{r} rows of width {d}") for r, d in ((3, 4), (5, 6))],
    refuse=REFUSE,
    refuse_hint=REFUSE_HINT,
    hint="f is the identity forward and sums the gradient over the ranks backward; g is the mirror image",
    passed="2 processes: the partial products summed forward, the input's gradient summed backward",
    mistakes=[
        _m(
            "the output is this rank's partial product: g's forward does not all-reduce. Try: g's forward must sum its "
            "input over the ranks",
            (COPY, NONE),
        ),
        _m(
            "the output is N times too large: f's forward all-reduces the whole input every rank already holds. Try: "
            "f's forward is the identity; only its backward all-reduces",
            (_op("all_reduce", "all_reduce"), REDUCE),
        ),
        _m(
            "the input's gradient is this rank's part only: f's backward does not all-reduce. Try: f's backward must "
            "sum the gradient over the ranks",
            (NONE, REDUCE),
        ),
        _m(
            "the input's gradient is N times too large: g's backward all-reduces a gradient every rank already holds "
            "whole. Try: g's backward is the identity",
            (COPY, _op("all_reduce", "all_reduce")),
        ),
    ],
)
check_tp_operators = TP_OPERATORS.checker(
    "``CopyToTP`` (f) and ``ReduceFromTP`` (g), autograd Functions, on 2 processes."
)


# ---------------------------------------------------------------------------- exercise 2: the block's shards
def _shard(block, r, n, qkv="heads", dims=(0, 1)):
    """Rank r's shards (the reference, with the defaults): q, k and v of its heads; fc's outputs; the projections'
    inputs. ``qkv="chunk"`` cuts the fused weight plainly and ``dims`` chooses the dims: the named mistakes."""
    (col, row), cut = dims, lambda t, dim=0: t.detach().chunk(n, dim)[r].clone()
    w, b = block.attn.qkv.weight.detach(), block.attn.qkv.bias.detach()
    if qkv == "heads":  # [3d, d] -> [3, d, d]: the q, k and v parts of this rank's heads
        w, b = cut(w.unflatten(0, (3, -1)), 1).flatten(0, 1), cut(b.unflatten(0, (3, -1)), 1).flatten()
    return {
        "qkv_weight": w if qkv == "heads" else cut(w, col),
        "qkv_bias": b if qkv == "heads" else cut(b),
        "attn_proj_weight": cut(block.attn.proj.weight, row),
        "fc_weight": cut(block.mlp.fc.weight, col),
        "fc_bias": cut(block.mlp.fc.bias),
        "mlp_proj_weight": cut(block.mlp.proj.weight, row),
    }


def _block(d, heads, seed):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # nn.Linear's own initialisation: every bias non-zero
        return Block(GPTConfig(width=d, heads=heads, context=64, layers=1))


_mlp = lambda s, h: F.linear(F.gelu(F.linear(h, s["fc_weight"], s["fc_bias"])), s["mlp_proj_weight"])


def _attention(s, h, heads):
    """The attention branch of one rank's shards on normalised input ``h``: a partial sum, no bias."""
    q, k, v = F.linear(h, s["qkv_weight"], s["qkv_bias"]).unflatten(-1, (3, heads, -1)).permute(2, 0, 3, 1, 4)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
    return F.linear(y, s["attn_proj_weight"])


def _shard_run(shard_block, case):
    """Every rank's shards, their partial outputs summed in this process (the all-reduce) and the bias added once."""
    d, heads, n, seed = case.args
    block, h = _block(d, heads, seed), torch.randn(2, 5, d, generator=torch.Generator().manual_seed(seed))
    shards = [shard_block(block, r, n) for r in range(n)]
    out = {"shapes": [{k: tuple(getattr(v, "shape", ())) for k, v in s.items()} for s in shards]}
    for name, part, layer in (
        ("attn", lambda s: _attention(s, h, heads // n), block.attn.proj),
        ("mlp", lambda s: _mlp(s, h), block.mlp.proj),
    ):
        try:
            out[name] = (sum(part(s) for s in shards) + layer.bias).detach()
        except (RuntimeError, KeyError, TypeError):
            out[name] = None
    return out


def _shapes_differ(got, want):
    """Which rank's shard has another shape (or is missing, or is one too many), in words; None if none."""
    for r, (g, w) in enumerate(zip(got, want)):
        for k in sorted(set(g) | set(w)):
            if g.get(k) != w.get(k):
                gave = f"{k} of shape {g[k]}" if k in g else f"no {k}"
                expected = f"shape {w[k]} was expected" if k in w else "none was"
                return f"gave rank {r} {gave} where {expected}"
    return None


SHARD_BLOCK = Exercise(
    name="shard_block",
    oracle=_shard,
    run=_shard_run,
    refuse=REFUSE,
    cases=lambda: [
        Case((d, h, n, d), label=f"width {d}, {h} heads on {n} ranks")
        for d, h, n in ((8, 2, 2), (12, 6, 3), (16, 4, 4))
    ],
    compare=lambda got, want: (
        _shapes_differ(got["shapes"], want["shapes"])
        or difference(*({"attention": o["attn"], "MLP": o["mlp"]} for o in (got, want)), atol=1e-5)
    ),
    hint="rank r keeps the q, k and v rows of heads r*H/N to (r+1)*H/N, fc's hidden units r*4d/N to (r+1)*4d/N, and "
    "the same slices of the projections' inputs",
    passed="2, 3 and 4 ranks: the partial outputs add up to the block's attention and MLP",
    mistakes=[
        _m(
            "a shard has the wrong shape: a weight was cut along the wrong dimension. Try: nn.Linear's weight is [out, "
            "in]: qkv and fc keep a slice of the OUTPUT features (dim 0), the projections of the INPUT features (dim "
            "1)",
            partial(_shard, dims=(1, 0)),
        ),
        _m(
            "the shapes are right but the attention differs: a plain slice of the fused qkv weight mixes the heads' "
            "queries, keys and values. Try: view it as 3 parts [q; k; v] of d rows and take this rank's heads' rows "
            "of each",
            partial(_shard, qkv="chunk"),
        ),
    ],
)
check_shard_block = SHARD_BLOCK.checker(
    "``shard_block(block, rank, world_size)``: one rank's shards of a Block's Linears."
)


# ---------------------------------------------------------------------------- exercises 3 and 4: the block on ranks
class _TPBlock(nn.Module):
    """The reference: this rank's part of a Block (f, column-parallel, row-parallel, g); ``how`` makes the mistakes."""

    def __init__(self, block, rank, world_size, how=""):
        super().__init__()
        self.heads, self.how = block.attn.heads // world_size, how
        self.norm1, self.norm2 = copy.deepcopy(block.norm1), copy.deepcopy(block.norm2)
        self.shards = nn.ParameterDict({k: nn.Parameter(v) for k, v in _shard(block, rank, world_size).items()})
        self.attn_proj_bias = nn.Parameter(block.attn.proj.bias.detach().clone())
        self.mlp_proj_bias = nn.Parameter(block.mlp.proj.bias.detach().clone())

    def branches(self):
        return (
            (self.norm1, lambda h: _attention(self.shards, h, self.heads), self.attn_proj_bias),
            (self.norm2, lambda h: _mlp(self.shards, h), self.mlp_proj_bias),
        )

    def forward(self, x):
        f, g = NONE if "no f" in self.how else COPY, NONE if "no g" in self.how else REDUCE
        early = "bias" in self.how  # the row-parallel bias added before g, on every rank
        for norm, branch, bias in self.branches():
            x = x + g.apply(branch(f.apply(norm(x))) + early * bias) + (not early) * bias
        return x


class _SPBlock(_TPBlock):
    """The same with sequence parallelism: x is this rank's sequence shard."""

    def forward(self, x):
        full = "full norm" in self.how  # the LayerNorm run after the all-gather, on the whole sequence
        g = REDUCE if "all_reduce" in self.how else GATHER_SUM if "gather sum" in self.how else SCATTER
        for norm, branch, bias in self.branches():
            y = g.apply(branch(norm(GATHER.apply(x)) if full else GATHER.apply(norm(x))))
            x = x + (y.chunk(dist.get_world_size(), 1)[dist.get_rank()] if g is REDUCE else y) + bias
        return x


SPLIT = {"fc_weight": 0, "fc_bias": 0, "attn_proj_weight": 1, "mlp_proj_weight": 1}


def _block_run(answer, case, sp=False):
    """The block on this rank (x whole, or with ``sp`` its sequence shard); the output, the input's gradient and
    every weight's gradient, gathered whole; the calls of all_reduce and the rows each LayerNorm saw."""
    d, heads, t, seed, ctx = case.args
    block, gen, n, rank = _block(d, heads, seed), torch.Generator().manual_seed(seed), ctx.world_size, ctx.rank
    x, probe = (torch.randn(2, t, d, generator=gen).to(ctx.device) for _ in range(2))
    mine = (lambda v: v.chunk(n, 1)[rank]) if sp else (lambda v: v)
    part, rows, xs = answer(block, rank, n).to(ctx.device), [], mine(x).clone().requires_grad_()
    seen = [
        norm.register_forward_pre_hook(lambda m, a: rows.append(a[0].numel() // a[0].shape[-1]))
        for norm in (part.norm1, part.norm2)
    ]
    with CommCounter(n) as comm:
        y = part(xs)
        (y * mine(probe)).sum().backward()
    [h.remove() for h in seen]
    out = {}  # each shard's gradient gathered whole; a replicated one whole under TP, summed over the shards under SP
    for k, p in part.named_parameters():
        v, cut = torch.zeros_like(p) if p.grad is None else p.grad, SPLIT.get(k.split(".")[-1])
        if k.endswith(("qkv_weight", "qkv_bias")):
            out[k] = _gather(v.unflatten(0, (3, -1)), 1).flatten(0, 1)
        else:
            out[k] = _gather(v, cut) if cut is not None else _gather(v[None], 0).sum(0) if sp else v
    res = {"output": _gather(y.detach(), 1) if sp else y.detach(), "input grad": _gather(xs.grad, 1) if sp else xs.grad}
    return res | {"param grads": out, "norm_rows": rows, "all_reduce": comm.calls.get("all_reduce"), "sent": comm.sent}


_block_cases = lambda ctx: [
    Case((d, h, t, d + t, ctx), label=f"width {d}, {h} heads, {t} tokens") for d, h, t in ((8, 2, 6), (12, 4, 4))
]
_numbers = lambda rs: [{k: r[k] for k in ("output", "input grad", "param grads")} for r in rs]  # not the mechanisms
_BLOCK = dict(
    ranks=2,
    cases=_block_cases,
    compare=lambda got, want: difference(_numbers(got), _numbers(want), atol=1e-5),
    timeout_s=120,
    refuse=REFUSE,
    refuse_hint=REFUSE_HINT,
)
TP_BLOCK = Exercise(
    name="tp_block",
    answer=("TPBlock",),
    oracle=_TPBlock,
    run=_block_run,
    **_BLOCK,
    hint="per branch: LayerNorm, f, the column-parallel layer, the rank's heads (or GELU), the row-parallel layer, g, "
    "then the bias once and the residual",
    passed="2 processes, two widths: the output and every gradient equal one process's Block",
    mistakes=[
        _m(
            "the output is off by (N - 1) times the projections' biases: a row-parallel bias was added on every rank "
            "before the all-reduce. Try: add it once, after g",
            partial(_TPBlock, how="bias"),
        ),
        _m(
            "the output is a partial sum: g is missing after a row-parallel layer. Try: pass each projection's output "
            "through g before the bias and the residual",
            partial(_TPBlock, how="no g"),
        ),
        _m(
            "the output is right but the gradients are one rank's part: f is missing before a column-parallel layer. "
            "Try: pass each LayerNorm's output through f before qkv and fc",
            partial(_TPBlock, how="no f"),
        ),
    ],
)
check_tp_block = TP_BLOCK.checker(
    "``TPBlock(block, rank, world_size)``: a Block's tensor-parallel forward on 2 processes."
)
SP_BLOCK = Exercise(
    name="sp_block",
    answer=("SPBlock",),
    oracle=_SPBlock,
    run=partial(_block_run, sp=True),
    **_BLOCK,
    hint="per branch: LayerNorm on your sequence shard, all-gather the sequence, the column- and row-parallel layers, "
    "reduce-scatter back to your shard, then the bias and the residual",
    passed="2 processes, two widths: the output and every gradient equal one process's Block, with no all-reduce",
    mistakes=[
        _m(
            "your block called an all-reduce, where sequence parallelism reduce-scatters along the sequence: in g's "
            "forward and in the all-gather's backward. Try: reduce-scatter there (dist.reduce_scatter_tensor), so "
            "each rank keeps the sum of its own shard only",
            partial(_SPBlock, how="all_reduce"),
            lambda o: any(r["all_reduce"] for r in o.got),
            mechanism=True,
        ),
        _m(
            "a LayerNorm ran on the whole sequence: every rank normalised (and kept) all the rows. Try: run each "
            "LayerNorm on your own sequence shard, then all-gather its output",
            partial(_SPBlock, how="full norm"),
            lambda o: any(n != o.want[0]["norm_rows"][0] for r in o.got for n in r["norm_rows"]),
            mechanism=True,
        ),
        _m(
            "your block sends more data than an all-gather and a reduce-scatter per branch and pass would: for "
            "instance, the partial sums were all-gathered and added up. Try: after a row-parallel layer, "
            "reduce-scatter the partial sums along the sequence (dist.reduce_scatter_tensor)",
            partial(_SPBlock, how="gather sum"),
            lambda o: any(r["sent"] > 1.01 * w["sent"] for r, w in zip(o.got, o.want)),
            mechanism=True,
        ),
    ],
)
check_sp_block = SP_BLOCK.checker(
    "``SPBlock(block, rank, world_size)``: a Block with sequence parallelism on 2 processes."
)
