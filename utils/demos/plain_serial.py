"""Notebook 03's starting point: a plain serial training script, torch only (no helper of the course).

Run it as ``python -m utils.demos.plain_serial``. Its DDP version, ``plain_ddp.py``, differs from
it by a small diff that the notebook prints side by side."""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

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

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    ds = make_data()
    shuffle = torch.Generator()
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=RandomSampler(ds, generator=shuffle))
    model = make_model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    losses = []
    for epoch in range(args.epochs):
        shuffle.manual_seed(SEED + epoch)  # a new order each epoch
        total = 0.0
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            total += loss.item()
        losses.append(total / len(loader))
        print(f"epoch {epoch}: loss {losses[-1]:.4f}")
        torch.save({"model": model.state_dict(), "epoch": epoch, "losses": losses}, args.out)


if __name__ == "__main__":
    main()
