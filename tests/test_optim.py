"""LARS against hand-computed updates; its trust ratio, LARC clipping, parameter groups,
argument checks; gradient noise; GhostBatchNorm2d against BatchNorm2d."""

import copy
import math

import pytest
import torch
from torch import nn

from utils.models import GhostBatchNorm2d, Net
from utils.optim import (
    LARS,
    MultiplicativeNoiseLoss,
    lars_param_groups,
    make_optimizer,
    noise_sigma,
    sample_weighted_loss,
)


def _norm(v):
    return math.sqrt(sum(x * x for x in v))


def reference_lars(
    w, grads, *, lr, momentum=0.0, weight_decay=0.0, eta=0.001, eps=1e-8, nesterov=False, clip=False, adapt=True
):
    """The update of the paper written out with Python floats, one step per gradient in ``grads``."""
    w, buf = list(w), None
    for g in grads:
        d = [gi + weight_decay * wi for gi, wi in zip(g, w)]
        if adapt:
            wn, gn = _norm(w), _norm(g)
            ratio = eta * wn / (gn + weight_decay * wn + eps) if wn > 0 and gn > 0 else 1.0
            if clip and wn > 0 and gn > 0:
                ratio = min(ratio / lr, 1.0)
            d = [ratio * x for x in d]
        if momentum:
            buf = list(d) if buf is None else [momentum * b + x for b, x in zip(buf, d)]
            d = [x + momentum * b for x, b in zip(d, buf)] if nesterov else buf
        w = [wi - lr * x for wi, x in zip(w, d)]
    return w


W0 = [0.5, -1.0, 2.0]
GRADS = [[0.1, 0.2, -0.3], [-0.05, 0.4, 0.1], [0.3, -0.1, 0.2], [0.0, 0.05, -0.2]]


def run_lars(w0, grads, **kw):
    p = nn.Parameter(torch.tensor(w0, dtype=torch.float64))
    opt = LARS([p], **kw)
    for g in grads:
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    return p.detach().tolist(), opt


def test_one_step_by_hand():
    # ||w|| = sqrt(0.25 + 1 + 4) = 2.29129, ||g|| = sqrt(0.01 + 0.04 + 0.09) = 0.374166
    # ratio = 0.02 * 2.29129 / (0.374166 + 0.1 * 2.29129) = 0.0759592
    # d = ratio * (g + 0.1 w) = ratio * [0.15, 0.1, -0.1];  w' = w - 1.0 * d
    got, opt = run_lars(W0, GRADS[:1], lr=1.0, momentum=0.0, weight_decay=0.1, trust_coefficient=0.02, eps=0.0)
    ratio = 0.02 * math.sqrt(5.25) / (math.sqrt(0.14) + 0.1 * math.sqrt(5.25))
    assert ratio == pytest.approx(0.0759592, rel=1e-5)
    want = [0.5 - ratio * 0.15, -1.0 - ratio * 0.1, 2.0 + ratio * 0.1]
    assert got == pytest.approx(want, rel=1e-12), "one LARS step differs from the paper's formula"
    assert float(opt.state[next(iter(opt.state))]["trust_ratio"]) == pytest.approx(ratio, rel=1e-12)


@pytest.mark.parametrize(
    "kw",
    [
        dict(lr=0.5, momentum=0.0, weight_decay=0.0),
        dict(lr=0.5, momentum=0.9, weight_decay=0.0),
        dict(lr=0.5, momentum=0.0, weight_decay=0.01),
        dict(lr=2.0, momentum=0.9, weight_decay=0.05),
        dict(lr=2.0, momentum=0.9, weight_decay=0.05, nesterov=True),
        dict(lr=0.3, momentum=0.8, weight_decay=0.01, adapt=False),
        dict(lr=0.01, momentum=0.9, weight_decay=0.01, clip=True),
    ],
    ids=["plain", "momentum", "wd", "momentum+wd", "nesterov", "excluded", "larc"],
)
def test_several_steps_match_reference(kw):
    eta = 0.02
    got, _ = run_lars(W0, GRADS, trust_coefficient=eta, eps=1e-8, **kw)
    ref_kw = {k: v for k, v in kw.items()}
    want = reference_lars(W0, GRADS, eta=eta, eps=1e-8, **ref_kw)
    assert got == pytest.approx(want, rel=1e-10, abs=1e-12), f"LARS with {kw} drifts from the hand-computed update"


def test_excluded_group_is_sgd_with_momentum_and_groups_are_independent():
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
    b = nn.Parameter(torch.randn(3, dtype=torch.float64))
    a0 = a.detach().flatten().tolist()
    b_sgd = nn.Parameter(b.detach().clone())
    lars = LARS(
        [{"params": [a]}, {"params": [b], "adapt": False, "weight_decay": 0.0}],
        lr=0.1,
        momentum=0.9,
        weight_decay=0.01,
        trust_coefficient=0.01,
    )
    sgd = torch.optim.SGD([b_sgd], lr=0.1, momentum=0.9)
    grads_a = []
    for _ in range(3):
        ga, gb = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
        grads_a.append(ga.flatten().tolist())
        a.grad, b.grad, b_sgd.grad = ga, gb, gb.clone()
        lars.step()
        sgd.step()
    want_a = reference_lars(a0, grads_a, lr=0.1, momentum=0.9, weight_decay=0.01, eta=0.01)
    assert a.detach().flatten().tolist() == pytest.approx(want_a, rel=1e-10), "the adapted group drifts"
    assert torch.allclose(b, b_sgd, rtol=0, atol=1e-12), "an adapt=False group must behave as torch.optim.SGD"
    assert "trust_ratio" not in lars.state[b] and "trust_ratio" in lars.state[a]


def test_matches_torch_sgd_when_ratio_is_one():
    # trust_coefficient chosen so that the ratio is exactly 1 is hard; adapt=False everywhere instead
    torch.manual_seed(1)
    p1 = nn.Parameter(torch.randn(5, 2))
    p2 = nn.Parameter(p1.detach().clone())
    o1 = LARS([p1], lr=0.1, momentum=0.9, weight_decay=1e-3, adapt=False, nesterov=True)
    o2 = torch.optim.SGD([p2], lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=True)
    for _ in range(4):
        g = torch.randn(5, 2)
        p1.grad, p2.grad = g.clone(), g.clone()
        o1.step()
        o2.step()
    assert torch.allclose(p1, p2, atol=1e-6)


@pytest.mark.parametrize(
    "w,g",
    [([0.0, 0.0, 0.0], [0.1, -0.2, 0.3]), ([1.0, 2.0, -1.0], [0.0, 0.0, 0.0])],
    ids=["zero-weights", "zero-gradient"],
)
def test_trust_ratio_is_one_when_a_norm_is_zero(w, g):
    got, opt = run_lars(w, [g], lr=0.5, momentum=0.0, weight_decay=0.0, trust_coefficient=0.001)
    ratio = float(next(iter(opt.state.values()))["trust_ratio"])
    assert ratio == 1.0, f"trust ratio must be 1 when ||w|| or ||g|| is 0, got {ratio}"
    assert got == pytest.approx([wi - 0.5 * gi for wi, gi in zip(w, g)])


def test_larc_clips_the_local_rate_at_the_global_one():
    # a huge trust coefficient: unclipped the step is enormous, clipped it is plain SGD (factor 1)
    _, opt = run_lars(W0, GRADS[:1], lr=0.1, momentum=0.0, trust_coefficient=100.0, clip=True)
    assert float(next(iter(opt.state.values()))["trust_ratio"]) == 1.0
    got, _ = run_lars(W0, GRADS[:1], lr=0.1, momentum=0.0, trust_coefficient=100.0, clip=True)
    assert got == pytest.approx([w - 0.1 * g for w, g in zip(W0, GRADS[0])])
    unclipped, _ = run_lars(W0, GRADS[:1], lr=0.1, momentum=0.0, trust_coefficient=100.0)
    assert abs(unclipped[0] - W0[0]) > 10 * abs(got[0] - W0[0])
    # a small one: below the global rate, LARC applies trust / lr, i.e. an effective rate `trust`
    got, opt = run_lars(W0, GRADS[:1], lr=0.1, momentum=0.0, trust_coefficient=0.001, clip=True, eps=0.0)
    trust = 0.001 * _norm(W0) / _norm(GRADS[0])
    assert float(next(iter(opt.state.values()))["trust_ratio"]) == pytest.approx(trust / 0.1)
    assert got == pytest.approx([w - trust * g for w, g in zip(W0, GRADS[0])])


def test_lazy_state_and_grad_untouched():
    p = nn.Parameter(torch.ones(3))
    q = nn.Parameter(torch.ones(2))  # never gets a gradient
    opt = LARS([p, q], lr=0.1, momentum=0.9, weight_decay=0.1)
    assert len(opt.state) == 0, "state must be created on the first step, not in __init__"
    g = torch.tensor([1.0, 2.0, 3.0])
    p.grad = g.clone()
    opt.step()
    assert torch.equal(p.grad, g), "LARS must not modify p.grad in place"
    assert q not in opt.state and "momentum_buffer" in opt.state[p]
    assert torch.equal(q.detach(), torch.ones(2))


def test_state_dict_round_trip():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = LARS(lars_param_groups(model, 1e-4), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    opt2 = LARS(lars_param_groups(model, 1e-4), lr=0.1)
    opt2.load_state_dict(opt.state_dict())
    assert opt2.param_groups[0]["adapt"] is True and opt2.param_groups[1]["adapt"] is False
    assert torch.equal(opt2.state[model.weight]["momentum_buffer"], opt.state[model.weight]["momentum_buffer"])


def test_reused_step_lists_follow_the_state():
    """A step reuses its lists (momentum buffers, ratio views) while nothing changed; every change
    below must still give the paper's update (reference_lars) or a fresh start."""
    kw = dict(lr=0.1, momentum=0.9, weight_decay=1e-3)
    a = nn.Parameter(torch.tensor(W0, dtype=torch.float64))
    b = nn.Parameter(torch.tensor(W0[::-1], dtype=torch.float64))
    opt = LARS([a, b], **kw)
    for i, g in enumerate(GRADS):
        a.grad = torch.tensor(g, dtype=torch.float64)
        b.grad = torch.tensor(g[::-1], dtype=torch.float64) if i != 1 else None  # b sits out step 1
        opt.step()
        if i == 2:  # restore a copy of the state mid-run: new tensors in opt.state
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert a.detach().tolist() == pytest.approx(reference_lars(W0, GRADS, **kw), rel=1e-12)
    b_grads = [g[::-1] for i, g in enumerate(GRADS) if i != 1]
    assert b.detach().tolist() == pytest.approx(reference_lars(W0[::-1], b_grads, **kw), rel=1e-12)
    # the state holds what the steps used: the same buffer and ratio as a run never restored
    _, ref = run_lars(W0, GRADS, **kw)
    (p_ref,) = ref.state
    assert torch.equal(opt.state[a]["momentum_buffer"], ref.state[p_ref]["momentum_buffer"])
    assert torch.equal(opt.state[a]["trust_ratio"], ref.state[p_ref]["trust_ratio"])
    # a cleared state starts again from zero buffers, as a new optimizer would
    w_now = a.detach().tolist()
    opt.state.clear()
    a.grad, b.grad = torch.tensor(GRADS[0], dtype=torch.float64), torch.tensor(GRADS[1], dtype=torch.float64)
    opt.step()
    assert a.detach().tolist() == pytest.approx(reference_lars(w_now, GRADS[:1], **kw), rel=1e-12)
    # momentum switched off mid-run: plain LARS from here on
    opt.param_groups[0]["momentum"] = 0.0
    w_now = a.detach().tolist()
    a.grad = torch.tensor(GRADS[2], dtype=torch.float64)
    opt.step()
    assert a.detach().tolist() == pytest.approx(reference_lars(w_now, GRADS[2:3], lr=0.1, weight_decay=1e-3), rel=1e-12)


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(lr=0.0), "lr"),
        (dict(lr=-1.0), "lr"),
        (dict(lr=float("nan")), "lr"),
        (dict(lr=0.1, momentum=1.0), "momentum"),
        (dict(lr=0.1, momentum=-0.1), "momentum"),
        (dict(lr=0.1, weight_decay=-1e-4), "weight_decay"),
        (dict(lr=0.1, trust_coefficient=0.0), "trust_coefficient"),
        (dict(lr=0.1, eps=-1.0), "eps"),
        (dict(lr=0.1, momentum=0.0, nesterov=True), "nesterov"),
        (dict(lr=0.1, clip="yes"), "clip"),
    ],
)
def test_bad_arguments_say_which(kw, msg):
    with pytest.raises(ValueError, match=msg):
        LARS([nn.Parameter(torch.ones(2))], **kw)


def test_bad_group_is_rejected_before_it_is_added():
    opt = LARS([nn.Parameter(torch.ones(2))], lr=0.1)
    with pytest.raises(ValueError, match="momentum"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(2))], "momentum": 2.0})
    assert len(opt.param_groups) == 1


def test_param_groups_exclude_biases_and_norms():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))
    groups = lars_param_groups(model, weight_decay=5e-4)
    adapted, excluded = groups
    assert adapted["adapt"] and adapted["weight_decay"] == 5e-4
    assert not excluded["adapt"] and excluded["weight_decay"] == 0.0
    assert {id(p) for p in adapted["params"]} == {id(model[0].weight), id(model[3].weight)}
    assert len(excluded["params"]) == 4  # conv bias, bn weight + bias, linear bias
    model[3].bias.requires_grad_(False)
    assert len(lars_param_groups(model)[1]["params"]) == 3, "frozen parameters must be left out"
    assert len(lars_param_groups(nn.Linear(2, 2, bias=False))) == 1, "empty groups are dropped"


def test_fits_a_small_batch_and_reports_ratios_by_name():
    torch.manual_seed(0)
    model = Net(8, in_channels=1, image_size=8)
    opt = LARS(lars_param_groups(model, 5e-4), lr=1.0, momentum=0.9, trust_coefficient=0.01)
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
    losses = []
    for _ in range(30):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], "LARS should fit a fixed small batch"
    ratios = opt.trust_ratios(model)
    assert set(ratios) == {n for n, p in model.named_parameters() if p.ndim >= 2}


def test_noise_sigma_matches_the_variance_argument():
    assert noise_sigma(64, 16) == pytest.approx(math.sqrt(3))
    assert noise_sigma(16, 16) == 0.0
    with pytest.raises(ValueError, match="small_batch"):
        noise_sigma(8, 16)


def test_multiplicative_noise_gradient_equals_hand_computed_weighted_sum():
    """Oracle by hand: for y_hat = w . x under squared error, loss_n = (w . x_n - y_n)^2 and its
    gradient is g_n = 2 r_n x_n; the noisy gradient must be (1/B) sum z_n g_n with the z_n drawn
    from the same generator state."""
    torch.manual_seed(0)
    B, d, sigma = 6, 3, 0.7
    x, y = torch.randn(B, d, dtype=torch.float64), torch.randn(B, dtype=torch.float64)
    w = torch.randn(d, dtype=torch.float64, requires_grad=True)
    sq = lambda out, target, reduction: (out - target) ** 2  # noqa: E731 - per-sample squared error
    loss = MultiplicativeNoiseLoss(sigma, loss=sq, generator=torch.Generator().manual_seed(3))(x @ w, y)
    loss.backward()
    z = 1 + sigma * torch.randn(B, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    r = (x @ w - y).detach()
    expected = sum(z[n] * 2 * r[n] * x[n] for n in range(B)) / B
    assert torch.allclose(w.grad, expected, rtol=1e-12, atol=1e-12)
    # sigma = 0 is exactly the plain mean, and so is a call without autograd (validation)
    w.grad = None
    MultiplicativeNoiseLoss(0.0, loss=sq)(x @ w, y).backward()
    assert torch.allclose(w.grad, (2 * r[:, None] * x).mean(0), rtol=1e-12)
    with torch.no_grad():
        plain = nn.functional.cross_entropy(x, torch.tensor([0, 1, 2, 0, 1, 2]))
        assert torch.equal(MultiplicativeNoiseLoss(5.0)(x, torch.tensor([0, 1, 2, 0, 1, 2])), plain)
    with pytest.raises(ValueError, match="sigma"):
        MultiplicativeNoiseLoss(-1.0)


def test_multiplicative_noise_has_the_predicted_variance():
    """Given the batch, the weighted gradient's variance is (sigma^2 / B^2) sum g_n^2 per
    coordinate (z_n independent, variance sigma^2): checked over many draws."""
    torch.manual_seed(1)
    B, d, sigma, draws = 8, 2, 0.5, 20000
    x, y = torch.randn(B, d, dtype=torch.float64), torch.randn(B, dtype=torch.float64)
    w0 = torch.randn(d, dtype=torch.float64)
    g_n = 2 * (x @ w0 - y)[:, None] * x  # per-sample gradients, by hand
    gen = torch.Generator().manual_seed(0)
    sq = lambda out, target, reduction: (out - target) ** 2  # noqa: E731
    grads = []
    for _ in range(draws):
        w = w0.clone().requires_grad_(True)
        sample_weighted_loss(sq(x @ w, y, "none"), sigma, gen).backward()
        grads.append(w.grad)
    grads = torch.stack(grads)
    assert torch.allclose(grads.mean(0), g_n.mean(0), rtol=0.03, atol=0.03 * g_n.abs().mean().item())
    predicted = sigma**2 * (g_n**2).sum(0) / B**2
    assert torch.allclose(grads.var(0), predicted, rtol=0.05)


def test_ghost_batch_norm_equals_batch_norm_when_virtual_batch_is_the_batch():
    torch.manual_seed(0)
    x = torch.randn(16, 3, 5, 5) * 2 + 1
    bn, gbn = nn.BatchNorm2d(3), GhostBatchNorm2d(3, virtual_batch_size=16)
    gbn.load_state_dict(bn.state_dict())
    for _ in range(3):
        assert torch.allclose(gbn(x), bn(x), atol=1e-6), "train mode: ghost BN with one virtual batch must equal BN"
    assert torch.allclose(gbn.running_mean, bn.running_mean) and torch.allclose(gbn.running_var, bn.running_var)
    gbn.eval(), bn.eval()
    assert torch.allclose(gbn(x), bn(x), atol=1e-6), "eval mode uses the running statistics, as BN"


def test_ghost_batch_norm_normalises_each_virtual_batch():
    torch.manual_seed(0)
    x = torch.randn(12, 2, 3, 3)
    x[6:] = x[6:] * 5 + 3  # the two halves have different statistics
    gbn = GhostBatchNorm2d(2, virtual_batch_size=6, affine=False)
    out = gbn(x)
    ref = torch.cat([nn.functional.batch_norm(c, None, None, training=True) for c in x.split(6)])
    assert torch.allclose(out, ref, atol=1e-5)
    with pytest.raises(ValueError):
        GhostBatchNorm2d(2, virtual_batch_size=0)


# ---- self-checks of lab4: pass on a right answer, fail with a message on the placeholder and typical mistakes


def _placeholder(*args, **kwargs):
    raise NotImplementedError("Exercise: write this part (see the hint above)")


def _trust_ratio(w, g, weight_decay, trust_coefficient, eps):
    wn, gn = torch.linalg.vector_norm(w), torch.linalg.vector_norm(g)
    r = trust_coefficient * wn / (gn + weight_decay * wn + eps)
    return torch.where((wn > 0) & (gn > 0), r, torch.ones_like(r))


def _lars_step(w, g, buf, lr, momentum, weight_decay, trust_coefficient, eps):
    d = _trust_ratio(w, g, weight_decay, trust_coefficient, eps) * (g + weight_decay * w)
    buf = d.clone() if buf is None else momentum * buf + d
    return w - lr * buf, buf


def test_check_lars_step():
    from utils.checks import CheckFailed, check_lars_step

    check_lars_step(_lars_step)
    with pytest.raises(CheckFailed, match="not implemented"):
        check_lars_step(_placeholder)

    def decay_after_scaling(w, g, buf, lr, m, wd, tc, eps):
        d = _trust_ratio(w, g, wd, tc, eps) * g
        buf = d.clone() if buf is None else m * buf + d
        return w - lr * buf, buf

    with pytest.raises(CheckFailed, match="before scaling"):
        check_lars_step(decay_after_scaling)

    def lr_inside_only(w, g, buf, lr, m, wd, tc, eps):
        d = _trust_ratio(w, g, wd, tc, eps) * (g + wd * w)
        buf = d.clone() if buf is None else m * buf + d
        return w - buf, buf

    with pytest.raises(CheckFailed, match="global lr"):
        check_lars_step(lr_inside_only)


def test_step_never_reads_a_tensor_on_the_host(monkeypatch):
    """No .item(), float() or `if tensor` inside step: each would be a GPU -> CPU sync per parameter."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    opts = [
        LARS(lars_param_groups(model, 1e-3), lr=0.1, momentum=0.9, nesterov=nesterov, clip=clip)
        for nesterov in (False, True)
        for clip in (False, True)
    ]
    opts.append(LARS(lars_param_groups(model, 1e-3), lr=0.1, momentum=0.0))
    model(torch.randn(16, 4)).sum().backward()

    def sync(*args, **kwargs):
        raise AssertionError("LARS.step read a tensor on the host (a sync point per parameter)")

    for name in ("item", "__bool__", "__float__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, sync)
    for opt in opts:
        opt.step()
        opt.step()


@pytest.mark.parametrize(
    "kw",
    [
        dict(momentum=0.9, weight_decay=1e-2),
        dict(momentum=0.0, weight_decay=0.0),
        dict(momentum=0.9, weight_decay=1e-2, nesterov=True, clip=True),
    ],
)
def test_multi_tensor_step_equals_one_tensor_at_a_time(kw):
    """The group's tensors are stepped together (for-each ops, stacked norms); each must move
    exactly as if it were alone in its own optimizer, whatever its shape, dtype or gradient."""
    torch.manual_seed(0)
    shapes = [(4, 3), (7,), (2, 3, 3), (5, 5)]
    together = [
        nn.Parameter(torch.randn(s, dtype=torch.float64 if i % 2 else torch.float32)) for i, s in enumerate(shapes)
    ]
    together[3].data.zero_()  # a zero-norm weight among them
    alone = [nn.Parameter(p.detach().clone()) for p in together]
    opt = LARS(together, lr=0.1, trust_coefficient=0.02, **kw)
    opts = [LARS([p], lr=0.1, trust_coefficient=0.02, **kw) for p in alone]
    for step in range(3):
        for i, (p, q) in enumerate(zip(together, alone)):
            g = torch.zeros_like(p) if (i == 1 and step == 1) else torch.randn_like(p)  # a zero gradient once
            p.grad, q.grad = g, g.clone()
        opt.step()
        for o in opts:
            o.step()
        for p, q, o in zip(together, alone, opts):
            tol = 1e-12 if p.dtype == torch.float64 else 1e-6
            assert torch.allclose(p, q, rtol=tol, atol=tol), (
                "a tensor stepped with others differs from it stepped alone"
            )
            assert torch.allclose(opt.state[p]["trust_ratio"].double(), o.state[q]["trust_ratio"].double(), rtol=1e-6)


def test_make_optimizer_has_one_meaning_per_name():
    model = nn.Linear(3, 2)
    plain = make_optimizer("sgd", model.parameters(), lr=0.1)
    assert isinstance(plain, torch.optim.SGD) and plain.param_groups[0]["momentum"] == 0, "'sgd' is plain SGD"
    heavy = make_optimizer("sgd", model.parameters(), lr=0.1, momentum=0.9)
    assert heavy.param_groups[0]["momentum"] == 0.9
    assert isinstance(make_optimizer("adam", model.parameters()), torch.optim.Adam)
    assert isinstance(make_optimizer("adamw", model.parameters()), torch.optim.AdamW)
    with pytest.raises(ValueError, match="momentum"):
        make_optimizer("adam", model.parameters(), momentum=0.9)
    with pytest.raises(ValueError, match="unknown optimizer"):
        make_optimizer("lion", model.parameters())
