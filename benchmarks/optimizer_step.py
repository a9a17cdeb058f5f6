"""How much does one LARS step cost over one SGD-with-momentum step?

Both optimizers update the parameters of the ResNet-9-style model (utils.models.ResNet9) with
fixed random gradients; LARS gets the usual two groups (weights adapted, biases and norm
parameters excluded), SGD the same groups, same momentum and weight decay. Steps are timed with
utils.bench.time_fn (CUDA events on a GPU, perf_counter after a synchronise on the CPU),
interleaved and repeated; medians reported. SGD runs with PyTorch's default implementation
(for-each on CUDA, a loop over tensors on the CPU). The last line is
``ratio <LARS step / SGD step>`` (goal: at most 1.5).

    python benchmarks/optimizer_step.py [--device cpu|cuda] [--width 64] [--repeats 15] [--number 5]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from utils import bench, device as dev, models  # noqa: E402
from utils.optim import LARS, lars_param_groups  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cpu, cuda, ... (default: the best available)")
    ap.add_argument("--width", type=int, default=64, help="ResNet9 width (64 = the original)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--number", type=int, default=5, help="steps per timed repeat")
    args = ap.parse_args(argv)
    device = dev.get_device(args.device)

    torch.manual_seed(0)
    model = models.ResNet9(width=args.width).to(device)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-2
    n_params = sum(p.numel() for p in model.parameters())
    optimizers = {
        "SGD (momentum)": torch.optim.SGD(lars_param_groups(model, 5e-4), lr=0.1, momentum=0.9),
        "LARS": LARS(lars_param_groups(model, 5e-4), lr=0.1, momentum=0.9, trust_coefficient=0.001),
        "LARS (LARC clip)": LARS(lars_param_groups(model, 5e-4), lr=0.1, momentum=0.9,
                                 trust_coefficient=0.001, clip=True),
    }
    times = {k: [] for k in optimizers}
    for _ in range(3):                         # interleaved rounds, so drift hits all alike
        for name, opt in optimizers.items():
            t = bench.time_fn(opt.step, warmup=3, repeats=args.repeats, number=args.number, device=device)
            times[name] += t.seconds

    print(dev.hardware_summary().splitlines()[0])
    print(f"ResNet9(width={args.width}): {n_params:,} parameters in {len(list(model.parameters()))} tensors, "
          f"on {device}, torch threads {torch.get_num_threads()}")
    med = {}
    print(f"{'optimizer':<18} {'median ms':>10} {'min ms':>8} {'max ms':>8}")
    for name, ts in times.items():
        ts = sorted(ts)
        med[name] = ts[len(ts) // 2]
        print(f"{name:<18} {1e3 * med[name]:>10.3f} {1e3 * ts[0]:>8.3f} {1e3 * ts[-1]:>8.3f}")
    print(f"ratio {med['LARS'] / med['SGD (momentum)']:.3f}")


if __name__ == "__main__":
    main()
