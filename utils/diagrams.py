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
  ``row_shard`` on a real block; :func:`megatron_split_figure`.
* :func:`pipeline_schedule_figure`: GPipe and 1F1B from ``parallel.pipeline.schedule``.

Every figure function returns its ``Figure`` and never calls ``plt.show()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from matplotlib.lines import Line2D
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle
from torch import nn

from utils import models
from utils.parallel import collectives, pipeline, shard, tensor_parallel

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
]

_MB = 1024 * 1024  # DDP's bucket_cap_mb is in MiB
_COLOURS = plt.get_cmap("tab10").colors


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
    ax.legend(
        handles=[Patch(color=_colour(r), alpha=0.55, label=f"held by rank {r}") for r in range(n_ranks)],
        loc="lower right",
        fontsize=8,
    )
    ax.set_title(
        f"Megatron MLP on {n_ranks} ranks (d = {d}, hidden = {hidden}, batch {bsz}), to scale:\n"
        "$W_1$ split by output columns, $W_2$ by input rows, one all-reduce in forward",
        fontsize=10,
    )
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
