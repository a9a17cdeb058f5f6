"""Lab 4's two bigger self-checks, MyLARS (a torch.optim.Optimizer) and MyGhostBatchNorm2d: each
passes on the lab's own answer (taken from the solutions notebook), fails on the placeholder, refuses
the library's class, and names each typical mistake. The mistakes are written out by hand below;
the checks' oracles are utils.optim.LARS, utils.models.GhostBatchNorm2d and nn.BatchNorm2d."""

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from utils import checks
from utils.checks import CheckFailed
from utils.models import GhostBatchNorm2d
from utils.optim import LARS

LAB = Path(__file__).resolve().parents[1] / "solutions" / "lab4_large_batch.ipynb"


def _answers():
    """The solution notebook's trust_ratio, MyLARS and MyGhostBatchNorm2d, defined from a file."""
    cells = ["".join(c["source"]) for c in json.loads(LAB.read_text())["cells"] if c["cell_type"] == "code"]
    ns = {"torch": torch, "nn": nn, "math": math, "__name__": "lab4_answers"}
    for start in ("def trust_ratio(", "class MyLARS(", "class MyGhostBatchNorm2d("):
        src = next(c for c in cells if c.startswith(start))
        exec(compile(src.split("\n\n\nprint(")[0], str(LAB), "exec"), ns)
    return ns


ANSWERS = _answers()


def _fails(check, cls, expected):
    with pytest.raises(CheckFailed) as info:
        check(cls)
    msg = str(info.value)
    assert "\n" not in msg and ". Try: " in msg, msg
    assert expected in msg, msg
    return msg


# ------------------------------------------------------------------ MyLARS


def _ratio(w, g, wd, tc, eps):
    wn, gn = torch.linalg.vector_norm(w), torch.linalg.vector_norm(g)
    return torch.where((wn > 0) & (gn > 0), tc * wn / (gn + wd * wn + eps), torch.ones_like(wn))


def make_lars(
    ignore_exclude=False,
    forget_buffer=False,
    wd_after=False,
    grad_on=False,
    rebind=False,
    graph_buffers=False,
    buffers_outside_state=False,
    lr_from_init=False,
    keep_none_grads=False,
):
    """A hand-written MyLARS; each switch is one typical mistake."""

    class Lars(torch.optim.Optimizer):
        def __init__(self, params, lr, momentum=0.9, weight_decay=0.0, trust_coefficient=0.001, eps=1e-8):
            self.init_lr, self.bufs = lr, {}
            defaults = dict(
                lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coefficient=trust_coefficient, eps=eps
            )
            super().__init__(params, {**defaults, "exclude": False})

        def step(self, closure=None):
            with torch.set_grad_enabled(grad_on or graph_buffers):
                for group in self.param_groups:
                    lr = self.init_lr if lr_from_init else group["lr"]
                    m, wd = group["momentum"], group["weight_decay"]
                    for p in group["params"]:
                        if p.grad is None and not keep_none_grads:
                            continue
                        g = p.grad
                        r = 1.0
                        if ignore_exclude or not group["exclude"]:
                            r = _ratio(p, g, wd, group["trust_coefficient"], group["eps"])
                        d = r * g + wd * p if wd_after else r * (g + wd * p)
                        store = self.bufs if buffers_outside_state else self.state[p]
                        key = p if buffers_outside_state else "buf"
                        if key not in store or forget_buffer:
                            store[key] = d.clone()
                        else:
                            store[key] = m * store[key] + d
                        if rebind:
                            p = p - lr * store[key]
                        elif graph_buffers:
                            p.data.sub_(lr * store[key].detach())
                        else:
                            p.sub_(lr * store[key])

    return Lars


class LarsSubclass(LARS):
    pass


class LarsWrapper(torch.optim.Optimizer):
    def __init__(self, params, lr, **kw):
        self.inner = LARS([{**g, "adapt": not g.pop("exclude")} for g in params], lr, **kw)
        super().__init__(self.inner.param_groups, {})

    def step(self, closure=None):
        return self.inner.step(closure)


class LarsCallsTheLibrary(torch.optim.Optimizer):
    def __init__(self, params, lr, **kw):
        super().__init__(params, dict(lr=lr, **kw, exclude=False))

    def step(self, closure=None):
        groups = [dict(g, adapt=not g["exclude"]) for g in self.param_groups]
        for g in groups:
            del g["exclude"]
        inner = LARS(groups, self.defaults["lr"])
        inner.state = self.state
        inner.step()


class LarsPlaceholder(torch.optim.Optimizer):
    def __init__(self, params, lr, momentum=0.9, weight_decay=0.0, trust_coefficient=0.001, eps=1e-8):
        raise NotImplementedError("Exercise: write this part (see the hint above)")


def test_lars_check_passes_on_the_answer_and_on_an_independent_hand_written_one(capsys):
    checks.check_lars_optimizer(ANSWERS["MyLARS"])
    checks.check_lars_optimizer(make_lars())
    assert capsys.readouterr().out.count("\u2714 MyLARS: correct") == 2


@pytest.mark.parametrize(
    "cls,expected",
    [
        (LarsPlaceholder, "not implemented yet"),
        (LARS, "subclasses utils.optim.LARS"),
        (LarsSubclass, "subclasses utils.optim.LARS"),
        (LarsWrapper, "wraps utils.optim.LARS"),
        (LarsCallsTheLibrary, "calls utils.optim.LARS"),
        (make_lars(ignore_exclude=True), "trust ratio to the excluded group"),
        (make_lars(forget_buffer=True), "momentum buffer is not kept"),
        (make_lars(wd_after=True), "weight decay was added after the trust ratio"),
        (make_lars(grad_on=True), "autograd on"),
        (make_lars(rebind=True), "no parameter has changed"),
        (make_lars(graph_buffers=True), "part of the autograd graph"),
        (make_lars(buffers_outside_state=True), "no momentum buffer in its per-parameter state"),
        (make_lars(lr_from_init=True), "ignores a changed learning rate"),
        (make_lars(keep_none_grads=True), "its .grad is None"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_lars_check_names_each_mistake(cls, expected):
    _fails(checks.check_lars_optimizer, cls, expected)


def test_lars_placeholder_in_step_only_says_not_implemented():
    class OnlyInit(ANSWERS["MyLARS"]):
        def step(self, closure=None):
            raise NotImplementedError("Exercise: write this part (see the hint above)")

    _fails(checks.check_lars_optimizer, OnlyInit, "not implemented yet")


# ------------------------------------------------------------------ MyGhostBatchNorm2d


def make_ghost(
    dims=(0, 2, 3),
    whole_batch=False,
    unbiased_norm=False,
    update_running=True,
    running_whole=False,
    running_biased=False,
    detach_stats=False,
    eval_batch_stats=False,
    reshape=False,
    no_affine=False,
    library=False,
):
    """A hand-written ghost batch norm; each switch is one typical mistake."""

    class Ghost(nn.Module):
        def __init__(self, c, virtual_batch_size=32, momentum=0.1, eps=1e-5):
            super().__init__()
            self.vb, self.m, self.eps = virtual_batch_size, momentum, eps
            self.weight, self.bias = nn.Parameter(torch.ones(c)), nn.Parameter(torch.zeros(c))
            self.register_buffer("running_mean", torch.zeros(c))
            self.register_buffer("running_var", torch.ones(c))

        def _update(self, v):
            with torch.no_grad():
                n = v.numel() // v.shape[1]
                var = v.var(dim=(0, 2, 3), correction=0) * (1 if running_biased else n / (n - 1))
                self.running_mean.copy_((1 - self.m) * self.running_mean + self.m * v.mean(dim=(0, 2, 3)))
                self.running_var.copy_((1 - self.m) * self.running_var + self.m * var)

        def forward(self, x):
            w, b = self.weight.view(1, -1, 1, 1), self.bias.view(1, -1, 1, 1)
            if no_affine:
                w, b = 1.0, 0.0
            if not self.training and not eval_batch_stats:
                rm, rv = self.running_mean.view(1, -1, 1, 1), self.running_var.view(1, -1, 1, 1)
                return (x - rm) / torch.sqrt(rv + self.eps) * w + b
            if library:
                return torch.cat(
                    [
                        nn.functional.batch_norm(v, self.running_mean, self.running_var, self.weight, self.bias, True)
                        for v in x.split(self.vb)
                    ]
                )
            if whole_batch:
                pieces = [x]
            elif reshape:
                pieces = list(x[: len(x) // self.vb * self.vb].reshape(-1, self.vb, *x.shape[1:]))
                pieces += [x[len(x) // self.vb * self.vb :]] if len(x) % self.vb else []
                pieces = [x] if len(x) % self.vb else pieces
            else:
                pieces = x.split(self.vb)
            out = []
            for v in pieces:
                mean = v.mean(dim=dims, keepdim=True)
                var = v.var(dim=dims, keepdim=True, correction=1 if unbiased_norm else 0)
                if detach_stats:
                    mean, var = mean.detach(), var.detach()
                out.append((v - mean) / torch.sqrt(var + self.eps))
                if self.training and update_running and not running_whole:
                    self._update(v)
            if self.training and update_running and running_whole:
                self._update(x)
            return torch.cat(out) * w + b

    return Ghost


class GhostPlaceholder(nn.Module):
    def __init__(self, num_features, virtual_batch_size=32, momentum=0.1, eps=1e-5):
        super().__init__()
        raise NotImplementedError("Exercise: write this part (see the hint above)")


class GhostForwardPlaceholder(nn.Module):
    def __init__(self, num_features, virtual_batch_size=32, momentum=0.1, eps=1e-5):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(num_features)), nn.Parameter(torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))

    def forward(self, x):
        raise NotImplementedError("Exercise: write this part (see the hint above)")


def test_ghost_check_passes_on_the_answer_and_on_an_independent_hand_written_one(capsys):
    checks.check_ghost_batch_norm(ANSWERS["MyGhostBatchNorm2d"])
    checks.check_ghost_batch_norm(make_ghost())
    assert capsys.readouterr().out.count("\u2714 MyGhostBatchNorm2d: correct") == 2


@pytest.mark.parametrize(
    "cls,expected",
    [
        (GhostPlaceholder, "not implemented yet"),
        (GhostForwardPlaceholder, "not implemented yet"),
        (GhostBatchNorm2d, "subclasses utils.models.GhostBatchNorm2d"),
        (nn.BatchNorm2d, "subclasses PyTorch's batch norm"),
        (make_ghost(library=True), "calls PyTorch's batch_norm"),
        (make_ghost(whole_batch=True), "statistics are over the whole batch"),
        (make_ghost(dims=(0,)), "per pixel"),
        (make_ghost(dims=(2, 3)), "per sample"),
        (make_ghost(dims=(0, 1, 2, 3)), "mix the channels"),
        (make_ghost(unbiased_norm=True), "normalise with the unbiased variance"),
        (make_ghost(no_affine=True), "weight and bias are not applied"),
        (make_ghost(detach_stats=True), "input gradient is not"),
        (make_ghost(update_running=False), "were not updated"),
        (make_ghost(running_whole=True), "updated with the whole batch"),
        (make_ghost(running_biased=True), "running_var was updated with the biased variance"),
        (make_ghost(reshape=True), "last virtual batch may be smaller"),
        (make_ghost(eval_batch_stats=True), "in eval mode"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_ghost_check_names_each_mistake(cls, expected):
    _fails(checks.check_ghost_batch_norm, cls, expected)


# --- trust_ratio, lars_step and lr_for_batch: the mistakes that passed before ---------------------


def _trust_item(w, g, weight_decay, trust_coefficient, eps):  # right values, but reads back to Python
    wn, gn = torch.linalg.vector_norm(w), torch.linalg.vector_norm(g)
    if wn.item() == 0 or gn.item() == 0:
        return torch.ones((), dtype=w.dtype)
    return trust_coefficient * wn / (gn + weight_decay * wn + eps)


def _trust_if(w, g, weight_decay, trust_coefficient, eps):  # right values, a Python `if` on a tensor
    wn, gn = torch.linalg.vector_norm(w), torch.linalg.vector_norm(g)
    if wn == 0 or gn == 0:
        return torch.ones_like(wn)
    return trust_coefficient * wn / (gn + weight_decay * wn + eps)


def _lars_step(lr_inside=False, wd_after=False):
    def step(w, g, buf, lr, momentum, weight_decay, trust_coefficient, eps):
        trust = ANSWERS["trust_ratio"](w, g, weight_decay, trust_coefficient, eps)
        d = trust * g + weight_decay * w if wd_after else trust * (g + weight_decay * w)
        if lr_inside:
            buf = lr * d if buf is None else momentum * buf + lr * d
            return w - buf, buf
        buf = d.clone() if buf is None else momentum * buf + d
        return w - lr * buf, buf

    return step


def _lr_no_error(base_lr, base_batch, batch, rule):
    k = batch / base_batch
    return base_lr * (k if rule == "linear" else math.sqrt(k))


def test_the_answers_pass_the_small_checks():
    checks.check_trust_ratio(ANSWERS["trust_ratio"])
    checks.check_lars_step(_lars_step())

    def lr_ok(base_lr, base_batch, batch, rule):
        if rule not in ("linear", "sqrt"):
            raise ValueError(rule)
        return _lr_no_error(base_lr, base_batch, batch, rule)

    checks.check_lr_for_batch(lr_ok)


@pytest.mark.parametrize(
    "check,fn,expected",
    [
        (checks.check_trust_ratio, _trust_item, "(.item())"),
        (checks.check_trust_ratio, _trust_if, "an `if` on a tensor"),
        (checks.check_lars_step, _lars_step(lr_inside=True), "lr went into the momentum buffer"),
        (checks.check_lars_step, _lars_step(wd_after=True), "weight decay was added after the trust-ratio scaling"),
        (checks.check_lr_for_batch, _lr_no_error, "a misspelt rule"),
    ],
)
def test_small_checks_name_the_mistakes_that_used_to_pass(check, fn, expected):
    _fails(check, fn, expected)
