"""utils.bench: the timer against known durations, throughput and loaders; the throughput
benchmark. (Byte counts and the memory predictor: test_memory.py; lab 2's self-checks: test_checks_throughput.py.)"""

import json
import statistics
import threading
import time

import pytest
import torch

from utils import bench, data, models, train

# ----------------------------------------------------------------------------------------
# time_fn
# ----------------------------------------------------------------------------------------


def test_time_fn_matches_a_sleep_within_10_percent():
    t = bench.time_fn(lambda: time.sleep(0.05), warmup=1, repeats=5)
    assert t.method == "perf_counter" and len(t.seconds) == 5 and len(t.warmup_seconds) == 1
    assert t.median == pytest.approx(0.05, rel=0.10), f"time_fn measured {t.median:.4f} s for a 0.05 s sleep"


def test_time_fn_divides_by_number():
    t = bench.time_fn(lambda: time.sleep(0.05), warmup=0, repeats=3, number=3)
    assert t.median == pytest.approx(0.05, rel=0.10), "seconds must be per call, not per repeat of `number` calls"


def test_time_fn_leaves_the_warm_up_out():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.2 if len(calls) <= 2 else 0.05)  # two cold calls, then warm ones

    t = bench.time_fn(fn, warmup=2, repeats=5)
    assert len(calls) == 7
    assert t.median == pytest.approx(0.05, rel=0.10), "the warm-up calls must not be timed"
    assert min(t.warmup_seconds) > 0.18


def test_time_fn_reports_the_median_not_the_mean():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.3 if len(calls) == 3 else 0.05)  # one outlier among five

    t = bench.time_fn(fn, warmup=0, repeats=5)
    assert t.median == pytest.approx(0.05, rel=0.10) and t.mean > 0.09
    assert t.median == statistics.median(t.seconds)


def test_time_fn_synchronises_an_asynchronous_device():
    """The work is queued on another thread (as CUDA does); without sync the host timer reads ~0."""
    with bench.SimulatedGPU() as gpu:
        t = bench.time_fn(lambda: gpu.launch(0.05), warmup=1, repeats=5, sync=gpu.synchronize)
        assert t.median == pytest.approx(0.05, rel=0.10), f"measured {t.median:.4f} s for 0.05 s of queued work"
        assert gpu.syncs >= 5, "time_fn must synchronise before reading the clock after each repeat"
        t0 = time.perf_counter()
        gpu.launch(0.03)
        naive = time.perf_counter() - t0
        gpu.synchronize()
    assert naive < 0.01, "the simulated launch should return at once"
    assert not [th for th in threading.enumerate() if th.name == "SimulatedGPU"], "SimulatedGPU leaked its thread"


def test_time_fn_uses_cuda_events_on_cuda(monkeypatch):
    """The CUDA branch, driven by a fake one-GPU torch.cuda (no GPU needed)."""
    from fake_gpu import FakeCuda

    fake = FakeCuda(1).install(monkeypatch.setattr)
    monkeypatch.setattr(bench, "synchronize", lambda device=None: None)
    t = bench.time_fn(lambda: time.sleep(0.05), warmup=1, repeats=4, device="cuda")
    assert t.method == "cuda events" and len(fake.events) == 2
    assert t.median == pytest.approx(0.05, rel=0.10), "elapsed_time is in ms: divide by 1000"


def test_time_fn_rejects_bad_arguments():
    with pytest.raises(ValueError, match="repeats"):
        bench.time_fn(lambda: None, repeats=0)
    with pytest.raises(TypeError, match="callable"):
        bench.time_fn(42)


# ----------------------------------------------------------------------------------------
# Throughput and loaders
# ----------------------------------------------------------------------------------------


def test_throughput_rows_and_the_model_is_not_changed():
    model = models.Net(8, in_channels=1, image_size=8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for kw in ({}, {"amp_dtype": "bf16"}, {"channels_last": True}):
        t = bench.train_throughput(model, 8, input_shape=(1, 8, 8), warmup=1, repeats=2, steps=1, **kw)
        assert len(t.images_per_s) == 2 and t.median > 0 and t.steps == 1
        row = t.row()
        assert row["images_per_s_median"] == t.median and row["batch_size"] == 8
    assert t.channels_last and t.dtype == "fp32"
    i = bench.inference_throughput(model, 8, input_shape=(1, 8, 8), warmup=1, repeats=2, min_repeat_s=0)
    assert i.mode == "inference" and i.steps >= 1
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), "measuring throughput must not train the caller's model"
    assert next(model.parameters()).is_contiguous()
    with pytest.raises(ValueError, match="dtype"):
        bench.train_throughput(model, 8, amp_dtype="int8")


def test_timed_loader_counts_the_wait_and_works_with_fit():
    class Slow:
        def __init__(self):
            self.epochs = []

        def __len__(self):
            return 4

        def set_epoch(self, e):
            self.epochs.append(e)

        def __iter__(self):
            for _ in range(4):
                time.sleep(0.05)
                yield torch.randn(3, 1, 8, 8), torch.randint(0, 10, (3,))

    slow = Slow()
    loader = bench.TimedLoader(slow)
    model = models.Net(4, in_channels=1, image_size=8)
    h = train.fit(model, loader, torch.optim.SGD(model.parameters(), lr=0.01), epochs=2, progress=False)
    assert slow.epochs == [0, 1], "TimedLoader must pass set_epoch through"
    assert loader.batches == 8 and h.steps == 8
    assert 8 * 0.05 <= loader.wait_s < 8 * 0.05 * 1.5, f"waited {loader.wait_s:.3f} s for 8 batches of 0.05 s"
    assert loader.wait_s < h.train_time


def test_timed_loader_passes_set_epoch_to_a_dataloaders_sampler():
    ds = data.synthetic(16, (1, 8, 8))
    dl = data.make_loader(ds, 4, kind="dataloader")
    tl = bench.TimedLoader(dl)
    tl.set_epoch(3)
    assert dl.sampler.epoch == 3 and len(tl) == 4


def test_slow_dataset_costs_its_time():
    ds = bench.SlowDataset(data.synthetic(4, (1, 2, 2)), cost_s=0.01)
    t0 = time.perf_counter()
    x, y = ds[0]
    assert time.perf_counter() - t0 >= 0.01 and x.shape == (1, 2, 2) and len(ds) == 4


def test_simulated_gpu_refuses_work_after_close():
    gpu = bench.SimulatedGPU()
    gpu.close()
    with pytest.raises(RuntimeError, match="closed"):
        gpu.launch(0.01)


# ----------------------------------------------------------------------------------------
# The benchmark script
# ----------------------------------------------------------------------------------------


def test_throughput_benchmark_writes_json_and_ends_with_speedup(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "throughput.py"
    spec = importlib.util.spec_from_file_location("throughput_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "r" / "t.json"
    assert (
        mod.main(
            [
                "--quick",
                "--batch-sizes",
                "2",
                "--width",
                "4",
                "--repeats",
                "2",
                "--min-repeat-s",
                "0",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    has_gpu = torch.cuda.is_available()
    assert lines[-1].startswith("speedup ") and (has_gpu or lines[-1] == "speedup n/a (no GPU)"), lines[-1]
    res = json.loads(out.read_text())
    assert {"hardware", "versions", "rows", "speedup_batch64", "model"} <= set(res)
    assert res["hardware"]["torch"] == torch.__version__
    batches = sorted({r["batch_size"] for r in res["rows"] if r["device"] == "cpu" and r["mode"] == "train"})
    assert batches == [2, 64], "batch 64 is always measured (the speedup line needs it)"
    assert all(r["images_per_s_median"] > 0 for r in res["rows"])
    assert not list(out.parent.glob("*.tmp")), "the atomic write left a temporary file"
