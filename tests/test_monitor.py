"""utils.monitor: starts, stops, returns samples (fake NVML) or a clear no-GPU result, and never
leaves its thread behind."""

import threading
import time
from types import SimpleNamespace

import pytest

from utils import monitor


def _monitor_threads():
    return [t for t in threading.enumerate() if t.name == "GPUMonitor"]


class FakeNVML:
    """Just enough of pynvml for two GPUs; GPU 1 does not report power (NotSupported)."""

    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 1, 2, 0

    class NVMLError(Exception):
        pass

    def __init__(self, count=2):
        self.count, self.inits, self.shutdowns, self.reads = count, 0, 0, 0

    def nvmlInit(self):
        self.inits += 1

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return b"Fake GPU"

    def nvmlDeviceGetUtilizationRates(self, h):
        self.reads += 1
        return SimpleNamespace(gpu=90, memory=40)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=3 * 2**30, total=80 * 2**30)

    def nvmlDeviceGetPowerUsage(self, h):
        if h == 1:
            raise self.NVMLError("Not Supported")
        return 250_000  # mW

    def nvmlDeviceGetClockInfo(self, h, kind):
        return 1980 if kind == self.NVML_CLOCK_SM else 2619

    def nvmlDeviceGetTemperature(self, h, kind):
        return 55


class BrokenNVML(FakeNVML):
    def nvmlInit(self):
        raise FakeNVML.NVMLError("NVML Shared Library Not Found")


def test_no_gpu_gives_a_clear_result_and_no_thread(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    before = set(threading.enumerate())
    mon = monitor.GPUMonitor(interval=0.01, nvml=BrokenNVML())
    with mon:
        time.sleep(0.03)
    res = mon.result
    assert not res.available and res.samples == [], "without NVML the result must be unavailable and empty"
    assert "no NVIDIA GPU" in res.reason, f"the reason should say there is no NVIDIA GPU, got {res.reason!r}"
    assert set(threading.enumerate()) <= before, "the monitor left a thread running without a GPU"
    assert "no GPU samples" in res.summary()


def test_real_environment_does_not_leak_threads():
    """Whatever this machine has (GPU or not), start/stop leaves no GPUMonitor thread."""
    with monitor.GPUMonitor(interval=0.01) as mon:
        time.sleep(0.05)
    res = mon.result
    assert not _monitor_threads(), "GPUMonitor thread still alive after the with block"
    if res.available:
        assert res.samples, "an available monitor takes a sample as soon as it starts"
    else:
        assert res.reason, "an unavailable result must say why"


def test_fake_gpus_are_sampled_and_the_thread_joins(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = FakeNVML()
    mon = monitor.GPUMonitor(interval=0.01, nvml=nvml).start()
    assert mon.running and len(_monitor_threads()) == 1
    time.sleep(0.1)
    res = mon.stop()
    assert not mon.running and not _monitor_threads(), "stop() must join the sampling thread"
    assert nvml.inits == 1 and nvml.shutdowns == 1, "NVML must be initialised and shut down once each"
    assert res.available and res.gpus == [(0, "Fake GPU"), (1, "Fake GPU")]
    n0 = len([s for s in res.samples if s["gpu"] == 0])
    assert n0 >= 2, f"expected several samples in 0.1 s at 0.01 s intervals, got {n0}"
    s0 = next(s for s in res.samples if s["gpu"] == 0)
    assert s0["util_gpu"] == 90 and s0["util_mem"] == 40 and s0["sm_clock_mhz"] == 1980
    assert s0["power_w"] == pytest.approx(250.0), "power: NVML reports milliwatts, the sample holds watts"
    assert s0["mem_used_mib"] == pytest.approx(3 * 1024) and s0["mem_total_mib"] == pytest.approx(80 * 1024)
    s1 = next(s for s in res.samples if s["gpu"] == 1)
    assert s1["power_w"] is None, "an unsupported counter must be None, not stop the sampling"
    ts, vs = res.series("util_gpu")
    assert ts == sorted(ts) and set(vs) == {90}
    # sampling has really stopped
    reads = nvml.reads
    time.sleep(0.05)
    assert nvml.reads == reads, "the monitor kept sampling after stop()"


def test_thread_is_joined_when_the_block_raises(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(ZeroDivisionError):
        with monitor.GPUMonitor(interval=0.01, nvml=FakeNVML()):
            _ = 1 / 0
    assert not _monitor_threads(), "an exception inside the with block left the monitor thread running"


def test_cuda_visible_devices_selects_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with monitor.GPUMonitor(interval=0.01, nvml=FakeNVML()) as mon:
        time.sleep(0.02)
    assert mon.result.gpus == [(0, "Fake GPU")], "CUDA_VISIBLE_DEVICES=1: one device, cuda:0"
    assert mon.result.devices[0]["nvml"] == 1, "cuda:0 under CUDA_VISIBLE_DEVICES=1 is NVML's GPU 1"


def test_bad_arguments_are_clear():
    with pytest.raises(ValueError, match="interval"):
        monitor.GPUMonitor(interval=0)
    with pytest.raises(ValueError, match="does not exist"):
        monitor.GPUMonitor(interval=0.01, gpus=[5], nvml=FakeNVML()).start()
    assert not _monitor_threads()


def test_plot_with_and_without_samples(monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with monitor.GPUMonitor(interval=0.01, nvml=FakeNVML()) as mon:
        time.sleep(0.03)
    fig = monitor.plot(mon.result)
    assert len(fig.axes) == 4 and all(ax.get_xlabel() for ax in fig.axes)
    plt.close(fig)
    empty = monitor.MonitorResult(False, "no NVIDIA GPU to monitor: test")
    fig = monitor.plot(empty)
    assert "no NVIDIA GPU" in fig.axes[0].texts[0].get_text()
    plt.close(fig)
