"""Triton kernels of the course, imported only where Triton is installed (``utils.kernels``
imports this module lazily, so ``import utils.kernels`` works everywhere)."""

import triton
import triton.language as tl


@triton.jit
def _add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # One program instance adds one block of BLOCK consecutive elements.
    pid = tl.program_id(axis=0)  # which block this instance owns: 0, 1, ..., grid - 1
    offsets = pid * BLOCK + tl.arange(0, BLOCK)  # the indices of its elements
    mask = offsets < n  # the last block may run past the end: those lanes do nothing
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x + y, mask=mask)
