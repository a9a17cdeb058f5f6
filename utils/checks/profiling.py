"""Lab 6's exercises (solutions/lab6_profiling.ipynb): reading a trace (self time per op, the steps' share waiting for data,
host syncs per step) on hand-made events and real traces of a small fit, then the fixes of utils.profiling's planted
bottlenecks, their mechanism measured (per-image reads, host reads inside a step, passes over the reference per call).
tests/test_checks_profiling.py holds the oracles below to key_averages(), the planted loader's cost and the originals."""

import tempfile
from collections import defaultdict
from functools import cache, partial
from types import SimpleNamespace

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .. import data, profiling
from ..bench import SlowDataset
from ..train import Callback
from ._common import HostReads
from .engine import Case, Exercise, difference
from .engine import mistake as _m

LAB = "lab6_profiling"
UA, SYNC, STEP = "user_annotation", "aten::_local_scalar_dense", "ProfilerStep#"


def _trace(rows, scale=1.0, shift=0.0):
    """Complete events from rows (name, ts, dur[, tid[, cat[, pid]]]) in microseconds, scaled and shifted in time."""
    events = [dict(zip(("name", "ts", "dur", "tid", "cat", "pid"), r + (1, "cpu_op", 100)[len(r) - 3 :])) for r in rows]
    return [e | {"ph": "X", "ts": shift + scale * e["ts"], "dur": scale * e["dur"]} for e in events]


@cache
def _fit_trace(kind):
    """A small fit's events: "plain", "slow" (its loader costs 2 ms per image) or "item" (a callback syncs every step)."""
    g, _ = torch.Generator().manual_seed(0), torch.manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(96, 32, generator=g), torch.randint(0, 10, (96,), generator=g))
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    loader = torch.utils.data.DataLoader(SlowDataset(ds, 2e-3) if kind == "slow" else ds, batch_size=16)
    callbacks = [profiling.LogLossEveryStep()] if kind == "item" else []
    with tempfile.TemporaryDirectory() as tmp:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        _, path = profiling.profile_fit(model, loader, opt, tmp, device="cpu", callbacks=callbacks)
        return profiling.load_trace(path)


_real = lambda kind, label: Case(([dict(e) for e in _fit_trace(kind)],), label=label)  # a copy the answer may change


def _reading(fn, case):
    """``fn(events)``, which must leave the events as they were (in any order): later cells read them again."""
    before = sorted(map(repr, case.args[0]))
    got = fn(*case.args)
    if sorted(map(repr, case.args[0])) != before:
        raise ValueError("the function changed the events it was given")
    return got


_CHANGED = _m(
    "your function changed the events it was given, which later cells read again. Try: read each event without writing "
    "to it, and keep what you compute in new variables",
    lambda ev: [e.update(dur=0) for e in ev][:0] or 0.0,
    when=lambda o: "changed the events" in o.error,
)
_hand = lambda rows, label: [
    Case((_trace(rows),), label=label),
    Case((_trace(rows, 2.5, 1e3),), label=f"{label}, 2.5 times longer"),
]


def _self_times(events, lane=lambda e: (e["pid"], e["tid"]), host=True, direct=True, ties=True):
    """Self time per name; its slips: one ``lane`` for all, kernels kept, all ancestors charged, ties in list order."""
    lanes, out = defaultdict(list), defaultdict(float)
    for e in events:
        if not host or e.get("cat") in profiling.HOST_EVENT_CATS:
            lanes[lane(e)].append(e)
    for events_of_lane in lanes.values():
        still_open = []
        for e in sorted(events_of_lane, key=lambda e: (e["ts"], -e["dur"] if ties else 0)):
            while still_open and e["ts"] >= still_open[-1]["ts"] + still_open[-1]["dur"]:
                still_open.pop()
            out[e["name"]] += e["dur"]
            for parent in still_open[-1:] if direct else still_open:
                out[parent["name"]] -= e["dur"]
            still_open.append(e)
    return dict(out)


# thread 1: A [0, 100) holds B [10, 40), which holds C [15, 25), and C [50, 60); thread 2: D [20, 80); a GPU kernel;
# thread 3: H [200, 220) listed before its caller G [200, 250), which starts with it; thread 4: E [300, 320), then F
# [320, 340) right after it; thread 1 of another process: P [5, 55)
_NESTING = [
    ("A", 0, 100),
    ("B", 10, 30),
    ("C", 15, 10),
    ("C", 50, 10),
    ("D", 20, 60, 2),
    ("kernel_k", 30, 40, 7, "kernel", 0),
    ("H", 200, 20, 3),
    ("G", 200, 50, 3),
    ("E", 300, 20, 4),
    ("F", 320, 20, 4),
    ("P", 5, 50, 1, "cpu_op", 200),
]
SELF_TIMES = Exercise(
    name="self_times",
    oracle=_self_times,
    run=_reading,
    rtol=0.02,
    atol=2.0,
    timeout_s=30,
    cases=lambda: (
        _hand(_NESTING, "hand-made events on five threads") + [_real("plain", "a real trace of a training run")]
    ),
    hint="per (pid, tid) lane of host events, sorted by start, add each dur to its name and take it off the innermost "
    "open event's",
    passed="nested events on five threads, and a real trace against the profiler's own self time",
    mistakes=[
        _m(
            "the result has events that are not host ops in it (a GPU kernel, or the trace's own span). Try: keep only "
            "host events (cat in utils.profiling.HOST_EVENT_CATS)",
            partial(_self_times, host=False),
        ),
        _m(
            "each op got its whole duration. Try: take each event's dur off the event directly around it",
            partial(_self_times, lane=id),
        ),
        _m(
            "an op was taken off its grandparent as well as its parent. Try: take it off its DIRECT parent only (the "
            "innermost open event)",
            partial(_self_times, direct=False),
        ),
        _m(
            "an op lost time to ops of another thread. Try: nest events only within one (pid, tid) lane",
            partial(_self_times, lane=lambda e: 0),
        ),
        _m(
            "of two events starting together, the shorter, listed first, was taken as the caller. Try: order ties "
            "longest first",
            partial(_self_times, ties=False),
        ),
        _CHANGED,
    ],
)


def _per_step(events, match, per, value=lambda e: 1, inside=True):
    """The sum of ``value(e)`` over events whose name ``match``es (starting inside a ProfilerStep#), over ``per``."""
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith(STEP)]
    hits = [e for e in events if match(e["name"]) and (not inside or any(a <= e["ts"] < b for a, b in steps))]
    return sum(value(e) for e in hits) / per(events, steps)


_wait = partial(
    _per_step, match="phase:data".__eq__, value=lambda e: e["dur"], per=lambda _, s: sum(b - a for a, b in s)
)
_span = lambda ev, _: max(e["ts"] + e["dur"] for e in ev) - min(e["ts"] for e in ev)  # the trace's whole span
# a wait before the recorded steps; steps of 10 and 20 ms, 2 ms apart, waiting 3 and 5 ms, the loader's own event
# inside each wait; a wait in the gap between the steps; an op after
_LOADER = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"
_WAITS = [
    ("phase:data", 0, 4000, 1, UA),
    (f"{STEP}1", 5000, 1e4, 1, UA),
    ("phase:data", 5000, 3000, 1, UA),
    (_LOADER, 5100, 2800),
    ("phase:data", 15500, 1000, 1, UA),
    (f"{STEP}2", 17000, 2e4, 1, UA),
    ("phase:data", 17000, 5000, 1, UA),
    (_LOADER, 17100, 4800),
    ("Optimizer.step#SGD.step", 40000, 10000),
]
DATA_WAIT_FRACTION = Exercise(
    name="data_wait_fraction",
    oracle=_wait,
    run=_reading,
    rtol=1e-3,
    atol=1e-3,
    timeout_s=30,
    cases=lambda: (
        _hand(_WAITS, "steps of 10 and 20 ms waiting 3 and 5 ms") + [_real("slow", "a real trace of a slow loader")]
    ),
    refuse=("utils.profiling.phase_times", "utils.profiling.phase_times_per_step"),
    refuse_hint="loop over the events and add up their durations",
    passed="hand-made steps, and a real trace whose loader costs a known time per image",
    hint="sum the dur of the phase:data events that start inside a ProfilerStep# event and divide by the steps' total "
    "dur",
    mistakes=[
        _m("it returns a percentage. Try: return a fraction between 0 and 1", lambda ev: 100 * _wait(ev)),
        _m(
            "the DataLoader's events inside phase:data were counted again. Try: count only the phase:data events",
            partial(_wait, match=lambda n: n.startswith(("phase:d", "enum"))),
        ),
        _m(
            "a wait outside the recorded steps was counted. Try: count only waits starting inside a ProfilerStep#",
            partial(_wait, inside=False),
        ),
        _m(
            "it divides by the trace's whole span. Try: divide by the total duration of the ProfilerStep# events",
            partial(_wait, per=_span),
        ),
        _CHANGED,
    ],
)

_syncs = partial(_per_step, match=SYNC.__eq__, per=lambda _, s: len(s))
# three steps, each with an .item() (aten::item around the sync) and a float(t) (no aten::item), the second with one
# more float(t); a float(t) after them
_SYNCS = [
    (f"{STEP}1", 0, 100, 1, UA),
    ("aten::item", 10, 5),
    (SYNC, 11, 3),
    (SYNC, 50, 3),
    (f"{STEP}2", 100, 100, 1, UA),
    ("aten::item", 110, 5),
    (SYNC, 111, 3),
    (SYNC, 150, 3),
    (SYNC, 170, 3),
    (f"{STEP}3", 200, 100, 1, UA),
    ("aten::item", 210, 5),
    (SYNC, 211, 3),
    (SYNC, 250, 3),
    (SYNC, 301, 3),
]
SYNCS_PER_STEP = Exercise(
    name="syncs_per_step",
    oracle=_syncs,
    run=_reading,
    timeout_s=30,
    cases=lambda: (
        _hand(_SYNCS, "3 hand-made steps with 7 syncs in all")
        + [_real("plain", "a real trace of fit alone"), _real("item", "a real trace of fit with a sync a step")]
    ),
    refuse=("utils.profiling.count_per_step",),
    refuse_hint="loop over the events and count them",
    hint="count the aten::_local_scalar_dense events that start inside ProfilerStep# events, and divide by the steps",
    passed="hand-made events, and real traces with and without a sync per step",
    mistakes=[
        _m(
            "you counted aten::item, which float(t) skips. Try: count aten::_local_scalar_dense, once per sync",
            partial(_syncs, match="aten::item".__eq__),
        ),
        _m(
            "aten::item was counted as well as the sync inside it. Try: count only aten::_local_scalar_dense",
            partial(_syncs, match=("aten::item", SYNC).__contains__),
        ),
        _m(
            "a sync after the last recorded step was counted. Try: count only syncs starting inside a ProfilerStep#",
            partial(_syncs, inside=False),
        ),
        _m(
            "it returns a total, not a mean per step. Try: divide by the number of ProfilerStep# events",
            partial(_syncs, per=lambda *_: 1),
        ),
        _CHANGED,
    ],
)


class _Counting(torch.utils.data.TensorDataset):  # counts its per-image reads (dataset[i]): the planted loader's cost
    def __getitem__(self, i):  # a batch of indices at once (a tensor or list) is no per-image read
        one = not isinstance(i, (list, torch.Tensor)) or torch.is_tensor(i) and i.dim() == 0
        self.reads = getattr(self, "reads", 0) + one
        return super().__getitem__(i)


def _loader(dataset, batch_size, device, seed, listed=False, **kw):  # the oracle, and its slips
    loader = data.make_loader(dataset, batch_size, **{"kind": "device", "device": device, "seed": seed, **kw})
    return list(loader) if listed else loader


def _run_loader(answer, case):
    """Two epochs of the answer's loader over a counting dataset whose labels are the images' indices, and the
    device of its first batch when asked for the meta device (tensors without data)."""
    n, batch, seed = case.args
    ds = _Counting(torch.randn(n, 3, 2, generator=torch.Generator().manual_seed(seed)), torch.arange(n))
    loader, epochs = answer(ds, batch, "cpu", seed), []
    if getattr(loader, "num_workers", 0):
        return {"worker processes": loader.num_workers}  # their reads cannot be counted here
    for epoch in range(2):
        data.set_epoch(loader, epoch)
        epochs.append([(bx.cpu(), by.cpu()) for bx, by in loader])
    on_meta = next(iter(answer(torch.utils.data.TensorDataset(*ds.tensors), batch, "meta", seed)))
    return {
        "on the device asked for": all(t.device.type == "meta" for t in on_meta),
        "worker processes": 0,
        "per-image reads": getattr(ds, "reads", 0),
        "batch sizes": [[len(y) for _, y in e] for e in epochs],
        "order": [[int(i) for _, y in e for i in y] for e in epochs],
        "images with their labels": all(torch.equal(bx, ds.tensors[0][by]) for e in epochs for bx, by in e),
    }


_same_epoch = lambda o, k: difference(o.got["order"][k], o.want["order"][k]) is None
FIXED_LOADER = Exercise(
    name="fixed_loader",
    oracle=_loader,
    run=_run_loader,
    timeout_s=60,
    cases=lambda: [
        Case((50, 8, 3), label="50 images in batches of 8, seed 3"),
        Case((37, 5, 11), label="37 images in batches of 5, seed 11"),
    ],
    hint="return a loader of (x, y) batches in utils.data's order for this seed, each batch a slice of the dataset's "
    "tensors",
    passed="the original's batches for two epochs and two seeds, with no per-image reads",
    mistakes=[
        _m(
            "your loader reads the images one at a time (dataset[i], in this process or in workers), paying the "
            "per-image work every epoch. Try: serve each batch as a slice of the dataset's tensors",
            partial(_loader, kind="dataloader"),
            when=lambda o: o.got["worker processes"] or o.got["per-image reads"],
            mechanism=True,
        ),
        _m(
            "your loader is an iterator (a generator, or iter(...)), which runs dry after one pass, so the second "
            "epoch had no batches. Try: return an object that starts again each time it is iterated, such as a class "
            "with __iter__",
            lambda ds, b, dev, seed: iter(_loader(ds, b, dev, seed)),
            when=lambda o: "order" in o.got and not o.got["order"][1],
        ),
        _m(
            "epoch 1 repeats epoch 0 or differs from the original's. Try: use a loader with set_epoch, as utils.data's "
            "are",
            partial(_loader, listed=True),
            when=lambda o: _same_epoch(o, 0) and not _same_epoch(o, 1),
        ),
        _m(
            "your batches come in the dataset's order. Try: shuffle, with the seed you are given",
            partial(_loader, shuffle=False),
        ),
        _m(
            "your batch sizes differ from the original's. Try: keep the last, smaller batch (no drop_last)",
            partial(_loader, drop_last=True),
            when=lambda o: o.got["batch sizes"] != o.want["batch sizes"],
        ),
        _m(
            "your batches are not on the device your function is given. Try: move the dataset's tensors to that device "
            "once, before the first epoch, and slice the batches there",
            lambda ds, b, dev, seed: _loader(ds, b, "cpu", seed),
        ),
        _m(
            "your batches differ from the original's for this seed. Try: use utils.data's order (make_loader's seed)",
            lambda ds, b, dev, seed: _loader(ds, b, dev, 0),
        ),
    ],
)


class _Ops(TorchDispatchMode):
    """Records each aten op run under it, with its first argument's shape (a host read is aten::_local_scalar_dense)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.__dict__.setdefault("seen", []).append((func.name(), tuple(getattr(args[0], "shape", ())) if args else ()))
        return func(*args, **(kwargs or {}))


class _Log(Callback):
    """The oracle LossLog (``kind`` None: the pending losses read in one go at each epoch's end), and its slips."""

    def __init__(self, kind=None):
        self.losses, self.pending, self.kind = [], [], kind

    def on_step_end(self, state):
        self.losses.append(float(state.loss)) if self.kind == "float" else self.pending.append(state.loss)

    def on_epoch_end(self, state):
        if self.kind in ("each", "tensors"):
            self.losses += [float(t) if self.kind == "each" else t for t in self.pending]
        elif self.pending and not (self.kind == "first" and self.losses):
            self.losses += torch.stack(self.pending).tolist()
        self.pending = self.pending if self.kind == "kept" else []


def _run_log(cls, case):
    """``cls()`` driven as fit drives a callback, over epochs of ``case.args`` steps; its host reads in each hook."""
    log, state, in_step, at_end = cls(), SimpleNamespace(step=0), HostReads(), HostReads()
    losses = torch.rand(sum(case.args), generator=torch.Generator().manual_seed(len(case.args))) * 3
    for state.epoch, steps in enumerate(case.args):
        for _ in range(steps):
            state.loss, state.step = losses[state.step].clone(), state.step + 1  # as fit's: detached, on the device
            with in_step:
                log.on_step_end(state)
        with at_end:
            log.on_epoch_end(state)
    got = getattr(log, "losses", None)
    return {
        "losses": got,
        "floats": isinstance(got, list) and all(type(v) is float for v in got),
        "host reads per step": in_step.n / state.step,
        "at most one host read per epoch end": at_end.n <= len(case.args),
    }


LOSS_LOG = Exercise(
    name="loss_log",
    answer=("LossLog",),
    oracle=_Log,
    run=_run_log,
    timeout_s=30,
    cases=lambda: [Case((5, 2), label="7 steps over 2 epochs"), Case((4, 4, 4, 1), label="13 steps over 4 epochs")],
    hint="keep state.loss of each step: your values must be the ones .item() reads every step",
    passed="the same losses as .item() every step, with no host read inside the steps",
    mistakes=[
        _m(
            "your LossLog reads the loss on the host at every step. Try: in on_step_end only keep the tensor state.loss",
            partial(_Log, "float"),
            when=lambda o: o.got["host reads per step"] > 0,
            mechanism=True,
        ),
        _m(
            "at an epoch's end your LossLog reads the losses one at a time. Try: stack them into one tensor, then read "
            "it",
            partial(_Log, "each"),
            when=lambda o: not o.got["at most one host read per epoch end"],
            mechanism=True,
        ),
        _m(
            "after fit, losses holds something other than floats. Try: turn the tensors into floats at each epoch's end",
            partial(_Log, "tensors"),
            when=lambda o: not o.got["floats"],
        ),
        _m(
            "losses lacks some steps' values. Try: convert the pending losses at every epoch's end, not only the first",
            partial(_Log, "first"),
            when=lambda o: len(o.got["losses"]) < sum(o.case.args),
        ),
        _m(
            "losses holds some steps' values more than once. Try: empty the pending list at every epoch's end, and "
            "make both lists in __init__, on self",
            partial(_Log, "kept"),
            when=lambda o: len(o.got["losses"]) > sum(o.case.args),
        ),
    ],
)


class _Std(nn.Module):
    """The oracle Standardize (``kind`` None: the statistics computed once, kept in buffers), and its slips."""

    def __init__(self, reference, eps=1e-5, kind=None):
        super().__init__()
        std, mean = torch.std_mean(reference, dim=0, correction=0 if kind == "biased" else 1)
        for name, value in zip(("mean", "std") if kind == "swapped" else ("std", "mean"), (std, mean)):
            if kind in ("attributes", "batch", "parameters"):
                setattr(self, name, nn.Parameter(value) if kind == "parameters" else value)
            else:
                self.register_buffer(name, value)
        self.eps, self.kind, self.reference = 0.0 if kind == "no_eps" else eps, kind, reference if kind else None

    def forward(self, x):
        source = {"batch": x, "every_call": self.reference}.get(self.kind)
        std, mean = (self.std, self.mean) if source is None else torch.std_mean(source, dim=0)
        return x.sub_(mean).div_(std + self.eps) if self.kind == "in_place" else (x - mean) / (std + self.eps)


def _run_std(cls, case):
    """``cls(reference)`` on a batch: its output, whether the call read the whole reference, whether it has buffers."""
    n, shape, eps = case.args
    g, w = torch.Generator().manual_seed(n), shape[-1]
    ref = torch.randn(n, *shape, generator=g) * torch.linspace(0.5, 3.0, w) + torch.linspace(1, -2, w)
    ref.view(n, -1)[:, 0] = 0.7  # a constant feature: its std is 0, as for the digits' corner pixels
    mod, ops, x = cls(ref, **({"eps": eps} if eps else {})), _Ops(), torch.randn(7, *shape, generator=g)
    with ops:
        out = mod(given := x.clone())
    return {
        "output": out,
        "reads the whole reference per call": any(s[:1] == (n,) for _, s in getattr(ops, "seen", [])),
        # the statistics (in one buffer or two), not the reference
        "statistics in buffers": any(b.shape != ref.shape for b in mod.buffers()),
        "statistics are parameters": bool(list(mod.parameters())),
        "input kept": torch.equal(given, x),
    }


_std_like = lambda kind: (
    lambda o: difference(o.got["output"], _run_std(partial(_Std, kind=kind), o.case)["output"]) is None
)
STANDARDIZE = Exercise(
    name="standardize",
    answer=("Standardize",),
    oracle=_Std,
    run=_run_std,
    timeout_s=30,
    cases=lambda: [
        Case((41, (2, 3), 0), label="a reference of 41 rows of 2 x 3 features"),
        Case((29, (5,), 1e-3), label="a reference of 29 rows of 5 features, eps 1e-3"),
    ],
    hint="subtract the reference's mean and divide by its std plus eps, per feature (statistics over dim 0)",
    passed="the original's outputs, statistics in buffers, and no pass over the reference per call",
    mistakes=[
        _m(
            "each call still reads the whole reference. Try: compute the statistics once, in __init__",
            partial(_Std, kind="every_call"),
            when=lambda o: o.got["reads the whole reference per call"],
            mechanism=True,
        ),
        _m(
            "some outputs are inf or nan, where a feature is constant (std 0). Try: add eps to the std before dividing",
            partial(_Std, kind="no_eps"),
            when=lambda o: not o.got["output"].isfinite().all(),
        ),
        _m(
            "you swapped the mean and the std. Try: torch.std_mean returns (std, mean), in that order",
            partial(_Std, kind="swapped"),
            when=_std_like("swapped"),
        ),
        _m(
            "you standardised with the batch's own statistics. Try: use the reference's, over its dim 0",
            partial(_Std, kind="batch"),
            when=_std_like("batch"),
        ),
        _m(
            "your std is the biased one (divides by N). Try: use torch.std_mean's default, which divides by N - 1",
            partial(_Std, kind="biased"),
            when=_std_like("biased"),
        ),
        _m(
            "your forward changed its input in place, so the caller's batch changed too. Try: compute a new tensor, "
            "with no sub_, div_, -= or /= on x",
            partial(_Std, kind="in_place"),
            when=lambda o: not o.got["input kept"],
        ),
        _m(
            "the statistics are nn.Parameters, which an optimizer would train with the weights. Try: register them as "
            "buffers",
            partial(_Std, kind="parameters"),
            when=lambda o: o.got["statistics are parameters"],
        ),
        _m(
            "the statistics are not buffers, so model.to(device) would leave them behind. Try: register them as buffers",
            partial(_Std, kind="attributes"),
            when=lambda o: not o.got["statistics in buffers"],
        ),
    ],
)
check_self_times = SELF_TIMES.checker("``self_times(events)``: {op name: self time in microseconds} of host events.")
check_data_wait_fraction = DATA_WAIT_FRACTION.checker("``data_wait_fraction(events)``: the steps' share spent waiting.")
check_syncs_per_step = SYNCS_PER_STEP.checker("``syncs_per_step(events)``: host syncs per recorded step.")
check_fixed_loader = FIXED_LOADER.checker("``fixed_loader(dataset, batch_size, device, seed)``: the planted order.")
check_loss_log = LOSS_LOG.checker("``LossLog``: a fit callback keeping every step's loss, without a sync per step.")
check_standardize = STANDARDIZE.checker("``Standardize(reference, eps=1e-5)``: the original's outputs, its stats once.")

__all__ = [name for name in dir() if name.startswith("check_")]
