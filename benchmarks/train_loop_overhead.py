"""How much does utils.train.fit cost over a minimal hand-written PyTorch loop?

Same model, data, optimizer and number of steps, on the CPU, both timed the same way (wall
clock around the whole call, after a synchronise), interleaved and repeated; medians reported.
The last line is ``ratio <fit time / hand loop time>`` (goal: at most 1.05).

    python benchmarks/train_loop_overhead.py [--steps 200] [--repeats 7] [--batch 64] [--width 32]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from utils import data, device, models, train  # noqa: E402


def hand_loop(model, loader, optimizer, steps):
    """The loop everyone writes first: nothing recorded, nothing checked."""
    model.train()
    done, epoch = 0, 0
    while done < steps:
        loader.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            done += 1
            if done == steps:
                break
        epoch += 1


def timed(fn) -> float:
    device.synchronize("cpu")
    t0 = time.perf_counter()
    fn()
    device.synchronize("cpu")
    return time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--width", type=int, default=32, help="Net hidden channels")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's); 1 gives steadier figures on a shared machine")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    splits = data.load("digits")
    loader = data.make_loader(splits.train, args.batch)

    def fresh():
        """(model, loader, optimizer), the same for every run."""
        torch.manual_seed(0)
        m = models.net_for(splits.shape, args.width)
        return m, loader, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    runs = {
        "hand loop": lambda: hand_loop(*fresh(), args.steps),
        "fit": lambda: train.fit(*fresh(), steps=args.steps, progress=False),
        "fit + progress bar": lambda: train.fit(*fresh(), steps=args.steps),   # fit's default
    }

    for fn in runs.values():       # warm-up: allocator, kernels, first-call costs
        fn()
    times = {k: [] for k in runs}
    for _ in range(args.repeats):  # interleaved, so drift hits all three alike
        for k, fn in runs.items():
            times[k].append(timed(fn))

    print(device.hardware_summary().splitlines()[0])
    print(f"Net({args.width}) on digits, batch {args.batch}, {args.steps} SGD steps, "
          f"{args.repeats} repeats, torch threads {torch.get_num_threads()}")
    print(f"{'loop':<20} {'median s':>9} {'min s':>8} {'max s':>8} {'steps/s':>9}")
    med = {}
    for k, ts in times.items():
        med[k] = statistics.median(ts)
        print(f"{k:<20} {med[k]:>9.3f} {min(ts):>8.3f} {max(ts):>8.3f} {args.steps / med[k]:>9.0f}")
    print(f"ratio with the progress bar (fit's default) {med['fit + progress bar'] / med['hand loop']:.3f}")
    print(f"ratio {med['fit'] / med['hand loop']:.3f}")


if __name__ == "__main__":
    main()
