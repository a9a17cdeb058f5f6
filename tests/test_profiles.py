"""Every profile's sizes, tested like code: for smoke, cpu and gpu, every dataset split, loader,
model and worker configuration that notebooks/, solutions/, utils/ddp_train.py and the grader's
spec files ask for is built, and one step of each is run.

No download: digits is bundled; Fashion-MNIST and CIFAR-10 are replaced by splits of the real
image shape and the requested length whose images are one stand-in image broadcast (no memory),
behind the real ``data.load`` (so its size check is the one under test).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from utils import config, data, ddp_train, models

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "solutions").glob("*.ipynb"))
SPECS = sorted((ROOT / "labs" / "assessment").glob("spec_*.toml"))
# The real datasets' image shapes and sizes (train, held out), from their documentation:
# Fashion-MNIST 60,000 + 10,000 28x28 grey; CIFAR-10 50,000 + 10,000 32x32 RGB; sklearn digits 1,797 8x8.
SHAPE = {"digits": (1, 8, 8), "fashion_mnist": (1, 28, 28), "cifar10": (3, 32, 32)}
TOTAL = {"digits": 1797, "fashion_mnist": 70_000, "cifar10": 60_000}
HELD_OUT = {"fashion_mnist": 10_000, "cifar10": 10_000}
TRAIN = {"fashion_mnist": 60_000, "cifar10": 50_000}


def _broadcast_loader(name):
    """A loader of the real shape and the requested length (one stand-in image, broadcast)."""

    def load(n_train=None, n_val=None, seed=0, **kw):
        img, _ = data.standin_images(10, SHAPE[name], seed=seed)
        one = torch.as_tensor(img[:1], dtype=torch.float32) / 255

        def split(n):
            return TensorDataset(one.expand(n, *SHAPE[name]), torch.arange(n) % data.NUM_CLASSES)

        return data.Splits(split(n_train or TRAIN[name]), split(n_val or HELD_OUT[name]), name)

    return load


@pytest.fixture(autouse=True)
def no_download(monkeypatch):
    monkeypatch.setitem(data.DATASETS, "fashion_mnist", _broadcast_loader("fashion_mnist"))
    monkeypatch.setitem(data.DATASETS, "cifar10", _broadcast_loader("cifar10"))


def _step(model, x, y):
    """One Adam step; the loss must be finite and the weights must move."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def _loads(cfg):
    """(where, dataset, n_train, n_val, batch) of every data.load call a notebook or solution makes."""
    prof_images = cfg.prof_batch_size * (sum(cfg.prof_steps) + 1)
    return [
        ("00_environment", "digits", cfg.env_n_train, cfg.env_n_val, cfg.env_batch_size),
        ("01_gd_vs_sgd / lab1", cfg.sgd_dataset, cfg.n_train, cfg.n_val, max(cfg.sgd_batch_sizes)),
        ("02_cpu_vs_gpu", cfg.dataset, cfg.n_train, cfg.n_val, cfg.batch_size),
        ("lab2_throughput", cfg.dataset, cfg.pipeline_n_train, cfg.n_val, cfg.batch_size),
        ("03_ddp (utils.ddp_train)", cfg.dataset, cfg.ddp_n_train, cfg.ddp_n_val, cfg.ddp_batch_size),
        ("04_large_batch / lab4", cfg.lb_dataset, cfg.n_train, cfg.n_val, max(cfg.lb_batch_sizes)),
        ("06_clusters_and_profiling", cfg.dataset, prof_images, 64, cfg.prof_batch_size),
        ("lab6_profiling", cfg.dataset, cfg.lab6_n_train, cfg.n_val, cfg.lab6_batch_size),
    ]


@pytest.mark.parametrize("name", config.PROFILE_NAMES)
def test_every_notebook_load_gives_the_splits_it_asks_for_and_trains_a_step(name):
    cfg = config.profile(name)
    for where, dataset, n_train, n_val, batch in _loads(cfg):
        what = f"{name} profile, {where}: {dataset} n_train={n_train} n_val={n_val}"
        splits = data.load(dataset, n_train, n_val, seed=0)
        assert (len(splits.train), len(splits.val)) == (n_train, n_val), what
        assert splits.shape == SHAPE[dataset], what
        assert n_train + n_val <= TOTAL[dataset], what
        assert batch <= n_train, f"{what}: batch {batch} larger than the training split"
        if dataset == "digits":  # the real images: finite, every class in both splits
            for part in (splits.train, splits.val):
                assert torch.isfinite(part.tensors[0]).all(), what
                assert set(part.tensors[1].tolist()) == set(range(10)), what
        loader = data.make_loader(splits.train, batch, seed=0)
        assert len(loader) >= 1, what
        x, y = next(iter(loader))
        assert x.shape == (batch, *SHAPE[dataset]), what
        torch.manual_seed(0)
        _step(models.net_for(splits.shape, width=8), x, y)


def test_the_cpu_profile_bug_is_caught_with_the_row_to_change():
    """The cpu profile once asked digits (1,797 images) for 10,000 + 2,000: every image went to
    validation and training crashed later with 'training loader yielded no batches'."""
    with pytest.raises(ValueError, match=r"12,000 but digits has 1,797 images.*utils/config\.py"):
        data.load("digits", n_train=10_000, n_val=2_000)


@pytest.mark.parametrize("name", config.PROFILE_NAMES)
def test_stage1_sweeps_fit_their_data(name):
    cfg = config.profile(name)
    assert cfg.gd_batch_size <= cfg.gd_n_points
    assert max(cfg.var_batch_sizes) <= cfg.n_train
    assert max(cfg.sgd_target_batch_sizes) <= cfg.n_train and max(cfg.sgd_batch_sizes) <= cfg.n_train
    assert cfg.noise_b_small < cfg.noise_b_big <= cfg.n_train
    assert cfg.sgd_base_lr <= cfg.sgd_max_lr
    assert 0.1 < cfg.sgd_target_acc < 1  # above chance, reachable
    assert cfg.sgd_epochs >= 1 and cfg.sgd_max_steps >= 1
    grid = cfg.sgd_lr_grid
    assert len(grid) >= 3 and all(b == 2 * a for a, b in zip(grid, grid[1:])), "a log grid, a factor 2 apart"
    first = cfg.sgd_base_lr * min(cfg.sgd_target_batch_sizes) / cfg.sgd_base_batch  # where the tuning starts
    assert grid[0] < first < grid[-1], "the tuning starts inside the grid, with room to walk both ways"
    assert all(0 <= f <= 1 for f in cfg.noise_run_fractions) and max(cfg.noise_run_fractions) == 1


@pytest.mark.parametrize("name", config.PROFILE_NAMES)
def test_stage2_benchmarks_and_input_pipeline(name):
    cfg = config.profile(name)
    assert cfg.pipeline_n_train <= cfg.n_train, "02 slices the first pipeline_n_train training images"
    assert cfg.batch_size <= cfg.pipeline_n_train
    assert min(cfg.bench_batch_sizes) < max(cfg.bench_batch_sizes)
    assert 0 in cfg.pipeline_workers and max(cfg.pipeline_workers) > 0, "workers compared against none"
    assert cfg.bench_warmup >= 1 and cfg.bench_repeats >= 3


@pytest.mark.parametrize("name", config.PROFILE_NAMES)
def test_workers_configurations_yield_a_batch(name):
    cfg = config.profile(name)
    splits = data.load("digits", n_train=256, n_val=64)
    for workers in sorted({cfg.num_workers, *cfg.pipeline_workers}):
        loader = data.make_loader(splits.train, cfg.batch_size, kind="dataloader", num_workers=workers)
        x, y = next(iter(loader))
        assert x.shape == (min(cfg.batch_size, 256), 1, 8, 8) and len(y) == len(x)
    assert cfg.loader in ("device", "dataloader")


@pytest.mark.parametrize("name", config.PROFILE_NAMES)
def test_ddp_runs_shard_without_padding(name):
    """Every process count of 03 gets whole batches of distinct images (DistributedSampler pads
    otherwise, and the notebook's single-process/N-process comparison would not be like for like)."""
    cfg = config.profile(name)
    counts = sorted({*cfg.ddp_scaling_nprocs, cfg.ddp_nprocs or 2, 2})  # 2: torchrun restart demo
    b, n = cfg.ddp_batch_size, cfg.ddp_n_train
    assert n % (max(counts) * b) == 0, f"ddp_n_train {n} not divisible by {max(counts)} x {b}"
    ds = TensorDataset(torch.arange(n).float()[:, None], torch.zeros(n, dtype=torch.long))
    for w in counts:
        seen = []
        for rank in range(w):
            loader = data.make_loader(ds, b, rank=rank, world_size=w, seed=0)
            sizes = [len(xb) for xb, _ in loader]
            assert sizes == [b] * (n // (w * b)), (w, rank)
            seen += [int(v) for xb, _ in loader for v in xb[:, 0]]
        assert sorted(seen) == list(range(n)), f"{w} processes: some images seen twice or never"
    steps_per_epoch = n // (2 * b)
    fail_step = (cfg.ddp_epochs - 1) * steps_per_epoch + steps_per_epoch // 2 + 1
    assert steps_per_epoch >= 2 and fail_step <= cfg.ddp_epochs * steps_per_epoch, "crash inside the run"
    run_cfg = ddp_train.make_config(
        dataset=cfg.dataset,
        n_train=n,
        n_val=cfg.ddp_n_val,
        width=cfg.ddp_cnn_width,
        epochs=cfg.ddp_epochs,
        batch_size=b,
        lr=cfg.ddp_lr,
    )
    data.check_sizes(run_cfg.dataset, run_cfg.n_train, run_cfg.n_val)
    assert cfg.ddp_bucket_caps_mb == tuple(sorted(cfg.ddp_bucket_caps_mb))


def test_ddp_train_defaults_fit_their_dataset():
    c = ddp_train.make_config()
    splits = data.load(c.dataset, c.n_train, c.n_val)
    assert (len(splits.train), len(splits.val)) == (c.n_train, c.n_val)
    assert c.n_train % (2 * c.batch_size) == 0  # make two-node: 2 processes


@pytest.mark.parametrize("name", config.PROFILE_NAMES)
def test_stage4_sweep_bases_inside_their_sweeps(name):
    cfg = config.profile(name)
    sweep = cfg.lb_batch_sizes
    assert cfg.lb_base_batch in sweep and cfg.lb_base_batch == min(sweep)
    assert max(sweep) <= cfg.n_train
    assert all(b % cfg.lb_ghost_batch == 0 for b in sweep), "ghost BN splits every batch evenly"
    assert cfg.lb_warmup_epochs < cfg.lb_epochs
    assert cfg.lb_smith_batch * cfg.lb_smith_factor**2 <= cfg.n_train, "grown twice, still fits the data"
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Flatten(),
        torch.nn.Linear(8, cfg.lb_mlp_width),
        torch.nn.BatchNorm1d(cfg.lb_mlp_width),
        torch.nn.ReLU(),
        torch.nn.Linear(cfg.lb_mlp_width, 10),
    )
    _step(model, torch.randn(cfg.lb_ghost_batch, 8), torch.arange(cfg.lb_ghost_batch) % 10)


@pytest.mark.parametrize("name", config.PROFILE_NAMES)
def test_stage5_splits_divide(name):
    cfg = config.profile(name)
    assert all(cfg.shard_batch % n == 0 for n in cfg.shard_nprocs)
    assert all(cfg.pp_batch % m == 0 for m in cfg.pp_micro_batches)
    assert cfg.pp_depth % 2 == 0, "two pipeline stages"
    assert (
        all(cfg.act_ckpt_depth % s == 0 for s in cfg.act_ckpt_segments)
        and max(cfg.act_ckpt_segments) <= cfg.act_ckpt_depth
    )
    assert (4 * cfg.tp_width) % 2 == 0 and cfg.tp_batch >= 1
    assert 2 in cfg.shard_nprocs


@pytest.mark.parametrize("name", config.PROFILE_NAMES)
def test_stage6_profiler_schedule_and_buckets(name):
    cfg = config.profile(name)
    wait, warmup, active = cfg.prof_steps
    assert wait >= 1 and active >= 1 and warmup >= 1 or name == "smoke"
    small, large = cfg.prof_bucket_caps_mb
    layer_mb = cfg.prof_ddp_width**2 * 4 / 2**20
    assert small < large and large >= cfg.prof_ddp_depth * layer_mb, "the large cap holds every gradient"


@pytest.mark.parametrize("name", config.PROFILE_NAMES)
def test_transformer_notebook_sizes_fit_the_model(name):
    """Notebook 07: three sequence lengths up to the model's context (the last is the context),
    a median of at least three timed steps after a warm-up, and a learning rate Adam can take."""
    cfg = config.profile(name)
    lens = cfg.gpt_mem_seq_lens
    assert len(lens) == 3 and list(lens) == sorted(set(lens)) and lens[0] >= 1 and lens[-1] == cfg.gpt_context
    assert cfg.gpt_timing_warmup >= 1 and cfg.gpt_timing_repeats >= 3
    assert cfg.gpt_train_steps >= 20 and 0 < cfg.gpt_lr <= 1e-2
    assert cfg.gpt_eval_batches >= 1 and cfg.gpt_sample_bytes >= 1 and cfg.gpt_mem_batch >= 1
    held_out = (cfg.gpt_corpus_bytes or data.SHAKESPEARE_BYTES) // 10  # load_tokens keeps 10% for validation
    assert held_out > cfg.gpt_context + 1, "held-out windows of the full context exist"


@pytest.mark.parametrize("spec_path", SPECS, ids=lambda p: p.name)
def test_grader_specs_fit_their_dataset_and_train_a_step(spec_path):
    from utils.grader import spec as grader_spec

    s = grader_spec.load_spec(spec_path)
    total = TOTAL[s.dataset]
    held = s.n_val or HELD_OUT.get(s.dataset, data.DIGITS_DEFAULT_N_VAL)
    if s.heldout == "secret_split":  # drawn from train + held out together
        train = s.n_train or total - held
        assert held + train <= total
    else:
        data.check_sizes(s.dataset, s.n_train or None, s.n_val or None)
        train = s.n_train or TRAIN.get(s.dataset, total - held)
    assert train >= s.nprocs * 32, "every rank gets batches"
    torch.manual_seed(0)
    model = models.build(s.model, SHAPE[s.dataset], **dict(s.model_kwargs))
    _step(model, torch.randn(4, *SHAPE[s.dataset]), torch.arange(4))


def test_every_size_a_notebook_reads_is_a_row():
    """An outside check on the table: the cfg.<key> names in the notebooks' and solutions' code."""
    used = set()
    for nb in NOTEBOOKS:
        cells = json.loads(nb.read_text())["cells"]
        src = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        used |= set(re.findall(r"\bcfg\.([a-z_0-9]+)", src))
    used -= {"name", "summary", "keys", "items", "as_dict"}
    missing = sorted(k for k in used if k not in config.TABLE)
    assert not missing, f"notebooks read sizes that utils/config.py does not have: {missing}"
    assert "n_train" in used and "ddp_n_train" in used  # the scan found the notebooks


def test_profiles_grow_from_smoke_to_gpu():
    s, c, g = (config.profile(n) for n in config.PROFILE_NAMES)
    for key in ("n_train", "ddp_n_train", "sgd_max_steps"):
        assert s[key] <= c[key] <= g[key], key
    assert math.isfinite(float(np.float32(c.lr)))
