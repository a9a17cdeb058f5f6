"""How much does utils.train.fit cost over a minimal hand-written PyTorch loop?

Same model, data, optimizer and number of steps, on the CPU, all timed the same way (wall
clock around the whole call, after a synchronise). The variants run interleaved
(benchmarks._common: one run of each per round, the order rotating round by round), and the
fit / hand-loop ratio of each round is summarised as median, IQR, min-max and repeat count.
The last line is ``ratio <median of fit / hand loop>`` (fit without the progress bar; goal:
at most 1.02); the line before it gives the same for fit's default, with the bar. The hand loop
also runs twice per round, as a control: ``hand loop (again) / hand loop`` compares the same code
with itself, so how far its median lies from 1 is how far this run's medians move by chance (0.970
in one 41-round run on an idle 2-core machine): a fit ratio closer to 1 than that is not resolved
by this run.

On a machine other work loads, ``--threads 1 --clock cpu`` times this process's CPU seconds
instead of elapsed time, so the waits for a core drop out of both sides of the ratio.

    python benchmarks/train_loop_overhead.py [--steps 200] [--repeats 15] [--batch 64] [--width 32]
                                             [--threads 1 --clock cpu]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from benchmarks._common import clock_args, cpu_seconds, interleave, machine_note, paired_ratio, time_table  # noqa: E402
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
    ap.add_argument("--steps", type=int, default=200, help="training steps per timed run")
    ap.add_argument("--repeats", type=int, default=15, help="interleaved rounds (the ratio is their median)")
    ap.add_argument("--batch", type=int, default=64, help="images per step")
    ap.add_argument("--width", type=int, default=32, help="Net hidden channels")
    clock_args(ap)
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
        "hand loop (again)": lambda: hand_loop(*fresh(), args.steps),  # the control: same code
        "fit": lambda: train.fit(*fresh(), steps=args.steps, progress=False),
        "fit + progress bar": lambda: train.fit(*fresh(), steps=args.steps),  # fit's default
    }
    clock = cpu_seconds if args.clock == "cpu" else timed
    times = interleave({k: (lambda fn=fn: clock(fn)) for k, fn in runs.items()}, args.repeats)

    print(device.hardware_summary().splitlines()[0])
    print(
        f"Net({args.width}) on digits, batch {args.batch}, {args.steps} SGD steps, "
        f"{args.repeats} interleaved repeats, {args.clock} clock, torch threads {torch.get_num_threads()}; "
        f"{machine_note()}"
    )
    print(
        time_table(times, "s", 1.0, extra={k: f"{args.steps / min(ts):,.0f} steps/s (best)" for k, ts in times.items()})
    )
    bar = paired_ratio(times["fit + progress bar"], times["hand loop"])
    plain = paired_ratio(times["fit"], times["hand loop"])
    control = paired_ratio(times["hand loop (again)"], times["hand loop"])
    print(f"hand loop (again) / hand loop (the control, same code; its distance from 1 is this run's noise): {control}")
    print(f"fit + progress bar / hand loop (fit's default): {bar}")
    print(f"fit / hand loop: {plain}")
    print(f"ratio {plain.median:.3f}")


if __name__ == "__main__":
    main()
