"""Where training memory goes on one device: predict each part, then measure the peak.

The budget of one training step is

    parameters + gradients + optimizer state + activations saved for backward (+ temporaries)

The first three are exact byte counts, for any model (:func:`parameter_bytes`, :func:`grad_bytes`,
:func:`optimizer_state_bytes`: SGD 0x the parameters, SGD with momentum 1x, Adam 2x; Adam and
AdamW 3x with amsgrad); :func:`activation_bytes` estimates the activations of any model, and
:func:`predict_memory` adds them up (:func:`measure_memory` measures the peak on a GPU). The
activations of :func:`block_mlp` have a closed form (:func:`mlp_activation_bytes`). Two
measures check the prediction:

* :class:`SavedTensors`: the bytes autograd saves for backward, counted as they are saved
  (``torch.autograd.graph.saved_tensors_hooks``), each storage once, parameters excluded;
* :func:`peak_bytes`: the peak of allocated bytes while a function runs: on a GPU
  ``torch.cuda.max_memory_allocated``; on a CPU, which has no allocator statistics, the
  profiler's record of every allocation and free (``profile_memory=True``), replayed in time order.

The resident set size (RSS) of the process is not a measure: the C library keeps freed memory,
so RSS hides most of what activation checkpointing saves.

Activation checkpointing (:func:`activation_checkpointed_forward`) keeps only the inputs of each
segment and recomputes the rest during backward: less memory for one more forward.

The GPT (``utils.gpt``) has its budget in closed form, term by term (:func:`gpt_memory`,
:func:`gpt_activation_bytes`), for both attention kernels a CPU runs.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from .device import autocast, bf16_supported, resolve_amp_dtype
from .gpt import GPTConfig, parameter_count
from .models import mlp
from .optim import make_optimizer

__all__ = [
    "parameter_bytes",
    "buffer_bytes",
    "grad_bytes",
    "optimizer_state_bytes",
    "counted_state_bytes",
    "activation_bytes",
    "MemoryPrediction",
    "predict_memory",
    "measure_memory",
    "format_bytes",
    "block_mlp",
    "mlp_activation_bytes",
    "SavedTensors",
    "saved_bytes",
    "peak_bytes",
    "budget",
    "measure_step",
    "activation_checkpointed_forward",
    "count_forwards",
    "gpt_activation_bytes",
    "gpt_memory",
    "OPTIMIZER_SETTINGS",
]

# The three optimizer settings of the budget: label -> (name for utils.optim.make_optimizer, momentum).
# "sgd" keeps no state, "momentum" one buffer per parameter, "adam" two.
OPTIMIZER_SETTINGS = {"sgd": ("sgd", 0.0), "momentum": ("sgd", 0.9), "adam": ("adam", 0.0)}


# ----------------------------------------------------------------------------------------
# Bytes of any model: parameters, buffers, gradients, optimizer state, activations
# ----------------------------------------------------------------------------------------


def _unique(tensors):
    seen, out = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of all parameters (shared ones once)."""
    return sum(_nbytes(p) for p in _unique(model.parameters()))


def buffer_bytes(model: nn.Module) -> int:
    """Bytes of the buffers (batch-norm running statistics and the like)."""
    return sum(_nbytes(b) for b in _unique(model.buffers()))


def grad_bytes(model: nn.Module) -> int:
    """Bytes of the gradients backward will create: one per trainable parameter, same dtype."""
    return sum(_nbytes(p) for p in _unique(model.parameters()) if p.requires_grad)


def _state_multiplier(kind: str, group: dict) -> int:
    """Per-element state tensors (each the size of its parameter) an optimizer keeps."""
    if kind == "sgd":
        return 1 if group.get("momentum", 0) else 0
    if kind in ("adam", "adamw"):
        return 3 if group.get("amsgrad", False) else 2
    if kind == "rmsprop":
        return 1 + (1 if group.get("momentum", 0) else 0) + (1 if group.get("centered", False) else 0)
    if kind == "adagrad":
        return 1
    raise ValueError(f"no state rule for optimizer {kind!r}; known: sgd, adam, adamw, rmsprop, adagrad")


def optimizer_state_bytes(
    model_or_params: nn.Module | Iterable[torch.Tensor],
    optimizer: str | torch.optim.Optimizer = "adam",
    *,
    momentum: float = 0.0,
    amsgrad: bool = False,
) -> int:
    """Bytes of the optimizer's per-element state after its first step, exactly.

    ``optimizer``: a ``torch.optim`` instance (its param groups decide), or a name ("sgd",
    "adam", "adamw", "rmsprop", "adagrad") with ``momentum``/``amsgrad`` for the model's
    trainable parameters. SGD keeps a momentum buffer only when momentum != 0; Adam keeps
    exp_avg and exp_avg_sq (2x the parameters). Not counted: Adam's per-parameter ``step``
    counters, 0-dimensional tensors that live on the CPU unless ``capturable``/``fused``.
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        kind = type(optimizer).__name__.lower()
        total = 0
        for g in optimizer.param_groups:
            mult = _state_multiplier(kind, g)
            total += mult * sum(_nbytes(p) for p in g["params"] if p.requires_grad)
        return total
    if not isinstance(optimizer, str):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or a name, got {type(optimizer).__name__}")
    params = model_or_params.parameters() if isinstance(model_or_params, nn.Module) else model_or_params
    group = {"momentum": momentum, "amsgrad": amsgrad}
    mult = _state_multiplier(optimizer.lower(), group)
    return mult * sum(_nbytes(p) for p in _unique(params) if p.requires_grad)


def counted_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The oracle: bytes of the per-element tensors really held in ``optimizer.state`` (call it
    after a step; 0-dimensional counters such as Adam's ``step`` are left out)."""
    total = 0
    for st in optimizer.state.values():
        for v in st.values():
            if torch.is_tensor(v) and v.dim() > 0:
                total += _nbytes(v)
    return total


def _saved_bytes(model: nn.Module, batch_size: int, input_shape, amp_dtype, num_classes: int) -> int:
    """Bytes of the distinct non-parameter tensors autograd saves for backward in one forward."""
    device = next(model.parameters()).device
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr not in param_ptrs:
            seen[ptr] = max(seen.get(ptr, 0), s.nbytes())
        return t

    x = torch.randn(batch_size, *input_shape, device=device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.enable_grad():
        with autocast(device, amp_dtype):
            out = model(x)
            y = torch.zeros(batch_size, dtype=torch.long, device=device)
            nn.functional.cross_entropy(out.float(), y)
    return sum(seen.values())


def activation_bytes(
    model: nn.Module,
    batch_size: int,
    input_shape: tuple[int, ...] = (3, 32, 32),
    *,
    amp_dtype: torch.dtype | str | None = None,
    num_classes: int = 10,
) -> int:
    """Estimate of the activations saved for backward at ``batch_size``.

    Runs two tiny forward passes (batch 2 and 4) on the model's device, counts the tensors
    autograd saves (parameters excluded), and extrapolates the straight line fixed + per-image x
    batch. The model's buffers (batch-norm statistics) are restored afterwards. An estimate: the
    peak during backward adds temporary gradient buffers and library workspaces."""
    amp_dtype, _ = resolve_amp_dtype(amp_dtype)
    buffers = {k: b.detach().clone() for k, b in model.named_buffers()}
    try:
        b1, b2 = 2, 4
        s1 = _saved_bytes(model, b1, input_shape, amp_dtype, num_classes)
        s2 = _saved_bytes(model, b2, input_shape, amp_dtype, num_classes)
    finally:
        with torch.no_grad():
            for k, b in model.named_buffers():
                b.copy_(buffers[k])
    per_image = (s2 - s1) / (b2 - b1)
    fixed = s1 - per_image * b1
    return int(round(max(fixed, 0) + per_image * batch_size))


@dataclass
class MemoryPrediction:
    """Bytes training keeps on the device, by kind."""

    batch_size: int
    params: int
    buffers: int
    grads: int
    optimizer_state: int
    activations: int  # an estimate; the rest are exact

    @property
    def total(self) -> int:
        return self.params + self.buffers + self.grads + self.optimizer_state + self.activations

    def as_dict(self) -> dict:
        d = asdict(self)
        d["total"] = self.total
        return d

    def table(self) -> str:
        rows = [
            ("parameters", self.params),
            ("buffers", self.buffers),
            ("gradients", self.grads),
            ("optimizer state", self.optimizer_state),
            (f"activations (batch {self.batch_size}, estimate)", self.activations),
            ("total", self.total),
        ]
        w = max(len(r[0]) for r in rows)
        return "\n".join(f"{k:<{w}}  {format_bytes(v):>12}" for k, v in rows)


def predict_memory(
    model: nn.Module,
    batch_size: int,
    input_shape: tuple[int, ...] = (3, 32, 32),
    *,
    optimizer: str | torch.optim.Optimizer = "adam",
    momentum: float = 0.0,
    amp_dtype: torch.dtype | str | None = None,
    num_classes: int = 10,
) -> MemoryPrediction:
    """What training ``model`` at ``batch_size`` keeps in device memory (see :class:`MemoryPrediction`)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return MemoryPrediction(
        batch_size=batch_size,
        params=parameter_bytes(model),
        buffers=buffer_bytes(model),
        grads=grad_bytes(model),
        optimizer_state=optimizer_state_bytes(model, optimizer, momentum=momentum),
        activations=activation_bytes(model, batch_size, input_shape, amp_dtype=amp_dtype, num_classes=num_classes),
    )


def measure_memory(
    model: nn.Module,
    batch_size: int,
    input_shape: tuple[int, ...] = (3, 32, 32),
    *,
    device: torch.device | str | None = None,
    optimizer: str | Callable[..., torch.optim.Optimizer] = "adam",
    momentum: float = 0.0,
    amp_dtype: torch.dtype | str | None = None,
    num_classes: int = 10,
) -> dict | None:
    """Measured bytes of two training steps of a copy of ``model`` on a CUDA ``device``:
    ``peak`` (``torch.cuda.max_memory_allocated`` over the steps) and ``resident`` (allocated
    after the second step, gradients still held), both above what was allocated before.
    Returns None on a device that is not CUDA: there is no allocator to ask."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cuda":
        return None
    amp_dtype, _ = resolve_amp_dtype(amp_dtype)
    net = copy.deepcopy(model).cpu()
    torch.cuda.synchronize(device)  # sync point: a clean baseline
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    net.to(device).train()
    opt = make_optimizer(optimizer, net.parameters(), momentum=momentum)
    x = torch.randn(batch_size, *input_shape, device=device)
    y = torch.randint(0, num_classes, (batch_size,), device=device)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        with autocast(device, amp_dtype):
            loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
    torch.cuda.synchronize(device)  # sync point: read the allocator's counters
    out = {
        "peak": torch.cuda.max_memory_allocated(device) - base,
        "resident": torch.cuda.memory_allocated(device) - base,
        "inputs": _nbytes(x) + _nbytes(y),
    }
    del net, opt, x, y, loss
    torch.cuda.empty_cache()
    return out


def format_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


# ----------------------------------------------------------------------------------------
# The block MLP of the memory demos: its budget in closed form, measured
# ----------------------------------------------------------------------------------------


def block_mlp(width: int, depth: int, *, expand: int = 4, seed: int = 0) -> nn.Sequential:
    """The model of the memory demos: ``depth`` blocks of Linear(width, expand*width) + GELU +
    Linear(expand*width, width), :func:`utils.models.mlp` with ``expand`` (``model[i]`` is block
    i, so activation checkpointing can cut it anywhere; same ``seed``, same weights). Its
    activations have a closed form (:func:`mlp_activation_bytes`)."""
    return mlp(width, depth, expand=expand, activation="gelu", seed=seed)


def mlp_activation_bytes(
    width: int,
    depth: int,
    batch_size: int,
    *,
    expand: int = 4,
    amp_dtype: torch.dtype | str | None = None,
    segment: int | None = None,
) -> int:
    """Bytes :func:`block_mlp` saves for backward in one forward (loss ``out.pow(2).mean()``).

    fp32: per block, the first Linear saves its input (``batch x width``), GELU its input and the
    second Linear its input (``batch x expand*width`` each); the loss saves the output: in all
    ``(depth * (1 + 2*expand) + 1) * batch * width`` floats. Weights are parameters, not counted.

    bf16/fp16 autocast: the same activations in 2 bytes, plus a half-precision copy of each
    weight that backward needs to pass the gradient to the layer's input (every weight but the
    first layer's, whose input needs no gradient), and the fp32 copy the loss makes (``.float()``).

    ``segment``: activation checkpointing every ``segment`` blocks (fp32): what is kept is each segment's
    input and the output for the loss, ``ceil(depth / segment) + 1`` tensors of ``batch x width``;
    the rest is recomputed during backward, one segment at a time."""
    amp_dtype, _ = resolve_amp_dtype(amp_dtype)
    act = batch_size * width
    if segment:
        if amp_dtype is not None:
            raise ValueError("the closed form with activation checkpointing is for fp32")
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
        self.exclude = {p.untyped_storage().data_ptr() for p in model.parameters()} if model is not None else set()
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


def saved_bytes(
    model: nn.Module,
    x: torch.Tensor,
    *,
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
    amp_dtype: torch.dtype | str | None = None,
) -> int:
    """Bytes saved for backward by one forward of ``model`` on ``x`` (``forward(model, x)``
    instead of ``model(x)`` when given, e.g. :func:`activation_checkpointed_forward`)."""
    amp_dtype, _ = resolve_amp_dtype(amp_dtype)
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


def _cublas_warm_up(device: torch.device) -> None:
    """Make cuBLAS take its workspaces before a measurement. cuBLAS keeps one per thread and
    stream (32 MiB each on Hopper), taken from PyTorch's caching allocator on first use and kept:
    the forward's on this thread, the backward's on autograd's device thread. Taken inside a
    measurement, they would be counted as the model's memory (64 MiB against a 6.6 MB step)."""
    dtypes = [torch.float32] + ([torch.bfloat16] if bf16_supported(device) else [])
    for dtype in dtypes:
        a = torch.ones(16, 16, device=device, dtype=dtype, requires_grad=True)
        (a @ a).sum().backward()


def peak_bytes(fn: Callable[[], Any], device: torch.device | str | None = None) -> int:
    """Peak bytes allocated while ``fn()`` runs, above what was allocated before.

    CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``. CPU: the
    profiler records each allocation and free (``profile_memory=True``); replaying them in
    time order gives the running total, whose maximum is the peak. Everything ``fn`` allocates
    counts, the model and optimizer too if ``fn`` creates them."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        _cublas_warm_up(device)
        torch.cuda.synchronize(device)  # sync point: a clean baseline
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)  # sync point: read the allocator's counters
        return torch.cuda.max_memory_allocated(device) - base
    if device.type != "cpu":
        raise ValueError(f"peak_bytes measures cuda and cpu devices, not {device.type!r}")
    from torch.profiler import ProfilerActivity, profile

    with _quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    current = peak = 0
    for _, nbytes in events:  # + allocation, - free
        current += nbytes
        peak = max(peak, current)
    return peak


def held_bytes(fn: Callable[[], Any], device: torch.device | str | None = None) -> tuple[int, Any]:
    """Bytes that ``fn()`` allocates and still holds when it returns, and what it returned.

    For a forward pass: what autograd keeps for backward plus the outputs, whoever keeps it
    (saved-tensor hooks see only what autograd saves, not a checkpoint's own cache). CUDA: the
    allocator's ``memory_allocated`` after minus before. CPU: the profiler's allocations minus
    its frees (``profile_memory=True``)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        _cublas_warm_up(device)
        torch.cuda.synchronize(device)  # sync point: a clean baseline
        base = torch.cuda.memory_allocated(device)
        out = fn()
        torch.cuda.synchronize(device)  # sync point: read the allocator's counter
        return torch.cuda.memory_allocated(device) - base, out
    if device.type != "cpu":
        raise ValueError(f"held_bytes measures cuda and cpu devices, not {device.type!r}")
    from torch.profiler import ProfilerActivity, profile

    with _quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    held = sum(
        e.nbytes()  # + allocation, - free
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    return held, out


def _optimizer_setting(label: str) -> tuple[str, float]:
    if label not in OPTIMIZER_SETTINGS:
        raise ValueError(f"unknown optimizer {label!r}; use one of {', '.join(OPTIMIZER_SETTINGS)}")
    return OPTIMIZER_SETTINGS[label]


def budget(
    width: int, depth: int, batch_size: int, optimizer: str = "adam", *, amp_dtype: torch.dtype | str | None = None
) -> dict[str, int]:
    """Predicted bytes of one training step of ``block_mlp(width, depth)``, by part.

    ``peak`` is the step's high-water mark: during backward the activations are still held
    while the gradients appear, with the parameters and optimizer state resident, so
    ``params + grads + optimizer + activations`` (an upper bound: backward frees activations
    as it goes, and ``zero_grad`` frees the gradients before the next forward)."""
    name, momentum = _optimizer_setting(optimizer)
    model = block_mlp(width, depth)
    out = {
        "params": parameter_bytes(model),
        "grads": grad_bytes(model),
        "optimizer": optimizer_state_bytes(model, name, momentum=momentum),
        "activations": mlp_activation_bytes(width, depth, batch_size, amp_dtype=amp_dtype),
    }
    out["peak"] = sum(out.values())
    return out


def measure_step(
    width: int,
    depth: int,
    batch_size: int,
    optimizer: str = "adam",
    *,
    amp_dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    steps: int = 2,
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Measure :func:`budget`'s parts on ``device``: build the model and optimizer, run
    ``steps`` training steps, all inside :func:`peak_bytes`.

    Returns ``peak`` (bytes), ``saved`` (activations saved for backward in the last step),
    ``optimizer`` (bytes really held in ``optimizer.state``), and the ``loss`` of each step."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    amp, _ = resolve_amp_dtype(amp_dtype)
    name, momentum = _optimizer_setting(optimizer)
    forward = forward or (lambda m, inp: m(inp))
    out = {"loss": []}

    def run():
        model = block_mlp(width, depth).to(device)
        opt = make_optimizer(name, model.parameters(), momentum=momentum, foreach=False)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(batch_size, width, generator=g).to(device)
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            with SavedTensors(model) as counter, autocast(device, amp):
                loss = forward(model, x).float().pow(2).mean()
            loss.backward()
            opt.step()
            out["loss"].append(loss.item())  # sync point, outside the hot path
        out["saved"] = counter.bytes
        out["optimizer"] = counted_state_bytes(opt)
        del model, opt, x, loss

    out["peak"] = peak_bytes(run, device)
    return out


# ----------------------------------------------------------------------------------------
# Activation checkpointing
# ----------------------------------------------------------------------------------------


def activation_checkpointed_forward(segment: int | None) -> Callable[[nn.Sequential, torch.Tensor], torch.Tensor]:
    """A ``forward(model, x)`` for a ``nn.Sequential`` that checkpoints every ``segment``
    consecutive blocks (``None`` or 0: no activation checkpointing).

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
            part = nn.Sequential(*blocks[i : i + segment])
            x = checkpoint(part, x, use_reentrant=False)
        return x

    return forward


class count_forwards:
    """Count how many times each block's forward runs (``with count_forwards(model) as c``):
    with activation checkpointing, every checkpointed block runs twice per step (forward, recompute)."""

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


# ----------------------------------------------------------------------------------------
# The GPT: its training step in closed form
# ----------------------------------------------------------------------------------------

GPT_ATTENTION = ("math", "flash")


def gpt_activation_bytes(
    cfg: GPTConfig, batch: int, seq_len: int | None = None, *, attention: str = "math", loss: bool = True
) -> int:
    """Bytes autograd saves for backward in one fp32 forward of ``utils.gpt.GPT(cfg)`` on ``batch``
    sequences of ``seq_len`` tokens (default the context), each saved storage once, parameters
    left out: exactly what :class:`SavedTensors` counts, with ``dropout = 0``.

    With N = batch x seq_len tokens, d = width, H heads, T = seq_len, in floats (4 bytes):

    * every block, 16 N d + 4 N: each LayerNorm its input (N d) and the mean and 1/std of every
      token (2 N); the QKV Linear its input (N d); the attention output projection its input
      (N d); the MLP's first Linear its input (N d), GELU its input (4 N d), the second Linear
      its input (the GELU's output, 4 N d); and 3 N d of attention inputs, by kernel below;
    * ``attention="math"`` (PyTorch's math path, ``SDPBackend.MATH``): copies of the scaled
      queries and keys and of the values (3 N d) and the softmax's T x T probabilities for every
      sequence and head (batch x H x T^2 per block): the term that grows with T^2;
    * ``attention="flash"`` (the CPU's default fused kernel): the QKV output itself (3 N d, q, k
      and v are views of it), the attention output (shared with the projection's input, so
      counted once, there), and the log-sum-exp of each row, batch x H x T per block, in place
      of the T x T matrix: backward recomputes the probabilities from it;
    * after the blocks: the final LayerNorm (N d + 2 N), the output projection's input (N d);
      with ``loss``: the log-probabilities (N x vocab), the targets (N int64) and the loss's
      total weight (one float);
    * the token ids (N int64) and the positions (T int64), which the embeddings' backward reads.

    CUDA's flash and memory-efficient kernels, like ``"flash"``, keep a log-sum-exp per row and
    no T x T matrix; their exact bytes (random-number state, the memory-efficient kernel's padding
    of the log-sum-exp) are not checked here, where no GPU runs. Under bf16 autocast the
    activations are 2 bytes and half-precision copies of the weights are saved too: this closed
    form is for fp32.

    The token ids and targets count as their own tensors; a view into a larger tensor would be
    counted as all of that tensor (the saved storage)."""
    if attention not in GPT_ATTENTION:
        raise ValueError(f"attention must be one of {', '.join(GPT_ATTENTION)}, got {attention!r}")
    if cfg.dropout:
        raise ValueError(f"the closed form is for dropout 0 (dropout saves masks), got {cfg.dropout}")
    t = cfg.context if seq_len is None else seq_len
    if not 1 <= t <= cfg.context:
        raise ValueError(f"seq_len must be in [1, context={cfg.context}], got {t}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    n, d = batch * t, cfg.width
    scores = batch * cfg.heads * (t * t if attention == "math" else t)
    floats = cfg.layers * (16 * n * d + 4 * n + scores) + 2 * n * d + 2 * n
    if loss:
        floats += n * cfg.vocab_size + 1
    int64s = n + t + (n if loss else 0)
    return 4 * floats + 8 * int64s


def gpt_memory(
    cfg: GPTConfig, batch: int, seq_len: int | None = None, *, optimizer: str = "adam", attention: str = "math"
) -> dict[str, int]:
    """Predicted bytes of one fp32 training step of ``utils.gpt.GPT(cfg)``, by part:
    ``params`` (4 bytes x :func:`utils.gpt.parameter_count`, the tied output projection once),
    ``grads`` (the same), ``optimizer`` (``"sgd"`` 0x, ``"momentum"`` 1x, ``"adam"`` 2x the
    parameters), ``activations`` (:func:`gpt_activation_bytes`), and ``peak``, their sum: during
    backward the activations are still held while the gradients appear (an upper bound, as in
    :func:`budget`; the temporaries of backward and the logits' gradient come on top)."""
    name, momentum = _optimizer_setting(optimizer)
    params = 4 * parameter_count(cfg)
    mult = _state_multiplier(name, {"momentum": momentum})
    out = {
        "params": params,
        "grads": params,
        "optimizer": mult * params,
        "activations": gpt_activation_bytes(cfg, batch, seq_len, attention=attention),
    }
    out["peak"] = sum(out.values())
    return out
