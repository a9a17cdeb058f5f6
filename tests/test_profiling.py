"""utils.profiling: traces are written, parsed and drawn; counts agree with the profiler's own
table; the phases and the DDP bucket mechanism show up as they must."""

import functools
import os

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

from utils import data, models, parallel  # noqa: E402
from utils import profiling as P
from utils.train import Callback  # noqa: E402


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)
    s = data.load("digits", 256, 64)
    return s


def _run(small, tmp_path, name, callbacks=()):
    torch.manual_seed(0)
    model = models.build("net", small.shape, width=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = data.make_loader(small.train, 32, kind="dataloader")
    prof, trace = P.profile_fit(model, loader, opt, tmp_path / name, steps=(1, 1, 3), callbacks=callbacks)
    return prof, trace, P.load_trace(trace)


class ItemEveryStep(Callback):
    """The classic hidden sync: reading the loss on the host after every step."""

    def on_step_end(self, state):
        state.history.__dict__.setdefault("logged", []).append(state.loss.item())


def test_trace_written_parsed_and_consistent_with_key_averages(small, tmp_path):
    prof, trace, events = _run(small, tmp_path, "one")
    assert os.path.basename(trace).startswith("rank0.") and trace.endswith(".pt.trace.json")
    assert os.path.dirname(trace) == str(tmp_path / "one")
    steps = P.profiler_steps(events)
    assert len(steps) == 3, [e["name"] for e in steps]  # the active steps of (1, 1, 3)
    # our JSON parse against the profiler's own aggregation of the same run
    table = {k.key: k.count for k in prof.key_averages()}
    counts = P.op_counts(events)
    for name in ("aten::convolution", "aten::addmm", "phase:forward", "phase:data"):
        assert counts[name] == table[name] > 0, name
    # one forward and one batch fetched per step (forward hook and loader wrapper), every phase present
    assert P.count_per_step(events, "phase:forward") == 1
    assert P.count_per_step(events, "phase:data") == 1
    t = P.phase_times(events)
    for phase in ("data", "forward", "backward", "optimizer"):
        assert t[phase] > 0, (phase, t)
    assert sum(t[p] for p in P.PHASES) + t["other"] >= t["step"] * 0.999
    assert t["communication"] == 0  # one process: no collectives


def test_item_in_the_loop_is_visible_and_fit_has_none(small, tmp_path):
    _, _, clean = _run(small, tmp_path, "clean")
    _, _, dirty = _run(small, tmp_path, "dirty", callbacks=[ItemEveryStep()])
    # fit's hot loop reads nothing on the host; the logging callback reads the loss once per step
    assert P.count_per_step(clean, "aten::item") == 0
    assert P.count_per_step(dirty, "aten::item") == 1
    assert P.count_per_step(dirty, "aten::_local_scalar_dense") == 1
    assert P.phase_times(dirty)["sync"] > 0


def test_timeline_draws_one_lane_per_thread(small, tmp_path):
    _, _, events = _run(small, tmp_path, "plot")
    # the process's threads (the profiler's own "Spans" lane has a name, not a pid)
    threads = {(e["pid"], e["tid"]) for e in events if isinstance(e["pid"], int)}
    ax = P.plot_timeline(events, title="t")
    assert len(ax.get_yticks()) == min(len(threads), 6)
    assert ax.get_xlabel().endswith("(ms)") and ax.get_title() == "t"
    matplotlib.pyplot.close(ax.figure)


def test_interval_helpers_by_hand():
    assert P._union([(0, 10), (5, 12), (20, 21)]) == 13
    assert P._subtract([(0, 10), (12, 20)], [(2, 3), (9, 13), (15, 30)]) == [(0, 2), (3, 9), (13, 15)]
    assert P.phase_of("autograd::engine::evaluate_function: AddmmBackward0") == "backward"
    assert P.phase_of("Optimizer.step#SGD.step") == "optimizer"
    assert P.phase_of("gloo:all_reduce") == "communication" and P.phase_of("aten::item") == "sync"


def test_a_cuda_traces_gpu_copies_of_the_ranges_are_not_counted_again(tmp_path):
    """With CUDA traced, the profiler writes every record_function range twice: on the CPU thread
    (cat user_annotation) and on the GPU's timeline (cat gpu_user_annotation, spanning its
    kernels). Seen on an H100: counting both halved every per-step figure. Two steps by hand."""
    import json

    def ev(cat, name, ts, dur, tid=1):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}

    events = []
    for k, t0 in enumerate((0, 100)):
        events += [
            ev("user_annotation", f"ProfilerStep#{k}", t0, 100),
            ev("user_annotation", "phase:data", t0, 60),
            ev("cpu_op", "aten::item", t0 + 70, 5),
            ev("gpu_user_annotation", f"ProfilerStep#{k}", t0 + 62, 30, tid=7),
            ev("gpu_user_annotation", "phase:data", t0 + 62, 1, tid=7),
            ev("kernel", "gemm", t0 + 63, 20, tid=7),
        ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    loaded = P.load_trace(path)
    assert len(P.profiler_steps(loaded)) == 2
    assert P.count_per_step(loaded, "aten::item") == 1
    times = P.phase_times(loaded)  # microseconds over the two steps
    assert (times["data"], times["step"]) == (120, 200)
    assert any(e["cat"] == "kernel" for e in loaded)  # the GPU's own work stays


def test_cuda_is_traced_only_for_work_on_a_cuda_device(monkeypatch, tmp_path):
    """Ranks that fall back to gloo on the CPU of a GPU machine trace the CPU alone."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cuda = torch.profiler.ProfilerActivity.CUDA
    assert cuda not in P.make_profiler(tmp_path, device="cpu").activities
    assert cuda in P.make_profiler(tmp_path, device="cuda:0").activities
    assert cuda in P.make_profiler(tmp_path).activities  # no device named: the GPU is traced


@pytest.mark.slow
def test_ddp_bucket_cap_sets_allreduces_per_step(tmp_path):
    """Two gloo ranks: small buckets mean one all-reduce per bucket, launched during backward;
    one big bucket, one all-reduce after it. DDP's own bucket account is the oracle."""
    res = parallel.launch(
        functools.partial(P.ddp_profile_worker, str(tmp_path), (0.25, 100.0), depth=3, steps=(1, 1, 2)),
        2,
        stream=False,
        timeout=300,
    )
    assert len(res) == 2
    small, big = res[0]
    assert os.path.exists(res[1][0]["trace"])  # every rank writes its own trace
    rs, rb = P.overlap_report(P.load_trace(small["trace"])), P.overlap_report(P.load_trace(big["trace"]))
    assert len(big["bucket_sizes"]) == 1 and len(small["bucket_sizes"]) == 3
    assert rs["allreduce_per_step"] == len(small["bucket_sizes"])
    assert rb["allreduce_per_step"] == 1
    # mechanism: with small buckets the first all-reduce starts while most of backward remains
    assert rs["backward_after_first_launch"] > 0.3 > 0.15 > rb["backward_after_first_launch"], (rs, rb)


def test_native_stderr_captures_fd2_and_kineto_noise_is_dropped(capfd):
    with P.native_stderr() as err:
        os.write(2, b"[W c10d] from C++\n")
    assert err.text == "[W c10d] from C++\n"
    with P._quiet_kineto():
        os.write(2, b"USDT:2026-11-23 08:42:11 22190:22190 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a real warning\n")
    assert capfd.readouterr().err == "a real warning\n"
