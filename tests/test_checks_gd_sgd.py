"""Lab 1's exercises on the engine: the solution passes, every named mistake is named, the placeholder is not;
the oracles written out here agree with hand computation and with the library's own estimators."""

import exercise_harness as harness
import pytest
import torch

from utils import gradient_noise, linear_regression
from utils.checks import CheckFailed, check_noise_scale, engine, gd_sgd

LAB = "lab1_gd_sgd_batch"
EXERCISES = [
    gd_sgd.GD_STEP,
    gd_sgd.SGD,
    gd_sgd.NOISE_SCALE,
    gd_sgd.PER_EXAMPLE_GRADS_LOOP,
    gd_sgd.PER_EXAMPLE_GRADS,
    gd_sgd.NOISE_SCALE_FROM_PER_EXAMPLE,
    gd_sgd.DATASET_NOISE_SCALE,
    gd_sgd.FIT_CRITICAL_BATCH,
    gd_sgd.STEPS_TO_TARGET,
    gd_sgd.EXAMPLES_TO_TARGET,
]
test_solution, test_mistake, test_placeholder = harness.tests_for(LAB, EXERCISES)


def test_the_hand_made_cases_have_the_hand_computed_answers():
    gd, pairs, per_example = (
        ex.cases()[0] for ex in (gd_sgd.GD_STEP, gd_sgd.NOISE_SCALE, gd_sgd.NOISE_SCALE_FROM_PER_EXAMPLE)
    )
    assert gd_sgd.GD_STEP.run(gd_sgd.GD_STEP.oracle, gd) == pytest.approx((0.5 + 0.1 * 29 / 3, 0.25 + 0.1 * 25 / 6))
    assert gd_sgd.NOISE_SCALE.oracle(*pairs.args) == pytest.approx(40.0)
    assert gd_sgd._b_simple(*per_example.args) == pytest.approx(8 / 13)


def test_the_unbiased_estimates_agree_with_the_library_population_ones():
    x, y = linear_regression.LinearProblem().sample(16, seed=4)
    G2_pop, trS_pop, _ = gradient_noise.dataset_noise_scale(x, y, 1.7, -0.6)
    n = len(x)
    want = (trS_pop * n / (n - 1)) / (G2_pop - trS_pop / (n - 1))
    assert gd_sgd._b_simple(gradient_noise.per_example_grads(x, y, 1.7, -0.6)) == pytest.approx(want, rel=1e-9)


def test_the_chunked_oracle_equals_b_simple_of_every_gradient_at_once():
    for case in gd_sgd.DATASET_NOISE_SCALE.cases():
        model, loss_fn, x, y, _ = case.args
        want = gd_sgd._b_simple(gd_sgd._per_example(model, loss_fn, x, y))
        assert gd_sgd.DATASET_NOISE_SCALE.oracle(*case.args) == pytest.approx(want, rel=1e-9)


def test_many_gd_steps_reach_least_squares():
    case = gd_sgd.GD_STEP.cases()[2]
    x, y, *_ = case.args
    w, b = gd_sgd.GD_STEP.run(gd_sgd.GD_STEP.oracle, case)
    assert (w, b) == pytest.approx(linear_regression.least_squares(x, y), abs=1e-3)


def test_the_per_example_oracle_agrees_with_torch_func():
    from torch.func import functional_call, grad, vmap

    for case in gd_sgd._models_cases():
        model, loss_fn, x, y = case.args
        params = {k: v.detach() for k, v in model.named_parameters()}

        def one(p, a, b, model=model, loss_fn=loss_fn):
            return loss_fn(functional_call(model, p, (a[None],)), b[None])

        g = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
        torch.testing.assert_close(gd_sgd._per_example(*case.args), torch.cat([t.flatten(1) for t in g.values()], 1))


@pytest.mark.parametrize("ex", [gd_sgd.PER_EXAMPLE_GRADS_LOOP, gd_sgd.PER_EXAMPLE_GRADS], ids=lambda ex: ex.name)
def test_the_library_per_example_grads_is_refused_and_the_loop_refusal_names_a_loop(ex):
    def via_library(model, loss_fn, x, y):
        return gradient_noise.per_example_grads(x, y, 1.0, 0.0)

    with pytest.raises(CheckFailed, match="asks you to write yourself") as e:
        engine.check(ex, via_library)
    assert ("loop over the examples" in str(e.value)) == ex.name.endswith("_loop"), str(e.value)


def test_weights_swapped_in_g2_alone_are_named_by_the_sign():
    def b_simple(sq_small, sq_big, b_small, b_big):  # each norm weighted by the other batch's size
        g2 = (b_small * sq_big - b_big * sq_small) / (b_big - b_small)
        tr = (sq_small - sq_big) / (1 / b_small - 1 / b_big)
        return float(tr.mean() / g2.mean())

    with pytest.raises(CheckFailed, match="the noise scale is negative"):
        check_noise_scale(b_simple)
