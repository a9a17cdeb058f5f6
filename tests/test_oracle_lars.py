"""Oracle from outside the project: LARS and LARC against the paper, written here from scratch.

The reference below does not import utils.optim. It follows You, Gitman and Ginsburg 2017
("Large Batch Training of Convolutional Networks", arXiv 1708.03888), eq. (6) and Algorithm 1:

    local rate   lambda = eta * ||w|| / (||grad L(w)|| + beta * ||w||)              (eq. 6)
    momentum     v <- m * v + gamma * lambda * (grad L(w) + beta * w)               (Alg. 1)
    weights      w <- w - v

and NVIDIA's LARC clipping (apex.parallel.LARC(clip=True)): the effective rate is
``min(lambda, gamma)`` instead of ``gamma * lambda``.

Conventions the paper leaves open, as the common implementations (timm, apex) settle them:
* a tensor whose weight norm or gradient norm is 0 gets lambda = 1 (plain SGD on it);
* biases and batch-norm parameters are excluded: no adaptation, no weight decay;
* the first momentum buffer is the first update (v starts at 0).

Algorithm 1 keeps the global rate gamma inside v; torch.optim.SGD (and utils.optim.LARS) keep it
outside (v' = v / gamma). With a constant gamma, as here, both give the same weights.
The whole comparison runs in float64 on real gradients of a small conv net with batch norm,
over several steps, the reference updating its own copy of the model.
"""

import copy
import math

import pytest
import torch
from torch import nn

from utils.optim import LARS, lars_param_groups  # the code under test, nothing else from it

STEPS, LR, ETA = 5, 0.1, 0.02


class Net(nn.Module):
    """conv (weight + bias), batch norm (weight + bias), a head whose weight starts at zero
    (||w|| = 0), and a branch multiplied by zero, whose weight always gets a zero gradient."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 4 * 4, 3)
        self.dead = nn.Linear(4 * 4 * 4, 3, bias=False)
        nn.init.zeros_(self.head.weight)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x))).flatten(1)
        return self.head(h) + 0.0 * self.dead(h)


def excluded(name, p):
    return p.ndim < 2  # biases and BN weights/biases


def paper_step(params, grads, bufs, *, lr, eta, beta, momentum, clip):
    """One step of the paper's LARS (LARC if clip) on a list of (name, tensor) pairs, in place.
    Returns {name: lambda, or None where a norm is 0} of the adapted tensors, for the test's
    own checks of which cases occurred."""
    rates = {}
    for (name, w), g in zip(params, grads):
        if excluded(name, w):
            update = lr * g  # plain SGD, no decay
        else:
            w_norm = math.sqrt(float((w * w).sum()))
            g_norm = math.sqrt(float((g * g).sum()))
            if w_norm > 0 and g_norm > 0:
                lam = eta * w_norm / (g_norm + beta * w_norm)  # eq. (6)
                rates[name] = lam
            else:
                lam = 1.0  # no adaptation
                rates[name] = None
            if clip and w_norm > 0 and g_norm > 0:
                rate = min(lam, lr)  # LARC: min(local, global)
            else:
                rate = lr * lam
            update = rate * (g + beta * w)
        if momentum:
            v = bufs.get(name)
            bufs[name] = update.clone() if v is None else momentum * v + update
            update = bufs[name]
        w -= update
    return rates


@pytest.mark.parametrize(
    "beta,momentum,clip",
    [
        (0.0, 0.9, False),  # weight decay zero
        (5e-3, 0.9, False),
        (5e-3, 0.0, False),  # no momentum
        (5e-3, 0.9, True),  # LARC clip
        (0.0, 0.0, True),
    ],
    ids=["wd0-momentum", "wd-momentum", "wd-no-momentum", "larc-wd-momentum", "larc-wd0"],
)
def test_lars_follows_the_paper(beta, momentum, clip):
    torch.manual_seed(0)
    net = Net().double()
    ref = copy.deepcopy(net)
    x = torch.randn(16, 1, 6, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (16,))
    opt = LARS(
        lars_param_groups(net, beta, exclude=excluded),
        lr=LR,
        momentum=momentum,
        trust_coefficient=ETA,
        eps=0.0,
        clip=clip,
    )
    bufs, seen = {}, {"clipped": 0, "unclipped": 0, "zero-norm": 0}
    for step in range(STEPS):
        for model in (net, ref):
            model.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
        assert torch.equal(net.dead.weight.grad, torch.zeros_like(net.dead.weight)), "the dead branch must get 0"
        opt.step()
        named = list(ref.named_parameters())
        with torch.no_grad():
            rates = paper_step(
                [(n, p.data) for n, p in named],
                [p.grad for _, p in named],
                bufs,
                lr=LR,
                eta=ETA,
                beta=beta,
                momentum=momentum,
                clip=clip,
            )
        for lam in rates.values():
            seen["zero-norm" if lam is None else "clipped" if lam > LR else "unclipped"] += 1
        for (n, p), (_, q) in zip(net.named_parameters(), ref.named_parameters()):
            assert torch.allclose(p, q, rtol=1e-10, atol=1e-13), (
                f"step {step}: {n} differs from the paper's update by {(p - q).abs().max():.2e} "
                f"(wd {beta}, momentum {momentum}, clip {clip})"
            )
    assert seen["zero-norm"] >= STEPS + 1, "the zero-norm cases (zero weight, zero gradient) were not exercised"
    if clip:
        assert seen["clipped"] and seen["unclipped"], f"LARC: both sides of min(lambda, lr) should occur, saw {seen}"


def test_excluded_parameters_are_plain_sgd_without_decay():
    """Biases and BN parameters: the update is exactly PyTorch's SGD with momentum, and weight
    decay never touches them, even a large one (the same gradients fed to both, step by step)."""
    torch.manual_seed(1)
    net = Net().double()
    ref = copy.deepcopy(net)
    opt = LARS(lars_param_groups(net, 0.5, exclude=excluded), lr=LR, momentum=0.9, trust_coefficient=ETA)
    sgd = torch.optim.SGD([p for n, p in ref.named_parameters() if excluded(n, p)], lr=LR, momentum=0.9)
    for _ in range(3):
        for p, q in zip(net.parameters(), ref.parameters()):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt.step()
        sgd.step()
        for (n, p), (_, q) in zip(net.named_parameters(), ref.named_parameters()):
            if excluded(n, p):
                assert torch.allclose(p, q, rtol=1e-12, atol=1e-14), f"{n}: an excluded parameter must follow SGD"
