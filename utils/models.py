"""Models used across the series: linear, the one MLP builder, the lecture CNN, a ResNet-9-style
CIFAR net; norm layers."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def count_parameters(model: nn.Module, trainable_only: bool = True) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


class LinearModel(nn.Module):
    """Flatten, then one linear layer: y = W x + b. ``LinearModel(1, 1)`` is y = w*x + b."""

    def __init__(self, in_features: int, out_features: int = 1):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1))


_ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}
_NORMS_1D = {"none": None, "batch": nn.BatchNorm1d, "layer": nn.LayerNorm}


def mlp(
    width: int,
    depth: int,
    *,
    in_features: int | None = None,
    out_features: int | None = None,
    expand: int | None = None,
    activation: str = "relu",
    norm: str = "none",
    flatten: bool = False,
    seed: int | None = None,
) -> nn.Sequential:
    """The course's one multilayer perceptron, flat enough that ``model[i]`` is the i-th layer.

    Layers (``expand=None``): ``depth`` Linear layers ``in_features -> width -> ... -> width ->
    out_features`` (both default to ``width``); every one but the last is followed by ``norm``
    ("none", "batch" = BatchNorm1d, "layer") and ``activation`` ("relu", "gelu", "tanh").
    ``flatten=True`` puts an ``nn.Flatten`` first (images in).

    Blocks (``expand=k``): ``depth`` blocks, each Linear(width, k*width), activation,
    Linear(k*width, width): the MLP half of a transformer layer; ``model[i]`` is block i
    (``in_features``, ``out_features``, ``norm`` and ``flatten`` must be left out).

    ``seed=None``: PyTorch's default initialisation, from the global RNG (seed it first for
    reproducible weights). ``seed=s``: every Linear's weight, then bias, in order, drawn
    uniformly from +-1/sqrt(in_features) (PyTorch's default bounds) with a generator seeded
    with ``s``, whatever the global RNG: same ``seed``, same weights."""
    if width < 1 or depth < 1:
        raise ValueError(f"width and depth must be >= 1, got {width} and {depth}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; use one of {', '.join(_ACTIVATIONS)}")
    if norm not in _NORMS_1D:
        raise ValueError(f"unknown norm {norm!r}; use one of {', '.join(_NORMS_1D)}")
    act = _ACTIVATIONS[activation]
    if expand is not None:
        if expand < 1:
            raise ValueError(f"expand must be >= 1, got {expand}")
        if in_features not in (None, width) or out_features not in (None, width) or norm != "none" or flatten:
            raise ValueError("a block MLP maps width to width: leave in_features, out_features, norm and flatten out")
        layers = [
            nn.Sequential(nn.Linear(width, expand * width), act(), nn.Linear(expand * width, width))
            for _ in range(depth)
        ]
    else:
        sizes = [in_features or width] + [width] * (depth - 1) + [out_features or width]
        layers = [nn.Flatten()] if flatten else []
        for i in range(depth):
            layers.append(nn.Linear(sizes[i], sizes[i + 1]))
            if i < depth - 1:
                if _NORMS_1D[norm] is not None:
                    layers.append(_NORMS_1D[norm](sizes[i + 1]))
                layers.append(act())
    model = nn.Sequential(*layers)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for lin in (m for m in model.modules() if isinstance(m, nn.Linear)):
                bound = 1 / math.sqrt(lin.in_features)
                lin.weight.uniform_(-bound, bound, generator=g)
                lin.bias.uniform_(-bound, bound, generator=g)
    return model


class Net(nn.Module):
    """The Lecture 19 demo CNN: the PyTorch CIFAR-10 tutorial net with its first convolution
    widened to ``width`` channels (the CNN's width). At 128 on 3x32x32 it has exactly 120,078 parameters.

    conv(C -> width, 5x5) -> ReLU -> maxpool 2 -> conv(width -> 16, 5x5) -> ReLU -> maxpool 2
    -> linear(16*h*w -> 120) -> ReLU -> linear(120 -> 84) -> ReLU -> linear(84 -> classes).

    Other input shapes work: the flatten size is computed from ``image_size``; images smaller
    than 20 pixels (digits are 8x8) get 'same' padding (2) so two 5x5 convolutions fit.
    """

    def __init__(self, width: int = 128, in_channels: int = 3, num_classes: int = 10, image_size: int = 32):
        super().__init__()
        pad = 0 if image_size >= 20 else 2
        self.conv1 = nn.Conv2d(in_channels, width, 5, padding=pad)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(width, 16, 5, padding=pad)
        side = image_size
        for _ in range(2):
            side = (side + 2 * pad - 4) // 2
        if side < 1:
            raise ValueError(f"image_size {image_size} is too small for Net")
        self.fc1 = nn.Linear(16 * side * side, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def net_for(shape: tuple[int, int, int], width: int = 128, num_classes: int = 10) -> Net:
    """The lecture CNN sized for images of ``shape`` = (C, H, W), e.g. ``Splits.shape``."""
    c, h, w = shape
    if h != w:
        raise ValueError(f"Net expects square images, got {h}x{w}")
    return Net(width, in_channels=c, num_classes=num_classes, image_size=h)


class GhostBatchNorm2d(nn.BatchNorm2d):
    """Batch norm whose statistics are taken over virtual batches of ``virtual_batch_size``
    (Hoffer et al. 2017). In eval mode, and when the batch is no larger than the virtual batch,
    it is exactly ``nn.BatchNorm2d``. The running statistics are updated once per virtual batch
    (each with ``momentum``), so they lean towards the last virtual batches of a step."""

    def __init__(self, num_features: int, virtual_batch_size: int = 32, **kw):
        super().__init__(num_features, **kw)
        if virtual_batch_size < 1:
            raise ValueError("virtual_batch_size must be >= 1")
        self.virtual_batch_size = virtual_batch_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or x.shape[0] <= self.virtual_batch_size:
            return super().forward(x)
        chunks = x.split(self.virtual_batch_size)
        return torch.cat([super(GhostBatchNorm2d, self).forward(c) for c in chunks])


def norm_layer(kind: str, channels: int, ghost_batch_size: int = 32) -> nn.Module:
    if kind == "bn":
        return nn.BatchNorm2d(channels)
    if kind == "ghost":
        return GhostBatchNorm2d(channels, ghost_batch_size)
    if kind == "group":
        return nn.GroupNorm(min(32, channels), channels)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"unknown norm {kind!r}; use 'bn', 'ghost', 'group' or 'none'")


def _conv_block(c_in, c_out, norm, ghost, pool=False):
    layers = [
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=norm == "none"),
        norm_layer(norm, c_out, ghost),
        nn.ReLU(inplace=True),
    ]
    if pool:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


class Residual(nn.Module):
    def __init__(self, channels: int, norm: str, ghost: int):
        super().__init__()
        self.body = nn.Sequential(
            _conv_block(channels, channels, norm, ghost), _conv_block(channels, channels, norm, ghost)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class ResNet9(nn.Module):
    """David Page's DAWNBench ResNet-9 family: prep, (layer + residual), layer, (layer + residual),
    global max-pool, linear. ``width`` is the prep layer's channels (64 in the original; stages
    use 1x, 2x, 4x, 8x), ``norm`` one of bn / ghost / group / none."""

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 3,
        width: int = 64,
        norm: str = "bn",
        ghost_batch_size: int = 32,
        scale: float = 0.125,
    ):
        super().__init__()
        w1, w2, w3, w4 = width, 2 * width, 4 * width, 8 * width
        self.net = nn.Sequential(
            _conv_block(in_channels, w1, norm, ghost_batch_size),
            _conv_block(w1, w2, norm, ghost_batch_size, pool=True),
            Residual(w2, norm, ghost_batch_size),
            _conv_block(w2, w3, norm, ghost_batch_size, pool=True),
            _conv_block(w3, w4, norm, ghost_batch_size, pool=True),
            Residual(w4, norm, ghost_batch_size),
            nn.AdaptiveMaxPool2d(1),
            nn.Flatten(),
        )
        self.fc = nn.Linear(w4, num_classes, bias=False)
        self.scale = scale  # Page's output scaling: keeps early logits small

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.net(x)) * self.scale


def build(name: str, shape: tuple[int, int, int] = (3, 32, 32), num_classes: int = 10, **kw: Any) -> nn.Module:
    """A model by name: ``linear``, ``net`` (the lecture CNN) or ``resnet9``."""
    c, h, w = shape
    if name == "linear":
        return LinearModel(c * h * w, num_classes)
    if name == "net":
        return net_for(shape, num_classes=num_classes, **kw)
    if name == "resnet9":
        return ResNet9(num_classes=num_classes, in_channels=c, **kw)
    raise ValueError(f"unknown model {name!r}; use 'linear', 'net' or 'resnet9'")
