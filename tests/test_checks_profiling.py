"""Lab 6's exercises on the engine (utils/checks/profiling.py) and its planted run (utils.profiling).

* The solution notebook's answers pass, each named mistake's variant is named, the placeholder is not implemented
  (tests/exercise_harness.py).
* What the harness cannot say: the checks' oracles agree with references from outside them (hand counts,
  torch.profiler's key_averages(), the planted loader's known cost, the planted originals' batches, losses and
  outputs), and the library's own trace readers are refused.
* The planted run's costs are real and known: the standardisation passes over the whole reference every call (the
  profiler's input shapes are the oracle), the logger syncs once per step, the loader reads every image one at a time.
* The lab asks for its hints in three tiers and a prediction before measuring, and its sizes are sound in every profile.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import exercise_harness as harness
import pytest
import torch

from utils import config, data, profiling
from utils.checks import CheckFailed, engine
from utils.checks import profiling as spec

ROOT = Path(__file__).resolve().parents[1]
LAB = "lab6_profiling"
EXERCISES = [ex for ex in engine.REGISTRY.values() if ex.module == spec.__name__]
test_solution, test_mistake, test_placeholder = harness.tests_for(LAB, EXERCISES)


def _authoring_tests():
    """tests/test_authoring.py, loaded by its path (whatever pytest's import mode): its checks of a
    lab's hints and prediction, applied to lab 6 below."""
    module_spec = importlib.util.spec_from_file_location("_lab6_authoring_tests", ROOT / "tests" / "test_authoring.py")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------ the oracles, against references from outside


def test_the_trace_oracles_give_the_hand_counted_answers():
    want = {"A": 60, "B": 20, "C": 20, "D": 60, "G": 30, "H": 20, "E": 20, "F": 20, "P": 50}
    assert spec._self_times(spec._trace(spec._NESTING)) == want
    assert spec._wait(spec._trace(spec._WAITS)) == pytest.approx((3000 + 5000) / 30000)  # steps of 10 and 20 ms
    assert spec._syncs(spec._trace(spec._SYNCS)) == pytest.approx(7 / 3)  # 2, 3 and 2 syncs in 3 steps


def test_the_self_time_oracle_matches_key_averages_on_a_real_trace(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    ds = torch.utils.data.TensorDataset(torch.randn(96, 32), torch.randint(0, 10, (96,)))
    prof, trace = profiling.profile_fit(
        model, torch.utils.data.DataLoader(ds, batch_size=16), torch.optim.SGD(model.parameters(), lr=0.05), tmp_path
    )
    events = profiling.load_trace(trace)
    mine, host = spec._self_times(events), {e["name"] for e in events if e.get("cat") in profiling.HOST_EVENT_CATS}
    compared = 0
    for k in prof.key_averages():
        if k.key in host and not k.key.startswith("ProfilerStep") and k.self_cpu_time_total >= 20:
            assert mine[k.key] == pytest.approx(k.self_cpu_time_total, rel=0.02, abs=2), k.key
            compared += 1
    assert compared >= 5


def test_the_real_traces_hold_their_known_costs():
    slow = spec._fit_trace("slow")
    steps = profiling.profiler_steps(slow)
    floor = 16 * 2e-3 * 1e6 * len(steps) / sum(s["dur"] for s in steps)  # 16 images of 2 ms per step
    assert 0.9 * floor <= spec._wait(slow) <= 1.0
    lib = profiling.phase_times(slow)
    assert spec._wait(slow) == pytest.approx(lib["data"] / lib["step"], abs=0.02)
    assert spec._syncs(spec._fit_trace("plain")) == 0.0 and spec._syncs(spec._fit_trace("item")) == 1.0
    assert profiling.count_per_step(spec._fit_trace("item"), spec.SYNC) == 1.0


def _batches(loader, epochs=2):
    out = []
    for e in range(epochs):
        data.set_epoch(loader, e)
        out.append([(x.clone(), y.clone()) for x, y in loader])
    return out


@pytest.mark.parametrize("n,batch,seed", [c.args for c in spec.FIXED_LOADER.cases()])
def test_the_loader_oracle_serves_the_planted_loaders_batches(n, batch, seed):
    ds = torch.utils.data.TensorDataset(torch.randn(n, 3, 2), torch.arange(n))
    want = _batches(profiling.planted_loader(ds, batch, 0.0, seed=seed))
    got = _batches(spec._loader(ds, batch, "cpu", seed))
    assert len(got[0]) == len(want[0]) and not torch.equal(want[0][0][1], want[1][0][1])
    for a, b in zip(got, want):
        assert all(torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(a, b))


@pytest.mark.parametrize("case", spec.LOSS_LOG.cases(), ids=lambda c: c.label)
def test_the_loss_log_oracle_keeps_the_planted_loggers_losses_without_its_syncs(case):
    planted, fixed = spec._run_log(profiling.LogLossEveryStep, case), spec._run_log(spec._Log, case)
    assert fixed["losses"] == planted["losses"] and len(planted["losses"]) == sum(case.args)
    assert planted["host reads per step"] == 1.0 and fixed["host reads per step"] == 0.0


@pytest.mark.parametrize("case", spec.STANDARDIZE.cases(), ids=lambda c: c.label)
def test_the_standardize_oracle_gives_the_planted_outputs_without_its_pass(case):
    planted, fixed = spec._run_std(profiling.StandardizeEveryStep, case), spec._run_std(spec._Std, case)
    torch.testing.assert_close(fixed["output"], planted["output"])
    assert planted["reads the whole reference per call"] and not fixed["reads the whole reference per call"]


def test_the_library_trace_readers_are_refused():
    def wait_from_the_library(events):
        t = profiling.phase_times(events)
        return t["data"] / t["step"]

    def syncs_from_the_library(events):
        return profiling.count_per_step(events, "aten::_local_scalar_dense")

    with pytest.raises(CheckFailed, match="uses utils.profiling.phase_times, which this exercise asks"):
        engine.check(spec.DATA_WAIT_FRACTION, wait_from_the_library)
    with pytest.raises(CheckFailed, match="uses utils.profiling.count_per_step, which this exercise asks"):
        engine.check(spec.SYNCS_PER_STEP, syncs_from_the_library)


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


def test_host_reads_count_the_tensors_read_once_each_per_block():
    from utils.checks._common import HostReads

    losses, reads = [torch.rand(()) for _ in range(7)], HostReads()
    for read, n in [(lambda: torch.stack(losses).cpu().tolist(), 1), (lambda: torch.tensor(losses), 7),
                    (lambda: [float(t) for t in losses], 7), (lambda: torch.stack(losses), 0)]:  # fmt: skip
        before = reads.n
        with reads:
            read()
        assert reads.n - before == n
