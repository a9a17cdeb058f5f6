"""Self-checks for stage 4: large-batch training (lab4)."""

import math
from collections.abc import Callable
from typing import Any

import torch

from ._common import CheckFailed, _call, _close, _fail, _passed  # noqa: F401

__all__ = ["check_warmup_lr", "check_trust_ratio", "check_lars_step", "check_lr_for_batch"]


def check_warmup_lr(warmup_lr: Callable[..., Any]) -> None:
    """``warmup_lr(step, base_lr, peak_lr, warmup_steps)``: the rate of optimizer step ``step``
    (0-based) under gradual warmup: ``base + (peak - base) * step / warmup_steps`` while
    ``step < warmup_steps``, then ``peak``."""
    name = "warmup_lr"
    base, peak, W = 0.1, 0.9, 8
    want = {t: (base + (peak - base) * t / W if t < W else peak) for t in (0, 1, 4, 7, 8, 20)}
    got = {t: _call(name, warmup_lr, t, base, peak, W) for t in want}
    for t, v in got.items():
        if not isinstance(v, (int, float)) and not (isinstance(v, torch.Tensor) and v.numel() == 1):
            _fail(
                name,
                f"warmup_lr({t}, ...) returned {type(v).__name__}, not a number",
                "return a float: the learning rate of that step",
            )
    if _close(got[0], 0.0) and not _close(base, 0.0):
        _fail(
            name,
            f"step 0 gives 0, but Goyal et al.'s warmup starts at the base rate ({base})",
            "ramp from base_lr to peak_lr, not from 0",
        )
    if _close(got[0], base + (peak - base) / W):
        _fail(
            name,
            f"step 0 gives {float(got[0]):.4g}: one increment too far (off by one)",
            "step 0 must run at base_lr exactly; use step / warmup_steps, not (step + 1)",
        )
    if _close(got[8], base + (peak - base) * 8 / W) and not _close(got[20], peak):
        _fail(
            name,
            f"after the warmup the rate keeps growing ({float(got[20]):.4g} at step 20)",
            "from step == warmup_steps on, return peak_lr",
        )
    for t, w in want.items():
        if not _close(got[t], w):
            _fail(
                name,
                f"step {t}: got {float(got[t]):.6g}, expected {w:.6g} (base {base}, peak {peak}, warmup_steps {W})",
                "lr = base + (peak - base) * step / warmup_steps while step < warmup_steps, else peak",
            )
    mid = _call(name, warmup_lr, 5, 0.0, 1.0, 10)
    if not _close(mid, 0.5):
        _fail(
            name,
            f"warmup_lr(5, 0.0, 1.0, 10) gave {float(mid):.4g}, expected 0.5",
            "the ramp is linear in the step number",
        )
    _passed(name, "starts at the base rate, adds a constant each step, holds the peak")


def _ref_ratio(w, g, wd, tc, eps):
    wn, gn = torch.linalg.vector_norm(w), torch.linalg.vector_norm(g)
    if wn == 0 or gn == 0:
        return 1.0
    return float(tc * wn / (gn + wd * wn + eps))


def check_trust_ratio(trust_ratio: Callable[..., Any]) -> None:
    """``trust_ratio(w, g, weight_decay, trust_coefficient, eps)`` -> the LARS local factor
    ``trust_coefficient * ||w|| / (||g|| + weight_decay * ||w|| + eps)``, 1 when a norm is 0."""
    name = "trust_ratio"
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(6, 5, generator=gen, dtype=torch.float64) * 3
    g = torch.randn(6, 5, generator=gen, dtype=torch.float64) * 0.1
    wd, tc, eps = 0.01, 0.02, 1e-9
    got = _call(name, trust_ratio, w.clone(), g.clone(), wd, tc, eps)
    want = _ref_ratio(w, g, wd, tc, eps)
    if not isinstance(got, torch.Tensor):
        _fail(
            name,
            f"returned a Python {type(got).__name__}, not a tensor",
            "keep it a tensor: torch.linalg.vector_norm and torch.where, no .item() or float() "
            "(on a GPU each would wait for the device)",
        )
    if not _close(got, want):
        no_wd = float(tc * w.norm() / (g.norm() + eps))
        inverted = float(tc * g.norm() / (w.norm() + wd * g.norm() + eps))
        if _close(got, no_wd):
            hint = "the denominator is ||g|| + weight_decay * ||w|| + eps: weight decay is missing"
        elif _close(got, inverted):
            hint = "you swapped the norms: the ratio is ||w|| over ||g||, not ||g|| over ||w||"
        elif _close(got, want / tc):
            hint = "multiply by trust_coefficient"
        else:
            hint = "use the L2 norm of the whole tensor (torch.linalg.vector_norm) for ||w|| and ||g||"
        _fail(name, f"got {float(got):.6g}, expected {want:.6g}", hint)
    for label, ww, gg in (("zero weights", torch.zeros_like(w), g), ("zero gradient", w, torch.zeros_like(g))):
        r = _call(name, trust_ratio, ww.clone(), gg.clone(), wd, tc, eps)
        if not _close(r, 1.0):
            _fail(
                name,
                f"with {label} the ratio is {float(r):.4g}, not 1",
                "when ||w|| == 0 or ||g|| == 0 return 1 (torch.where keeps it on the device)",
            )
    _passed(name, "matches the paper's formula and falls back to 1")


def check_lars_step(lars_step: Callable[..., Any]) -> None:
    """``lars_step(w, g, buf, lr, momentum, weight_decay, trust_coefficient, eps)`` -> (new_w,
    new_buf) for one tensor; ``buf`` is None on the first step. Compared with utils.optim.LARS."""
    from utils.optim import LARS

    name = "lars_step"
    gen = torch.Generator().manual_seed(5)
    w0 = torch.randn(4, 3, generator=gen, dtype=torch.float64)
    grads = [torch.randn(4, 3, generator=gen, dtype=torch.float64) * 0.5 for _ in range(3)]
    hp = dict(lr=0.5, momentum=0.9, weight_decay=0.01, trust_coefficient=0.02, eps=1e-9)
    p = torch.nn.Parameter(w0.clone())
    ref = LARS([p], **hp)
    w, buf = w0.clone(), None
    for i, g in enumerate(grads):
        p.grad = g.clone()
        ref.step()
        w_in, g_in, buf_in = w.clone(), g.clone(), None if buf is None else buf.clone()
        out = _call(
            name,
            lars_step,
            w_in,
            g_in,
            buf_in,
            hp["lr"],
            hp["momentum"],
            hp["weight_decay"],
            hp["trust_coefficient"],
            hp["eps"],
        )
        for label, before, after in (("w", w, w_in), ("g", g, g_in), ("buf", buf, buf_in)):
            if before is not None and not torch.equal(before, after):
                _fail(
                    name,
                    f"step {i}: your function changed its input {label} in place",
                    "build new tensors (w - lr * buf, momentum * buf + d) instead of in-place "
                    "updates (-=, mul_, add_) on the arguments",
                )
        if not (isinstance(out, tuple) and len(out) == 2):
            _fail(name, f"returned {type(out).__name__}, not a pair (new_w, new_buf)", "return new_w, new_buf")
        w, buf = out
        if not _close(w, p.detach(), rtol=1e-8, atol=1e-10):
            want_buf = ref.state[p]["momentum_buffer"]
            if i == 0:
                d = g + hp["weight_decay"] * w0
                ratio = _ref_ratio(w0, g, hp["weight_decay"], hp["trust_coefficient"], hp["eps"])
                if _close(w, w0 - hp["lr"] * ratio * g):
                    hint = "add weight_decay * w to the gradient before scaling it by the trust ratio"
                elif _close(w, w0 - hp["lr"] * d):
                    hint = "scale the update by the trust ratio"
                elif _close(w, w0 - ratio * d):
                    hint = "multiply the step by the global lr too"
                else:
                    hint = "on the first step buf = ratio * (g + wd * w) and w_new = w - lr * buf"
            else:
                hint = (
                    "momentum: buf = momentum * buf + ratio * (g + wd * w), then w -= lr * buf "
                    "(the ratio uses the current w and g)"
                )
            _fail(
                name,
                f"step {i}: your weights differ from utils.optim.LARS by "
                f"{float((w - p.detach()).abs().max()):.3g} (buffer off by "
                f"{float((buf - want_buf).abs().max()) if isinstance(buf, torch.Tensor) else 'n/a'})",
                hint,
            )
    _passed(name, "three steps with momentum and weight decay match utils.optim.LARS")


def check_lr_for_batch(lr_for_batch: Callable[..., Any]) -> None:
    """``lr_for_batch(base_lr, base_batch, batch, rule)`` with rule "linear" or "sqrt", compared
    with :func:`utils.schedules.lr_for_batch` (same arguments, same order)."""
    from ..schedules import lr_for_batch as reference

    name = "lr_for_batch"
    cases = [(0.1, 256, 8192, "linear"), (0.1, 256, 1024, "sqrt"), (0.05, 16, 8, "linear"), (0.05, 16, 16, "sqrt")]
    for base_lr, base_batch, batch, rule in cases:
        want = reference(base_lr, base_batch, batch, rule)  # 3.2, 0.2, 0.025, 0.05
        got = _call(name, lr_for_batch, base_lr, base_batch, batch, rule)
        if not _close(got, want):
            inverse = base_lr * (base_batch / batch if rule == "linear" else math.sqrt(base_batch / batch))
            hint = (
                "the ratio is upside down: a bigger batch gets a bigger rate (batch / base_batch)"
                if _close(got, inverse)
                else "linear: base_lr * batch / base_batch;  sqrt: base_lr * sqrt(batch / base_batch)"
            )
            _fail(
                name,
                f"lr_for_batch({base_lr}, {base_batch}, {batch}, {rule!r}) = {float(got):.6g}, expected {want:.6g}",
                hint,
            )
    _passed(name, "linear and square-root rules")
