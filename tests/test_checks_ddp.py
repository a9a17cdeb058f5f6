"""Lab 3's exercises on the engine: each solution passes, each named mistake is named, each placeholder
is not implemented. The rank-run exercises spawn processes (slow): one launch per exercise on its solution
also names its replayed mistakes; the mistakes a predicate sees (hangs, deadlocks, syncs) need a launch of
their own each (extended)."""

import json
import re

import exercise_harness as harness
import pytest
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from utils import checks
from utils.checks import CheckFailed, ddp, engine

LAB = "lab3_ddp"
IN_NOTEBOOK = [ddp.SHARD_BATCHES, ddp.SAVE_ON_RANK0]
ON_RANKS = [ddp.RING_ALL_REDUCE, ddp.AVERAGE_GRADIENTS, ddp.OVERLAP_DDP, ddp.OVERLAP_TRACE]
test_solution, test_mistake, test_placeholder = harness.tests_for(LAB, IN_NOTEBOOK)
# On ranks every check spawns processes: the solutions run in make test, the placeholders and the
# mistakes (each a launch of 2 or 3 ranks) in make test-extended.
_ranked = harness.tests_for(LAB, ON_RANKS)
test_ranked_placeholder = pytest.mark.extended(pytest.mark.slow(_ranked[2]))
# One launch per exercise on its solution: the solution passes, the replayed mistakes are named.
test_ranked_solution, test_replayed_mistake = map(pytest.mark.slow, harness.replayed_tests_for(LAB, ON_RANKS))


def _ranked_mistakes():  # the mistakes a predicate sees: each needs a launch of its variant
    for ex in ON_RANKS:
        for i, m in enumerate(ex.mistakes):
            if m not in engine._replayed(ex):
                yield pytest.param(ex, m, marks=[pytest.mark.extended], id=f"{ex.name}-{i}")


@pytest.mark.slow
@pytest.mark.parametrize("ex,mistake", list(_ranked_mistakes()))
def test_ranked_mistake_is_named(ex, mistake):
    with pytest.raises(CheckFailed) as e:
        engine.check(ex, mistake.variant)
    assert mistake.problem.rstrip(".") in str(e.value), str(e.value)


def average_by_two(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= 2


def overlap_blocking(model, bucket_numel=0):
    def hook(p):
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    return lambda: None


def shard_everything(n, batch_size, rank, world_size, epoch, seed):
    sampler = DistributedSampler(range(n), num_replicas=1, rank=0, seed=seed)
    sampler.set_epoch(epoch)
    idx = list(sampler)
    return [idx[i : i + batch_size] for i in range(0, len(idx), batch_size)]


def test_every_rank_on_the_whole_dataset_is_named_as_not_dealt_out_by_rank():
    with pytest.raises(CheckFailed, match="every rank got the same batches: the data is not dealt out by rank"):
        checks.check_shard_batches(shard_everything)


@pytest.mark.slow
def test_a_fixed_divisor_passes_on_2_processes_and_is_named_on_3():
    with pytest.raises(CheckFailed, match="divided by 2, not by the number of processes"):
        checks.check_average_gradients(average_by_two)


@pytest.mark.slow
@pytest.mark.extended
def test_a_blocking_all_reduce_in_the_hook_is_named_as_no_overlap():
    """Right gradients, but each hook's all-reduce is blocking (no async_op): nothing overlaps."""
    with pytest.raises(CheckFailed, match="finished inside its hook .blocking, or waited for there."):
        engine.check(ddp.OVERLAP_DDP, overlap_blocking)


@pytest.mark.slow
def test_the_trace_returns_the_lab_answer_keys_count_of_all_reduces(capsys):
    (overlap_ddp,) = harness.answer(LAB, ddp.OVERLAP_TRACE)
    events = checks.check_overlap_trace(overlap_ddp, bucket_numel=70_000)
    assert sum(e[0] == "c10d::allreduce_" for e in events) == 4  # buckets by hand: see the lab's answer key
    assert "backward" in capsys.readouterr().out


def test_no_hint_of_lab3_contains_a_line_of_its_answer():
    from utils import authoring

    cells = json.loads((harness.ROOT / "solutions" / f"{LAB}.ipynb").read_text())["cells"]
    for cell in ("".join(c["source"]) for c in cells if c["cell_type"] == "code"):
        blocks = re.findall(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", cell, re.S)
        for block in blocks:
            lines = [ln.strip() for ln in block.splitlines() if ln.strip()]
            hints = [ln for ln in lines if authoring.hint_tier(ln) is not None]
            answer = [ln for ln in lines if not ln.startswith("#")]
            for a in answer:
                for h in hints:
                    assert a not in h, f"a hint gives away the answer line {a!r}"
            assert {authoring.hint_tier(h) for h in hints} == {1, 2, 3}, f"hints not in three tiers: {hints}"
