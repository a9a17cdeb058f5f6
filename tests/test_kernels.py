"""The vector-add kernel: its launch grid by hand everywhere; the kernel itself against ``x + y``
where CUDA and Triton are present."""

import importlib.util

import pytest
import torch

from utils import kernels


@pytest.mark.parametrize(
    ("n", "block", "want"),
    [(0, 1024, 0), (1, 1024, 1), (1024, 1024, 1), (1025, 1024, 2), (98432, 1024, 97), (10, 4, 3)],
)
def test_grid_size_by_hand(n, block, want):
    assert kernels.grid_size(n, block) == want
    # the grid covers every element, and one block fewer would not
    assert kernels.grid_size(n, block) * block >= n > (kernels.grid_size(n, block) - 1) * block or n == 0


@pytest.mark.parametrize("block", [0, -4, 3, 1000])
def test_grid_size_refuses_bad_blocks(block):
    with pytest.raises(ValueError):
        kernels.grid_size(10, block)


def test_not_runnable_on_cpu_says_why():
    why = kernels.why_not_runnable("cpu")
    assert why and "cpu" in why
    with pytest.raises(RuntimeError, match="not run"):
        kernels.vector_add(torch.ones(3), torch.ones(3))


def test_kernel_source_is_the_kernel():
    src = kernels.kernel_source()
    assert src.startswith("@triton.jit") and "def _add_kernel" in src and "tl.store" in src and "mask" in src


@pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("triton") is None, reason="needs CUDA and Triton"
)
@pytest.mark.parametrize("n", [1, 1000, 98_432, 1_000_003])
def test_vector_add_matches_torch_on_gpu(n):
    x = torch.randn(n, device="cuda")
    y = torch.randn(n, device="cuda")
    assert torch.equal(kernels.vector_add(x, y), x + y)
