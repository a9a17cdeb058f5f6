"""Lab 5's exercises on the engine: each solution in solutions/lab5_memory_and_model_parallel.ipynb passes,
every named mistake's variant is named, the placeholder is not implemented. ZeRO-2 runs on 3 processes
(slow: one launch on the solution names the replayed mistakes; the others, one launch each, extended); a few refusals and what check_zero2 measures are
tested on their own."""

import textwrap

import exercise_harness as harness
import pytest
import torch

from utils import checks
from utils.checks import CheckFailed, engine
from utils.checks import model_parallel as mp

LAB = "lab5_memory_and_model_parallel"
test_solution, test_mistake, test_placeholder = harness.tests_for(LAB, [mp.TENSOR_PARALLEL, mp.ZERO_MEMORY, mp.GPIPE])
_zero2 = harness.tests_for(LAB, [mp.ZERO2])
test_zero2_placeholder = pytest.mark.slow(_zero2[2])
# One launch on the solution: it passes, and the replayed mistakes are named from that launch's outputs.
test_zero2_solution, test_zero2_replayed_mistake = map(pytest.mark.slow, harness.replayed_tests_for(LAB, [mp.ZERO2]))


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize(
    "mistake", [m for m in mp.ZERO2.mistakes if m not in engine._replayed(mp.ZERO2)], ids=lambda m: m.problem[:40]
)
def test_zero2_mistake(mistake):  # the mistakes a predicate sees: each needs a launch of its variant
    with pytest.raises(CheckFailed) as e:
        engine.check(mp.ZERO2, *harness._as_answer(mp.ZERO2, mistake.variant))
    assert mistake.problem.rstrip(".") in str(e.value), str(e.value)


@pytest.mark.slow
def test_zero2_measures_the_zero2_formulas():
    """The 57-parameter MLP with Adam on 2 ranks (the check's last run, after 3), hand-counted: 57 padded to 58,
    29 per rank, 2 fp32 moments."""
    from utils.parallel import ring_bytes

    got = checks.check_zero2(*harness.answer(LAB, mp.ZERO2))
    assert (got["numel"], got["padded"], got["world_size"]) == (5 * 6 + 6 + 6 * 3 + 3, 58, 2)
    assert got["state_bytes"] == [2 * 4 * 29] * 2 and got["full_state_bytes"] == 2 * 4 * 57
    assert got["sent_bytes"] == 4 * 58 == ring_bytes("all_reduce", 4 * 58, 2)  # a ring: 2(N-1)/N x M
    assert got["ddp_sent_bytes"] == 4 * 57


@pytest.mark.slow
def test_zero2_reference_equals_one_process_torch_optim():
    """The oracle the answers are compared with: 2 ranks of the reference ZeRO-2 step equal one process
    running torch.optim over the whole model on the whole batch."""
    from utils import parallel

    outs = parallel.launch(_reference_on_ranks, 2, timeout=120, stream=False)
    for i, ((d_in, width, d_out), kind) in enumerate([(s, k) for s in ((4, 6, 2), (5, 6, 3)) for k in ("SGD", "Adam")]):
        model = mp.mlp(width, 2, in_features=d_in, out_features=d_out, activation="tanh", seed=d_in + width)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if kind == "SGD" else None
        opt = opt or torch.optim.Adam(model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(d_in)
        for step in range(3):
            x, y = torch.randn(8, d_in, generator=g), torch.randn(8, d_out, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            want = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            for rank in outs:
                torch.testing.assert_close(rank[i]["params"][step], want, rtol=1e-5, atol=1e-6)


def _reference_on_ranks():
    from utils import parallel

    ctx = parallel.setup()
    try:
        return [mp._zero2_run(mp.ZERO2.oracle, case) for case in mp._zero2_cases(ctx)]
    finally:
        parallel.teardown()


REFUSED = {
    "all_reduce in a helper": """
        def average(grads):
            '''a docstring that says all_reduce is no call'''
            dist.all_reduce(grads)
            return grads / dist.get_world_size()

        def zero2_optimizer(model, optimizer_class, **kwargs):
            return optimizer_class(model.parameters(), **kwargs)

        def zero2_step(model, optimizer):
            for p in model.parameters():
                p.grad = average(p.grad)
            optimizer.step()
        """,
    "ZeroRedundancyOptimizer": """
        def zero2_optimizer(model, optimizer_class, **kwargs):
            from torch.distributed.optim import ZeroRedundancyOptimizer
            return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class, **kwargs)

        def zero2_step(model, optimizer):
            optimizer.step()
        """,
    "the course's sharding": """
        from utils.parallel.shard import shard_model

        def zero2_optimizer(model, optimizer_class, **kwargs):
            return shard_model(model, "zero1", None, 0.1)[1]

        def zero2_step(model, optimizer):
            optimizer.step()
        """,
}


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_zero2_refuses_the_library_and_all_reduce(name, tmp_path):
    path = tmp_path / "cell.py"
    path.write_text("import torch\nimport torch.distributed as dist\n" + textwrap.dedent(REFUSED[name]))
    ns = {"__name__": "__main__"}
    exec(compile(path.read_text(), str(path), "exec"), ns)
    with pytest.raises(CheckFailed, match="which this exercise asks you to write yourself"):
        checks.check_zero2(ns["zero2_optimizer"], ns["zero2_step"])
