import pytest
import torch
from torch import nn

from utils import models


def test_lecture_cnn_has_exactly_120078_parameters():
    assert models.count_parameters(models.Net(128)) == 120_078
    assert models.Net(128)(torch.randn(2, 3, 32, 32)).shape == (2, 10)


@pytest.mark.parametrize("shape", [(1, 8, 8), (1, 28, 28), (3, 32, 32)])
def test_cnn_accepts_other_input_shapes(shape):
    net = models.net_for(shape, width=16)
    assert net(torch.randn(3, *shape)).shape == (3, 10)


def test_cnn_rejects_non_square_and_tiny():
    with pytest.raises(ValueError, match="square"):
        models.net_for((1, 8, 9))


@pytest.mark.parametrize("norm", ["bn", "ghost", "group", "none"])
def test_resnet9_family(norm):
    net = models.ResNet9(width=8, norm=norm, ghost_batch_size=2)
    assert net(torch.randn(4, 3, 32, 32)).shape == (4, 10)
    wider = models.ResNet9(width=16, norm=norm)
    assert models.count_parameters(wider) > 3 * models.count_parameters(net)


def test_resnet9_page_width_parameter_count():
    # 64-wide ResNet-9 (Page's DAWNBench net) with BN: ~6.57M parameters.
    assert 6.5e6 < models.count_parameters(models.ResNet9(width=64)) < 6.6e6


def test_ghost_batchnorm_equals_batchnorm_when_virtual_batch_is_the_batch():
    torch.manual_seed(0)
    x = torch.randn(8, 4, 5, 5)
    bn, gbn = nn.BatchNorm2d(4), models.GhostBatchNorm2d(4, virtual_batch_size=8)
    assert torch.allclose(bn(x), gbn(x), atol=1e-6)
    assert torch.allclose(bn.running_mean, gbn.running_mean) and torch.allclose(bn.running_var, gbn.running_var)


def test_ghost_batchnorm_normalises_each_virtual_batch():
    x = torch.cat([torch.randn(4, 2, 3, 3), 10 + 5 * torch.randn(4, 2, 3, 3)])
    out = models.GhostBatchNorm2d(2, virtual_batch_size=4)(x)
    for chunk in out.split(4):
        assert torch.allclose(chunk.mean((0, 2, 3)), torch.zeros(2), atol=1e-5)


def test_build_by_name():
    assert isinstance(models.build("net", (1, 8, 8), width=8), models.Net)
    assert models.build("linear", (1, 8, 8))(torch.randn(2, 1, 8, 8)).shape == (2, 10)
    with pytest.raises(ValueError, match="resnet9"):
        models.build("vgg")


def test_mlp_layers_blocks_and_seed():
    plain = models.mlp(20, 2, in_features=10, out_features=3)  # Linear(10, 20), ReLU, Linear(20, 3)
    assert [type(m).__name__ for m in plain] == ["Linear", "ReLU", "Linear"]
    assert models.count_parameters(plain) == 10 * 20 + 20 + 20 * 3 + 3
    bn = models.mlp(16, 3, in_features=64, out_features=10, norm="batch", flatten=True)
    assert [type(m).__name__ for m in bn] == [
        "Flatten",
        "Linear",
        "BatchNorm1d",
        "ReLU",
        "Linear",
        "BatchNorm1d",
        "ReLU",
        "Linear",
    ]
    blocks = models.mlp(8, 3, expand=4, activation="gelu", seed=1)
    assert len(blocks) == 3 and blocks[0][0].out_features == 32 and isinstance(blocks[0][1], nn.GELU)
    again = models.mlp(8, 3, expand=4, activation="gelu", seed=1)
    assert all(torch.equal(a, b) for a, b in zip(blocks.parameters(), again.parameters())), "same seed, same weights"
    with pytest.raises(ValueError, match="block MLP"):
        models.mlp(8, 2, in_features=4, expand=4)
    with pytest.raises(ValueError, match="activation"):
        models.mlp(8, 2, activation="swish")
