"""Where the time goes: ``torch.profiler`` around :func:`utils.train.fit`, a trace per rank,
parsed and drawn without another tool.

    prof, trace = profile_fit(model, loader, optimizer, "runs/profiles/one", steps=(1, 1, 3))
    events = load_trace(trace)                 # the Chrome/Perfetto JSON's complete events
    phase_times(events)                        # {"data": us, "forward": us, "backward": us, ...}
    plot_timeline(events)                      # one lane per thread, coloured by phase

The trace is the file ``tensorboard --logdir runs/profiles`` (with torch-tb-profiler) and
https://ui.perfetto.dev open. Nothing here edits the training loop: the profiler is stepped by a
``fit`` callback, the phases are labelled by a forward hook and a loader wrapper, and the rest
(backward, optimizer, collectives, syncs) carries the names PyTorch already gives it.

Lab 6 profiles a run with three planted bottlenecks, built from the pieces at the end of this
module: :func:`planted_loader`, :class:`StandardizeEveryStep`, :class:`LogLossEveryStep`, and
its model :func:`lab_model`.
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import json
import os
import re
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.profiler import record_function

from .data import EpochLoader
from .train import Callback, fit

if TYPE_CHECKING:
    from matplotlib.axes import Axes

# Phase of an event, by name: our labels first, then the names PyTorch's own ops carry.
PHASES = ("data", "forward", "backward", "optimizer", "communication", "sync")
PHASE_COLORS = {
    "data": "tab:orange",
    "forward": "tab:blue",
    "backward": "tab:green",
    "optimizer": "tab:purple",
    "communication": "tab:red",
    "sync": "black",
}
# The categories of a trace's host-side events (the ones key_averages() counts as CPU time); the
# device's own events (kernels, copies, gpu_user_annotation) sit on lanes of their own.
HOST_EVENT_CATS = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")
SYNC_OPS = (
    "aten::item",
    "aten::_local_scalar_dense",
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
)


def phase_of(name: str) -> str | None:
    """The phase an event belongs to, from its name (None: not one of :data:`PHASES`)."""
    if name.startswith("phase:"):
        return name[6:]
    if name.startswith("enumerate(DataLoader)"):
        return "data"
    if name.startswith(("autograd::engine::evaluate_function", "DistributedDataParallel.backward")):
        return "backward"
    if name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")):
        return "optimizer"
    if is_allreduce(name) or name.startswith(("gloo:", "nccl:", "ncclDevKernel", "ncclKernel")):
        return "communication"
    if name in SYNC_OPS:
        return "sync"
    return None


def is_allreduce(name: str) -> bool:
    """A collective all-reduce as the profiler names it (``gloo:all_reduce``, ``nccl:all_reduce``...)."""
    n = name.lower()
    return ("all_reduce" in n or "allreduce" in n) and not n.startswith("phase:")


# ----------------------------------------------------------------------------------------
# Recording
# ----------------------------------------------------------------------------------------


class ProfilerStep(Callback):
    """A ``fit`` callback that advances a ``torch.profiler.profile`` schedule after every optimizer step."""

    def __init__(self, prof: torch.profiler.profile):
        self.prof = prof

    def on_step_end(self, state: SimpleNamespace) -> None:
        self.prof.step()


class LabeledLoader(EpochLoader):
    """A loader whose every ``next()`` is recorded as ``phase:data`` (time the loop waits for a batch)."""

    def __init__(self, loader: Iterable):
        self.loader = loader

    def __iter__(self):
        it = iter(self.loader)
        while True:
            with record_function("phase:data"):
                try:
                    batch = next(it)
                except StopIteration:
                    return
            yield batch

    def __getattr__(self, name):  # sampler, batch_size...
        return getattr(self.loader, name)


@contextlib.contextmanager
def phase_labels(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Record every call of ``model`` (the forward pass) as ``phase:forward``, via forward hooks."""
    open_ = []

    def pre(module, args):
        rf = record_function("phase:forward")
        rf.__enter__()
        open_.append(rf)

    def post(module, args, out):
        if open_:
            open_.pop().__exit__(None, None, None)

    h1, h2 = model.register_forward_pre_hook(pre), model.register_forward_hook(post)
    try:
        yield model
    finally:
        h1.remove()
        h2.remove()


def make_profiler(
    trace_dir: str | os.PathLike,
    *,
    worker_name: str = "rank0",
    wait: int = 1,
    warmup: int = 1,
    active: int = 3,
    record_shapes: bool = False,
    with_stack: bool = False,
    device: torch.device | str | None = None,
) -> torch.profiler.profile:
    """A ``torch.profiler.profile`` that skips ``wait`` steps, warms up ``warmup``, records ``active``
    and then writes ``trace_dir/<worker_name>.<time>.pt.trace.json`` (TensorBoard's layout),
    replacing the worker's earlier traces in that folder. GPU activity is traced when the work runs
    on a CUDA ``device`` (default: whenever CUDA is available); a rank working on the CPU beside a
    GPU traces only the CPU."""
    for old in glob.glob(os.path.join(os.fspath(trace_dir), f"{worker_name}.*.pt.trace.json*")):
        os.remove(old)  # a rerun replaces its trace (one per worker and folder)
    acts = [torch.profiler.ProfilerActivity.CPU]
    on_cuda = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
    if on_cuda and torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    os.makedirs(trace_dir, exist_ok=True)
    return torch.profiler.profile(
        activities=acts,
        schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(os.fspath(trace_dir), worker_name=worker_name),
        record_shapes=record_shapes,
        with_stack=with_stack,
        acc_events=True,  # one cycle (repeat=1): keeping its events changes nothing, and torch stops warning
    )


def trace_dir(name: str) -> str:
    """``runs/profiles/<name>`` at the repository's top (or under LAB_RUNS_DIR): where
    ``make tensorboard`` looks."""
    root = os.environ.get("LAB_RUNS_DIR") or os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runs"
    )
    return os.path.join(root, "profiles", name)


def latest_trace(trace_dir: str | os.PathLike, worker_name: str = "") -> str:
    """The newest trace file in ``trace_dir`` (of ``worker_name`` if given)."""
    files = glob.glob(os.path.join(os.fspath(trace_dir), f"{worker_name}*.pt.trace.json*"))
    if not files:
        raise FileNotFoundError(
            f"no trace {worker_name}*.pt.trace.json in {trace_dir}: did the profiler reach "
            "the end of its active steps (wait + warmup + active optimizer steps)?"
        )
    return max(files, key=os.path.getmtime)


_KINETO_NOISE = re.compile(r"^(USDT|STAGE):\S+ \S+ \d+:\d+ \S+\.cpp:\d+\] ")


class _Captured:
    text = ""


@contextlib.contextmanager
def native_stderr() -> Iterator[_Captured]:
    """Capture what native (C++) code writes to this process's stderr, file descriptor 2 (c10d's
    and gloo's logs, which Python's ``sys.stderr`` never sees); ``.text`` holds it after the block::

        with native_stderr() as err:
            torch.distributed.TCPStore("node-O1.invalid", 29500, 2, False, timedelta(seconds=2))
        print(err.text)        # the retry log a rank prints before its exception
    """
    cap = _Captured()
    try:
        fd = sys.__stderr__.fileno()
    except (AttributeError, ValueError, OSError):
        yield cap
        return
    sys.__stderr__.flush()
    saved = os.dup(fd)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), fd)
        try:
            yield cap
        finally:
            sys.__stderr__.flush()
            os.dup2(saved, fd)
            os.close(saved)
            tmp.seek(0)
            cap.text = tmp.read().decode(errors="replace")


@contextlib.contextmanager
def _quiet_kineto():
    """Drop the lines some libkineto builds print on stderr at every profiler start and stop
    ("USDT:... profiler_start"); every other line written meanwhile is passed on."""
    with native_stderr() as err:
        yield
    kept = "".join(line for line in err.text.splitlines(keepends=True) if not _KINETO_NOISE.match(line))
    if kept:
        try:
            os.write(sys.__stderr__.fileno(), kept.encode())
        except (AttributeError, ValueError, OSError):
            pass


def profile_fit(
    model: torch.nn.Module,
    loader: Iterable,
    optimizer: torch.optim.Optimizer,
    trace_dir: str | os.PathLike,
    *,
    steps: tuple[int, int, int] = (1, 1, 3),
    worker_name: str = "rank0",
    callbacks: Iterable[Callback] = (),
    record_shapes: bool = False,
    **fit_kwargs: Any,
) -> tuple[torch.profiler.profile, str]:
    """Run ``fit`` for ``wait + warmup + active`` optimizer steps under the profiler, with phases
    labelled; returns ``(profiler, trace_path)``. ``steps = (wait, warmup, active)``;
    ``record_shapes``: each op's input shapes go into the trace (``args["Input Dims"]``)."""
    wait, warmup, active = steps
    fit_kwargs.setdefault("progress", False)
    with (
        _quiet_kineto(),
        phase_labels(model),
        make_profiler(
            trace_dir,
            worker_name=worker_name,
            wait=wait,
            warmup=warmup,
            active=active,
            record_shapes=record_shapes,
            device=fit_kwargs.get("device"),
        ) as prof,
    ):
        fit(
            model,
            LabeledLoader(loader),
            optimizer,
            steps=wait + warmup + active,
            callbacks=[*callbacks, ProfilerStep(prof)],
            **fit_kwargs,
        )
    return prof, latest_trace(trace_dir, worker_name)


# ----------------------------------------------------------------------------------------
# Reading a trace
# ----------------------------------------------------------------------------------------


def load_trace(path: str | os.PathLike) -> list[dict]:
    """The complete events (``"ph": "X"``: name, ts and dur in microseconds, pid, tid) of a
    Chrome trace file (``.json`` or ``.json.gz``), in time order.

    With CUDA traced, the profiler also writes each ``record_function`` range (``ProfilerStep#N``,
    ``phase:data``, ...) a second time on the GPU's timeline, category ``gpu_user_annotation``,
    spanning that range's kernels. Those copies are left out: they share the CPU range's name, so
    keeping them would count every step twice."""
    path = os.fspath(path)
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    out = [e for e in events if e.get("ph") == "X" and "dur" in e and e.get("cat") != "gpu_user_annotation"]
    if not out:
        raise ValueError(f"{path} holds no complete events: is it a torch.profiler trace?")
    return sorted(out, key=lambda e: e["ts"])


def profiler_steps(events: Iterable[dict]) -> list[dict]:
    """The ``ProfilerStep#N`` events: one per recorded optimizer step."""
    return [e for e in events if e["name"].startswith("ProfilerStep#")]


def _union(intervals) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _merge(intervals) -> list:
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [tuple(x) for x in out]


def _subtract(intervals, holes) -> list:
    """The parts of ``intervals`` outside every hole."""
    out = []
    holes = _merge(holes)
    for a, b in _merge(intervals):
        for p, q in holes:
            if q <= a or p >= b:
                continue
            if p > a:
                out.append((a, p))
            a = max(a, q)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out


def phase_times(events: list[dict], *, phases: Iterable[str] = PHASES) -> dict[str, float]:
    """Microseconds spent in each phase, within the recorded steps. Nested events (an op inside
    ``phase:forward``) and events on other threads overlapping in time count once per phase.
    ``"step"``: the total of the ``ProfilerStep`` spans; ``"other"``: step time in no phase."""
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in profiler_steps(events)]
    if not spans:
        raise ValueError("no ProfilerStep# events: record with a schedule and step the profiler (ProfilerStep)")
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    per = {p: [] for p in phases}
    for e in events:
        p = phase_of(e["name"])
        if p in per:
            a, b = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
            if b > a:
                per[p].append((a, b))
    out = {p: _union(v) for p, v in per.items()}
    out["step"] = sum(b - a for a, b in spans)
    out["other"] = max(0.0, out["step"] - _union([iv for v in per.values() for iv in v]))
    return out


def phase_times_per_step(events: list[dict], *, phases: Iterable[str] = PHASES) -> list[dict[str, float]]:
    """:func:`phase_times` of each recorded step on its own (medians over them resist a step that
    another process on a busy machine stretched)."""
    out = []
    for s in profiler_steps(events):
        a, b = s["ts"], s["ts"] + s["dur"]
        inside = [
            e for e in events if e["ts"] < b and e["ts"] + e["dur"] > a and not e["name"].startswith("ProfilerStep#")
        ]
        out.append(phase_times([s, *inside], phases=phases))
    return out


def count_per_step(events: list[dict], match: str | Callable[[str], bool]) -> float:
    """Events per recorded step whose name satisfies ``match`` (a callable, or an exact name)."""
    pred = match if callable(match) else (lambda n: n == match)
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in profiler_steps(events)]
    if not spans:
        raise ValueError("no ProfilerStep# events in this trace")
    n = sum(1 for e in events if pred(e["name"]) and any(a <= e["ts"] < b for a, b in spans))
    return n / len(spans)


def op_counts(events: Iterable[dict]) -> Counter:
    return Counter(e["name"] for e in events)


# ----------------------------------------------------------------------------------------
# Drawing a trace
# ----------------------------------------------------------------------------------------


def plot_timeline(
    events: list[dict],
    ax: Axes | None = None,
    *,
    title: str = "profiler trace",
    max_lanes: int = 6,
    legend: bool = True,
    step: int | None = None,
) -> Axes:
    """The trace as a timeline: one lane per (process, thread), each event a bar coloured by its
    phase (grey: other ops, drawn thinner). Time in milliseconds from the first recorded step;
    ``step``: show only that recorded step (0 = the first)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    steps = profiler_steps(events)
    t0 = min(e["ts"] for e in steps) if steps else events[0]["ts"]
    lanes = {}
    for e in events:
        if (
            e["name"].startswith("ProfilerStep#")
            or e.get("cat") in ("python_function", "Trace")
            or isinstance(e["pid"], str)
        ):  # the profiler's own span lane
            continue
        lanes.setdefault((e["pid"], e["tid"]), []).append(e)
    # busiest lanes first, at most max_lanes
    keys = sorted(lanes, key=lambda k: -sum(e["dur"] for e in lanes[k]))[:max_lanes]
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 0.9 + 0.7 * (len(keys) + 1)))
    for s in steps:
        ax.axvspan(
            (s["ts"] - t0) / 1e3,
            (s["ts"] + s["dur"] - t0) / 1e3,
            color="0.93" if int(s["name"].split("#")[1]) % 2 else "0.97",
            zorder=0,
        )
    labels = []
    for i, k in enumerate(keys):
        y = len(keys) - i
        bars = {}  # one broken_barh per (lane, phase): fast to draw
        for e in lanes[k]:
            bars.setdefault(phase_of(e["name"]), []).append(((e["ts"] - t0) / 1e3, max(e["dur"], 1) / 1e3))
        for p, xs in bars.items():
            top = p is not None
            ax.broken_barh(
                xs,
                (y - (0.35 if top else 0.15), 0.7 if top else 0.3),
                color=PHASE_COLORS.get(p, "0.6"),
                zorder=3 if top else 2,
                linewidth=0,
            )
        labels.append(f"pid {k[0]}\ntid {k[1]}")
    ax.set_yticks(range(len(keys), 0, -1), labels, fontsize=8)
    ax.set_xlabel("time since the first recorded step (ms)")
    ax.set_title(title)
    ax.set_ylim(0.4, len(keys) + 0.6)
    if step is not None and steps:
        s = steps[step]
        ax.set_xlim((s["ts"] - t0) / 1e3, (s["ts"] + s["dur"] - t0) / 1e3)
    if legend:
        ax.legend(
            handles=[Patch(color=c, label=p) for p, c in PHASE_COLORS.items()] + [Patch(color="0.6", label="other op")],
            loc="upper center",
            bbox_to_anchor=(0.5, -0.25),
            ncol=7,
            fontsize=8,
            frameon=False,
        )
    return ax


# ----------------------------------------------------------------------------------------
# DDP: a worker that profiles a few steps per rank (for utils.parallel.launch)
# ----------------------------------------------------------------------------------------


def ddp_profile_worker(
    trace_dir: str,
    bucket_caps_mb: Iterable[float] = (25.0,),
    *,
    width: int = 512,
    depth: int = 4,
    batch_size: int = 32,
    steps: tuple[int, int, int] = (2, 1, 3),
    seed: int = 0,
) -> list[dict]:
    """One rank of DDP runs on an MLP (``depth`` layers of ``width`` x ``width``: 1 MiB of float32
    gradient each at width 512), one run per bucket cap, each profiled for ``steps = (wait,
    warmup, active)``. Rank R writes ``trace_dir/cap<C>mb/rank<R>.*.pt.trace.json``. Returns, per
    cap, the trace path and DDP's own account of its buckets (bytes, after the rebuild at step 1)."""
    from . import parallel

    ctx = parallel.setup()
    out = []
    try:
        for cap in bucket_caps_mb:
            torch.manual_seed(seed)
            layers = []
            for _ in range(depth):
                layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
            model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))
            g = torch.Generator().manual_seed(seed + ctx.rank)
            n = batch_size * (sum(steps) + 1)
            x, y = torch.randn(n, width, generator=g), torch.randint(0, 10, (n,), generator=g)
            loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)
            net = parallel.ddp(model, ctx, bucket_cap_mb=cap)
            opt = torch.optim.SGD(net.parameters(), lr=0.01)
            _, trace = profile_fit(
                net,
                loader,
                opt,
                os.path.join(trace_dir, f"cap{cap:g}mb"),
                steps=steps,
                worker_name=f"rank{ctx.rank}",
                device=ctx.device,
            )
            info = net._get_ddp_logging_data() if hasattr(net, "_get_ddp_logging_data") else {}
            sizes = info.get("rebuilt_bucket_sizes") or info.get("bucket_sizes") or ""
            out.append(
                {
                    "rank": ctx.rank,
                    "trace": trace,
                    "bucket_cap_mb": cap,
                    "bucket_sizes": [int(v) for v in str(sizes).split(",") if v.strip()],
                }
            )
            net = None  # free the Reducer while the group exists
        return out
    finally:
        net = None
        parallel.teardown()


def overlap_report(events: list[dict]) -> dict[str, float]:
    """How DDP's gradient all-reduce overlaps the backward pass, averaged over the recorded steps.

    ``allreduce_per_step``: all-reduces launched per step (``c10d::allreduce_``: one per bucket);
    ``backward_after_first_launch``: share of the step's backward time that comes after the first
    launch (0: communication waited for the whole backward; near 1: it started early);
    ``comm_overlapped``: share of the communication time (the collective's own events, on the
    backend's threads) during which backward was still running."""
    steps = profiler_steps(events)
    if not steps:
        raise ValueError("no ProfilerStep# events in this trace")
    after, hidden, comm_total, launches = [], 0.0, 0.0, 0
    for s in steps:
        a, b = s["ts"], s["ts"] + s["dur"]
        inside = [e for e in events if a <= e["ts"] < b]
        # backward compute: the autograd events, minus the all-reduce launches nested in their hooks
        launch = [(e["ts"], e["ts"] + e["dur"]) for e in inside if e["name"] == "c10d::allreduce_"]
        bwd = _subtract([(e["ts"], e["ts"] + e["dur"]) for e in inside if phase_of(e["name"]) == "backward"], launch)
        starts = [x for x, _ in launch]
        comm = [
            (e["ts"], e["ts"] + e["dur"]) for e in inside if is_allreduce(e["name"]) and e["name"] != "c10d::allreduce_"
        ]
        launches += len(starts)
        total = _union(bwd)
        if starts and total > 0:
            t = min(starts)
            after.append(_union([(max(x, t), y) for x, y in bwd if y > t]) / total)
        for x, y in comm:
            comm_total += y - x
            hidden += _union([(max(x, p), min(y, q)) for p, q in bwd if q > x and p < y])
    return {
        "allreduce_per_step": launches / len(steps),
        "backward_after_first_launch": sum(after) / len(after) if after else 0.0,
        "comm_overlapped": hidden / comm_total if comm_total > 0 else 0.0,
    }


# ----------------------------------------------------------------------------------------
# Lab 6: a training run with three planted bottlenecks
# ----------------------------------------------------------------------------------------


class StandardizeEveryStep(torch.nn.Module):
    """``x -> (x - mean) / (std + eps)``, feature by feature, with the statistics of ``reference``
    (the training images). PLANTED BOTTLENECK: the statistics are a constant, yet every call
    computes them again from the whole ``reference`` (one pass over the training set per step)."""

    def __init__(self, reference: torch.Tensor, eps: float = 1e-5):
        super().__init__()
        self.register_buffer("reference", reference, persistent=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        std, mean = torch.std_mean(self.reference, dim=0)  # the whole training set, every step
        return (x - mean) / (std + self.eps)


class LogLossEveryStep(Callback):
    """A ``fit`` callback that keeps every step's loss in ``self.losses`` (floats). PLANTED
    BOTTLENECK: ``.item()`` reads the loss on the host every step, a host sync: on a GPU the host
    waits there until the device has finished the step, so it cannot queue the next one ahead."""

    def __init__(self):
        self.losses: list[float] = []

    def on_step_end(self, state: SimpleNamespace) -> None:
        self.losses.append(state.loss.item())  # a host sync, every step


def planted_loader(
    dataset: torch.utils.data.Dataset, batch_size: int, item_cost_s: float, *, seed: int = 0
) -> torch.utils.data.DataLoader:
    """PLANTED BOTTLENECK: every image costs ``item_cost_s`` of host work when it is read
    (``bench.SlowDataset``: decoding, in a real pipeline), in the training process itself
    (``num_workers=0``), every epoch. Batches in ``data.make_loader``'s order for ``seed``."""
    from .bench import SlowDataset
    from .data import make_loader

    return make_loader(SlowDataset(dataset, item_cost_s), batch_size, kind="dataloader", num_workers=0, seed=seed)


def lab_model(
    reference: torch.Tensor,
    width: int,
    depth: int,
    *,
    standardize: Callable[[torch.Tensor], torch.nn.Module] = StandardizeEveryStep,
    num_classes: int = 10,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> torch.nn.Sequential:
    """Lab 6's model: ``standardize(reference)`` (the planted :class:`StandardizeEveryStep` by
    default), then the course's MLP (``models.mlp``, ``depth`` layers of ``width``, images
    flattened), weights drawn from ``seed``: the same seed gives the same weights."""
    from .models import mlp

    reference = reference.to(device)
    net = mlp(width, depth, in_features=reference[0].numel(), out_features=num_classes, flatten=True, seed=seed)
    return torch.nn.Sequential(standardize(reference), net).to(device)
