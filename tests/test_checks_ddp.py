"""Lab 3's self-checks (utils/checks/ddp.py): each FAILS on the lab's placeholder, on the
course's own implementation, and on the likely mistakes written out below, with a message that
names the mistake; and PASSES on the answers in solutions/lab3_ddp.ipynb (taken from the notebook
itself, so the test follows the lab). 2 ranks, tiny models."""

import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from utils import checks, device, parallel  # device: the name lab 3's setup cell binds
from utils.checks import CheckFailed

ROOT = Path(__file__).resolve().parents[1]
LAB = ROOT / "solutions" / "lab3_ddp.ipynb"


def _cells():
    return ["".join(c["source"]) for c in json.loads(LAB.read_text())["cells"] if c["cell_type"] == "code"]


def _answer(fn_name, tmp_path):
    """The solution's function, defined from a file so that inspect.getsource works (as in a notebook)."""
    src = next(c for c in _cells() if c.startswith(f"def {fn_name}("))
    path = tmp_path / f"answer_{fn_name}.py"
    path.write_text(
        "import os\nimport torch\nimport torch.distributed as dist\nfrom torch import nn\n"
        "from torch.utils.data import DistributedSampler\n\n" + src + "\n"
    )
    ns = {"__name__": f"answer_{fn_name}"}
    exec(compile(path.read_text(), str(path), "exec"), ns)
    return ns[fn_name]


def placeholder(*args, **kwargs):
    raise NotImplementedError("Exercise: write this part (see the hint above)")


def _as_notebook_function(fn):
    """Make ``fn`` look defined in a notebook (module __main__), as the student's helpers are."""
    fn.__module__ = "__main__"
    return fn


# ------------------------------------------------------------------ ring all-reduce: refusals


def ring_calls_all_reduce(tensor):
    dist.all_reduce(tensor)
    return tensor


def ring_wraps_the_library(tensor):
    return parallel.ring_all_reduce(tensor)


def ring_blocking_sends(tensor):
    world, rank = dist.get_world_size(), dist.get_rank()
    chunks = list(tensor.view(-1).tensor_split(world))
    for s in range(2 * (world - 1)):
        buf = torch.empty_like(chunks[(rank - s - 1) % world])
        dist.send(chunks[(rank - s) % world], (rank + 1) % world)  # the mistake under test
        dist.recv(buf, (rank - 1) % world)  # the mistake under test
    return tensor


def ring_raises_on_rank1(tensor):
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    return tensor


def _exchange_helper(send, recv, right, left):
    ops = [dist.P2POp(dist.isend, send, right), dist.P2POp(dist.irecv, recv, left)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()


def ring_with_a_helper(tensor):
    world, rank = dist.get_world_size(), dist.get_rank()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = list(tensor.view(-1).tensor_split(world))
    for s in range(world - 1):
        send_i, recv_i = (rank - s) % world, (rank - s - 1) % world
        buf = torch.empty_like(chunks[recv_i])
        _exchange_helper(chunks[send_i], buf, right, left)
        chunks[recv_i] += buf
    for s in range(world - 1):
        send_i, recv_i = (rank + 1 - s) % world, (rank - s) % world
        buf = torch.empty_like(chunks[recv_i])
        _exchange_helper(chunks[send_i], buf, right, left)
        chunks[recv_i].copy_(buf)
    return tensor


def _ring_exchange(chunks, send_i, recv_i, right, left):
    buf = torch.empty_like(chunks[recv_i])
    ops = [dist.P2POp(dist.isend, chunks[send_i], right), dist.P2POp(dist.irecv, buf, left)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return buf


_as_notebook_function(_ring_exchange)


def ring_adds_into_copies(tensor):
    world, rank = dist.get_world_size(), dist.get_rank()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = [c.clone() for c in tensor.view(-1).tensor_split(world)]  # the mistake under test: copies
    for s in range(world - 1):
        recv_i = (rank - s - 1) % world
        chunks[recv_i].add_(_ring_exchange(chunks, (rank - s) % world, recv_i, right, left))
    for s in range(world - 1):
        recv_i = (rank - s) % world
        chunks[recv_i].copy_(_ring_exchange(chunks, (rank + 1 - s) % world, recv_i, right, left))
    return tensor


def ring_all_gather_with_reduce_scatter_indices(tensor):
    world, rank = dist.get_world_size(), dist.get_rank()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = tensor.view(-1).tensor_split(world)
    for s in range(world - 1):
        recv_i = (rank - s - 1) % world
        chunks[recv_i].add_(_ring_exchange(chunks, (rank - s) % world, recv_i, right, left))
    for s in range(world - 1):
        recv_i = (rank - s - 1) % world  # the mistake under test: reduce-scatter's indices again
        chunks[recv_i].copy_(_ring_exchange(chunks, (rank - s) % world, recv_i, right, left))
    return tensor


def ring_reduce_scatter_copies(tensor):
    world, rank = dist.get_world_size(), dist.get_rank()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = tensor.view(-1).tensor_split(world)
    for s in range(world - 1):
        recv_i = (rank - s - 1) % world
        chunks[recv_i].copy_(_ring_exchange(chunks, (rank - s) % world, recv_i, right, left))  # the mistake
    for s in range(world - 1):
        recv_i = (rank - s) % world
        chunks[recv_i].copy_(_ring_exchange(chunks, (rank + 1 - s) % world, recv_i, right, left))
    return tensor


@pytest.mark.extended
@pytest.mark.parametrize(
    "fn, message",
    [
        (ring_adds_into_copies, "every rank still holds its own tensor.*copies.*not views of `tensor`"),
        (
            ring_all_gather_with_reduce_scatter_indices,
            "reduce-scatter is right .*but the all-gather is wrong: .*full sum only for some.*rank 0: none",
        ),
        (ring_reduce_scatter_copies, "reduce-scatter is wrong"),
    ],
)
def test_ring_check_names_the_phase_that_went_wrong(fn, message):
    with pytest.raises(CheckFailed, match=message):
        checks.check_ring_all_reduce(fn)


@pytest.mark.parametrize(
    "fn, message",
    [
        (parallel.ring_all_reduce, "library's own implementation"),
        (ring_calls_all_reduce, "calls all_reduce, which this exercise asks you to build"),
        (ring_wraps_the_library, "course's utils.parallel"),
    ],
)
def test_ring_check_refuses_the_collective_and_the_library(fn, message):
    with pytest.raises(CheckFailed, match=message):
        checks.check_ring_all_reduce(fn)


def reads_the_tensors_device(tensor):
    return torch.zeros(1, device=tensor.device)


def uses_the_device_module(tensor):
    return torch.zeros(1, device=device.get_device())


def test_an_attribute_named_like_a_course_module_is_not_that_module():
    from utils.checks.ddp import _source

    assert "def reads_the_tensors_device" in _source("probe", reads_the_tensors_device)
    with pytest.raises(CheckFailed, match="course's utils.device"):
        _source("probe", uses_the_device_module)


@pytest.mark.extended
def test_ring_check_names_the_deadlock_of_blocking_sends():
    with pytest.raises(CheckFailed, match="deadlock: every rank is blocked in its dist.send"):
        checks.check_ring_all_reduce(ring_blocking_sends)


def test_ring_check_hands_over_the_ranks_traceback():
    with pytest.raises(CheckFailed) as info:
        checks.check_ring_all_reduce(ring_raises_on_rank1)
    assert "boom on rank 1" in str(info.value) and "Traceback from rank 1" in str(info.value)
    assert "boom on rank 1" in info.value.remote_traceback


def test_helpers_defined_in_the_notebook_travel_with_the_function(monkeypatch):
    _as_notebook_function(_exchange_helper)
    checks.check_ring_all_reduce(ring_with_a_helper)


def test_ring_and_average_pass_on_the_answers(tmp_path):
    checks.check_ring_all_reduce(_answer("ring_all_reduce", tmp_path))
    checks.check_average_gradients(_answer("average_gradients", tmp_path))


def test_average_check_refuses_the_library():
    with pytest.raises(CheckFailed, match="library's own implementation"):
        checks.check_average_gradients(parallel.average_gradients)


# ------------------------------------------------------------------ overlapped DDP by hand


def overlap_uses_ddp(model, bucket_numel=0):
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel(model)
    return lambda: None


def overlap_blocking(model, bucket_numel=0):
    world = dist.get_world_size()

    def hook(p):
        dist.all_reduce(p.grad)
        p.grad /= world

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    return lambda: None


def overlap_after_backward(model, bucket_numel=0):
    world = dist.get_world_size()

    def finish():
        works = [(p, dist.all_reduce(p.grad, async_op=True)) for p in model.parameters()]
        for p, w in works:
            w.wait()
            p.grad /= world

    return finish


def overlap_all_in_finish(model, bucket_numel=0):
    def finish():
        world = dist.get_world_size()
        for p in model.parameters():
            dist.all_reduce(p.grad)  # the mistake under test: no hooks, blocking, after backward
            p.grad /= world

    return finish


def overlap_forward_buckets(model, bucket_numel=0):
    params = list(model.parameters())
    buckets, current, size = [], [], 0
    for p in params:  # the mistake under test: forward order, not reversed
        if current and size + p.numel() > bucket_numel:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel()
    buckets.append(current)
    bucket_of = {p: i for i, b in enumerate(buckets) for p in b}
    ready, pending = [0] * len(buckets), []

    def hook(p):
        i = bucket_of[p]
        ready[i] += 1
        if ready[i] == len(buckets[i]):
            flat = torch.cat([q.grad.reshape(-1) for q in buckets[i]])
            pending.append((i, flat, dist.all_reduce(flat, async_op=True)))

    for p in params:
        p.register_post_accumulate_grad_hook(hook)

    def finish():
        for i, flat, work in pending:
            work.wait()
            flat /= dist.get_world_size()
            offset = 0
            for q in buckets[i]:
                q.grad.copy_(flat[offset : offset + q.numel()].view_as(q.grad))
                offset += q.numel()
        pending.clear()
        ready[:] = [0] * len(buckets)

    return finish


def test_bucket_rule_oracle():
    from utils.checks.ddp import _bucket_numels, _forward_buckets

    # the lab's trace model, by hand: weights 256*256 (10 for the last), biases 256 (10)
    sizes = [256 * 256, 256] * 4 + [2560, 10]
    assert _bucket_numels(sizes[::-1], 70_000) == [10 + 2560 + 256 + 65536 + 256, 65536 + 256, 65536 + 256, 65536]
    assert _bucket_numels(sizes, 0) == sizes
    assert _bucket_numels(sizes, 70_000) == [65792, 65792, 65792, 65536 + 256 + 2560 + 10]  # also 4 buckets
    assert _forward_buckets([65792, 65792, 65792, 68362], sizes, 70_000)
    assert not _forward_buckets([68618, 65792, 65792, 65536], sizes, 70_000)


def test_overlap_trace_refuses_forward_buckets():
    with pytest.raises(CheckFailed, match="forward order.*last layer first"):
        checks.check_overlap_trace(overlap_forward_buckets, bucket_numel=70_000)


def _per_param(model, divide=True, clear=True):
    world = dist.get_world_size()
    pending = []

    def hook(p):
        pending.append((p, dist.all_reduce(p.grad, async_op=True)))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)

    def finish():
        for p, w in pending:
            w.wait()
            if divide:
                p.grad /= world
        if clear:
            pending.clear()

    return finish


_as_notebook_function(_per_param)  # a helper from another cell: it travels with the function


def overlap_sums(model, bucket_numel=0):
    return _per_param(model, divide=False)


def overlap_never_clears(model, bucket_numel=0):
    return _per_param(model, clear=False)


def overlap_ignores_buckets(model, bucket_numel=0):
    return _per_param(model)


@pytest.mark.extended
@pytest.mark.parametrize(
    "fn, message",
    [
        (placeholder, "not implemented"),
        (overlap_uses_ddp, "calls DistributedDataParallel"),
        (overlap_blocking, "blocking .async_op not set"),
        (overlap_after_backward, "after backward\\(\\) returned"),
        (overlap_all_in_finish, "none started during backward.*Try: launch the all-reduces from gradient hooks"),
        (overlap_forward_buckets, "forward order of model.parameters.*last layer first.*waits for the whole backward"),
        (overlap_sums, "summed, not averaged"),
        (overlap_never_clears, "after 3 steps the weights differ"),
        (overlap_ignores_buckets, "bucket_numel=80 you made 6 all-reduces"),
    ],
)
def test_overlap_check_names_the_mistake(fn, message):
    with pytest.raises(CheckFailed, match=message):
        checks.check_overlap_ddp(fn)


def test_overlap_check_and_trace_pass_on_the_answer(tmp_path, capsys):
    answer = _answer("overlap_ddp", tmp_path)
    checks.check_overlap_ddp(answer)
    events = checks.check_overlap_trace(answer, bucket_numel=70_000)
    assert sum(e[0] == "c10d::allreduce_" for e in events) == 4  # the lab's answer key


def test_overlap_trace_fails_without_overlap():
    with pytest.raises(CheckFailed, match="no overlap"):
        checks.check_overlap_trace(overlap_after_backward)


# ------------------------------------------------------------------ the lab's hints


def test_no_hint_of_lab3_contains_a_line_of_its_answer():
    from utils import authoring

    for cell in _cells():
        blocks = re.findall(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", cell, re.S)
        for block in blocks:
            lines = [ln.strip() for ln in block.splitlines() if ln.strip()]
            hints = [ln for ln in lines if authoring.hint_tier(ln) is not None]
            answer = [ln for ln in lines if not ln.startswith("#")]
            for a in answer:
                for h in hints:
                    assert a not in h, f"a hint gives away the answer line {a!r}"
            assert {authoring.hint_tier(h) for h in hints} == {1, 2, 3}, f"hints not in three tiers: {hints}"
