"""Tensor, sequence and pipeline parallelism of the course's GPT (notebook 07): the split attention
against ``utils.gpt``'s fused one, its heads split by hand against the whole layer, and the
``parallelize_module`` plans on 2 ranks against one process on the whole model, with the collectives
``CommDebugMode`` counts against the hand-derived formula and against ``diagrams.block_layouts``;
the GPT cut into pipeline stages, chained in one process and scheduled on 2 ranks, against the
whole model."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from utils import config, diagrams, gpt, parallel  # noqa: E402
from utils.demos import gpt_pp_demo, gpt_tp_demo  # noqa: E402
from utils.parallel import pipeline, shard  # noqa: E402
from utils.parallel.tensor_parallel import SplitQKVAttention, split_qkv  # noqa: E402

ARCH = gpt.GPTConfig(context=16, width=32, layers=2, heads=4)


def _tokens(arch, batch, seed=1):
    idx = torch.randint(0, arch.vocab_size, (batch, arch.context + 1), generator=torch.Generator().manual_seed(seed))
    return idx[:, :-1], idx[:, 1:]


def test_split_attention_is_the_fused_attention():
    ref = gpt.GPT(ARCH, seed=0)
    split = split_qkv(gpt.GPT(ARCH, seed=0))
    x, y = _tokens(ARCH, 3)
    (l1, loss1), (l2, loss2) = ref(x, y), split(x, y)
    torch.testing.assert_close(l2, l1)
    loss1.backward()
    loss2.backward()
    for i, (a, b) in enumerate(zip(ref.blocks, split.blocks)):
        for kind in ("weight", "bias"):
            fused = getattr(a.attn.qkv, kind).grad
            torch.testing.assert_close(
                torch.cat([getattr(lin, kind).grad for lin in (b.attn.q, b.attn.k, b.attn.v)]), fused, msg=f"block {i}"
            )


@pytest.mark.parametrize("n", [2, 4])
def test_heads_split_by_hand_sum_to_the_whole_attention(n):
    """Each rank's q, k, v rows and the proj columns of its heads: the partial outputs, summed,
    plus the bias once, are the whole layer's output (the forward that ColwiseParallel and
    RowwiseParallel run)."""
    attn = SplitQKVAttention(gpt.GPT(ARCH, seed=0).blocks[0].attn)
    x = torch.randn(2, ARCH.context, ARCH.width, generator=torch.Generator().manual_seed(2))
    total = 0
    with torch.no_grad():
        for r in range(n):
            rows = slice(r * ARCH.width // n, (r + 1) * ARCH.width // n)
            q, k, v = (
                F.linear(x, lin.weight[rows], lin.bias[rows]).unflatten(-1, (-1, ARCH.head_width)).transpose(1, 2)
                for lin in (attn.q, attn.k, attn.v)
            )
            assert q.shape[1] == ARCH.heads // n  # this rank's heads, read from the input
            h = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
            total = total + F.linear(h, attn.proj.weight[:, rows])
        torch.testing.assert_close(total + attn.proj.bias, attn(x))


def _sum(counts, phase, kind):
    return counts.get(phase, {}).get(kind, 0)


@pytest.mark.slow
def test_tensor_and_sequence_parallel_gpt_on_2_ranks_equal_one_process():
    arch = gpt.config_for(config.profile("smoke"))
    batch, L = config.profile("smoke").gpt_batch, arch.layers
    r = parallel.launch(gpt_tp_demo.worker, 2, arch, batch, stream=False)[0]
    ref = r["ref"]
    for name in gpt_tp_demo.PLANS:
        torch.testing.assert_close(r[name]["logits"], ref["logits"], msg=name)
        torch.testing.assert_close(r[name]["loss"], ref["loss"], msg=name)
        assert r[name]["grads"].keys() == ref["grads"].keys()
        for k, g in ref["grads"].items():
            torch.testing.assert_close(r[name]["grads"][k], g, msg=f"{name}: {k}")
        assert r[name]["local_shapes"] == {
            "attn.q": (arch.width // 2, arch.width),
            "attn.proj": (arch.width, arch.width // 2),
            "mlp.fc": (2 * arch.width, arch.width),
        }

    # per attention and per MLP: TP one all-reduce each way; SP an all-gather in and a reduce-scatter out
    per_branch = {
        "tp": ({"all_reduce": 1}, {"all_reduce": 1}),
        "tp_unshared": ({"all_reduce": 1}, None),  # backward: q, k, v each all-reduce (attention 3, MLP 1)
        "sp": ({"all_gather": 1, "reduce_scatter": 1}, {"all_gather": 1, "reduce_scatter": 1}),
    }
    for name, (fwd, bwd) in per_branch.items():
        c = r[name]["counts"]
        for i in range(L):
            for branch in ("attn", "mlp"):
                assert c[f"blocks.{i}.{branch}"]["forward"] == fwd, (name, i, branch)
                if bwd is not None:
                    assert c[f"blocks.{i}.{branch}"]["backward"] == bwd, (name, i, branch)
    assert [r["tp_unshared"]["counts"][f"blocks.0.{b}"]["backward"] for b in ("attn", "mlp")] == [
        {"all_reduce": 3},
        {"all_reduce": 1},
    ]
    # whole model: TP adds nothing outside the blocks; SP gathers the head's input in forward and the
    # gradient of the first block's input in backward
    total = {name: r[name]["counts"]["total"] for name in gpt_tp_demo.PLANS}
    assert total["tp"] == {"forward": {"all_reduce": 2 * L}, "backward": {"all_reduce": 2 * L}}
    assert total["tp_unshared"] == {"forward": {"all_reduce": 2 * L}, "backward": {"all_reduce": 4 * L}}
    assert total["sp"] == {
        "forward": {"all_gather": 2 * L + 1, "reduce_scatter": 2 * L},
        "backward": {"all_gather": 2 * L + 1, "reduce_scatter": 2 * L},
    }
    assert r["sp"]["counts"]["head"]["forward"] == {"all_gather": 1}
    # every collective moves one activation, batch x T x d floats: TP's 4L all-reduces; SP's
    # 4L + 2 all-gathers and 4L reduce-scatters, half an all-reduce's bytes each on a ring
    buf = batch * arch.context * arch.width * 4
    assert r["tp"]["nbytes"] == {"all_reduce": 4 * L * buf}
    assert r["sp"]["nbytes"] == {"all_gather": (4 * L + 2) * buf, "reduce_scatter": 4 * L * buf}
    assert r["tp"]["sent"] == 4 * L * shard.ring_bytes("all_reduce", buf, 2)
    assert r["sp"]["sent"] == r["tp"]["sent"] + 2 * shard.ring_bytes("all_gather", buf, 2)
    assert r["sp"]["norm_grad_placements"] == ["P(sum)"] and r["tp"]["norm_grad_placements"] == []

    # the figure's collectives are the ones counted in a block (the last: the first one also gathers
    # the gradient of the model's input in backward)
    for name, sp in (("tp", False), ("sp", True)):
        drawn = diagrams.block_layouts(sp)["collectives"]
        block = r[name]["counts"][f"blocks.{L - 1}"]
        for phase in ("forward", "backward"):
            kinds = [c[phase].replace("-", "_") for c in drawn if c[phase]]
            assert {k: kinds.count(k) for k in set(kinds)} == block[phase], (name, phase)


@pytest.mark.parametrize("p", [1, 2])
def test_gpt_stages_chained_are_the_whole_model(p):
    arch = gpt.GPTConfig(context=16, width=32, layers=2, heads=4)
    whole = gpt.GPT(arch, seed=0)
    stages = pipeline.gpt_stages(gpt.GPT(arch, seed=0), p)
    x, y = _tokens(arch, 3)
    logits, loss = whole(x, y)
    h = x
    for stage in stages:
        h = stage(h)
    torch.testing.assert_close(h, logits)
    loss.backward()
    pipeline.gpt_loss(h, y).backward()
    ref = dict(whole.named_parameters())
    names = [n for stage in stages for n, _ in stage.named_parameters()]
    extra = 1 if p > 1 else 0  # the head's own copy of the token table
    assert len(names) == len(set(names)) == len(ref) + extra
    grads = {n: q.grad for stage in stages for n, q in stage.named_parameters()}
    for n, q in ref.items():
        if n != "tok.weight":
            torch.testing.assert_close(grads[n], q.grad, msg=n)
    tied = grads["tok.weight"] + (grads["head.weight"] if p > 1 else 0)  # the two copies' parts, summed
    torch.testing.assert_close(tied, ref["tok.weight"].grad)
    with pytest.raises(ValueError, match="do not split evenly"):
        pipeline.gpt_stages(whole, 3)


@pytest.mark.slow
def test_gpt_pipeline_on_2_ranks_equals_one_process():
    arch = gpt.config_for(config.profile("smoke"))
    ranks = parallel.launch(gpt_pp_demo.worker, 2, arch, 8, 4, stream=False)
    for r in ranks:
        for kind, s in r["schedules"].items():
            assert s["grads"].keys() == r["ref"]["grads"].keys()
            for n, g in r["ref"]["grads"].items():
                torch.testing.assert_close(s["grads"][n], g, msg=f"rank {r['rank']} {kind}: {n}")
            # before the all-reduce, each copy of the tied table held only its own stage's part
            assert not torch.allclose(s["tied_alone"], r["ref"]["grads"]["head.weight" if r["rank"] else "tok.weight"])
    last = ranks[-1]
    for s in last["schedules"].values():
        assert s["loss"] == pytest.approx(last["ref"]["loss"], rel=1e-6)
    assert {n.split(".")[0] for n in ranks[0]["schedules"]["gpipe"]["grads"]} == {"tok", "pos", "blocks"}
    assert {n.split(".")[0] for n in last["schedules"]["gpipe"]["grads"]} == {"blocks", "norm", "head"}
