"""Floating-point operations (FLOPs) of the lecture CNN and of the GPT, and model FLOPs utilisation (MFU).

A multiply-accumulate (MAC) is two FLOPs. Per image, a convolution with ``c_in`` input and
``c_out`` output channels, a ``kh x kw`` kernel and an ``h x w`` output does
``2 * c_in * kh * kw * c_out * h * w`` FLOPs; a linear layer ``n_in -> n_out`` does
``2 * n_in * n_out``. Biases, ReLUs and pooling add a fraction of a percent and are not counted
(``torch.utils.flop_counter.FlopCounterMode``, the outside count, leaves them out too).

Training costs about 3x the forward pass: the backward pass computes, per layer, the gradient
of its input and the gradient of its weights, each as many FLOPs as the forward. The first
layer's input gradient is never needed (the images do not require a gradient), so
``train = 3 * forward - forward(first layer)``.

The GPT (``utils.gpt``) has its own closed form per token (:func:`gpt_flops_per_token`): the
matrix multiplies of its weights plus the attention term, derived in that function's docstring.

MFU (Chowdhery et al. 2022, arXiv 2204.02311) = achieved FLOP/s / the device's peak FLOP/s,
where achieved FLOP/s = training FLOPs per image (or per token) x images (tokens) per second. The peaks of a few GPUs
are in :data:`PEAK_TFLOPS` (NVIDIA's datasheets, dense, no sparsity); elsewhere the peak is
measured, as the FLOP/s of a large matrix multiply (:func:`utils.bench.matmul_flops_per_s`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

__all__ = [
    "conv2d_flops",
    "linear_flops",
    "net_layer_flops",
    "net_forward_flops",
    "net_train_flops",
    "counted_flops",
    "gpt_matmul_params",
    "gpt_flops_per_token",
    "counted_gpt_flops",
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
    with _grads_kept(model), FlopCounterMode(display=False) as counter:
        if train:
            model(x).sum().backward()
        else:
            with torch.no_grad():
                model(x)
    return counter.get_total_flops() // batch


@contextlib.contextmanager
def _grads_kept(model: nn.Module):
    """Set the gradients aside (backward would add into them in place), give them back after."""
    params = list(model.parameters())
    saved = [q.grad for q in params]
    for q in params:
        q.grad = None
    try:
        yield
    finally:
        for q, g in zip(params, saved):
            q.grad = g


def gpt_matmul_params(cfg: Any) -> int:
    """Weights of ``utils.gpt.GPT(cfg)`` that multiply every token's activations: per block the
    query-key-value (3d^2), attention output (d^2) and MLP (4d^2 + 4d^2) matrices, 12 d^2, and
    the output projection (vocab x d), which is tied to the token embedding but is a matrix
    multiply all the same. ``12 * layers * d^2 + vocab * d``, with ``d = width``.

    Kaplan et al.'s non-embedding N (arXiv 2001.08361) is ``12 * layers * d^2`` plus the biases
    and norms; biases and norms cost no matrix-multiply FLOPs, and the output projection does,
    so this is the N that FLOPs are counted from."""
    return 12 * cfg.layers * cfg.width**2 + cfg.vocab_size * cfg.width


def gpt_flops_per_token(cfg: Any, seq_len: int | None = None, *, train: bool = True, recompute: bool = False) -> int:
    """FLOPs per token of ``utils.gpt.GPT(cfg)`` on sequences of ``seq_len`` tokens (default
    ``cfg.context``), in closed form; N = :func:`gpt_matmul_params`, L layers, T = ``seq_len``,
    d = width.

    Weights: each weight multiplies each token once forward (2 FLOPs per weight, one
    multiply-accumulate), and twice backward (the gradient of its input and of itself; every
    input needs its gradient, since the first block's input is the trainable embeddings): 2N
    forward, 6N for a training step.

    Attention: per layer and head, scores = Q K^T ((T x h) times (h x T): 2 T^2 h FLOPs) and
    out = scores V (2 T^2 h again), so per layer 4 T^2 d for a sequence, 4 T d per token forward.
    Causal attention needs only half the scores, but the kernels compute the full T x T square
    (the mask is applied after), and ``FlopCounterMode`` counts the full square: so does this.
    Backward of the two products: 4 products of the same size, 8 T d per token per layer. A
    training step: ``6N + 12 * L * T * d`` per token, which is PaLM's (Chowdhery et al. 2022,
    appendix B) ``6N + 12 L H Q T`` with H Q = d. This is what MFU counts (``recompute=False``).

    ``recompute=True``: flash-style backward kernels (CUDA's flash, memory-efficient and cuDNN
    attention) keep no T x T matrix and compute Q K^T again during backward, 2 T d more per token
    per layer (``14 * L * T * d``): the hardware FLOPs, and what ``FlopCounterMode`` counts for
    those kernels. For PyTorch's math attention (``SDPBackend.MATH``) it counts
    ``recompute=False``; for the CPU's default fused kernel it counts no attention FLOPs at all
    (torch 2.13 registers no formula for it).

    Not counted, as ``FlopCounterMode`` does not count them: biases, LayerNorm, GELU, softmax,
    the loss, embedding lookups and the residual additions, whose work grows as d per token
    where the matrix multiplies' grows as d^2."""
    t = cfg.context if seq_len is None else seq_len
    if not 1 <= t <= cfg.context:
        raise ValueError(f"seq_len must be in [1, context={cfg.context}], got {t}")
    n, ltd = gpt_matmul_params(cfg), cfg.layers * t * cfg.width
    if not train:
        return 2 * n + 4 * ltd
    return 6 * n + (14 if recompute else 12) * ltd


def counted_gpt_flops(model: nn.Module, batch: int = 1, seq_len: int | None = None, *, train: bool = True) -> int:
    """FLOPs per token of a ``utils.gpt.GPT`` as ``FlopCounterMode`` counts them: one forward
    (and, with ``train``, the loss against random targets and its backward) of ``batch`` random
    sequences of ``seq_len`` tokens (default the context), divided by the tokens. The attention
    kernel is whichever ``scaled_dot_product_attention`` picks (choose one with
    ``torch.nn.attention.sdpa_kernel``); see :func:`gpt_flops_per_token` for what each counts.
    The model's gradients are left as they were."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = model.cfg
    t = cfg.context if seq_len is None else seq_len
    device = next(model.parameters()).device
    idx, targets = torch.randint(0, cfg.vocab_size, (2, batch, t), device=device)
    with _grads_kept(model), FlopCounterMode(display=False) as counter:
        if train:
            _, loss = model(idx, targets)
            loss.backward()
        else:
            with torch.no_grad():
                model(idx)
    return counter.get_total_flops() // (batch * t)


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
    """Model FLOPs utilisation: achieved FLOP/s (images/s x FLOPs per image) / peak FLOP/s.
    The same for a language model: tokens/s and FLOPs per token (:func:`gpt_flops_per_token`)."""
    if peak_flops_per_s <= 0:
        raise ValueError(f"the peak must be positive, got {peak_flops_per_s}")
    return images_per_s * flops_per_image / peak_flops_per_s
