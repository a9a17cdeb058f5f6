"""Lab 5's ZeRO-2 self-check (utils.checks.check_zero2): it FAILS on the lab's placeholder, on the
library's sharding (PyTorch's and the course's) and on dist.all_reduce, naming which; it FAILS on
each likely mistake, written out below as a small wrong implementation, with a message that names
it; and it PASSES on the answer in solutions/lab5_memory_and_model_parallel.ipynb (taken from the
notebook itself, so the test follows the lab). The oracle is inside the check: one process running
torch.optim on the whole batch. The tests that start ranks (2 each) are marked slow."""

import json
import re
import textwrap
from pathlib import Path

import pytest

from utils import checks
from utils.checks import CheckFailed
from utils.checks import model_parallel as mp

ROOT = Path(__file__).resolve().parents[1]
LAB = ROOT / "solutions" / "lab5_memory_and_model_parallel.ipynb"
NAMES = ("flatten_padded", "zero2_optimizer", "zero2_step")
HEADER = "import torch\nimport torch.distributed as dist\nimport torch.nn.functional as F\nfrom torch import nn\n\n"


def _answer_cell() -> str:
    cells = ["".join(c["source"]) for c in json.loads(LAB.read_text())["cells"] if c["cell_type"] == "code"]
    return next(c for c in cells if c.startswith("def flatten_padded("))


def _notebook(source: str, tmp_path, name="cell"):
    """Define ``source`` as a notebook cell would: functions of module ``__main__`` (so helpers
    travel), from a file (so inspect.getsource works). Returns (zero2_optimizer, zero2_step)."""
    path = tmp_path / f"{name}.py"
    path.write_text(HEADER + textwrap.dedent(source))
    ns = {"__name__": "__main__"}
    exec(compile(path.read_text(), str(path), "exec"), ns)
    return ns["zero2_optimizer"], ns["zero2_step"]


def _replace(source: str, old: str, new: str) -> str:
    assert old in source, f"the lab's answer no longer contains {old!r}: update this test's mistake"
    return source.replace(old, new)


# ------------------------------------------------------------------ refused before any process starts


def test_placeholder_is_not_implemented_yet(tmp_path):
    from utils import authoring

    student = authoring.strip_solutions(_answer_cell())
    assert student.count("NotImplementedError") == 3
    with pytest.raises(CheckFailed, match="not implemented yet"):
        checks.check_zero2(*_notebook(student, tmp_path))


ZERO_LIBRARY = """
def zero2_optimizer(model, optimizer_class, **kwargs):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class, **kwargs)


def zero2_step(model, optimizer):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    optimizer.step()
"""

FSDP_LIBRARY = """
def zero2_optimizer(model, optimizer_class, **kwargs):
    from torch.distributed.fsdp import fully_shard
    fully_shard(model)
    return optimizer_class(model.parameters(), **kwargs)


def zero2_step(model, optimizer):
    optimizer.step()
"""

DDP_LIBRARY = """
def zero2_optimizer(model, optimizer_class, **kwargs):
    return optimizer_class(model.parameters(), **kwargs)


def zero2_step(model, optimizer):
    from torch.nn.parallel import DistributedDataParallel
    assert DistributedDataParallel
    optimizer.step()
"""

COURSE_LIBRARY = """
from utils.parallel.shard import shard_model


def zero2_optimizer(model, optimizer_class, **kwargs):
    return shard_model(model, "zero1", None, 0.1)[1]


def zero2_step(model, optimizer):
    optimizer.step()
"""

ALL_REDUCE_IN_HELPER = '''
def average(grads):
    """a docstring that says all_reduce is no call"""
    dist.all_reduce(grads)
    return grads / dist.get_world_size()


def zero2_optimizer(model, optimizer_class, **kwargs):
    return optimizer_class(model.parameters(), **kwargs)


def zero2_step(model, optimizer):
    for p in model.parameters():
        p.grad = average(p.grad)
    optimizer.step()
'''


@pytest.mark.parametrize(
    "source, message",
    [
        (ZERO_LIBRARY, r"zero2_optimizer uses ZeroRedundancyOptimizer \(PyTorch's ZeRO-1\)"),
        (FSDP_LIBRARY, r"uses fully_shard \(FSDP2"),
        (DDP_LIBRARY, r"zero2_step uses DistributedDataParallel \(DDP\)"),
        (COURSE_LIBRARY, r"uses shard_model from the course's utils"),
        (ALL_REDUCE_IN_HELPER, r"average calls dist.all_reduce, which ZeRO-2 replaces"),
    ],
    ids=["ZeroRedundancyOptimizer", "fully_shard", "DDP", "course", "all_reduce"],
)
def test_the_library_and_all_reduce_are_refused_by_name(source, message, tmp_path):
    with pytest.raises(CheckFailed, match=message):
        checks.check_zero2(*_notebook(source, tmp_path))


def test_library_functions_passed_directly_are_refused():
    import torch

    with pytest.raises(CheckFailed, match="library's code, not yours"):
        checks.check_zero2(torch.optim.Adam, torch.optim.Adam.step)


def test_an_attribute_named_like_a_course_module_is_not_refused(tmp_path):
    """The lab's setup cell imports utils.device as `device`; `grads.device` is not a use of it."""
    source = _answer_cell().replace("torch.empty_like(grads)", "torch.empty(grads.shape, device=grads.device)")
    assert "grads.device" in source
    fns = _notebook(source, tmp_path)
    from utils import device

    fns[1].__globals__["device"] = device
    assert any("grads.device" in src for _, src in mp._zero2_source("zero2", fns))


def test_names_read_code_not_strings():
    def f():
        """all_reduce"""
        return "all_reduce"

    assert "all_reduce" not in mp._names(f.__code__)


# ------------------------------------------------------------------ on 2 processes


@pytest.mark.slow
def test_the_lab_answer_passes_and_measures_the_zero2_formulas(tmp_path, capsys):
    from utils.parallel import ring_bytes

    got = checks.check_zero2(*_notebook(_answer_cell(), tmp_path))
    assert "\u2714 zero2: correct" in capsys.readouterr().out
    # the 57-parameter MLP of the check, Adam, 2 ranks: hand-counted
    assert (got["numel"], got["padded"], got["world_size"]) == (5 * 6 + 6 + 6 * 3 + 3, 58, 2)
    assert got["state_bytes"] == [2 * 4 * 29] * 2 and got["full_state_bytes"] == 2 * 4 * 57
    assert got["sent_bytes"] == 4 * 58 == ring_bytes("all_reduce", 4 * 58, 2)  # a ring: 2(N-1)/N x M
    assert got["ddp_sent_bytes"] == 4 * 57


MISTAKES = {
    # forgetting to divide by the world size: gradients N x too large
    "no_divide": (
        lambda s: _replace(s, "    shard.grad /= world\n", ""),
        r"gradients were 2x too large: reduce-scatter sums.*Try: divide your shard's gradient by the world size",
    ),
    # averaged in the collective and divided again: gradients N x too small
    "averaged_twice": (
        lambda s: _replace(
            s,
            "dist.reduce_scatter_tensor(shard.grad, grads)",
            "dist.reduce_scatter_tensor(shard.grad, grads, op=dist.ReduceOp.AVG)",
        ),
        r"(2x too small: they were averaged twice|ReduceOp.AVG failed).*Try: .*(divide by the world size|then divide)",
    ),
    # shards cut without padding: unequal shards when numel % N != 0, and the collectives refuse them
    "no_padding": (
        lambda s: _replace(s, "    return F.pad(flat, (0, missing))", "    return flat"),
        r"ran on the 44-parameter MLP but raised on the 57-parameter one.*Try: pad the flat vectors with zeros",
    ),
    # shards of numel // N: the last element is never stepped
    "truncated_shards": (
        lambda s: _replace(
            _replace(
                s, "    return F.pad(flat, (0, missing))", "    return flat[: flat.numel() - flat.numel() % world_size]"
            ),
            "            p.copy_(full[offset : offset + p.numel()].view_as(p))",
            "            n = min(p.numel(), full.numel() - offset)\n"
            "            p.view(-1)[:n].copy_(full[offset : offset + n])",
        ),
        r"57-parameter MLP.*differ from one process's.*but the 44-parameter MLP was right.*Try: pad the flat vectors",
    ),
    # stepping the full parameters, with the whole optimizer state, instead of the shard
    "full_step": (
        lambda s: (
            s
            + textwrap.dedent(
                """

            def zero2_optimizer(model, optimizer_class, **kwargs):
                return optimizer_class(model.parameters(), **kwargs)


            def zero2_step(model, optimizer):
                world, rank = dist.get_world_size(), dist.get_rank()
                params = list(model.parameters())
                grads = flatten_padded([p.grad for p in params], world)
                mine = torch.empty(grads.numel() // world)
                dist.reduce_scatter_tensor(mine, grads)
                dist.all_gather_into_tensor(grads, mine / world)
                offset = 0
                for p in params:
                    p.grad = grads[offset : offset + p.numel()].view_as(p).clone()
                    offset += p.numel()
                optimizer.step()
            """
            )
        ),
        r"holds \d+ bytes of state, the whole model's.*you step the full parameters, not your shard",
    ),
    # gathering the parameters before the optimizer has stepped them
    "gather_before_step": (
        lambda s: _replace(
            _replace(
                s, "    optimizer.step()\n    full = torch.empty_like(grads)\n", "    full = torch.empty_like(grads)\n"
            ),
            "    offset = 0\n    with torch.no_grad():",
            "    optimizer.step()\n    offset = 0\n    with torch.no_grad():",
        ),
        r"first step left the parameters as they were.*you gathered before stepping.*Try: step the optimizer on your shard first",
    ),
    # the shard cut as a view, not copied: the whole flat vector stays alive on every rank
    "shard_is_a_view": (
        lambda s: _replace(
            s, "flat.chunk(world)[rank].clone().requires_grad_()", "flat.chunk(world)[rank].requires_grad_()"
        ),
        r"shard is a view into the whole padded flat vector.*Try: make the shard a tensor of its own",
    ),
    # padding at the front: every parameter is read one element off
    "padding_in_front": (
        lambda s: _replace(s, "    return F.pad(flat, (0, missing))", "    return F.pad(flat, (missing, 0))"),
        r"57-parameter MLP.*but the 44-parameter MLP was right.*Try: pad the flat vectors with zeros at the END",
    ),
    # ZeRO-1 with a reduce-scatter: the full gradients stay on every rank
    "keeps_full_grads": (
        lambda s: _replace(s, "        p.grad = None  # ZeRO-2 keeps only its shard's gradient\n", "        pass\n"),
        r"still holds the model's full gradients.*Try: .*set p.grad to None",
    ),
}


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_each_mistake_is_named(mistake, tmp_path):
    make, message = MISTAKES[mistake]
    with pytest.raises(CheckFailed) as err:
        checks.check_zero2(*_notebook(make(_answer_cell()), tmp_path, mistake))
    text = str(err.value)
    assert re.search(message, text, re.S), text
    assert "\n" not in text.split("Try:")[0], "the diagnosis is one line"


@pytest.mark.slow
def test_a_crash_names_the_line_of_the_function(tmp_path):
    source = _replace(_answer_cell(), "    optimizer.step()\n", "    optimizer.step()\n    undefined_name + 1\n")
    with pytest.raises(CheckFailed) as err:
        checks.check_zero2(*_notebook(source, tmp_path))
    step_lines = next(c for c in source.split("\n\n\n") if c.startswith("def zero2_step(")).splitlines()
    line = next(i for i, text in enumerate(step_lines, 1) if "undefined_name" in text)
    first = str(err.value).split("\n")[0]
    assert "NameError" in first and f"(line {line} of zero2_step)" in first, first
    assert "failed too" not in first and "undefined_name" in err.value.remote_traceback


def _stage_pair(stage0, stage1, x, y, m, boundary="leaf", zero=False):
    """A GPipe step with one mistake at a time (the lab's answer when boundary="leaf", zero=False)."""
    if zero:
        stage0.zero_grad()
        stage1.zero_grad()
    saved = []
    for xi, yi in zip(x.chunk(m), y.chunk(m)):
        out0 = stage0(xi)
        b = {"leaf": out0.detach().requires_grad_(), "no_grad": out0.detach(), "same": out0}[boundary]
        saved.append((out0, b, ((stage1(b) - yi) ** 2).mean() / m))
    total = 0.0
    for out0, b, loss in saved:
        loss.backward()
        out0.backward(b.grad)
        total += loss.item()
    return total


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"boundary": "no_grad"},
            r"no gradient from the boundary.*Try: the boundary activation must be a leaf that requires grad",
        ),
        (
            {"boundary": "same"},
            r"no gradient from the boundary.*Try: the boundary activation must be a leaf that requires grad",
        ),
        ({"zero": True}, r"held before the call are gone: your function zeroed them"),
    ],
)
def test_gpipe_names_the_boundary_and_zeroing_mistakes(kwargs, message):
    checks.check_gpipe_microbatches(_stage_pair)  # the oracle inside: one full-batch step's gradients
    with pytest.raises(CheckFailed) as err:
        checks.check_gpipe_microbatches(lambda *a: _stage_pair(*a, **kwargs))
    assert re.search(message, str(err.value)), str(err.value)
