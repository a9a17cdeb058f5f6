"""Notebook 03's plain DDP script: ``plain_serial.py`` plus a small diff, torch only (no helper of the course).

Run it as ``torchrun --standalone --nproc-per-node 2 -m utils.demos.plain_ddp``. torchrun starts
the processes and gives each RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT."""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

SEED = 0


def make_data(n: int = 1024) -> TensorDataset:
    """A synthetic task: 16 features, 4 classes given by a fixed random linear teacher."""
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(n, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


def make_model() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)  # images per optimizer step, all ranks together
    parser.add_argument("--out", default="checkpoint.pt")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])  # torchrun sets it: this process's index on this machine
    use_cuda = torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"])  # one GPU per process
    if use_cuda:
        torch.cuda.set_device(local_rank)  # this process's GPU, before the group exists
    dist.init_process_group("nccl" if use_cuda else "gloo")  # rank, world size, address: from the environment
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")

    ds = make_data()
    sampler = DistributedSampler(ds, seed=SEED)  # this rank's shard; the same seed on every rank
    loader = DataLoader(ds, batch_size=args.batch_size // world, sampler=sampler)
    model = make_model().to(device)
    model = DDP(model, device_ids=[local_rank] if use_cuda else None)  # copies rank 0's weights to all
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    losses = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new order each epoch
        total = 0.0
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()  # DDP averages the gradients over the ranks here
            opt.step()
            total += loss.item()
        losses.append(total / len(loader))  # this rank's shard only
        if rank == 0:  # one writer
            print(f"epoch {epoch}: loss {losses[-1]:.4f}")
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "losses": losses}, args.out)

    dist.barrier()  # every rank is done before any leaves
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
