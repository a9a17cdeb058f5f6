"""Self-checks for stage 2: throughput (lab2): predicting memory, timing a step, finding the
input-pipeline bottleneck."""

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import models
from ._common import CheckFailed, _call, _close, _fail, _passed  # noqa: F401

__all__ = ["check_state_bytes", "check_time_step", "check_wait_fraction"]


# ----------------------------------------------------------------------------------------
# Exercise 1: memory
# ----------------------------------------------------------------------------------------


def _counted(model: nn.Module, optimizer: str, momentum: float) -> dict:
    """The oracle: build the real optimizer, take one step, count what it holds."""
    from ..memory import counted_state_bytes

    trainable = [p for p in model.parameters() if p.requires_grad]
    if optimizer == "sgd":
        opt = torch.optim.SGD(trainable, lr=0.1, momentum=momentum)
    else:
        opt = torch.optim.Adam(trainable, lr=0.1)
    first = next(model.parameters())
    x = torch.randn(2, model[0].in_features, dtype=first.dtype)
    model(x).float().pow(2).mean().backward()
    opt.step()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    out = {
        "params": sum(p.numel() * p.element_size() for p in model.parameters()),
        "grads": grads,
        "optimizer_state": counted_state_bytes(opt),
    }
    model.zero_grad(set_to_none=True)
    return out


def check_state_bytes(state_bytes: Callable[..., Any]) -> None:
    """``state_bytes(model, optimizer, momentum=0.0)`` -> dict with ``params``, ``grads`` and
    ``optimizer_state`` in bytes, for ``optimizer`` "sgd" or "adam". Compared with the bytes a
    real optimizer holds after one step."""
    name = "state_bytes"

    def mlp(dtype=torch.float32, freeze_first=False):
        torch.manual_seed(0)
        m = models.mlp(20, 2, in_features=10, out_features=3).to(dtype)  # Linear(10, 20), ReLU, Linear(20, 3)
        if freeze_first:
            m[0].requires_grad_(False)
        return m

    cases = [
        ("adam", 0.0, torch.float32, False, "Adam, float32"),
        ("sgd", 0.9, torch.float32, False, "SGD with momentum 0.9, float32"),
        ("sgd", 0.0, torch.float32, False, "plain SGD (momentum 0), float32"),
        ("adam", 0.0, torch.bfloat16, False, "Adam, a bfloat16 model"),
        ("adam", 0.0, torch.float32, True, "Adam, first layer frozen (requires_grad=False)"),
    ]
    for opt, mom, dtype, freeze, what in cases:
        got = _call(name, state_bytes, mlp(dtype, freeze), opt, mom)
        want = _counted(mlp(dtype, freeze), opt, mom)
        if not isinstance(got, dict) or not {"params", "grads", "optimizer_state"} <= set(got):
            _fail(
                name,
                f"returned {type(got).__name__} {got!r}",
                "return a dict with the keys 'params', 'grads' and 'optimizer_state' (numbers of bytes)",
            )
        for key in ("params", "grads", "optimizer_state"):
            g, w = got[key], want[key]
            if isinstance(g, torch.Tensor):
                g = g.item()
            if g == w:
                continue
            n_elems = w / (2 if dtype == torch.bfloat16 else 4)
            if w and g == n_elems:
                _fail(
                    name,
                    f"{what}: {key} is {g}, the number of elements; expected {w} bytes",
                    "multiply each tensor's numel() by its element_size() (4 bytes for float32)",
                )
            if dtype == torch.bfloat16 and w and g == 2 * w:
                _fail(
                    name,
                    f"{what}: {key} is {g}, twice the {w} bytes a bfloat16 model holds",
                    "don't assume 4 bytes per number: use p.element_size()",
                )
            if key == "optimizer_state" and opt == "adam" and g == w // 2:
                _fail(
                    name,
                    f"{what}: optimizer_state is {g}, expected {w}",
                    "Adam keeps TWO tensors per parameter: exp_avg and exp_avg_sq",
                )
            if key == "optimizer_state" and opt == "sgd" and mom == 0 and g > 0:
                _fail(
                    name,
                    f"{what}: optimizer_state is {g}, expected 0",
                    "plain SGD (momentum=0) keeps no state; only momentum creates a buffer per parameter",
                )
            if key == "optimizer_state" and opt == "sgd" and mom and g == 0:
                _fail(
                    name,
                    f"{what}: optimizer_state is 0, expected {w}",
                    "SGD with momentum keeps one momentum buffer the size of each parameter",
                )
            if freeze and key != "params":
                _fail(
                    name,
                    f"{what}: {key} is {g}, expected {w}",
                    "frozen parameters (requires_grad=False) get no gradient and no optimizer state; "
                    "count only parameters with p.requires_grad",
                )
            _fail(
                name,
                f"{what}: {key} is {g} bytes, expected {w}",
                "params: sum of p.numel() * p.element_size(); grads: the same for trainable parameters; "
                "optimizer state: 2x that for Adam, 1x for SGD with momentum, 0 without",
            )
    _passed(name, "params, grads and optimizer state match a real optimizer's, byte for byte")


# ----------------------------------------------------------------------------------------
# Exercise 2: timing a step
# ----------------------------------------------------------------------------------------


def check_time_step(time_step: Callable[..., Any]) -> None:
    """``time_step(step, sync, warmup, repeats)`` -> median seconds per ``step()``.

    Checked on a simulated asynchronous GPU: ``step()`` only queues its work (as a CUDA launch
    does) and ``sync()`` waits for it. The first calls are slow (warm-up), and one timed call
    is an outlier, as a real machine has."""
    from ..bench import SimulatedGPU

    name = "time_step"
    warmup, repeats = 3, 5
    normal, cold, outlier = 0.03, 0.15, 0.3
    calls = []
    with SimulatedGPU() as gpu:

        def step():
            i = len(calls)
            calls.append(i)
            gpu.launch(cold if i < warmup else outlier if i == warmup + 3 else normal)

        got = _call(name, time_step, step, gpu.synchronize, warmup, repeats)
        gpu.synchronize()
    if isinstance(got, torch.Tensor):
        got = got.item()
    if not isinstance(got, (int, float)):
        _fail(
            name,
            f"returned {type(got).__name__}, expected a number of seconds",
            "return the median of the per-repeat times, a float",
        )
    if len(calls) < warmup + repeats:
        _fail(
            name,
            f"called step() {len(calls)} times; expected warmup + repeats = {warmup + repeats}",
            "run `warmup` untimed calls first, then `repeats` timed ones",
        )
    total = (repeats - 1) * normal + outlier
    if abs(got - total) < 0.15 * total:
        _fail(
            name,
            f"returned {got * 1e3:.0f} ms: about the TOTAL of the {repeats} timed repeats",
            "keep one time per repeat in a list and return their median, not the sum",
        )
    if got > 5:
        _fail(
            name,
            f"returned {got:.1f}; the step takes about {normal * 1e3:.0f} ms",
            "return seconds (differences of perf_counter readings), not milliseconds",
        )
    if got < 0.25 * normal:
        _fail(
            name,
            f"measured {got * 1e3:.2f} ms per step, but each step's work takes {normal * 1e3:.0f} ms",
            "the step only QUEUES work, as on a GPU: call sync() before reading the clock at the end "
            "of each timed repeat (and before starting it)",
        )
    if abs(got - cold) < 0.25 * cold:
        _fail(
            name,
            f"measured {got * 1e3:.1f} ms: the cold first calls ({cold * 1e3:.0f} ms) got into the timing",
            "make `warmup` untimed calls (then sync) before the timed repeats",
        )
    if 2 * normal < got < 0.75 * cold:
        _fail(
            name,
            f"measured {got * 1e3:.1f} ms: one slow repeat ({outlier * 1e3:.0f} ms) pulled the result up",
            "report the MEDIAN of the repeats (statistics.median), not the mean or the total / repeats",
        )
    if not 0.7 * normal <= got <= 1.6 * normal:
        _fail(
            name,
            f"measured {got * 1e3:.1f} ms per step, expected about {normal * 1e3:.0f} ms",
            "time each repeat on its own, with sync() before starting the clock and before stopping it; "
            "then return the median of the repeats",
        )
    _passed(name, f"{got * 1e3:.1f} ms per step on a simulated GPU whose step takes {normal * 1e3:.0f} ms")


# ----------------------------------------------------------------------------------------
# Exercise 3: the input pipeline
# ----------------------------------------------------------------------------------------


class _SlowLoader:
    """Yields ``n`` batches, each after ``load_s`` seconds of 'decoding'."""

    def __init__(self, n, load_s):
        self.n, self.load_s, self.served = n, load_s, []

    def __len__(self):
        return self.n

    def __iter__(self):
        for i in range(self.n):
            time.sleep(self.load_s)
            batch = (torch.full((2, 1), float(i)), torch.tensor([i, i]))
            self.served.append(i)
            yield batch


def check_wait_fraction(wait_fraction: Callable[..., Any]) -> None:
    """``wait_fraction(loader, step)`` -> the fraction (0..1) of one pass's time spent waiting
    for the loader's next batch, calling ``step(batch)`` for every batch."""
    name = "wait_fraction"
    for load_s, step_s in ((0.03, 0.01), (0.01, 0.04)):
        want = load_s / (load_s + step_s)
        loader, stepped = _SlowLoader(5, load_s), []

        def step(batch, stepped=stepped, step_s=step_s):
            stepped.append(int(batch[1][0]))
            time.sleep(step_s)

        got = _call(name, wait_fraction, loader, step)
        if isinstance(got, torch.Tensor):
            got = got.item()
        if not isinstance(got, (int, float)):
            _fail(name, f"returned {type(got).__name__}, expected a float", "return wait_time / total_time")
        if stepped != list(range(5)):
            _fail(
                name,
                f"step() saw batches {stepped}, expected each of the 5 batches once, in order",
                "for batch in loader: ... step(batch)",
            )
        case = f"loading {load_s * 1e3:.0f} ms and stepping {step_s * 1e3:.0f} ms per batch"
        if got > 1.5:
            if abs(got - 100 * want) < 10:
                _fail(name, f"returned {got:.1f}: a percentage", "return a fraction between 0 and 1")
            _fail(
                name,
                f"returned {got:.2f} for {case}, more than 1",
                "divide the waiting time by the TOTAL time (waiting + stepping), not by the stepping time",
            )
        if abs(got - (1 - want)) < 0.08 and abs(got - want) > 0.08:
            _fail(
                name,
                f"returned {got:.2f} for {case}: that is the share spent in step()",
                "time only the wait for the next batch: next(iterator), not the step",
            )
        if abs(got - want) > 0.08:
            _fail(
                name,
                f"returned {got:.2f} for {case}, expected about {want:.2f}",
                "time only each request for the next batch (an explicit iterator over the loader), add those "
                "times up, and divide by the time of the whole pass",
            )
    _passed(name, "waiting share measured right on a data-bound and a compute-bound pipeline")
