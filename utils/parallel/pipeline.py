"""Pipeline parallelism: the model cut into stages, one per rank, fed with micro-batches.

* :func:`schedule` lays out GPipe (all forwards, then all backwards) or 1F1B (after a warm-up,
  one forward, one backward) on a grid of unit time slots, from the dependencies alone, and
  :func:`bubble_fraction` is its idle share: ``(p-1)/(m+p-1)`` for p stages and m micro-batches,
  the same for both; 1F1B holds at most ``p - stage`` micro-batches' activations, GPipe ``m``.
* :func:`gpipe_step` is the micro-batch loop by hand, with ``send``/``recv`` between stages,
  recording when each stage computes; :func:`measured_bubble` turns those timestamps into the
  idle share.
* :func:`gpt_stages` cuts ``utils.gpt.GPT`` into stages of whole blocks, the embeddings on the
  first and the final LayerNorm and head on the last, each with its own copy of the tied table.
* :func:`pp_worker` runs the hand loop for several micro-batch counts, then
  ``torch.distributed.pipelining`` (``ScheduleGPipe``, ``Schedule1F1B``), each against the
  gradients of one process on the whole batch.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from .group import DistContext

__all__ = [
    "schedule",
    "replay",
    "bubble_fraction",
    "schedule_bubble",
    "in_flight",
    "gpipe_step",
    "measured_bubble",
    "executed_bubble",
    "library_step",
    "split_stages",
    "mse",
    "gpt_stages",
    "gpt_loss",
]


def bubble_fraction(p: int, m: int) -> float:
    """Idle share of a GPipe or 1F1B step: ``(p - 1) / (m + p - 1)``."""
    if p < 1 or m < 1:
        raise ValueError(f"need p >= 1 stages and m >= 1 micro-batches, got {p}, {m}")
    return (p - 1) / (m + p - 1)


def _order(p: int, m: int, stage: int, kind: str) -> list:
    if kind == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if kind == "1f1b":
        warm = min(p - 1 - stage, m)
        ops = [("F", i) for i in range(warm)]
        f, b = warm, 0
        while b < m:
            if f < m:
                ops.append(("F", f))
                f += 1
            ops.append(("B", b))
            b += 1
        return ops
    raise ValueError(f"unknown schedule {kind!r}; use 'gpipe' or '1f1b'")


def schedule(p: int, m: int, kind: str = "gpipe") -> list:
    """``grid[stage][slot]``: ``("F", i)``, ``("B", i)`` or ``None`` (idle), one unit of time
    per forward or backward of one micro-batch on one stage. Each stage runs its ops in order,
    each as soon as its input is there: F(s, i) after F(s-1, i); B(s, i) after B(s+1, i), and
    on the last stage after F(p-1, i)."""
    if p < 1 or m < 1:
        raise ValueError(f"need p >= 1 stages and m >= 1 micro-batches, got {p}, {m}")
    return replay([_order(p, m, s, kind) for s in range(p)])


def replay(orders: list) -> list:
    """The slot grid of per-stage op orders (``[("F", 0), ("F", 1), ..., ("B", 0), ...]`` per
    stage), each op one unit, each as early as its dependencies allow (see :func:`schedule`).
    Fed with the order a real run executed (:func:`executed_bubble`), it counts that run's
    idle slots."""
    p = len(orders)
    done: dict = {}  # (op, stage, i) -> slot it ends in
    pos, free = [0] * p, [0] * p  # next op per stage; first free slot per stage
    while any(pos[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if pos[s] == len(orders[s]):
                continue
            op, i = orders[s][pos[s]]
            dep = (("F", s - 1, i) if s else None) if op == "F" else (("B", s + 1, i) if s < p - 1 else ("F", s, i))
            if dep is not None and dep not in done:
                continue
            start = max(free[s], done[dep] if dep is not None else 0)
            done[(op, s, i)] = start + 1
            free[s] = start + 1
            pos[s] += 1
            progressed = True
        if not progressed:  # pragma: no cover - the orders above never deadlock
            raise RuntimeError("schedule deadlocked")
    end = max(free)
    grid = [[None] * end for _ in range(p)]
    for (op, s, i), t in done.items():
        grid[s][t - 1] = (op, i)
    return grid


def schedule_bubble(grid: list[list[tuple[str, int] | None]]) -> float:
    """Idle slots over all slots of a :func:`schedule` grid."""
    slots = sum(len(row) for row in grid)
    return sum(x is None for row in grid for x in row) / slots


def in_flight(grid: list[list[tuple[str, int] | None]]) -> list[int]:
    """Per stage: the most micro-batches whose forward is done and backward not yet (their
    activations are held)."""
    out = []
    for row in grid:
        held = peak = 0
        for x in row:
            if x is not None:
                held += 1 if x[0] == "F" else -1
                peak = max(peak, held)
        out.append(peak)
    return out


def split_stages(model: nn.Sequential, p: int) -> list:
    """``p`` consecutive, equal slices of a Sequential's blocks."""
    n = len(model)
    if n % p:
        raise ValueError(f"{n} blocks do not split evenly into {p} stages")
    return [model[s * n // p : (s + 1) * n // p] for s in range(p)]


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out.float() - target).pow(2).mean()


def gpipe_step(
    stage: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    m: int,
    *,
    rank: int,
    world_size: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = mse,
    trace: list | None = None,
) -> torch.Tensor | None:
    """One GPipe step of this rank's ``stage`` on the batch ``(x, y)`` cut in ``m`` micro-batches.

    Forward every micro-batch (receive its input from the previous stage, send the output on),
    then backward every micro-batch (receive the output's gradient from the next stage, send the
    input's gradient back). The last stage computes the loss of each micro-batch, divided by m,
    so the gradients add up to the whole batch's. Gradients accumulate in ``stage``'s
    parameters. ``trace``: a list to which ``(op, i, start, end)`` of each computation is appended.
    Returns the loss (last stage) or None."""
    first, last = rank == 0, rank == world_size - 1
    if x.shape[0] % m:
        raise ValueError(f"batch of {x.shape[0]} does not split into {m} equal micro-batches")
    xs, ys = x.chunk(m), y.chunk(m)
    inputs, outputs, sends = [], [], []
    total = 0.0
    for i in range(m):  # all forwards
        if first:
            inp = xs[i]
        else:
            inp = torch.empty_like(xs[i])  # the stages keep the width
            _recv(inp, rank - 1)
            inp.requires_grad_(True)
        t0 = time.perf_counter()
        out = stage(inp)
        if last:
            out = loss_fn(out, ys[i]) / m
            total += out.detach()
        _record(trace, "F", i, t0, out)
        if not last:
            sends += _isend(out.detach().contiguous(), rank + 1)
        inputs.append(inp)
        outputs.append(out)
    for i in range(m):  # all backwards
        if last:
            t0 = time.perf_counter()
            outputs[i].backward()
        else:
            grad = torch.empty_like(outputs[i])
            _recv(grad, rank + 1)
            t0 = time.perf_counter()
            outputs[i].backward(grad)
        _record(trace, "B", i, t0, outputs[i])
        if not first:
            sends += _isend(inputs[i].grad.contiguous(), rank - 1)
        outputs[i] = inputs[i] = None  # this micro-batch's activations go
    for w in sends:
        w.wait()
    return total if last else None


def _recv(tensor, src: int) -> None:
    """Receive into ``tensor`` from rank ``src``, posted through ``batch_isend_irecv`` as every
    point-to-point op in this project is (NCCL-safe: see ``collectives.ring_all_reduce``)."""
    for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, tensor, src)]):
        w.wait()


def _isend(tensor, dst: int) -> list:
    """Post a send of ``tensor`` to rank ``dst``; returns the works to wait on."""
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, dst)])


def _record(trace, op, i, t0, tensor):
    if trace is not None:
        if tensor.device.type == "cuda":
            torch.cuda.synchronize(tensor.device)  # sync point: time the kernels, not their launch
        trace.append((op, i, t0, time.perf_counter()))


def executed_bubble(traces: list) -> float:
    """The idle share of the op order a run really executed (each stage's trace), in unit slots:
    what the schedule costs, without the noise of this machine's timings."""
    return schedule_bubble(replay([[(op, i) for op, i, *_ in tr] for tr in traces]))


def measured_bubble(traces: list) -> float:
    """Idle share from every stage's ``(op, i, start, end)`` trace (one clock for all ranks:
    ``perf_counter`` is system-wide on Linux): 1 - busy time / (stages x the step's span)."""
    start = min(t[2] for tr in traces for t in tr)
    end = max(t[3] for tr in traces for t in tr)
    busy = sum(t[3] - t[2] for tr in traces for t in tr)
    return 1.0 - busy / (len(traces) * (end - start))


def library_step(
    kind: str,
    stage_mod: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    m: int,
    ctx: DistContext,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = mse,
) -> float | None:
    """One step with torch.distributed.pipelining; the loss (``loss_fn(output, target)`` of a
    micro-batch) scaled by 1/m ourselves, so the gradients mean the same on every version (2.6+
    can scale them itself: scale_grads). Returns the whole batch's loss on the last stage."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    p, r = ctx.world_size, ctx.rank
    kw = {}
    params = inspect.signature(PipelineStage.__init__).parameters
    if "input_args" in params and params["input_args"].default is inspect.Parameter.empty:
        kw["input_args"] = (x.chunk(m)[0],)  # torch 2.4 wants an example micro-batch
    stage = PipelineStage(stage_mod, r, p, ctx.device, **kw)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[kind]
    skw = {"scale_grads": False} if "scale_grads" in inspect.signature(cls.__init__).parameters else {}
    sched = cls(stage, n_microbatches=m, loss_fn=lambda out, tgt: loss_fn(out, tgt) / m, **skw)
    losses = []
    if r == 0:
        sched.step(x)
    elif r == p - 1:
        sched.step(target=y, losses=losses)
    else:
        sched.step()
    return float(sum(v.detach().item() for v in losses)) if losses else None


class _GPTStage(nn.Module):
    """Blocks ``first`` to ``first + len(blocks) - 1`` of a GPT; the first stage also embeds the
    token ids, the last also applies the final LayerNorm and the output head. Its parameters are
    named as in the whole GPT (``blocks.<global index>...``), so gradients compare by name."""

    def __init__(self, model: nn.Module, first: int, last: int):
        super().__init__()
        self.embeds, self.ends = first == 0, last == len(model.blocks)
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(first, last)})
        if self.embeds:
            self.tok, self.pos, self.in_dropout = model.tok, model.pos, model.in_dropout
        if self.ends:
            self.norm = model.norm
            self.head = nn.Linear(model.cfg.width, model.cfg.vocab_size, bias=False)
            with torch.no_grad():  # the tied table: a copy here when the token table is on another stage
                self.head.weight = model.tok.weight if self.embeds else nn.Parameter(model.tok.weight.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embeds:  # token ids in
            x = self.in_dropout(self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device)))
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.norm(x)) if self.ends else x


def gpt_stages(model: nn.Module, p: int) -> list[nn.Module]:
    """``p`` stages of a ``utils.gpt.GPT``, ``L/p`` consecutive blocks each: token ids into the
    first, hidden states ``(batch, t, d)`` between stages, logits out of the last.

    The output head and the token table are one tensor in the whole model; on two stages each holds
    a copy, and the copies stay equal only if both step with the sum of their two gradients (one
    all-reduce between the first and the last stage after backward, as Megatron-LM does)."""
    n = len(model.blocks)
    if n % p:
        raise ValueError(
            f"gpt_stages: {n} blocks do not split evenly into {p} stages. Try: a number of stages that divides {n}."
        )
    return [_GPTStage(model, s * n // p, (s + 1) * n // p) for s in range(p)]


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The GPT's loss: mean cross-entropy of every position's logits against its next token."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
