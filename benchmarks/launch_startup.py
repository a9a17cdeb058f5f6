"""How long does ``utils.parallel.launch`` take to start ranks, run nothing, and collect them?

``launch`` forks its ranks from a fork server that imported torch once; the alternative it falls
back on (where there is no fork server) starts each rank as a fresh interpreter ('spawn'), which
imports torch again. Both run the same do-nothing worker on ``--ranks`` processes, interleaved
(benchmarks._common: one launch of each per round, the order rotating round by round); the
spawn / fork-server ratio of each round is summarised as median, IQR, min-max and repeat count.
The fork server itself starts at the first launch of the process: that launch is left out (a
warm-up round runs before the timed ones).

    python benchmarks/launch_startup.py [--ranks 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from benchmarks._common import interleave, machine_note, paired_ratio, time_table  # noqa: E402
from utils import device, parallel  # noqa: E402
from utils.parallel import launcher  # noqa: E402


def timed_launch(context, ranks: int) -> float:
    """Seconds for one launch of ``ranks`` do-nothing ranks, started from ``context``."""
    chosen = launcher._context
    launcher._context = lambda: context
    try:
        t0 = time.perf_counter()
        results = parallel.launch(os.getenv, ranks, "RANK", stream=False)  # each rank says its RANK
        took = time.perf_counter() - t0
    finally:
        launcher._context = chosen
    assert results == [str(r) for r in range(ranks)], results
    return took


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2, help="processes per launch")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds (the ratio is their median)")
    args = ap.parse_args(argv)
    if "forkserver" not in mp.get_all_start_methods():
        sys.exit("launch_startup: this platform has no fork server, so launch() always spawns; nothing to compare.")

    server, spawn = launcher._context(), mp.get_context("spawn")
    timed_launch(server, args.ranks)  # starts the fork server: not timed
    runs = {"fork server": lambda: timed_launch(server, args.ranks), "spawn": lambda: timed_launch(spawn, args.ranks)}
    times = interleave(runs, args.repeats)

    print(device.hardware_summary().splitlines()[0])
    print(f"launch() of {args.ranks} do-nothing ranks, {args.repeats} interleaved repeats; {machine_note()}")
    print(time_table(times, "s", 1.0))
    ratio = paired_ratio(times["spawn"], times["fork server"])
    print(f"spawn / fork server: {ratio}")
    print(f"ratio {ratio.median:.1f}")


if __name__ == "__main__":
    main()
