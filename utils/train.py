"""THE training loop of the series, and evaluation.

Every notebook, DDP worker, lab and the assessment solution call :func:`fit`; nothing else in
the series writes a training loop. It takes epochs or steps, a scheduler stepped per
optimizer step, mixed precision, channels_last, gradient accumulation (with DDP's ``no_sync``),
periodic evaluation and small callbacks, and returns a :class:`History`.

Timing: the clock is read only after the device has been synchronised, once at each epoch's
start and end; evaluation is left out of it. The hot loop has no host synchronisation: losses
and correct counts stay on the device and are read once per epoch.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from .data import set_epoch  # the one helper, re-exported here as train.set_epoch
from .device import autocast, synchronize


@dataclass
class History:
    """What a run produced. Per optimizer step: ``step_loss``, ``step_lr``. Per epoch: a dict in
    ``epochs`` (train_loss, train_acc, val_loss, val_acc, time_s, images, images_per_s).
    ``evals``: evaluations every ``eval_every`` steps (step, val_loss, val_acc)."""

    step_loss: list = field(default_factory=list)
    step_lr: list = field(default_factory=list)
    epochs: list = field(default_factory=list)
    evals: list = field(default_factory=list)
    steps: int = 0
    images: int = 0
    train_time: float = 0.0  # seconds spent training (evaluation excluded)
    wall_time: float = 0.0  # seconds from start to end of fit, everything included

    def _steady(self) -> list:
        """The epochs that measure speed: all but the first when there are several. Epoch 0
        pays the warm-up (allocation, cuDNN autotuning, compilation, DataLoader workers)."""
        return self.epochs[1:] if len(self.epochs) > 1 else self.epochs

    @property
    def images_per_s(self) -> float:
        """Training throughput after the warm-up: epochs 1.. (epoch 0 alone if there is one)."""
        ep = self._steady()
        images, seconds = sum(e["images"] for e in ep), sum(e["time_s"] for e in ep)
        if not ep:
            images, seconds = self.images, self.train_time
        return images / seconds if seconds > 0 else float("nan")

    @property
    def warmup_images_per_s(self) -> float:
        """Throughput of epoch 0, the warm-up, reported on its own (nan without epochs)."""
        return self.epochs[0]["images_per_s"] if self.epochs else float("nan")

    @property
    def step_s(self) -> float:
        """Seconds per optimizer step after the warm-up (same epochs as ``images_per_s``)."""
        ep = self._steady()
        first = self.epochs.index(ep[0]) if ep else 0
        steps = (ep[-1]["step"] - (self.epochs[first - 1]["step"] if first > 0 else 0)) if ep else 0
        return sum(e["time_s"] for e in ep) / steps if steps > 0 else float("nan")

    def last(self, key: str, default: Any = None) -> Any:
        """The latest per-epoch value of ``key`` (e.g. ``"val_acc"``)."""
        for e in reversed(self.epochs):
            if e.get(key) is not None:
                return e[key]
        return default

    @property
    def val_acc(self) -> float | None:
        return self.last("val_acc")

    def steps_to(self, target_acc: float) -> int | None:
        """The first step at which a recorded evaluation reached ``target_acc`` (None if never)."""
        for e in self.evals:
            if e["val_acc"] is not None and e["val_acc"] >= target_acc:
                return e["step"]
        return None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["images_per_s"] = self.images_per_s
        d["warmup_images_per_s"] = self.warmup_images_per_s
        d["step_s"] = self.step_s
        return d

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f)

    def __repr__(self):
        acc = self.val_acc
        acc_s = f", val_acc {acc:.3f}" if acc is not None else ""
        return f"History({len(self.epochs)} epochs, {self.steps} steps{acc_s}, {self.images_per_s:,.0f} images/s)"


_NULL = contextlib.nullcontext()  # reusable: entering it does nothing


class Callback:
    """Override any of these; ``state`` has model, optimizer, epoch, step, history, loss (a
    device tensor: reading it is a sync point) and ``stop`` (set True to end the run)."""

    def on_step_end(self, state: SimpleNamespace) -> None:
        pass

    def on_epoch_end(self, state: SimpleNamespace) -> None:
        pass


class StopAtAccuracy(Callback):
    """End the run once a recorded evaluation reaches ``target`` validation accuracy."""

    def __init__(self, target: float):
        self.target = target

    def on_step_end(self, state: SimpleNamespace) -> None:
        ev = state.history.evals
        if ev and ev[-1]["step"] == state.step and (ev[-1]["val_acc"] or 0) >= self.target:
            state.stop = True

    on_epoch_end = on_step_end


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)  # DDP / DataParallel / torch.compile wrappers


def _param_device(model: nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def _to(x, device, channels_last=False):
    if x.device != device:  # a batch already there (DeviceLoader) skips the call
        x = x.to(device, non_blocking=True)
    if channels_last and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    return x


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: Iterable,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    device: torch.device | str | None = None,
    amp_dtype: torch.dtype | None = None,
    channels_last: bool = False,
) -> dict[str, Any]:
    """Mean loss and accuracy of ``model`` over ``loader``: ``{"loss", "acc", "n"}``.

    Runs the unwrapped module (no DDP collectives), in eval mode, restoring the mode after.
    ``acc`` is None when the targets are not class labels (regression)."""
    net = _unwrap(model)
    device = torch.device(device) if device is not None else _param_device(net)
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    was_training = net.training
    net.eval()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device, dtype=torch.long)
    n, classify = 0, True
    try:
        for x, y in loader:
            x, y = _to(x, device, channels_last), _to(y, device)
            with autocast(device, amp_dtype):
                out = net(x)
                loss = loss_fn(out.float(), y)
            loss_sum += loss.detach() * y.shape[0]
            classify = classify and out.dim() == 2 and not y.is_floating_point()
            if classify:
                correct += (out.argmax(1) == y).sum()
            n += y.shape[0]
    finally:
        net.train(was_training)
    if n == 0:
        raise ValueError("evaluate() got an empty loader")
    return {"loss": loss_sum.item() / n, "acc": correct.item() / n if classify else None, "n": n}


class ProgressBar(Callback):
    """A tqdm bar over optimizer steps. tqdm limits its own redraws (``mininterval``), so a step
    costs one ``update()``; the epoch's loss and accuracy go in the postfix."""

    def __init__(self, total: int | None, desc: str = "train"):
        self.bar = tqdm(total=total, desc=desc, leave=True, unit="step", mininterval=0.1)

    def on_step_end(self, state: SimpleNamespace) -> None:
        self.bar.update()

    def on_epoch_end(self, state: SimpleNamespace) -> None:
        rec = state.history.epochs[-1]
        post = {"loss": f"{rec['train_loss']:.3f}"}
        if rec["val_acc"] is not None:
            post["val_acc"] = f"{rec['val_acc']:.3f}"
        self.bar.set_postfix(post)

    def close(self) -> None:
        n, total = self.bar.n, self.bar.total
        if total and n < total:  # stopped early on purpose (a callback): not an error, so the
            self.bar.reset(total=n)  # bar is shortened to what ran rather than left red
            self.bar.update(n)
        self.bar.close()


class _EpochStats:
    """One epoch's training loss and accuracy. Each micro-batch adds device tensors; nothing is
    read on the host until :meth:`close`, once per epoch (the hot loop has no sync point)."""

    def __init__(self):
        self.step_losses = []  # per optimizer step (the mean over its micro-batches)
        self.losses, self.sizes, self.correct = [], [], []  # per micro-batch
        self.seen, self.classify, self._step_loss = 0, True, None

    def add(self, loss, out, y):
        self._step_loss = loss if self._step_loss is None else self._step_loss + loss
        self.losses.append(loss)
        self.sizes.append(y.shape[0])
        self.classify = self.classify and out.dim() == 2 and not y.is_floating_point()
        if self.classify:
            self.correct.append(out.argmax(1) == y)  # argmax has no graph
        self.seen += y.shape[0]

    def end_step(self, grad_accum: int):
        self.step_losses.append(self._step_loss / grad_accum if grad_accum > 1 else self._step_loss)
        self._step_loss = None

    def close(self, device) -> tuple[list, float, float | None]:
        """(loss per step, mean training loss, accuracy or None): the epoch's sync points."""
        if self.seen == 0:
            raise ValueError("the training loader yielded no batches")
        steps = torch.stack(self.step_losses).float().tolist() if self.step_losses else []
        weights = torch.tensor(self.sizes, device=device, dtype=torch.float32)
        loss = (torch.stack(self.losses).float() * weights).sum().item() / self.seen
        acc = torch.cat(self.correct).sum().item() / self.seen if self.classify else None
        return steps, loss, acc


def _check_fit_args(model, epochs, steps, grad_accum, channels_last):
    if epochs is None and steps is None:
        raise ValueError("fit() needs epochs=... or steps=... (or both)")
    if grad_accum < 1:
        raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
    if (
        channels_last
        and hasattr(model, "no_sync")
        and any(p.dim() == 4 and not p.is_contiguous(memory_format=torch.channels_last) for p in model.parameters())
    ):
        raise ValueError(
            "channels_last=True on a model already wrapped in DistributedDataParallel: DDP "
            "built its gradient buckets for the old layout. Convert before wrapping: "
            "utils.parallel.ddp(model, ctx, channels_last=True)"
        )


def _total_steps(train_loader, epochs, steps, grad_accum) -> int | None:
    try:
        per_epoch = len(train_loader) // grad_accum
    except TypeError:  # an iterable without a length
        return steps
    if epochs is None:
        return steps
    return per_epoch * epochs if steps is None else min(steps, per_epoch * epochs)


def fit(
    model: nn.Module,
    train_loader: Iterable,
    optimizer: torch.optim.Optimizer,
    *,
    epochs: int | None = None,
    steps: int | None = None,
    scheduler: Any = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    device: torch.device | str | None = None,
    amp_dtype: torch.dtype | None = None,
    channels_last: bool = False,
    grad_accum: int = 1,
    clip_grad_norm: float | None = None,
    val_loader: Iterable | None = None,
    eval_every: int | None = None,
    callbacks: Iterable[Callback] = (),
    progress: bool = True,
    desc: str = "train",
) -> History:
    """Train ``model`` and return its :class:`History`.

    epochs / steps: stop after this many passes or optimizer steps (give one or both; the
        first reached ends the run).
    scheduler: anything with ``.step()``; stepped after every optimizer step (per iteration).
    amp_dtype: ``torch.bfloat16`` or ``torch.float16`` for autocast (fp16 uses a GradScaler).
    grad_accum: micro-batches per optimizer step; the loss is divided by it. Under DDP the
        gradients are all-reduced only on the last micro-batch (``no_sync`` on the others).
        A window left open at an epoch's end carries on into the next epoch.
    val_loader: evaluated at the end of every epoch and every ``eval_every`` steps.
    """
    _check_fit_args(model, epochs, steps, grad_accum, channels_last)
    device = _param_device(model) if device is None else torch.device(device)
    model.to(device, memory_format=torch.channels_last) if channels_last else model.to(device)
    loss_fn = loss_fn or nn.functional.cross_entropy  # a function: no module-call overhead per step
    scaler = torch.amp.GradScaler("cuda") if amp_dtype == torch.float16 and device.type == "cuda" else None
    bar = ProgressBar(_total_steps(train_loader, epochs, steps, grad_accum), desc) if progress else None
    callbacks = ([bar] if bar else []) + list(callbacks)
    no_sync = getattr(model, "no_sync", None)
    hist = History()
    state = SimpleNamespace(model=model, optimizer=optimizer, epoch=0, step=0, history=hist, loss=None, stop=False)

    def optimizer_step(stats: _EpochStats):
        """One optimizer step from the accumulated gradients, then the scheduler's; counts it."""
        if scaler:
            scaler.unscale_(optimizer)
        if clip_grad_norm is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
        hist.step_lr.append(optimizer.param_groups[0]["lr"])  # the rate this step used
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
        stats.end_step(grad_accum)
        state.step += 1

    def run_eval(epoch: int, record: bool) -> dict:
        r = evaluate(
            model, val_loader, loss_fn=loss_fn, device=device, amp_dtype=amp_dtype, channels_last=channels_last
        )
        if record:
            hist.evals.append({"step": state.step, "epoch": epoch, "val_loss": r["loss"], "val_acc": r["acc"]})
        return r

    def timed_eval() -> float:
        synchronize(device)  # sync point: pause the clock
        tp = time.perf_counter()
        run_eval(state.epoch, record=True)
        return time.perf_counter() - tp

    t_start = time.perf_counter()
    micro = 0
    optimizer.zero_grad(set_to_none=True)
    try:
        while not state.stop and (epochs is None or state.epoch < epochs) and (steps is None or state.step < steps):
            set_epoch(train_loader, state.epoch)
            model.train()
            stats, paused = _EpochStats(), 0.0
            synchronize(device)  # sync point: start the clock
            t0 = time.perf_counter()
            # The hot loop: no host synchronisation, and as little Python per step as we can.
            for x, y in train_loader:
                x, y = _to(x, device, channels_last), _to(y, device)
                micro += 1
                with no_sync() if no_sync and micro < grad_accum else _NULL:
                    with autocast(device, amp_dtype):
                        out = model(x)
                        loss = loss_fn(out, y)
                    scaled = loss / grad_accum if grad_accum > 1 else loss
                    (scaler.scale(scaled) if scaler else scaled).backward()
                state.loss = loss = loss.detach()
                stats.add(loss, out, y)
                if micro < grad_accum:
                    continue
                micro = 0
                optimizer_step(stats)
                if val_loader is not None and eval_every and state.step % eval_every == 0:
                    paused += timed_eval()  # off the clock
                for cb in callbacks:
                    cb.on_step_end(state)
                if state.stop or (steps is not None and state.step >= steps):
                    break
            synchronize(device)  # sync point: stop the clock
            _end_epoch(
                hist,
                stats,
                state,
                device,
                time.perf_counter() - t0 - paused,
                (lambda: run_eval(state.epoch, record=bool(eval_every))) if val_loader is not None else None,
            )
            for cb in callbacks:
                cb.on_epoch_end(state)
            state.epoch += 1
    finally:
        if bar:
            bar.close()
    hist.steps = state.step
    hist.wall_time = time.perf_counter() - t_start
    return hist


def _end_epoch(hist: History, stats: _EpochStats, state, device, elapsed: float, run_eval) -> None:
    """Read the epoch's statistics (its sync points), evaluate unless the last step just did, and
    append the epoch's record to ``hist``."""
    step_losses, train_loss, train_acc = stats.close(device)
    hist.step_loss.extend(step_losses)
    rec = {
        "epoch": state.epoch,
        "step": state.step,
        "train_loss": train_loss,
        "train_acc": train_acc,
        "time_s": elapsed,
        "images": stats.seen,
        "images_per_s": stats.seen / elapsed if elapsed > 0 else float("nan"),
        "val_loss": None,
        "val_acc": None,
    }
    hist.images += stats.seen
    hist.train_time += elapsed
    if run_eval is not None:
        if hist.evals and hist.evals[-1]["step"] == state.step:
            rec["val_loss"], rec["val_acc"] = hist.evals[-1]["val_loss"], hist.evals[-1]["val_acc"]
        else:
            r = run_eval()
            rec["val_loss"], rec["val_acc"] = r["loss"], r["acc"]
    hist.epochs.append(rec)
    hist.steps = state.step
