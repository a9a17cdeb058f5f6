"""Self-checks for stage 4: large-batch training (lab4)."""

import math
from collections.abc import Callable
from typing import Any

import torch

from ._common import CheckFailed, _call, _close, _fail, _passed  # noqa: F401

__all__ = [
    "check_warmup_lr",
    "check_trust_ratio",
    "check_lars_step",
    "check_lr_for_batch",
    "check_lars_optimizer",
    "check_ghost_batch_norm",
]


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
            "from step == warmup_steps on, the rate stays at the peak",
        )
    for t, w in want.items():
        if not _close(got[t], w):
            _fail(
                name,
                f"step {t}: got {float(got[t]):.6g}, expected {w:.6g} (base {base}, peak {peak}, warmup_steps {W})",
                "inside the warmup, a straight line from base_lr at step 0 to peak_lr at step warmup_steps; then the peak",
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
    # A batch of three (w, g) pairs under torch.func.vmap: .item(), float() or a Python `if` on a tensor
    # cannot run there, exactly the host synchronisations the exercise rules out.
    code = getattr(trust_ratio, "__code__", None)
    sync = sorted({"item", "tolist"} & set(code.co_names)) if code is not None else []
    ws, gs = torch.stack([w, torch.zeros_like(w), w]), torch.stack([g, g, torch.zeros_like(g)])
    try:
        batched = torch.func.vmap(lambda a, b: trust_ratio(a, b, wd, tc, eps))(ws, gs)
        ok = isinstance(batched, torch.Tensor) and _close(batched, torch.tensor([want, 1.0, 1.0], dtype=w.dtype))
    except Exception:  # noqa: BLE001 (any failure under vmap is the same finding)
        ok = False
    if sync or not ok:
        _fail(
            name,
            "the right values, but your function reads a tensor back to Python "
            f"({'.' + sync[0] + '()' if sync else '.item(), float() or an `if` on a tensor'}): on a GPU it waits",
            "keep the norms and the fallback as tensors: choose between the ratio and 1 with torch.where",
        )
    _passed(name, "matches the paper's formula and falls back to 1, all on tensors (it runs under vmap)")


def check_lars_step(lars_step: Callable[..., Any]) -> None:
    """``lars_step(w, g, buf, lr, momentum, weight_decay, trust_coefficient, eps)`` -> (new_w,
    new_buf) for one tensor; ``buf`` is None on the first step. Compared with utils.optim.LARS."""
    from utils.optim import LARS

    name = "lars_step"
    gen = torch.Generator().manual_seed(5)
    w0 = torch.randn(4, 3, generator=gen, dtype=torch.float64)
    grads = [torch.randn(4, 3, generator=gen, dtype=torch.float64) * 0.5 for _ in range(3)]
    hp = dict(lr=0.5, momentum=0.9, weight_decay=0.01, trust_coefficient=0.02, eps=1e-9)
    lrs = [0.5, 0.2, 0.8]  # a schedule changes lr between steps
    p = torch.nn.Parameter(w0.clone())
    ref = LARS([p], **hp)
    w, buf = w0.clone(), None
    for i, g in enumerate(grads):
        hp["lr"] = ref.param_groups[0]["lr"] = lrs[i]
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
        want_buf = ref.state[p]["momentum_buffer"]
        lr_inside = isinstance(buf, torch.Tensor) and _close(buf, hp["lr"] * want_buf, rtol=1e-8, atol=1e-10)
        if i > 0 and isinstance(buf_in, torch.Tensor) and not _close(w, p.detach(), rtol=1e-8, atol=1e-10):
            ratio = _ref_ratio(w_in, g, hp["weight_decay"], hp["trust_coefficient"], hp["eps"])
            d = ratio * (g + hp["weight_decay"] * w_in)
            lr_inside = lr_inside or _close(w, w_in - (hp["momentum"] * buf_in + hp["lr"] * d), rtol=1e-8, atol=1e-10)
        if lr_inside:
            _fail(
                name,
                f"step {i}: lr went into the momentum buffer (buf = momentum * buf + lr * d): "
                "when a schedule changes lr, the past updates keep their old rate",
                "keep lr out of the buffer: the buffer holds the scaled updates, lr multiplies it in the weight step",
            )
        if not _close(w, p.detach(), rtol=1e-8, atol=1e-10):
            problem = (
                f"step {i}: your weights differ from utils.optim.LARS by {float((w - p.detach()).abs().max()):.3g}"
            )
            hint = (
                "momentum: the new buffer is momentum times the old one plus this step's scaled update; "
                "the trust ratio uses the current w and g"
            )
            if i == 0:
                d = g + hp["weight_decay"] * w0
                ratio = _ref_ratio(w0, g, hp["weight_decay"], hp["trust_coefficient"], hp["eps"])
                hint = "on the first step the buffer is the scaled update itself, and the weights move by lr times it"
                if _close(w, w0 - hp["lr"] * (ratio * g + hp["weight_decay"] * w0)):
                    problem = "step 0: weight decay was added after the trust-ratio scaling, so it escapes the ratio"
                    hint = "add weight_decay * w to the gradient first, then scale the sum by the trust ratio"
                elif _close(w, w0 - hp["lr"] * ratio * g):
                    problem = "step 0: weight decay is missing from the update"
                    hint = "add weight_decay * w to the gradient before scaling it by the trust ratio"
                elif _close(w, w0 - hp["lr"] * d):
                    problem = "step 0: the update was not scaled by the trust ratio"
                    hint = "multiply the weight-decayed gradient by your trust_ratio"
                elif _close(w, w0 - ratio * d):
                    problem = "step 0: the global lr is missing from the weight step"
                    hint = "multiply the step by the global lr too"
            _fail(name, problem, hint)
        if not (isinstance(buf, torch.Tensor) and _close(buf, want_buf, rtol=1e-8, atol=1e-10)):
            _fail(
                name,
                f"step {i}: the weights are right but the returned buffer is not the one LARS keeps",
                "return the new momentum buffer itself (the scaled updates accumulated with momentum, without lr)",
            )
    _passed(name, "three steps with momentum, weight decay and a changing lr match utils.optim.LARS")


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
                "the ratio is upside down: a bigger batch gets a bigger rate (the new batch over the base one)"
                if _close(got, inverse)
                else "linear: the base rate times the batch growth factor;  sqrt: times its square root "
                "(beware integer division)"
            )
            _fail(
                name,
                f"lr_for_batch({base_lr}, {base_batch}, {batch}, {rule!r}) = {float(got):.6g}, expected {want:.6g}",
                hint,
            )
    try:
        got = lr_for_batch(0.1, 256, 1024, "cubic")
    except ValueError:
        got = ValueError
    except Exception as e:  # noqa: BLE001
        _fail(
            name,
            f"an unknown rule raised {type(e).__name__}, not ValueError",
            "for any rule but linear and sqrt, raise ValueError with a message that names the rule",
        )
    if got is not ValueError:
        _fail(
            name,
            f"lr_for_batch(0.1, 256, 1024, 'cubic') returned {got!r}: a misspelt rule would train at a wrong rate",
            "for any rule but linear and sqrt, raise ValueError with a message that names the rule",
        )
    _passed(name, "linear and square-root rules; an unknown rule raises ValueError")


# ---------------------------------------------------------------- LARS as a torch.optim.Optimizer

_LARS_HP = dict(lr=0.4, momentum=0.9, weight_decay=0.01, trust_coefficient=0.02, eps=1e-9)
_LARS_STEPS = 4


class _LarsVariant(torch.optim.Optimizer):
    """A plain per-tensor LARS with switches that reproduce the usual slips, for diagnosis only
    (the oracle is utils.optim.LARS). Groups carry ``adapt`` as in lars_param_groups."""

    def __init__(self, params, adapt_all=False, wd_after=False, keep_buffer=True, fixed_lr=None, **hp):
        self.flags = dict(adapt_all=adapt_all, wd_after=wd_after, keep_buffer=keep_buffer, fixed_lr=fixed_lr)
        super().__init__(params, hp)

    @torch.no_grad()
    def step(self, closure=None):
        f = self.flags
        for group in self.param_groups:
            lr = f["fixed_lr"] or group["lr"]
            wd, m = group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                adapt = group["adapt"] or f["adapt_all"]
                r = _ref_ratio(p, g, wd, group["trust_coefficient"], group["eps"]) if adapt else 1.0
                d = r * g + wd * p if f["wd_after"] else r * (g + wd * p)
                buf = self.state[p].get("buf")
                buf = d.clone() if buf is None or not f["keep_buffer"] else m * buf + d
                self.state[p]["buf"] = buf
                p.sub_(lr * buf)


def _lars_model() -> torch.nn.Module:
    torch.manual_seed(41)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
    ).double()
    model.unused = torch.nn.Parameter(torch.randn(2, 2, dtype=torch.float64))  # never gets a gradient
    return model


def _lars_batches():
    gen = torch.Generator().manual_seed(42)
    return [
        (torch.randn(16, 6, generator=gen, dtype=torch.float64), torch.randint(0, 3, (16,), generator=gen))
        for _ in range(_LARS_STEPS)
    ]


def _lars_groups(model, exclude_key: bool):
    from ..optim import lars_param_groups

    groups = lars_param_groups(model, _LARS_HP["weight_decay"])
    if exclude_key:  # the exercise's interface: "exclude" instead of the library's "adapt"
        groups = [{"params": g["params"], "weight_decay": g["weight_decay"], "exclude": not g["adapt"]} for g in groups]
    return groups


def _lars_lr(step: int) -> float:
    return _LARS_HP["lr"] * (0.5 if step >= 2 else 1.0)  # a schedule changes the group's lr


def _lars_run(make_opt, steps=_LARS_STEPS):
    """[parameters after each step] of the check's model trained with ``make_opt(groups)``."""
    model = _lars_model()
    opt = make_opt(model)
    out = []
    for t, (x, y) in enumerate(_lars_batches()[:steps]):
        for g in opt.param_groups:
            g["lr"] = _lars_lr(t)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        out.append([p.detach().clone() for p in model.parameters()])
    return out


def check_lars_optimizer(cls: Any) -> None:
    """``cls(params, lr, momentum, weight_decay, trust_coefficient, eps)``: a torch.optim.Optimizer
    that does LARS for groups with ``exclude`` False and SGD with momentum for groups with
    ``exclude`` True. Four steps on a small model (a schedule halves lr at step 2) are compared
    with utils.optim.LARS, parameter by parameter, after every step."""
    from ..optim import LARS

    name = "MyLARS"
    if not isinstance(cls, type):
        _fail(name, f"got {type(cls).__name__}, not a class", "pass the class itself: check_lars_optimizer(MyLARS)")
    if issubclass(cls, LARS):
        _fail(
            name,
            "your class subclasses utils.optim.LARS, the library's own implementation",
            "subclass torch.optim.Optimizer and write the step yourself",
        )
    if not issubclass(cls, torch.optim.Optimizer):
        _fail(name, "your class is not a torch.optim.Optimizer", "class MyLARS(torch.optim.Optimizer): ...")

    oracle = _lars_run(lambda m: LARS(_lars_groups(m, False), **_LARS_HP))
    model = _lars_model()
    opt = _call(name, cls, _lars_groups(model, True), **_LARS_HP)
    if any(isinstance(v, LARS) for v in vars(opt).values()):
        _fail(
            name,
            "your optimizer wraps utils.optim.LARS, the library's own implementation",
            "keep the momentum buffers in the per-parameter state (self.state) and update the parameters yourself",
        )
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    excluded = {id(p) for g in _lars_groups(model, False) if not g["adapt"] for p in g["params"]}
    calls = []
    real_step = LARS.step

    def spy(self, *a, **k):
        calls.append(1)
        return real_step(self, *a, **k)

    for t, (x, y) in enumerate(_lars_batches()):
        for g in opt.param_groups:
            g["lr"] = _lars_lr(t)
        before = [p.detach().clone() for p in params]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        LARS.step = spy
        try:
            _call(name, opt.step)
        except CheckFailed as e:
            cause = str(e.__cause__ or "")
            if "leaf Variable that requires grad" in cause:
                _fail(
                    name,
                    "an in-place update of a parameter ran with autograd on",
                    "update the parameters with autograd off (torch.no_grad, as a context or a decorator of step)",
                )
            if "NoneType" in cause:
                _fail(
                    name,
                    "a parameter without a gradient (its .grad is None) made your step crash",
                    "skip parameters whose .grad is None, as torch.optim.SGD does",
                )
            raise
        finally:
            LARS.step = real_step
        if calls:
            _fail(
                name,
                "your step calls utils.optim.LARS, the library's own implementation",
                "compute the trust ratio and the momentum update yourself (your trust_ratio and lars_step may help)",
            )
        for p in params:
            for v in opt.state.get(p, {}).values():
                if isinstance(v, torch.Tensor) and (v.requires_grad or v.grad_fn is not None):
                    _fail(
                        name,
                        "a momentum buffer in self.state is part of the autograd graph",
                        "run the update with autograd off (torch.no_grad) so the buffers are plain tensors",
                    )
        if t == 0 and all(torch.equal(b, p.detach()) for b, p in zip(before, params)):
            _fail(
                name,
                "after one step no parameter has changed",
                "update each parameter in place (p.add_(...) or p.sub_(...)) under torch.no_grad(); "
                "`p = p - ...` only rebinds a local name",
            )
        got = [p.detach() for p in params]
        bad = [i for i, (a, b) in enumerate(zip(got, oracle[t])) if not _close(a, b, rtol=1e-7, atol=1e-10)]
        if not bad:
            continue
        if all(id(params[i]) in excluded for i in bad) and t == 0:
            hint = (
                "parameters in a group with exclude=True (biases, norm weights) get plain SGD with momentum: "
                "no trust ratio"
            )
            problem = (
                f"step {t}: the excluded parameters ({', '.join(names[i] for i in bad)}) differ from utils.optim.LARS"
            )
        else:
            problem = (
                f"step {t}: {', '.join(names[i] for i in bad)} differ from utils.optim.LARS by "
                f"{max(float((got[i] - oracle[t][i]).abs().max()) for i in bad):.3g}"
            )
            hint = "per parameter: d = trust * (g + weight_decay * w), buf = momentum * buf + d, w -= lr * buf"
        variants = [
            (dict(adapt_all=True), "you applied the trust ratio to the excluded group too", hint),
            (
                dict(wd_after=True),
                "weight decay was added after the trust ratio",
                "add weight_decay * w to the gradient first, then scale the sum by the trust ratio",
            ),
            (
                dict(keep_buffer=False),
                "the momentum buffer is not kept from one step to the next",
                "store each parameter's buffer in its per-parameter state (self.state) and update it there every step",
            ),
            (
                dict(fixed_lr=_LARS_HP["lr"]),
                "your step ignores a changed learning rate (a schedule sets group['lr'] each step)",
                "read lr from the parameter group inside step, not from a value saved in __init__",
            ),
        ]
        for flags, why, fix in variants:
            alt = _lars_run(lambda m, f=flags: _LarsVariant(_lars_groups(m, False), **f, **_LARS_HP), t + 1)
            if all(_close(a, b, rtol=1e-7, atol=1e-10) for a, b in zip(got, alt[t])):
                _fail(name, f"{problem}: {why}", fix)
        _fail(name, problem, hint)
    for p in params:
        if p.grad is not None and not any(
            isinstance(v, torch.Tensor) and v.shape == p.shape for v in opt.state.get(p, {}).values()
        ):
            _fail(
                name,
                "a parameter has no momentum buffer in its per-parameter state",
                "keep each parameter's buffer in self.state, under that parameter (PyTorch saves it with the optimizer)",
            )
    _passed(name, f"{_LARS_STEPS} steps with momentum, weight decay, an excluded group and a schedule match LARS")


# ---------------------------------------------------------------- ghost batch norm by hand

_GBN_C, _GBN_VB, _GBN_MOMENTUM, _GBN_EPS = 3, 4, 0.1, 1e-5


def _ghost_ref(x, weight, bias, rm, rv, vb, *, dims=(0, 2, 3), unbiased_norm=False, whole=False, biased_running=False):
    """Ghost batch norm written out with switches that reproduce the usual slips, for diagnosis
    only (the oracles are utils.models.GhostBatchNorm2d and nn.BatchNorm2d). Returns (y, rm, rv)."""
    rm, rv, parts = rm.clone(), rv.clone(), []
    for v in [x] if whole else x.split(vb):
        mean = v.mean(dim=dims, keepdim=True)
        var = v.var(dim=dims, keepdim=True, correction=1 if unbiased_norm else 0)
        parts.append((v - mean) / torch.sqrt(var + _GBN_EPS))
        if dims == (0, 2, 3):
            unb = v.var(dim=dims, correction=0 if biased_running else 1)
            rm = (1 - _GBN_MOMENTUM) * rm + _GBN_MOMENTUM * v.mean(dim=dims)
            rv = (1 - _GBN_MOMENTUM) * rv + _GBN_MOMENTUM * unb
    y = torch.cat(parts) * weight.view(1, -1, 1, 1) + bias.view(1, -1, 1, 1)
    return y, rm, rv


def _gbn_input(n, seed):
    gen = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.5, 2.0, 4.0], dtype=torch.float64).view(1, -1, 1, 1)
    shift = torch.tensor([-3.0, 0.0, 5.0], dtype=torch.float64).view(1, -1, 1, 1)
    drift = torch.linspace(-2, 2, n, dtype=torch.float64).view(-1, 1, 1, 1)  # virtual batches differ
    return torch.randn(n, _GBN_C, 5, 4, generator=gen, dtype=torch.float64) * scale + shift + drift


def _gbn_setup(cls, name, vb):
    """The student's module and the oracle with the same (random) affine weights, float64."""
    gen = torch.Generator().manual_seed(7)
    weight = torch.rand(_GBN_C, generator=gen, dtype=torch.float64) + 0.5
    bias = torch.randn(_GBN_C, generator=gen, dtype=torch.float64)
    mine = _call(name, cls, _GBN_C, virtual_batch_size=vb)
    if not isinstance(mine, torch.nn.Module):
        _fail(name, f"your class made a {type(mine).__name__}, not an nn.Module", "subclass nn.Module")
    mine = mine.double()
    params, buffers = dict(mine.named_parameters()), dict(mine.named_buffers())
    for k, where in (("weight", params), ("bias", params), ("running_mean", buffers), ("running_var", buffers)):
        if k not in where or tuple(where[k].shape) != (_GBN_C,):
            kind = "parameter" if where is params else "buffer (register_buffer)"
            _fail(
                name,
                f"no {kind} named {k!r} of shape ({_GBN_C},)",
                "use the names of nn.BatchNorm2d: weight and bias (nn.Parameter), running_mean and running_var "
                "(register_buffer), one value per channel",
            )
    with torch.no_grad():
        params["weight"].copy_(weight)
        params["bias"].copy_(bias)
    return mine, weight, bias


def _gbn_forward_backward(module, x, seed=3):
    x = x.clone().requires_grad_(True)
    y = module(x)
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(y.shape, generator=gen, dtype=y.dtype)
    (y * w).sum().backward()
    return y.detach(), x.grad


def check_ghost_batch_norm(cls: Any) -> None:
    """``cls(num_features, virtual_batch_size)``: batch norm over virtual batches, with weight,
    bias, running_mean and running_var as in nn.BatchNorm2d (momentum 0.1, eps 1e-5). Compared
    with utils.models.GhostBatchNorm2d (and with nn.BatchNorm2d when the virtual batch is the
    whole batch) on outputs, gradients, running statistics, and in eval mode."""
    from torch import nn

    from ..models import GhostBatchNorm2d

    name = "MyGhostBatchNorm2d"
    if not isinstance(cls, type):
        _fail(
            name,
            f"got {type(cls).__name__}, not a class",
            "pass the class itself: check_ghost_batch_norm(MyGhostBatchNorm2d)",
        )
    if issubclass(cls, nn.modules.batchnorm._BatchNorm):
        lib = "utils.models.GhostBatchNorm2d" if issubclass(cls, GhostBatchNorm2d) else "PyTorch's batch norm"
        _fail(
            name,
            f"your class subclasses {lib}, a library implementation",
            "subclass nn.Module and compute the statistics yourself",
        )

    real = torch.nn.functional.batch_norm, torch.batch_norm
    used = []

    def spy(real_fn):
        def wrapped(*a, **k):
            used.append(1)
            return real_fn(*a, **k)

        return wrapped

    def run(module, x):
        torch.nn.functional.batch_norm, torch.batch_norm = spy(real[0]), spy(real[1])
        try:
            out = _call(name, _gbn_forward_backward, module, x)
        finally:
            torch.nn.functional.batch_norm, torch.batch_norm = real
        if used:
            _fail(
                name,
                "your forward calls PyTorch's batch_norm (or a BatchNorm module)",
                "compute each virtual batch's mean and variance yourself with Tensor.mean and Tensor.var",
            )
        return out

    def differs(a, b):
        return not _close(a, b, rtol=1e-6, atol=1e-8)

    # 1. training, three virtual batches, against utils.models.GhostBatchNorm2d
    n = 3 * _GBN_VB
    x = _gbn_input(n, 0)
    mine, weight, bias = _gbn_setup(cls, name, _GBN_VB)
    ref = GhostBatchNorm2d(_GBN_C, _GBN_VB, momentum=_GBN_MOMENTUM, eps=_GBN_EPS).double()
    with torch.no_grad():
        ref.weight.copy_(weight)
        ref.bias.copy_(bias)
    mine.train()
    rm0, rv0 = mine.running_mean.clone(), mine.running_var.clone()
    y, gx = run(mine, x)
    y_ref, gx_ref = _gbn_forward_backward(ref, x)
    if differs(y, y_ref):
        args = (x, weight, bias, rm0, rv0, _GBN_VB)
        for kw, why, fix in (
            (
                dict(whole=True),
                "your statistics are over the whole batch",
                "split the batch into virtual batches of virtual_batch_size (Tensor.split) and normalise each "
                "with its own mean and variance",
            ),
            (
                dict(unbiased_norm=True),
                "you normalise with the unbiased variance (divided by n - 1)",
                "normalise with the biased variance (Tensor.var(..., correction=0)); the unbiased one is for running_var",
            ),
            (dict(dims=(0,)), "your mean and variance are per pixel (reduced over N only)", None),
            (dict(dims=(2, 3)), "your mean and variance are per sample (reduced over H, W only)", None),
            (dict(dims=(0, 1, 2, 3)), "your mean and variance mix the channels", None),
        ):
            if not differs(y, _ghost_ref(*args, **kw)[0]):
                _fail(
                    name,
                    f"outputs differ from GhostBatchNorm2d: {why}",
                    fix or "reduce over dims (0, 2, 3): N, H and W, one statistic per channel",
                )
        if not differs(y, _ghost_ref(x, torch.ones_like(weight), torch.zeros_like(bias), rm0, rv0, _GBN_VB)[0]):
            _fail(
                name,
                "outputs differ from GhostBatchNorm2d: the affine weight and bias are not applied",
                "multiply by weight and add bias, per channel",
            )
        _fail(
            name,
            f"training outputs differ from GhostBatchNorm2d by {float((y - y_ref).abs().max()):.3g}",
            "per virtual batch and channel: (x - mean) / sqrt(var + eps), then * weight + bias",
        )
    if differs(gx, gx_ref):
        _fail(
            name,
            "the outputs are right but the input gradient is not",
            "let autograd see the mean and variance: no torch.no_grad() or .detach() around them",
        )
    for k in ("weight", "bias"):
        g, g_ref = dict(mine.named_parameters())[k].grad, getattr(ref, k).grad
        if g is None or differs(g, g_ref):
            _fail(name, f"the gradient of {k} is wrong", f"use self.{k} (the nn.Parameter) in the output, per channel")
    rm, rv = mine.running_mean.detach(), mine.running_var.detach()
    if differs(rm, ref.running_mean) or differs(rv, ref.running_var):
        if not differs(rm, rm0) and not differs(rv, rv0):
            problem, fix = (
                "running_mean and running_var were not updated",
                "update them in training, once per virtual batch",
            )
        elif not any(
            differs(a, b) for a, b in zip((rm, rv), _ghost_ref(x, weight, bias, rm0, rv0, _GBN_VB, whole=True)[1:])
        ):
            problem, fix = (
                "the running statistics were updated with the whole batch",
                "update them once per virtual batch, with that virtual batch's mean and variance",
            )
        elif not differs(rv, _ghost_ref(x, weight, bias, rm0, rv0, _GBN_VB, biased_running=True)[2]):
            problem, fix = (
                "running_var was updated with the biased variance",
                "use the unbiased variance (divided by n - 1, n values per channel) for running_var, as BatchNorm2d does",
            )
        else:
            problem, fix = (
                "running_mean or running_var differ from GhostBatchNorm2d's",
                "running = (1 - momentum) * running + momentum * new, per virtual batch, in order",
            )
        _fail(name, problem, fix)
    if rm.requires_grad or rv.requires_grad:
        _fail(
            name,
            "the running statistics are part of the autograd graph",
            "update them under torch.no_grad() (or from detached values)",
        )

    # 2. an uneven split: the last virtual batch is smaller
    x_odd = _gbn_input(10, 1)
    mine, _, _ = _gbn_setup(cls, name, _GBN_VB)
    ref = GhostBatchNorm2d(_GBN_C, _GBN_VB).double()
    with torch.no_grad():
        ref.weight.copy_(weight)
        ref.bias.copy_(bias)
    y, _ = run(mine, x_odd)
    if differs(y, _gbn_forward_backward(ref, x_odd)[0]):
        _fail(
            name,
            "a batch of 10 with virtual batches of 4 gives wrong outputs",
            "the last virtual batch may be smaller: Tensor.split handles that, a reshape does not",
        )

    # 3. virtual batch >= batch: exactly nn.BatchNorm2d (the second oracle)
    mine, _, _ = _gbn_setup(cls, name, 64)
    bn = nn.BatchNorm2d(_GBN_C).double()
    with torch.no_grad():
        bn.weight.copy_(weight)
        bn.bias.copy_(bias)
    x = _gbn_input(n, 2)
    y, gx = run(mine, x)
    y_bn, gx_bn = _gbn_forward_backward(bn, x)
    for label, a, b in (
        ("outputs", y, y_bn),
        ("input gradients", gx, gx_bn),
        ("running_mean", mine.running_mean.detach(), bn.running_mean),
        ("running_var", mine.running_var.detach(), bn.running_var),
    ):
        if differs(a, b):
            _fail(
                name,
                f"with one virtual batch ({n} samples) your {label} differ from nn.BatchNorm2d",
                "a single virtual batch must be exactly batch norm",
            )

    # 4. eval mode: the running statistics, nothing updated
    mine.eval()
    bn.eval()
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        rm_eval = torch.randn(_GBN_C, generator=gen, dtype=torch.float64)
        rv_eval = torch.rand(_GBN_C, generator=gen, dtype=torch.float64) + 0.5
        for b in (mine, bn):
            b.running_mean.copy_(rm_eval)
            b.running_var.copy_(rv_eval)
    x = _gbn_input(n, 3)
    y, _ = run(mine, x)
    y_bn, _ = _gbn_forward_backward(bn, x)
    if differs(y, y_bn):
        _fail(
            name,
            "in eval mode your outputs differ from nn.BatchNorm2d",
            "in eval mode (training is False), normalise with running_mean and running_var, not the batch's statistics",
        )
    if differs(mine.running_mean, rm_eval) or differs(mine.running_var, rv_eval):
        _fail(name, "eval mode changed the running statistics", "update them only when self.training is True")
    _passed(
        name,
        "matches GhostBatchNorm2d (outputs, gradients, running stats), BatchNorm2d for one virtual batch, and eval mode",
    )
