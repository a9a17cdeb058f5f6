"""Where training memory goes on one device: predict each part, then measure the peak.

The budget of one training step is

    parameters + gradients + optimizer state + activations saved for backward (+ temporaries)

The first three are exact byte counts (``utils.bench``: :func:`~utils.bench.parameter_bytes`,
:func:`~utils.bench.grad_bytes`, :func:`~utils.bench.optimizer_state_bytes`: SGD 0x the
parameters, SGD with momentum 1x, Adam 2x). The activations of :func:`block_mlp` have a closed
form (:func:`mlp_activation_bytes`). Two measures check the prediction:

* :class:`SavedTensors`: the bytes autograd saves for backward, counted as they are saved
  (``torch.autograd.graph.saved_tensors_hooks``), each storage once, parameters excluded;
* :func:`peak_bytes`: the peak of allocated bytes while a function runs: on a GPU
  ``torch.cuda.max_memory_allocated``; on a CPU, which has no allocator statistics, the
  profiler's record of every allocation and free (``profile_memory=True``), replayed in time order.

The resident set size (RSS) of the process is not a measure: the C library keeps freed memory,
so RSS hides most of what checkpointing saves.

Activation checkpointing (:func:`checkpointed_forward`) keeps only the inputs of each segment
and recomputes the rest during backward: less memory for one more forward.
"""
from __future__ import annotations

import contextlib
import math
import os

import torch
from torch import nn

from .device import autocast
from .bench import (_amp, counted_state_bytes, format_bytes, grad_bytes,  # noqa: F401
                    optimizer_state_bytes, parameter_bytes)

__all__ = ["block_mlp", "mlp_activation_bytes", "SavedTensors", "saved_bytes", "peak_bytes",
           "budget", "measure_step", "checkpointed_forward", "count_forwards", "make_optimizer",
           "OPTIMIZERS", "format_bytes"]

OPTIMIZERS = ("sgd", "momentum", "adam")   # the three optimizer-state rules of the budget


def block_mlp(width: int, depth: int, *, expand: int = 4, seed: int = 0) -> nn.Sequential:
    """``depth`` blocks of Linear(width, expand*width) + GELU + Linear(expand*width, width): the
    MLP half of a transformer layer, the model of the memory demos.

    Its activations have a closed form (:func:`mlp_activation_bytes`); ``model[i]`` is block i,
    so checkpointing can cut it anywhere. Same ``seed``, same weights."""
    if width < 1 or depth < 1 or expand < 1:
        raise ValueError(f"width, depth and expand must be >= 1, got {width}, {depth}, {expand}")
    g = torch.Generator().manual_seed(seed)
    blocks = []
    for _ in range(depth):
        block = nn.Sequential(nn.Linear(width, expand * width), nn.GELU(), nn.Linear(expand * width, width))
        with torch.no_grad():
            for lin in (block[0], block[2]):
                bound = 1 / math.sqrt(lin.in_features)
                lin.weight.uniform_(-bound, bound, generator=g)
                lin.bias.uniform_(-bound, bound, generator=g)
        blocks.append(block)
    return nn.Sequential(*blocks)


def mlp_activation_bytes(width: int, depth: int, batch_size: int, *, expand: int = 4, amp_dtype=None,
                         segment: int | None = None) -> int:
    """Bytes :func:`block_mlp` saves for backward in one forward (loss ``out.pow(2).mean()``).

    fp32: per block, the first Linear saves its input (``batch x width``), GELU its input and the
    second Linear its input (``batch x expand*width`` each); the loss saves the output: in all
    ``(depth * (1 + 2*expand) + 1) * batch * width`` floats. Weights are parameters, not counted.

    bf16/fp16 autocast: the same activations in 2 bytes, plus a half-precision copy of each
    weight that backward needs to pass the gradient to the layer's input (every weight but the
    first layer's, whose input needs no gradient), and the fp32 copy the loss makes (``.float()``).

    ``segment``: checkpointing every ``segment`` blocks (fp32): what is kept is each segment's
    input and the output for the loss, ``ceil(depth / segment) + 1`` tensors of ``batch x width``;
    the rest is recomputed during backward, one segment at a time."""
    amp_dtype, _ = _amp(amp_dtype)
    act = batch_size * width
    if segment:
        if amp_dtype is not None:
            raise ValueError("the closed form with checkpointing is for fp32")
        return (math.ceil(depth / segment) + 1) * act * 4
    if amp_dtype is None:
        return (depth * (1 + 2 * expand) + 1) * act * 4
    return depth * (1 + 2 * expand) * act * 2 + (2 * depth - 1) * expand * width * width * 2 + act * 4


class SavedTensors:
    """Count the bytes autograd saves for backward inside a ``with`` block.

    Each storage is counted once (a ReLU's output that is also the next Linear's input is one
    tensor), parameters are left out (they are resident anyway). ``.bytes`` after the block.
    Inner hooks win: inside a non-reentrant ``torch.utils.checkpoint`` region the checkpoint's
    own hooks see the tensors, and this counter sees what the checkpoint keeps instead."""

    def __init__(self, model: nn.Module | None = None):
        self.exclude = ({p.untyped_storage().data_ptr() for p in model.parameters()}
                        if model is not None else set())
        self.sizes: dict[int, int] = {}
        self._ctx = None

    def _pack(self, t):
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr not in self.exclude and not isinstance(t, nn.Parameter):
            self.sizes[ptr] = max(self.sizes.get(ptr, 0), s.nbytes())
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        return False

    @property
    def bytes(self) -> int:
        return sum(self.sizes.values())


def saved_bytes(model: nn.Module, x: torch.Tensor, *, forward=None, amp_dtype=None) -> int:
    """Bytes saved for backward by one forward of ``model`` on ``x`` (``forward(model, x)``
    instead of ``model(x)`` when given, e.g. a checkpointed forward)."""
    amp_dtype, _ = _amp(amp_dtype)
    forward = forward or (lambda m, inp: m(inp))
    with SavedTensors(model) as counter, torch.enable_grad(), autocast(x.device, amp_dtype):
        out = forward(model, x)
    del out
    return counter.bytes


@contextlib.contextmanager
def _quiet_profiler():
    # Kineto (the profiler's engine) logs "profiler_start"/"profiler_stop" on stderr unless its
    # log level is raised; read when the profiler first starts.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    yield


def peak_bytes(fn, device=None) -> int:
    """Peak bytes allocated while ``fn()`` runs, above what was allocated before.

    CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``. CPU: the
    profiler records each allocation and free (``profile_memory=True``); replaying them in
    time order gives the running total, whose maximum is the peak. Everything ``fn`` allocates
    counts, the model and optimizer too if ``fn`` creates them."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.synchronize(device)                 # sync point: a clean baseline
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)                 # sync point: read the allocator's counters
        return torch.cuda.max_memory_allocated(device) - base
    if device.type != "cpu":
        raise ValueError(f"peak_bytes measures cuda and cpu devices, not {device.type!r}")
    from torch.profiler import ProfilerActivity, profile
    with _quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    current = peak = 0
    for _, nbytes in events:                           # + allocation, - free
        current += nbytes
        peak = max(peak, current)
    return peak


def make_optimizer(kind: str, params, lr: float = 1e-3) -> torch.optim.Optimizer:
    """"sgd" (no state), "momentum" (SGD, momentum 0.9: one buffer) or "adam" (two moments).
    foreach=False: one parameter at a time, so the step's temporaries stay one tensor wide."""
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, foreach=False)
    if kind == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=False)
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr, foreach=False)
    raise ValueError(f"unknown optimizer {kind!r}; use one of {', '.join(OPTIMIZERS)}")


def _state_name(kind: str) -> tuple[str, float]:
    return {"sgd": ("sgd", 0.0), "momentum": ("sgd", 0.9), "adam": ("adam", 0.0)}[kind]


def budget(width: int, depth: int, batch_size: int, optimizer: str = "adam", *, amp_dtype=None) -> dict:
    """Predicted bytes of one training step of ``block_mlp(width, depth)``, by part.

    ``peak`` is the step's high-water mark: during backward the activations are still held
    while the gradients appear, with the parameters and optimizer state resident, so
    ``params + grads + optimizer + activations`` (an upper bound: backward frees activations
    as it goes, and ``zero_grad`` frees the gradients before the next forward)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
    model = block_mlp(width, depth)
    name, momentum = _state_name(optimizer)
    out = {"params": parameter_bytes(model), "grads": grad_bytes(model),
           "optimizer": optimizer_state_bytes(model, name, momentum=momentum),
           "activations": mlp_activation_bytes(width, depth, batch_size, amp_dtype=amp_dtype)}
    out["peak"] = sum(out.values())
    return out


def measure_step(width: int, depth: int, batch_size: int, optimizer: str = "adam", *, amp_dtype=None,
                 device=None, steps: int = 2, forward=None) -> dict:
    """Measure :func:`budget`'s parts on ``device``: build the model and optimizer, run
    ``steps`` training steps, all inside :func:`peak_bytes`.

    Returns ``peak`` (bytes), ``saved`` (activations saved for backward in the last step),
    ``optimizer`` (bytes really held in ``optimizer.state``), and the ``loss`` of each step."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    amp, _ = _amp(amp_dtype)
    forward = forward or (lambda m, inp: m(inp))
    out = {"loss": []}

    def run():
        model = block_mlp(width, depth).to(device)
        opt = make_optimizer(optimizer, model.parameters())
        g = torch.Generator().manual_seed(1)
        x = torch.randn(batch_size, width, generator=g).to(device)
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            with SavedTensors(model) as counter, autocast(device, amp):
                loss = forward(model, x).float().pow(2).mean()
            loss.backward()
            opt.step()
            out["loss"].append(loss.item())          # sync point, outside the hot path
        out["saved"] = counter.bytes
        out["optimizer"] = counted_state_bytes(opt)
        del model, opt, x, loss

    out["peak"] = peak_bytes(run, device)
    return out


# ----------------------------------------------------------------------------------------
# Activation checkpointing
# ----------------------------------------------------------------------------------------

def checkpointed_forward(segment: int | None):
    """A ``forward(model, x)`` for a ``nn.Sequential`` that checkpoints every ``segment``
    consecutive blocks (``None`` or 0: no checkpointing).

    Each segment keeps only its input; its inner activations are recomputed during backward
    (non-reentrant ``torch.utils.checkpoint``). Small segments keep many inputs; large ones
    recompute many activations at once. About sqrt(depth) blocks per segment minimises the
    peak (Chen et al. 2016)."""
    from torch.utils.checkpoint import checkpoint

    if segment is not None and segment < 0:
        raise ValueError(f"segment must be None, 0 or a positive number of blocks, got {segment}")

    def forward(model: nn.Sequential, x):
        if not segment:
            return model(x)
        blocks = list(model)
        for i in range(0, len(blocks), segment):
            part = nn.Sequential(*blocks[i:i + segment])
            x = checkpoint(part, x, use_reentrant=False)
        return x

    return forward


class count_forwards:
    """Count how many times each block's forward runs (``with count_forwards(model) as c``):
    with checkpointing, every checkpointed block runs twice per step (forward, recompute)."""

    def __init__(self, model: nn.Sequential):
        self.model, self.calls, self._handles = model, [0] * len(model), []

    def __enter__(self):
        for i, block in enumerate(self.model):
            # a pre-hook: a recomputation may stop inside the block once it has what backward
            # needs (non-reentrant checkpoint's early stop), so the block's post-hook never fires
            self._handles.append(block.register_forward_pre_hook(self._hook(i)))
        return self

    def _hook(self, i):
        def hook(module, inputs):
            self.calls[i] += 1
        return hook

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        return False
