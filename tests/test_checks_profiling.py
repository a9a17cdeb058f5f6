"""Lab 6's self-checks (utils/checks/profiling.py) and its planted run (utils.profiling).

* The solution notebook's own answers pass every check (they are read from the notebook, so the
  notebook and the tests cannot drift apart); the lab's placeholder fails with "not implemented".
* Each typical mistake, written out by hand below, fails with ONE line that names it.
* The planted run's costs are real and known: the standardisation passes over the whole reference
  every call (the profiler's input shapes are the oracle), the logger syncs once per step, the
  loader reads every image one at a time.
* The lab asks for its hints in three tiers and a prediction before measuring (as
  tests/test_authoring.py does for the other labs), and its sizes are sound in every profile.
"""

from __future__ import annotations

import importlib.util
import re
import time
from collections import defaultdict
from pathlib import Path

import nbformat
import pytest
import torch
from torch import nn

from utils import checks, config, data, profiling
from utils.authoring import BEGIN, END
from utils.train import Callback

ROOT = Path(__file__).resolve().parents[1]
LAB = "lab6_profiling"


def _authoring_tests():
    """tests/test_authoring.py, loaded by its path (whatever pytest's import mode): its checks of a
    lab's hints and prediction, applied to lab 6 below."""
    spec = importlib.util.spec_from_file_location("_lab6_authoring_tests", ROOT / "tests" / "test_authoring.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _exercises(folder: str) -> dict:
    """The exercise cells of FOLDER/lab6_profiling.ipynb, run as they are: the answers in solutions/,
    the placeholders in labs/."""
    ns = {}
    exec(
        "from collections import defaultdict\nimport torch\nfrom torch import nn\n"
        "from utils import data, profiling\nfrom utils.train import Callback\n",
        ns,
    )
    for cell in nbformat.read(ROOT / folder / f"{LAB}.ipynb", 4).cells:
        if cell.cell_type == "code" and (
            (BEGIN in cell.source and END in cell.source) or "raise NotImplementedError(" in cell.source
        ):
            exec(cell.source, ns)
    return ns


SOL = _exercises("solutions")
EXERCISES = [
    (checks.check_self_times, "self_times"),
    (checks.check_data_wait_fraction, "data_wait_fraction"),
    (checks.check_syncs_per_step, "syncs_per_step"),
    (checks.check_fixed_loader, "fixed_loader"),
    (checks.check_loss_log, "LossLog"),
    (checks.check_standardize, "Standardize"),
]


@pytest.mark.parametrize("check,name", EXERCISES, ids=[n for _, n in EXERCISES])
def test_the_solution_passes(check, name, capsys):
    check(SOL[name])
    assert "\u2714" in capsys.readouterr().out


@pytest.mark.parametrize("check,name", EXERCISES, ids=[n for _, n in EXERCISES])
def test_the_labs_untouched_exercise_says_not_implemented(check, name):
    lab = _exercises("labs")
    with pytest.raises(checks.CheckFailed, match="not implemented yet.*NotImplementedError"):
        check(lab[name])


def placeholder(*args, **kwargs):
    raise NotImplementedError("Exercise: write this part (see the hint above)")


class PlaceholderLog(Callback):
    def __init__(self):
        placeholder()


class PlaceholderModule(nn.Module):
    def __init__(self, reference, eps=1e-5):
        super().__init__()
        placeholder()


@pytest.mark.parametrize(
    "check,stub",
    [(c, placeholder) for c, _ in EXERCISES[:4]]
    + [(checks.check_loss_log, PlaceholderLog), (checks.check_standardize, PlaceholderModule)],
    ids=[n for _, n in EXERCISES],
)
def test_the_placeholder_says_not_implemented(check, stub):
    with pytest.raises(checks.CheckFailed, match="not implemented yet.*NotImplementedError"):
        check(stub)


# ------------------------------------------------------------------ hand-written mistakes


def self_times_total_durations(events):
    out = defaultdict(float)
    for e in events:
        if e.get("cat") in profiling.HOST_EVENT_CATS:
            out[e["name"]] += e["dur"]
    return dict(out)


def _nested(events, *, per_lane=True, host_only=True, direct=True):
    lanes = defaultdict(list)
    for e in events:
        if not host_only or e.get("cat") in profiling.HOST_EVENT_CATS:
            lanes[(e["pid"], e["tid"]) if per_lane else 0].append(e)
    out = defaultdict(float)
    for lane in lanes.values():
        lane.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in lane:
            while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
                stack.pop()
            out[e["name"]] += e["dur"]
            for parent in stack[-1:] if direct else stack:
                out[parent["name"]] -= e["dur"]
            stack.append(e)
    return dict(out)


def self_times_ties_in_list_order(events):
    """Sorted by start only: of two events starting together, the one listed first opens first."""
    lanes = defaultdict(list)
    for e in events:
        if e.get("cat") in profiling.HOST_EVENT_CATS:
            lanes[(e["pid"], e["tid"])].append(e)
    out = defaultdict(float)
    for lane in lanes.values():
        lane.sort(key=lambda e: e["ts"])
        stack = []
        for e in lane:
            while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
                stack.pop()
            out[e["name"]] += e["dur"]
            if stack:
                out[stack[-1]["name"]] -= e["dur"]
            stack.append(e)
    return dict(out)


def self_times_all_ancestors(events):
    return _nested(events, direct=False)


def self_times_one_lane(events):
    return _nested(events, per_lane=False)


def self_times_with_kernels(events):
    return _nested(events, host_only=False)


def _steps(events):
    return [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith("ProfilerStep#")]


def _inside(events, steps):
    return [e for e in events if any(a <= e["ts"] < b for a, b in steps)]


def wait_percent(events):
    steps = _steps(events)
    return (
        100 * sum(e["dur"] for e in _inside(events, steps) if e["name"] == "phase:data") / sum(b - a for a, b in steps)
    )


def wait_counts_the_loader_too(events):
    steps = _steps(events)
    hits = [e for e in _inside(events, steps) if e["name"] == "phase:data" or e["name"].startswith("enumerate(")]
    return sum(e["dur"] for e in hits) / sum(b - a for a, b in steps)


def wait_outside_steps(events):
    steps = _steps(events)
    return sum(e["dur"] for e in events if e["name"] == "phase:data") / sum(b - a for a, b in steps)


def wait_over_trace_span(events):
    steps = _steps(events)
    span = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    return sum(e["dur"] for e in _inside(events, steps) if e["name"] == "phase:data") / span


def wait_from_the_library(events):
    t = profiling.phase_times(events)
    return t["data"] / t["step"]


def syncs_item_too(events):
    steps = _steps(events)
    hits = [e for e in _inside(events, steps) if e["name"] in ("aten::item", "aten::_local_scalar_dense")]
    return len(hits) / len(steps)


def syncs_counts_item(events):
    return sum(e["name"] == "aten::item" for e in _inside(events, _steps(events))) / len(_steps(events))


def syncs_outside_steps(events):
    return sum(e["name"] == "aten::_local_scalar_dense" for e in events) / len(_steps(events))


def syncs_total(events):
    return float(sum(e["name"] == "aten::_local_scalar_dense" for e in _inside(events, _steps(events))))


def loader_with_dataloader(dataset, batch_size, device, seed):
    return data.make_loader(dataset, batch_size, kind="dataloader", seed=seed)


def loader_with_workers(dataset, batch_size, device, seed):
    return torch.utils.data.DataLoader(dataset, batch_size, shuffle=True, num_workers=2)


def loader_unshuffled(dataset, batch_size, device, seed):
    return data.make_loader(dataset, batch_size, kind="device", device=device, shuffle=False)


def loader_ignores_seed(dataset, batch_size, device, seed):
    return data.make_loader(dataset, batch_size, kind="device", device=device)


def loader_same_order_every_epoch(dataset, batch_size, device, seed):
    return list(data.make_loader(dataset, batch_size, kind="device", device=device, seed=seed))


class LogWithFloat(Callback):
    def __init__(self):
        self.losses = []

    def on_step_end(self, state):
        self.losses.append(float(state.loss))


class LogKeepsTensors(Callback):
    def __init__(self):
        self.losses = []

    def on_step_end(self, state):
        self.losses.append(state.loss)


class LogFloatEachAtEpochEnd(Callback):
    def __init__(self):
        self.losses, self.pending = [], []

    def on_step_end(self, state):
        self.pending.append(state.loss)

    def on_epoch_end(self, state):
        self.losses += [float(t) for t in self.pending]
        self.pending = []


class LogFirstEpochOnly(Callback):
    def __init__(self):
        self.losses, self.pending, self.done = [], [], False

    def on_step_end(self, state):
        self.pending.append(state.loss)

    def on_epoch_end(self, state):
        if not self.done:
            self.losses += torch.stack(self.pending).tolist()
            self.done = True


class StandardizeBatch(nn.Module):
    def __init__(self, reference, eps=1e-5):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return (x - x.mean(0)) / (x.std(0) + self.eps)


class StandardizeBiased(nn.Module):
    def __init__(self, reference, eps=1e-5):
        super().__init__()
        std, mean = torch.std_mean(reference, dim=0, correction=0)
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)
        self.eps = eps

    def forward(self, x):
        return (x - self.mean) / (self.std + self.eps)


class StandardizeNoEps(nn.Module):
    def __init__(self, reference, eps=1e-5):
        super().__init__()
        std, mean = torch.std_mean(reference, dim=0)
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)

    def forward(self, x):
        return (x - self.mean) / self.std


class StandardizeAttributes(nn.Module):
    def __init__(self, reference, eps=1e-5):
        super().__init__()
        self.std, self.mean = torch.std_mean(reference, dim=0)
        self.eps = eps

    def forward(self, x):
        return (x - self.mean) / (self.std + self.eps)


class StandardizeSwapped(nn.Module):
    def __init__(self, reference, eps=1e-5):
        super().__init__()
        mean, std = torch.std_mean(reference, dim=0)
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)
        self.eps = eps

    def forward(self, x):
        return (x - self.mean) / (self.std + self.eps)


class StandardizeKeepsReference(nn.Module):
    def __init__(self, reference, eps=1e-5):
        super().__init__()
        self.reference, self.eps = reference, eps

    def forward(self, x):
        std, mean = torch.std_mean(self.reference, dim=0)
        return (x - mean) / (std + self.eps)


class StandardizeStillEveryCall(nn.Module):
    def __init__(self, reference, eps=1e-5):
        super().__init__()
        self.register_buffer("reference", reference.clone())
        self.eps = eps

    def forward(self, x):
        std, mean = torch.std_mean(self.reference, dim=0)
        return (x - mean) / (std + self.eps)


CASES = [
    (checks.check_self_times, self_times_total_durations, "whole duration"),
    (checks.check_self_times, self_times_all_ancestors, "DIRECT children"),
    (checks.check_self_times, self_times_ties_in_list_order, "order ties longest first"),
    (checks.check_self_times, self_times_one_lane, "another thread"),
    (checks.check_self_times, self_times_with_kernels, "GPU kernel"),
    (checks.check_data_wait_fraction, wait_percent, "a percentage"),
    (checks.check_data_wait_fraction, wait_counts_the_loader_too, "counted again"),
    (checks.check_data_wait_fraction, wait_outside_steps, "before the first recorded step"),
    (checks.check_data_wait_fraction, wait_over_trace_span, "whole span"),
    (checks.check_data_wait_fraction, wait_from_the_library, "called utils.profiling.s own phase_times"),
    (checks.check_syncs_per_step, syncs_item_too, "aten::item was counted"),
    (checks.check_syncs_per_step, syncs_counts_item, "you counted aten::item.*once per sync"),
    (checks.check_syncs_per_step, syncs_outside_steps, "after the last step"),
    (checks.check_syncs_per_step, syncs_total, "a total"),
    (checks.check_fixed_loader, loader_with_dataloader, "one at a time"),
    (checks.check_fixed_loader, loader_with_workers, "worker processes.*keep the data resident"),
    (checks.check_fixed_loader, loader_unshuffled, "dataset's order"),
    (checks.check_fixed_loader, loader_ignores_seed, "differ from the original"),
    (checks.check_fixed_loader, loader_same_order_every_epoch, "epoch 1"),
    (checks.check_loss_log, LogWithFloat, "host per step"),
    (checks.check_loss_log, LogKeepsTensors, "not floats"),
    (checks.check_loss_log, LogFirstEpochOnly, "every epoch's end"),
    (checks.check_loss_log, LogFloatEachAtEpochEnd, "one at a time.*epoch ends"),
    (checks.check_standardize, StandardizeBatch, "batch's own statistics"),
    (checks.check_standardize, StandardizeBiased, "biased"),
    (checks.check_standardize, StandardizeNoEps, "inf or nan"),
    (checks.check_standardize, StandardizeAttributes, "not buffers"),
    (checks.check_standardize, StandardizeStillEveryCall, "whole reference"),
    (checks.check_standardize, StandardizeSwapped, r"order \(std, mean\)"),
    (checks.check_standardize, StandardizeKeepsReference, "whole reference"),
]


@pytest.mark.parametrize("check,wrong,expected", CASES, ids=[c[1].__name__ for c in CASES])
def test_a_typical_mistake_is_named_in_one_line(check, wrong, expected):
    with pytest.raises(checks.CheckFailed) as info:
        check(wrong)
    msg = str(info.value)
    assert "\n" not in msg and ". Try: " in msg, msg
    assert re.search(expected, msg), msg


# ------------------------------------------------------------------ the planted run


def test_the_planted_standardisation_reads_the_whole_reference_every_call():
    ref = torch.randn(37, 4)
    mod = profiling.StandardizeEveryStep(ref)
    x = torch.randn(5, 4)
    std, mean = torch.std_mean(ref, dim=0)
    assert torch.allclose(mod(x), (x - mean) / (std + 1e-5))  # the closed form
    with torch.profiler.profile(record_shapes=True) as prof:
        for _ in range(3):
            mod(x)
    calls = [e for e in prof.events() if e.name == "aten::std_mean" and [37, 4] in e.input_shapes]
    assert len({e.id for e in calls}) >= 3  # once per call, on all 37 rows


def test_the_planted_logger_syncs_once_per_step_and_the_loader_costs_its_floor(tmp_path):
    ds = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 10, (64,)))
    cost, B = 2e-3, 8
    loader = profiling.planted_loader(ds, B, cost, seed=0)
    assert isinstance(loader, torch.utils.data.DataLoader) and loader.num_workers == 0
    t0 = time.perf_counter()
    n = sum(1 for _ in loader)
    assert n == 8 and time.perf_counter() - t0 >= 64 * cost  # busy work per image: a floor
    model = profiling.lab_model(ds.tensors[0], 16, 2)
    log = profiling.LogLossEveryStep()
    _, trace = profiling.profile_fit(
        model,
        profiling.planted_loader(ds, B, 0.0),
        torch.optim.SGD(model.parameters(), lr=0.1),
        tmp_path,
        steps=(1, 1, 3),
        callbacks=[log],
    )
    events = profiling.load_trace(trace)
    assert profiling.count_per_step(events, "aten::_local_scalar_dense") == 1
    assert len(log.losses) == 5 and all(isinstance(v, float) for v in log.losses)


def test_lab_model_is_seeded_and_standardises_first():
    ref = torch.randn(20, 1, 4, 4)
    a, b = profiling.lab_model(ref, 8, 2, seed=3), profiling.lab_model(ref, 8, 2, seed=3)
    assert isinstance(a[0], profiling.StandardizeEveryStep)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert a(torch.randn(3, 1, 4, 4)).shape == (3, 10)


# ------------------------------------------------------------------ the lab's form and sizes


def test_the_lab_has_three_tiers_of_hints_and_a_prediction():
    authoring_tests = _authoring_tests()
    authoring_tests.test_every_exercise_has_three_tiers_of_hints(LAB)
    authoring_tests.test_each_lab_asks_for_a_prediction_before_measuring(LAB)
    assert not authoring_tests.leaked_lines(ROOT / "solutions" / f"{LAB}.ipynb")


@pytest.mark.parametrize("name", config.PROFILE_NAMES)
def test_the_lab_sizes_fit_every_profile(name):
    cfg = config.profile(name)
    wait, warmup, active = cfg.lab6_prof_steps
    per_epoch = cfg.lab6_n_train // cfg.lab6_batch_size
    assert per_epoch >= wait + warmup + active, "an epoch's end (a sync) would fall inside the recorded steps"
    assert per_epoch >= cfg.lab6_timing_steps
    assert cfg.lab6_batch_size > 20  # the fixed loader's few ops per batch stay below B / 2
    assert cfg.lab6_item_cost_s * cfg.lab6_batch_size >= 2e-3  # the planted wait is milliseconds per batch
    if cfg.dataset == "digits":
        splits = data.load("digits", cfg.lab6_n_train, cfg.n_val)
        assert len(splits.train) == cfg.lab6_n_train
