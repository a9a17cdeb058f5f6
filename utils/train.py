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
import itertools
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
    ``epochs`` (epoch, step, train_loss, train_acc, val_loss, val_acc, time_s, images, images_per_s).
    ``evals``: evaluations every ``eval_every`` steps (step, epoch, val_loss, val_acc).

    ``epoch`` is the true epoch number (a run resumed with ``fit(start_epoch=k)`` records k, k+1...);
    ``step`` is the number of optimizer steps this ``fit`` call had taken when the record was made."""

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


def _check_fit_args(model, epochs, start_epoch, steps, grad_accum, channels_last):
    if epochs is None and steps is None:
        raise ValueError("fit() needs epochs=... or steps=... (or both)")
    if grad_accum < 1:
        raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
    if start_epoch < 0 or (epochs is not None and start_epoch > epochs):
        raise ValueError(
            f"start_epoch={start_epoch} is not in [0, epochs={epochs}]: epochs is the run's total, "
            "so a run resumed after k epochs passes epochs=the total and start_epoch=k"
        )
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


def _total_steps(train_loader, epochs, start_epoch, steps, grad_accum) -> int | None:
    try:
        per_epoch = len(train_loader) // grad_accum
    except TypeError:  # an iterable without a length
        return steps
    if epochs is None:
        return steps
    left = per_epoch * (epochs - start_epoch)
    return left if steps is None else min(steps, left)


@dataclass(eq=False)
class _Run:
    """What one :func:`fit` call holds between steps, and everything it does outside the hot loop:
    the setup (device, layout, defaults), the optimizer step (fp16 loss scaling, clipping,
    scheduler), evaluation, callbacks and the epoch's record. ``state`` is what callbacks see."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    loss_fn: Callable[..., torch.Tensor] | None
    device: torch.device | str | None
    amp_dtype: torch.dtype | None
    channels_last: bool
    grad_accum: int
    clip_grad_norm: float | None
    val_loader: Iterable | None
    eval_every: int | None
    steps: int | None
    callbacks: list

    def __post_init__(self):
        model, device = self.model, self.device
        self.device = device = _param_device(model) if device is None else torch.device(device)
        model.to(device, memory_format=torch.channels_last) if self.channels_last else model.to(device)
        self.loss_fn = self.loss_fn or nn.functional.cross_entropy  # a function: no module-call overhead per step
        fp16_cuda = self.amp_dtype == torch.float16 and device.type == "cuda"
        self.scaler = torch.amp.GradScaler("cuda") if fp16_cuda else None  # bf16 and the CPU need none
        self.hist = History()
        self.state = SimpleNamespace(
            model=model, optimizer=self.optimizer, epoch=0, step=0, history=self.hist, loss=None, stop=False
        )

    def finished(self) -> bool:
        """A callback asked to stop, or the step budget is spent."""
        return self.state.stop or (self.steps is not None and self.state.step >= self.steps)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's share of the step's loss (scaled under fp16)."""
        if self.grad_accum > 1:
            loss = loss / self.grad_accum
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def optimizer_step(self, stats: _EpochStats) -> None:
        """One optimizer step from the accumulated gradients, then the scheduler's; counts it."""
        if self.scaler:
            self.scaler.unscale_(self.optimizer)  # clipping must see the true gradients
        if self.clip_grad_norm is not None:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad_norm)
        self.hist.step_lr.append(self.optimizer.param_groups[0]["lr"])  # the rate this step used
        if self.scaler:
            self.scaler.step(self.optimizer)  # skipped when the gradients overflowed
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        stats.end_step(self.grad_accum)
        self.state.step += 1

    def evaluate(self, record: bool) -> dict:
        r = evaluate(
            self.model,
            self.val_loader,
            loss_fn=self.loss_fn,
            device=self.device,
            amp_dtype=self.amp_dtype,
            channels_last=self.channels_last,
        )
        if record:
            s = self.state
            self.hist.evals.append({"step": s.step, "epoch": s.epoch, "val_loss": r["loss"], "val_acc": r["acc"]})
        return r

    def end_step(self) -> float:
        """Evaluate when ``eval_every`` steps have passed, then call the callbacks. Returns the
        seconds evaluation took, which the caller takes off the epoch's clock."""
        paused = 0.0
        if self.val_loader is not None and self.eval_every and self.state.step % self.eval_every == 0:
            synchronize(self.device)  # sync point: pause the clock
            t0 = time.perf_counter()
            self.evaluate(record=True)
            paused = time.perf_counter() - t0
        for cb in self.callbacks:
            cb.on_step_end(self.state)
        return paused

    def end_epoch(self, stats: _EpochStats, elapsed: float) -> None:
        """Read the epoch's statistics (its sync points), evaluate unless the last step just did,
        append the epoch's record to the history, then call the callbacks."""
        hist, state = self.hist, self.state
        step_losses, train_loss, train_acc = stats.close(self.device)
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
        if self.val_loader is not None:
            last = hist.evals[-1] if hist.evals and hist.evals[-1]["step"] == state.step else None
            if last is None:
                r = self.evaluate(record=bool(self.eval_every))
                last = {"val_loss": r["loss"], "val_acc": r["acc"]}
            rec["val_loss"], rec["val_acc"] = last["val_loss"], last["val_acc"]
        hist.epochs.append(rec)
        hist.steps = state.step
        for cb in self.callbacks:
            cb.on_epoch_end(state)


def fit(
    model: nn.Module,
    train_loader: Iterable,
    optimizer: torch.optim.Optimizer,
    *,
    epochs: int | None = None,
    start_epoch: int = 0,
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
        first reached ends the run). ``epochs`` is the run's total, counted from epoch 0;
        ``steps`` counts the optimizer steps of this call.
    start_epoch: the first epoch to train. A run resumed from a checkpoint taken after k
        epochs passes ``epochs=<the total>, start_epoch=k`` and trains epochs k..epochs-1. Each
        epoch calls ``set_epoch(train_loader, epoch)`` with its true number, so the resumed run
        shuffles exactly as the uninterrupted one did; ``state.epoch`` and the history's
        ``"epoch"`` fields are true epoch numbers too. Restoring the model, optimizer and
        scheduler is the caller's (``parallel.load_checkpoint``).
    scheduler: anything with ``.step()``; stepped after every optimizer step (per iteration).
    amp_dtype: ``torch.bfloat16`` or ``torch.float16`` for autocast (fp16 uses a GradScaler).
    grad_accum: micro-batches per optimizer step; the loss is divided by it. Under DDP the
        gradients are all-reduced only on the last micro-batch (``no_sync`` on the others).
        A window left open at an epoch's end carries on into the next epoch.
    val_loader: evaluated at the end of every epoch and every ``eval_every`` steps.
    """
    _check_fit_args(model, epochs, start_epoch, steps, grad_accum, channels_last)
    bar = ProgressBar(_total_steps(train_loader, epochs, start_epoch, steps, grad_accum), desc) if progress else None
    run = _Run(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        loss_fn=loss_fn,
        device=device,
        amp_dtype=amp_dtype,
        channels_last=channels_last,
        grad_accum=grad_accum,
        clip_grad_norm=clip_grad_norm,
        val_loader=val_loader,
        eval_every=eval_every,
        steps=steps,
        callbacks=([bar] if bar else []) + list(callbacks),
    )
    state, device, loss_fn = run.state, run.device, run.loss_fn
    no_sync = getattr(model, "no_sync", None)  # DDP's: skip the gradient all-reduce in backward
    t_start = time.perf_counter()
    micro = 0  # micro-batches in the open accumulation window
    optimizer.zero_grad(set_to_none=True)
    try:
        for epoch in range(start_epoch, epochs) if epochs is not None else itertools.count(start_epoch):
            if run.finished():
                break
            state.epoch = epoch
            set_epoch(train_loader, epoch)  # the true epoch number: its shuffle, on every rank
            model.train()
            stats, paused = _EpochStats(), 0.0
            synchronize(device)  # sync point: start the clock
            t0 = time.perf_counter()
            # The hot loop: no host synchronisation, and as little Python per step as we can.
            for x, y in train_loader:
                x, y = _to(x, device, channels_last), _to(y, device)  # non-blocking; none for a DeviceLoader
                micro += 1
                # Under DDP, backward all-reduces the gradients on the window's last micro-batch only.
                with no_sync() if no_sync and micro < grad_accum else _NULL:
                    with autocast(device, amp_dtype):
                        out = model(x)
                        loss = loss_fn(out, y)
                    run.backward(loss)
                state.loss = loss = loss.detach()  # stays on the device: reading it would sync
                stats.add(loss, out, y)
                if micro < grad_accum:
                    continue
                micro = 0
                run.optimizer_step(stats)
                paused += run.end_step()  # periodic evaluation (a sync point, off the clock), then the callbacks
                if run.finished():
                    break
            synchronize(device)  # sync point: stop the clock
            run.end_epoch(stats, time.perf_counter() - t0 - paused)  # sync points: reads the epoch's losses
    finally:
        if bar:
            bar.close()
    run.hist.steps = state.step
    run.hist.wall_time = time.perf_counter() - t_start
    return run.hist
