"""Self-check messages: each typical mistake (written out by hand below, the oracle) gets ONE line
that names it and says what to try; the untouched lab placeholder gets the "not implemented"
line; and what a Jupyter kernel shows for a failed check is short: the student's own cell, then
that line, no frames from utils.checks and no chained traceback."""

import math
import os
import re
import statistics
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler

from utils import checks, linear_regression


def placeholder(*args, **kwargs):
    raise NotImplementedError("Exercise: write this part (see the hint above)")  # labs/' placeholder


# ------------------------------------------------------------------ hand-written mistakes


def gd_step_forgets_b(x, y, w, b, lr):
    r = w * x - y
    return float(w - lr * 2 * (r * x).mean()), float(b - lr * 2 * r.mean())


def gd_step_keeps_b(x, y, w, b, lr):
    r = w * x + b - y
    return float(w - lr * 2 * (r * x).mean()), b


def sgd_new_iterator_each_step(x, y, w0, b0, lr, steps, batch_size, seed=0):
    path, w, b = [(w0, b0)], w0, b0
    for _ in range(steps):
        idx = next(linear_regression.minibatches(len(x), batch_size, seed))
        r = w * x[idx] + b - y[idx]
        w, b = float(w - lr * 2 * (r * x[idx]).mean()), float(b - lr * 2 * r.mean())
        path.append((w, b))
    return torch.tensor(path, dtype=torch.float64)


def b_simple_mean_of_ratios(s, g, bs, bb):
    return float(((s - g) / (1 / bs - 1 / bb) / ((bb * g - bs * s) / (bb - bs))).mean())


def state_bytes_counts_elements(model, optimizer, momentum=0.0):
    n = sum(p.numel() for p in model.parameters())
    return {"params": n, "grads": n, "optimizer_state": {"adam": 2, "sgd": 1 if momentum else 0}[optimizer] * n}


def time_step_without_final_sync(step, sync, warmup=3, repeats=5):
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def wait_fraction_percent(loader, step):
    waited, start, it = 0.0, time.perf_counter(), iter(loader)
    while True:
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        waited += time.perf_counter() - t0
        step(batch)
    return 100 * waited / (time.perf_counter() - start)


def shard_without_set_epoch(n, batch_size, rank, world_size, epoch, seed):
    idx = list(DistributedSampler(range(n), num_replicas=world_size, rank=rank, seed=seed))
    return [idx[i : i + batch_size] for i in range(0, len(idx), batch_size)]


def save_in_place(path, model, optimizer, epoch, rank):
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}, path)


def warmup_off_by_one(step, base_lr, peak_lr, warmup_steps):
    return base_lr + (peak_lr - base_lr) * min(step + 1, warmup_steps) / warmup_steps


def trust_ratio_as_float(w, g, weight_decay, trust_coefficient, eps):
    wn, gn = w.norm().item(), g.norm().item()
    return trust_coefficient * wn / (gn + weight_decay * wn + eps) if wn and gn else 1.0


def lars_step_in_place(w, g, buf, lr, momentum, weight_decay, trust_coefficient, eps):
    wn, gn = torch.linalg.vector_norm(w), torch.linalg.vector_norm(g)
    d = trust_coefficient * wn / (gn + weight_decay * wn + eps) * (g + weight_decay * w)
    buf = d if buf is None else buf.mul_(momentum).add_(d)
    w -= lr * buf
    return w, buf


def lr_upside_down(base_lr, base_batch, batch, rule):
    k = base_batch / batch
    return base_lr * (k if rule == "linear" else math.sqrt(k))


def per_example_grads_summed(model, loss_fn, x, y):
    grads = torch.autograd.grad(loss_fn(model(x), y), list(model.parameters()))
    return torch.cat([g.reshape(-1) for g in grads])


def noise_scale_uncorrected(g):
    mean = g.mean(0)
    return float(((g - mean) ** 2).sum() / (len(g) - 1) / (mean**2).sum())


def fit_critical_batch_slope(batch_sizes, steps):
    import numpy as np

    slope, s_min = np.polyfit(1 / np.asarray(batch_sizes, float), np.asarray(steps, float), 1)
    return float(s_min), float(slope)


def examples_as_steps(batch_sizes, s_min, b_crit):
    return [s_min * (1 + b_crit / b) for b in batch_sizes]


def dataset_scale_first_chunk(model, loss_fn, x, y, chunk):
    grads = []
    for i in range(chunk):
        gs = torch.autograd.grad(loss_fn(model(x[i : i + 1]), y[i : i + 1]), list(model.parameters()))
        grads.append(torch.cat([g.reshape(-1) for g in gs]))
    return noise_scale_unbiased(torch.stack(grads))


def steps_swapped(batch_sizes, s_min, b_crit):
    return [s_min * (1 + b / b_crit) for b in batch_sizes]


def noise_scale_unbiased(g):
    mean = g.mean(0)
    tr = ((g - mean) ** 2).sum() / (len(g) - 1)
    return float(tr / ((mean**2).sum() - tr / len(g)))


CASES = [
    (checks.check_gd_step, gd_step_forgets_b, "the residual leaves out b"),
    (checks.check_gd_step, gd_step_keeps_b, "w moves correctly but b does not"),
    (checks.check_sgd, sgd_new_iterator_each_step, "the first step is right but later ones are not"),
    (checks.check_noise_scale, b_simple_mean_of_ratios, "you averaged the per-pair ratios"),
    (checks.check_state_bytes, state_bytes_counts_elements, "the number of elements"),
    (checks.check_time_step, time_step_without_final_sync, "call sync\\(\\) before reading the clock"),
    (checks.check_wait_fraction, wait_fraction_percent, "a percentage"),
    (checks.check_shard_batches, shard_without_set_epoch, "never reshuffled.*set_epoch"),
    (checks.check_save_on_rank0, save_in_place, "not atomically.*os.replace"),
    (checks.check_warmup_lr, warmup_off_by_one, "off by one"),
    (checks.check_trust_ratio, trust_ratio_as_float, "not a tensor"),
    (checks.check_lars_step, lars_step_in_place, "changed its input w in place"),
    (checks.check_lr_for_batch, lr_upside_down, "upside down"),
    (checks.check_per_example_grads, per_example_grads_summed, "not one per example"),
    (checks.check_noise_scale_from_per_example, noise_scale_uncorrected, "the mean's own noise"),
    (checks.check_fit_critical_batch, fit_critical_batch_slope, "the slope S_min \\* B_crit itself"),
    (checks.check_examples_to_target, examples_as_steps, "the steps S\\(B\\), not the examples"),
    (checks.check_dataset_noise_scale, dataset_scale_first_chunk, "only the first chunk"),
    (checks.check_steps_to_target, steps_swapped, "B and B_crit are swapped"),
]


def _one_line(message: str) -> str:
    assert "\n" not in message, f"the diagnosis should be one line:\n{message}"
    assert ". Try: " in message, f"the diagnosis should say what to try: {message}"
    return message


@pytest.mark.parametrize("check,wrong,expected", CASES, ids=[c[1].__name__ for c in CASES])
def test_a_typical_mistake_is_named_in_one_line(check, wrong, expected):
    with pytest.raises(checks.CheckFailed) as info:
        check(wrong)
    assert re.search(expected, _one_line(str(info.value))), str(info.value)
    assert info.value.__suppress_context__, "raise from None: no 'During handling...' chain"


CHECKS = sorted({c[0] for c in CASES} | {checks.check_accuracy}, key=lambda f: f.__name__)


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
def test_the_untouched_placeholder_says_not_implemented(check):
    with pytest.raises(checks.CheckFailed) as info:
        check(placeholder)
    msg = _one_line(str(info.value))
    assert "not implemented yet" in msg and "NotImplementedError" in msg, msg
    assert info.value.__cause__ is None and info.value.__suppress_context__


def _kernel_tracebacks(cells: list[str]) -> list[list[str]]:
    """What a Jupyter kernel sends the browser for each cell: the error's traceback lines."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", cwd=os.path.dirname(os.path.dirname(__file__)))
    out = []
    try:
        for code in cells:
            msg_id, lines = kc.execute(code), []
            while True:
                msg = kc.get_iopub_msg(timeout=120)
                if msg["parent_header"].get("msg_id") != msg_id:
                    continue
                if msg["msg_type"] == "error":
                    lines = [
                        re.sub(r"\x1b\[[0-9;]*m", "", line)
                        for line in "\n".join(msg["content"]["traceback"]).splitlines()
                    ]
                if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                    break
            out.append(lines)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return out


def _lab_cells(name: str, defines: str):
    """The untouched exercise cell of labs/NAME that defines `defines`, and the check cell after it."""
    import json

    cells = json.loads((Path(__file__).resolve().parents[1] / "labs" / name).read_text())["cells"]
    i = next(i for i, c in enumerate(cells) if f"def {defines}(" in "".join(c["source"]))
    return "".join(cells[i]["source"]), "".join(cells[i + 1]["source"])


def test_a_kernel_shows_a_failed_check_as_the_cell_and_one_line():
    exercise, check = _lab_cells("lab1_gd_sgd_batch.ipynb", "gd_step")
    assert "NotImplementedError" in exercise and "check_gd_step" in check
    placeholder_cell = exercise + "\n" + check
    wrong_cell = (
        "def gd_step(x, y, w, b, lr):\n"
        "    r = w * x - y\n"
        "    return float(w - lr * 2 * (r * x).mean()), float(b - lr * 2 * r.mean())\n"
        "utils.checks.check_gd_step(gd_step)"
    )
    _, first, second = _kernel_tracebacks(["import utils.checks", placeholder_cell, wrong_cell])
    for cell, lines, last in (
        (placeholder_cell, first, r"CheckFailed: gd_step: it is not implemented yet\. Try: replace the"),
        (wrong_cell, second, r"CheckFailed: gd_step: the residual leaves out b\. Try: "),
    ):
        text = "\n".join(lines)
        assert lines, "the check did not fail in the kernel"
        assert re.match(last, lines[-1]), text
        # one frame (the student's cell), none from utils.checks, no chained exception
        assert sum(line.startswith(("Cell In[", "File ")) for line in lines) == 1, text
        assert "utils/checks" not in text and "During handling" not in text and "direct cause" not in text, text
        assert len(lines) <= cell.count("\n") + 1 + 5, text


# ------------------------------------------------------------------ lab 4: MyLARS and MyGhostBatchNorm2d


def _lab4_class(defines: str):
    """The untouched exercise cell of labs/lab4 that defines class `defines` (the placeholders)."""
    import json

    cells = json.loads((Path(__file__).resolve().parents[1] / "labs" / "lab4_large_batch.ipynb").read_text())["cells"]
    src = next("".join(c["source"]) for c in cells if "".join(c["source"]).startswith(f"class {defines}("))
    ns = {"torch": torch, "nn": torch.nn}
    exec(src, ns)
    return ns[defines]


class LarsNotAnOptimizer:  # forgot to subclass torch.optim.Optimizer
    def __init__(self, params, lr, **kw):
        self.param_groups = [dict(kw, lr=lr, **g) for g in params]

    def step(self):
        pass


class GhostWholeBatch(torch.nn.Module):
    def __init__(self, c, virtual_batch_size=32):
        super().__init__()
        self.weight, self.bias = torch.nn.Parameter(torch.ones(c)), torch.nn.Parameter(torch.zeros(c))
        self.register_buffer("running_mean", torch.zeros(c))
        self.register_buffer("running_var", torch.ones(c))

    def forward(self, x):
        mean, var = x.mean(dim=(0, 2, 3), keepdim=True), x.var(dim=(0, 2, 3), keepdim=True, correction=0)
        return (x - mean) / torch.sqrt(var + 1e-5) * self.weight.view(1, -1, 1, 1) + self.bias.view(1, -1, 1, 1)


@pytest.mark.parametrize(
    "check,wrong,expected",
    [
        (checks.check_lars_optimizer, LarsNotAnOptimizer, "not a torch.optim.Optimizer"),
        (checks.check_ghost_batch_norm, GhostWholeBatch, "statistics are over the whole batch"),
    ],
    ids=["lars_not_an_optimizer", "ghost_whole_batch"],
)
def test_lab4_classes_name_a_mistake_in_one_line(check, wrong, expected):
    with pytest.raises(checks.CheckFailed) as info:
        check(wrong)
    assert re.search(expected, _one_line(str(info.value))), str(info.value)
    assert info.value.__suppress_context__


@pytest.mark.parametrize(
    "check,cls", [(checks.check_lars_optimizer, "MyLARS"), (checks.check_ghost_batch_norm, "MyGhostBatchNorm2d")]
)
def test_lab4_untouched_classes_say_not_implemented(check, cls):
    with pytest.raises(checks.CheckFailed) as info:
        check(_lab4_class(cls))
    msg = _one_line(str(info.value))
    assert "not implemented yet" in msg and "NotImplementedError" in msg, msg
    assert info.value.__cause__ is None and info.value.__suppress_context__
