"""utils.parallel on CPU with gloo: launch() and its failure modes, the ring all-reduce, DDP (by hand
and with PyTorch) against a single process, and checkpoints that resume exactly.

The workers are module-level functions of this file: spawned processes import them by name.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from utils import data, ddp_train, models, parallel
from utils.train import fit

pytestmark = pytest.mark.slow  # nearly every test starts ranks (make check keeps test_oracle_ddp's 2)

W, B, STEPS = 2, 8, 4  # world size, per-rank batch, optimizer steps of the DDP comparison


# ---------------------------------------------------------------------------- workers


def collectives_worker(sizes):
    ctx = parallel.setup()
    out = {
        "rank": ctx.rank,
        "world": ctx.world_size,
        "backend": ctx.backend,
        "pid": os.getpid(),
        "threads": torch.get_num_threads(),
        "ring": [],
        "ref": [],
    }
    for n in sizes:
        x = torch.arange(n, dtype=torch.float32) * (ctx.rank + 1) + 10 * ctx.rank
        ref = x.clone()
        dist.all_reduce(ref)
        out["ref"].append(ref)
        out["ring"].append(parallel.ring_all_reduce(x.clone()))
    m = torch.full((2, 3), float(ctx.rank)).t()  # not contiguous
    out["noncontig"] = parallel.ring_all_reduce(m)
    return out


def raising_worker():
    ctx = parallel.setup()
    if ctx.rank == 1:
        raise ValueError("boom from the second rank")
    dist.barrier()  # rank 0 waits for a peer that is gone


def hanging_worker():
    ctx = parallel.setup()
    if ctx.rank == 0:
        dist.all_reduce(torch.ones(3))  # rank 1 never joins: a hang
    time.sleep(600)


def rank_worker(x):
    return {"rank": int(os.environ["RANK"]), "x": x}


def stuck_at_exit_worker():
    import atexit

    atexit.register(time.sleep, 600)  # the result is sent, then the process never exits
    return int(os.environ["RANK"])


class _GlooAbortAtExit:
    """Dies of SIGABRT while the interpreter shuts down, with the line gloo's teardown prints."""

    def __del__(self, write=os.write, abort=os.abort):
        write(2, b"terminate called without an active exception\n")
        abort()


_held = None  # freed as the interpreter shuts down, after the rank sent its result


def aborted_at_exit_worker(mode):
    global _held
    rank = int(os.environ["RANK"])
    if rank == 1:
        _held = _GlooAbortAtExit()
        if mode == "raise":
            raise ValueError("rank 1 failed before its exit")
        if mode == "abort":
            _held.__del__()  # the same abort, before the worker returned
    return rank


def _dataset():
    return data.synthetic(W * B * STEPS, shape=(1, 8, 8), seed=3)


def _model(seed):
    torch.manual_seed(seed)
    return models.Net(8, in_channels=1, image_size=8)


def ddp_worker():
    """Hand DDP and torch DDP from ranks whose models start with DIFFERENT seeds."""
    ctx = parallel.setup()
    ds = _dataset()
    init = {k: v.clone() for k, v in _model(100 + ctx.rank).state_dict().items()}

    hand = _model(100 + ctx.rank)  # by hand: broadcast, then average gradients
    for p in hand.parameters():
        dist.broadcast(p.data, src=0)
    opt = torch.optim.SGD(hand.parameters(), lr=0.1, momentum=0.9)
    loader = data.make_loader(ds, B, rank=ctx.rank, world_size=ctx.world_size, seed=5)
    loss_fn = nn.CrossEntropyLoss()
    for x, y in loader:
        opt.zero_grad()
        loss_fn(hand(x), y).backward()
        parallel.average_gradients(hand)
        opt.step()

    net = parallel.ddp(_model(100 + ctx.rank), ctx)  # torch DDP broadcasts rank 0's weights itself
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    fit(net, data.make_loader(ds, B, rank=ctx.rank, world_size=ctx.world_size, seed=5), opt, epochs=1, progress=False)
    return {"init": init, "hand": hand.state_dict(), "ddp": net.module.state_dict()}


# ---------------------------------------------------------------------------- helpers


def _children():
    """PIDs of this process's live descendants, ranks forked by the fork server included; not the
    stdlib's resource tracker and fork server themselves (one helper each per interpreter, no rank)."""
    me, parent, helper = os.getpid(), {}, set()
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            parent[int(pid)] = int(fields[1])
            if int(fields[1]) == me and (b"resource_tracker" in cmd or b"forkserver" in cmd):
                helper.add(int(pid))

    def descends(pid):
        while pid in parent:
            pid = parent[pid]
            if pid == me:
                return True
        return False

    kids = [pid for pid in parent if pid not in helper and descends(pid)]
    return kids + [p.pid for p in mp.active_children()]


def _no_children(what):
    deadline = time.monotonic() + 5
    while _children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _children(), f"{what} left child processes behind: {_children()}; launch() must stop them all"


# ---------------------------------------------------------------------------- tests


def test_launch_returns_every_rank_and_ring_equals_all_reduce():
    sizes = [1, 7, 1000]
    res = parallel.launch(collectives_worker, 3, sizes, timeout=120)
    assert [r["rank"] for r in res] == [0, 1, 2], "launch must return the results in rank order"
    assert all(r["world"] == 3 and r["backend"] == "gloo" for r in res), (
        "on a machine without 3 GPUs launch must choose gloo and a world of nprocs"
    )
    assert len({r["pid"] for r in res}) == 3, "each rank must be its own process"
    assert all(r["threads"] == 1 for r in res), "each rank should run one torch thread by default"
    for r in res:
        for n, ring, ref in zip(sizes, r["ring"], r["ref"]):
            assert torch.equal(ring, ref), f"ring_all_reduce != dist.all_reduce on rank {r['rank']} for {n} elements"
        assert torch.equal(r["noncontig"], torch.full((3, 2), 3.0)), "ring_all_reduce of a non-contiguous tensor"
    _no_children("a successful launch")


def test_raising_rank_is_named_with_traceback_and_cleaned_up():
    t0 = time.monotonic()
    with pytest.raises(parallel.LaunchError) as err:
        parallel.launch(raising_worker, 2, timeout=60, stream=False)
    took = time.monotonic() - t0
    e = err.value
    assert not isinstance(e, parallel.LaunchTimeout), "a raising rank must not be reported as a timeout"
    assert e.rank == 1 and "rank 1" in str(e), f"the error must name rank 1, got: {e}"
    assert "boom from the second rank" in str(e) and "raising_worker" in e.remote_traceback, (
        "the error must carry the rank's message and traceback"
    )
    assert took < 45, f"the failure took {took:.0f} s to surface: stop waiting once a rank fails"
    _no_children("a failed launch")


def test_hang_stops_at_timeout_and_next_launch_works():
    t0 = time.monotonic()
    with pytest.raises(parallel.LaunchTimeout) as err:
        parallel.launch(hanging_worker, 2, timeout=4, stream=False)
    took = time.monotonic() - t0
    assert 4 <= took < 25, f"a 4 s timeout ended after {took:.1f} s"
    assert "timed out" in str(err.value)
    _no_children("a timed-out launch")
    res = parallel.launch(rank_worker, 2, "again", timeout=60)
    assert res == [{"rank": 0, "x": "again"}, {"rank": 1, "x": "again"}], "a launch after a failure must work"
    _no_children("the launch after a timeout")


def test_a_rank_stuck_exiting_after_its_result_does_not_hang_launch(monkeypatch):
    monkeypatch.setattr(parallel.launcher, "EXIT_GRACE_S", 1.0)
    t0 = time.monotonic()
    assert parallel.launch(stuck_at_exit_worker, W, timeout=60, stream=False) == list(range(W))
    assert time.monotonic() - t0 < 30, "launch should return soon after every rank sent its result"
    _no_children("a rank stuck at exit")


def test_gloo_s_abort_at_exit_after_the_result_was_sent_is_no_failure():
    assert parallel.launch(aborted_at_exit_worker, 2, "finish", timeout=120, stream=False) == [0, 1]
    with pytest.raises(parallel.LaunchError, match="rank 1 raised ValueError: rank 1 failed before its exit"):
        parallel.launch(aborted_at_exit_worker, 2, "raise", timeout=120, stream=False)
    with pytest.raises(parallel.LaunchError, match="rank 1 was killed by signal 6"):
        parallel.launch(aborted_at_exit_worker, 2, "abort", timeout=120, stream=False)
    _no_children("launches whose rank aborted")


def test_worker_from_main_or_lambda_is_refused():
    def local():
        pass

    main_fn = lambda: None  # noqa: E731
    for fn in (local, main_fn):
        with pytest.raises(parallel.WorkerNotImportable, match="%%writefile"):
            parallel.launch(fn, 2)
    local.__module__ = "__main__"
    local.__qualname__ = "local"
    with pytest.raises(parallel.WorkerNotImportable, match="__main__"):
        parallel.launch(local, 2)
    with pytest.raises(ValueError, match="nprocs"):
        parallel.launch(rank_worker, 0)


def test_nccl_refused_without_enough_gpus():
    if torch.cuda.is_available() and torch.cuda.device_count() >= 64:
        pytest.skip("this machine has 64 GPUs")
    with pytest.raises(ValueError, match="one GPU per process"):
        parallel.launch(rank_worker, 64, 1, backend="nccl")
    assert parallel.choose_backend(64) == "gloo"


def test_hand_ddp_and_torch_ddp_match_single_process():
    res = parallel.launch(ddp_worker, W, timeout=120)
    assert any(not torch.equal(res[0]["init"][k], res[1]["init"][k]) for k in res[0]["init"]), (
        "the ranks should start from different weights (different seeds) for this test to mean anything"
    )
    oracle = _model(100)  # rank 0's initial weights
    opt = torch.optim.SGD(oracle.parameters(), lr=0.1, momentum=0.9)
    fit(oracle, data.make_loader(_dataset(), W * B, seed=5), opt, epochs=1, progress=False)
    want = oracle.state_dict()
    for r in res:
        for kind in ("hand", "ddp"):
            for k, v in want.items():
                assert torch.allclose(r[kind][k], v, rtol=1e-4, atol=1e-5), (
                    f"{kind} DDP on rank {r['rank']} differs from one process on the concatenated batch "
                    f"in {k}: max diff {(r[kind][k] - v).abs().max():.2e}"
                )


def test_checkpoint_resume_is_exact(tmp_path, monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    cfg = dict(n_train=128, n_val=64, batch_size=32, epochs=3, width=8, evaluate=False)
    full = ddp_train.train(cfg)["state"]
    ck = str(tmp_path / "run.pt")
    with pytest.raises(RuntimeError, match="injected failure"):
        ddp_train.train(cfg, ckpt=ck, fail_at_step=6, fail_rank=0, fail_mode="raise")  # dies in epoch 2
    saved = torch.load(ck, weights_only=True)
    assert saved["epoch"] == 1 and saved["step"] == 4 and saved["sampler_epoch"] == 1, (
        f"the checkpoint should hold the end of epoch 1 (step 4), got epoch {saved['epoch']} step {saved['step']}"
    )
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p], "a temporary file was left next to the checkpoint"
    res = ddp_train.train(cfg, ckpt=ck)
    assert res["start_epoch"] == 1
    for k, v in full.items():
        assert torch.equal(res["state"][k], v), f"resumed weights differ from the uninterrupted run in {k}"


def test_rng_state_roundtrip():
    import random

    import numpy as np

    s = parallel.rng_state()
    a = (torch.rand(3), np.random.rand(3), random.random())
    parallel.set_rng_state(s)
    b = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


def test_alpha_beta_fit_recovers_latency_and_bandwidth():
    n = [1e3, 1e5, 1e7]
    t = [20e-6 + x / 2e9 for x in n]
    alpha, bw = parallel.alpha_beta_fit(n, t)
    assert abs(alpha - 20e-6) < 1e-6 and abs(bw - 2e9) / 2e9 < 1e-3
    assert parallel.ring_allreduce_bytes(100, 4) == 150 and parallel.ring_allreduce_bytes(100, 1) == 0


# ---------------------------------------------------------------------------- lab self-checks

from torch.utils.data import DistributedSampler  # noqa: E402

from utils import checks  # noqa: E402
from utils.checks import CheckFailed  # noqa: E402


def placeholder(*args):
    raise NotImplementedError("Exercise: write this part (see the hint above)")


def ring_without_all_gather(tensor):
    world, rank = dist.get_world_size(), dist.get_rank()
    chunks = list(tensor.view(-1).tensor_split(world))
    for s in range(world - 1):
        send_i, recv_i = (rank - s) % world, (rank - s - 1) % world
        buf = torch.empty_like(chunks[recv_i])
        ops = [
            dist.P2POp(dist.isend, chunks[send_i], (rank + 1) % world),
            dist.P2POp(dist.irecv, buf, (rank - 1) % world),
        ]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        chunks[recv_i] += buf
    return tensor


def average_without_dividing(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)


def shard_right(n, batch_size, rank, world_size, epoch, seed):
    s = DistributedSampler(range(n), num_replicas=world_size, rank=rank, seed=seed)
    s.set_epoch(epoch)
    idx = list(s)
    return [idx[i : i + batch_size] for i in range(0, len(idx), batch_size)]


def shard_without_set_epoch(n, batch_size, rank, world_size, epoch, seed):
    idx = list(DistributedSampler(range(n), num_replicas=world_size, rank=rank, seed=seed))
    return [idx[i : i + batch_size] for i in range(0, len(idx), batch_size)]


def shard_seed_per_rank(n, batch_size, rank, world_size, epoch, seed):
    return shard_right(n, batch_size, rank, world_size, epoch, seed + rank)


def save_right(path, model, optimizer, epoch, rank):
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)


def save_on_every_rank(path, model, optimizer, epoch, rank):
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}, path)


def save_in_place(path, model, optimizer, epoch, rank):
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}, path)


@pytest.mark.parametrize(
    "check",
    [
        checks.check_ring_all_reduce,
        checks.check_average_gradients,
        checks.check_shard_batches,
        checks.check_save_on_rank0,
    ],
)
def test_checks_fail_on_the_placeholder(check):
    with pytest.raises(CheckFailed, match="not implemented"):
        check(placeholder)


def test_ring_check_spots_a_missing_all_gather():
    with pytest.raises(CheckFailed, match="all-gather"):
        checks.check_ring_all_reduce(ring_without_all_gather)


def test_average_check_spots_a_sum_not_divided():
    with pytest.raises(CheckFailed, match="summed, not averaged"):
        checks.check_average_gradients(average_without_dividing)


def test_shard_and_save_checks():
    checks.check_shard_batches(shard_right)
    with pytest.raises(CheckFailed, match="set_epoch"):
        checks.check_shard_batches(shard_without_set_epoch)
    with pytest.raises(CheckFailed, match="SAME seed"):
        checks.check_shard_batches(shard_seed_per_rank)
    checks.check_save_on_rank0(save_right)
    with pytest.raises(CheckFailed, match="a rank other than 0 wrote a file too"):
        checks.check_save_on_rank0(save_on_every_rank)
    with pytest.raises(CheckFailed, match="atomically"):
        checks.check_save_on_rank0(save_in_place)


def killed_worker():
    ctx = parallel.setup()
    if ctx.rank == 1:
        os.kill(os.getpid(), 9)  # a lost node: no Python exception at all
    dist.barrier()


def test_killed_rank_is_named():
    with pytest.raises(parallel.LaunchError, match="rank 1 was killed by signal 9") as err:
        parallel.launch(killed_worker, 2, timeout=60, stream=False)
    assert err.value.rank == 1
    _no_children("a launch with a killed rank")


def test_a_rank_killed_by_a_signal_points_to_its_output_only_when_it_was_shown(tmp_path):
    from types import SimpleNamespace

    from utils.parallel import launcher

    procs = [SimpleNamespace(exitcode=0), SimpleNamespace(exitcode=-9)]  # rank 1 killed, no result file
    shown = str(launcher._failure(procs, str(tmp_path), [1], True))
    hidden = str(launcher._failure(procs, str(tmp_path), [1], False))
    assert "rank 1 was killed by signal 9" in shown and "its output is above" in shown
    assert "rank 1 was killed by signal 9" in hidden and "output" not in hidden


def test_torchrun_meets_on_a_free_port_unless_told_where():
    """Without a rendezvous of its own torchrun meets on port 29500: two students' runs on one server
    collide. parallel.torchrun adds --standalone (a free port) unless the arguments name one."""
    from utils.parallel.launcher import standalone_unless_told as s

    assert s(["--nproc-per-node", 2, "x.py", "--epochs", "3"]) == [
        "--standalone",
        "--nproc-per-node",
        "2",
        "x.py",
        "--epochs",
        "3",
    ]
    assert (
        s(["--nproc-per-node=2", "-m", "utils.ddp_train", "--rdzv-endpoint", "h:1"])[0] == "--standalone"
    )  # the script's own flag
    assert s(["--no-python", "python3", "-c", "pass"])[0] == "--standalone"
    for told in (
        ["--standalone"],
        ["--rdzv-endpoint", "127.0.0.1:29400"],
        ["--rdzv_endpoint=h:1"],
        ["--master-port", "1234"],
    ):
        args = [*told, "--nproc-per-node", "2", "x.py"]
        assert s(args) == args
