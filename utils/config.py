"""Profiles: every size a notebook uses, in ONE table.

A notebook never asks "am I in CI?"; it asks the profile::

    cfg = utils.config.profile()        # LAB_PROFILE, else gpu when CUDA is available, else cpu
    cfg.dataset, cfg.n_train, cfg.epochs, cfg.batch_size

``smoke`` is for CI (2 CPU cores, seconds per notebook), ``cpu`` for a laptop (minutes),
``gpu`` for a GPU server (the real experiment).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, KeysView
from types import MappingProxyType

PROFILE_NAMES = ("smoke", "cpu", "gpu")

# Each row: key -> (smoke, cpu, gpu). Units in the comments. Stages own the rows under their
# heading; add a row rather than a literal in a notebook.
# fmt: off  (the table keeps its columns: one row per size, units in the comments)
TABLE: dict[str, tuple] = {
    # --- common (00_environment, the training loop) ---
    "dataset": ("digits", "fashion_mnist", "cifar10"),  # default dataset of the stage notebooks
    "n_train": (1400, 5_000, 50_000),  # training images (None = all)
    "n_val": (397, 1_000, 10_000),  # held-out images
    "epochs": (6, 3, 10),  # passes over n_train
    "batch_size": (64, 64, 256),  # images per optimizer step
    "lr": (2e-3, 1e-3, 1e-3),  # Adam learning rate for the default runs
    "cnn_width": (32, 32, 128),  # the lecture CNN's width (Net's first-convolution channels)
    "num_workers": (0, 2, 4),  # DataLoader workers
    "loader": ("device", "device", "device"),  # "device" (resident) or "dataloader"
    # --- 00_environment: the bundled digits in every profile (no download; under a minute) ---
    "env_n_train": (1400, 1400, 1400),  # digits training images (1,797 - env_n_val at most)
    "env_n_val": (397, 397, 397),  # digits held out
    "env_epochs": (6, 8, 10),  # passes over env_n_train
    "env_batch_size": (64, 64, 64),  # images per step (digits: 22 steps per epoch)
    # --- stage 1: gradient descent vs SGD, batch size ---
    "gd_n_points": (256, 1024, 4096),  # synthetic linear-regression points
    "gd_steps": (60, 200, 400),  # optimizer steps on the loss surface
    "gd_lr": (0.1, 0.1, 0.1),  # learning rate on the loss surface
    "gd_batch_size": (16, 16, 32),  # the minibatch drawn beside GD and SGD (B=1)
    "var_batch_sizes": (
        (1, 2, 4, 8, 16, 32, 64, 128),
        (1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
        (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
    ),  # gradient-variance sweep
    "var_draws": (200, 500, 2000),  # minibatches drawn per batch size
    "sgd_dataset": ("digits", "fashion_mnist", "fashion_mnist"),
    "sgd_batch_sizes": ((8, 32, 128, 512), (16, 64, 256, 1024), (16, 64, 256, 1024, 4096)),  # fixed epochs
    "sgd_epochs": (1, 2, 10),  # fixed epoch budget of the sweep
    "sgd_turn_rounds": (5, 7, 7),  # rounds timing the smallest and the fastest batch in turns
    "sgd_turn_images": (2048, 4096, 32768),  # images each batch size trains on per round
    "sgd_target_batch_sizes": (
        (4, 16, 64, 256),
        (8, 32, 128, 512),
        (8, 32, 128, 512, 2048, 8192),
    ),  # steps-to-target sweep
    "sgd_target_acc": (0.85, 0.80, 0.87),  # validation accuracy that ends a run
    "sgd_max_steps": (500, 1500, 20_000),  # cap on steps-to-target
    "sgd_eval_images": (32, 1024, 1024),  # evaluate every ~this many images (>= every step)
    "sgd_base_lr": (0.02, 0.01, 0.01),  # SGD (momentum 0.9) rate at sgd_base_batch
    "sgd_base_batch": (8, 16, 16),  # batch the base rate was tuned for (images)
    "sgd_max_lr": (0.05, 0.1, 0.1),  # ceiling on the linearly scaled rate of the fixed-epoch sweep
    "sgd_lr_grid": (
        (0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32),
        (0.00125, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32),
        (0.00125, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64),
    ),  # SGD (momentum 0.9) rates, a factor 2 apart, that the steps-to-target tuning walks
    "sgd_momentum": (0.9, 0.9, 0.9),
    "noise_b_small": (8, 16, 32),  # two-batch estimator: small batch (images)
    "noise_b_big": (512, 1024, 4096),  # two-batch estimator: big batch (images)
    "noise_draws": (20, 30, 50),  # (small, big) pairs averaged
    "noise_run_fractions": (
        (0, 0.25, 0.5, 1.0),
        (0, 0.25, 0.5, 1.0),
        (0, 0.25, 0.5, 1.0),
    ),  # where B_simple is measured along the smallest batch's run to target (fractions of its steps)
    # --- stage 2: CPU vs GPU throughput ---
    "bench_batch_sizes": ((2, 4, 64), (2, 4, 16, 64, 256), (2, 4, 16, 64, 256, 1024)),
    "bench_cnn_widths": (
        (16, 128),
        (16, 128),
        (32, 128, 512),
    ),  # the CNN widths swept (Net's first-convolution channels)
    "bench_repeats": (3, 5, 20),  # timed repeats (median reported)
    "bench_warmup": (1, 3, 10),  # untimed warm-up steps
    "bench_steps": (3, 10, 30),  # steps per timed repeat
    "bench_min_repeat_s": (0.02, 0.1, 0.2),  # seconds a timed repeat lasts at least
    "bench_compile": (False, False, True),  # try torch.compile (slow to compile on a CPU)
    "bench_gpu_variant_batch": (1024, 1024, 1024),  # fp32/bf16/channels_last compared on a GPU: busy, not launch-bound
    "mem_batch_sizes": ((16, 64, 256), (16, 64, 256, 1024), (64, 256, 1024, 4096)),  # memory predicted
    "pipeline_workers": ((0, 2, 4), (0, 2, 4), (0, 2, 4)),  # DataLoader workers compared
    "pipeline_epochs": (1, 1, 2),  # epochs per input-pipeline run
    "pipeline_n_train": (640, 2_000, 10_000),  # training images per input-pipeline run
    "pipeline_item_cost_s": (2e-3, 2e-3, 5e-4),  # host work per image (decode + augment), seconds
    # (smoke, cpu: 128 ms per batch, far above a busy 2-core box's hiccups)
    "monitor_interval": (0.05, 0.1, 0.1),  # seconds between GPU samples
    # --- stage 3: data parallelism ---
    "ddp_nprocs": (2, 2, 0),  # processes (0 = one per GPU)
    "ddp_epochs": (4, 3, 5),  # epochs of the utils.ddp_train runs
    "ddp_batch_size": (32, 64, 256),  # per process
    "ddp_n_train": (512, 4096, 49152),  # images; divisible by max(nprocs) * batch
    "ddp_n_val": (256, 1000, 10000),
    "ddp_cnn_width": (16, 32, 128),  # the CNN's width in the DDP runs
    "ddp_lr": (0.1, 0.05, 0.05),  # SGD peak rate (cosine schedule)
    "ddp_scaling_nprocs": ((1, 2), (1, 2, 4), (1, 2, 4, 8)),  # process counts timed
    "ddp_message_sizes": (
        (1 << 10, 1 << 14, 1 << 20),
        (1 << 10, 1 << 14, 1 << 18, 1 << 21),
        (1 << 10, 1 << 14, 1 << 18, 1 << 22, 1 << 26),
    ),  # float32 elements
    "ddp_timing_repeats": (10, 10, 20),  # timed repeats per collective (fastest kept)
    "ddp_mlp_width": (512, 1024, 4096),  # MLP of the bucket / overlap demo
    "ddp_bucket_caps_mb": ((0.5, 1, 25), (0.5, 1, 25), (1, 5, 25, 100)),  # DDP bucket_cap_mb tried
    "ddp_collective_timeout": (3, 5, 10),  # seconds a collective waits in the hang demo
    # --- stage 4: large-batch training ---
    "lb_dataset": ("digits", "fashion_mnist", "cifar10"),
    "lb_batch_sizes": ((16, 128, 1024), (32, 256, 1024), (64, 512, 2048, 8192)),  # sweep (images/step)
    "lb_base_batch": (16, 32, 64),  # batch the base rate was tuned for
    "lb_base_lr": (0.05, 0.05, 0.05),  # SGD rate at lb_base_batch (momentum 0.9)
    "lb_epochs": (6, 8, 16),  # fixed epoch budget of every sweep run
    "lb_warmup_epochs": (2, 2, 3),  # gradual warmup length (epochs)
    "lb_mlp_width": (128, 256, 1024),  # width of the sweep's MLP (BatchNorm, 2 hidden layers)
    "lb_weight_decay": (5e-4, 5e-4, 5e-4),  # on weights only (biases, norms excluded)
    "lb_trust_coefficient": (0.02, 0.02, 0.02),  # LARS eta (the paper's 0.001 goes with lr ~ 10)
    "lb_diverge_factor": (2.0, 3.0, 2.0),  # x the linear rate in the no-warmup demo
    "lb_ghost_batch": (16, 32, 64),  # virtual batch of ghost batch norm (images)
    "lb_resnet_width": (4, 16, 64),  # ResNet9 width of the ghost-BN experiment
    "lb_smith_batch": (32, 64, 256),  # first batch of the grow-the-batch run
    "lb_smith_factor": (4, 4, 5),  # batch x this (or lr / this) at each third
    # --- stage 5: memory and model parallelism (05_memory_and_model_parallel, lab5) ---
    "mem_width": (128, 256, 1024),  # block MLP width of the memory budget
    "mem_depth": (4, 8, 16),  # blocks (Linear-GELU-Linear, 4x expansion)
    "mem_batch": (128, 512, 2048),  # rows per step of the budget
    "act_ckpt_width": (64, 128, 1024),  # activation checkpointing sweep: block MLP width
    "act_ckpt_depth": (8, 16, 16),  # blocks; segments cut these
    "act_ckpt_batch": (256, 1024, 8192),  # rows: activations dominate the parameters
    "act_ckpt_segments": ((1, 2, 4, 8), (1, 2, 4, 8, 16), (1, 2, 4, 8, 16)),  # blocks per activation checkpoint
    "act_ckpt_repeats": (3, 3, 10),  # timed steps per segment size (median)
    "shard_nprocs": ((1, 2, 4), (1, 2, 4), (1, 2, 4)),  # ranks compared under DDP, ZeRO-1, FSDP2
    "shard_width": (64, 128, 1024),  # model of the sharding runs
    "shard_depth": (3, 3, 6),  # blocks (odd: ZeRO-1's whole-parameter split shows)
    "shard_batch": (32, 64, 256),  # global rows per step; divisible by the ranks
    "shard_steps": (4, 6, 10),  # Adam steps per strategy (checkpoint after half)
    "tp_width": (32, 256, 1024),  # d of the tensor-parallel MLP (hidden 4d)
    "tp_batch": (8, 64, 1024),  # rows (every rank sees all of them)
    "pp_width": (256, 512, 1024),  # pipeline: block MLP width (compute >> send)
    "pp_depth": (4, 8, 8),  # blocks, split evenly over 2 stages
    "pp_batch": (512, 1024, 4096),  # rows per step; divisible by every m
    "pp_micro_batches": ((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8, 16, 32)),  # m swept
    "pp_repeats": (2, 2, 5),  # hand GPipe steps per m
    # --- stage 6: clusters and profiling (06_clusters_and_profiling) ---
    "prof_batch_size": (64, 64, 256),  # images per profiled step
    "prof_item_cost_s": (2e-3, 1e-3, 2e-4),  # host work per image of the slow input pipeline (s)
    "prof_steps": ((1, 1, 3), (1, 2, 5), (2, 3, 10)),  # profiler schedule: (wait, warmup, active) steps
    "prof_ddp_width": (512, 1024, 4096),  # MLP layer width of the DDP trace (1 MiB grads at 512)
    "prof_ddp_depth": (4, 4, 6),  # MLP layers (one bucket each with small buckets)
    "prof_bucket_caps_mb": ((0.25, 100), (1, 100), (25, 1000)),  # small vs one-bucket DDP caps (MB)
    "rdzv_timeout_s": (2, 5, 10),  # seconds the failure demos wait before giving up
    # --- stage 5: assessment: its sizes live in the spec files (labs/assessment/spec_*.toml) ---
    # --- lab 6: profiling a run with planted bottlenecks (solutions/lab6_profiling) ---
    "lab6_n_train": (1400, 5_000, 50_000),  # training images; the planted standardisation reads all of them every step
    "lab6_batch_size": (64, 64, 256),  # images per step
    "lab6_width": (64, 256, 1024),  # MLP width (models.mlp)
    "lab6_depth": (3, 3, 3),  # MLP Linear layers
    "lab6_lr": (0.05, 0.05, 0.05),  # SGD (momentum 0.9) learning rate
    "lab6_item_cost_s": (1e-4, 1e-4, 2e-5),  # planted host work per image read (s): 6.4 ms per batch of 64
    "lab6_prof_steps": ((1, 1, 4), (1, 2, 5), (2, 3, 10)),  # profiler schedule: (wait, warmup, active) steps
    "lab6_timing_steps": (8, 8, 30),  # optimizer steps per timed run
    "lab6_timing_repeats": (5, 5, 10),  # timed rounds per variant, interleaved (median and quartiles)
    # --- notebook 04_large_batch: sharp minima (Keskar et al.) ---
    "lb_sharp_max_epochs": (200, 200, 400),  # cap on the large-batch run that trains to the small one's loss
    "lb_sharp_rel": (0.1, 0.1, 0.1),  # perturbation size, relative to each parameter tensor's norm
    "lb_sharp_draws": (20, 20, 20),  # random perturbations averaged
    # --- 02_cpu_vs_gpu: MFU and the first kernel ---
    "mfu_matmul_n": (512, 1024, 8192),  # side of the matmul timed as a measured peak (CPU, unknown GPU)
    "kernel_n": (1_000_003, 1_000_003, 50_000_003),  # vector-add elements (odd: a partial last block)
    # --- the transformer track: utils.gpt on byte-level text (utils.data.load_tokens) ---
    "gpt_corpus": ("stdlib", "shakespeare", "shakespeare"),  # text: the Python stdlib's sources, or Tiny Shakespeare
    "gpt_corpus_bytes": (200_000, None, None),  # bytes of the corpus used (None = all of it)
    "gpt_context": (64, 128, 1024),  # tokens (bytes) per sequence; the position table's rows
    "gpt_width": (64, 256, 768),  # d_model
    "gpt_layers": (2, 4, 12),  # transformer blocks
    "gpt_heads": (4, 4, 12),  # attention heads (head width 16, 64, 64)
    "gpt_batch": (8, 16, 32),  # sequences per optimizer step (x gpt_context tokens)
    # --- notebook 07_scaling_a_transformer ---
    "gpt_train_steps": (60, 30, 100),  # AdamW steps of the first training run
    "gpt_lr": (3e-3, 3e-3, 3e-4),  # AdamW learning rate (constant, no weight decay)
    "gpt_eval_batches": (4, 4, 8),  # held-out batches (gpt_batch x gpt_context tokens each) for the validation loss
    "gpt_sample_bytes": (200, 200, 300),  # bytes the trained model writes after a prompt
    "gpt_timing_warmup": (2, 1, 3),  # untimed training steps before the timed ones
    "gpt_timing_repeats": (5, 3, 10),  # timed training steps (median)
    "gpt_compile": (False, True, True),  # also time a torch.compile'd step (compiling takes about a minute on a CPU)
    "gpt_mem_batch": (4, 4, 8),  # sequences per batch in the memory measurements
    "gpt_mem_seq_lens": ((16, 32, 64), (32, 64, 128), (256, 512, 1024)),  # tokens; the last is gpt_context
    "gpt_pp_micro_batches": (4, 4, 8),  # micro-batches of the GPT's pipeline step (each divides gpt_batch)
    "gpt_dp_steps": (4, 4, 10),  # AdamW steps of the 2-rank DDP and FSDP2 runs (utils.demos.gpt_ddp) and of one process
}
# fmt: on


class UnknownProfileError(ValueError):
    pass


class Profile:
    """Read-only view of one column of TABLE: ``cfg.epochs`` or ``cfg["epochs"]``."""

    def __init__(self, name: str, values: dict):
        self.name = name
        self._values = MappingProxyType(dict(values))

    def __getattr__(self, key):
        if key.startswith("_"):
            raise AttributeError(key)
        return self[key]

    def __getitem__(self, key):
        try:
            return self._values[key]
        except KeyError:
            raise KeyError(
                f"profile {self.name!r} has no size {key!r}; add a row to utils/config.py TABLE "
                f"(known: {', '.join(sorted(self._values))})"
            ) from None

    def __contains__(self, key):
        return key in self._values

    def keys(self) -> KeysView[str]:
        return self._values.keys()

    def as_dict(self) -> dict:
        return dict(self._values)

    def summary(self, keys: Iterable[str] | None = None) -> str:
        keys = list(keys) if keys is not None else list(self._values)
        width = max(len(k) for k in keys)
        lines = [f"profile: {self.name}  (set LAB_PROFILE to one of {', '.join(PROFILE_NAMES)})"]
        lines += [f"  {k:<{width}}  {self._values[k]}" for k in keys]
        return "\n".join(lines)

    def __repr__(self):
        return f"Profile({self.name!r})"


def default_profile_name() -> str:
    """LAB_PROFILE if set, else gpu when CUDA is available, else cpu."""
    name = os.environ.get("LAB_PROFILE", "").strip().lower()
    if name:
        return name
    try:
        import torch

        return "gpu" if torch.cuda.is_available() else "cpu"
    except ImportError:  # pragma: no cover - torch is a dependency
        return "cpu"


def profile(name: str | None = None, **overrides) -> Profile:
    """The sizes for a profile (default: :func:`default_profile_name`).

    ``overrides`` replace single entries (``profile(epochs=1)``); unknown keys are errors.
    """
    name = (name or default_profile_name()).strip().lower()
    if name not in PROFILE_NAMES:
        raise UnknownProfileError(
            f"unknown profile {name!r}: valid profiles are {', '.join(PROFILE_NAMES)} (set LAB_PROFILE=smoke|cpu|gpu)"
        )
    col = PROFILE_NAMES.index(name)
    values = {k: v[col] for k, v in TABLE.items()}
    for k, v in overrides.items():
        if k not in values:
            raise KeyError(f"unknown size {k!r}; known: {', '.join(sorted(values))}")
        values[k] = v
    return Profile(name, values)


def _check_table():
    for k, v in TABLE.items():
        if not isinstance(v, tuple) or len(v) != len(PROFILE_NAMES):
            raise ValueError(f"TABLE[{k!r}] must be a tuple of {len(PROFILE_NAMES)} values")


_check_table()
