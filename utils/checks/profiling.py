"""Self-checks for stage 6: profiling (lab6). Reading a trace (self time per op, the share of a
step spent waiting for data, host syncs per step) is checked on hand-made events with a known
answer and on real traces against ``torch.profiler``'s own totals or a planted, known cost.
The fixes (a loader, a logging callback, a standardisation layer) are checked against the planted
originals of ``utils.profiling`` (same batches, same losses, same outputs) and for their mechanism
(no per-image reads, no host sync per step, no pass over the training set per call)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import torch

from ._common import CheckFailed, _call, _fail, _passed, refusing  # noqa: F401

__all__ = [
    "check_self_times",
    "check_data_wait_fraction",
    "check_syncs_per_step",
    "check_fixed_loader",
    "check_loss_log",
    "check_standardize",
]


def _ev(name, ts, dur, tid=1, cat="cpu_op", pid=100):
    return {"ph": "X", "name": name, "ts": float(ts), "dur": float(dur), "pid": pid, "tid": tid, "cat": cat}


def _step(n, ts, dur):
    return _ev(f"ProfilerStep#{n}", ts, dur, cat="user_annotation")


def _number(name, got, what="a number"):
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        got = got.item()
    if not isinstance(got, (int, float)):
        _fail(name, f"returned {type(got).__name__}, expected {what}", "return a plain Python float")
    return float(got)


def _tiny_run(tmp, *, loader, callbacks=(), steps=(1, 1, 3), record_shapes=False, seed=0):
    """A small MLP trained under the profiler on CPU: (profiler, events)."""
    from .. import profiling

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    prof, trace = profiling.profile_fit(
        model, loader, opt, tmp, steps=steps, device="cpu", callbacks=callbacks, record_shapes=record_shapes
    )
    return prof, profiling.load_trace(trace)


def _tiny_data(n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g))


# ----------------------------------------------------------------------------------------
# Exercise 1: self time per op
# ----------------------------------------------------------------------------------------


def check_self_times(self_times: Callable[..., Any]) -> None:
    """``self_times(events)`` -> {name: microseconds}: each host event's duration minus the
    durations of the events directly inside it on the same thread, summed by name. Checked on
    hand-made events (a closed form) and on a real trace against ``key_averages()``'s self CPU."""
    name = "self_times"
    # thread 1: A [0, 100) holds B [10, 40) which holds C [15, 25); A also holds C [50, 60).
    # thread 2, overlapping in time: D [20, 80). A kernel on the GPU's lane overlaps A too.
    events = [
        _ev("A", 0, 100),
        _ev("B", 10, 30),
        _ev("C", 15, 10),
        _ev("C", 50, 10),
        _ev("D", 20, 60, tid=2),
        _ev("kernel_k", 30, 40, pid=0, tid=7, cat="kernel"),
        # thread 3: H [200, 220) starts with its caller G [200, 250), and comes first in the list
        _ev("H", 200, 20, tid=3),
        _ev("G", 200, 50, tid=3),
    ]
    want = {"A": 100 - 30 - 10, "B": 30 - 10, "C": 20, "D": 60, "G": 50 - 20, "H": 20}
    got = _call(name, self_times, [dict(e) for e in events])
    if not isinstance(got, dict):
        _fail(name, f"returned {type(got).__name__}", "return a dict {op name: self time in microseconds}")
    got = {k: _number(name, v) for k, v in got.items()}
    if "kernel_k" in got:
        _fail(
            name,
            "the result has a GPU kernel in it",
            "keep only host events: those whose 'cat' is in utils.profiling.HOST_EVENT_CATS",
        )
    if got.get("A") == 100 and got.get("B") == 30:
        _fail(
            name,
            "each op got its whole duration (A: 100 us, though B and C ran inside it)",
            "subtract from each event the durations of the events directly inside it",
        )
    if got.get("A") == 100 - 30 - 10 - 10:
        _fail(
            name,
            f"A got {got['A']:g} us: C inside B was subtracted from A as well as from B",
            "subtract only the DIRECT children (the innermost open event is the parent)",
        )
    if got.get("D") != 60:
        _fail(
            name,
            f"D, alone on its thread, got {got.get('D')} us instead of its 60: events of another thread were "
            "nested with it",
            "nest events only within the same (pid, tid) lane",
        )
    if got.get("G") == 50 or got.get("H", 0) < 0:
        _fail(
            name,
            f"G [200, 250 us) calls H [200, 220 us), both starting at 200; you got G {got.get('G')} us and H "
            f"{got.get('H')} us: H was opened first and taken as G's parent",
            "when two events start together, the longer one is the caller: order ties longest first",
        )
    for k, w in want.items():
        if abs(got.get(k, float("nan")) - w) > 1e-6:
            _fail(
                name,
                f"on hand-made events {k} got {got.get(k)} us, expected {w}",
                "per (pid, tid): sort by start (longest first on ties), keep a stack of open events, "
                "pop those that ended; add each event's dur to its name and take it off its parent's",
            )
    # A real trace: the profiler's own self CPU totals are the oracle.
    from .. import profiling

    with tempfile.TemporaryDirectory() as tmp:
        loader = torch.utils.data.DataLoader(_tiny_data(), batch_size=16)
        prof, real = _tiny_run(tmp, loader=loader)
    got = _call(name, self_times, real)
    got = {k: _number(name, v) for k, v in got.items()}
    worst = None
    host = {e["name"] for e in real if e.get("cat") in profiling.HOST_EVENT_CATS}
    for k in prof.key_averages():
        if k.key not in host or k.key.startswith("ProfilerStep") or k.self_cpu_time_total < 20:
            continue
        mine = got.get(k.key)
        if mine is None or abs(mine - k.self_cpu_time_total) > 0.02 * k.self_cpu_time_total + 2:
            worst = (k.key, mine, k.self_cpu_time_total)
            break
    if worst:
        _fail(
            name,
            f"on a real trace, {worst[0]} got {worst[1]} us of self time; torch.profiler's key_averages() says "
            f"{worst[2]:.0f} us",
            "use every host event of the list (cat in HOST_EVENT_CATS), on its own (pid, tid) lane",
        )
    _passed(name, "nested events on two threads, and a real trace, match key_averages()'s self CPU time")


# ----------------------------------------------------------------------------------------
# Exercise 2: the share of the step spent waiting for data
# ----------------------------------------------------------------------------------------


def check_data_wait_fraction(data_wait_fraction: Callable[..., Any], item_cost_s: float = 2e-3) -> None:
    """``data_wait_fraction(events)`` -> the fraction (0..1) of the recorded steps' time spent in
    ``phase:data`` events. Checked on hand-made events and on a real trace of a loader whose
    per-image cost is known (its floor)."""
    from .. import profiling
    from ..bench import SlowDataset

    name = "data_wait_fraction"
    # two steps of 10 ms; data 3 ms and 5 ms (with DataLoader's own event inside); one data wait
    # before the first recorded step (not recorded), and the trace runs on after the last step.
    events = [
        _ev("phase:data", 0, 4000, cat="user_annotation"),
        _step(1, 5000, 10000),
        _ev("phase:data", 5000, 3000, cat="user_annotation"),
        _ev("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 5100, 2800),
        _step(2, 15000, 10000),
        _ev("phase:data", 15000, 5000, cat="user_annotation"),
        _ev("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 15100, 4800),
        _ev("Optimizer.step#SGD.step", 30000, 10000),
    ]
    want = 8000 / 20000
    with refusing(
        name, profiling, ("phase_times", "phase_times_per_step"), "loop over the events and add up their durations"
    ):
        got = _number(name, _call(name, data_wait_fraction, events))
    if abs(got - 100 * want) < 1:
        _fail(name, f"returned {got:g}: a percentage", "return a fraction between 0 and 1")
    if abs(got - 15600 / 20000) < 1e-6:
        _fail(
            name,
            f"returned {got:.3f}: the DataLoader's own events, nested inside phase:data, were counted again",
            "count only the phase:data events (they already contain the loader's)",
        )
    if abs(got - 12000 / 20000) < 1e-6:
        _fail(
            name,
            f"returned {got:.3f}: a data wait before the first recorded step was counted",
            "count only the phase:data events that start inside a ProfilerStep# event",
        )
    if abs(got - 8000 / 40000) < 1e-6 or abs(got - 12000 / 40000) < 1e-6:
        _fail(
            name,
            f"returned {got:.3f}: divided by the trace's whole span",
            "divide by the total duration of the ProfilerStep# events",
        )
    if abs(got - want) > 1e-6:
        _fail(
            name,
            f"returned {got:.4f} on hand-made events (two 10 ms steps waiting 3 and 5 ms), expected {want}",
            "sum the dur of phase:data events inside ProfilerStep# events; divide by the steps' total dur",
        )
    # A real trace: 16 images of item_cost_s each per batch is a floor the wait cannot beat.
    from .. import profiling

    with tempfile.TemporaryDirectory() as tmp:
        loader = torch.utils.data.DataLoader(SlowDataset(_tiny_data(), item_cost_s), batch_size=16)
        _, real = _tiny_run(tmp, loader=loader, steps=(1, 1, 2))
    with refusing(
        name, profiling, ("phase_times", "phase_times_per_step"), "loop over the events and add up their durations"
    ):
        got = _number(name, _call(name, data_wait_fraction, real))
    steps = profiling.profiler_steps(real)
    floor = 16 * item_cost_s * 1e6 * len(steps) / sum(s["dur"] for s in steps)
    lib = profiling.phase_times(real)
    if not (0.9 * floor <= got <= 1.0) or abs(got - lib["data"] / lib["step"]) > 0.02:
        _fail(
            name,
            f"on a real trace returned {got:.3f}; the loader alone costs at least {floor:.3f} of those steps",
            "sum phase:data durations inside the ProfilerStep# events, over their total duration",
        )
    _passed(name, f"hand-made events, and a real trace waiting {got:.0%} of its steps (floor {floor:.0%})")


# ----------------------------------------------------------------------------------------
# Exercise 3: host syncs per step
# ----------------------------------------------------------------------------------------


def check_syncs_per_step(syncs_per_step: Callable[..., Any]) -> None:
    """``syncs_per_step(events)`` -> the mean number of ``aten::_local_scalar_dense`` events (one
    per read of a device value on the host) per recorded step. Checked on hand-made events and on
    real traces of ``fit`` with and without a callback that calls ``.item()`` every step."""
    from .. import profiling

    name = "syncs_per_step"
    # each step: one .item() (aten::item around aten::_local_scalar_dense) and one float(t) (no
    # aten::item); then a float(t) after the recorded steps (an epoch's end). 4 syncs in 2 steps.
    events = [
        _step(1, 0, 100),
        _ev("aten::item", 10, 5),
        _ev("aten::_local_scalar_dense", 11, 3),
        _ev("aten::_local_scalar_dense", 50, 3),
        _step(2, 100, 100),
        _ev("aten::item", 110, 5),
        _ev("aten::_local_scalar_dense", 111, 3),
        _ev("aten::_local_scalar_dense", 150, 3),
        _ev("aten::_local_scalar_dense", 301, 3),
    ]
    got = _number(name, _call(name, syncs_per_step, events))
    if abs(got - 1.0) < 1e-9:
        _fail(
            name,
            "returned 1.0 on hand-made events with 4 syncs in 2 steps: you counted aten::item, and float(t) "
            "syncs without it",
            "aten::item calls aten::_local_scalar_dense, and every sync goes through that op: count it, once per sync",
        )
    if abs(got - 3.0) < 1e-9 or abs(got - 3.5) < 1e-9:
        _fail(
            name,
            f"returned {got:g} on hand-made events with 4 syncs in 2 steps: aten::item was counted as well",
            "aten::item calls aten::_local_scalar_dense; count only the latter (float(t) skips aten::item)",
        )
    if abs(got - 2.5) < 1e-9:
        _fail(
            name,
            "returned 2.5 on hand-made events with 4 syncs in 2 steps: one after the last step was counted",
            "count only events that start inside a ProfilerStep# event",
        )
    if abs(got - 4.0) < 1e-9 or abs(got - 5.0) < 1e-9:
        _fail(name, f"returned {got:g}, a total", "divide by the number of ProfilerStep# events")
    if abs(got - 2.0) > 1e-9:
        _fail(
            name,
            f"returned {got:g} on hand-made events with 4 syncs in 2 steps, expected 2.0",
            "count aten::_local_scalar_dense events inside ProfilerStep# events; divide by the steps",
        )
    for log, want in ((None, 0.0), (profiling.LogLossEveryStep(), 1.0)):
        with tempfile.TemporaryDirectory() as tmp:
            loader = torch.utils.data.DataLoader(_tiny_data(), batch_size=16)
            _, real = _tiny_run(tmp, loader=loader, callbacks=[log] if log else [])
        got = _number(name, _call(name, syncs_per_step, real))
        if got != want:
            _fail(
                name,
                f"on a real trace of fit {'with a callback calling .item() every step' if log else 'alone'} "
                f"returned {got:g}, expected {want:g}",
                "match the exact name 'aten::_local_scalar_dense', inside the ProfilerStep# events",
            )
    _passed(name, "hand-made events, and real traces with 0 and 1 sync per step")


# ----------------------------------------------------------------------------------------
# Exercise 4: the loader
# ----------------------------------------------------------------------------------------


class _CountingDataset(torch.utils.data.TensorDataset):
    """A TensorDataset that counts per-image reads (``dataset[i]``): the planted per-image cost."""

    reads = 0

    def __getitem__(self, i):
        self.reads += 1
        return super().__getitem__(i)


def _epochs(loader, n=2):
    from ..data import set_epoch

    out = []
    for e in range(n):
        set_epoch(loader, e)
        out.append([(x.cpu(), y.cpu()) for x, y in loader])
    return out


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(a, b))


def check_fixed_loader(fixed_loader: Callable[..., Any]) -> None:
    """``fixed_loader(dataset, batch_size, device, seed)`` -> a loader yielding, epoch by epoch
    (``utils.data.set_epoch``), the planted loader's batches for that seed, without reading the
    images one at a time."""
    from ..profiling import planted_loader

    name = "fixed_loader"
    x, y = torch.randn(50, 3, 2), torch.arange(50) % 10
    seed, B = 3, 8
    want = _epochs(planted_loader(torch.utils.data.TensorDataset(x, y), B, 0.0, seed=seed))
    ds = _CountingDataset(x, y)
    loader = _call(name, fixed_loader, ds, B, "cpu", seed)
    if getattr(loader, "num_workers", 0):
        _fail(
            name,
            f"your loader reads the images in {loader.num_workers} worker processes: the per-image work is "
            "still done every epoch, only spread over more cores (and reads there cannot be counted here)",
            "keep the data resident instead: serve each batch as a slice of the dataset's tensors, with no "
            "per-image read at all",
        )
    try:
        got = _epochs(loader)
    except Exception as e:  # noqa: BLE001 - the student's loader crashed while iterated
        _fail(name, f"iterating your loader raised {type(e).__name__}: {e}", "return a loader of (x, y) batches")
    if ds.reads:
        _fail(
            name,
            f"your loader read the images one at a time ({ds.reads} reads of dataset[i] in 2 epochs), "
            "so any per-image work is paid again every epoch",
            "serve batches as slices of the dataset's tensors (dataset.tensors), as a device-resident loader does",
        )
    if _same(got[0], want[0]) and not _same(got[1], want[1]):
        _fail(
            name,
            "epoch 0 is right but epoch 1 repeats or differs from the original's order",
            "draw a new order each epoch: a loader with set_epoch (utils.data's loaders have it)",
        )
    if not _same(got[0], want[0]):
        sizes = [len(b[1]) for b in got[0]]
        unshuffled = [y[i : i + B] for i in range(0, 50, B)]
        if sizes and all(torch.equal(b[1], u) for b, u in zip(got[0], unshuffled)):
            _fail(name, "your batches come in the dataset's order", "shuffle, with the seed you are given")
        if sizes != [len(b[1]) for b in want[0]]:
            _fail(
                name,
                f"your batch sizes are {sizes}, expected {[len(b[1]) for b in want[0]]}",
                "keep the last, smaller batch (no drop_last)",
            )
        _fail(
            name,
            "your batches differ from the original loader's for the same seed",
            "use utils.data's order for this seed (data.make_loader takes a seed), not a shuffle of your own",
        )
    _passed(name, "the original's batches for 2 epochs, and no per-image reads")


# ----------------------------------------------------------------------------------------
# Exercise 5: logging without a host sync per step
# ----------------------------------------------------------------------------------------


def check_loss_log(LossLog: Callable[..., Any]) -> None:  # noqa: N803 - a class, named as in the lab
    """``LossLog()``: a ``fit`` callback whose ``losses`` holds every step's loss as floats once
    an epoch has ended (the planted ``LogLossEveryStep``'s values), with no host sync inside the
    steps (``aten::_local_scalar_dense`` counted in a profiler trace)."""
    from .. import profiling
    from ..data import make_loader
    from ..profiling import _quiet_kineto
    from ..train import Callback, fit

    name = "LossLog"
    ds = _tiny_data(40)

    def run(cb):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        fit(model, make_loader(ds, 8, seed=0), opt, steps=7, progress=False, callbacks=[cb])
        return cb.losses

    want = run(profiling.LogLossEveryStep())
    log = _call(name, LossLog)
    got = _call(name, run, log)
    if not isinstance(got, list) or any(isinstance(v, torch.Tensor) for v in got):
        _fail(
            name,
            f"after fit, losses holds {type(got).__name__ if not isinstance(got, list) else 'tensors'}, not floats",
            "keep the tensors during the epoch; in on_epoch_end turn all of them into floats in one read",
        )
    if len(got) != len(want):
        _fail(
            name,
            f"after 7 steps over 2 epochs, losses has {len(got)} values",
            "one loss per optimizer step, and convert the pending ones at every epoch's end, not only the first",
        )
    if not all(abs(float(a) - b) <= 1e-6 * max(1.0, abs(b)) for a, b in zip(got, want)):
        _fail(name, "your losses differ from the ones read with .item() every step", "keep state.loss of each step")
    with tempfile.TemporaryDirectory() as tmp:
        loader = torch.utils.data.DataLoader(_tiny_data(), batch_size=16)
        _, events = _tiny_run(tmp, loader=loader, callbacks=[_call(name, LossLog)])
    syncs = profiling.count_per_step(events, "aten::_local_scalar_dense")
    if syncs > 0:
        _fail(
            name,
            f"a profiled run still reads {syncs:g} value(s) on the host per step (aten::_local_scalar_dense)",
            "in on_step_end only append the tensor state.loss; no .item(), float() or .tolist() there",
        )

    class EpochEnds(Callback):  # the baseline: reads nothing, counts the epochs' ends
        def __init__(self):
            self.calls, self.losses = 0, []

        def on_epoch_end(self, state):
            self.calls += 1

    def host_reads(cb):
        with _quiet_kineto(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _call(name, run, cb)
        return sum(e.name == "aten::_local_scalar_dense" for e in prof.events())

    ends = EpochEnds()
    n_log, n_base = host_reads(_call(name, LossLog)), host_reads(ends)
    if n_log - n_base > ends.calls:
        _fail(
            name,
            f"at the epochs' ends your LossLog read the losses one at a time ({n_log - n_base} host reads "
            f"over {ends.calls} epoch ends of 7 steps); one read per epoch is the point",
            "in on_epoch_end join the pending tensors into one tensor first, then read that one tensor",
        )
    _passed(name, "the same losses as .item() every step, 0 host syncs per step and 1 per epoch's end")


# ----------------------------------------------------------------------------------------
# Exercise 6: the constant computed once
# ----------------------------------------------------------------------------------------


def check_standardize(Standardize: Callable[..., Any]) -> None:  # noqa: N803 - a class, named as in the lab
    """``Standardize(reference, eps=1e-5)``: the planted ``StandardizeEveryStep``'s outputs, with
    the statistics kept in buffers and no pass over ``reference`` per call (the profiler's input
    shapes are the oracle)."""
    from ..profiling import StandardizeEveryStep, _quiet_kineto

    name = "Standardize"
    g = torch.Generator().manual_seed(0)
    N = 41  # rows of the reference: a size no batch has
    ref = torch.randn(N, 2, 3, generator=g) * torch.tensor([0.5, 2.0, 3.0]) + torch.tensor([1.0, -2.0, 0.5])
    ref[:, 0, 0] = 0.7  # a constant feature: its std is 0, as for the digits' corner pixels
    x = torch.randn(7, 2, 3, generator=g)
    want = StandardizeEveryStep(ref)(x)
    mod = _call(name, Standardize, ref.clone())
    got = _call(name, mod, x)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        _fail(
            name,
            f"returned {getattr(got, 'shape', type(got).__name__)}",
            f"return a tensor of x's shape {tuple(x.shape)}",
        )
    s1, m1 = torch.std_mean(ref, dim=0)
    if torch.allclose(got, (x - s1) / (m1 + 1e-5), rtol=1e-4, atol=1e-5, equal_nan=True):
        _fail(
            name,
            "you swapped the mean and the std: torch.std_mean returns them in the order (std, mean)",
            "unpack its result in that order, std first",
        )
    if not torch.isfinite(got).all():
        _fail(
            name,
            "some outputs are inf or nan: a feature of the reference is constant (std 0)",
            "add eps to the std before dividing, as the original does",
        )
    batch = (x - x.mean(0)) / (x.std(0) + 1e-5)
    if torch.allclose(got, batch, rtol=1e-4, atol=1e-5):
        _fail(
            name,
            "you standardised with the batch's own statistics",
            "compute mean and std over the reference (all training images), along dim 0",
        )
    s0, m0 = torch.std_mean(ref, dim=0, correction=0)
    if torch.allclose(got, (x - m0) / (s0 + 1e-5), rtol=1e-4, atol=1e-5):
        _fail(
            name,
            "your std is the biased one (divides by N)",
            "torch.std_mean's default divides by N - 1: use it with its defaults, as the original does",
        )
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
        _fail(
            name,
            "your outputs differ from the original's",
            "subtract the reference's mean and divide by its std plus eps, per feature (statistics over dim 0)",
        )
    with (
        _quiet_kineto(),
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof,
    ):
        mod(x)
    reads = sorted({e.name for e in prof.events() if any(s and s[0] == N for s in e.input_shapes)})
    if reads:
        _fail(
            name,
            f"each call still reads the whole reference ({', '.join(reads)} on its {N} rows)",
            "compute the statistics once, in __init__, and only use them in forward",
        )
    if not list(mod.buffers()):
        _fail(
            name,
            "the statistics are not buffers, so model.to(device) would leave them behind",
            "keep them as buffers of the module (nn.Module has a method for that), so they move with it",
        )
    _passed(name, "the original's outputs, statistics in buffers, and no pass over the reference per call")
