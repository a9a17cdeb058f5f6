"""Figures that explain the parallel mechanisms, drawn from the code and formulas the course uses.

Each figure has a pure function that computes what is drawn, so the picture stays true to the code:

* :func:`ring_schedule` and :func:`ring_states`: who sends which chunk to whom at each step of the
  ring all-reduce, by the index arithmetic of ``parallel.collectives.ring_all_reduce``;
  :func:`ring_allreduce_figure` draws it step by step.
* :func:`ddp_buckets` and :func:`ddp_timeline`: DDP's buckets (parameters in reverse order, a
  bucket closed when it reaches ``bucket_cap_mb``) and their all-reduces on a communication lane,
  each costed by the alpha-beta model of notebook 03; :func:`ddp_overlap_figure` compares them
  with all-reduce after backward.
* :func:`zero_segments`: what each rank holds of parameters, gradients and optimizer state under
  DDP and ZeRO-1/2/3, sized by ``parallel.shard.zero_bytes``; :func:`zero_stages_figure`.
* :func:`megatron_shapes`: the shards of ``parallel.tensor_parallel.column_shard`` and
  ``row_shard`` on a real block; :func:`megatron_split_figure`. :func:`gpt_tp_owners`: which rank
  holds each feature of a GPT block's weights, heads marked, and the fused qkv weight cut
  contiguously; :func:`gpt_tp_figure`. :func:`block_layouts`: a GPT block's activations
  replicated, split by position or by heads and hidden units, and the collectives between them,
  read from ``tensor_parallel.gpt_plan``; :func:`sequence_parallel_figure`.
* :func:`pipeline_schedule_figure`: GPipe and 1F1B from ``parallel.pipeline.schedule``.
* :func:`collective_states`: broadcast, reduce, all-reduce, all-gather and reduce-scatter run on
  numbers, what each rank holds before and after; :func:`collectives_figure`.
* :func:`parallel_split`: which blocks, hidden units and batch rows each rank holds under data
  (``data.shard_indices``), tensor (``tensor_parallel.column_shard``/``row_shard``) and pipeline
  (``pipeline.split_stages``) parallelism; :func:`parallel_split_figure`.
* :func:`rank_layout`: RANK, LOCAL_RANK and WORLD_SIZE of every task on a few nodes, as
  ``parallel.rendezvous_env`` reads them from SLURM's variables; :func:`rank_layout_figure`.
* :func:`step_memory`: the bytes held through one training step of ``memory.block_mlp``, with
  and without activation checkpointing, from ``memory.budget`` and ``memory.mlp_activation_bytes``;
  :func:`step_memory_figure`.
* :func:`gpt_rank_bytes`: the bytes of parameters, gradients and AdamW state each rank holds of
  each FSDP unit of ``gpt.GPT`` (its blocks, and the rest) under DDP and under FSDP2, from
  ``parallel.shard.dim0_shard_numel``; :func:`gpt_rank_bytes_figure`.
* :func:`fsdp_timeline`: FSDP's per-block all-gather, compute and reduce-scatter, with and without
  prefetch, costed by ``parallel.shard.ring_bytes``; :func:`fsdp_figure`.
* :func:`rendezvous_sequence`: torchrun's agents meeting in the c10d store, the node ranks and
  RANKs they hand out, then ``init_process_group``; :func:`rendezvous_figure`.
* :func:`roofline`: attainable FLOP/s against arithmetic intensity, with kernels' points
  (:func:`vector_add_cost`, :func:`matmul_cost`); :func:`roofline_figure`.
* :func:`scaling_speedup`: strong (Amdahl) and weak (Gustafson) scaling; :func:`scaling_figure`.

Every figure function returns its ``Figure`` and never calls ``plt.show()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.lines import Line2D
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle
from torch import nn

from utils import data, gpt, memory, models, plots
from utils.parallel import collectives, pipeline, shard, tensor_parallel
from utils.parallel import env as parallel_env

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "ring_schedule",
    "ring_states",
    "ring_allreduce_figure",
    "ddp_buckets",
    "ddp_timeline",
    "ddp_overlap_figure",
    "zero_segments",
    "zero_stages_figure",
    "megatron_shapes",
    "megatron_split_figure",
    "pipeline_cells",
    "pipeline_schedule_figure",
    "collective_states",
    "collectives_figure",
    "parallel_split",
    "parallel_split_figure",
    "rank_layout",
    "rank_layout_figure",
    "step_memory",
    "step_memory_figure",
    "gpt_units",
    "gpt_rank_bytes",
    "gpt_rank_bytes_figure",
    "fsdp_timeline",
    "fsdp_figure",
    "rendezvous_sequence",
    "rendezvous_figure",
    "vector_add_cost",
    "matmul_cost",
    "roofline",
    "roofline_figure",
    "scaling_speedup",
    "scaling_figure",
]

_MB = 1024 * 1024  # DDP's bucket_cap_mb is in MiB
_COLOURS = plt.get_cmap("tab10").colors


def _rank_legend(ax, n_ranks: int, alpha: float) -> None:
    """A legend of one colour patch per rank, "held by rank r"."""
    handles = [Patch(color=_colour(r), alpha=alpha, label=f"held by rank {r}") for r in range(n_ranks)]
    ax.legend(handles=handles, loc="lower right", fontsize=8)


def _colour(i: int) -> tuple:
    return _COLOURS[i % len(_COLOURS)]


# ----------------------------------------------------------------------------------------
# 1. The ring all-reduce
# ----------------------------------------------------------------------------------------


def ring_schedule(n: int) -> list[tuple[str, list[tuple[int, int, int]]]]:
    """The ring all-reduce's messages on ``n`` ranks: ``[(phase, [(src, dst, chunk), ...]), ...]``,
    one entry per step, ``2(n-1)`` steps, phase ``"reduce-scatter"`` then ``"all-gather"``.

    The same index arithmetic as ``parallel.collectives.ring_all_reduce``: at reduce-scatter
    step s rank r sends chunk ``(r - s) % n`` to ``(r + 1) % n``, which adds it to its own; at
    all-gather step s it sends chunk ``(r + 1 - s) % n``, which the receiver copies."""
    if n < 1:
        raise ValueError(f"need n >= 1 ranks, got {n}")
    steps = []
    for s in range(n - 1):
        steps.append(("reduce-scatter", [(r, (r + 1) % n, (r - s) % n) for r in range(n)]))
    for s in range(n - 1):
        steps.append(("all-gather", [(r, (r + 1) % n, (r + 1 - s) % n) for r in range(n)]))
    return steps


def ring_states(n: int) -> list[list[list[frozenset]]]:
    """``states[k][rank][chunk]``: the set of ranks whose values are summed into that chunk on
    that rank before step k (``states[0]``: each rank holds only its own), and after the last
    step (``states[-1]``). Replays :func:`ring_schedule`: all messages of a step are sent from
    the state before it, then added (reduce-scatter) or copied (all-gather)."""
    state = [[frozenset({r}) for _ in range(n)] for r in range(n)]
    states = [state]
    for phase, transfers in ring_schedule(n):
        new = [row[:] for row in state]
        for src, dst, c in transfers:
            new[dst][c] = state[dst][c] | state[src][c] if phase == "reduce-scatter" else state[src][c]
        state = new
        states.append(state)
    return states


def _draw_ring_panel(ax, state, transfers, phase, n, title):
    for r in range(n):
        for c in range(n):
            k = len(state[r][c])
            ax.add_patch(
                Rectangle(
                    (c, r - 0.35), 0.56, 0.7, facecolor=_colour(c), alpha=0.15 + 0.85 * k / n, edgecolor="black", lw=0.5
                )
            )
            label = "Σ" if k == n else "+".join(str(i) for i in sorted(state[r][c]))
            ax.text(c + 0.28, r, label, ha="center", va="center", fontsize=7 if k < n else 10)
    colour = "tab:red" if phase == "reduce-scatter" else "tab:blue"
    for src, dst, c in transfers or []:
        wrap = dst < src
        arrow = FancyArrowPatch(
            (c + (0.74 if wrap else 0.66), src + (-0.3 if wrap else 0.3)),
            (c + (0.74 if wrap else 0.66), dst + (0.3 if wrap else -0.3)),
            arrowstyle="-|>",
            mutation_scale=9,
            color=colour,
            lw=1.2,
            connectionstyle=f"arc3,rad={0.2 / n}" if wrap else "arc3,rad=0",
            gid=f"ring:{src}->{dst}:{c}",
        )
        ax.add_patch(arrow)
    ax.set_xlim(-0.15, n + 0.05)
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_xticks([c + 0.28 for c in range(n)], [str(c) for c in range(n)])
    ax.set_yticks(range(n), [f"rank {r}" for r in range(n)])
    ax.tick_params(length=0, labelsize=8)
    ax.set_xlabel("chunk", fontsize=8)
    ax.set_title(title, fontsize=9)
    for side in ax.spines.values():
        side.set_visible(False)


def ring_allreduce_figure(n_ranks: int = 4) -> Figure:
    """The ring all-reduce on ``n_ranks`` ranks, one panel per step: the top row is
    reduce-scatter (each arrow: a chunk sent to the next rank and added there), the bottom row
    all-gather (the finished chunks copied round the ring). A cell's colour is its chunk; its
    shade and label say whose values it sums. The last panel of each row shows the result."""
    if n_ranks < 2:
        raise ValueError(f"a ring needs at least 2 ranks, got {n_ranks}")
    n = n_ranks
    steps, states = ring_schedule(n), ring_states(n)
    fig, axes = plt.subplots(2, n, figsize=(2.6 * n + 0.6, 2 * (0.55 * n + 1.1) + 0.9), squeeze=False)
    for k, (phase, transfers) in enumerate(steps):
        row, col = (0, k) if k < n - 1 else (1, k - (n - 1))
        _draw_ring_panel(axes[row][col], states[k], transfers, phase, n, f"{phase} step {col + 1}")
    _draw_ring_panel(axes[0][n - 1], states[n - 1], None, "", n, "after reduce-scatter:\nrank r owns chunk (r+1) mod N")
    _draw_ring_panel(axes[1][n - 1], states[-1], None, "", n, "after all-gather:\nevery rank holds the sum")
    handles = [
        Line2D([], [], color="tab:red", marker=">", label="reduce-scatter: send, receiver adds"),
        Line2D([], [], color="tab:blue", marker=">", label="all-gather: send, receiver copies"),
        Patch(facecolor="lightgray", edgecolor="black", label="cell label: ranks summed in (Σ = all)"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=8, frameon=False)
    sent = collectives.ring_allreduce_bytes(1.0, n)
    fig.suptitle(
        f"Ring all-reduce on {n} ranks: {2 * (n - 1)} steps, each rank sends {2 * (n - 1)} chunks "
        f"of 1/{n} = {sent:.2f}x the tensor",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


# ----------------------------------------------------------------------------------------
# 2. DDP's buckets and their overlap with backward
# ----------------------------------------------------------------------------------------


def ddp_buckets(
    param_bytes: Sequence[int], bucket_cap_mb: float = 25.0, first_bucket_mb: float | None = None
) -> list[list[int]]:
    """DDP's buckets: lists of parameter indices (into ``param_bytes``, given in
    ``model.parameters()`` order), in the order backward fills them.

    As DDP's reducer assigns them once it has seen backward's order (the rebuild after the first
    step; for a feed-forward model, reverse parameter order): walk the parameters from the last,
    add each to the open bucket, and close the bucket when its bytes reach the cap (the
    parameter that crosses it stays in). ``first_bucket_mb``: a smaller cap for the first bucket,
    so the first all-reduce starts early (PyTorch's reducer uses ``dist._DEFAULT_FIRST_BUCKET_BYTES``,
    1 MiB; recent versions only when ``bucket_cap_mb`` is left at its default); None: the same
    cap for all. All parameters are taken to share one dtype and device (DDP buckets each kind
    apart). The tests check this against PyTorch's own ``_compute_bucket_assignment_by_size``."""
    caps = [first_bucket_mb if first_bucket_mb is not None else bucket_cap_mb, bucket_cap_mb]
    if min(caps) <= 0:
        raise ValueError(f"bucket caps must be > 0 MB, got {caps}")
    buckets, current, size = [], [], 0
    for i in reversed(range(len(param_bytes))):
        current.append(i)
        size += param_bytes[i]
        if size >= caps[min(len(buckets), 1)] * _MB:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def _layers(model: nn.Module) -> list[tuple[str, list[int]]]:
    """Modules that own parameters directly, in definition order, with the indices (into
    ``model.parameters()``) of their parameters."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    out = []
    for name, m in model.named_modules():
        own = [index[id(p)] for p in m.parameters(recurse=False) if id(p) in index]
        if own:
            out.append((name or type(m).__name__, own))
    return out


def ddp_timeline(
    model: nn.Module,
    bucket_cap_mb: float = 25.0,
    *,
    world_size: int = 4,
    batch_size: int = 256,
    flops: float = 10e12,
    alpha_s: float = 5e-6,
    bandwidth: float = 100e9,
    first_bucket_mb: float | None = None,
) -> dict[str, Any]:
    """One backward pass of ``model`` under DDP, on a compute lane and a communication lane.

    Compute: the layers' backwards in reverse order, each ``4 x batch_size x its parameters``
    FLOPs (two matrix products: the input's gradient and the weight's) at ``flops`` per second;
    a layer's gradients are ready when its backward ends. Communication: the buckets of
    :func:`ddp_buckets`, each all-reduced (:func:`utils.parallel.collectives.allreduce_time`) when its last gradient is
    ready and the previous all-reduce is done (one communication stream). The serial
    alternative all-reduces the same buckets one after another once backward has ended.

    Returns ``layers`` (name, start, end, in backward order), ``buckets`` (params, bytes, ready,
    start, end, serial_start, serial_end), ``t_backward``, ``t_overlap`` and ``t_serial``
    (seconds)."""
    params = list(model.parameters())
    nbytes = [p.numel() * p.element_size() for p in params]
    ready_of_param, layers, t = {}, [], 0.0
    found = _layers(model)
    for name, idx in reversed(found):
        dt = 4 * batch_size * sum(params[i].numel() for i in idx) / flops
        layers.append({"name": name, "label": f"L{len(found) - 1 - len(layers)}", "start": t, "end": t + dt})
        t += dt
        for i in idx:
            ready_of_param[i] = t
    t_backward = t
    buckets, comm_free, serial_free = [], 0.0, t_backward
    for b in ddp_buckets(nbytes, bucket_cap_mb, first_bucket_mb):
        size = sum(nbytes[i] for i in b)
        cost = collectives.allreduce_time(size, world_size, alpha_s, bandwidth)
        ready = max(ready_of_param[i] for i in b)
        start = max(ready, comm_free)
        comm_free = start + cost
        buckets.append(
            {
                "params": b,
                "bytes": size,
                "ready": ready,
                "start": start,
                "end": comm_free,
                "serial_start": serial_free,
                "serial_end": serial_free + cost,
            }
        )
        serial_free += cost
    return {
        "layers": layers,
        "buckets": buckets,
        "t_backward": t_backward,
        "t_overlap": max(t_backward, comm_free),
        "t_serial": serial_free,
    }


def ddp_overlap_figure(
    model: nn.Module | None = None,
    bucket_cap_mb: float = 8.0,
    *,
    world_size: int = 4,
    batch_size: int = 256,
    flops: float = 10e12,
    alpha_s: float = 5e-6,
    bandwidth: float = 100e9,
    first_bucket_mb: float | None = None,
) -> Figure:
    """Backward and all-reduce on two lanes, twice: all-reduce after backward (top) and DDP's
    bucket all-reduces overlapped with backward (bottom). ``model`` defaults to an 8-layer MLP of
    width 1024 (4 MiB of fp32 weights per layer); the costs are those of :func:`ddp_timeline`."""
    if model is None:
        model = models.mlp(1024, 8)
    tl = ddp_timeline(
        model,
        bucket_cap_mb,
        world_size=world_size,
        batch_size=batch_size,
        flops=flops,
        alpha_s=alpha_s,
        bandwidth=bandwidth,
        first_bucket_mb=first_bucket_mb,
    )
    us = 1e6
    fig, axes = plt.subplots(2, 1, figsize=(10, 5), sharex=True)
    panels = (
        ("All-reduce after backward (no overlap)", "serial_start", "serial_end", tl["t_serial"]),
        (
            f"DDP: a bucket's all-reduce starts when its last gradient is ready (cap {bucket_cap_mb:g} MiB)",
            "start",
            "end",
            tl["t_overlap"],
        ),
    )
    for ax, (title, s_key, e_key, t_end) in zip(axes, panels):
        for i, layer in enumerate(tl["layers"]):
            ax.barh(
                1, (layer["end"] - layer["start"]) * us, left=layer["start"] * us, height=0.6,
                color="0.75" if i % 2 else "0.6", edgecolor="white", gid="compute",
            )  # fmt: skip
            ax.text((layer["start"] + layer["end"]) / 2 * us, 1, layer["label"], ha="center", va="center", fontsize=7)
        for j, b in enumerate(tl["buckets"]):
            ax.barh(
                0, (b[e_key] - b[s_key]) * us, left=b[s_key] * us, height=0.6,
                color=_colour(j), edgecolor="white", gid="allreduce",
            )  # fmt: skip
            ax.text((b[s_key] + b[e_key]) / 2 * us, 0, f"bucket {j}", ha="center", va="center", fontsize=7)
            if s_key == "start":
                ax.plot([b["ready"] * us] * 2, [0.35, 0.7], color=_colour(j), ls=":", lw=1.2)
        ax.axvline(t_end * us, color="black", lw=1)
        ax.text(t_end * us, 1.55, f" end {t_end * us:.0f} µs", fontsize=8, va="center")
        ax.set_yticks([0, 1], ["all-reduce", "backward"])
        ax.set_ylim(-0.5, 1.8)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[1].set_xlabel("time since backward started (µs)")
    saved = tl["t_serial"] - tl["t_overlap"]
    fig.legend(
        handles=[
            Patch(color="0.6", label="backward of layer Lk (last layer first)"),
            Patch(color=_colour(0), label="all-reduce of one bucket"),
            Line2D([], [], color="black", ls=":", label="bucket's last gradient ready"),
        ],
        fontsize=8,
        loc="lower center",
        ncol=3,
        frameon=False,
    )
    n_params = sum(p.numel() for p in model.parameters())
    fig.suptitle(
        f"DDP overlap: {n_params / 1e6:.1f}M parameters, {len(tl['buckets'])} buckets, {world_size} ranks; "
        f"overlap saves {saved * us:.0f} µs of {tl['t_serial'] * us:.0f} µs",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


# ----------------------------------------------------------------------------------------
# 3. ZeRO stages
# ----------------------------------------------------------------------------------------

_KINDS = ("params", "grads", "optimizer")
_KIND_LABELS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state"}


def zero_segments(
    n_params: float,
    n_ranks: int,
    stage: int,
    *,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    optim_bytes: float = 12,
) -> list[list[tuple[str, float, float]]]:
    """Per rank, the pieces of the model states it holds: ``(kind, start, width)`` in bytes, on an
    axis where parameters, gradients and optimizer state lie end to end at their full size.

    Each piece's width is ``parallel.shard.zero_bytes(...)[kind]`` (the bytes per rank); a piece
    smaller than the whole is rank r's r-th slice of it. So the widths of rank r sum to
    ``zero_bytes(...)["total"]``."""
    per = {"params": param_bytes, "grads": grad_bytes, "optimizer": optim_bytes}
    held = shard.zero_bytes(
        n_params, n_ranks, stage, param_bytes=param_bytes, grad_bytes=grad_bytes, optim_bytes=optim_bytes
    )
    out = []
    for r in range(n_ranks):
        offset, pieces = 0.0, []
        for kind in _KINDS:
            full = per[kind] * n_params
            width = held[kind]
            start = offset if width >= full else offset + r * width
            pieces.append((kind, start, width))
            offset += full
        out.append(pieces)
    return out


def zero_stages_figure(
    n_ranks: int = 4,
    n_params: float = 7.5e9,
    *,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    optim_bytes: float = 12,
) -> Figure:
    """What each of ``n_ranks`` ranks holds of parameters, gradients and optimizer state under
    DDP, ZeRO-1, ZeRO-2 and ZeRO-3, one panel per stage: a bar per rank on the axis of the whole
    model state, the pieces it holds coloured, the rest (held by other ranks) outlined. Sizes
    from :func:`zero_segments`, so from ``parallel.shard.zero_bytes``. Defaults: the ZeRO paper's
    mixed-precision Adam (2 + 2 + 12 bytes per parameter)."""
    kw = {"param_bytes": param_bytes, "grad_bytes": grad_bytes, "optim_bytes": optim_bytes}
    full = {"params": param_bytes * n_params, "grads": grad_bytes * n_params, "optimizer": optim_bytes * n_params}
    colours = {"params": "tab:blue", "grads": "tab:orange", "optimizer": "tab:green"}
    gb = 1e9
    fig, axes = plt.subplots(4, 1, figsize=(10, 1.2 + 4 * (0.3 * n_ranks + 0.6)), sharex=True)
    for stage, ax in enumerate(axes):
        total = shard.zero_bytes(n_params, n_ranks, stage, **kw)["total"]
        for r, pieces in enumerate(zero_segments(n_params, n_ranks, stage, **kw)):
            offset = 0.0
            for kind in _KINDS:  # the whole state, outlined
                ax.barh(r, full[kind] / gb, left=offset / gb, height=0.7, color="none", edgecolor=colours[kind], lw=0.6)
                offset += full[kind]
            for kind, start, width in pieces:
                ax.barh(r, width / gb, left=start / gb, height=0.7, color=colours[kind], gid=f"zero:{stage}:{r}:{kind}")
            ax.text(offset / gb * 1.01, r, f"{total / gb:.1f} GB", va="center", fontsize=8)
        ax.set_yticks(range(n_ranks), [f"rank {r}" for r in range(n_ranks)], fontsize=8)
        ax.set_ylim(n_ranks - 0.4, -0.6)
        ax.set_title(f"{shard.ZERO_STAGES[stage]}: {total / gb:.1f} GB per rank", fontsize=10)
        ax.set_xlim(0, sum(full.values()) / gb * 1.1)
    axes[-1].set_xlabel("model state, parameters then gradients then optimizer state (GB)")
    handles = [Patch(color=colours[k], label=f"{_KIND_LABELS[k]}, held") for k in _KINDS]
    handles.append(Patch(facecolor="none", edgecolor="gray", label="held by the other ranks"))
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle(
        f"ZeRO stages: {n_params / 1e9:g}B parameters on {n_ranks} ranks, "
        f"{param_bytes:g} + {grad_bytes:g} + {optim_bytes:g} bytes per parameter",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return fig


# ----------------------------------------------------------------------------------------
# 4. The Megatron MLP split
# ----------------------------------------------------------------------------------------


def megatron_shapes(width: int = 8, n_ranks: int = 2, *, expand: int = 4, batch_size: int = 4) -> dict[str, Any]:
    """Tensor shapes of one block MLP ``Linear(d, h) -> GELU -> Linear(h, d)`` (``models.mlp``
    with ``expand``) split over ``n_ranks`` by ``tensor_parallel.column_shard`` and
    ``row_shard``, from running the shards on a random input: ``x``, the full ``w1`` ``[h, d]``
    and ``w2`` ``[d, h]``, and per rank ``w1`` ``[h/N, d]``, ``h`` (after GELU, ``[B, h/N]``),
    ``w2`` ``[d, h/N]`` and ``partial`` ``[B, d]``; ``y`` is the sum of the partials plus ``b2``.
    ``max_error``: the largest difference between ``y`` and the block run whole."""
    block = models.mlp(width, 1, expand=expand, activation="gelu", seed=0)[0]
    x = torch.randn(batch_size, width, generator=torch.Generator().manual_seed(0))
    ranks, partials = [], []
    with torch.no_grad():
        for r in range(n_ranks):
            w1, b1 = tensor_parallel.column_shard(block[0], r, n_ranks)
            w2 = tensor_parallel.row_shard(block[2], r, n_ranks)
            h = F.gelu(F.linear(x, w1, b1))
            partial = F.linear(h, w2)
            partials.append(partial)
            ranks.append(
                {"w1": tuple(w1.shape), "h": tuple(h.shape), "w2": tuple(w2.shape), "partial": tuple(partial.shape)}
            )
        y = torch.stack(partials).sum(0) + block[2].bias
        err = (y - block(x)).abs().max().item()
    return {
        "x": tuple(x.shape),
        "w1": tuple(block[0].weight.shape),
        "w2": tuple(block[2].weight.shape),
        "y": tuple(y.shape),
        "ranks": ranks,
        "max_error": err,
    }


def megatron_split_figure(width: int = 8, n_ranks: int = 2, *, expand: int = 4, batch_size: int = 4) -> Figure:
    """The Megatron MLP split, drawn to scale from :func:`megatron_shapes` (a matrix of r rows and
    c columns is a box c wide and r tall): on top the whole layer on one device
    (``X W1^T -> GELU -> W2^T -> Y``, ``W1^T``'s column blocks and ``W2^T``'s row blocks coloured by
    the rank that gets them); below, each rank's column shard of ``W1``, its own GELU, its row
    shard of ``W2``, a partial sum, and the one all-reduce that adds them."""
    s = megatron_shapes(width, n_ranks, expand=expand, batch_size=batch_size)
    (bsz, d), (hidden, _) = s["x"], s["w1"]
    per = hidden // n_ranks
    u = max(1.0, d / 8)  # spacing grows with the matrices, so the text keeps its room
    gap, wide_gap = 5.0 * u, 10.0 * u
    fig, ax = plt.subplots(figsize=(11, 6))  # resized to the drawing below

    def box(x0, y0, shape, colour, label, gid, alpha=0.55):
        """A matrix of ``shape`` (rows, cols): cols wide, rows tall, top-left corner at (x0, y0)."""
        rows, cols = shape
        ax.add_patch(Rectangle((x0, y0), cols, rows, facecolor=colour, alpha=alpha, edgecolor="black", lw=0.8, gid=gid))
        if label:
            ax.text(x0 + cols / 2, y0 - 0.8 * u, label, ha="center", va="bottom", fontsize=8)
        return x0 + cols

    def sign(x0, y, text, width=gap):
        ax.text(x0 + width / 2, y, text, ha="center", va="center", fontsize=10)
        return x0 + width

    def t(name):  # a transposed weight, in mathtext
        return rf"${name[0]}_{name[1]}^\top$"

    # one device: the whole layer, each shard coloured by its rank
    y0 = 4.0 * u
    mid = y0 + bsz / 2
    x = box(0, y0, s["x"], "0.8", f"X\n{bsz}×{d}", "full:x")
    x = sign(x, mid, "@")
    for r in range(n_ranks):  # W1^T is [d, h]: rank r gets columns r*h/N to (r+1)*h/N
        box(x + r * per, y0, (d, per), _colour(r), "", f"full:w1t:{r}")
    ax.text(x + hidden / 2, y0 - 0.8 * u, f"{t('W1')}\n{d}×{hidden}", ha="center", va="bottom", fontsize=8)
    x = sign(x + hidden, mid, "→ GELU →", wide_gap)
    x = box(x, y0, (bsz, hidden), "0.8", f"H\n{bsz}×{hidden}", "full:h")
    x = sign(x, mid, "@")
    for r in range(n_ranks):  # W2^T is [h, d]: rank r gets the same rows
        box(x, y0 + r * per, (per, d), _colour(r), "", f"full:w2t:{r}")
    ax.text(x + d / 2, y0 - 0.8 * u, f"{t('W2')}\n{hidden}×{d}", ha="center", va="bottom", fontsize=8)
    x = sign(x + d, mid, "=")
    x_end = box(x, y0, s["y"], "0.8", f"Y\n{bsz}×{d}", "full:y")
    ax.text(-1.5 * u, mid, "one device", ha="right", va="center", fontsize=9, weight="bold")

    # each rank: the whole X, its shards, a partial sum
    y_top = y0 + max(hidden, bsz, d) + 8 * u
    row_h = max(d, per, bsz) + 7 * u
    for r, rk in enumerate(s["ranks"]):
        yr = y_top + r * row_h
        mid = yr + bsz / 2
        lo, hi = r * per, (r + 1) * per
        x = box(0, yr, s["x"], "0.8", f"X (all of it)\n{bsz}×{d}", f"rank:{r}:x")
        x = sign(x, mid, "@")
        w1t = (rk["w1"][1], rk["w1"][0])
        x = box(x, yr, w1t, _colour(r), f"{t('W1')} columns {lo}:{hi}\n{w1t[0]}×{w1t[1]}", f"rank:{r}:w1t")
        x = sign(x, mid, "→ GELU →", wide_gap)
        x = box(x, yr, rk["h"], _colour(r), f"$H_{r}$\n{rk['h'][0]}×{rk['h'][1]}", f"rank:{r}:h", alpha=0.3)
        x = sign(x, mid, "@")
        w2t = (rk["w2"][1], rk["w2"][0])
        x = box(x, yr, w2t, _colour(r), f"{t('W2')} rows\n{lo}:{hi}, {w2t[0]}×{w2t[1]}", f"rank:{r}:w2t")
        x = sign(x, mid, "=")
        partial_x = x
        box(x, yr, rk["partial"], _colour(r), f"partial $Y_{r}$\n{bsz}×{d}", f"rank:{r}:partial", alpha=0.3)
        ax.text(-1.5 * u, mid, f"rank {r}", ha="right", va="center", fontsize=9, weight="bold")
    # the all-reduce: the partials summed, the sum on every rank
    y_mid = y_top + (n_ranks - 1) * row_h / 2 + bsz / 2
    ar_x = partial_x + d + 2.5 * gap
    for r in range(n_ranks):
        ax.add_patch(
            FancyArrowPatch(
                (partial_x + d + 0.5 * u, y_top + r * row_h + bsz / 2), (ar_x - 0.5 * u, y_mid),
                arrowstyle="-|>", mutation_scale=10, color="tab:red", lw=1.2, gid=f"allreduce:{r}",
            )
        )  # fmt: skip
    box(ar_x, y_mid - bsz / 2, s["y"], "tab:red", "all-reduce (sum), + $b_2$:\nY on every rank", "allreduce:y", 0.3)
    x_max, y_max = max(x_end, ar_x + d) + 2, y_top + (n_ranks - 1) * row_h + max(d, per, bsz) + 1
    ax.set_xlim(-14 * u, x_max)
    ax.set_ylim(y_max, 0)
    fig.set_size_inches(11, 11 * y_max / (x_max + 14 * u) + 0.9)
    ax.set_aspect("equal")
    ax.axis("off")
    _rank_legend(ax, n_ranks, 0.55)
    ax.set_title(
        f"Megatron MLP on {n_ranks} ranks (d = {d}, hidden = {hidden}, batch {bsz}), to scale:\n"
        "$W_1$ split by output columns, $W_2$ by input rows, one all-reduce in forward",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def gpt_tp_owners(width: int = 16, heads: int = 4, n_ranks: int = 2) -> dict[str, dict[str, list]]:
    """Which rank holds each feature of a GPT block's split dimensions, by
    ``tensor_parallel.column_shard`` (output features) and ``row_shard`` (input features) run on
    Linears whose weights number their features. Per weight: ``owner`` (a rank per feature),
    ``label`` (``"q0"``: query head 0, ``"k1"``, ... for attention, else ``""``) and ``split``
    (``"outputs"`` or ``"inputs"``). ``"fused qkv"`` is ``utils.gpt``'s one Linear (d -> 3d, laid
    out (3, heads, head_width)) cut into N contiguous pieces; ``"q"``, ``"k"``, ``"v"`` are
    :class:`tensor_parallel.SplitQKVAttention`'s three Linears, each cut alone."""
    d, hw = width, width // heads

    def owners(n_features, split):
        lin = nn.Linear(n_features, n_features)
        with torch.no_grad():  # the weight numbers its features: row i is i, column j is j
            idx = torch.arange(n_features, dtype=torch.float32)
            lin.weight.copy_(idx[:, None] if split == "outputs" else idx[None, :].expand(n_features, -1))
        owner = [0] * n_features
        for r in range(n_ranks):
            held = (
                tensor_parallel.column_shard(lin, r, n_ranks)[0][:, 0]
                if split == "outputs"
                else tensor_parallel.row_shard(lin, r, n_ranks)[0]
            )
            for i in held.long().tolist():
                owner[i] = r
        return owner

    def head_labels(n_features, parts):
        return [f"{parts[i // d]}{(i % d) // hw}" for i in range(n_features)]

    out = {"fused qkv": {"owner": owners(3 * d, "outputs"), "label": head_labels(3 * d, "qkv"), "split": "outputs"}}
    for part in "qkv":
        out[part] = {"owner": owners(d, "outputs"), "label": head_labels(d, part), "split": "outputs"}
    out["attn.proj"] = {"owner": owners(d, "inputs"), "label": head_labels(d, "h"), "split": "inputs"}
    out["mlp.fc"] = {"owner": owners(4 * d, "outputs"), "label": [""] * 4 * d, "split": "outputs"}
    out["mlp.proj"] = {"owner": owners(4 * d, "inputs"), "label": [""] * 4 * d, "split": "inputs"}
    return out


def gpt_tp_figure(width: int = 16, heads: int = 4, n_ranks: int = 2) -> Figure:
    """A GPT block's weights split over ``n_ranks`` (:func:`gpt_tp_owners`): one bar per weight
    along the dimension that is split, one cell per feature coloured by the rank that holds it,
    attention's head boundaries marked. The fused qkv weight cut into contiguous pieces is on top:
    its pieces do not line up with heads."""
    s = gpt_tp_owners(width, heads, n_ranks)
    names = {
        "fused qkv": "fused qkv (utils.gpt),\ncut into contiguous pieces",
        "q": "q, column-wise",
        "k": "k, column-wise",
        "v": "v, column-wise",
        "attn.proj": "attention proj, row-wise\n(its inputs: the heads)",
        "mlp.fc": "MLP fc, column-wise",
        "mlp.proj": "MLP proj, row-wise",
    }
    fig, ax = plt.subplots(figsize=(11, 4.6))
    for row, (key, w) in enumerate(s.items()):
        y = len(s) - 1 - row
        for i, r in enumerate(w["owner"]):
            ax.add_patch(Rectangle((i, y + 0.1), 1, 0.8, facecolor=_colour(r), alpha=0.6, lw=0, gid=f"{key}:{i}"))
        runs, start = [], 0  # runs of one head label: a box and its name
        for i in range(1, len(w["label"]) + 1):
            if i == len(w["label"]) or w["label"][i] != w["label"][start]:
                runs.append((start, i, w["label"][start]))
                start = i
        for a, b, label in runs:
            ax.add_patch(Rectangle((a, y + 0.1), b - a, 0.8, fill=False, edgecolor="black", lw=0.6))
            if label:
                ax.text((a + b) / 2, y + 0.5, label, ha="center", va="center", fontsize=7)
        ax.text(-1, y + 0.5, names[key], ha="right", va="center", fontsize=8)
    ax.set_xlim(-0.32 * 4 * width - 1, 4 * width + 1)
    ax.set_ylim(0, len(s))
    ax.set_yticks([])
    ax.set_xticks([t for t in ax.get_xticks() if 0 <= t <= 4 * width])
    ax.set_xlabel(f"feature index along the split dimension (d = {width}, {heads} heads of {width // heads})")
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    _rank_legend(ax, n_ranks, 0.6)
    ax.set_title(
        f"A GPT block on {n_ranks} ranks: q, k, v split by heads, MLP by hidden units\n"
        "(q0 = query head 0; the fused qkv weight cut contiguously gives a rank whole q and part of k)",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def block_layouts(sequence_parallel: bool) -> dict[str, list[dict[str, Any]]]:
    """How the activations of one GPT block are laid out over the ranks, read from
    ``tensor_parallel.gpt_plan``'s styles: ``stages`` in forward order, each with its ``layout``
    (``"replicated"``: every rank holds the whole tensor; ``"sequence"``: each rank its positions;
    ``"hidden"``: each rank its heads or hidden units), and the ``collectives`` between them (after
    stage ``after``: the ``forward`` one and the ``backward`` one, None for none)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    plan = tensor_parallel.gpt_plan(1, sequence_parallel=sequence_parallel)
    p = "blocks.0."
    stages, collectives = [], []

    def norm(name):
        sp = isinstance(plan.get(p + name), SequenceParallel)
        return "sequence" if sp else "replicated"

    residual = norm("norm1")
    stages.append({"name": "residual x", "layout": residual})
    for norm_name, branch, inner, proj in (
        ("norm1", "attn", "q, k, v,\nattention", "attn.proj"),
        ("norm2", "mlp", "fc, GELU", "mlp.proj"),
    ):
        stages.append({"name": f"LayerNorm {norm_name[-1]}", "layout": norm(norm_name)})
        entry = plan.get(p + branch)
        gathers = isinstance(entry, PrepareModuleInput) and isinstance(entry.input_layouts[0], Shard)
        collectives.append(
            {"after": len(stages) - 1, "forward": "all-gather" if gathers else None,
             "backward": "reduce-scatter" if gathers else "all-reduce"}
        )  # fmt: skip
        stages.append({"name": inner, "layout": "hidden"})
        scatters = isinstance(plan[p + proj].output_layouts[0], Shard)
        collectives.append(
            {"after": len(stages) - 1, "forward": "reduce-scatter" if scatters else "all-reduce",
             "backward": "all-gather" if scatters else None}
        )  # fmt: skip
        stages.append(
            {"name": f"{proj.split('.')[0]} proj\n+ residual", "layout": "sequence" if scatters else "replicated"}
        )
    return {"stages": stages, "collectives": collectives}


_LAYOUT_COLOURS = {"replicated": "0.8", "sequence": "tab:blue", "hidden": "tab:orange"}


def sequence_parallel_figure() -> Figure:
    """One GPT block's activations under tensor parallelism (top) and tensor plus sequence
    parallelism (below), from :func:`block_layouts`: each stage coloured by how its activation is
    split over the ranks, each collective between stages written in, forward above the arrow and
    backward (in brackets) below it."""
    fig, ax = plt.subplots(figsize=(13, 4.2))
    titles = {False: "tensor parallelism", True: "tensor + sequence parallelism"}
    step, box_w, n_stages = 2.7, 1.4, 0
    for row, sp in enumerate((False, True)):
        s = block_layouts(sp)
        y0 = 3.2 * (1 - row)
        n_stages = len(s["stages"])
        for i, stage in enumerate(s["stages"]):
            ax.add_patch(
                Rectangle((i * step, y0), box_w, 1, facecolor=_LAYOUT_COLOURS[stage["layout"]], alpha=0.6,
                          edgecolor="black", lw=0.8, gid=f"{row}:stage:{i}:{stage['layout']}")
            )  # fmt: skip
            ax.text(i * step + box_w / 2, y0 + 0.5, stage["name"], ha="center", va="center", fontsize=8)
            if i:
                ax.annotate("", (i * step, y0 + 0.5), (i * step - step + box_w, y0 + 0.5),
                            arrowprops={"arrowstyle": "->", "lw": 0.8})  # fmt: skip
        for c in s["collectives"]:
            x = c["after"] * step + (box_w + step) / 2
            if c["forward"]:
                ax.text(x, y0 + 0.6, c["forward"], ha="center", va="bottom", fontsize=7, color="tab:red",
                        gid=f"{row}:forward")  # fmt: skip
            if c["backward"]:
                ax.text(x, y0 + 0.4, f"({c['backward']})", ha="center", va="top", fontsize=7, color="tab:purple",
                        gid=f"{row}:backward")  # fmt: skip
        ax.text(-0.2, y0 + 1.35, titles[sp], ha="left", va="bottom", fontsize=9, weight="bold")
    ax.set_xlim(-0.3, n_stages * step - step + box_w + 0.3)
    ax.set_ylim(-0.5, 5.0)
    ax.axis("off")
    meaning = {
        "replicated": "replicated: every rank all of it",
        "sequence": "split by position (sequence)",
        "hidden": "split by heads / hidden units",
    }
    ax.legend(
        handles=[Patch(color=c, alpha=0.6, label=meaning[k]) for k, c in _LAYOUT_COLOURS.items()]
        + [Line2D([], [], color="tab:red", label="collective in forward"),
           Line2D([], [], color="tab:purple", label="(collective in backward)")],
        loc="lower center", ncol=5, fontsize=8, frameon=False,
    )  # fmt: skip
    ax.set_title("Activations of one GPT block over the ranks, and the collectives between them", fontsize=10)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------
# 5. Pipeline schedules
# ----------------------------------------------------------------------------------------


def pipeline_cells(stages: int, micro_batches: int, kind: str) -> dict[str, Any]:
    """What :func:`pipeline_schedule_figure` draws for one schedule: ``grid`` from
    ``parallel.pipeline.schedule``, its ``idle`` cell count, ``bubble`` share and per-stage
    ``in_flight`` peaks (micro-batches whose activations a stage holds)."""
    grid = pipeline.schedule(stages, micro_batches, kind)
    return {
        "grid": grid,
        "idle": sum(cell is None for row in grid for cell in row),
        "slots": sum(len(row) for row in grid),
        "bubble": pipeline.schedule_bubble(grid),
        "in_flight": pipeline.in_flight(grid),
    }


def pipeline_schedule_figure(stages: int = 4, micro_batches: int = 8) -> Figure:
    """GPipe (top) and 1F1B (bottom) as Gantt charts from ``parallel.pipeline.schedule``: a row
    per stage, a column per time slot (one micro-batch's forward or backward on one stage), F
    and B cells numbered by micro-batch, idle cells (the bubble) hatched."""
    p, m = stages, micro_batches
    fig, axes = plt.subplots(2, 1, figsize=(11, 1.6 + 2 * (0.45 * p + 0.9)), sharex=True)
    for ax, kind in zip(axes, ("gpipe", "1f1b")):
        cells = pipeline_cells(p, m, kind)
        for st, row in enumerate(cells["grid"]):
            for t, op in enumerate(row):
                if op is None:
                    ax.add_patch(
                        Rectangle(
                            (t, st - 0.4), 1, 0.8, facecolor="white", edgecolor="0.7", hatch="///", lw=0.5, gid="idle"
                        )
                    )
                    continue
                colour = "tab:blue" if op[0] == "F" else "tab:orange"
                ax.add_patch(
                    Rectangle((t, st - 0.4), 1, 0.8, facecolor=colour, edgecolor="white", gid=f"{op[0]}{op[1]}")
                )
                ax.text(t + 0.5, st, f"{op[0]}{op[1]}", ha="center", va="center", fontsize=7, color="white")
        ax.set_xlim(0, len(cells["grid"][0]))
        ax.set_xticks(range(0, len(cells["grid"][0]) + 1, 2))
        ax.set_ylim(p - 0.5, -0.5)
        ax.set_yticks(range(p), [f"stage {s}" for s in range(p)], fontsize=8)
        ax.set_title(
            f"{'GPipe' if kind == 'gpipe' else '1F1B'}: bubble {cells['idle']}/{cells['slots']} slots = "
            f"{cells['bubble']:.2f} = (p-1)/(m+p-1); activations held per stage, at most: {cells['in_flight']}",
            fontsize=10,
        )
    axes[-1].set_xlabel("time slot (one forward or backward of one micro-batch)")
    fig.legend(
        handles=[
            Patch(color="tab:blue", label="forward of micro-batch i (Fi)"),
            Patch(color="tab:orange", label="backward of micro-batch i (Bi)"),
            Patch(facecolor="white", edgecolor="0.6", hatch="///", label="idle: the bubble"),
        ],
        loc="lower center",
        ncol=3,
        fontsize=8,
        frameon=False,
    )
    fig.suptitle(f"Pipeline schedules: p = {p} stages, m = {m} micro-batches", fontsize=11)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


# ----------------------------------------------------------------------------------------
# 6. The five collectives
# ----------------------------------------------------------------------------------------

COLLECTIVES = ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter")


def collective_states(n_ranks: int = 4) -> dict[str, dict[str, list[list[int | None]]]]:
    """What each rank holds before and after each collective, on numbers: ``out[name]["before"]``
    and ``["after"]`` are ``[rank][chunk]`` grids of ints, None where the rank holds nothing there.

    Rank r starts with the vector ``r * N + 1 ... r * N + N`` (one number per chunk). Broadcast and
    reduce use rank 0 as root. After a reduce only the root's buffer is defined (``dist.reduce``
    leaves the others' as scratch). All-gather's input is rank r's chunk r alone; reduce-scatter
    leaves rank r the sum of chunk r only."""
    if n_ranks < 2:
        raise ValueError(f"a collective needs at least 2 ranks, got {n_ranks}")
    n = n_ranks
    x = torch.arange(1, n * n + 1).reshape(n, n)  # x[r]: rank r's vector
    total = x.sum(0).tolist()
    full = x.tolist()
    own = [[x[r, c].item() if c == r else None for c in range(n)] for r in range(n)]
    return {
        "broadcast": {"before": full, "after": [full[0]] * n},
        "reduce": {"before": full, "after": [total] + [[None] * n] * (n - 1)},
        "all_reduce": {"before": full, "after": [total] * n},
        "all_gather": {"before": own, "after": [[x[c, c].item() for c in range(n)]] * n},
        "reduce_scatter": {
            "before": full,
            "after": [[total[c] if c == r else None for c in range(n)] for r in range(n)],
        },
    }


def collectives_figure(n_ranks: int = 4) -> Figure:
    """The five collectives side by side (columns), before (top row) and after (bottom row): a row
    of cells per rank, one cell per chunk, numbers from :func:`collective_states`. A cell is
    coloured by the rank its number came from, dark grey where it is a sum over all ranks, and
    left empty where the rank holds nothing (or, after a reduce, nothing defined)."""
    states, n = collective_states(n_ranks), n_ranks
    sums = set(states["all_reduce"]["after"][0])
    fig, axes = plt.subplots(2, len(COLLECTIVES), figsize=(3.0 * len(COLLECTIVES), 2 * (0.45 * n + 1.0) + 0.8))
    for col, name in enumerate(COLLECTIVES):
        for row, phase in enumerate(("before", "after")):
            ax = axes[row][col]
            for r, cells in enumerate(states[name][phase]):
                for c, v in enumerate(cells):
                    if v is None:
                        ax.add_patch(Rectangle((c, r - 0.4), 0.9, 0.8, facecolor="none", edgecolor="0.8", lw=0.5))
                        continue
                    summed = phase == "after" and v in sums and name not in ("broadcast", "all_gather")
                    colour = "0.3" if summed else _colour((v - 1) // n)
                    ax.add_patch(
                        Rectangle(
                            (c, r - 0.4), 0.9, 0.8, facecolor=colour, alpha=0.8, edgecolor="black", lw=0.5,
                            gid=f"{name}:{phase}:{r}:{c}",
                        )
                    )  # fmt: skip
                    ax.text(c + 0.45, r, str(v), ha="center", va="center", fontsize=8, color="white")
            ax.set_xlim(-0.1, n)
            ax.set_ylim(n - 0.5, -0.5)
            ax.set_xticks([c + 0.45 for c in range(n)], [str(c) for c in range(n)], fontsize=7)
            ax.set_yticks(range(n), [f"rank {r}" for r in range(n)], fontsize=8)
            ax.tick_params(length=0)
            ax.set_xlabel("chunk", fontsize=8)
            for side in ax.spines.values():
                side.set_visible(False)
            ax.set_title(f"{name.replace('_', '-')}: {phase}", fontsize=10)
    handles = [Patch(color=_colour(r), alpha=0.8, label=f"rank {r}'s number") for r in range(n)]
    handles.append(Patch(color="0.3", alpha=0.8, label="a sum over all ranks"))
    handles.append(Patch(facecolor="none", edgecolor="0.7", label="nothing (defined) held"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle(f"The five collectives on {n} ranks (root: rank 0): what each rank holds", fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


# ----------------------------------------------------------------------------------------
# 7. Data, tensor and pipeline parallelism: who holds what
# ----------------------------------------------------------------------------------------

SPLITS = ("data", "tensor", "pipeline")


def parallel_split(n_ranks: int = 4, depth: int = 4, width: int = 8, batch_size: int = 8) -> dict[str, list[dict]]:
    """What each rank holds of a :func:`utils.memory.block_mlp` of ``depth`` blocks and of a batch,
    under each way of splitting the work: ``out[kind][rank]`` is ``{"blocks": [block indices],
    "hidden": (lo, hi), "rows": [batch rows]}``, hidden units ``lo:hi`` of each block held.

    * data: every block whole, the rows ``data.shard_indices`` gives the rank (as
      ``DistributedSampler`` without shuffling);
    * tensor: every block, hidden units where ``tensor_parallel.column_shard`` and ``row_shard``
      put the rank's shard (found by matching the shard to the whole weight), all rows;
    * pipeline: the blocks of the rank's stage in ``pipeline.split_stages``, all rows."""
    model = memory.block_mlp(width, depth)
    hidden = model[0][0].out_features
    index = {id(b): i for i, b in enumerate(model)}
    all_rows, all_blocks = list(range(batch_size)), list(range(depth))
    stages = pipeline.split_stages(model, n_ranks)
    out = {kind: [] for kind in SPLITS}
    for r in range(n_ranks):
        rows = data.shard_indices(batch_size, shuffle=False, rank=r, world_size=n_ranks).tolist()
        out["data"].append({"blocks": all_blocks, "hidden": (0, hidden), "rows": rows})
        w1, _ = tensor_parallel.column_shard(model[0][0], r, n_ranks)
        full = model[0][0].weight.detach()
        lo = next(i for i in range(hidden) if torch.equal(full[i : i + len(w1)], w1))
        w2 = tensor_parallel.row_shard(model[0][2], r, n_ranks)
        if not torch.equal(model[0][2].weight.detach()[:, lo : lo + len(w1)], w2):
            raise AssertionError("row_shard and column_shard must cut the same hidden units")
        out["tensor"].append({"blocks": all_blocks, "hidden": (lo, lo + len(w1)), "rows": all_rows})
        out["pipeline"].append({"blocks": [index[id(b)] for b in stages[r]], "hidden": (0, hidden), "rows": all_rows})
    return out


def parallel_split_figure(n_ranks: int = 4, depth: int = 4, width: int = 8, batch_size: int = 8) -> Figure:
    """Data, tensor and pipeline parallelism side by side, from :func:`parallel_split`: a row per
    rank; on the left the model's blocks (a block's hidden units run top to bottom, the part the
    rank holds filled), on the right the batch's rows (the ones the rank computes filled)."""
    split = parallel_split(n_ranks, depth, width, batch_size)
    hidden = split["data"][0]["hidden"][1]
    fig, axes = plt.subplots(1, 3, figsize=(15, 1.0 + 0.75 * n_ranks + 0.6))
    titles = {
        "data": "Data parallel: whole model, a slice of the batch",
        "tensor": "Tensor parallel: a slice of every layer, whole batch",
        "pipeline": "Pipeline parallel: some whole layers, whole batch",
    }
    gap = 1.0
    for ax, kind in zip(axes, SPLITS):
        for r, held in enumerate(split[kind]):
            y = r - 0.35
            for b in range(depth):
                ax.add_patch(Rectangle((b, y), 0.8, 0.7, facecolor="none", edgecolor="0.7", lw=0.5))
                if b in held["blocks"]:
                    lo, hi = held["hidden"]
                    ax.add_patch(
                        Rectangle(
                            (b, y + 0.7 * lo / hidden), 0.8, 0.7 * (hi - lo) / hidden, facecolor=_colour(r), alpha=0.8,
                            gid=f"{kind}:{r}:block:{b}",
                        )
                    )  # fmt: skip
            for i in range(batch_size):
                x0 = depth + gap + i * 0.5
                held_row = i in held["rows"]
                ax.add_patch(
                    Rectangle(
                        (x0, y), 0.4, 0.7, facecolor=_colour(r) if held_row else "none", alpha=0.8 if held_row else 1,
                        edgecolor="0.7", lw=0.5, gid=f"{kind}:{r}:row:{i}" if held_row else None,
                    )
                )  # fmt: skip
        ax.set_xlim(-0.2, depth + gap + 0.5 * batch_size)
        ax.set_ylim(n_ranks - 0.5, -0.5)
        ax.set_yticks(range(n_ranks), [f"rank {r}" for r in range(n_ranks)], fontsize=8)
        ax.set_xticks(
            [b + 0.4 for b in range(depth)] + [depth + gap + 0.5 * i + 0.2 for i in range(batch_size)],
            [f"B{b}" for b in range(depth)] + [str(i) for i in range(batch_size)],
            fontsize=7,
        )
        ax.tick_params(length=0)
        ax.set_xlabel("model blocks (hidden units top to bottom)  |  batch rows", fontsize=8)
        ax.set_title(titles[kind], fontsize=10)
        for side in ax.spines.values():
            side.set_visible(False)
    fig.suptitle(
        f"Three ways to split training over {n_ranks} ranks: a {depth}-block MLP (hidden {hidden}), "
        f"a batch of {batch_size}",
        fontsize=11,
    )
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------
# 8. Ranks, local ranks and nodes
# ----------------------------------------------------------------------------------------


def rank_layout(nodes: int = 2, gpus_per_node: int = 4, *, job_id: int = 123456) -> list[dict[str, Any]]:
    """Every task of ``srun --nodes=nodes --ntasks-per-node=gpus_per_node`` (SLURM's default block
    distribution: tasks fill node 0 first), with what ``parallel.rendezvous_env`` reads from the
    variables SLURM gives it: ``node``, ``host``, ``gpu`` and the env's ``rank``, ``local_rank``,
    ``world_size``, ``local_world_size``, ``master_addr``, ``master_port``."""
    hostlist = f"node[01-{nodes:02d}]"
    hosts = parallel_env.expand_hostlist(hostlist)
    out = []
    for task in range(nodes * gpus_per_node):
        node, local = divmod(task, gpus_per_node)
        env = {
            "SLURM_JOB_ID": str(job_id),
            "SLURM_STEP_ID": "0",
            "SLURM_PROCID": str(task),
            "SLURM_NTASKS": str(nodes * gpus_per_node),
            "SLURM_LOCALID": str(local),
            "SLURM_NODEID": str(node),
            "SLURM_TASKS_PER_NODE": f"{gpus_per_node}(x{nodes})",
            "SLURM_JOB_NODELIST": hostlist,
        }
        e = parallel_env.rendezvous_env(env)
        out.append(
            {
                "node": node,
                "host": hosts[node],
                "gpu": e.local_rank,
                "rank": e.rank,
                "local_rank": e.local_rank,
                "world_size": e.world_size,
                "local_world_size": e.local_world_size,
                "master_addr": e.master_addr,
                "master_port": e.master_port,
            }
        )
    return out


def rank_layout_figure(nodes: int = 2, gpus_per_node: int = 4) -> Figure:
    """Nodes as boxes, their GPUs inside, each GPU labelled with its process's RANK and LOCAL_RANK
    from :func:`rank_layout`; the title gives WORLD_SIZE, and the first node is marked as
    MASTER_ADDR."""
    tasks = rank_layout(nodes, gpus_per_node)
    first = tasks[0]
    fig, ax = plt.subplots(figsize=(1.5 + 1.45 * gpus_per_node * nodes, 3.0))
    node_w = gpus_per_node * 1.2 + 0.4
    for n in range(nodes):
        x0 = n * (node_w + 0.6)
        host = tasks[n * gpus_per_node]["host"]
        ax.add_patch(Rectangle((x0, 0), node_w, 2.2, facecolor="0.95", edgecolor="black", gid=f"node:{n}"))
        master = " = MASTER_ADDR" if host == first["master_addr"] else ""
        ax.text(x0 + node_w / 2, 2.05, f"{host} (node {n}){master}", ha="center", va="top", fontsize=9, weight="bold")
    for t in tasks:
        x0 = t["node"] * (node_w + 0.6) + 0.3 + t["gpu"] * 1.2
        ax.add_patch(
            Rectangle(
                (x0, 0.2),
                1.0,
                1.45,
                facecolor=_colour(t["node"]),
                alpha=0.35,
                edgecolor="black",
                gid=f"gpu:{t['rank']}",
            )
        )
        ax.text(
            x0 + 0.5, 0.92, f"GPU {t['gpu']}\n\nRANK {t['rank']}\nLOCAL_RANK {t['local_rank']}",
            ha="center", va="center", fontsize=8,
        )  # fmt: skip
    ax.set_xlim(-0.2, nodes * (node_w + 0.6) - 0.4)
    ax.set_ylim(0, 2.3)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(
        f"{nodes} nodes x {gpus_per_node} GPUs: WORLD_SIZE = {first['world_size']}, "
        f"LOCAL_WORLD_SIZE = {first['local_world_size']}, MASTER_ADDR:PORT = "
        f"{first['master_addr']}:{first['master_port']}\nRANK = node x GPUs per node + LOCAL_RANK",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------
# 9. Memory over one training step, with and without activation checkpointing
# ----------------------------------------------------------------------------------------

_PARTS = ("params", "optimizer", "grads", "activations")


def step_memory(
    width: int, depth: int, batch_size: int, *, segment: int | None = None, optimizer: str = "sgd"
) -> list[tuple[str, dict[str, int]]]:
    """Bytes held through one training step of ``memory.block_mlp(width, depth)``, event by event:
    ``[(label, {"params", "optimizer", "grads", "activations"}), ...]``, each the state after the
    event. Sizes from the lesson's own formulas: ``memory.budget`` of one block (parameters,
    gradients, optimizer state) and ``memory.mlp_activation_bytes`` (what a block saves, what the
    loss saves, what checkpointing keeps).

    The step: the optimizer state is resident from the step before. Forward saves each block's
    activations (with ``segment``: only each segment's input), then the loss saves the output.
    Backward frees the loss's, then per block (from the last) writes the block's gradients and
    frees its activations; with checkpointing each segment first runs its forward again. Then the
    optimizer steps and ``zero_grad`` frees the gradients."""
    one = memory.budget(width, 1, batch_size, optimizer)
    act_out = memory.mlp_activation_bytes(width, 0, batch_size)  # what the loss keeps
    act_block = memory.mlp_activation_bytes(width, 1, batch_size) - act_out
    act_in = 4 * batch_size * width  # a segment's input: what checkpointing keeps of it
    seg = segment or 0
    s = {"params": depth * one["params"], "optimizer": depth * one["optimizer"], "grads": 0, "activations": 0}
    events = [("start", dict(s))]

    def event(label, **change):
        for k, v in change.items():
            s[k] += v
        events.append((label, dict(s)))

    for b in range(depth):
        if not seg:
            event(f"F{b}", activations=act_block)
        elif b % seg == 0:
            event(f"F{b}", activations=act_in)
        else:
            event(f"F{b}")
    event("loss", activations=act_out)
    event("loss'", activations=-act_out)
    for b in reversed(range(depth)):
        first = b - b % seg if seg else b
        if seg and b == min(first + seg, depth) - 1:  # the segment's last block: run its forward again
            event(f"R{first}-{b}", activations=(b - first + 1) * act_block - act_in)
        event(f"B{b}", grads=one["grads"])
        event("", activations=-act_block)
    event("opt")
    event("zero_grad", grads=-s["grads"])
    return events


def step_memory_figure(
    width: int = 1024, depth: int = 8, batch_size: int = 4096, *, segment: int = 2, optimizer: str = "sgd"
) -> Figure:
    """One training step's memory, stacked by part, without (left) and with activation
    checkpointing every ``segment`` blocks (right), from :func:`step_memory`: F forward of a block,
    R a segment's forward run again, B a block's backward (its gradients written; the point after
    it frees its activations)."""
    mib = 2**20
    colours = {"params": "tab:blue", "optimizer": "tab:green", "grads": "tab:orange", "activations": "tab:red"}
    runs = {"no checkpointing": step_memory(width, depth, batch_size, optimizer=optimizer)}
    runs[f"checkpoint every {segment} blocks"] = step_memory(
        width, depth, batch_size, segment=segment, optimizer=optimizer
    )
    top = max(sum(st.values()) for ev in runs.values() for _, st in ev) / mib
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2), sharey=True)
    for ax, (title, ev) in zip(axes, runs.items()):
        xs = range(len(ev))
        ax.stackplot(
            xs, *[[st[p] / mib for _, st in ev] for p in _PARTS], step="post",
            colors=[colours[p] for p in _PARTS], alpha=0.75, labels=[p for p in _PARTS],
        )  # fmt: skip
        totals = [sum(st.values()) for _, st in ev]
        k = max(range(len(ev)), key=totals.__getitem__)
        ax.axhline(totals[k] / mib, color="black", lw=0.8, ls="--", gid="peak")
        ax.text(0, totals[k] / mib, f" peak {totals[k] / mib:.0f} MiB at {ev[k][0]}", va="bottom", fontsize=8)
        ticks = [i for i, (label, _) in enumerate(ev) if label]
        ax.set_xticks([i + 0.5 for i in ticks], [ev[i][0] for i in ticks], rotation=90, fontsize=7)
        ax.set_xlim(0, len(ev))
        ax.set_ylim(0, top * 1.15)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("event of the step (F forward, R recompute, B backward)")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("bytes held (MiB)")
    axes[0].legend(loc="upper right", fontsize=8)
    fig.suptitle(
        f"Memory through one training step: block MLP d = {width}, {depth} blocks, batch {batch_size}, {optimizer}",
        fontsize=11,
    )
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------
# 10a. The GPT's model state per rank: DDP against FSDP2 per block
# ----------------------------------------------------------------------------------------

GPT_REST = "tables and final LayerNorm"  # the root unit: what fully_shard(model) keeps after the blocks


def gpt_units(arch: gpt.GPTConfig) -> dict[str, list[tuple[int, ...]]]:
    """The shapes of ``gpt.GPT(arch)``'s parameters by FSDP unit, as ``fully_shard`` on each
    block and then on the model groups them: ``"block i"`` for each block, then :data:`GPT_REST`
    (the token table, which is also the output projection, counted once; the position table; the
    final LayerNorm). Built on the meta device: no memory, whatever the size."""
    with torch.device("meta"):
        model = gpt.GPT(arch)
    units = {f"block {i}": [tuple(p.shape) for p in b.parameters()] for i, b in enumerate(model.blocks)}
    in_blocks = {id(p) for p in model.blocks.parameters()}
    units[GPT_REST] = [tuple(p.shape) for p in model.parameters() if id(p) not in in_blocks]
    return units


def gpt_rank_bytes(arch: gpt.GPTConfig, n_ranks: int, *, bytes_per_element: int = 16) -> dict[str, list[dict]]:
    """Bytes each of ``n_ranks`` ranks holds of each unit of ``gpt.GPT(arch)`` (:func:`gpt_units`)
    for parameters, gradients and optimizer state together, ``bytes_per_element`` per element
    held (fp32 AdamW: 4 + 4 + 8 = 16). ``{"ddp": [per rank {unit: bytes}], "fsdp2": [...]}``:
    under DDP every rank holds every tensor whole; under FSDP2 rank r holds its dim-0 shard of
    each (``parallel.shard.dim0_shard_numel``), so the ranks' bytes sum to DDP's one copy."""
    units = gpt_units(arch)
    whole = {u: bytes_per_element * sum(int(np.prod(s)) for s in shapes) for u, shapes in units.items()}
    return {
        "ddp": [dict(whole) for _ in range(n_ranks)],
        "fsdp2": [
            {
                u: bytes_per_element * sum(shard.dim0_shard_numel(s, n_ranks, r) for s in shapes)
                for u, shapes in units.items()
            }
            for r in range(n_ranks)
        ],
    }


def gpt_rank_bytes_figure(
    arch: gpt.GPTConfig, n_ranks: int = 2, *, measured: dict[str, list[float]] | None = None
) -> Figure:
    """What each rank holds of a GPT's model state (parameters, gradients, AdamW state: 16 bytes
    per fp32 element) under DDP and under FSDP2 with one unit per block: a stacked bar per rank,
    one segment per unit (the blocks in two alternating blues, the rest in green), from
    :func:`gpt_rank_bytes`. ``measured``: ``{"ddp": [bytes per rank], "fsdp2": [...]}``, drawn as
    a marker on each bar."""
    held = gpt_rank_bytes(arch, n_ranks)
    names = {"ddp": "DDP", "fsdp2": "FSDP2 per block"}
    units = list(held["ddp"][0])
    colours = {u: ("tab:blue", "lightsteelblue")[i % 2] for i, u in enumerate(units)} | {GPT_REST: "tab:green"}
    mib = 2**20
    top = max(sum(u.values()) for ranks in held.values() for u in ranks) / mib
    fig, ax = plt.subplots(figsize=(7.5, 4))
    x = 0
    ticks, labels = [], []
    for strategy, ranks in held.items():
        for r, per_unit in enumerate(ranks):
            bottom = 0.0
            for u in units:
                ax.bar(
                    x, per_unit[u] / mib, bottom=bottom / mib, width=0.7, color=colours[u], edgecolor="white",
                    gid=f"{strategy}:{r}:{u}",
                )  # fmt: skip
                bottom += per_unit[u]
            ax.text(x, bottom / mib + 0.04 * top, f"{bottom / mib:.2f} MiB", ha="center", va="bottom", fontsize=8)
            if measured is not None:
                ax.plot(x, measured[strategy][r] / mib, "kx", ms=9, mew=2)
            ticks.append(x)
            labels.append(f"{names[strategy]}\nrank {r}")
            x += 1
        x += 0.5  # a gap between the strategies
    ax.set_xticks(ticks, labels, fontsize=8)
    ax.set_ylim(0, top * 1.3)
    ax.set_ylabel("parameters + gradients + AdamW state (MiB)")
    ax.set_title(
        f"What each of {n_ranks} ranks holds: GPT d={arch.width}, L={arch.layers}, "
        f"{gpt.parameter_count(arch):,} parameters, fp32 AdamW",
        fontsize=10,
    )
    handles = [
        Patch(color="tab:blue", label=f"blocks 0 to {arch.layers - 1}, one segment each"),
        Patch(color=colours[GPT_REST], label=f"{GPT_REST} (root unit)"),
    ]
    if measured is not None:
        handles.append(Line2D([], [], color="black", marker="x", ls="", mew=2, label="measured (local shards)"))
    ax.legend(handles=handles, fontsize=7, loc="upper right")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------
# 10. FSDP: all-gather, compute, reduce-scatter per block
# ----------------------------------------------------------------------------------------


def fsdp_timeline(
    n_blocks: int,
    block_bytes: float,
    world_size: int,
    *,
    t_forward: float,
    t_backward: float,
    alpha_s: float = 5e-6,
    bandwidth: float = 100e9,
    prefetch: bool = True,
) -> dict[str, Any]:
    """One FSDP (ZeRO-3) training step of ``n_blocks`` equal blocks on three lanes: compute, the
    all-gather stream and the reduce-scatter stream (FSDP2 gives each collective its own).

    Each block's parameters (``block_bytes``, unsharded) are all-gathered before its forward and
    again before its backward (they are freed in between), and its gradients reduce-scattered
    after its backward. A collective costs ``(N-1) alpha`` plus the bytes a ring sends per rank
    (``parallel.shard.ring_bytes``) over ``bandwidth``. A block's compute starts when its
    all-gather is done and the previous compute is. Without ``prefetch`` the all-gather of a
    block is issued when the previous block's compute ends; with it, when that compute starts
    (one block ahead), so it runs under it. Returns ``ops`` (lane, name, start, end), ``t_end``
    and ``sent`` (bytes each rank sends)."""
    n = world_size
    t_ag = (n - 1) * alpha_s + shard.ring_bytes("all_gather", block_bytes, n) / bandwidth
    t_rs = (n - 1) * alpha_s + shard.ring_bytes("reduce_scatter", block_bytes, n) / bandwidth
    ops, free = [], {"compute": 0.0, "all-gather": 0.0, "reduce-scatter": 0.0}

    def run(lane, name, start, dt):
        start = max(start, free[lane])
        free[lane] = start + dt
        ops.append((lane, name, start, start + dt))
        return start, start + dt

    for phase, order, dt, tag in (
        ("forward", range(n_blocks), t_forward, "F"),
        ("backward", reversed(range(n_blocks)), t_backward, "B"),
    ):
        issue = free["compute"]  # the pass starts when the compute before it ends
        for b in order:
            _, ag_end = run("all-gather", f"AG{b}", issue, t_ag)
            c_start, c_end = run("compute", f"{tag}{b}", ag_end, dt)
            issue = c_start if prefetch else c_end
            if phase == "backward":
                run("reduce-scatter", f"RS{b}", c_end, t_rs)
    sent = n_blocks * (
        2 * shard.ring_bytes("all_gather", block_bytes, n) + shard.ring_bytes("reduce_scatter", block_bytes, n)
    )
    return {"ops": ops, "t_end": max(free.values()), "sent": sent, "t_ag": t_ag, "t_rs": t_rs}


def fsdp_figure(
    model: nn.Module | None = None,
    world_size: int = 8,
    *,
    batch_size: int = 2048,
    flops: float = 50e12,
    alpha_s: float = 5e-6,
    bandwidth: float = 50e9,
) -> Figure:
    """FSDP's step on three lanes, without (top) and with prefetch (bottom), from
    :func:`fsdp_timeline`. ``model``: a Sequential of equal blocks, default
    ``memory.block_mlp(2048, 6)``; a block's forward costs ``2 x batch_size x its parameters``
    FLOPs, its backward twice that, at ``flops`` per second."""
    if model is None:
        model = memory.block_mlp(2048, 6)
    block_params = sum(p.numel() for p in model[0].parameters())
    block_bytes = memory.parameter_bytes(model[0])
    t_f = 2 * batch_size * block_params / flops
    kw = {"t_forward": t_f, "t_backward": 2 * t_f, "alpha_s": alpha_s, "bandwidth": bandwidth}
    us = 1e6
    lanes = {"compute": 2, "all-gather": 1, "reduce-scatter": 0}
    fig, axes = plt.subplots(2, 1, figsize=(12, 5.2), sharex=True)
    ends = {}
    for ax, prefetch in zip(axes, (False, True)):
        tl = fsdp_timeline(len(model), block_bytes, world_size, prefetch=prefetch, **kw)
        ends[prefetch] = tl["t_end"]
        for lane, name, start, end in tl["ops"]:
            colour = {"F": "tab:blue", "B": "tab:orange", "A": "tab:green", "R": "tab:red"}[name[0]]
            ax.barh(
                lanes[lane], (end - start) * us, left=start * us, height=0.6, color=colour, edgecolor="white", gid=name
            )
            ax.text((start + end) / 2 * us, lanes[lane], name, ha="center", va="center", fontsize=6, color="white")
        ax.axvline(tl["t_end"] * us, color="black", lw=1)
        ax.text(tl["t_end"] * us, 2.55, f" end {tl['t_end'] * us:.0f} µs", fontsize=8, va="center")
        ax.set_yticks(list(lanes.values()), list(lanes))
        ax.set_ylim(-0.5, 2.8)
        ax.grid(axis="x", alpha=0.3)
        ax.set_title(
            "prefetch: the next block's all-gather is issued when this block's compute starts"
            if prefetch
            else "no prefetch: each all-gather waits for the compute before it",
            fontsize=10,
        )
    axes[-1].set_xlabel("time since the step started (µs)")
    fig.legend(
        handles=[
            Patch(color="tab:blue", label="forward of block i (Fi)"),
            Patch(color="tab:orange", label="backward (Bi)"),
            Patch(color="tab:green", label="all-gather of its parameters (AGi)"),
            Patch(color="tab:red", label="reduce-scatter of its gradients (RSi)"),
        ],
        loc="lower center",
        ncol=4,
        fontsize=8,
        frameon=False,
    )
    fig.suptitle(
        f"FSDP on {world_size} ranks: {len(model)} blocks of {block_bytes / 2**20:.0f} MiB, batch {batch_size}; "
        f"prefetch: {ends[False] * us:.0f} -> {ends[True] * us:.0f} µs",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


# ----------------------------------------------------------------------------------------
# 11. The rendezvous
# ----------------------------------------------------------------------------------------


def rendezvous_sequence(
    hosts: Sequence[str] = ("node01", "node02"),
    nproc_per_node: int = 2,
    *,
    arrival: Sequence[str] | None = None,
    port: int = 29400,
) -> dict[str, Any]:
    """The messages of a torchrun start on ``hosts`` (``--nnodes=len(hosts)
    --nproc-per-node=nproc_per_node --rdzv-backend=c10d --rdzv-endpoint=hosts[0]:port``), in order:
    ``messages`` is ``[(src, dst, text), ...]`` between the lifelines ``"store"`` (the c10d store
    at the endpoint), ``"agent <host>"`` and ``"rank <r>"``.

    The agents join in ``arrival`` order (default: ``hosts``). When the last one has joined,
    torch's c10d rendezvous numbers the nodes by their sorted descriptors (host name first), so
    node ranks follow the host names, not the arrival. Each agent starts its ranks with
    ``RANK = node_rank * nproc_per_node + LOCAL_RANK`` and the store's address as
    MASTER_ADDR:MASTER_PORT; the ranks' fields here are what ``parallel.rendezvous_env`` reads
    from those variables. Then every rank's ``init_process_group`` publishes its address in the
    store and waits for all; the backend connects the ranks directly."""
    arrival = list(hosts if arrival is None else arrival)
    if sorted(arrival) != sorted(hosts) or len(set(hosts)) != len(hosts):
        raise ValueError(f"arrival must be the hosts {list(hosts)} in some order, each once; got {arrival}")
    nnodes, world = len(hosts), len(hosts) * nproc_per_node
    node_rank = {h: i for i, h in enumerate(sorted(hosts))}
    msgs = [(f"agent {h}", "store", f"join ({k + 1} of {nnodes})") for k, h in enumerate(arrival)]
    msgs += [("store", f"agent {h}", f"complete: node rank {node_rank[h]}") for h in arrival]
    ranks = {}
    for h in sorted(hosts, key=node_rank.get):
        for local in range(nproc_per_node):
            env = {
                "RANK": str(node_rank[h] * nproc_per_node + local),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(local),
                "LOCAL_WORLD_SIZE": str(nproc_per_node),
                "MASTER_ADDR": hosts[0],
                "MASTER_PORT": str(port),
            }
            e = parallel_env.rendezvous_env(env)
            ranks[e.rank] = {"host": h, "local_rank": e.local_rank, "world_size": e.world_size}
            msgs.append((f"agent {h}", f"rank {e.rank}", f"start: RANK={e.rank} LOCAL_RANK={e.local_rank}"))
    msgs += [(f"rank {r}", "store", "init_process_group: my address") for r in range(world)]
    msgs += [("store", f"rank {r}", f"all {world} ranks in") for r in range(world)]
    msgs += [(f"rank {r}", f"rank {(r + 1) % world}", "backend connects") for r in range(world)]
    lifelines = ["store"] + [f"agent {h}" for h in sorted(hosts)] + [f"rank {r}" for r in range(world)]
    return {"lifelines": lifelines, "messages": msgs, "ranks": ranks, "node_rank": node_rank}


def rendezvous_figure(
    hosts: Sequence[str] = ("node01", "node02"), nproc_per_node: int = 2, *, arrival: Sequence[str] | None = None
) -> Figure:
    """The torchrun start of :func:`rendezvous_sequence` as a sequence diagram: a vertical
    lifeline per participant, time running down, an arrow per message."""
    seq = rendezvous_sequence(hosts, nproc_per_node, arrival=arrival)
    x = {name: i for i, name in enumerate(seq["lifelines"])}
    msgs = seq["messages"]
    fig, ax = plt.subplots(figsize=(1.6 * len(x) + 1, 0.36 * len(msgs) + 1.6))
    for name, i in x.items():
        ax.plot([i, i], [0, len(msgs) + 0.2], color="0.6", lw=0.8, ls="--")
        kind = "tab:purple" if name == "store" else "tab:blue" if name.startswith("agent") else "tab:green"
        label = f"c10d store\n{hosts[0]}" if name == "store" else name.replace("agent ", "agent\n")
        ax.text(i, -0.6, label, ha="center", va="center", fontsize=8, weight="bold", color=kind)
    for k, (src, dst, text) in enumerate(msgs):
        y = k + 0.6
        colour = "tab:purple" if "store" in (src, dst) else "tab:blue" if src.startswith("agent") else "tab:green"
        ax.add_patch(
            FancyArrowPatch(
                (x[src], y), (x[dst], y), arrowstyle="-|>", mutation_scale=9, color=colour, lw=1,
                gid=f"msg:{src}->{dst}",
            )
        )  # fmt: skip
        ax.text((x[src] + x[dst]) / 2, y - 0.1, text, ha="center", va="bottom", fontsize=7.5)
    ax.set_xlim(-0.8, len(x) - 0.2)
    ax.set_ylim(len(msgs) + 0.4, -1.2)
    ax.set_yticks([0.6, len(msgs) - 0.4], ["start", "ready"], fontsize=8)
    ax.set_xticks([])
    ax.set_ylabel("time (messages in order)", fontsize=8)
    for side in ax.spines.values():
        side.set_visible(False)
    world = len(seq["ranks"])
    ax.set_title(
        f"torchrun on {len(hosts)} nodes x {nproc_per_node}: agents meet in the c10d store, nodes numbered by "
        f"host name,\nranks started with RANK = node rank x {nproc_per_node} + LOCAL_RANK, then "
        f"init_process_group ({world} ranks)",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------
# 12. The roofline
# ----------------------------------------------------------------------------------------


def vector_add_cost(n: int, element_size: int = 4) -> tuple[int, int]:
    """(FLOPs, bytes moved) of ``x + y`` on ``n`` elements: one add per element; read x and y,
    write the result (notebook 02's 12 bytes per FLOP in fp32)."""
    return n, 3 * element_size * n


def matmul_cost(n: int, element_size: int = 4) -> tuple[int, int]:
    """(FLOPs, bytes moved at least) of an ``n x n`` by ``n x n`` matrix multiply: ``2 n^3``
    (``bench.matmul_flops_per_s``'s count); read both inputs and write the output once each."""
    return 2 * n**3, 3 * element_size * n * n


def roofline(
    peak_flops: float, bandwidth: float, kernels: dict[str, tuple[float, float, float | None]]
) -> dict[str, Any]:
    """The roofline of a device with ``peak_flops`` (FLOP/s) and memory ``bandwidth`` (bytes/s):
    a kernel of arithmetic intensity I (FLOPs per byte moved) can reach at most
    ``min(peak_flops, I x bandwidth)``. ``kernels``: name -> (FLOPs, bytes, seconds measured or
    None). Returns ``ridge`` (the intensity where the two limits meet) and per kernel its
    ``intensity``, ``attainable``, ``achieved`` (FLOPs / seconds, or None) and ``bound``
    ("memory" left of the ridge, else "compute")."""
    if peak_flops <= 0 or bandwidth <= 0:
        raise ValueError(f"peak and bandwidth must be > 0, got {peak_flops}, {bandwidth}")
    ridge = peak_flops / bandwidth
    points = []
    for name, (fl, nbytes, seconds) in kernels.items():
        i = fl / nbytes
        points.append(
            {
                "name": name,
                "intensity": i,
                "attainable": min(peak_flops, i * bandwidth),
                "achieved": None if seconds is None else fl / seconds,
                "bound": "memory" if i < ridge else "compute",
            }
        )
    return {"peak": peak_flops, "bandwidth": bandwidth, "ridge": ridge, "points": points}


def roofline_figure(
    peak_flops: float, bandwidth: float, kernels: dict[str, tuple[float, float, float | None]], device: str = ""
) -> Figure:
    """The roofline of :func:`roofline` on log axes: the bandwidth slope, the peak, the ridge
    between them, and a point per kernel at its intensity: filled at the FLOP/s measured, hollow at
    the roof where no time was measured."""
    rl = roofline(peak_flops, bandwidth, kernels)
    giga = 1e9
    xs = [p["intensity"] for p in rl["points"]] + [rl["ridge"]]
    lo, hi = min(xs) / 4, max(xs) * 4
    grid = np.geomspace(lo, hi, 200)
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(grid, np.minimum(peak_flops, grid * bandwidth) / giga, color="black", lw=2, gid="roof", label="roof")
    ax.axvline(rl["ridge"], color="0.5", ls=":", lw=1)
    ax.text(rl["ridge"], peak_flops / giga * 1.15, f"ridge {rl['ridge']:.1f} FLOP/byte", ha="center", fontsize=8)
    for k, p in enumerate(rl["points"]):
        y = p["achieved"] if p["achieved"] is not None else p["attainable"]
        ax.plot(
            [p["intensity"]], [y / giga], "o", ms=8, color=_colour(k), gid=f"point:{p['name']}",
            mfc=_colour(k) if p["achieved"] is not None else "none", label=f"{p['name']} ({p['bound']}-bound)",
        )  # fmt: skip
    ax.set(xscale="log", yscale="log", xlim=(lo, hi))
    ax.set_ylim(top=peak_flops / giga * 2)
    ax.set_xlabel("arithmetic intensity (FLOPs per byte moved)")
    ax.set_ylabel("GFLOP/s")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(
        f"Roofline{' of ' + device if device else ''}: peak {peak_flops / giga:,.0f} GFLOP/s, "
        f"bandwidth {bandwidth / giga:,.1f} GB/s",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------
# 13. Strong and weak scaling
# ----------------------------------------------------------------------------------------


def scaling_speedup(workers: Sequence[int], serial_fraction: float) -> dict[str, list[float]]:
    """Speed-up on each number of ``workers`` when a share ``serial_fraction`` of one worker's time
    cannot be split. ``strong`` (the same problem on N workers, Amdahl 1967):
    ``1 / (f + (1 - f) / N)``, never above ``1 / f``. ``weak`` (the problem grown with N, the
    serial part not; Gustafson 1988): the work done in the same time, ``f + (1 - f) N``."""
    f = serial_fraction
    if not 0 <= f <= 1 or min(workers) < 1:
        raise ValueError(f"need 0 <= serial_fraction <= 1 and workers >= 1, got {f}, {list(workers)}")
    return {"strong": [1 / (f + (1 - f) / n) for n in workers], "weak": [f + (1 - f) * n for n in workers]}


def scaling_figure(
    workers: Sequence[int] = tuple(2**k for k in range(11)), fractions: Sequence[float] = (0.01, 0.05, 0.1, 0.25)
) -> Figure:
    """Strong scaling (left: Amdahl, its ceiling ``1/f`` dashed) against weak scaling (right:
    Gustafson), one curve per serial fraction, from :func:`scaling_speedup`; log axes."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, kind in zip(axes, ("strong", "weak")):
        ax.plot(workers, workers, color="black", lw=1, ls="--", label="ideal: N")
        for k, f in enumerate(fractions):
            ax.plot(
                workers,
                scaling_speedup(workers, f)[kind],
                "o-",
                ms=3,
                color=_colour(k),
                label=f"f = {f:g}",
                gid=f"{kind}:{f:g}",
            )
            if kind == "strong":
                ax.axhline(1 / f, color=_colour(k), ls=":", lw=1)
        ax.set(xscale="log", yscale="log")
        plots.plain_ticks(ax, "x", workers)
        ax.set_xlabel("workers N")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("speed-up over one worker")
    axes[0].set_title("Strong scaling: a fixed problem, 1 / (f + (1-f)/N); dotted: the ceiling 1/f", fontsize=9)
    axes[1].set_title("Weak scaling: the problem grows with N, f + (1-f) N", fontsize=9)
    fig.suptitle("Amdahl against Gustafson: f is the share of one worker's time that cannot be split", fontsize=11)
    fig.tight_layout()
    return fig
