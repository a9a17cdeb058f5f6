"""Oracle from outside the project: PyTorch DDP across 2 and 4 gloo ranks against one process.

One launch per world size (utils.parallel.launch, workers in tests/_ddp_workers.py) covers three
cases; the oracle for each is a plain single-process computation on the union of the ranks'
data, written out below from DDP's averaging rule: every rank's gradient is the all-reduced
SUM divided by the world size W.

* one step: rank r's loss is the mean over its B examples, so the averaged gradient is the
  gradient of the mean over all W * B examples: one process on the concatenated batch.
* no_sync accumulation: each of the MICRO micro-batch losses is divided by MICRO and only the
  last backward all-reduces, so the result is again the gradient of the mean over all
  W * MICRO * B examples; before the last micro-batch a rank holds only its own gradient.
* uneven inputs under Join: at step s only the ranks that still have a batch compute a
  gradient; the ranks that ran out take part in the all-reduce with ZEROS ("shadow"
  all-reduces), and the divisor stays W (DDP's default, divide_by_initial_world_size=True).
  So step s applies  (1 / W) * sum over active ranks of grad(mean over that rank's B examples)
  = grad( sum of the losses of the active examples / (W * B) ),  NOT the mean over the active
  examples. Only the ranks still active step their optimizer; when the last one finishes,
  DDP broadcasts its weights to all (``_sync_final_model``), so every rank ends with them.
"""

from __future__ import annotations

import _ddp_workers as wk
import pytest
import torch
from torch import nn

from utils import parallel


def _sgd_steps(losses_per_step):
    """Single process: SGD with the workers' settings, one step per loss function."""
    model = wk.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=wk.LR, momentum=wk.MOMENTUM)
    for loss_of in losses_per_step:
        opt.zero_grad(set_to_none=True)
        loss_of(model).backward()
        opt.step()
    return model.state_dict()


def _close(got, want, what):
    for k, v in want.items():
        assert torch.allclose(got[k], v, rtol=1e-10, atol=1e-12), (
            f"{what}: {k} differs from the single-process oracle by {(got[k] - v).abs().max():.2e}"
        )


def _check(results, world):
    x, y = wk.data(world)
    ce = nn.functional.cross_entropy
    assert [r["rank"] for r in results] == list(range(world)) and all(r["backend"] == "gloo" for r in results)

    # one step: the mean over the concatenated batch
    xs, ys = x[:, 0].reshape(-1, wk.D), y[:, 0].reshape(-1)
    want = _sgd_steps([lambda m: ce(m(xs), ys)])
    # no_sync: the mean over every micro-batch of every rank
    xa, ya = x.reshape(-1, wk.D), y.reshape(-1)
    want_acc = _sgd_steps([lambda m: ce(m(xa), ya)])
    # Join: step s sums the losses of the ranks still active, divided by W * B
    steps = max(wk.batches_under_join(r) for r in range(world))
    active = [[r for r in range(world) if wk.batches_under_join(r) > s] for s in range(steps)]

    def join_loss(s, divisor):
        def loss_of(m):
            return sum(ce(m(x[r, s]), y[r, s], reduction="sum") for r in active[s]) / divisor

        return loss_of

    want_join = _sgd_steps([join_loss(s, world * wk.B) for s in range(steps)])
    naive = _sgd_steps([join_loss(s, len(active[s]) * wk.B) for s in range(steps)])  # mean over active only
    assert any(not torch.allclose(want_join[k], naive[k], rtol=1e-6) for k in want_join), (
        "the uneven case should tell 'divide by W' from 'divide by the active ranks'"
    )

    for res in results:
        r = res["rank"]
        _close(res["one_step"], want, f"{world} ranks, one step, rank {r}")
        _close(res["no_sync"], want_acc, f"{world} ranks, no_sync accumulation, rank {r}")
        _close(res["join"], want_join, f"{world} ranks, uneven inputs under Join, rank {r}")
        local = wk.make_model()
        (ce(local(x[r, 0]), y[r, 0]) / wk.MICRO).backward()
        for n, p in local.named_parameters():
            assert torch.allclose(res["local_grad_after_first_micro"][n], p.grad, rtol=1e-10, atol=1e-12), (
                f"rank {r}: under no_sync the gradient of {n} should be the rank's own (nothing all-reduced)"
            )


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ddp_step_equals_one_process_on_the_union(world):
    results = parallel.launch(wk.equivalence_worker, world, backend="gloo", timeout=300)
    _check(results, world)
