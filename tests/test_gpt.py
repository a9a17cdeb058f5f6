"""The GPT of utils/gpt.py, its text data (utils/data.py), FLOPs (utils/flops.py) and memory
(utils/memory.py), each against an outside oracle: parameter counts by hand, PyTorch's
FlopCounterMode and its SDPA formulas, autograd's saved tensors, the real optimizer's state, the
corpus files read independently, and the size of the real Tiny Shakespeare file."""

import math
import sysconfig
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from utils import config, data, flops, gpt, memory, models

TINY = gpt.GPTConfig(context=32, width=32, layers=2, heads=2)
CONFIGS = [
    TINY,
    gpt.GPTConfig(context=16, width=40, layers=1, heads=4, bias=False),
    gpt.GPTConfig(vocab_size=100, context=24, width=48, layers=3, heads=3),
]
KERNELS = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION}  # the CPU's two


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one thread is the fastest, and leaves the other cores to other work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _batch(cfg, batch, t, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, cfg.vocab_size, (batch, t), generator=g) for _ in range(2))


# ---------------------------------------------------------------- the model


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_parameter_count_matches_the_closed_form(cfg):
    model = gpt.GPT(cfg)
    assert models.count_parameters(model) == gpt.parameter_count(cfg)
    emb = (cfg.vocab_size + cfg.context) * cfg.width
    assert gpt.parameter_count(cfg, embeddings=False) == gpt.parameter_count(cfg) - emb


def test_parameter_count_by_hand_and_the_profiles():
    # smoke: d=64, 2 layers, context 64. Tables 256*64 + 64*64 = 20,480; per block
    # 12*64^2 + 13*64 = 49,984; final LayerNorm 128: 20,480 + 2*49,984 + 128 = 120,576.
    assert gpt.parameter_count(gpt.GPTConfig(context=64, width=64, layers=2, heads=4)) == 120_576
    smoke, cpu, gpu = (gpt.parameter_count(gpt.config_for(config.profile(n))) for n in config.PROFILE_NAMES)
    assert smoke < 1_000_000 and 1_000_000 < cpu < 10_000_000 and 50_000_000 <= gpu <= 125_000_000


def test_output_projection_and_token_embedding_are_one_tensor():
    model = gpt.GPT(TINY, seed=0)
    assert model.head.weight is model.tok.weight
    assert sum(p is model.tok.weight for p in model.parameters()) == 1, "listed once, so optimised once"
    with torch.no_grad():
        model.tok.weight[7] += 1.0  # moving the embedding moves the output projection
    assert model.head.weight[7].sub(1.0).abs().max() < 0.2


def test_same_seed_same_weights_and_gpt2_init():
    a, b = gpt.GPT(TINY, seed=3), gpt.GPT(TINY, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    big = gpt.GPT(gpt.GPTConfig(context=64, width=128, layers=8, heads=4), seed=0)
    # std 0.02, residual projections 0.02 / sqrt(2 * 8) = 0.005; 16k+ draws: within 5%
    assert big.blocks[0].mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert big.blocks[0].mlp.proj.weight.std().item() == pytest.approx(0.005, rel=0.05)
    assert big.blocks[3].attn.proj.weight.std().item() == pytest.approx(0.005, rel=0.05)
    assert big.blocks[0].attn.qkv.bias.abs().max() == 0


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_a_future_token_never_changes_earlier_logits(kernel):
    model = gpt.GPT(TINY, seed=0).eval()
    idx, _ = _batch(TINY, 2, 20)
    changed = idx.clone()
    changed[:, 12] = (changed[:, 12] + 1) % TINY.vocab_size
    with torch.no_grad(), sdpa_kernel(KERNELS[kernel]):
        a, b = model(idx)[0], model(changed)[0]
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=1e-6)
    assert (a[:, 12:] - b[:, 12:]).abs().amax(-1).min() > 1e-4, "positions >= 12 do see the change"


def test_loss_at_init_is_close_to_ln_256():
    """At init every logit is w_j . u: u the final LayerNorm's output (|u|^2 = d exactly), w_j a
    row of the token table, N(0, 0.02^2) entries: z_j ~ N(0, s^2), s = 0.02 sqrt(d). For random
    targets E[loss] = E[logsumexp z] - E[z_y] ~ ln V + s^2 / 2 (the mean of e^z is e^(s^2/2)),
    plus at most (e^a - 1) / V for the input token's own row (tied: its logit is about
    a = 0.02 d / sqrt(2) higher). The mean over n tokens of z_y has standard error s / sqrt(n)."""
    cfg = gpt.GPTConfig(context=64, width=64, layers=2, heads=4)
    idx, targets = _batch(cfg, 8, 64)
    with torch.no_grad():
        loss = gpt.GPT(cfg, seed=0)(idx, targets)[1].item()
    s, a, n = 0.02 * math.sqrt(64), 0.02 * 64 / math.sqrt(2), 8 * 64
    bound = s * s / 2 + (math.exp(a) - 1) / 256 + 4 * s / math.sqrt(n)  # 0.013 + 0.006 + 0.028
    assert abs(loss - math.log(256)) < bound, f"loss {loss:.4f} vs ln 256 = {math.log(256):.4f}"


def test_a_tiny_model_overfits_a_tiny_text():
    text = "the quick brown fox jumps over the lazy dog. "
    counts = torch.bincount(data.encode(text)).float()
    p = counts[counts > 0] / len(text)
    unigram = -(p * p.log()).sum().item()  # the best loss of a model that ignores the context: 3.0
    batches = data.TokenBatches(data.encode(text * 8), 8, 16, seed=0)
    model = gpt.GPT(gpt.GPTConfig(context=16, width=32, layers=1, heads=2), seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(120):
        x, y = next(batches)
        loss = model(x, y)[1]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 5.0, "starts near ln 256"
    assert max(losses[-10:]) < unigram / 4, f"loss {losses[0]:.2f} -> {max(losses[-10:]):.2f}; unigram {unigram:.2f}"


def test_greedy_generation_follows_the_logits():
    model = gpt.GPT(TINY, seed=1).eval()
    prompt, _ = _batch(TINY, 2, 5)
    out = model.generate(prompt, 40, temperature=0)  # past the context: the window slides
    assert out.shape == (2, 45) and torch.equal(out[:, :5], prompt)
    with torch.no_grad():
        for t in (5, 20, 44):
            assert torch.equal(out[:, t], model(out[:, max(0, t - 32) : t])[0][:, -1].argmax(-1))
    g = [torch.Generator().manual_seed(7) for _ in range(2)]
    assert torch.equal(model.generate(prompt, 6, generator=g[0]), model.generate(prompt, 6, generator=g[1]))


def test_a_sequence_longer_than_the_context_is_refused():
    with pytest.raises(ValueError, match="context"):
        gpt.GPT(TINY)(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="divide"):
        gpt.GPTConfig(width=30, heads=4)
    with pytest.raises(ValueError, match="Try:"):
        gpt.GPT(TINY).generate(torch.zeros(1, 1, dtype=torch.long), 1, temperature=-1)


# ---------------------------------------------------------------- FLOPs


def _counted(model, idx, targets, train):
    with FlopCounterMode(display=False) as c:
        if train:
            model(idx, targets)[1].backward()
        else:
            with torch.no_grad():
                model(idx)
    return c.get_total_flops()


@pytest.mark.parametrize("cfg", [*CONFIGS, gpt.config_for(config.profile("smoke"))], ids=str)
def test_flops_per_token_equal_flop_counter_mode(cfg):
    model = gpt.GPT(cfg, seed=0)
    for batch, t in ((3, cfg.context), (2, cfg.context // 2 + 1)):
        idx, targets = _batch(cfg, batch, t)
        with sdpa_kernel(SDPBackend.MATH):
            for train in (False, True):
                want = flops.gpt_flops_per_token(cfg, t, train=train) * batch * t
                assert _counted(model, idx, targets, train) == want, (batch, t, train)
    grads = [p.grad.clone() for p in model.parameters()]
    with sdpa_kernel(SDPBackend.MATH):
        assert flops.counted_gpt_flops(model, 2) == flops.gpt_flops_per_token(cfg)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads)), "gradients left alone"


def test_flash_kernels_flops_by_torchs_own_formulas():
    """CUDA's flash-type kernels cannot run here; FlopCounterMode counts them with these two
    formulas of torch's (forward; backward with the recomputed Q K^T): per token they are
    gpt_flops_per_token(recompute=True) less the weights' 6N."""
    cfg, batch, t = CONFIGS[2], 2, 20
    q = (batch, cfg.heads, t, cfg.head_width)
    per_layer = flop_counter.sdpa_flop_count(q, q, q) + flop_counter.sdpa_backward_flop_count(q, q, q, q)
    attention = flops.gpt_flops_per_token(cfg, t, recompute=True) - 6 * flops.gpt_matmul_params(cfg)
    assert attention * batch * t == cfg.layers * per_layer


def test_the_cpus_fused_kernel_counts_no_attention_flops():
    cfg = CONFIGS[0]
    model = gpt.GPT(cfg, seed=0)
    idx, targets = _batch(cfg, 2, cfg.context)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        counted = _counted(model, idx, targets, train=True)
    assert counted == 6 * flops.gpt_matmul_params(cfg) * 2 * cfg.context


# ---------------------------------------------------------------- memory


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("t", [16, 32])
def test_saved_activation_bytes_equal_the_closed_form(kernel, t):
    cfg = TINY
    model = gpt.GPT(cfg, seed=0)
    x, y = next(data.TokenBatches(data.encode(data.stdlib_text(5_000)), 3, t, seed=0))
    with sdpa_kernel(KERNELS[kernel]), memory.SavedTensors(model) as saved:
        model(x, y)
    assert saved.bytes == memory.gpt_activation_bytes(cfg, 3, t, attention=kernel)


def test_the_math_kernel_saves_the_t_by_t_probabilities():
    cfg, b = TINY, 3
    gap = [
        memory.gpt_activation_bytes(cfg, b, t, attention="math")
        - memory.gpt_activation_bytes(cfg, b, t, attention="flash")
        for t in (8, 32)
    ]
    # fp32 bytes per block: batch x heads x (T^2 - T)
    assert gap == [4 * cfg.layers * b * cfg.heads * (t * t - t) for t in (8, 32)]


def test_gpt_memory_parts_equal_the_real_step():
    cfg = TINY
    model = gpt.GPT(cfg, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    idx, targets = _batch(cfg, 2, 16)
    model(idx, targets)[1].backward()
    opt.step()
    pred = memory.gpt_memory(cfg, 2, 16, optimizer="adam")
    assert pred["params"] == memory.parameter_bytes(model)
    assert pred["grads"] == sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    assert pred["optimizer"] == memory.counted_state_bytes(opt)
    assert pred["peak"] == pred["params"] + pred["grads"] + pred["optimizer"] + pred["activations"]
    assert memory.gpt_memory(cfg, 2, 16, optimizer="sgd")["optimizer"] == 0


# ---------------------------------------------------------------- text data


def test_stdlib_corpus_is_deterministic_and_of_the_asked_size():
    a = data.stdlib_text(30_000)
    assert len(a) == 30_000 and a == data.stdlib_text(30_000)
    assert data.stdlib_text(1_000) == a[:1_000]
    folder = Path(sysconfig.get_paths()["stdlib"])
    first = sorted(p.name for p in folder.iterdir() if p.suffix == ".py" and p.is_file())[0]
    head = (folder / first).read_bytes()
    assert a.startswith(head[:30_000]), f"starts with {first}, the first source by name"
    with pytest.raises(ValueError, match="Try:"):
        data.stdlib_text(10**12)
    splits = data.load_tokens("stdlib", 30_000)
    assert (len(splits.train), len(splits.val)) == (27_000, 3_000) and splits.train.dtype == torch.uint8
    assert data.decode(torch.cat([splits.train, splits.val])) == a.decode("utf-8", errors="replace")


def test_standin_shakespeare_has_the_real_size_and_layout(tmp_path, monkeypatch, capsys):
    (path,) = data.write_standins(tmp_path, which=("shakespeare",))
    raw = path.read_bytes()
    assert len(raw) == 1_115_394, "the size of the real input.txt"
    assert raw.isascii() and raw.endswith(b"\n") and path.name == "input.txt"
    speeches = raw.decode().split("\n\n")
    assert len(speeches) > 1000
    for s in speeches[:-1]:
        speaker, *lines = s.split("\n")
        assert speaker.endswith(":") and speaker[:-1].replace(" ", "").isupper() and lines, s[:80]
    assert data.standin_text() == raw, "the same bytes every time"
    monkeypatch.setenv("LAB_DATA", "standin")
    splits = data.load_tokens("shakespeare", root=tmp_path)
    assert data.standin_notice("shakespeare") in capsys.readouterr().out
    assert len(splits.train) + len(splits.val) == 1_115_394
    assert data.load_text("shakespeare", 1_000, root=tmp_path) == raw[:1_000]
    with pytest.raises(ValueError, match="Try:"):
        data.load_text("shakespeare", 2_000_000, root=tmp_path)  # refused, never capped


def test_without_the_switch_shakespeare_is_the_verified_download(tmp_path, monkeypatch):
    monkeypatch.delenv("LAB_DATA", raising=False)
    with pytest.raises(data.DatasetUnavailable, match="6fb458f1232090904fb40fe944165e91"):
        data.load_tokens("shakespeare", root=tmp_path, download=False)
    bad = tmp_path / "shakespeare" / "input.txt"
    bad.parent.mkdir()
    bad.write_bytes(data.standin_text(2_000))
    with pytest.raises(data.DatasetUnavailable, match="MD5"):
        data.shakespeare_text(root=tmp_path, download=False)


def test_batches_are_windows_shifted_by_one():
    tokens = torch.arange(500)
    batches = data.TokenBatches(tokens, 6, 16, seed=0)
    x, y = next(batches)
    assert x.shape == y.shape == (6, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1), "y is x shifted by one token"
    assert torch.equal(x, x[:, :1] + torch.arange(16)), "each row is a contiguous window"
    assert x.min() >= 0 and y.max() <= 499
    again = data.TokenBatches(tokens, 6, 16, seed=0)
    assert torch.equal(next(again)[0], x) and not torch.equal(next(batches)[0], x)
    assert not torch.equal(next(data.TokenBatches(tokens, 6, 16, seed=1))[0], x)
    edge = next(data.TokenBatches(torch.arange(17), 4, 16))  # one window only: the whole tensor
    assert torch.equal(edge[0][0], torch.arange(16)) and torch.equal(edge[1][0], torch.arange(1, 17))
    with pytest.raises(ValueError, match="Try:"):
        data.TokenBatches(torch.arange(16), 1, 16)
