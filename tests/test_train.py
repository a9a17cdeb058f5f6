import pytest
import torch
from torch import nn

from utils import config, data, models, train


@pytest.mark.slow
def test_lecture_cnn_reaches_90_percent_on_digits_in_smoke_profile():
    cfg = config.profile("smoke")
    torch.manual_seed(0)
    s = data.load("digits", n_train=cfg.n_train, n_val=cfg.n_val)
    net = models.net_for(s.shape, cfg.cnn_width)
    hist = train.fit(
        net,
        data.make_loader(s.train, cfg.batch_size),
        torch.optim.Adam(net.parameters(), cfg.lr),
        epochs=cfg.epochs,
        val_loader=data.make_loader(s.val, 512, shuffle=False),
        progress=False,
    )
    assert hist.val_acc >= 0.90, f"lecture CNN reached only {hist.val_acc:.3f} on digits"
    assert len(hist.epochs) == cfg.epochs and hist.images == cfg.epochs * cfg.n_train
    assert hist.step_loss[-1] < hist.step_loss[0]
    assert hist.images_per_s > 0 and hist.wall_time >= hist.train_time


def _tiny_problem(n=32):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 1, 4, 4, generator=g), torch.randint(0, 3, (n,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def _model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3))


def test_one_step_equals_hand_computed_sgd_step():
    ds = _tiny_problem(16)
    m, ref = _model(), _model()
    train.fit(m, data.make_loader(ds, 16, shuffle=False), torch.optim.SGD(m.parameters(), 0.1), steps=1, progress=False)
    loss = nn.functional.cross_entropy(ref(ds.tensors[0]), ds.tensors[1])
    grads = torch.autograd.grad(loss, list(ref.parameters()))
    for p, q, g in zip(m.parameters(), ref.parameters(), grads):
        assert torch.allclose(p, q - 0.1 * g, atol=1e-6)


def test_gradient_accumulation_equals_the_big_batch():
    ds = _tiny_problem(32)
    a, b = _model(), _model()
    train.fit(
        a,
        data.make_loader(ds, 8, shuffle=False),
        torch.optim.SGD(a.parameters(), 0.1),
        steps=2,
        grad_accum=2,
        progress=False,
    )
    train.fit(b, data.make_loader(ds, 16, shuffle=False), torch.optim.SGD(b.parameters(), 0.1), steps=2, progress=False)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=1e-6), "2 micro-batches of 8 must equal one batch of 16"


def test_scheduler_is_stepped_per_iteration_and_lr_recorded():
    ds = _tiny_problem(32)
    m = _model()
    opt = torch.optim.SGD(m.parameters(), 1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (i + 1))
    hist = train.fit(m, data.make_loader(ds, 8), opt, epochs=2, scheduler=sched, progress=False)
    assert hist.steps == 8 and len(hist.step_loss) == 8
    assert hist.step_lr == pytest.approx([1.0 / (i + 1) for i in range(8)])


@pytest.mark.slow  # trains the lecture CNN to 80%: about 16 s of CPU
def test_steps_limit_and_stop_at_accuracy():
    s = data.load("digits", n_train=400)
    torch.manual_seed(0)
    net = models.net_for(s.shape, 16)
    val = data.make_loader(s.val, 512, shuffle=False)
    hist = train.fit(
        net,
        data.make_loader(s.train, 32),
        torch.optim.Adam(net.parameters(), 3e-3),
        epochs=50,
        val_loader=val,
        eval_every=5,
        callbacks=[train.StopAtAccuracy(0.8)],
        progress=False,
    )
    reached = hist.steps_to(0.8)
    assert reached is not None and hist.steps == reached, "the run must stop at the first evaluation >= target"
    hist = train.fit(
        net, data.make_loader(s.train, 32), torch.optim.SGD(net.parameters(), 0.01), steps=7, progress=False
    )
    assert hist.steps == 7 and len(hist.step_loss) == 7


def test_evaluate_matches_manual_computation_and_restores_mode():
    ds = _tiny_problem(20)
    m = _model().train()
    r = train.evaluate(m, data.make_loader(ds, 6, shuffle=False))
    with torch.no_grad():
        out = m(ds.tensors[0])
    assert r["n"] == 20
    assert r["loss"] == pytest.approx(nn.functional.cross_entropy(out, ds.tensors[1]).item(), rel=1e-5)
    assert r["acc"] == pytest.approx((out.argmax(1) == ds.tensors[1]).float().mean().item())
    assert m.training


def test_bf16_autocast_and_channels_last_run_on_cpu():
    s = data.load("digits", n_train=128)
    net = models.net_for(s.shape, 8)
    hist = train.fit(
        net,
        data.make_loader(s.train, 32),
        torch.optim.SGD(net.parameters(), 0.05),
        epochs=1,
        amp_dtype=torch.bfloat16,
        channels_last=True,
        val_loader=data.make_loader(s.val, 128),
        progress=False,
    )
    assert hist.steps == 4 and all(torch.isfinite(torch.tensor(hist.step_loss)))


def test_bad_arguments_say_what_to_do():
    m = _model()
    with pytest.raises(ValueError, match="epochs=... or steps="):
        train.fit(m, [], torch.optim.SGD(m.parameters(), 0.1))
    with pytest.raises(ValueError, match="grad_accum"):
        train.fit(m, [], torch.optim.SGD(m.parameters(), 0.1), epochs=1, grad_accum=0)
    with pytest.raises(ValueError, match="no batches"):
        train.fit(m, [], torch.optim.SGD(m.parameters(), 0.1), epochs=1, progress=False)
    with pytest.raises(ValueError, match="start_epoch=3 is not in"):
        train.fit(m, [], torch.optim.SGD(m.parameters(), 0.1), epochs=2, start_epoch=3)


@pytest.mark.parametrize("kind", ["device", "dataloader"])
def test_resuming_with_start_epoch_equals_the_uninterrupted_run(tmp_path, kind):
    ds = _tiny_problem(32)

    def fresh():
        """A new process's objects: model, optimizer with momentum, per-step schedule, shuffling loader."""
        m = _model()
        opt = torch.optim.SGD(m.parameters(), 0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return m, opt, sched, data.make_loader(ds, 8, kind=kind, seed=5)

    def from_checkpoint():
        m, opt, sched, loader = fresh()
        ck = torch.load(tmp_path / "ck.pt", weights_only=True)
        m.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        return m, opt, sched, loader

    full, opt, sched, loader = fresh()
    train.fit(full, loader, opt, epochs=3, scheduler=sched, progress=False)

    m, opt, sched, loader = fresh()
    train.fit(m, loader, opt, epochs=1, scheduler=sched, progress=False)  # then the run is interrupted
    torch.save({"model": m.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, tmp_path / "ck.pt")

    resumed, opt, sched, loader = from_checkpoint()
    hist = train.fit(resumed, loader, opt, epochs=3, start_epoch=1, scheduler=sched, progress=False)
    assert [e["epoch"] for e in hist.epochs] == [1, 2] and hist.steps == 8
    for (name, want), got in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(got, want), f"resumed at epoch 1, {name} differs from the uninterrupted 3-epoch run"

    # The comparison can fail: the two epochs left, trained in epoch 0 and 1's orders, give other weights.
    other, opt, sched, loader = from_checkpoint()
    train.fit(other, loader, opt, epochs=2, scheduler=sched, progress=False)
    assert not any(torch.equal(a, b) for a, b in zip(full.parameters(), other.parameters()))


def test_history_roundtrip(tmp_path):
    ds = _tiny_problem(16)
    m = _model()
    h = train.fit(m, data.make_loader(ds, 8), torch.optim.SGD(m.parameters(), 0.1), epochs=1, progress=False)
    h.save(tmp_path / "h.json")
    import json

    d = json.loads((tmp_path / "h.json").read_text())
    assert d["steps"] == 2 and len(d["step_loss"]) == 2 and d["images_per_s"] > 0
