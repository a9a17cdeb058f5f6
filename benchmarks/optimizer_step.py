"""How much does one LARS step cost over one SGD-with-momentum step?

Two models, chosen for the two ways an optimizer step costs time:

* ``resnet9``: utils.models.ResNet9 (6.6 M parameters in 25 tensors): memory traffic dominates;
* ``mlp50``: a 50-layer MLP of width 64 (100 small tensors, 50 weights and 50 biases):
  per-tensor overhead (Python, kernel launches) dominates.

Every optimizer updates the same parameters with fixed random gradients, with the usual two
groups (weights adapted and decayed, biases and norm parameters excluded), momentum 0.9 and
weight decay 5e-4. The baseline is ``torch.optim.SGD(..., foreach=True)``, PyTorch's
multi-tensor implementation (the default on CUDA; on the CPU PyTorch defaults to a per-tensor
loop, shown as "SGD (default)" for reference). LARS and LARC (utils.optim.LARS, clip=True) are
multi-tensor too.

Variants run interleaved (benchmarks._common): each round times every optimizer over ``number``
steps (utils.bench.time_fn: CUDA events on a GPU, perf_counter after synchronising on the CPU),
the order rotating round by round; per model the LARS/SGD ratio of each round is summarised as
median, IQR, min-max and repeat count. The last line is ``ratio <median>`` for the WORSE of the
two models (the larger median), since the goal (<= 1.2) must hold for both.

On a machine other work loads, ``--threads 1 --clock cpu`` times this process's CPU seconds
instead of elapsed time, so the waits for a core drop out of both sides of the ratio.

    python benchmarks/optimizer_step.py [--device cpu|cuda] [--models resnet9,mlp50] [--repeats 31]
                                        [--threads 1 --clock cpu]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from benchmarks._common import clock_args, cpu_seconds, interleave, machine_note, paired_ratio, time_table  # noqa: E402
from utils import bench, models  # noqa: E402
from utils import device as dev
from utils.optim import LARS, lars_param_groups  # noqa: E402

# mlp50: 50 Linear(64, 64) layers with ReLUs between them, 100 small parameter tensors
MODELS = {"resnet9": lambda: models.ResNet9(width=64), "mlp50": lambda: models.mlp(64, 50)}


def optimizers(model: nn.Module) -> dict:
    groups = lambda: lars_param_groups(model, 5e-4)  # noqa: E731  fresh dicts per optimizer
    return {
        "SGD (foreach)": torch.optim.SGD(groups(), lr=0.1, momentum=0.9, foreach=True),
        "SGD (default)": torch.optim.SGD(groups(), lr=0.1, momentum=0.9),
        "LARS": LARS(groups(), lr=0.1, momentum=0.9, trust_coefficient=0.001),
        "LARC (clip)": LARS(groups(), lr=0.1, momentum=0.9, trust_coefficient=0.001, clip=True),
    }


def measure(name: str, device, repeats: int, min_round_s: float, clock: str = "wall"):
    torch.manual_seed(0)
    model = MODELS[name]().to(device)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-2
    opts = optimizers(model)
    # steps per timed round: enough for about min_round_s of the slowest variant
    one = max(bench.time_fn(o.step, warmup=2, repeats=3, device=device).median for o in opts.values())
    number = max(1, math.ceil(min_round_s / max(one, 1e-7)))

    def timer(opt):
        if clock == "cpu":  # CPU seconds of this process (see --clock)
            return lambda: (opt.step(), cpu_seconds(opt.step, number))[1]
        return lambda: bench.time_fn(opt.step, warmup=1, repeats=1, number=number, device=device).seconds[0]

    times = interleave({k: timer(o) for k, o in opts.items()}, repeats)
    tensors = list(model.parameters())
    print(
        f"\n{name}: {sum(p.numel() for p in tensors):,} parameters in {len(tensors)} tensors, on {device}; "
        f"{repeats} interleaved rounds of {number} steps each, {clock} clock"
    )
    print(time_table(times, "ms"))
    pairs = [
        ("LARS", "SGD (foreach)"),
        ("LARC (clip)", "SGD (foreach)"),
        ("LARS", "SGD (default)"),
        ("SGD (default)", "SGD (foreach)"),
    ]
    ratios = {(a, b): paired_ratio(times[a], times[b]) for a, b in pairs}
    for (a, b), r in ratios.items():
        print(f"  {a} / {b}: {r}")
    return ratios[("LARS", "SGD (foreach)")]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: the best available)")
    ap.add_argument("--models", default="resnet9,mlp50", help=f"comma-separated, from {', '.join(MODELS)}")
    ap.add_argument("--repeats", type=int, default=31, help="interleaved rounds (the ratio is their median)")
    ap.add_argument("--min-round-s", type=float, default=0.1, help="seconds each timed round lasts at least")
    clock_args(ap)
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown or not names:
        ap.error(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = dev.get_device(args.device)
    if args.clock == "cpu" and device.type != "cpu":
        ap.error("--clock cpu times CPU work; on a GPU the wall clock (CUDA events) is the one to use")

    print(dev.hardware_summary().splitlines()[0])
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}; {machine_note()}")
    results = {n: measure(n, device, args.repeats, args.min_round_s, args.clock) for n in names}
    worst = max(results, key=lambda n: results[n].median)
    print("\nLARS / SGD (foreach), median of per-round ratios: " + "; ".join(f"{n} {r}" for n, r in results.items()))
    print(f"final line: the worse model ({worst}); {machine_note()}")
    print(f"ratio {results[worst].median:.3f}")


if __name__ == "__main__":
    main()
