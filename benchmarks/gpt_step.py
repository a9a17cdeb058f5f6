"""How fast does the course's GPT train through utils.train.fit, against a minimal hand loop?

The GPT of ``utils.gpt`` (sizes from the profile's ``gpt_*`` rows) takes AdamW steps on byte
windows of the standard library's sources (``data.TokenBatches``, no download). Every run starts
from the same weights, the same batches and a new optimizer; only the loop differs:

* the hand loop: zero_grad, ``_, loss = model(x, y)``, backward, step (notebook 07's loop);
* fit: ``utils.train.fit`` on the same model behind :class:`Logits`, which returns the logits
  alone (fit calls ``model(x)`` and ``loss_fn(out, y)``; the GPT returns ``(logits, loss)``),
  with :func:`lm_loss`, the cross-entropy the GPT computes itself.

Both loops time the whole run of ``--steps`` steps the same way (the set-up is left out), run
interleaved (``benchmarks._common``), and each round's fit / hand-loop ratio is summarised as
median, IQR, min-max and repeat count. ``hand loop (again) / hand loop`` is the control: the
same code against itself, so its distance from 1 is how far this run's medians move by chance.
Each variant's row gives its tokens/s (from its median time) and its MFU: tokens/s times the
model's FLOPs per token (``flops.gpt_flops_per_token``) over the peak that
``bench.matmul_flops_per_s`` measures on the same device and precision (with ``--clock cpu``,
the same multiply in CPU seconds: :func:`peak_flops_per_s`). On a CPU without bf16 instructions
(``device.cpu_bf16_features``) a bf16 multiply is emulated and slow, so the bf16 "peak" is no
peak and the bf16 MFU can pass 100%.

On a GPU the same pair runs under bf16 autocast and with ``torch.compile`` (on top of bf16
where it is on); on a CPU both are off unless asked (``--bf16``, ``--compile``: compiling takes
a minute there). Compiled, the hand loop's graph holds the loss and fit's does not (fit computes
it outside the model). The last line is ``ratio <median of fit / hand loop>``, without bf16
or compile. On a machine other work loads, ``--threads 1 --clock cpu`` times this process's CPU
seconds, so the waits for a core drop out of both sides of the ratio.

    python benchmarks/gpt_step.py [--steps 3] [--repeats 7] [--batch N] [--threads 1 --clock cpu]
                                  [--bf16] [--compile] [--device cpu]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from benchmarks._common import clock_args, cpu_seconds, interleave, machine_note, paired_ratio, quartiles, time_table  # noqa: E402
from utils import bench, config, data, device, flops, gpt, train  # noqa: E402

TEXT_BYTES = 1_000_000  # of the standard library's sources: on every machine, no download


class Logits(nn.Module):
    """The GPT's logits alone, the output ``fit`` hands to its ``loss_fn``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)[0]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of every position: what ``GPT.forward(idx, targets)`` returns as loss."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def hand_loop(model, batches, optimizer, steps, amp_dtype=None):
    """The loop everyone writes first; it keeps each step's loss on the device and returns them."""
    model.train()
    where, losses = next(model.parameters()).device, []
    for _ in range(steps):
        x, y = next(batches)
        with device.autocast(where, amp_dtype):
            _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def fit_loop(model, batches, optimizer, steps, amp_dtype=None):
    """The same steps through ``utils.train.fit``; returns its per-step losses."""
    hist = train.fit(
        Logits(model), batches, optimizer, steps=steps, loss_fn=lm_loss, amp_dtype=amp_dtype, progress=False
    )
    return torch.tensor(hist.step_loss)


def timed(fn, where) -> float:
    device.synchronize(where)
    t0 = time.perf_counter()
    fn()
    device.synchronize(where)
    return time.perf_counter() - t0


def peak_flops_per_s(n: int, where: torch.device, precision: str, clock: str) -> float:
    """The device's peak for MFU, on the runs' clock: ``bench.matmul_flops_per_s`` (the fastest of
    its repeats, elapsed time), or for ``clock="cpu"`` the same ``n x n`` multiply on one thread
    timed in CPU seconds, times the threads torch uses. A busy machine stretches elapsed time, so
    a wall-clock peak against CPU-clock runs would come out low, and the MFU high."""
    if clock == "wall":
        return bench.matmul_flops_per_s(n, device=where, precision=precision)
    a, b = torch.randn(2, n, n, dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seconds = min(cpu_seconds(lambda: torch.mm(a, b)) for _ in range(4))  # the first warms up
    finally:
        torch.set_num_threads(threads)
    return 2 * n**3 / seconds * threads


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="AdamW steps per timed run")
    ap.add_argument("--repeats", type=int, default=7, help="interleaved rounds (the ratio is their median)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default: the profile's gpt_batch)")
    ap.add_argument("--device", default=None, help="cpu, cuda... (default: the first GPU, else the CPU)")
    ap.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time both loops under bf16 autocast (default: on a GPU that supports it)",
    )
    ap.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time both loops on torch.compile(model) (default: on a GPU)",
    )
    clock_args(ap)
    args = ap.parse_args(argv)
    for name in ("steps", "repeats", "batch", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}. Try: leave it out for the default.")
    where = device.get_device(args.device)
    if args.clock == "cpu" and where.type != "cpu":
        ap.error(f"--clock cpu counts CPU seconds, not the work of {where}. Try: --clock wall, or --device cpu.")
    if args.threads:
        torch.set_num_threads(args.threads)
    on_gpu = where.type == "cuda"
    bf16 = on_gpu and device.bf16_supported(where) if args.bf16 is None else args.bf16
    compiled = on_gpu if args.compile is None else args.compile

    cfg = config.profile()
    arch, batch = gpt.config_for(cfg), args.batch if args.batch is not None else cfg.gpt_batch
    tokens = data.load_tokens("stdlib", TEXT_BYTES).train
    net = gpt.GPT(arch, seed=0).to(where)
    init = {k: v.clone() for k, v in net.state_dict().items()}
    models = {None: net, "compiled": torch.compile(net) if compiled else None}  # one set of weights

    def fresh(which=None):
        """(model, batches, optimizer), the same for every run: the weights reset in place."""
        net.load_state_dict(init)
        batches = data.TokenBatches(tokens, batch, arch.context, device=where, seed=0)
        return models[which], batches, torch.optim.AdamW(net.parameters(), lr=cfg.gpt_lr, weight_decay=0.0)

    # name: (loop, model, autocast dtype); every loop on the one set of weights
    runs = {
        "hand loop": (hand_loop, None, None),
        "hand loop (again)": (hand_loop, None, None),
        "fit": (fit_loop, None, None),
    }
    if bf16:
        runs |= {"hand loop bf16": (hand_loop, None, torch.bfloat16), "fit bf16": (fit_loop, None, torch.bfloat16)}
    if compiled:
        cast = torch.bfloat16 if bf16 else None
        runs |= {"hand loop compiled": (hand_loop, "compiled", cast), "fit compiled": (fit_loop, "compiled", cast)}
    clock = cpu_seconds if args.clock == "cpu" else (lambda fn: timed(fn, where))

    def measure(loop, which, amp_dtype):
        def once():  # the set-up is rebuilt every run, off the clock
            parts = fresh(which)
            return clock(lambda: loop(*parts, args.steps, amp_dtype))

        return once

    times = interleave({k: measure(*run) for k, run in runs.items()}, args.repeats)

    fp32 = "tf32" if device.tf32_settings(where)["matmuls_tf32"] else "fp32"
    precision = {k: "bf16" if amp_dtype is not None else fp32 for k, (_, _, amp_dtype) in runs.items()}
    peaks = {p: peak_flops_per_s(cfg.mfu_matmul_n, where, p, args.clock) for p in set(precision.values())}
    per_token, step_tokens = flops.gpt_flops_per_token(arch), batch * arch.context
    rows = {}
    for k, ts in times.items():
        tokens_per_s = args.steps * step_tokens / quartiles(ts)[1]
        mfu = flops.mfu(tokens_per_s, per_token, peaks[precision[k]])
        rows[k] = f"{tokens_per_s:,.0f} tokens/s, MFU {mfu:.2%} ({precision[k]})"

    print(device.hardware_summary().splitlines()[0])
    print(
        f"GPT {arch.layers} layers, width {arch.width}, {arch.heads} heads, context {arch.context} "
        f"({gpt.parameter_count(arch):,} parameters, {per_token:,} FLOPs per token); batch {batch} "
        f"({step_tokens:,} tokens), {args.steps} AdamW steps per run, {args.repeats} interleaved repeats, "
        f"{args.clock} clock, torch threads {torch.get_num_threads()} on {where}; {machine_note()}"
    )
    print(time_table(times, "s", 1.0, extra=rows))
    print(
        f"measured peak ({cfg.mfu_matmul_n}x{cfg.mfu_matmul_n} matmul on {where.type}, {args.clock} clock): "
        + ", ".join(f"{p} {f / 1e9:,.1f} GFLOP/s" for p, f in sorted(peaks.items()))
    )
    control = paired_ratio(times["hand loop (again)"], times["hand loop"])
    print(f"hand loop (again) / hand loop (the control, same code; its distance from 1 is this run's noise): {control}")
    for tag in ("bf16", "compiled"):
        if f"fit {tag}" in times:
            print(f"fit {tag} / hand loop {tag}: {paired_ratio(times[f'fit {tag}'], times[f'hand loop {tag}'])}")
    plain = paired_ratio(times["fit"], times["hand loop"])
    print(f"fit / hand loop: {plain}")
    print(f"ratio {plain.median:.3f}")


if __name__ == "__main__":
    main()
