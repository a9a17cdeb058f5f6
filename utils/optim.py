"""Optimizers: the one optimizer-by-name factory (:func:`make_optimizer`), large-batch
optimizers (LARS and its LARC clipping mode), parameter groups that switch adaptation off, and
Hoffer et al.'s multiplicative noise (each sample's gradient weighted by ``z_n ~ N(1, sigma^2)``,
done on the per-sample losses: :class:`MultiplicativeNoiseLoss`).

LARS (You, Gitman and Ginsburg 2017, arXiv 1708.03888) gives every parameter tensor (a layer's
weight) its own *local* rate. For a parameter ``w`` with gradient ``g`` in a group with global
rate ``lr``, weight decay ``wd``, momentum ``m`` and trust coefficient ``eta``, one step is::

    trust = eta * ||w|| / (||g|| + wd * ||w|| + eps)     # 1 where ||w|| == 0 or ||g|| == 0
    d     = trust * (g + wd * w)                         # weight decay joins the gradient first
    buf   = m * buf + d                                  # momentum on the scaled update
    step  = d + m * buf   if nesterov else   buf
    w     = w - lr * step                                # lr: the global rate (the schedule's)

``lr`` stays outside the momentum buffer, as in ``torch.optim.SGD`` (which LARS reduces to when
``trust`` is 1), so a warmup schedule changes the step at once. With ``clip=True`` (LARC, NVIDIA
apex's ``LARC(clip=True)``) the local rate ``trust`` is clipped at the global one, i.e. the
applied factor is ``min(trust / lr, 1)`` and the effective rate ``min(trust, lr)``.

A group with ``adapt=False`` skips the trust ratio (factor 1): plain SGD with momentum. Biases
and normalisation parameters usually go there, without weight decay
(:func:`lars_param_groups`). The factor applied at the last step is kept, per parameter, in
``optimizer.state[p]["trust_ratio"]`` (a 0-d tensor on the parameter's device) for plotting. Like
``torch.optim``'s own state tensors (Adam's ``step``, ``exp_avg``) it is updated in place by each
step: ``clone()`` it to keep a history.

No host synchronisation: norms, the zero tests and the ratio stay on the device
(``torch.where``, never ``.item()`` or a Python ``if`` on a tensor).

Multi-tensor: a step costs a fixed number of calls per parameter group, not per parameter.
``torch._foreach_norm`` gives every weight and gradient norm of a group at once, they are
stacked into one tensor, the trust ratios are computed as one tensor, and the updates are
``torch._foreach_*`` ops (``mul_``, ``addcmul_`` with the ratios as 0-d tensors, ``add_``): no
Python per parameter. On a GPU, PyTorch fuses the norms and the plain updates into a few
kernels over all tensors; the ``addcmul_`` with a different 0-d ratio per tensor takes its
per-tensor path (one kernel per tensor, launched from C++; PyTorch has no fused for-each op
with per-tensor scalars on the device, and reading them on the host would be a sync). On the
CPU every for-each op is a C++ loop. ``trust * (g + wd * w)`` is never materialised (two fused
multiply-adds instead), so LARS needs no memory beyond its momentum buffers. The lists a step
passes to those ops (momentum buffers, the ratios as 0-d views of one buffer per group) are built
once per group and parameter set and reused; building them every step (``unbind``, a dict lookup
per parameter) cost about 10% of a step on a model of 100 small tensors. Tensors on different devices
(or dtypes) in one group are stepped kind by kind. (``benchmarks/optimizer_step.py`` measures the cost
against ``torch.optim.SGD(foreach=True)``.)

How this relates to two well-known implementations:

* timm's ``timm.optim.Lars`` (``trust_coeff``, ``trust_clip``, ``always_adapt``): the same
  update with ``dampening=0``. timm adapts a group only when its ``weight_decay != 0``, unless
  ``always_adapt=True``; we adapt every group unless it says ``adapt=False``, i.e. our default
  is timm's ``always_adapt=True``, and the exclusion of biases and norm parameters is explicit
  (:func:`lars_param_groups`) instead of implied by a zero weight decay. Our ``clip=True`` is
  timm's ``trust_clip=True``. One difference at the edges: timm sets the ratio to 1 for a zero
  norm *before* clipping (so with ``lr > 1`` it applies ``1 / lr``); we clip first and then
  set 1, so a zero-norm tensor always gets exactly the plain SGD step.
* NVIDIA apex's ``apex.parallel.LARC`` (``trust_coefficient=0.02, clip=True`` by default): a
  wrapper that rescales ``p.grad`` in place, then calls the wrapped optimizer, so the momentum
  and ``lr`` sit outside the scaling exactly as here; ``clip=True`` gives the effective rate
  ``min(trust, lr)``, ``clip=False`` scales by ``trust``. Differences: apex adapts every
  parameter (no exclusion groups), modifies ``p.grad`` (we never do), and where a norm is 0 it
  skips both the scaling *and* the weight decay it took over from the optimizer; we apply
  ``d = g + wd * w`` with factor 1 there, as timm does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

OPTIMIZERS = ("sgd", "adam", "adamw")  # the names make_optimizer knows


def make_optimizer(
    name: str | Callable[[Iterable], Optimizer],
    params: Iterable,
    lr: float = 1e-3,
    *,
    momentum: float = 0.0,
    foreach: bool | None = None,
) -> Optimizer:
    """The optimizer called ``name``, the one meaning of each name in the course:

    * ``"sgd"``: ``torch.optim.SGD`` with ``momentum`` (0 by default: plain SGD, no state; give
      ``momentum=0.9`` for SGD with momentum, one buffer per parameter);
    * ``"adam"``, ``"adamw"``: ``torch.optim.Adam`` / ``AdamW`` (two moments per parameter);
      ``momentum`` must stay 0 (Adam's betas are its momentum).

    ``foreach=False`` steps one parameter at a time (the step's temporaries stay one tensor
    wide, as the memory demos want); None lets PyTorch choose. A callable ``name`` is called
    as ``name(params)``, for an optimizer the names do not cover."""
    if callable(name):
        return name(params)
    if not isinstance(name, str):
        raise TypeError(
            f"optimizer must be a name ({', '.join(OPTIMIZERS)}) or a function params -> optimizer, "
            f"got {type(name).__name__}"
        )
    kind = name.lower()
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, foreach=foreach)
    if kind in ("adam", "adamw"):
        if momentum:
            raise ValueError(f"momentum={momentum} is for 'sgd'; {name!r} has its betas")
        cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW
        return cls(params, lr=lr, foreach=foreach)
    raise ValueError(
        f"unknown optimizer {name!r}; use one of {', '.join(OPTIMIZERS)}, or pass a function params -> optimizer"
    )


def _check_number(name: str, value, *, low: float = 0.0, strict: bool = False) -> float:
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a Python number, got a tensor; pass float({name})")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < low or (strict and value == low):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {low}, got {value}")
    return float(value)


class LARS(Optimizer):
    """Layer-wise Adaptive Rate Scaling on top of SGD with momentum (see the module docstring
    for the exact update).

    Args:
        params: parameters or parameter groups; a group may set ``adapt`` (bool) and any of the
            keyword arguments below.
        lr: global learning rate (> 0).
        momentum: in [0, 1).
        weight_decay: L2 coefficient (>= 0), added to the gradient before scaling.
        trust_coefficient: ``eta`` of the paper (> 0; 0.001 there).
        eps: added to the trust ratio's denominator (>= 0).
        nesterov: Nesterov momentum (needs momentum > 0).
        clip: LARC mode: clip the local rate at the global one.
        adapt: use the trust ratio (default for groups that do not say).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        eps: float = 1e-8,
        nesterov: bool = False,
        clip: bool = False,
        adapt: bool = True,
    ):
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            trust_coefficient=trust_coefficient,
            eps=eps,
            nesterov=nesterov,
            clip=clip,
            adapt=adapt,
        )
        self._validate(defaults)
        self._lists = {}  # per group: the lists a step reuses (_group_lists)
        super().__init__(params, defaults)  # calls add_param_group, which validates each group

    @staticmethod
    def _validate(group: dict) -> None:
        _check_number("lr", group["lr"], strict=True)
        m = _check_number("momentum", group["momentum"])
        if m >= 1:
            raise ValueError(f"momentum must be in [0, 1), got {m}")
        _check_number("weight_decay", group["weight_decay"])
        _check_number("trust_coefficient", group["trust_coefficient"], strict=True)
        _check_number("eps", group["eps"])
        for flag in ("nesterov", "clip", "adapt"):
            if not isinstance(group[flag], bool):
                raise ValueError(f"{flag} must be True or False, got {group[flag]!r}")
        if group["nesterov"] and m == 0:
            raise ValueError("nesterov=True needs momentum > 0")

    def add_param_group(self, param_group: dict) -> None:
        self._validate({**self.defaults, **param_group})  # before the group is added
        super().add_param_group(param_group)
        self._lists = {}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._lists = {}  # the state's tensors were replaced

    def __setstate__(self, state):
        super().__setstate__(state)
        self._lists = {}
        for group in self.param_groups:
            for k, v in self.defaults.items():
                group.setdefault(k, v)

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads = [], []
            for p in group["params"]:
                if p.grad is not None:
                    params.append(p)
                    grads.append(p.grad)
            if not params:
                continue
            if any(g.is_sparse for g in grads):
                raise RuntimeError("LARS does not support sparse gradients")
            kinds = {(p.device, p.dtype) for p in params}
            if len(kinds) == 1:  # the usual case: one list for the group
                self._step_tensors(group, params, grads, 0)
            else:  # stacked norms need one device; the 0-d scalars one dtype (see scalar())
                for k, kind in enumerate(sorted(kinds, key=str)):
                    idx = [i for i, p in enumerate(params) if (p.device, p.dtype) == kind]
                    self._step_tensors(group, [params[i] for i in idx], [grads[i] for i in idx], k)
        return loss

    def _group_lists(self, group: dict, params: list, part: int):
        """(momentum buffers, ratio buffer, its 0-d views, weight-decay ratio buffer, its views)
        for these ``params`` of ``group``, built on first use and reused while the group steps the
        same parameters with the same state (a changed set, ``load_state_dict`` or a cleared
        ``state`` builds them again)."""
        key = (id(group), part)
        ids = (group["momentum"] != 0, group["adapt"], *map(id, params))
        cached = self._lists.get(key)
        if (
            cached is not None
            and cached[0] == ids
            and (not cached[1] or self.state[params[0]].get("momentum_buffer") is cached[1][0])
        ):
            return cached[1:]
        bufs = self._momentum_buffers(params) if group["momentum"] != 0 else []
        ratio = ratio_wd = ratios = ratios_wd = None
        if group["adapt"]:
            ratio = torch.ones(len(params), dtype=params[0].dtype, device=params[0].device)
            ratios = ratio.unbind(0)  # 0-d views, one per parameter
            ratio_wd = torch.empty_like(ratio)
            ratios_wd = ratio_wd.unbind(0)
            for p, r in zip(params, ratios):
                self.state[p]["trust_ratio"] = r
        self._lists[key] = (ids, bufs, ratio, ratios, ratio_wd, ratios_wd)
        return bufs, ratio, ratios, ratio_wd, ratios_wd

    def _step_tensors(self, group: dict, params: list, grads: list, part: int) -> None:
        """One step of ``group``'s rule for ``params`` (one device, one dtype), every tensor at once."""
        lr, m, wd, nesterov = group["lr"], group["momentum"], group["weight_decay"], group["nesterov"]
        bufs, ratio_buf, ratios, ratio_wd_buf, ratios_wd = self._group_lists(group, params, part)
        on_cpu = params[0].device.type == "cpu"

        def scalar(v):
            # PyTorch's CPU for-each ops turn a Python number into a tensor once per list entry,
            # which costs more than the op itself on a small tensor; a 0-d tensor is made once.
            # It has the parameters' dtype, as the number would be cast to. (On a GPU the number
            # is a kernel argument; a tensor there would need a copy.)
            return torch.tensor(v, dtype=params[0].dtype) if on_cpu else v

        if not group["adapt"]:  # SGD with momentum, as torch.optim.SGD
            d = grads  # d = g + wd * w, never written into p.grad
            if wd != 0:
                d = torch._foreach_mul(params, scalar(wd))
                torch._foreach_add_(d, grads)
            if m == 0:
                torch._foreach_add_(params, d, alpha=-lr)
                return
            torch._foreach_mul_(bufs, scalar(m))
            torch._foreach_add_(bufs, d)  # buf = m * buf + d
            if nesterov:  # w -= lr * (d + m * buf)
                torch._foreach_add_(params, d, alpha=-lr)
                torch._foreach_add_(params, bufs, alpha=-lr * m)
            else:  # w -= lr * buf
                torch._foreach_add_(params, bufs, alpha=-lr)
            return

        # The trust ratios: every weight and gradient norm at once, then one tensor of ratios.
        n = len(params)
        norms = torch.stack(torch._foreach_norm(params + grads))
        w_norm, g_norm = norms[:n], norms[n:]
        ratio = (group["trust_coefficient"] * w_norm) / (g_norm + wd * w_norm + group["eps"])
        if group["clip"]:  # LARC: local rate min(trust, lr)
            ratio = torch.clamp(ratio / lr, max=1.0)
        # 1 where either norm is 0 (a fresh zero-initialised layer, or no gradient): torch.where
        # on the device, never .item() or a Python branch on a tensor
        ratio = torch.where(torch.minimum(w_norm, g_norm) > 0, ratio, 1.0)
        ratio_buf.copy_(ratio)  # `ratios` (and the state) are its views
        # trust * d = trust * g + (trust * wd) * w: two fused multiply-adds, d never materialised
        if wd != 0:
            torch.mul(ratio, wd, out=ratio_wd_buf)
        else:
            ratios_wd = None
        if m == 0:  # w -= lr * trust * (g + wd * w)
            if ratios_wd is not None:  # the decay term first: it reads the old w
                torch._foreach_addcmul_(params, params, ratios_wd, value=-lr)
            torch._foreach_addcmul_(params, grads, ratios, value=-lr)
            return
        torch._foreach_mul_(bufs, scalar(m))  # buf = m * buf + trust * d
        torch._foreach_addcmul_(bufs, grads, ratios)
        if ratios_wd is not None:
            torch._foreach_addcmul_(bufs, params, ratios_wd)
        if nesterov:  # w -= lr * (trust * d + m * buf)
            if ratios_wd is not None:
                torch._foreach_addcmul_(params, params, ratios_wd, value=-lr)
            torch._foreach_addcmul_(params, grads, ratios, value=-lr)
            torch._foreach_add_(params, bufs, alpha=-lr * m)
        else:  # w -= lr * buf
            torch._foreach_add_(params, bufs, alpha=-lr)

    def _momentum_buffers(self, params: list) -> list:
        """Each parameter's momentum buffer, created (zeros) on its first step: m * 0 + d = d,
        the first buffer of torch.optim.SGD."""
        bufs = []
        for p in params:
            state = self.state[p]
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            bufs.append(buf)
        return bufs

    def trust_ratios(self, model: nn.Module | None = None) -> dict:
        """{name: last applied factor (0-d device tensor)} for every adapted parameter that has
        stepped; names come from ``model.named_parameters()`` when a model is given, else they
        are ``"group{i}.param{j}"``. Reading the values (``float(t)``) is a sync point."""
        names = {p: n for n, p in model.named_parameters()} if model is not None else {}
        out = {}
        for i, group in enumerate(self.param_groups):
            for j, p in enumerate(group["params"]):
                r = self.state.get(p, {}).get("trust_ratio")
                if r is not None:
                    out[names.get(p, f"group{i}.param{j}")] = r
        return out


def is_excluded(name: str, param: torch.Tensor) -> bool:
    """The usual exclusion: biases and normalisation parameters (anything with fewer than two
    dimensions) get neither the trust ratio nor weight decay."""
    return param.ndim < 2


def lars_param_groups(
    model: nn.Module, weight_decay: float = 0.0, exclude: Callable[[str, torch.Tensor], bool] = is_excluded
) -> list[dict]:
    """Two parameter groups for :class:`LARS` (or SGD): ``{"params": [...], "weight_decay": wd,
    "adapt": True}`` for the weights and ``{"params": [...], "weight_decay": 0.0, "adapt":
    False}`` for what ``exclude(name, param)`` picks (default: ``param.ndim < 2``). Frozen
    parameters are left out; an empty group is dropped."""
    _check_number("weight_decay", weight_decay)
    adapted, excluded = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (excluded if exclude(name, p) else adapted).append(p)
    groups = [
        {"params": adapted, "weight_decay": float(weight_decay), "adapt": True},
        {"params": excluded, "weight_decay": 0.0, "adapt": False},
    ]
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise ValueError("the model has no trainable parameters")
    return groups


# ----------------------------------------------------------------------------------------
# Multiplicative noise on per-sample gradients (Hoffer, Hubara and Soudry 2017)
# ----------------------------------------------------------------------------------------


def noise_sigma(batch_size: int, small_batch: int) -> float:
    """The sigma of :class:`MultiplicativeNoiseLoss` that makes a ``batch_size`` gradient about
    as noisy as a ``small_batch`` one: ``sqrt(batch_size / small_batch - 1)``.

    Why: with weights ``z_n ~ N(1, sigma^2)`` the gradient is ``(1/B) sum z_n g_n``. Given the
    batch, its added noise has covariance ``(sigma^2 / B^2) sum g_n g_n^T``, about
    ``(sigma^2 / B) E[g g^T]``. With the batch's own sampling noise ``Sigma / B`` the total is
    about ``(1 + sigma^2) Sigma / B`` when the mean gradient is small against the noise. It
    equals the small batch's ``Sigma / small_batch`` when ``1 + sigma^2 = B / small_batch``.
    So ``sigma^2`` grows in proportion to the batch, as Hoffer et al. ask."""
    if batch_size < 1 or small_batch < 1:
        raise ValueError(f"batch sizes must be >= 1, got {batch_size} and {small_batch}")
    if batch_size < small_batch:
        raise ValueError(f"batch_size ({batch_size}) must be >= small_batch ({small_batch}): noise is only added")
    return math.sqrt(batch_size / small_batch - 1)


def sample_weighted_loss(
    per_sample_loss: torch.Tensor, sigma: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """``mean(z_n * loss_n)`` with one ``z_n ~ N(1, sigma^2)`` per sample (the batch's first
    dimension). Its gradient is ``(1/B) sum z_n g_n``: Hoffer et al.'s multiplicative noise,
    each *sample's* gradient weighted, exactly and for the cost of B random numbers.
    ``generator`` must live on the loss's device."""
    sigma = _check_number("sigma", sigma)
    if sigma == 0:
        return per_sample_loss.mean()
    n = per_sample_loss.shape[0]
    z = torch.randn(n, generator=generator, device=per_sample_loss.device, dtype=per_sample_loss.dtype)
    z = z.mul_(sigma).add_(1.0).view(n, *([1] * (per_sample_loss.dim() - 1)))
    return (z * per_sample_loss).mean()


class MultiplicativeNoiseLoss:
    """A loss function for :func:`utils.train.fit` (``loss_fn=``) that weights each sample's
    loss by its own ``z_n ~ N(1, sigma^2)`` (see :func:`sample_weighted_loss`).

    ``loss`` is a per-sample loss called as ``loss(output, target, reduction="none")``
    (default: cross-entropy). Without autograd (``torch.no_grad``, as in
    :func:`utils.train.evaluate`) it returns the plain mean, so validation losses stay clean."""

    def __init__(
        self, sigma: float, loss: Callable[..., torch.Tensor] | None = None, generator: torch.Generator | None = None
    ):
        self.sigma = _check_number("sigma", sigma)
        self.loss = loss or nn.functional.cross_entropy
        self.generator = generator

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        per_sample = self.loss(output, target, reduction="none")
        if not torch.is_grad_enabled():
            return per_sample.mean()
        return sample_weighted_loss(per_sample, self.sigma, self.generator)

    def __repr__(self):
        return f"MultiplicativeNoiseLoss(sigma={self.sigma:g})"


__all__ = [
    "make_optimizer",
    "OPTIMIZERS",
    "LARS",
    "lars_param_groups",
    "is_excluded",
    "noise_sigma",
    "sample_weighted_loss",
    "MultiplicativeNoiseLoss",
]
