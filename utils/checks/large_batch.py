"""Lab 4's exercises (solutions/lab4_large_batch.ipynb): warmup, the LARS trust ratio and step, the rate for a batch
size, LARS as a torch.optim.Optimizer, ghost batch norm. Oracles: the warmup's closed form, utils.optim.LARS,
utils.schedules.lr_for_batch, utils.models.GhostBatchNorm2d (nn.BatchNorm2d for one virtual batch)."""

import math
from functools import partial

import torch
from torch import nn

from ..models import GhostBatchNorm2d
from ..optim import LARS, lars_param_groups
from ..schedules import lr_for_batch as _lr_reference
from ._common import HostReads
from .engine import Case, Exercise, difference, mistake

LAB = "lab4_large_batch"
F64 = torch.float64
_NOT_CLASS = "it is not a class. Try: pass the class itself, as the check cell does"


def _named(rows: dict, variant=None, **when) -> list:
    """A Mistake per row, {key: "problem. Try: hint"} made by ``variant(key)`` or {key: (variant, "problem. Try:
    hint")}, seen by ``when[key]`` if given."""
    rows = {k: r if isinstance(r, tuple) else (variant(k), r) for k, r in rows.items()}
    return [mistake(t, v, when.get(k)) for k, (v, t) in rows.items()]


def _raised(*words):  # the answer raised an error whose last line holds one of ``words``
    return lambda o: any(w in o.error for w in words)


def _made(cls, base, *args, **kwargs):
    obj = cls(*args, **kwargs)
    if not isinstance(cls, type) or not isinstance(obj, base):
        raise TypeError("it is not a class" if not isinstance(cls, type) else f"it is not a {base.__name__} class")
    return obj


def _class_variant(cls, name, kind):
    """The variant ``kind`` of a class answer: "not_class" is a function, "not_..." a class of the wrong kind, any
    other ``kind`` a subclass of the hand-written ``cls`` making that slip."""
    if kind == "not_class":
        return lambda *args, **kwargs: cls(*args, **kwargs)
    if kind.startswith("not_"):
        return type(name, (), {"__init__": lambda self, *args, **kwargs: None})
    return type(name, (cls,), {"kinds": frozenset([kind])})


def _warmup(step, base_lr, peak_lr, warmup_steps):
    return base_lr + (peak_lr - base_lr) * step / warmup_steps if step < warmup_steps else peak_lr


WARMUP_LR = Exercise(
    name="warmup_lr",
    oracle=_warmup,
    run=lambda f, c: {f"step {t}": f(t, *c.args[:3]) for t in c.args[3]},
    cases=lambda: [
        Case((0.1, 0.9, 8, (0, 1, 4, 7, 8, 20)), label="a warmup from 0.1 to 0.9 over 8 steps, read at steps 0 to 20"),
        Case((0.02, 0.5, 5, (0, 2, 3, 5, 9)), label="a warmup from 0.02 to 0.5 over 5 steps, read at steps 0 to 9"),
    ],
    refuse=("utils.schedules.WarmupDecay",),
    passed="two warmups, read inside and after the ramp",
    hint="inside the warmup, a straight line from base_lr at step 0 to peak_lr at step warmup_steps; then the peak",
    mistakes=_named(
        {
            "list": (
                lambda t, b, p, w: [_warmup(s, b, p, w) for s in range(t + 1)],
                "it returns something other than one number for a step. Try: return a float, the learning rate of that "
                "one step",
            ),
            "from_zero": (
                lambda t, b, p, w: p * min(t, w) / w,
                "the ramp starts at 0, but Goyal et al.'s warmup starts at the base rate. Try: ramp from base_lr to "
                "peak_lr, not from 0",
            ),
            "off_by_one": (
                lambda t, b, p, w: b + (p - b) * min(t + 1, w) / w,
                "step 0 is one increment along the ramp already (off by one). Try: step 0 must run at base_lr exactly: "
                "use the fraction of the warmup done before this step",
            ),
            "no_peak": (
                lambda t, b, p, w: b + (p - b) * t / w,
                "after the warmup the rate keeps growing. Try: from step warmup_steps on, the rate stays at the peak",
            ),
        },
        list=lambda o: any(not isinstance(v, (int, float, torch.Tensor)) for v in o.got.values()),
    ),
)


def _ratio(w, g, weight_decay, trust_coefficient, eps, eps_outside=False):
    wn, gn = torch.linalg.vector_norm(w), torch.linalg.vector_norm(g)
    den = gn + weight_decay * wn + (0 if eps_outside else eps)
    ratio = trust_coefficient * wn / den + (eps if eps_outside else 0)
    return torch.where((wn > 0) & (gn > 0), ratio, torch.ones_like(wn))


def _ratio_case(shape, scale, *hp, seed):  # three (w, g) pairs: the 2nd with zero weights, the 3rd with a zero grad
    gen = torch.Generator().manual_seed(seed)
    w, g = torch.randn(3, *shape, generator=gen, dtype=F64) * scale, torch.randn(3, *shape, generator=gen, dtype=F64)
    w[1], g[2] = 0.0, 0.0
    size = "x".join(map(str, shape)) if len(shape) > 1 else f"{shape[0]}-element"
    label = f"three {size} tensors, one with zero weights and one with a zero gradient"
    return Case((w, g * 0.1, *hp), label=label)


TRUST_RATIO = Exercise(
    name="trust_ratio",
    oracle=_ratio,
    passed="the paper's formula and its fallback, all on tensors",
    cases=lambda: [
        _ratio_case((6, 5), 3.0, 0.01, 0.02, 1e-9, seed=4),
        _ratio_case((7,), 0.5, 0.1, 1e-3, 1e-8, seed=5),
        _ratio_case((5,), 1.0, 0.0, 0.5, 0.2, seed=6),
    ],
    # a case's pairs go through torch.func.vmap, where reading a tensor back to Python cannot run
    run=lambda f, c: torch.func.vmap(lambda w, g: f(w, g, *c.args[2:]))(*c.args[:2]),
    hint="the ratio is trust_coefficient times the norm of the whole w over the norm of g plus weight_decay times the "
    "norm of w plus eps, and 1 where either norm is 0",
    mistakes=_named(
        {
            "host": (
                lambda w, g, wd, tc, eps: torch.tensor(_ratio(w, g, wd, tc, eps).item()),
                "it reads a tensor back to Python (.item(), float(), .tolist() or an `if` on a tensor) or indexes with "
                "a boolean mask, which on a GPU waits for the device. Try: keep the norms and the fallback as tensors "
                "and choose between the ratio and 1 with torch.where",
            ),
            "one_element": (
                lambda w, g, wd, tc, eps: _ratio(w, g, wd, tc, eps).reshape(1),
                "it returns a 1-element tensor, not a 0-d one. Try: keep the result 0-d, as the norms are, also where "
                "the fallback gives 1",
            ),
            "number": (
                lambda w, g, wd, tc, eps: tc,
                "it returns a Python number, not a tensor. Try: return a 0-d tensor, computed with "
                "torch.linalg.vector_norm and torch.where",
            ),
            "no_wd": (
                lambda w, g, wd, tc, eps: _ratio(w, g, 0.0, tc, eps),
                "weight decay is missing from the denominator. Try: the denominator is the norm of g plus weight_decay "
                "times the norm of w plus eps",
            ),
            "swapped": (
                lambda w, g, wd, tc, eps: _ratio(g, w, wd, tc, eps),
                "the norms are swapped: the ratio is the weights' norm over the gradient's, not the other way round. "
                "Try: put the norm of w in the numerator",
            ),
            "no_eps": (
                lambda w, g, wd, tc, eps: _ratio(w, g, wd, tc, 0.0),
                "eps is not added to the denominator. Try: add eps to the norm of g plus weight_decay times the norm "
                "of w, inside the division",
            ),
            "eps_outside": (
                lambda w, g, wd, tc, eps: _ratio(w, g, wd, tc, eps, eps_outside=True),
                "eps was added to the ratio, outside the division. Try: eps belongs in the denominator, beside the two "
                "norms, where it keeps the division away from 0",
            ),
            "no_tc": (
                lambda w, g, wd, tc, eps: _ratio(w, g, wd, 1.0, eps),
                "the ratio is not multiplied by trust_coefficient. Try: multiply it by trust_coefficient",
            ),
            "no_fallback": (
                lambda w, g, wd, tc, eps: tc * w.norm() / (g.norm() + wd * w.norm() + eps),
                "with zero weights or a zero gradient the ratio is not 1. Try: where either norm is 0 give 1, chosen "
                "with torch.where so that it stays on the device",
            ),
        },
        host=_raised("item()", "data pointer", "control flow", "boolean mask"),
        one_element=lambda o: o.got.shape == o.want.shape + (1,),
        number=_raised("only return Tensors"),
        eps_outside=lambda o: any(
            difference(o.got, TRUST_RATIO.run(v, o.case)) is None
            # eps outside the division only, or outside the fallback too
            for v in (partial(_ratio, eps_outside=True), lambda w, g, wd, tc, eps: _ratio(w, g, wd, tc, 0.0) + eps)
        ),
    ),
)


def _lars_step(w, g, buf, lr, momentum, weight_decay, trust_coefficient, eps):
    """One step of utils.optim.LARS on one tensor whose momentum buffer is ``buf``."""
    p = nn.Parameter(w.clone())
    p.grad, opt = g.clone(), LARS([p], lr, momentum, weight_decay, trust_coefficient, eps)
    if buf is not None:
        opt.state[p]["momentum_buffer"] = buf.clone()
    opt.step()
    return p.detach(), opt.state[p]["momentum_buffer"]


def _step_variant(kind):
    def lars_step(w, g, buf, lr, momentum, weight_decay, trust_coefficient, eps):
        r = 1.0 if kind == "no_trust" else _ratio(w, g, weight_decay, trust_coefficient, eps)
        wd = 0.0 if kind == "no_wd" else weight_decay
        d = (r * g + wd * w if kind == "wd_after" else r * (g + wd * w)) * (lr if kind == "lr_inside" else 1.0)
        new = d if buf is None else buf.mul_(momentum).add_(d) if kind == "in_place" else momentum * buf + d
        step = (1.0 if kind in ("lr_inside", "no_lr") else lr) * new
        w = w.sub_(step) if kind == "in_place" else w - step
        return w if kind == "not_pair" else (w, d if kind == "return_d" else new)

    return lars_step


def _run_steps(f, case):
    """Steps of ``f`` along the case's rates, each fed the weights and buffer the step before returned."""
    w, grads, lrs, hp = case.args
    buf, out = None, {"steps": [], "inputs kept": True}
    for g, lr in zip(grads, lrs):
        args = (w.clone(), g.clone(), None if buf is None else buf.clone())
        res = f(*args, lr, *hp)
        if not (isinstance(res, (tuple, list)) and len(res) == 2):
            raise TypeError(f"lars_step returned {type(res).__name__}, not a pair (new_w, new_buf)")
        out["inputs kept"] &= all(a is None or torch.equal(a, b) for a, b in zip(args, (w, g, buf)))
        out["steps"].append(res)
        w, buf = res
    return out


def _step_case(shape, lrs, hp, seed, label):
    gen = torch.Generator().manual_seed(seed)
    w, grads = torch.randn(*shape, generator=gen, dtype=F64), torch.randn(len(lrs), *shape, generator=gen, dtype=F64)
    return Case((w, list(grads * 0.3), lrs, hp), label=label)


LARS_STEP = Exercise(
    name="lars_step",
    oracle=_lars_step,
    run=_run_steps,
    rtol=1e-7,
    atol=1e-10,
    refuse=("utils.optim.LARS",),
    cases=lambda: [
        _step_case((4, 3), (0.5, 0.2, 0.8), (0.9, 0.01, 0.02, 1e-9), 5, "3 steps of a 4x3 tensor, lr 0.5, 0.2, 0.8"),
        _step_case((6,), (0.1, 0.2, 0.3, 0.3), (0.8, 0.05, 0.01, 1e-8), 6, "4 steps of a 6-element tensor in a warmup"),
    ],
    hint="follow the box: the weight-decayed gradient times the trust ratio, folded into the buffer with momentum, "
    "then the weights move by lr times the new buffer",
    passed="steps with momentum, weight decay and a changing lr, as utils.optim.LARS takes them",
    mistakes=_named(
        {
            "in_place": "it changed its input w in place (or g, or buf), and the caller's tensors change with it. Try: "
            "build new tensors with out-of-place arithmetic, no -=, mul_ or add_ on the arguments",
            "not_pair": "it does not return a pair (new_w, new_buf). Try: return the new weights and the new momentum "
            "buffer, in that order",
            "lr_inside": "lr went into the momentum buffer, as in Algorithm 1 of the LARS paper, whereas this lab "
            "follows the PyTorch and apex convention: the buffer holds the scaled updates and lr multiplies it in the "
            "weight step. Try: keep lr out of the buffer; the two forms agree while lr is constant, but once a "
            "schedule changes lr they differ, and this check follows utils.optim.LARS, which uses the lab's form",
            "wd_after": "weight decay was added after the trust-ratio scaling, so it escapes the ratio. Try: add "
            "weight_decay times w to the gradient first, then scale the sum by the trust ratio",
            "no_wd": "weight decay is missing from the update. Try: add weight_decay times w to the gradient before "
            "scaling it by the trust ratio",
            "no_trust": "the update was not scaled by the trust ratio. Try: multiply the weight-decayed gradient by "
            "your trust_ratio",
            "no_lr": "the global lr is missing from the weight step. Try: the weights move by lr times the new buffer",
            "return_d": "the returned buffer is this step's scaled update, not the momentum buffer. Try: return "
            "momentum times the old buffer plus this step's scaled update",
        },
        _step_variant,
        in_place=lambda o: o.got["inputs kept"] is False,
        not_pair=_raised("not a pair"),
    ),
)


def _run_lr(f, case):
    try:
        return f(*case.args)
    except Exception as e:  # an unknown rule must raise a ValueError (a subclass counts), compared as a string
        if case.args[3] in ("linear", "sqrt"):
            raise
        return "ValueError" if isinstance(e, ValueError) else type(e).__name__


LR_FOR_BATCH = Exercise(
    name="lr_for_batch",
    oracle=_lr_reference,
    run=_run_lr,
    refuse=("utils.schedules.lr_for_batch",),
    cases=lambda: [
        Case((0.1, 256, 8192, "linear"), label="the linear rule from batch 256 to 8192"),
        Case((0.1, 256, 1024, "sqrt"), label="the square-root rule from batch 256 to 1024"),
        Case((0.05, 16, 8, "linear"), label="the linear rule from batch 16 down to 8"),
        Case((0.05, 16, 12, "sqrt"), label="the square-root rule from batch 16 down to 12"),
        Case((0.1, 256, 1024, "cubic"), label="an unknown rule"),
    ],
    hint="linear: the base rate times the batch growth factor (the new batch over the base one); sqrt: times its "
    "square root",
    passed="both rules, up and down, and an unknown rule",
    mistakes=_named(
        {
            "no_value_error": (
                lambda b, bb, n, rule: b * (n / bb if rule == "linear" else math.sqrt(n / bb)),
                "an unknown rule does not raise ValueError, so a misspelt rule would train at a wrong rate or stop "
                "with an unclear error. Try: for any rule but linear and sqrt, raise ValueError with a message that "
                "names the rule",
            ),
            "upside_down": (
                lambda b, bb, n, rule: b * (bb / n if rule == "linear" else math.sqrt(bb / n)),
                "the ratio is upside down: a bigger batch should get a bigger rate. Try: divide the new batch by the "
                "base one",
            ),
            "int_division": (
                lambda b, bb, n, rule: b * (n // bb if rule == "linear" else math.sqrt(n // bb)),
                "the batch ratio is rounded down to a whole number (with // or int()). Try: keep its fraction: divide "
                "with / and do not round",
            ),
        },
        no_value_error=lambda o: o.want == "ValueError" and o.got != "ValueError",
    ),
)


class _LarsVariant(torch.optim.Optimizer):
    """A hand-written MyLARS that makes the slips named in ``kinds`` (none: a right answer)."""

    kinds: frozenset = frozenset()

    def __init__(self, params, lr, momentum=0.9, weight_decay=0.0, trust_coefficient=0.001, eps=1e-8):
        self.init_lr, self.bufs = lr, {}
        hp = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coefficient=trust_coefficient, eps=eps)
        super().__init__(params, hp if "no_default_exclude" in self.kinds else dict(hp, exclude=False))

    def step(self, closure=None):
        k = self.kinds
        with torch.set_grad_enabled("grad_on" in k):
            for group in self.param_groups:
                lr, ex = self.init_lr if "lr_from_init" in k else group["lr"], group["exclude"]
                for p in group["params"]:
                    if (p.grad is None and "none_grads" not in k) or (ex and "skip_excluded" in k):
                        continue
                    wd, adapt = group["weight_decay"], not ex or "ignore_exclude" in k
                    r = _ratio(p, p.grad, wd, group["trust_coefficient"], group["eps"]) if adapt else 1.0
                    r = float(r) if "host" in k else r
                    d = r * p.grad + wd * p if "wd_after" in k else r * (p.grad + wd * p)
                    d = p.grad.copy_(d) if "alias" in k else d  # the update written into .grad itself
                    store, key = (self.bufs, p) if "outside_state" in k else (self.state[p], "buf")
                    fresh = key not in store or "forget_buffer" in k
                    store[key] = (d if "alias" in k else d.clone()) if fresh else group["momentum"] * store[key] + d
                    if "rebind" not in k:  # a rebinding `p = p - ...` leaves the parameter as it was
                        p.sub_(lr * store[key].detach())


def _flipped(groups, old, new):  # the flag ``old`` (False where missing) replaced by its negation ``new``
    return [{**{k: v for k, v in g.items() if k != old}, new: not g.get(old, False)} for g in groups]


class _LarsOracle(LARS):
    """utils.optim.LARS, for groups marked with the lab's ``exclude`` instead of the library's ``adapt``."""

    def __init__(self, params, lr, **hp):
        super().__init__(_flipped(params, "exclude", "adapt"), lr, **hp)


def _run_optimizer(cls, case):
    """The case's network trained by ``cls``: its parameters after every step, and where its buffers live. Its
    groups say exclude=True, and exclude=False where ``keep_false`` (else they leave it out, as the lab allows);
    ``mixed`` groups set their own momentum, weight decay, trust coefficient, eps and lr (an ``lr_scale`` of the
    schedule's), with a 1-D weight adapted and a matrix excluded."""
    seed, (i, h, o), hp, lrs, keep_false, *mixed = case.args
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(i, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Linear(h, o)).double()
        model.unused = nn.Parameter(torch.randn(2, 2, dtype=F64))  # never gets a gradient
        data = [(torch.randn(16, i, dtype=F64), torch.randint(0, o, (16,))) for _ in lrs]
    groups = _flipped(lars_param_groups(model, hp["weight_decay"]), "adapt", "exclude")
    groups = groups if keep_false else [{k: v for k, v in g.items() if v is not False} for g in groups]
    if mixed:
        (a, bn, _, b), adapted = model, dict(weight_decay=0.01, momentum=0.7, trust_coefficient=0.03, eps=1e-7)
        groups = [
            dict(params=[a.weight, bn.weight, model.unused], **adapted),
            dict(
                params=[a.bias, bn.bias, b.weight, b.bias], exclude=True, weight_decay=0.02, momentum=0.5, lr_scale=0.5
            ),
        ]
    opt, reads = _made(cls, torch.optim.Optimizer, groups, **hp), HostReads()
    out = {"params": [], "state": True, "plain": True, "names": [n for n, _ in model.named_parameters()]}
    for (x, y), lr in zip(data, lrs):
        for g in opt.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)
        opt.zero_grad(set_to_none=False)  # zeroes each .grad in place: a buffer that is a .grad is zeroed with it
        nn.functional.cross_entropy(model(x), y).backward()
        with reads:
            opt.step()
        out["params"].append([p.detach().clone() for p in model.parameters()])
        for p in model.parameters():
            kept = [v for k, s in opt.state.items() if k is p for v in s.values() if isinstance(v, torch.Tensor)]
            out["state"] &= p.grad is None or any(v.shape == p.shape for v in kept)  # a buffer in self.state
            out["plain"] &= not any(v.requires_grad for v in kept)  # and outside the autograd graph
    return out | {"no host read in step": reads.n == 0}


def _lars_compare(got, want):
    """The first parameter, by name, that differs from utils.optim.LARS's, and after which step."""
    for step, (g, w) in enumerate(zip(got["params"], want["params"])):
        for name, a, b in zip(want["names"], g, w):
            if difference(a, b, 1e-7, 1e-10):
                return f"left parameter {name} different from utils.optim.LARS's after step {step + 1}"
    flags = lambda out: {k: v for k, v in out.items() if k != "names"}
    return difference(flags(got), flags(want), 1e-7, 1e-10)


_HP = ("lr", "momentum", "weight_decay", "trust_coefficient", "eps")
LARS_OPTIMIZER = Exercise(
    name="lars_optimizer",
    answer=("MyLARS",),
    oracle=_LarsOracle,
    run=_run_optimizer,
    compare=_lars_compare,
    cases=lambda: [
        Case(
            (41, (6, 8, 3), dict(zip(_HP, (0.4, 0.9, 0.01, 0.02, 1e-9))), (0.4, 0.4, 0.2, 0.2), False),
            label="4 steps of a 6-8-3 network with batch norm, lr halved at step 2",
        ),
        Case(
            (7, (5, 4, 2), dict(zip(_HP, (0.05, 0.8, 0.05, 0.01, 1e-8))), (0.05, 0.1, 0.15), True),
            label="3 steps of a 5-4-2 network with batch norm, lr rising in a warmup, a group with exclude=False",
        ),
        Case(
            (3, (6, 5, 3), dict(zip(_HP, (0.2, 0.9, 0.0, 0.02, 1e-9))), (0.2, 0.1, 0.1), False, True),
            label="3 steps of a 6-5-3 network in two groups with settings of their own: a 1-D weight adapted, a matrix "
            "excluded, the excluded group with weight decay and half the lr",
        ),
    ],
    refuse=("utils.optim.LARS.step",),
    refuse_hint="subclass torch.optim.Optimizer and write the step yourself; your trust_ratio and lars_step may help",
    hint="per parameter: the weight-decayed gradient times the trust ratio (1 in an excluded group), folded into the "
    "buffer with momentum; the parameter moves by lr times the buffer",
    passed="steps of a network with an excluded group and a schedule, as utils.optim.LARS takes them",
    mistakes=_named(
        {
            "not_class": _NOT_CLASS,
            "not_optimizer": "your class is not a torch.optim.Optimizer. Try: subclass torch.optim.Optimizer and pass "
            "your groups and defaults to its constructor",
            "grad_on": "your step ran with autograd on: an in-place update of a parameter fails, or a momentum buffer "
            "joins the autograd graph. Try: run the update with autograd off (torch.no_grad, as a context or a "
            "decorator of step)",
            "no_default_exclude": 'a group that does not say "exclude" made your step crash. Try: put exclude=False in the '
            "defaults you hand to the Optimizer constructor, which fills it into every group that leaves it "
            "out",
            "none_grads": "a parameter without a gradient (its .grad is None) made your step crash. Try: skip "
            "parameters whose .grad is None, as torch.optim.SGD does",
            "rebind": "after a step no parameter has changed. Try: update each parameter in place under "
            "torch.no_grad(); assigning p a new value only rebinds a local name",
            "ignore_exclude": "you applied the trust ratio to the excluded group too. Try: parameters of a group with "
            "exclude set get plain SGD with momentum, the trust ratio fixed at 1",
            "skip_excluded": "the parameters of the excluded group (biases, norm weights) are not updated. Try: an "
            "excluded group still gets SGD with momentum, the trust ratio fixed at 1",
            "alias": "the first momentum buffer is the gradient tensor itself, so zero_grad() (which may zero .grad in "
            "place) wipes the buffer. Try: store a copy of the first update (torch.clone(d).detach()), as "
            "torch.optim.SGD does",
            "forget_buffer": "the momentum buffer is not kept from one step to the next. Try: store each parameter's "
            "buffer in its per-parameter state (self.state) and update it there every step",
            "wd_after": "weight decay was added after the trust ratio. Try: add weight_decay times the parameter to "
            "the gradient first, then scale the sum by the trust ratio",
            "lr_from_init": "your step ignores a changed learning rate, which a schedule sets in group['lr'] each "
            "step. Try: read lr from the parameter group inside step, not from a value saved in __init__",
            "host": "your step reads tensors back to Python (.item(), float(), or an `if` on a tensor), which on a GPU "
            "waits for the device once per parameter. Try: compute the trust ratio with tensor operations only, as "
            "your trust_ratio does, and keep it a tensor",
            "outside_state": "a parameter has no momentum buffer in its per-parameter state: it is kept somewhere "
            "else, or that parameter gets no momentum. Try: every parameter with a gradient, in an excluded group "
            "too, keeps its buffer in self.state under the parameter itself, which PyTorch saves with the optimizer",
        },
        partial(_class_variant, _LarsVariant, "MyLARS"),
        not_class=_raised("not a class"),
        not_optimizer=_raised("not a Optimizer class"),
        grad_on=lambda o: "leaf Variable" in o.error or o.got["plain"] is False,
        none_grads=_raised("NoneType"),
        no_default_exclude=_raised("KeyError: 'exclude'"),
        outside_state=lambda o: o.got["state"] is False,
        host=lambda o: o.got["no host read in step"] is False,
    ),
)


class _GhostVariant(nn.Module):
    """A hand-written MyGhostBatchNorm2d that makes the slips named in ``kinds`` (none: a right answer)."""

    kinds: frozenset = frozenset()

    def __init__(self, num_features, virtual_batch_size=32, momentum=0.1, eps=1e-5):
        super().__init__()
        k = self.kinds
        self.vb, self.m = virtual_batch_size, 0.1 if "own_momentum" in k else momentum
        self.eps = 1e-5 if "own_eps" in k else eps
        self.weight = nn.Parameter(torch.zeros(num_features) if "zero_weight" in k else torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        for name, value in (("running_mean", torch.zeros(num_features)), ("running_var", torch.ones(num_features))):
            setattr(self, name, value) if "plain_running" in k else self.register_buffer(name, value)
        if "shaped" in k:
            self.weight = nn.Parameter(self.weight.detach().view(1, -1, 1, 1))
        if "rename" in k:
            self.gamma = self.weight
            del self.weight

    def _update(self, v):
        n, biased = v.numel() // v.shape[1], "running_biased" in self.kinds
        with torch.set_grad_enabled("graph_running" in self.kinds):
            self.running_mean = (1 - self.m) * self.running_mean + self.m * v.mean((0, 2, 3))
            var = v.var((0, 2, 3), correction=0) * (1 if biased else n / (n - 1))
            self.running_var = (1 - self.m) * self.running_var + self.m * var

    def forward(self, x):
        k, c = self.kinds, lambda t: t.view(1, -1, 1, 1)
        w = 1.0 if "no_affine" in k else c(self.weight.detach() if "detach_weight" in k else self.weight)
        b = 0.0 if "no_affine" in k else c(self.bias)
        if not self.training and "eval_batch_stats" not in k:
            if "eval_updates" in k:
                self._update(x)
            return (x - c(self.running_mean)) / torch.sqrt(c(self.running_var) + self.eps) * w + b
        dims = {"per_pixel": (0,), "per_sample": (2, 3), "mix_channels": (0, 1, 2, 3)}.get(next(iter(k), ""), (0, 2, 3))
        parts = x.reshape(-1, self.vb, *x.shape[1:]).unbind(0) if "reshape" in k else x.split(self.vb)
        out = []
        for v in [x] if "whole_batch" in k else parts:
            mean, var = v.mean(dims, keepdim=True), v.var(dims, keepdim=True, correction=int("unbiased_norm" in k))
            if "detach_stats" in k:
                mean, var = mean.detach(), var.detach()
            out.append((v - mean) / torch.sqrt(var + self.eps))
            if not k & {"no_running", "running_whole"}:
                self._update(v)
        if "running_whole" in k:
            self._update(x)
        return torch.cat(out) * w + b


def _run_ghost(cls, case):
    """``cls(3, virtual_batch_size)`` in training (outputs, gradients, running statistics), then in eval mode."""
    n, vb, seed, momentum, eps = case.args
    gen, ch = torch.Generator().manual_seed(seed), lambda *v: torch.tensor(v, dtype=F64).view(1, -1, 1, 1)
    drift = torch.linspace(-2, 2, n, dtype=F64).view(-1, 1, 1, 1)  # the virtual batches differ
    x = torch.randn(n, 3, 5, 4, generator=gen, dtype=F64) * ch(0.5, 2.0, 4.0) + ch(-3.0, 0.0, 5.0) + drift
    m = _made(cls, nn.Module, 3, virtual_batch_size=vb, momentum=momentum, eps=eps).double().train()
    state, names = {**dict(m.named_parameters()), **dict(m.named_buffers())}, ("running_mean", "running_var")
    if all(isinstance(getattr(m, k, None), torch.Tensor) and k not in state for k in names):
        raise AttributeError("its running statistics are plain tensors, not buffers")
    if any(k not in state for k in ("weight", "bias", *names)):
        raise AttributeError("it lacks weight, bias, running_mean or running_var")
    if any(state[k].shape != (3,) for k in ("weight", "bias", *names)):
        raise AttributeError("its weight, bias or running statistics are not of shape (C,)")
    out = {"initial state": [state[k].detach().clone() for k in ("weight", "bias", *names)]}
    with torch.no_grad():
        m.weight.copy_(torch.rand(3, generator=gen, dtype=F64) + 0.5)
        m.bias.copy_(torch.randn(3, generator=gen, dtype=F64))
    y = m(x.requires_grad_())
    (y * torch.randn(y.shape, generator=gen, dtype=F64)).sum().backward()
    out |= {"output": y.detach(), "input grad": x.grad, "weight grad": m.weight.grad, "bias grad": m.bias.grad}
    out |= {k: getattr(m, k).detach().clone() for k in names}
    out["running stats outside autograd"] = not (m.running_mean.requires_grad or m.running_var.requires_grad)
    with torch.no_grad():
        m.eval().running_mean.copy_(torch.randn(3, generator=gen, dtype=F64))
        m.running_var.copy_(torch.rand(3, generator=gen, dtype=F64) + 0.5)
        out["eval output"] = m(x.detach())
        out |= {f"{k} after eval": getattr(m, k).clone() for k in names}
    return out


_ghost_variant = partial(_class_variant, _GhostVariant, "MyGhostBatchNorm2d")


def _stage(kinds, keys, o):
    """Seen when the answer's outputs under ``keys`` differ from the oracle's and equal those of a variant of
    ``kinds``: the first part that goes wrong names the mistake, whatever the later parts do."""
    diff = lambda a, b: any(difference(a[k], b[k], 1e-6, 1e-8) for k in keys)
    variants = (_run_ghost(_ghost_variant(kind), o.case) for kind in kinds.split())
    return diff(o.got, o.want) and any(not diff(o.got, theirs) for theirs in variants)


_RUNNING = ("running_mean", "running_var")
_GHOST_STAGES = {k: ("output",) for k in ("whole_batch", "unbiased_norm", "per_pixel per_sample mix_channels")}
_GHOST_STAGES |= {"no_affine": ("output",), "detach_stats": ("input grad",), "detach_weight": ("weight grad",)}
_GHOST_STAGES |= {"no_running running_whole": _RUNNING, "running_biased": _RUNNING}
_GHOST_STAGES |= {"eval_batch_stats": ("eval output",), "eval_updates": tuple(f"{k} after eval" for k in _RUNNING)}
_GHOST_STAGES |= {"own_eps": ("output",), "own_momentum": _RUNNING}
GHOST_BATCH_NORM = Exercise(
    name="ghost_batch_norm",
    answer=("MyGhostBatchNorm2d",),
    oracle=GhostBatchNorm2d,
    run=_run_ghost,
    rtol=1e-6,
    atol=1e-8,
    cases=lambda: [
        Case((12, 4, 0, 0.1, 1e-5), label="a batch of 12 in virtual batches of 4"),
        Case(
            (10, 4, 1, 0.3, 1e-3),
            label="a batch of 10 in virtual batches of 4, the last one smaller, momentum 0.3 and eps 1e-3",
        ),
        Case((12, 64, 2, 0.1, 1e-5), label="a batch of 12 in one virtual batch, which is exactly nn.BatchNorm2d"),
    ],
    refuse=(
        "torch.nn.functional.batch_norm",
        "torch.batch_norm",
        "torch.native_batch_norm",
        "torch.ops.aten.batch_norm",
        "torch.ops.aten.native_batch_norm",
        "utils.models.GhostBatchNorm2d.forward",
    ),
    refuse_hint="subclass nn.Module and compute each virtual batch's mean and variance yourself with Tensor.mean and "
    "Tensor.var",
    hint="per virtual batch and channel: subtract the mean, divide by the square root of the biased variance plus eps, "
    "then scale by weight and add bias; in eval mode use the running statistics",
    passed="outputs, gradients and running statistics in training, uneven and single virtual batches, and eval mode",
    mistakes=_named(
        {
            "not_class": _NOT_CLASS,
            "not_module": "your class is not an nn.Module. Try: subclass nn.Module and call super().__init__() first",
            "shaped": "weight, bias, running_mean and running_var must be of shape (C,), one value per channel, as in "
            "nn.BatchNorm2d, whose state_dict they must match. Try: create them with C values and reshape them to (1, "
            "C, 1, 1) only where forward uses them",
            "rename": "the parameters or buffers are not named as in nn.BatchNorm2d. Try: use weight and bias "
            "(nn.Parameter), running_mean and running_var (register_buffer), one value per channel",
            "plain_running": "running_mean and running_var are plain tensors, not buffers, so state_dict() and "
            "model.to(device) leave them out. Try: create them with self.register_buffer",
            "zero_weight": "weight, bias or the running statistics do not start as in nn.BatchNorm2d. Try: start with "
            "weight 1, bias 0, running_mean 0 and running_var 1",
            "own_eps": "the eps the layer was built with is not used. Try: keep the eps argument and add it to the "
            "variance inside the square root",
            "own_momentum": "the running statistics ignore the momentum the layer was built with. Try: keep the "
            "momentum argument: new = (1 - momentum) * old + momentum * the virtual batch's statistic",
            "whole_batch": "your statistics are over the whole batch, not per virtual batch. Try: split the batch into "
            "virtual batches of virtual_batch_size (Tensor.split) and normalise each with its own mean and variance",
            "unbiased_norm": "you normalise with the unbiased variance (divided by n - 1). Try: normalise with the "
            "biased variance (correction=0); the unbiased one is for running_var",
            "per_pixel": "your mean and variance are not one per channel (per pixel, per sample, or mixing the "
            "channels). Try: reduce over dims (0, 2, 3): N, H and W, one statistic per channel",
            "no_affine": "the affine weight and bias are not applied. Try: multiply by weight and add bias, per channel",
            "detach_stats": "the outputs are right but the input gradient is not. Try: let autograd see the mean and "
            "variance: no torch.no_grad() or .detach() around them",
            "detach_weight": "the gradient of weight is wrong. Try: use self.weight, the nn.Parameter itself, in the output",
            "no_running": "running_mean and running_var were not updated once per virtual batch (not at all, or with "
            "the whole batch). Try: update them in training, once per virtual batch, with that virtual batch's mean "
            "and variance",
            "running_biased": "running_var was updated with the biased variance. Try: use the unbiased variance "
            "(divided by n - 1) for running_var, as nn.BatchNorm2d does",
            "graph_running": "the running statistics are part of the autograd graph. Try: update them under "
            "torch.no_grad() or from detached values",
            "reshape": "a batch that virtual_batch_size does not divide fails, but the last virtual batch may be "
            "smaller. Try: split with Tensor.split, which allows a smaller last piece, not with a reshape",
            "eval_batch_stats": "in eval mode your outputs differ from nn.BatchNorm2d. Try: in eval mode normalise "
            "with running_mean and running_var, not the batch's statistics",
            "eval_updates": "eval mode changed the running statistics. Try: update them only when self.training is True",
        },
        _ghost_variant,
        **{k.split()[0]: partial(_stage, k, keys) for k, keys in _GHOST_STAGES.items()},
        not_class=_raised("not a class"),
        not_module=_raised("not a Module class"),
        rename=_raised("lacks weight"),
        shaped=_raised("not of shape (C,)"),
        plain_running=_raised("not buffers"),
        zero_weight=lambda o: difference(o.got["initial state"], o.want["initial state"]) is not None,
        reshape=_raised("is invalid for input of size", "multiply up to"),
        graph_running=lambda o: o.got["running stats outside autograd"] is False,
    ),
)

check_warmup_lr = WARMUP_LR.checker("``warmup_lr(step, base_lr, peak_lr, warmup_steps)``: the rate of step ``step``.")
check_trust_ratio = TRUST_RATIO.checker("``trust_ratio(w, g, weight_decay, trust_coefficient, eps)``: the LARS factor.")
check_lars_step = LARS_STEP.checker("``lars_step(w, g, buf, lr, ...)`` -> (new_w, new_buf), compared with optim.LARS.")
check_lr_for_batch = LR_FOR_BATCH.checker("``lr_for_batch(base_lr, base_batch, batch, rule)``: linear or sqrt.")
check_lars_optimizer = LARS_OPTIMIZER.checker("``MyLARS``, a torch.optim.Optimizer, stepped like utils.optim.LARS.")
check_ghost_batch_norm = GHOST_BATCH_NORM.checker("``MyGhostBatchNorm2d``: batch norm over virtual batches.")

__all__ = [name for name in dir() if name.startswith("check_")]
