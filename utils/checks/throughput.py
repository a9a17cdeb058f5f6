"""Lab 2's exercises (solutions/lab2_throughput.ipynb): predicting memory, timing a step, finding the
input-pipeline bottleneck. Time runs on a simulated clock, so every case has one exact answer."""

import contextlib
import statistics
import threading
import time
import timeit
from functools import partial

import torch

from .. import models
from .engine import Case, Exercise, difference, patched
from .engine import mistake as _m

__all__ = ["check_state_bytes", "check_time_step", "check_wait_fraction", "STATE_BYTES", "TIME_STEP", "WAIT_FRACTION"]
LAB = "lab2_throughput"
_STATE_CASES = [
    ("adam", 0.0, torch.float32, False, "Adam"),
    ("sgd", 0.9, torch.float32, False, "SGD, momentum 0.9"),
    ("sgd", 0.0, torch.float32, False, "plain SGD (momentum 0)"),
    ("adam", 0.0, torch.bfloat16, False, "Adam, in bfloat16"),
    ("adam", 0.0, torch.float32, True, "Adam, its first layer frozen"),
]
_MEMORY = (
    "parameter_bytes grad_bytes optimizer_state_bytes counted_state_bytes predict_memory _state_multiplier _nbytes"
)


def _run_state(answer, case: Case):
    torch.manual_seed(0)
    model = models.mlp(20, 2, in_features=10, out_features=3).to(case.kwargs["dtype"])  # Linear(10, 20), Linear(20, 3)
    model[0].requires_grad_(not case.kwargs["frozen"])
    got, keys = answer(model, *case.args), ("params", "grads", "optimizer_state")
    return {k: got[k] for k in keys} if isinstance(got, dict) and set(keys) <= set(got) else got


def _counted(model, optimizer, momentum=0.0):
    """The oracle: the bytes a real optimizer holds after one step."""
    from ..memory import counted_state_bytes, grad_bytes, parameter_bytes

    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=0.1, momentum=momentum) if optimizer == "sgd" else torch.optim.Adam(trainable)
    model(torch.randn(2, 10, dtype=trainable[0].dtype)).float().pow(2).mean().backward()
    opt.step()
    return {"params": parameter_bytes(model), "grads": grad_bytes(model), "optimizer_state": counted_state_bytes(opt)}


def _bytes(model, optimizer, momentum=0.0, size=lambda p: p.numel() * p.element_size(), every=False, adam=2, sgd=None):
    """state_bytes with a slip (``size`` of a tensor, ``every`` parameter trainable, copies of state kept)."""
    grads = sum(size(p) for p in model.parameters() if every or p.requires_grad)
    copies = adam if optimizer == "adam" else (1 if momentum else 0) if sgd is None else sgd
    return {"params": sum(size(p) for p in model.parameters()), "grads": grads, "optimizer_state": copies * grads}


STATE_BYTES = Exercise(
    name="state_bytes",
    oracle=_counted,
    run=_run_state,
    cases=lambda: [
        Case((o, m), {"dtype": d, "frozen": f}, f"a model trained with {w}") for o, m, d, f, w in _STATE_CASES
    ],
    hint="params: the sum of p.numel() * p.element_size(); grads: the same over trainable parameters; optimizer state: "
    "twice that for Adam, once for SGD with momentum, zero without",
    passed="byte for byte what a real optimizer holds, for 5 models and optimizers",
    refuse=tuple(f"utils.memory.{f}" for f in _MEMORY.split()),
    mistakes=[
        _m(
            "it does not return a dict with the keys params, grads and optimizer_state. Try: return such a dict of "
            "numbers of bytes",
            lambda *a: tuple(_bytes(*a).values()),
            when=lambda o: not (o.error or o.hung) and (type(o.got) is not dict or set(o.got) != set(o.want)),
        ),
        _m(
            "it returns the number of elements, not bytes. Try: multiply each tensor's numel() by its element_size()",
            partial(_bytes, size=lambda p: p.numel()),
        ),
        _m(
            "it assumes 4 bytes per number, twice what a bfloat16 model holds. Try: use p.element_size()",
            partial(_bytes, size=lambda p: 4 * p.numel()),
        ),
        _m(
            "Adam's state is counted once. Try: Adam keeps TWO tensors per parameter: exp_avg and exp_avg_sq",
            partial(_bytes, adam=1),
        ),
        _m(
            "plain SGD (momentum 0) is given optimizer state. Try: only momentum makes a buffer per parameter",
            partial(_bytes, sgd=1),
        ),
        _m(
            "SGD with momentum is given no optimizer state. Try: momentum keeps one buffer the size of each parameter",
            partial(_bytes, sgd=0),
        ),
        _m(
            "frozen parameters are given gradients and optimizer state. Try: count those only for parameters with "
            "p.requires_grad",
            partial(_bytes, every=True),
        ),
    ],
)
check_state_bytes = STATE_BYTES.checker("``state_bytes(model, optimizer, momentum=0.0)``: a dict of bytes.")


class _Machine:
    """A host clock ``now`` (``reads``: how often the answer read it); ``step()`` queues ``work[i]`` s on a device
    (its launch costs the host 1 ms), ``sync()`` waits for it; iterated, a loader whose batch i comes ``loads[i]`` s
    after it is asked for, as (x, y) with y = [i, i] and x of other values."""

    def __init__(self, work=(0.0,), loads=()):
        self.now = self.free = 0.0
        self.work, self.loads, self.steps, self.reads = list(work), list(loads), 0, 0

    def step(self):
        self.now += 1e-3
        self.free = max(self.free, self.now) + self.work[min(self.steps, len(self.work) - 1)]
        self.steps += 1

    def sync(self):
        self.now = max(self.now, self.free)

    def __iter__(self):
        for i, load in enumerate(self.loads):
            self.now += load
            yield torch.full((2, 1), -1.0 - i), torch.tensor([i, i])

    def __len__(self):
        return len(self.loads)


def _clock(machine: _Machine, answer) -> contextlib.AbstractContextManager:
    """While the answer runs, time's wall clocks, under any name (``perf_counter`` imported, timeit's default_timer,
    a default argument), read ``machine.now`` in this thread; other threads read the real ones."""
    me = threading.get_ident()
    names = ("perf_counter", "monotonic", "time", "perf_counter_ns", "monotonic_ns", "time_ns")

    def fake(real, ns):
        def read():
            if threading.get_ident() != me:
                return real()
            machine.reads += 1
            return int(machine.now * 1e9) if ns else machine.now

        return read

    fakes = {id(getattr(time, n)): fake(getattr(time, n), n.endswith("_ns")) for n in names}
    scopes = [vars(time), vars(timeit), getattr(answer, "__globals__", {})]
    patches = [(scope, k, fakes[id(v)]) for scope in scopes for k, v in list(scope.items()) if id(v) in fakes]
    patches += [
        (f, "__defaults__", tuple(fakes.get(id(d), d) for d in f.__defaults__))
        for f in (answer, timeit.Timer.__init__, timeit.timeit, timeit.repeat)
        if getattr(f, "__defaults__", None)
    ]
    return patched(patches)


def _compare(got, want):  # (result, what step() saw) against the oracle's: the calls first, then the number
    said = [f"{t} times" if isinstance(t, int) else f"on batches {t[:12]}" for t in (got[1], want[1])]
    return f"called step() {said[0]}, not {said[1]}" if got[1] != want[1] else difference(got[0], want[0], 1e-3, 1e-9)


def _timer(
    step, sync, warmup=3, repeats=5, pick=statistics.median, warm="untimed", synced=True, late=False, clock=None
):
    """The oracle, and its slips: ``warm`` calls "skipped" or "timed", no sync if not ``synced``, another ``pick``,
    the clock started after step() (``late``), another ``clock``."""
    clock = clock or time.perf_counter
    for _ in range(warmup if warm == "untimed" else 0):
        step()
    sync()
    times = []
    for _ in range(repeats + (warmup if warm == "timed" else 0)):
        sync() if synced else None
        t0 = None if late else clock()
        step()
        t0 = clock() if late else t0
        sync() if synced else None
        times.append(clock() - t0)
    return pick(times)


def _read_clock(machine, got):
    """``got``, unless the answer stepped without reading a clock that ``machine`` follows."""
    if machine.reads == 0:
        raise RuntimeError("the answer read no clock that the check follows")
    return got


def _run_timer(answer, case: Case):
    machine = _Machine([case.args[1]] * case.args[0] + case.args[2])  # warm-up calls are slow, then the repeats
    with _clock(machine, answer):
        got = answer(machine.step, machine.sync, case.args[0], len(case.args[2]))
    return _read_clock(machine, got), machine.steps


_OTHER_CLOCK = (
    "your timer reads a clock that the check's simulated GPU does not drive (CPU time such as time.process_time, or "
    "datetime). Try: time with the wall clock time.perf_counter, read at the start and end of each timed piece"
)


TIME_STEP = Exercise(
    name="time_step",
    oracle=_timer,
    run=_run_timer,
    compare=_compare,
    refuse=("utils.bench.time_fn",),
    timeout_s=10,
    cases=lambda: [
        Case((3, 0.15, [0.021, 0.019, 0.3, 0.020, 0.022]), label="5 repeats after 3 slow calls"),
        Case((2, 0.09, [0.052, 0.2, 0.049, 0.25, 0.05, 0.048, 0.051]), label="7 repeats after 2 slow calls"),
    ],
    hint="make `warmup` untimed calls, then time each repeat on its own with sync() before starting and before "
    "stopping the clock, and return the median of those times in seconds",
    passed="on a simulated GPU with slow first calls and outliers, for two step lengths",
    mistakes=[
        _m(
            "it returns something other than one number of seconds. Try: return the median of the per-repeat times",
            partial(_timer, pick=list),
            when=lambda o: not isinstance(o.got[0], (int, float, torch.Tensor)),
        ),
        _m(_OTHER_CLOCK, partial(_timer, clock=time.process_time), when=lambda o: "read no clock" in o.error),
        _m(
            "step() was called only `repeats` times, as if the warm-up calls were left out. Try: run `warmup` untimed "
            "calls first, then `repeats` timed ones",
            partial(_timer, warm="skipped"),
            when=lambda o: o.got[1] == o.want[1] - o.case.args[0],
        ),
        _m(
            "it measured far less than the work each step queues. Try: the step only QUEUES work, as on a GPU: call "
            "sync() before reading the clock at the end of each timed repeat (and before starting it)",
            partial(_timer, synced=False),
            when=lambda o: o.got[0] < o.want[0] / 4,
        ),
        _m(
            "the clock starts after step() returns, so it misses what step() itself costs the host. Try: read the "
            "clock before calling step(), right after a sync()",
            partial(_timer, late=True),
        ),
        _m(
            "it returns milliseconds. Try: return seconds, the difference of two perf_counter readings",
            partial(_timer, pick=lambda t: 1e3 * statistics.median(t)),
        ),
        _m(
            "the slow warm-up calls were timed with the repeats. Try: keep the `warmup` calls out of the times",
            partial(_timer, warm="timed"),
        ),
        _m(
            "one slow repeat pulled the result up, as it does a mean. Try: report the MEDIAN of the repeats "
            "(statistics.median), not the mean or the total / repeats",
            partial(_timer, pick=statistics.mean),
        ),
        _m(
            "it returns the middle repeat in the order they ran. Try: sort the times first, or use statistics.median",
            partial(_timer, pick=lambda t: t[len(t) // 2]),
        ),
    ],
)
check_time_step = TIME_STEP.checker("``time_step(step, sync, warmup, repeats)``: the median seconds of one step().")


def _fraction(loader, step, out=lambda wait, total: wait / total, fresh=False, warm=False, clock=None):
    """The oracle, and its slips: another ``out``, a ``fresh`` iterator per batch, a ``warm``-up step, another
    ``clock``."""
    clock = clock or time.perf_counter
    waited, start, it = 0.0, clock(), iter(loader)
    step(next(iter(loader))) if warm else None
    while True:
        t0 = clock()
        try:
            batch = next(iter(loader) if fresh else it)  # a fresh iterator gives batch 0 for ever
        except StopIteration:
            return out(waited, clock() - start)
        waited += clock() - t0
        step(batch)


def _run_pass(answer, case: Case):
    machine, stepped = _Machine(loads=case.args[0]), []

    def step(batch):
        stepped.append(int(batch[1][0]))
        machine.now += case.args[1]

    with _clock(machine, answer):
        got = answer(machine, step)
    return _read_clock(machine, got), stepped


WAIT_FRACTION = Exercise(
    name="wait_fraction",
    oracle=_fraction,
    run=_run_pass,
    compare=_compare,
    refuse=("utils.bench.TimedLoader",),
    timeout_s=5,
    passed="on a data-bound and a compute-bound pipeline",
    cases=lambda: [
        Case(([0.03] * 5, 0.01), label="5 batches that load slower than they step"),
        Case(([0.05] + [0.01] * 6, 0.04), label="7 batches that step slower than they load"),
    ],
    hint="time only each request for the next batch (an explicit iterator over the loader), add those times up, and "
    "divide by the time of the whole pass",
    mistakes=[
        _m(
            "the pass never ends, as when a new iterator is made for every batch. Try: make one iterator over the "
            "loader before the loop and ask it for each next batch",
            partial(_fraction, fresh=True),
            when=lambda o: o.hung,
            replay=False,
        ),
        _m(
            "it returns something other than one fraction. Try: divide the waiting time by the whole pass's time",
            partial(_fraction, out=lambda w, t: (w, t)),
            when=lambda o: not isinstance(o.got[0], (int, float, torch.Tensor)),
        ),
        _m(_OTHER_CLOCK, partial(_fraction, clock=time.process_time), when=lambda o: "read no clock" in o.error),
        _m(
            "step() did not see each batch exactly once, in order. Try: call step(batch) with the whole batch the "
            "loader gave, once on each batch of one pass, and on nothing else",
            partial(_fraction, warm=True),
            when=lambda o: o.got[1] != o.want[1],
        ),
        _m(
            "it returns a percentage. Try: return a fraction between 0 and 1",
            partial(_fraction, out=lambda w, t: 100 * w / t),
        ),
        _m(
            "it divides the waiting time by the stepping time. Try: divide by the TOTAL time (waiting + stepping)",
            partial(_fraction, out=lambda w, t: w / (t - w)),
        ),
        _m(
            "it returns the share spent in step(). Try: time only the wait for the next batch: next(iterator), not the "
            "step",
            partial(_fraction, out=lambda w, t: 1 - w / t),
        ),
    ],
)
check_wait_fraction = WAIT_FRACTION.checker("``wait_fraction(loader, step)``: the share of a pass waiting for data.")
