"""Lab 7's exercises on the engine: each solution in solutions/lab7_tensor_parallel_transformer.ipynb passes, every
named mistake is named, each placeholder is not implemented. The shards are checked in this process; f and g and
the two blocks on 2 processes (slow: one launch per exercise on its solution also names the replayed mistakes; the
placeholders and the mistakes a predicate sees need a launch each, extended). The oracle blocks are held to one
process's Block."""

import linecache
import pickle

import exercise_harness as harness
import pytest
import torch

from utils import parallel
from utils.checks import CheckFailed, engine
from utils.checks import transformer as tr

LAB = "lab7_tensor_parallel_transformer"
ON_RANKS = [tr.TP_OPERATORS, tr.TP_BLOCK, tr.SP_BLOCK]
test_solution, test_mistake, test_placeholder = harness.tests_for(LAB, [tr.SHARD_BLOCK])
_ranked = harness.tests_for(LAB, ON_RANKS)
test_ranked_placeholder = pytest.mark.extended(pytest.mark.slow(_ranked[2]))
# One launch per exercise on its solution: the solution passes, the replayed mistakes are named.
test_ranked_solution, test_replayed_mistake = map(pytest.mark.slow, harness.replayed_tests_for(LAB, ON_RANKS))


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("mistake", [m for m in tr.SP_BLOCK.mistakes if m.when], ids=lambda m: m.problem[:40])
def test_sp_mechanism_mistake(mistake):  # right numbers for the wrong reason: each needs a launch of its variant
    with pytest.raises(CheckFailed) as e:
        engine.check(tr.SP_BLOCK, mistake.variant)
    assert mistake.problem.rstrip(".") in str(e.value) and mistake.hint.rstrip(".") in str(e.value), str(e.value)


def test_a_class_defined_in_a_cell_is_found_from_its_methods():
    cell = "x = 1\n\n\nclass Twice(torch.autograd.Function):\n    @staticmethod\n    def forward(ctx, t):\n        return 2 * t\n"
    name = "<ipython-input-7-twice>"
    linecache.cache[name] = (len(cell), None, cell.splitlines(keepends=True), name)
    ns = {"__name__": "__main__", "torch": torch}
    exec(compile(cell, name, "exec"), ns)
    assert engine.getsource(ns["Twice"]) == cell[cell.index("class") :]
    shipped = engine.ship("twice", (ns["Twice"],))  # what a rank defines again: the class and the names it reads
    assert shipped.sources == [("Twice", cell[cell.index("class") :])] and shipped.answer == ("Twice",)


def test_a_shipment_carries_an_operators_alias_a_notebooks_dict_and_a_private_constant_to_a_rank():
    cell = ("class Twice(torch.autograd.Function):\n    @staticmethod\n    def forward(ctx, t):\n        return 2 * t\n\n\n"
            "twice = Twice.apply\nseen = {'calls': 0}\n_ONE = 1\n\n\ndef double(t):\n    seen['calls'] += _ONE\n    return twice(t)\n")  # fmt: skip
    name = "<ipython-input-8-double>"
    linecache.cache[name] = (len(cell), None, cell.splitlines(keepends=True), name)
    ns = {"__name__": "__main__", "torch": torch}
    exec(compile(cell, name, "exec"), ns)
    (double,), scope = pickle.loads(pickle.dumps(engine.ship("double", (ns["double"],)))).define()  # as a rank does
    assert double(torch.ones(2)).tolist() == [2.0, 2.0] and scope["seen"] == {"calls": 1} and ns["seen"] == {"calls": 0}


NAMES = {"shards.qkv_weight": "attn.qkv.weight", "shards.qkv_bias": "attn.qkv.bias", "shards.fc_weight": "mlp.fc.weight",
         "shards.fc_bias": "mlp.fc.bias", "shards.attn_proj_weight": "attn.proj.weight", "attn_proj_bias": "attn.proj.bias",
         "shards.mlp_proj_weight": "mlp.proj.weight", "mlp_proj_bias": "mlp.proj.bias"}  # fmt: skip


@pytest.mark.slow
def test_the_oracle_blocks_on_2_ranks_equal_one_process_block():
    """The references the answers are compared with (TP and SP on 2 gloo ranks, their gradients gathered whole)
    equal one process's utils.gpt.Block: output, input gradient, every parameter's gradient."""
    outs = parallel.launch(_oracles_on_ranks, 2, timeout=300, stream=False)
    ctx = type("Ctx", (), {"rank": 0, "world_size": 2, "device": torch.device("cpu")})
    for i, case in enumerate(tr._block_cases(ctx)):
        d, heads, t, seed, _ = case.args
        block, g = tr._block(d, heads, seed), torch.Generator().manual_seed(seed)
        x, probe = (torch.randn(2, t, d, generator=g) for _ in range(2))
        x.requires_grad_()
        y = block(x)
        (y * probe).sum().backward()
        params = dict(block.named_parameters())
        for rank in outs:
            for name in ("tp_block", "sp_block"):
                got = rank[name][i]
                torch.testing.assert_close(got["output"], y.detach(), rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(got["input grad"], x.grad, rtol=1e-4, atol=1e-5)
                assert len(got["param grads"]) == len(params)
                for k, grad in got["param grads"].items():
                    torch.testing.assert_close(grad, params[NAMES.get(k, k)].grad, rtol=1e-4, atol=1e-5, msg=k)
            # each LayerNorm normalised the rank's t / 2 tokens of each of the 2 sequences, and nothing all-reduced
            assert rank["sp_block"][i]["norm_rows"] == [2 * t // 2] * 2 and not rank["sp_block"][i]["all_reduce"]


def _oracles_on_ranks():
    ctx = parallel.setup()
    try:
        return {ex.name: [ex.run(ex.oracle, c) for c in ex.cases(ctx)] for ex in (tr.TP_BLOCK, tr.SP_BLOCK)}
    finally:
        parallel.teardown()


def test_shard_oracle_equals_the_block_in_one_process():
    """What the shard check compares with: every rank's partial outputs summed are the block's branches."""
    for case in tr.SHARD_BLOCK.cases():
        d, heads, n, seed = case.args
        block = tr._block(d, heads, seed)
        h = torch.randn(2, 5, d, generator=torch.Generator().manual_seed(seed))
        out = tr._shard_run(tr._shard, case)
        torch.testing.assert_close(out["attn"], block.attn(h).detach(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(out["mlp"], block.mlp(h).detach(), rtol=1e-4, atol=1e-5)
