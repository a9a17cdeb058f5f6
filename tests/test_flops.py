"""FLOPs of the lecture CNN in closed form against PyTorch's FlopCounterMode (the outside count),
the peak-FLOP/s table, MFU arithmetic, and the hardware switches notebook 02 prints (bf16 CPU
flags parsed from hand-written /proc/cpuinfo text; TF32 flags against torch's own)."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from utils import bench, device, flops, models


def _flop_counter(model, shape, train):
    x = torch.randn(1, *shape)
    with FlopCounterMode(display=False) as c:
        if train:
            model(x).sum().backward()
        else:
            model(x)
    return c.get_total_flops()


@pytest.mark.parametrize(("width", "shape"), [(128, (3, 32, 32)), (16, (3, 32, 32)), (32, (1, 8, 8)), (8, (1, 28, 28))])
def test_closed_form_matches_flop_counter(width, shape):
    net = models.net_for(shape, width)
    assert flops.net_forward_flops(net, shape[-1]) == _flop_counter(net, shape, train=False)
    assert flops.net_train_flops(net, shape[-1]) == _flop_counter(net, shape, train=True)
    assert flops.counted_flops(net, shape, train=True, batch=3) == flops.net_train_flops(net, shape[-1])


def test_lecture_cnn_by_hand():
    # Net(128) on 3x32x32: conv1 5x5 -> 28x28, pool -> 14; conv2 5x5 -> 10x10, pool -> 5.
    layers = flops.net_layer_flops(models.Net(128), 32)
    assert layers == {
        "conv1": 2 * 3 * 25 * 128 * 28 * 28,  # 15,052,800
        "conv2": 2 * 128 * 25 * 16 * 10 * 10,  # 10,240,000
        "fc1": 2 * 400 * 120,
        "fc2": 2 * 120 * 84,
        "fc3": 2 * 84 * 10,
    }
    assert flops.net_forward_flops(models.Net(128), 32) == 25_410_640
    assert flops.net_train_flops(models.Net(128), 32) == 3 * 25_410_640 - 15_052_800


def test_counted_flops_leaves_gradients_alone():
    net = models.Net(8)
    flops.counted_flops(net, (3, 32, 32))
    assert all(p.grad is None for p in net.parameters())


def test_peak_table_lookup():
    peak, source = flops.gpu_peak_flops("NVIDIA H100 80GB HBM3", "bf16")
    assert peak == 989e12 and "H100 SXM" in source and "datasheet" in source
    assert flops.gpu_peak_flops("NVIDIA H100 PCIe", "tf32")[0] == 378e12
    assert flops.gpu_peak_flops("NVIDIA H200", "bf16")[0] == flops.gpu_peak_flops("NVIDIA H100 80GB HBM3", "bf16")[0]
    assert flops.gpu_peak_flops("NVIDIA A100-SXM4-80GB", "tf32")[0] == 156e12
    assert flops.gpu_peak_flops("NVIDIA GeForce RTX 3080 Ti", "bf16") is None
    with pytest.raises(ValueError):
        flops.gpu_peak_flops("NVIDIA A100", "fp8")


def test_mfu_arithmetic():
    # 1,000 images/s x 61,179,120 FLOPs = 61.2 GFLOP/s; against a 100 GFLOP/s peak: 0.6118
    assert flops.mfu(1000, 61_179_120, 100e9) == pytest.approx(0.61179120)
    with pytest.raises(ValueError):
        flops.mfu(1, 1, 0)


def test_matmul_peak_is_a_rate():
    rate = bench.matmul_flops_per_s(64, repeats=2)
    assert 0 < rate < float("inf")  # a rate, not a time: positive and finite (no claim on its size)


CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu vme avx2 avx512f avx512_bf16 amx_tile amx_bf16
"""


def test_cpu_bf16_features_parses_flags():
    got = device.cpu_bf16_features(CPUINFO)
    assert got == {"avx512_bf16": True, "amx_bf16": True, "arm_bf16": False, "source": "/proc/cpuinfo", "native": True}
    old = device.cpu_bf16_features("processor\t: 0\nflags\t\t: fpu avx2 avx512f\n")
    assert old["native"] is False and old["avx512_bf16"] is False
    arm = device.cpu_bf16_features("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert arm["arm_bf16"] is True and arm["native"] is True
    assert device.cpu_bf16_features("processor\t: 0\nFeatures\t: fp asimd\n")["native"] is False


def test_cpu_bf16_features_agree_with_torch_here():
    here = device.cpu_bf16_features()
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    if here["source"] != "/proc/cpuinfo" or probe is None:
        pytest.skip("needs /proc/cpuinfo and torch's CPU probe to compare")
    assert here["avx512_bf16"] == bool(probe())


def test_tf32_settings_follow_torch_flags():
    s = device.tf32_settings("cpu")
    assert s["cudnn_allow_tf32"] == torch.backends.cudnn.allow_tf32
    assert s["matmul_allow_tf32"] == torch.backends.cuda.matmul.allow_tf32
    assert s["float32_matmul_precision"] == torch.get_float32_matmul_precision()
    assert s["tensor_cores_tf32"] is False and s["convs_tf32"] is False  # no tensor cores on a CPU


def test_matmul_peak_restores_precision_and_refuses_unknown():
    before, threads = torch.get_float32_matmul_precision(), torch.get_num_threads()
    assert bench.matmul_flops_per_s(32, precision="tf32", repeats=1) > 0
    assert bench.matmul_flops_per_s(32, precision="bf16", repeats=1) > 0
    assert torch.get_float32_matmul_precision() == before and torch.get_num_threads() == threads
    with pytest.raises(ValueError):
        bench.matmul_flops_per_s(32, precision="fp8")


def test_cpu_peak_is_one_core_times_threads(monkeypatch):
    seen = {}

    def fake_time_fn(fn, **kw):
        seen["threads"] = torch.get_num_threads()  # while the multiply is timed
        return bench.Timing([0.004, 0.002, 0.003], 0, 1, "perf_counter")

    monkeypatch.setattr(bench, "time_fn", fake_time_fn)
    threads = torch.get_num_threads()
    # 2 * 100**3 = 2e6 FLOPs in the fastest repeat, 2 ms: 1e9 FLOP/s per core
    assert bench.matmul_flops_per_s(100, repeats=3) == pytest.approx(1e9 * threads)
    assert seen["threads"] == 1 and torch.get_num_threads() == threads
