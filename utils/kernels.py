"""A first GPU kernel: the vector add, written in Triton (Tillet et al. 2019).

The kernel (``utils/_triton_kernels.py``) is compiled for the GPU. This module holds what runs
everywhere: the launch-grid arithmetic (:func:`grid_size`), whether the kernel can run here
(:func:`why_not_runnable`), its source (:func:`kernel_source`), and the launcher
(:func:`vector_add`), which imports Triton only when it is called.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

__all__ = ["grid_size", "why_not_runnable", "kernel_source", "vector_add", "KERNEL_FILE"]

KERNEL_FILE = Path(__file__).with_name("_triton_kernels.py")


def grid_size(n: int, block: int) -> int:
    """Program instances needed to cover ``n`` elements in blocks of ``block``: ceil(n / block).
    Triton's ``tl.arange`` needs ``block`` to be a power of two."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a positive power of two, got {block}")
    return (n + block - 1) // block


def why_not_runnable(device: torch.device | str) -> str | None:
    """None when the Triton kernel can run on ``device``; else one line saying why not."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"the Triton kernel was not run: Triton compiles for GPUs, and this run's device is {device}"
    if importlib.util.find_spec("triton") is None:
        return "the Triton kernel was not run: the triton package is not installed here"
    return None


def kernel_source() -> str:
    """The kernel's source, read from its file (works without Triton installed)."""
    text = KERNEL_FILE.read_text()
    return text[text.index("@triton.jit") :]


def vector_add(x: torch.Tensor, y: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """``x + y`` computed by the Triton kernel: contiguous CUDA tensors of one shape and dtype."""
    if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
        raise ValueError("x and y need the same shape, dtype and device")
    reason = why_not_runnable(x.device)
    if reason:
        raise RuntimeError(reason)
    from ._triton_kernels import _add_kernel  # lazy: needs triton and a GPU

    x, y = x.contiguous(), y.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    _add_kernel[(grid_size(n, block),)](x, y, out, n, BLOCK=block)
    return out
