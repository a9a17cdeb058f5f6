"""Floating-point operations (FLOPs) of the lecture CNN, and model FLOPs utilisation (MFU).

A multiply-accumulate (MAC) is two FLOPs. Per image, a convolution with ``c_in`` input and
``c_out`` output channels, a ``kh x kw`` kernel and an ``h x w`` output does
``2 * c_in * kh * kw * c_out * h * w`` FLOPs; a linear layer ``n_in -> n_out`` does
``2 * n_in * n_out``. Biases, ReLUs and pooling add a fraction of a percent and are not counted
(``torch.utils.flop_counter.FlopCounterMode``, the outside count, leaves them out too).

Training costs about 3x the forward pass: the backward pass computes, per layer, the gradient
of its input and the gradient of its weights, each as many FLOPs as the forward. The first
layer's input gradient is never needed (the images do not require a gradient), so
``train = 3 * forward - forward(first layer)``.

MFU (Chowdhery et al. 2022, arXiv 2204.02311) = achieved FLOP/s / the device's peak FLOP/s,
where achieved FLOP/s = training FLOPs per image x images per second. The peaks of a few GPUs
are in :data:`PEAK_TFLOPS` (NVIDIA's datasheets, dense, no sparsity); elsewhere the peak is
measured, as the FLOP/s of a large matrix multiply (:func:`utils.bench.matmul_flops_per_s`).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "conv2d_flops",
    "linear_flops",
    "net_layer_flops",
    "net_forward_flops",
    "net_train_flops",
    "counted_flops",
    "PEAK_TFLOPS",
    "PEAK_SOURCES",
    "gpu_peak_flops",
    "mfu",
]


def conv2d_flops(c_in: int, c_out: int, kernel: tuple[int, int], out_hw: tuple[int, int], groups: int = 1) -> int:
    """Forward FLOPs of one convolution for one image: 2 x MACs."""
    kh, kw = kernel
    h, w = out_hw
    return 2 * (c_in // groups) * kh * kw * c_out * h * w


def linear_flops(n_in: int, n_out: int) -> int:
    """Forward FLOPs of one linear layer for one example: 2 x MACs."""
    return 2 * n_in * n_out


def _conv_out(side: int, conv: nn.Conv2d, dim: int) -> int:
    k, p, s, d = conv.kernel_size[dim], conv.padding[dim], conv.stride[dim], conv.dilation[dim]
    return (side + 2 * p - d * (k - 1) - 1) // s + 1


def net_layer_flops(net: nn.Module, image_size: int) -> dict[str, int]:
    """Forward FLOPs per image of each layer of ``utils.models.Net`` (conv, pool, conv, pool,
    three linear layers), in closed form from the layers' sizes. ``image_size``: the side of the
    square input images (32 for CIFAR-10)."""
    out = {}
    side = image_size
    for name in ("conv1", "conv2"):
        conv = getattr(net, name)
        side = _conv_out(side, conv, 0)
        out[name] = conv2d_flops(conv.in_channels, conv.out_channels, conv.kernel_size, (side, side), conv.groups)
        side //= 2  # the 2x2 max-pool after each convolution
    for name in ("fc1", "fc2", "fc3"):
        fc = getattr(net, name)
        out[name] = linear_flops(fc.in_features, fc.out_features)
    return out


def net_forward_flops(net: nn.Module, image_size: int) -> int:
    """Forward FLOPs per image of ``utils.models.Net``, in closed form."""
    return sum(net_layer_flops(net, image_size).values())


def net_train_flops(net: nn.Module, image_size: int) -> int:
    """FLOPs of one training step per image (forward + backward) of ``utils.models.Net``:
    3x the forward, less the first layer's input gradient, which nobody needs."""
    layers = net_layer_flops(net, image_size)
    return 3 * sum(layers.values()) - layers["conv1"]


def counted_flops(model: nn.Module, input_shape: tuple[int, ...], train: bool = True, batch: int = 1) -> int:
    """FLOPs per example as PyTorch's ``FlopCounterMode`` counts them: one forward (and, with
    ``train``, one backward of the summed output) of ``batch`` random inputs on the model's
    device, divided by ``batch``. The model's gradients are left as they were."""
    from torch.utils.flop_counter import FlopCounterMode

    p = next(model.parameters())
    x = torch.randn(batch, *input_shape, device=p.device, dtype=p.dtype)
    saved = [q.grad for q in model.parameters()]
    with FlopCounterMode(display=False) as counter:
        if train:
            model(x).sum().backward()
        else:
            with torch.no_grad():
                model(x)
    for q, g in zip(model.parameters(), saved):
        q.grad = g
    return counter.get_total_flops() // batch


# Peak dense tensor-core throughput, TFLOP/s (1e12 FLOP/s): half the datasheets' "with sparsity"
# figures. "fp32" is the plain (non-tensor-core) fp32 rate; "tf32" what convolutions and
# matmuls reach when TF32 is on.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 SXM": {"bf16": 989.0, "tf32": 494.5, "fp32": 67.0},
    "H100 PCIe": {"bf16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "H200": {"bf16": 989.0, "tf32": 494.5, "fp32": 67.0},  # the same compute as the H100 SXM
    "A100": {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
}
PEAK_SOURCES: dict[str, str] = {
    "H100 SXM": "NVIDIA H100 Tensor Core GPU datasheet (2023), SXM column, dense",
    "H100 PCIe": "NVIDIA H100 Tensor Core GPU datasheet (2023), PCIe column, dense",
    "H200": "NVIDIA H200 Tensor Core GPU datasheet (2024), SXM, dense (the same compute as H100 SXM)",
    "A100": "NVIDIA A100 Tensor Core GPU datasheet (2021), dense",
}


def _table_key(gpu_name: str) -> str | None:
    name = gpu_name.upper()
    if "H200" in name:
        return "H200"
    if "H100" in name:
        if "PCIE" in name:
            return "H100 PCIe"
        if "NVL" in name:
            return None  # a different board and clock: not in the table
        return "H100 SXM"
    if "A100" in name:
        return "A100"
    return None


def gpu_peak_flops(gpu_name: str, precision: str) -> tuple[float, str] | None:
    """(peak FLOP/s, its source) of a GPU named like ``torch.cuda.get_device_name()`` for
    ``precision`` "bf16", "tf32" or "fp32"; None when the GPU is not in :data:`PEAK_TFLOPS`."""
    if precision not in ("bf16", "tf32", "fp32"):
        raise ValueError(f"precision must be bf16, tf32 or fp32, got {precision!r}")
    key = _table_key(gpu_name)
    if key is None:
        return None
    return PEAK_TFLOPS[key][precision] * 1e12, f"{key} {precision}: {PEAK_SOURCES[key]}"


def mfu(images_per_s: float, flops_per_image: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s (images/s x FLOPs per image) / peak FLOP/s."""
    if peak_flops_per_s <= 0:
        raise ValueError(f"the peak must be positive, got {peak_flops_per_s}")
    return images_per_s * flops_per_image / peak_flops_per_s
