"""What every benchmark shares: variants run interleaved, and ratios reported as a median with
its spread, so that a noisy (shared, throttled, busy) machine cannot fool one figure.

* :func:`interleave` runs every variant once per round, for ``repeats`` rounds, rotating the
  order each round (A B C, B C A, C A B, ...): a slow spell of the machine, or the first place
  in a round, hits every variant alike.
* :func:`paired_ratio` divides the two variants' times of the same round, then summarises those
  per-round ratios: median, interquartile range, min-max and count. A ratio of two medians
  would let drift between rounds into the figure; a ratio within one round mostly cancels it.
* Every benchmark's last line is ``ratio <median>`` (the median of the per-round ratios).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass

from utils.bench import quartiles  # the one summary of repeats (re-exported for the benchmarks)

__all__ = [
    "interleave",
    "Ratio",
    "paired_ratio",
    "quartiles",
    "time_table",
    "machine_note",
    "cpu_seconds",
    "clock_args",
]


def interleave(
    variants: dict[str, Callable[[], float]],
    repeats: int,
    *,
    warmup_rounds: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, list[float]]:
    """``{name: [seconds, one per round]}``: each callable measures its variant once and returns
    what it measured (seconds, or seconds per step). ``warmup_rounds`` untimed rounds first
    (allocator, caches, first-call costs). The order rotates by one each round."""
    if repeats < 1 or warmup_rounds < 0:
        raise ValueError(f"need repeats >= 1 and warmup_rounds >= 0, got {repeats} and {warmup_rounds}")
    if not variants:
        raise ValueError("no variants to run")
    names = list(variants)
    for _ in range(warmup_rounds):
        for name in names:
            variants[name]()
    times = {name: [] for name in names}
    for i in range(repeats):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            times[name].append(float(variants[name]()))
        if progress is not None:
            progress(i + 1, repeats)
    return times


@dataclass(frozen=True)
class Ratio:
    """Per-round ratios of two variants and their summary."""

    ratios: tuple

    @property
    def n(self) -> int:
        return len(self.ratios)

    @property
    def median(self) -> float:
        return quartiles(self.ratios)[1]

    @property
    def iqr(self) -> tuple[float, float]:
        q25, _, q75 = quartiles(self.ratios)
        return q25, q75

    @property
    def min(self) -> float:
        return min(self.ratios)

    @property
    def max(self) -> float:
        return max(self.ratios)

    def __str__(self):
        (q25, q75) = self.iqr
        return f"{self.median:.3f} (IQR {q25:.3f}-{q75:.3f}, min-max {self.min:.3f}-{self.max:.3f}, {self.n} repeats)"


def paired_ratio(numerator, denominator) -> Ratio:
    """Round by round ``numerator[i] / denominator[i]`` (two lists from :func:`interleave`)."""
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError(f"need two non-empty lists of the same length, got {len(numerator)} and {len(denominator)}")
    if min(denominator) <= 0:
        raise ValueError("a denominator time is <= 0: the timer did not measure anything")
    return Ratio(tuple(a / b for a, b in zip(numerator, denominator)))


def time_table(times: dict[str, list[float]], unit: str = "ms", scale: float = 1e3, extra=None) -> str:
    """A table of each variant's median, IQR and min-max (``scale`` * seconds, in ``unit``);
    ``extra``: {name: text} appended to the row."""
    w = max(12, *(len(k) for k in times))
    lines = [f"{'variant':<{w}} {'median ' + unit:>11} {'IQR ' + unit:>17} {'min-max ' + unit:>17}"]
    for name, ts in times.items():
        q25, q50, q75 = (scale * q for q in quartiles(ts))
        lo, hi = scale * min(ts), scale * max(ts)
        lines.append(
            f"{name:<{w}} {q50:>11.3f} {f'{q25:.3f}-{q75:.3f}':>17} {f'{lo:.3f}-{hi:.3f}':>17}"
            + (f"  {extra[name]}" if extra and name in extra else "")
        )
    return "\n".join(lines)


def machine_note() -> str:
    """The load average against the core count: figures taken on a busy machine are noisier
    (and a ratio of two CPU-bound variants can move when the cores are shared)."""
    cores = os.cpu_count() or 0
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return f"{cores} CPU cores (load average unknown)"
    busy = "  (busy: other work shares the cores)" if cores and load > 0.5 * cores else ""
    return f"load average {load:.2f} on {cores} CPU cores{busy}"


def cpu_seconds(fn: Callable[[], object], number: int = 1) -> float:
    """CPU seconds this process spends per call of ``fn`` (``time.process_time``), for CPU work
    on a shared machine: time the process waits for a core is not counted, so other users'
    load drops out of the figure (their cache traffic does not). Meant for one torch thread
    (``--threads 1``): with more, it adds up every thread's time, spinning included."""
    import time

    t0 = time.process_time()
    for _ in range(number):
        fn()
    return (time.process_time() - t0) / number


def clock_args(ap: argparse.ArgumentParser) -> None:
    """The options every benchmark takes for a shared machine: ``--threads`` (torch's CPU threads;
    the benchmark sets them) and ``--clock`` (``wall``: elapsed time; ``cpu``: :func:`cpu_seconds`)."""
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's); 1 gives steadier figures on a shared machine",
    )
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: elapsed time (CUDA events on a GPU); cpu: this process's CPU time, steadier on a "
        "machine others load (CPU device only, use with --threads 1)",
    )
