"""Notebook 07's data-parallel GPT: a few AdamW steps of ``utils.gpt.GPT`` on byte-level text, under
DistributedDataParallel or FSDP2, started by torchrun.

Run it as ``torchrun --standalone --nproc-per-node 2 -m utils.demos.gpt_ddp --strategy ddp --out
losses.json`` (``--strategy fsdp2``: ``fully_shard`` on each block, then on the whole model).
torchrun gives each process RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT.

Every rank draws the same global batch of ``--batch`` sequences from the same seeded generator
and trains on its own slice of the rows, so the ranks together see exactly the batches one
process would draw. Sizes default to the profile's ``gpt_*`` rows (``LAB_PROFILE``). Rank 0
writes the losses (each step's mean over all ranks) and the bytes each rank holds for
parameters, gradients and AdamW's state to the JSON file ``--out``, atomically."""

from __future__ import annotations

import argparse
import dataclasses
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from utils import config, data, gpt
from utils.files import atomic_write_json
from utils.parallel import teardown
from utils.parallel.shard import fully_shard, rank_bytes

STRATEGIES = ("ddp", "fsdp2")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cfg = config.profile()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategy", choices=STRATEGIES, default="ddp")
    p.add_argument("--steps", type=int, default=cfg.gpt_dp_steps, help="AdamW steps")
    p.add_argument("--batch", type=int, default=cfg.gpt_batch, help="sequences per step, all ranks together")
    p.add_argument("--context", type=int, default=cfg.gpt_context, help="tokens per sequence")
    p.add_argument("--width", type=int, default=cfg.gpt_width)
    p.add_argument("--layers", type=int, default=cfg.gpt_layers)
    p.add_argument("--heads", type=int, default=cfg.gpt_heads)
    p.add_argument("--lr", type=float, default=cfg.gpt_lr)
    p.add_argument("--corpus", default=cfg.gpt_corpus)
    p.add_argument("--corpus-bytes", type=int, default=cfg.gpt_corpus_bytes, help="bytes of the corpus (all if unset)")
    p.add_argument("--seed", type=int, default=0, help="the weights' and the batches' seed")
    p.add_argument("--out", required=True, help="JSON file rank 0 writes")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 matmuls: the losses are compared with one process
    torch.backends.cudnn.allow_tf32 = False

    local_rank = int(os.environ["LOCAL_RANK"])  # this process's index on this machine
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"])
    if use_cuda:
        torch.cuda.set_device(local_rank)  # one GPU per process, chosen before the group exists
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if args.batch % world:
        raise SystemExit(
            f"gpt_ddp: --batch {args.batch} does not split over {world} ranks. Try: a multiple of {world}."
        )

    arch = gpt.GPTConfig(context=args.context, width=args.width, layers=args.layers, heads=args.heads)
    model = gpt.GPT(arch, seed=args.seed).to(device)  # the same weights on every rank
    if args.strategy == "ddp":
        model = DDP(model, device_ids=[local_rank] if use_cuda else None)  # a full copy per rank
    else:
        # a mesh of the ranks' own device type (on a CPU, gloo), then one FSDP unit per block and
        # one for what is left (the tables and the final LayerNorm): each rank keeps 1/N of every tensor
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    splits = data.load_tokens(args.corpus, args.corpus_bytes)
    # the global batch, drawn on the CPU with the same seed on every rank; each keeps its rows
    batches = data.TokenBatches(splits.train, args.batch, arch.context, device="cpu", seed=args.seed)
    per = args.batch // world
    mine = slice(rank * per, (rank + 1) * per)
    losses = []
    for _ in range(args.steps):
        x, y = next(batches)
        _, loss = model(x[mine].to(device), y[mine].to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces the gradients; FSDP2 reduce-scatters them, each rank its shard
        opt.step()
        losses.append(loss.detach())

    # every rank's losses and bytes, gathered once after the loop
    mean_losses = torch.stack(losses)
    dist.all_reduce(mean_losses)  # the sum over ranks of equal slices' means ...
    mean_losses /= world  # ... over the ranks: the loss on the whole global batch
    held = rank_bytes(model, opt)  # parameters, gradients (left from the last step) and AdamW's state
    mine_bytes = torch.tensor([held[k] for k in ("params", "grads", "optimizer")], device=device)
    every = [torch.zeros_like(mine_bytes) for _ in range(world)]
    dist.all_gather(every, mine_bytes)
    if rank == 0:  # one writer
        result = {
            "strategy": args.strategy,
            "world_size": world,
            "backend": dist.get_backend(),
            "device": device.type,
            "arch": dataclasses.asdict(arch),
            "batch": args.batch,
            "steps": args.steps,
            "lr": args.lr,
            "seed": args.seed,
            "corpus": args.corpus,
            "corpus_bytes": args.corpus_bytes,
            "losses": mean_losses.tolist(),
            "rank_bytes": [dict(zip(("params", "grads", "optimizer"), b.tolist())) for b in every],
        }
        atomic_write_json(args.out, result)
        for i, v in enumerate(result["losses"]):
            print(f"{args.strategy} step {i}: loss {v:.6f}")
        print("bytes per rank (parameters + gradients + AdamW state):", [sum(b.values()) for b in result["rank_bytes"]])
    # Free the model before leaving the group. DDP's C++ Reducer holds the process group; were it the
    # last holder when main() returns, the group would be destroyed with the GIL held, while gloo's
    # worker thread may still need the GIL to free the last collective's tensors: both would wait for good.
    del model, opt
    dist.barrier()  # every rank is done before any leaves
    teardown()  # destroy_process_group, given up after a bounded wait: gloo can wait for good on a peer's goodbye


if __name__ == "__main__":
    main()
