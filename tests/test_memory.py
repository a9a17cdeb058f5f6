"""utils.memory's byte counts of any model: the state predictor against a real optimizer's
state, the activation estimate, the memory prediction."""

import pytest
import torch
from torch import nn

from utils import memory, models


def _step(model, opt, shape=(3, 32, 32)):
    torch.manual_seed(0)
    x = torch.randn(4, *shape)
    nn.functional.cross_entropy(model(x), torch.randint(0, 10, (4,))).backward()
    opt.step()


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "adamw-amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-3, amsgrad=True),
    "rmsprop-centered-momentum": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.9, centered=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-3),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("model_name", ["net", "resnet9"])
def test_state_bytes_match_the_real_optimizer(name, model_name):
    torch.manual_seed(0)
    model = models.Net(8, image_size=16) if model_name == "net" else models.ResNet9(width=4)
    opt = OPTIMIZERS[name](model.parameters())
    _step(model, opt, (3, 16, 16))
    counted_params = sum(p.numel() * p.element_size() for p in model.parameters())
    counted_grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    assert memory.parameter_bytes(model) == counted_params
    assert memory.grad_bytes(model) == counted_grads
    counted = memory.counted_state_bytes(opt)
    assert memory.optimizer_state_bytes(model, opt) == counted, f"{name}: predicted state != optimizer.state"
    by_name = {"sgd": ("sgd", 0.0), "sgd-momentum": ("sgd", 0.9), "adam": ("adam", 0.0)}
    if name in by_name:
        kind, mom = by_name[name]
        assert memory.optimizer_state_bytes(model, kind, momentum=mom) == counted
    if name == "adam":
        assert counted == 2 * counted_params, "Adam keeps exactly 2x the parameters"
    if name == "sgd":
        assert counted == 0, "SGD without momentum keeps no state"


def test_state_bytes_of_frozen_and_low_precision_parameters():
    model = models.Net(16).to(torch.bfloat16)
    model.conv1.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    x = torch.randn(2, 3, 32, 32, dtype=torch.bfloat16)
    model(x).float().sum().backward()
    opt.step()
    counted_grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    assert memory.grad_bytes(model) == counted_grads, "frozen parameters get no gradient"
    assert memory.optimizer_state_bytes(model, "adam") == memory.counted_state_bytes(opt)
    assert memory.optimizer_state_bytes(model, opt) == memory.counted_state_bytes(opt)


def test_counted_state_leaves_out_adams_step_counters():
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    assert memory.counted_state_bytes(opt) == 2 * (6 + 2) * 4


def test_unknown_optimizer_is_a_clear_error():
    with pytest.raises(ValueError, match="known"):
        memory.optimizer_state_bytes(nn.Linear(2, 2), "lion")


def test_activation_estimate_is_linear_in_batch_and_leaves_the_model_alone():
    torch.manual_seed(0)
    model = models.ResNet9(width=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    a8 = memory.activation_bytes(model, 8, (3, 16, 16))
    a16 = memory.activation_bytes(model, 16, (3, 16, 16))
    a32 = memory.activation_bytes(model, 32, (3, 16, 16))
    assert 0 < a8 < a16 < a32
    assert (a32 - a16) == pytest.approx(2 * (a16 - a8), rel=1e-6), "activations grow linearly with the batch"
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"activation_bytes changed {k} (restore batch-norm buffers)"
    assert all(p.grad is None for p in model.parameters())
    # Net on 32x32: at least the first convolution's output (hidden x 28 x 28 floats per image)
    net = models.Net(16)
    assert memory.activation_bytes(net, 10) >= 10 * 16 * 28 * 28 * 4


def test_predict_memory_adds_up():
    p = memory.predict_memory(models.Net(16), 64, optimizer="sgd", momentum=0.9)
    assert p.total == p.params + p.buffers + p.grads + p.optimizer_state + p.activations
    assert p.optimizer_state == p.params == p.grads
    assert "activations" in p.table() and p.as_dict()["total"] == p.total


def test_measure_memory_needs_cuda():
    assert memory.measure_memory(models.Net(8), 4, device="cpu") is None


def test_format_bytes():
    assert memory.format_bytes(512) == "512 B"
    assert memory.format_bytes(3 * 2**20) == "3.00 MiB"
