"""Time and throughput, measured right, once for everyone.

Timing (:func:`time_fn`): untimed warm-up calls first (allocator, cuDNN autotuning, compilation
happen there), then ``repeats`` timed repeats of ``number`` calls each. On a CUDA device the
repeats are timed with CUDA events recorded on the stream; elsewhere with ``time.perf_counter``
read only after the device has been synchronised. We report the median of the repeats and
their spread (the interquartile range), never a single run and never the mean (one slow
repeat, a garbage collection or another process, would drag it).

Throughput (:func:`train_throughput`, :func:`inference_throughput`): images/s of one model on
one fixed, device-resident batch of random images, for a given batch size, device, dtype
(bf16 autocast), memory format (channels_last) and, optionally, ``torch.compile``. This times
the step alone, with no input pipeline; the whole loop with data is ``utils.train.fit``'s
``History.images_per_s``, and :class:`TimedLoader` measures how long ``fit`` waits for data.

Memory (bytes of parameters, gradients, optimizer state and activations, predicted and
measured) is :mod:`utils.memory`.

:class:`SimulatedGPU` is a stand-in for an asynchronous accelerator (work queued to a thread)
that shows on any machine why a host timer without synchronisation lies.
"""

from __future__ import annotations

import copy
import math
import queue
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from .data import EpochLoader
from .device import autocast, resolve_amp_dtype, synchronize
from .optim import make_optimizer

__all__ = [
    "Timing",
    "time_fn",
    "Throughput",
    "train_throughput",
    "inference_throughput",
    "measure_throughput",
    "TimedLoader",
    "SlowDataset",
    "SimulatedGPU",
    "format_table",
    "count_syncs",
    "amp_step_costs",
    "quartiles",
    "matmul_flops_per_s",
]


# ----------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------


def quartiles(xs: Iterable[float]) -> tuple[float, float, float]:
    """(q25, median, q75) of ``xs``, linear interpolation (one value gives itself three times): the
    one summary of repeated measurements in the package and in benchmarks/."""
    xs = sorted(float(x) for x in xs)
    if not xs:
        raise ValueError("no values to summarise")
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q25, q50, q75 = statistics.quantiles(xs, n=4, method="inclusive")
    return q25, q50, q75


@dataclass
class Timing:
    """Seconds per call, one entry per timed repeat, and how they were taken."""

    seconds: list
    warmup: int
    number: int
    method: str  # "cuda events" or "perf_counter"
    warmup_seconds: list = field(default_factory=list)  # each warm-up call, for showing its cost

    @property
    def median(self) -> float:
        return quartiles(self.seconds)[1]

    @property
    def iqr(self) -> float:
        q25, _, q75 = quartiles(self.seconds)
        return q75 - q25

    @property
    def mean(self) -> float:
        return statistics.fmean(self.seconds)

    @property
    def min(self) -> float:
        return min(self.seconds)

    @property
    def max(self) -> float:
        return max(self.seconds)

    def __repr__(self):
        return (
            f"Timing(median {self.median * 1e3:.3f} ms, IQR {self.iqr * 1e3:.3f} ms, "
            f"{len(self.seconds)} repeats x {self.number} calls, {self.method})"
        )


def time_fn(
    fn: Callable[[], Any],
    *,
    warmup: int = 3,
    repeats: int = 10,
    number: int = 1,
    device: torch.device | str | None = None,
    sync: Callable[[], Any] | None = None,
) -> Timing:
    """Time ``fn()`` (no arguments): seconds per call, per repeat, as a :class:`Timing`.

    device: where ``fn`` queues its work. On ``cuda`` (``cuda:N``) the repeats are timed with
        CUDA events of that device, on its current stream; otherwise with ``perf_counter``
        between two synchronisations.
    sync: a callable that waits for all queued work (default: ``utils.device.synchronize(device)``,
        a no-op on the CPU). Pass your own for other asynchronous back-ends.
    """
    if warmup < 0 or repeats < 1 or number < 1:
        raise ValueError(f"need warmup >= 0, repeats >= 1 and number >= 1; got {warmup}, {repeats}, {number}")
    if not callable(fn):
        raise TypeError(f"time_fn needs a callable with no arguments, got {type(fn).__name__}")
    device = torch.device(device) if device is not None else None
    use_events = sync is None and device is not None and device.type == "cuda"
    if sync is None:

        def sync():
            synchronize(device) if device is not None else None

    warm = []
    for _ in range(warmup):
        sync()  # sync point: the warm-up call's own time
        t0 = time.perf_counter()
        fn()
        sync()  # sync point
        warm.append(time.perf_counter() - t0)
    sync()  # sync point: nothing left queued before timing

    seconds = []
    if use_events:
        # The events belong to the measured device and are recorded on ITS current stream: on
        # cuda:1, events of the current device (often cuda:0) would time cuda:0's idle stream.
        with torch.cuda.device(device):
            stream = torch.cuda.current_stream(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(repeats):
                start.record(stream)
                for _ in range(number):
                    fn()
                end.record(stream)
                end.synchronize()  # sync point: wait for this repeat's work
                seconds.append(start.elapsed_time(end) / 1e3 / number)  # elapsed_time is in ms
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(number):
                fn()
            sync()  # sync point: the work, not just its launch
            seconds.append((time.perf_counter() - t0) / number)
    return Timing(seconds, warmup, number, "cuda events" if use_events else "perf_counter", warm)


# ----------------------------------------------------------------------------------------
# Throughput
# ----------------------------------------------------------------------------------------


@dataclass
class Throughput:
    """Images/s of one configuration: one entry per timed repeat, with what was measured."""

    mode: str  # "train" (forward, backward, optimizer step) or "inference"
    model: str
    device: str
    batch_size: int
    dtype: str  # fp32, or the autocast dtype
    channels_last: bool
    compiled: bool
    steps: int  # steps per timed repeat
    images_per_s: list  # one per repeat
    step_s: float  # median seconds per step
    first_step_s: float  # the first (cold) step: allocation, autotuning, compilation
    method: str

    @property
    def median(self) -> float:
        return quartiles(self.images_per_s)[1]

    @property
    def iqr(self) -> float:
        q25, _, q75 = quartiles(self.images_per_s)
        return q75 - q25

    def row(self) -> dict:
        d = asdict(self)
        d.update(images_per_s_median=self.median, images_per_s_iqr=self.iqr)
        return d

    def __repr__(self):
        return (
            f"Throughput({self.mode} {self.model} on {self.device}, batch {self.batch_size}, {self.dtype}"
            f"{', channels_last' if self.channels_last else ''}{', compiled' if self.compiled else ''}: "
            f"{self.median:,.0f} images/s, IQR {self.iqr:,.0f})"
        )


def measure_throughput(
    model: nn.Module,
    batch_size: int,
    *,
    mode: str = "train",
    device: torch.device | str | None = None,
    input_shape: tuple[int, ...] = (3, 32, 32),
    num_classes: int = 10,
    amp_dtype: torch.dtype | str | None = None,
    channels_last: bool = False,
    compile: bool = False,
    optimizer: str | Callable[..., torch.optim.Optimizer] = "sgd",
    momentum: float = 0.9,
    warmup: int = 3,
    repeats: int = 10,
    steps: int | None = None,
    min_repeat_s: float = 0.1,
    max_steps: int = 50,
    name: str | None = None,
) -> Throughput:
    """Images/s of ``model`` (a copy: yours is not moved or changed) on one random batch.

    mode: "train" (forward, loss, backward, optimizer step) or "inference" (forward, no grad).
    steps: steps per timed repeat; None chooses enough for about ``min_repeat_s`` seconds
        (at most ``max_steps``), from the time of one warm step.
    optimizer, momentum: a name for :func:`utils.optim.make_optimizer` ("sgd", "adam", "adamw")
        or a function params -> optimizer; ``momentum`` is SGD's (0.9 by default here; the
        lecture does not say which optimizer its throughput demo used).
    """
    if mode not in ("train", "inference"):
        raise ValueError(f"mode must be 'train' or 'inference', got {mode!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    amp_dtype, dtype_name = resolve_amp_dtype(amp_dtype)
    name = name or type(model).__name__
    net = copy.deepcopy(model).to(device)
    if channels_last:
        net = net.to(memory_format=torch.channels_last)
    x = torch.randn(batch_size, *input_shape, device=device)
    if channels_last and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, num_classes, (batch_size,), device=device)
    run = torch.compile(net) if compile else net
    loss_fn = nn.CrossEntropyLoss()

    if mode == "train":
        net.train()
        opt = make_optimizer(optimizer, net.parameters(), momentum=momentum if optimizer == "sgd" else 0.0)

        def step():
            with autocast(device, amp_dtype):
                loss = loss_fn(run(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        net.eval()

        def step():
            with torch.no_grad(), autocast(device, amp_dtype):
                run(x)

    first = time_fn(step, warmup=0, repeats=1, device=device)  # the cold step, timed on its own
    if steps is None:
        one = time_fn(step, warmup=max(warmup - 1, 0), repeats=1, device=device).median
        steps = max(1, min(max_steps, math.ceil(min_repeat_s / max(one, 1e-6))))
        warmup = 0  # the warm-up calls just happened
    else:
        warmup = max(warmup - 1, 0)
    t = time_fn(step, warmup=warmup, repeats=repeats, number=steps, device=device)
    return Throughput(
        mode,
        name,
        str(device),
        batch_size,
        dtype_name,
        channels_last,
        compile,
        steps,
        [batch_size / s for s in t.seconds],
        t.median,
        first.seconds[0],
        t.method,
    )


def train_throughput(model: nn.Module, batch_size: int, **kw: Any) -> Throughput:
    """Training images/s (forward, backward, optimizer step); see :func:`measure_throughput`."""
    return measure_throughput(model, batch_size, mode="train", **kw)


def inference_throughput(model: nn.Module, batch_size: int, **kw: Any) -> Throughput:
    """Inference images/s (forward under no_grad); see :func:`measure_throughput`."""
    return measure_throughput(model, batch_size, mode="inference", **kw)


# ----------------------------------------------------------------------------------------
# Input pipeline
# ----------------------------------------------------------------------------------------


class TimedLoader(EpochLoader):
    """Wraps a loader and adds up the host time spent waiting for each batch (``wait_s``).

    Give it to ``fit`` instead of the loader; ``wait_s / history.train_time`` is the fraction of
    the step time spent waiting for data. ``len`` and ``set_epoch`` pass through. (On a GPU
    the host can run ahead of the device, so this is the host's wait: a GPU kept busy by queued
    work is not idle while the host waits.)"""

    def __init__(self, loader: Iterable):
        self.loader = loader
        self.wait_s = 0.0
        self.batches = 0
        self.waits = []  # seconds waited for each batch (a median ignores a hiccup)

    def reset(self) -> None:
        self.wait_s, self.batches, self.waits = 0.0, 0, []

    def __iter__(self):
        it = iter(self.loader)
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                self.wait_s += time.perf_counter() - t0
                return
            self.waits.append(time.perf_counter() - t0)
            self.wait_s += self.waits[-1]
            self.batches += 1
            yield batch


class SlowDataset(torch.utils.data.Dataset):
    """A dataset whose ``__getitem__`` costs ``cost_s`` seconds of host work per item, like
    decoding and augmenting a JPEG: the slow input pipeline of the exercises. Importable, so
    DataLoader workers can use it under any start method."""

    def __init__(self, dataset: torch.utils.data.Dataset, cost_s: float = 1e-4):
        self.dataset, self.cost_s = dataset, cost_s

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        t_end = time.perf_counter() + self.cost_s
        while time.perf_counter() < t_end:  # busy work, as a decoder would do
            pass
        return self.dataset[i]


# ----------------------------------------------------------------------------------------
# An asynchronous device, simulated
# ----------------------------------------------------------------------------------------


class SimulatedGPU:
    """A stand-in for an asynchronous accelerator, on any machine.

    ``launch(seconds)`` queues that much "kernel" work for a worker thread and returns at once,
    as a CUDA kernel launch does; ``synchronize()`` waits until everything queued has run, as
    ``torch.cuda.synchronize()`` does. ``launches`` and ``syncs`` count the calls. Use it in a
    ``with`` block (or call ``close()``) so its thread ends::

        with SimulatedGPU() as gpu:
            gpu.launch(0.05)          # returns immediately
            gpu.synchronize()         # returns after about 50 ms
    """

    def __init__(self, launch_s: float = 0.0):
        self.launch_s = launch_s  # host cost of one launch
        self.launches = 0
        self.syncs = 0
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="SimulatedGPU", daemon=True)
        self._thread.start()

    def _run(self):
        while True:
            work = self._q.get()
            try:
                if work is None:
                    return
                time.sleep(work)
            finally:
                self._q.task_done()

    def launch(self, seconds: float) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("this SimulatedGPU is closed; make a new one")
        self.launches += 1
        if self.launch_s:
            time.sleep(self.launch_s)
        self._q.put(float(seconds))

    def synchronize(self) -> None:
        self.syncs += 1
        self._q.join()

    def close(self) -> None:
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ----------------------------------------------------------------------------------------
# Mixed precision: what fp16's GradScaler costs in host synchronisations
# ----------------------------------------------------------------------------------------


def count_syncs(fn: Callable[[], Any]) -> int:
    """How many times ``fn()`` made the host wait for the GPU (``.item()``, ``.cpu()``, a
    blocking copy...): CUDA's sync debug mode reports each one; we count the reports. CUDA only."""
    import warnings

    if not torch.cuda.is_available():
        raise RuntimeError("count_syncs needs a CUDA GPU: there is nothing to synchronise with on a CPU")
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(before)
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def amp_step_costs(
    model: nn.Module,
    batch_size: int = 256,
    *,
    device: torch.device | str = "cuda",
    input_shape: tuple[int, ...] = (3, 32, 32),
    steps: int = 20,
    repeats: int = 5,
) -> dict[str, dict]:
    """fp16 with ``GradScaler`` against bf16 without one, on a CUDA ``device``: host syncs per
    step and median seconds per step (:func:`time_fn`), plus the steps when fp16 is run *without*
    the scaler's check (for the timing only: unsafe to train with).

    Why the scaler synchronises: ``scaler.step(optimizer)`` must skip the step when the scaled
    gradients overflowed. With a non-fused optimizer, such as the SGD here, that decision is taken
    on the host, so it reads the GPU's found-inf flag with ``.item()`` every step (a ``fused=True``
    optimizer takes the flag as a tensor and skips on the GPU, with no sync). The host then waits for the whole backward pass
    before it can queue the next step's kernels; the GPU idles for the host's launch time of
    the next forward. bf16 has fp32's exponent range, needs no scaler and has no such sync."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"amp_step_costs measures CUDA synchronisations; got device {device}")
    net = copy.deepcopy(model).to(device).train()
    x = torch.randn(batch_size, *input_shape, device=device)
    y = torch.randint(0, 10, (batch_size,), device=device)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)  # not fused: the scaler reads found_inf on the host
    scaler = torch.amp.GradScaler("cuda")

    def fp16_scaled():
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.cross_entropy(net(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)  # sync point: reads found_inf with .item()
        scaler.update()
        opt.zero_grad(set_to_none=True)

    def fp16_unscaled():
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def bf16():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    from .device import bf16_supported

    variants = [("fp16 + GradScaler", fp16_scaled), ("fp16, no scaler", fp16_unscaled)]
    if bf16_supported(device):  # pre-Ampere GPUs only emulate bf16
        variants.append(("bf16", bf16))
    out = {}
    for name, fn in variants:
        fn()  # warm-up (cuDNN autotuning, allocation)
        torch.cuda.synchronize(device)
        syncs = count_syncs(lambda fn=fn: [fn() for _ in range(steps)]) / steps
        t = time_fn(fn, warmup=1, repeats=repeats, number=steps, device=device)
        out[name] = {"syncs_per_step": syncs, "step_s": t.median, "iqr_s": t.iqr}
    return out


# ----------------------------------------------------------------------------------------
# A device's measured peak
# ----------------------------------------------------------------------------------------


def matmul_flops_per_s(
    n: int,
    *,
    device: torch.device | str = "cpu",
    precision: str = "fp32",
    warmup: int = 1,
    repeats: int = 3,
) -> float:
    """FLOP/s of an ``n x n`` by ``n x n`` matrix multiply (``2 n^3`` FLOPs) on ``device``:
    the peak a device reaches in practice, where no datasheet figure applies (a CPU, an unknown
    GPU). ``precision``: "fp32", "tf32" (fp32 tensors with TF32 matrix multiplies allowed, for
    the duration of the measurement) or "bf16". Taken from the FASTEST repeat: other work on
    the machine only ever slows a repeat down, so the fastest is the least disturbed.

    On a CPU the multiply runs on ONE thread and the rate is multiplied by the threads torch
    uses (``torch.get_num_threads()``): a chip's peak is the sum of its cores' peaks. One
    thread has no partner to wait for, so a busy neighbour on another core cannot slow it. The
    result is an upper bound: one core alone clocks higher than all of them busy together, and
    threads beyond the physical cores share their arithmetic units."""
    if precision not in ("fp32", "tf32", "bf16"):
        raise ValueError(f"precision must be fp32, tf32 or bf16, got {precision!r}")
    device = torch.device(device)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    before = torch.get_float32_matmul_precision()
    threads = torch.get_num_threads()
    torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        t = time_fn(lambda: torch.mm(a, b), warmup=warmup, repeats=repeats, device=device)
    finally:
        torch.set_float32_matmul_precision(before)
        torch.set_num_threads(threads)
    return 2 * n**3 / t.min * (threads if device.type == "cpu" else 1)


# ----------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------


def format_table(rows: Iterable[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """A plain-text table of dicts ``rows``; ``columns`` is a list of (key, header, format)."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        cells.append([("-" if r.get(k) is None else fmt.format(r[k])) for k, _, fmt in columns])
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
