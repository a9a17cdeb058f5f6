"""Training throughput of the lecture CNN on CPU and GPU, measured right (utils.bench).

    python benchmarks/throughput.py            # sizes from the profile (gpu on a GPU server)
    python benchmarks/throughput.py --quick    # a minute or less on a laptop CPU

Prints a table (device, model, mode, batch size, dtype, layout, images/s median and IQR),
writes it as JSON with the hardware and versions (atomically) to --out, and ends with one line:
``speedup <GPU/CPU training images/s at batch 64>`` or ``speedup n/a (no GPU)``. That line is
this benchmark's ``ratio`` line under its historical name (kept for the scripts that read it):
the median, over the interleaved rounds, of each round's GPU/CPU ratio; the line before it
gives that ratio's IQR, min-max and number of rounds.

Every configuration is measured once per round, for ``--repeats`` rounds, the order rotating
round by round (benchmarks._common.interleave), so a slow spell of a shared machine hits every
row alike rather than a few rows entirely. The steps per timed repeat are fixed per
configuration by a first calibration call (about ``--min-repeat-s`` seconds).

The model is the lecture's ``Net(width=128)`` (120,078 parameters) on random
3x32x32 images, SGD with momentum, one device-resident batch (no input pipeline). The lecture
measured 5,369 images/s on its GPU against 1,474 on its CPU at batch 64; it pictures an RTX 3080 Ti
but says neither that its demo ran on it nor which optimizer the demo used.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks._common import interleave, machine_note, paired_ratio, quartiles  # noqa: E402
from utils import bench, config, models  # noqa: E402
from utils import device as devices
from utils.files import atomic_write_json  # noqa: E402

LECTURE = {
    "gpu": "not stated (the lecture pictures an RTX 3080 Ti)",
    "rows": [  # docs/REFERENCES.md: (device, batch, images/s)
        ("cpu", 64, 1474),
        ("cuda", 64, 5369),
        ("cpu", 4, 1350),
        ("cuda", 4, 1633),
        ("cpu", 2, 860),
        ("cuda", 2, 937),
    ],
}

COLUMNS = [
    ("device", "device", "{}"),
    ("model", "model", "{}"),
    ("mode", "mode", "{}"),
    ("batch_size", "batch", "{}"),
    ("dtype", "dtype", "{}"),
    ("layout", "layout", "{}"),
    ("images_per_s_median", "images/s (median)", "{:,.0f}"),
    ("images_per_s_iqr", "IQR", "{:,.0f}"),
    ("step_ms", "step ms", "{:.2f}"),
    ("steps_x_repeats", "steps x repeats", "{}"),
]


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def parse_args(argv=None):
    host = socket.gethostname().split(".")[0] or "host"
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="few batch sizes and repeats (under a minute on a CPU)")
    ap.add_argument(
        "--profile",
        default=None,
        help="sizes from this profile (smoke|cpu|gpu); default: LAB_PROFILE, else gpu when CUDA is available, else cpu",
    )
    ap.add_argument("--batch-sizes", type=_ints, default=None, help="e.g. 2,4,64 (64 is always added)")
    ap.add_argument(
        "--width", type=int, default=128, help="Net's hidden channels (128: the lecture's 120,078 parameters)"
    )
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per row (median reported)")
    ap.add_argument(
        "--min-repeat-s",
        type=float,
        default=None,
        help="seconds each timed repeat should last at least (steps are chosen to fit)",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--no-cpu", action="store_true", help="skip the CPU rows (then no speedup line)")
    ap.add_argument(
        "--out",
        type=Path,
        default=ROOT / "runs" / "benchmarks" / f"throughput-{host}.json",
        help="where to write the JSON (default runs/benchmarks/throughput-<host>.json; runs/ is git-ignored)",
    )
    return ap.parse_args(argv)


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def versions() -> dict:
    import numpy

    v = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "commit": _git_commit(),
    }
    try:
        from importlib.metadata import PackageNotFoundError, version

        v["nvidia_ml_py"] = version("nvidia-ml-py")
    except (ImportError, PackageNotFoundError):
        v["nvidia_ml_py"] = None
    return v


def load_average():
    """The 1, 5 and 15 minute load averages (None where the OS has none): CPU figures fall when
    other processes compete for the cores, so the results carry it."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def plan(args, cfg, has_cuda: bool) -> list[dict]:
    """The configurations to measure, as keyword dicts for bench.measure_throughput."""
    if args.batch_sizes:
        batches = args.batch_sizes
    elif args.quick:
        batches = (2, 16, 64)
    else:
        batches = cfg.bench_batch_sizes
    batches = tuple(sorted(set(batches) | {64}))
    runs = []
    for dev in (["cpu"] if not args.no_cpu else []) + (["cuda"] if has_cuda else []):
        for b in batches:
            runs.append(dict(device=dev, batch_size=b, mode="train"))
        runs.append(dict(device=dev, batch_size=64, mode="inference"))
        if dev == "cuda":  # the one-GPU speed-ups, each alone and together
            big = max(batches)
            for b in sorted({64, big}):
                runs.append(dict(device=dev, batch_size=b, mode="train", amp_dtype="bf16"))
                runs.append(dict(device=dev, batch_size=b, mode="train", channels_last=True))
                runs.append(dict(device=dev, batch_size=b, mode="train", amp_dtype="bf16", channels_last=True))
    return runs


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = config.profile(args.profile)
    if args.threads:
        torch.set_num_threads(args.threads)
    has_cuda = torch.cuda.is_available()
    repeats = args.repeats or (3 if args.quick else cfg.bench_repeats)
    warmup = 1 if args.quick else cfg.bench_warmup
    min_repeat_s = args.min_repeat_s if args.min_repeat_s is not None else 0.05 if args.quick else 0.2
    model = models.Net(args.width)
    n_params = models.count_parameters(model)
    print(devices.hardware_summary())
    load_before = load_average()
    print(
        f"model Net(width={args.width}), {n_params:,} parameters; profile {cfg.name}; "
        f"{'quick; ' if args.quick else ''}{repeats} repeats, {warmup} warm-up; load average {load_before}"
    )

    runs = plan(args, cfg, has_cuda)
    first, steps = {}, {}
    for i, run in enumerate(runs):  # calibration: the cold step and the steps per repeat
        t = bench.measure_throughput(
            model, warmup=warmup, repeats=1, min_repeat_s=min_repeat_s, name=f"Net{args.width}", **run
        )
        first[i], steps[i] = t, t.steps

    def one_repeat(i):
        def measure():  # seconds per image of one timed repeat
            t = bench.measure_throughput(model, warmup=1, repeats=1, steps=steps[i], name=f"Net{args.width}", **runs[i])
            return 1.0 / t.images_per_s[0]

        return measure

    spi = interleave(
        {i: one_repeat(i) for i in range(len(runs))},
        repeats,
        warmup_rounds=0,
        progress=lambda k, n: print(f"  round {k}/{n}", flush=True),
    )
    rows = []
    for i, t in first.items():
        ips = [1.0 / s for s in spi[i]]
        q25, q50, q75 = quartiles(ips)
        row = t.row()
        row.update(
            images_per_s=ips,
            images_per_s_median=q50,
            images_per_s_iqr=q75 - q25,
            step_s=t.batch_size / q50,
            step_ms=t.batch_size / q50 * 1e3,
            layout="channels_last" if t.channels_last else "contiguous",
            steps_x_repeats=f"{t.steps} x {len(ips)}",
            device=t.device.split(":")[0],
        )
        rows.append(row)

    print()
    print(bench.format_table(rows, COLUMNS))

    def at64(dev):
        for r in rows:
            if (r["device"], r["mode"], r["batch_size"], r["dtype"], r["channels_last"]) == (
                dev,
                "train",
                64,
                "fp32",
                False,
            ):
                return r
        return None

    cpu_row, gpu_row = at64("cpu"), at64("cuda")
    cpu64 = cpu_row["images_per_s_median"] if cpu_row else None
    gpu64 = gpu_row["images_per_s_median"] if gpu_row else None
    # the GPU/CPU ratio round by round (both measured in the same round), then its median
    ratio = paired_ratio(gpu_row["images_per_s"], cpu_row["images_per_s"]) if cpu_row and gpu_row else None
    speedup = ratio.median if ratio else None
    result = {
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "profile": cfg.name,
        "quick": args.quick,
        "repeats": repeats,
        "warmup": warmup,
        "load_average": {"before": load_before, "after": load_average()},
        "hardware": devices.describe_hardware(),
        "versions": versions(),
        "model": {
            "name": "Net",
            "width": args.width,
            "parameters": n_params,
            "input": [3, 32, 32],
            "optimizer": "SGD momentum 0.9",
            "loss": "cross-entropy",
        },
        "rows": rows,
        "speedup_batch64": speedup,
        "speedup_batch64_rounds": list(ratio.ratios) if ratio else None,
        "lecture_reference": LECTURE,
    }
    atomic_write_json(args.out, result)
    print(f"\nwrote {args.out}")
    if cpu64:
        print(f"CPU batch 64: {cpu64:,.0f} images/s (lecture's CPU: 1,474)")
    if gpu64:
        print(f"GPU batch 64: {gpu64:,.0f} images/s (lecture's GPU: 5,369)")
        best = max(
            (r for r in rows if r["device"] == "cuda" and r["mode"] == "train"), key=lambda r: r["images_per_s_median"]
        )
        print(
            f"best GPU training row: {best['images_per_s_median']:,.0f} images/s at batch {best['batch_size']}, "
            f"{best['dtype']}, {best['layout']}"
        )
    print(f"{machine_note()} (CPU rows are depressed on a busy machine)")
    if ratio:
        print(f"GPU/CPU training images/s at batch 64, per round: {ratio}")
    print(f"speedup {speedup:.2f}" if speedup else "speedup n/a (no GPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
