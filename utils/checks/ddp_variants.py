"""Lab 3's reference answers and known-wrong variants, one keyword per mistake: the exercises in
ddp.py compare a student's answer with the reference and replay the variants to name a mistake.
They run on the ranks (the module is imported there), so each is a module-level ``def``."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler


def _ring_oracle(tensor):
    dist.all_reduce(tensor)
    return tensor


def _ring(tensor, *, copies=False, reduce_add=True, gather=True, gather_add=False, gather_shift=0):
    world, rank = dist.get_world_size(), dist.get_rank()
    chunks = tensor.view(-1).tensor_split(world)
    chunks = [c.clone() for c in chunks] if copies else list(chunks)

    def step(send_i, recv_i, add):
        buf = torch.empty_like(chunks[recv_i])
        ops = [
            dist.P2POp(dist.isend, chunks[send_i], (rank + 1) % world),
            dist.P2POp(dist.irecv, buf, (rank - 1) % world),
        ]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        chunks[recv_i].add_(buf) if add else chunks[recv_i].copy_(buf)

    for s in range(world - 1):
        step((rank - s) % world, (rank - s - 1) % world, reduce_add)
    for s in range(world - 1 if gather else 0):
        at = (rank + 1 + gather_shift - s, rank + gather_shift - s)
        step(at[0] % world, at[1] % world, gather_add)
    return tensor


def _ring_blocking(tensor):
    world, rank = dist.get_world_size(), dist.get_rank()
    chunks = tensor.view(-1).tensor_split(world)
    for s in range(2 * (world - 1)):
        buf = torch.empty_like(chunks[(rank - s - 1) % world])
        dist.send(chunks[(rank - s) % world], (rank + 1) % world)  # the mistake under test
        dist.recv(buf, (rank - 1) % world)  # the mistake under test
        chunks[(rank - s - 1) % world].add_(buf)
    return tensor


def _ring_no_wait(tensor):
    world, rank = dist.get_world_size(), dist.get_rank()
    chunks = tensor.view(-1).tensor_split(world)
    for s in range(2 * (world - 1)):
        buf = torch.empty_like(chunks[(rank - s - 1) % world])
        ops = [dist.P2POp(dist.isend, chunks[(rank - s) % world], (rank + 1) % world)]
        dist.batch_isend_irecv(ops + [dist.P2POp(dist.irecv, buf, (rank - 1) % world)])
        chunks[(rank - s - 1) % world].add_(buf) if s < world - 1 else chunks[(rank - s - 1) % world].copy_(buf)
    return tensor


def _ring_out_of_place(tensor):
    return _ring(tensor.clone())


def _ring_copies(tensor):
    return _ring(tensor, copies=True)


def _ring_gather_shifted(tensor):
    return _ring(tensor, gather_shift=1)


def _ring_reduce_copies(tensor):
    return _ring(tensor, reduce_add=False)


def _ring_no_gather(tensor):
    return _ring(tensor, gather=False)


def _ring_gather_adds(tensor):
    return _ring(tensor, gather_add=True)


def _average(model, *, reduce=True, divide=True, by=None):
    for p in model.parameters():
        if reduce:
            dist.all_reduce(p.grad)
        if divide:
            p.grad /= by or dist.get_world_size()


def _average_oracle(model):
    _average(model)


def _average_sums(model):
    _average(model, divide=False)


def _average_nothing(model):
    return None


def _average_unreduced(model):
    _average(model, reduce=False)


def _average_by_two(model):
    _average(model, by=2)


def _average_none(model):
    _average(model)
    list(model.parameters())[-1].grad = None


def _overlap(model, bucket_numel, *, order=reversed, divide=True, clear=True, copy=True, wait=False, hold=False):
    world, params = dist.get_world_size(), [p for p in model.parameters() if p.requires_grad]
    buckets, size = [[]], 0
    for p in order(params):
        if buckets[-1] and size + p.numel() > bucket_numel:
            buckets, size = buckets + [[]], 0
        buckets[-1].append(p)
        size += p.numel()
    bucket_of, ready, pending = {p: i for i, b in enumerate(buckets) for p in b}, [0] * len(buckets), []

    def launch(i):
        flat = torch.cat([q.grad.reshape(-1) for q in buckets[i]])
        pending.append((i, flat, dist.all_reduce(flat, async_op=True)))
        _ = pending[-1][2].wait() if wait else None

    def hook(p):
        ready[bucket_of[p]] += 1
        if hold and sum(ready) == len(params):
            [launch(j) for j in range(len(buckets))]
        elif not hold and ready[bucket_of[p]] == len(buckets[bucket_of[p]]):
            launch(bucket_of[p])

    for p in params:
        p.register_post_accumulate_grad_hook(hook)

    def finish():
        for i, flat, work in pending:
            work.wait()
            flat /= world if divide else 1
            for q, part in zip(buckets[i], flat.split([q.numel() for q in buckets[i]])):
                _ = q.grad.copy_(part.view_as(q.grad)) if copy else None
        if clear:
            pending.clear()
            ready[:] = [0] * len(buckets)

    return finish


def _overlap_oracle(model, bucket_numel=0):
    return _overlap(model, bucket_numel)


def _overlap_no_finish(model, bucket_numel=0):
    _overlap(model, bucket_numel)


def _overlap_silent(model, bucket_numel=0):
    return lambda: None


def _overlap_after_backward(model, bucket_numel=0):
    def finish():
        works = [(p, dist.all_reduce(p.grad, async_op=True)) for p in model.parameters()]
        for p, w in works:
            w.wait()
            p.grad /= dist.get_world_size()

    return finish


def _overlap_blocking(model, bucket_numel=0):
    def hook(p):
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    return lambda: None


def _overlap_waits_in_hook(model, bucket_numel=0):
    return _overlap(model, bucket_numel, wait=True)


def _overlap_holds(model, bucket_numel=0):
    return _overlap(model, bucket_numel, hold=True)


def _overlap_forward(model, bucket_numel=0):
    return _overlap(model, bucket_numel, order=list)


def _overlap_sums(model, bucket_numel=0):
    return _overlap(model, bucket_numel, divide=False)


def _overlap_no_copy(model, bucket_numel=0):
    return _overlap(model, bucket_numel, copy=False)


def _overlap_never_clears(model, bucket_numel=0):
    return _overlap(model, bucket_numel, clear=False)


def _overlap_one_per_param(model, bucket_numel=0):
    return _overlap(model, 0)


def _overlap_none(model, bucket_numel=0):
    finish = _overlap(model, bucket_numel)

    def done():
        finish()
        next(model.parameters()).grad = None

    return done


def _shard(n, batch_size, rank, world, epoch, seed, *, replicas=None, reshuffle=True, drop_last=False, whole=False):
    s = DistributedSampler(range(n), num_replicas=replicas or world, rank=rank, seed=seed, drop_last=drop_last)
    _ = s.set_epoch(epoch) if reshuffle else None
    idx = list(s)
    return [idx] if whole else [idx[i : i + batch_size] for i in range(0, len(idx), batch_size)]


def _shard_global_rng(n, batch_size, rank, world, epoch, seed):
    idx = torch.randperm(n).tolist()[rank::world]
    return [idx[i : i + batch_size] for i in range(0, len(idx), batch_size)]


def _save(path, model, optimizer, epoch, rank, *, every_rank=False, in_place=False, leave_tmp=False, state=None):
    if rank != 0 and not every_rank:
        return
    tmp = path if in_place else f"{path}.tmp"
    torch.save(state or {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}, tmp)
    if leave_tmp:
        torch.save(torch.load(tmp, weights_only=True), tmp + "2")
        tmp += "2"
    _ = os.replace(tmp, path) if tmp != path else None
