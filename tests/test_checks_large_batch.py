"""Lab 4's exercises on the engine: the solution passes, every named mistake is named, the placeholder is not
implemented; and what the harness cannot say: the library's LARS and batch norm are refused however they are
reached, an independent right answer passes, and the ghost oracle is nn.BatchNorm2d for one virtual batch."""

import math

import exercise_harness as harness
import pytest
import torch
from torch import nn

from utils.checks import CheckFailed, check_lr_for_batch, check_trust_ratio, engine, large_batch
from utils.models import GhostBatchNorm2d
from utils.optim import LARS

LAB = "lab4_large_batch"
EXERCISES = [ex for ex in engine.REGISTRY.values() if ex.module == large_batch.__name__]
test_solution, test_mistake, test_placeholder = harness.tests_for(LAB, EXERCISES)


class LarsSubclass(LARS):
    pass


class LarsWrapper(torch.optim.Optimizer):
    def __init__(self, params, lr, **kw):
        self.inner = LARS([{**g, "adapt": not g.pop("exclude", False)} for g in params], lr, **kw)
        super().__init__(self.inner.param_groups, {})

    def step(self, closure=None):
        return self.inner.step(closure)


class GhostSubclass(GhostBatchNorm2d):
    pass


class BatchNormSubclass(nn.BatchNorm2d):
    def __init__(self, c, virtual_batch_size=32, **kw):
        super().__init__(c, **kw)


class GhostCallsBatchNorm(nn.Module):
    def __init__(self, c, virtual_batch_size=32, momentum=0.1, eps=1e-5):
        super().__init__()
        self.vb, self.weight, self.bias = virtual_batch_size, nn.Parameter(torch.ones(c)), nn.Parameter(torch.zeros(c))
        self.register_buffer("running_mean", torch.zeros(c))
        self.register_buffer("running_var", torch.ones(c))

    def forward(self, x):
        parts = x.split(self.vb)
        return torch.cat([nn.functional.batch_norm(v, None, None, self.weight, self.bias, True) for v in parts])


class SpecSubclass(large_batch._GhostVariant):  # the check's own hand-written class
    pass


@pytest.mark.parametrize(
    "ex,cls,used",
    [
        (large_batch.LARS_OPTIMIZER, LarsSubclass, "LARS.step"),
        (large_batch.LARS_OPTIMIZER, LarsWrapper, "LARS.step"),
        (large_batch.GHOST_BATCH_NORM, GhostSubclass, "GhostBatchNorm2d.forward"),
        (large_batch.GHOST_BATCH_NORM, BatchNormSubclass, "batch_norm"),
        (large_batch.GHOST_BATCH_NORM, GhostCallsBatchNorm, "batch_norm"),
        (large_batch.GHOST_BATCH_NORM, SpecSubclass, "_GhostVariant"),
    ],
    ids=["lars-subclass", "lars-wrapper", "ghost-subclass", "batchnorm-subclass", "calls-batch-norm", "spec-subclass"],
)
def test_the_library_is_refused_however_it_is_reached(ex, cls, used):
    with pytest.raises(CheckFailed, match=f"your code uses .*{used}, which this exercise asks you to write yourself"):
        engine.check(ex, cls)


@pytest.mark.parametrize("ex,cls", [(large_batch.LARS_OPTIMIZER, LARS), (large_batch.GHOST_BATCH_NORM, nn.BatchNorm2d)])
def test_passing_the_library_class_itself_is_refused(ex, cls):
    with pytest.raises(CheckFailed, match="the library's own code"):
        engine.check(ex, cls)


def test_independent_hand_written_classes_pass(capsys):
    engine.check(large_batch.LARS_OPTIMIZER, large_batch._LarsVariant)
    engine.check(large_batch.GHOST_BATCH_NORM, large_batch._GhostVariant)
    assert capsys.readouterr().out.count("correct") == 2


def test_a_placeholder_in_step_alone_says_not_implemented():
    class OnlyInit(harness.answer(LAB, large_batch.LARS_OPTIMIZER)[0]):
        def step(self, closure=None):
            raise NotImplementedError("Exercise: write this part (see the hint above)")

    with pytest.raises(CheckFailed, match="not implemented yet"):
        engine.check(large_batch.LARS_OPTIMIZER, OnlyInit)


def test_the_ghost_oracle_is_batch_norm_for_one_virtual_batch():
    case = large_batch.GHOST_BATCH_NORM.cases()[2]
    assert case.args[1] >= case.args[0]  # one virtual batch holds the whole batch
    ghost, bn = (large_batch._run_ghost(cls, case) for cls in (GhostBatchNorm2d, BatchNormSubclass))
    assert engine.difference(ghost, bn, rtol=1e-12, atol=1e-12) is None


def _ratio_if(w, g, weight_decay, trust_coefficient, eps):  # an `if` on a tensor: a host read, like .item()
    if torch.linalg.vector_norm(w) > 0 and torch.linalg.vector_norm(g) > 0:
        return large_batch._ratio(w, g, weight_decay, trust_coefficient, eps)
    return torch.ones(())


def _lr_key_error(base_lr, base_batch, batch, rule):  # an unknown rule raises KeyError, not ValueError
    return base_lr * {"linear": batch / base_batch, "sqrt": math.sqrt(batch / base_batch)}[rule]


@pytest.mark.parametrize(
    "check,answer,problem",
    [
        (check_trust_ratio, _ratio_if, "reads a tensor back to Python"),
        (check_lr_for_batch, _lr_key_error, "does not raise ValueError"),
    ],
    ids=["trust-ratio-if", "lr-key-error"],
)
def test_the_second_form_of_a_merged_mistake_is_named_too(check, answer, problem):
    with pytest.raises(CheckFailed, match=problem):
        check(answer)
