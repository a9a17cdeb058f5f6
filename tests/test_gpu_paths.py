"""The CUDA/NCCL paths, on a CPU-only machine.

Each test holds one rule of the GPU paths that a CPU-only run would never exercise. Where a GPU is needed,
``fake_gpu.FakeCuda`` makes torch.cuda a machine with N GPUs whose ``set_device`` keeps torch's
real semantics (an index is required); NCCL-only logic runs on gloo through the same code path.
Workers are module-level functions: spawned ranks import them by name.
"""

from __future__ import annotations

import os
import re
import threading
import time
import warnings
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from fake_gpu import FakeCuda, install_in_rank
from torch import nn

from utils import bench, data, ddp_train, device, models, monitor, parallel
from utils.demos import pp_demo, shard_demo, tp_demo
from utils.parallel import group
from utils.train import fit

ROOT = Path(__file__).resolve().parents[1]
DIST_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "LAB_DIST_BACKEND",
    "LAB_DIST_PARENT_STORE",
    "TORCHELASTIC_RESTART_COUNT",
)


@pytest.fixture
def alone(monkeypatch):
    """No torchrun / launch environment: setup() makes a group of one."""
    for k in DIST_ENV:
        monkeypatch.delenv(k, raising=False)
    yield
    parallel.teardown()


@pytest.fixture
def one_gpu(monkeypatch):
    """This process sees one (fake) GPU; NCCL groups are created on gloo."""
    return FakeCuda(1).install(monkeypatch.setattr, nccl_on_gloo=True)


# ---------------------------------------------------------------------------- 1. set_device needs an index


def test_the_fake_gpu_has_torchs_set_device_semantics(one_gpu):
    with pytest.raises(ValueError, match="specified index"):
        torch.cuda.set_device(torch.device("cuda"))  # a bare "cuda" has no index: setup() must pass one
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.cuda.set_device(1)
    torch.cuda.set_device(torch.device("cuda", 0))
    assert one_gpu.set_device_calls == [0]


def test_bare_cuda_device_gets_an_index(one_gpu, alone):
    ctx = parallel.setup("gloo", device="cuda")  # notebook 03 with fewer GPUs than processes
    assert ctx.device == torch.device("cuda", 0) and one_gpu.set_device_calls == [0]
    assert ctx.backend == "gloo"


@pytest.mark.parametrize("n_gpus, local_rank, want", [(1, 3, 0), (2, 3, 1), (4, 2, 2), (8, 7, 7)])
def test_ranks_sharing_gpus_spread_over_them(monkeypatch, n_gpus, local_rank, want):
    FakeCuda(n_gpus).install(monkeypatch.setattr)
    assert group.rank_device(local_rank, "cuda") == torch.device("cuda", want)
    assert group.rank_device(local_rank, "cpu") == torch.device("cpu")
    with pytest.raises(RuntimeError, match="does not exist"):
        group.rank_device(0, f"cuda:{n_gpus}")


def test_alone_with_one_gpu_picks_nccl_on_cuda0(one_gpu, alone):
    ctx = parallel.setup()
    assert ctx.backend == "nccl" and one_gpu.backends_asked == ["nccl"]
    assert ctx.device == torch.device("cuda", 0) and one_gpu.set_device_calls == [0]


# ---------------------------------------------------------------------------- 11. backend from what each rank sees


def _agree(identities):
    """_agree_on_gpus for len(identities) ranks, as threads around one real TCPStore."""
    world = len(identities)
    server = dist.TCPStore("127.0.0.1", 0, world, True, timedelta(seconds=30), wait_for_workers=False)
    out = [None] * world

    def rank(r):
        store = dist.TCPStore("127.0.0.1", server.port, world, False, timedelta(seconds=30))
        out[r] = group._agree_on_gpus(store, r, world, identities[r], 30)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_ranks_agree_on_nccl_only_when_every_rank_has_its_own_gpu():
    own = _agree(["node0/gpu-a", "node0/gpu-b", "node1/gpu-a", "node1/gpu-b"])
    assert own == [(True, 0)] * 4, "four ranks, four distinct GPUs (2 nodes x 2): NCCL everywhere"
    shared = _agree(["node0/gpu-a", "node0/gpu-a", "node1/gpu-a", "node1/gpu-b"])
    assert shared == [(False, 0)] * 4, "two ranks on one GPU: every rank must fall back together"
    hetero = _agree(["node0/gpu-a", "node0/gpu-b", None, None])  # node 1 has no GPU
    assert hetero == [(False, 2)] * 4, "a node without GPUs: gloo on every rank, not only there"


def backend_worker(uuid, device_arg):
    """A rank that sees one fake GPU with this UUID, started as torchrun would (no backend given)."""
    os.environ.pop("LAB_DIST_BACKEND", None)
    fake = install_in_rank(1, [uuid])
    ctx = parallel.setup(device=device_arg)
    return {
        "backend": ctx.backend,
        "device": str(ctx.device),
        "asked": fake.backends_asked,
        "pinned": fake.set_device_calls,
    }


def per_rank_gpu_worker(device_arg):
    rank = int(os.environ["RANK"])
    return backend_worker(f"gpu-of-rank-{rank}", device_arg)  # CUDA_VISIBLE_DEVICES=<rank's own GPU>


def shared_gpu_worker(device_arg):
    return backend_worker("the-only-gpu", device_arg)  # one GPU, both ranks see it


@pytest.mark.slow  # 2 ranks
def test_one_visible_gpu_per_rank_is_nccl_on_cuda0():
    """SLURM --gpus-per-task=1: LOCAL_RANK 1 sees one GPU, its own, as cuda:0. The backend follows
    each rank's own GPU, not the count of visible GPUs (1 < 2 processes would mean gloo), so NCCL
    is chosen and an explicit nccl works."""
    res = parallel.launch(per_rank_gpu_worker, 2, None, timeout=120, stream=False)
    for r in res:
        assert r["backend"] == "nccl" and r["asked"] == ["nccl"], r
        assert r["device"] == "cuda:0" and r["pinned"] == [0], r


@pytest.mark.slow  # 2 ranks
def test_ranks_sharing_one_gpu_agree_on_gloo_and_share_cuda0():
    res = parallel.launch(shared_gpu_worker, 2, "cuda", timeout=120, stream=False)
    for r in res:
        assert r["backend"] == "gloo" and r["asked"] == ["gloo"], r
        assert r["device"] == "cuda:0" and r["pinned"] == [0], r


# ---------------------------------------------------------------------------- 2. batched point-to-point only

P2P_CALL = re.compile(r"\b(?:dist|distributed)\.(?:isend|irecv|send|recv)\s*\(")


def test_the_repository_has_no_unbatched_point_to_point_ops():
    """A ring of separate isend/recv calls deadlocks on NCCL; every point-to-point op must go
    through dist.batch_isend_irecv([P2POp(...)]). Scans code, notebooks, solutions and labs."""
    offenders = []
    for folder in ("utils", "notebooks", "solutions", "labs", "tests", "benchmarks"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix not in (".py", ".ipynb") or ".ipynb_checkpoints" in path.parts:
                continue
            for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if P2P_CALL.search(line) and "# the mistake under test" not in line:  # a check's wrong answer
                    offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
    assert not offenders, "unbatched point-to-point ops (use batch_isend_irecv with P2POp):\n" + "\n".join(offenders)


def test_the_scan_sees_a_ring_of_separate_sends():
    isend = "dist." + "isend"  # split, so that this file passes its own scan
    assert P2P_CALL.search(f"req = {isend}(chunks[send_i].contiguous(), right, group=group)")
    assert P2P_CALL.search("        dist." + "recv(buf, left)")
    assert not P2P_CALL.search("ops = [dist.P2POp(dist.isend, chunk, right), dist.P2POp(dist.irecv, buf, left)]")


# ---------------------------------------------------------------------------- 3. determinism for bit-identical resume


def test_set_deterministic_sets_cudnn_and_cublas(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = device.set_deterministic()
    assert before == {"cudnn.deterministic": False, "cudnn.benchmark": True, "CUBLAS_WORKSPACE_CONFIG": None}
    assert torch.backends.cudnn.deterministic is True and torch.backends.cudnn.benchmark is False
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")


def test_ddp_train_is_deterministic_before_it_touches_a_device(monkeypatch, alone):
    order = []
    monkeypatch.setattr(device, "set_deterministic", lambda: order.append("deterministic"))
    real_setup = parallel.setup
    monkeypatch.setattr(parallel, "setup", lambda *a, **k: (order.append("setup"), real_setup(*a, **k))[1])
    ddp_train.train(n_train=64, n_val=32, batch_size=32, epochs=1, width=4, evaluate=False)
    assert order == ["deterministic", "setup"]


# ---------------------------------------------------------------------------- 4. DataLoader workers


def test_loader_workers_fit_the_cores_persist_and_do_not_force_spawn(monkeypatch):
    FakeCuda(1).install(monkeypatch.setattr)  # CUDA "initialised" in this process
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    ds = data.synthetic(64, shape=(1, 4, 4))
    dl = data.make_loader(ds, 8, kind="dataloader", num_workers=4, device="cuda")
    assert dl.num_workers == 2, "never more workers than the cores this process may use"
    assert dl.persistent_workers, "workers must survive the epoch (a restart per epoch is slow)"
    assert dl.multiprocessing_context is None, "workers never touch CUDA: no forced spawn"
    assert dl.pin_memory, "pinned memory for a CUDA device"


def test_loader_pins_only_with_cuda_and_runs_without_warnings():
    ds = data.synthetic(40, shape=(1, 4, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "4 workers on 2 cores", "pin_memory without CUDA"
        dl = data.make_loader(ds, 8, kind="dataloader", num_workers=64, pin_memory=True)
        assert dl.pin_memory == torch.cuda.is_available()  # also true on a GPU machine
        seen = torch.cat([y for _, y in dl])
    assert len(seen) == 40 and dl.num_workers == data.usable_cores()


def test_small_dev_shm_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(data, "shm_free_bytes", lambda path=data.SHM_DIR: 64 * 2**20)  # Docker's default
    ds = data.synthetic(4096, shape=(3, 224, 224))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    with pytest.raises(RuntimeError, match="shm-size"):
        data.make_loader(ds, 256, kind="dataloader", num_workers=4)
    data.make_loader(ds, 256, kind="dataloader", num_workers=0)  # no workers: no shared memory needed


def test_gpu_resident_dataset_with_workers_is_refused():
    ds = torch.utils.data.TensorDataset(torch.empty(8, 1, device="meta"), torch.empty(8, device="meta"))
    with pytest.raises(ValueError, match="kind='device'"):
        data.make_loader(ds, 4, kind="dataloader", num_workers=1)


# ---------------------------------------------------------------------------- 5. CUDA events on the measured device


def test_time_fn_records_events_on_the_measured_device(monkeypatch):
    fake = FakeCuda(2).install(monkeypatch.setattr)
    monkeypatch.setattr(bench, "synchronize", lambda device=None: None)
    assert torch.cuda.current_device() == 0
    t = bench.time_fn(lambda: time.sleep(0.01), warmup=0, repeats=3, device="cuda:1")
    assert t.method == "cuda events" and len(fake.events) == 2
    assert all(e.device == 1 for e in fake.events), "events must belong to cuda:1, the measured device"
    assert all(e.stream.device_index == 1 for e in fake.events), "recorded on cuda:1's stream"
    assert torch.cuda.current_device() == 0, "the current device is restored"
    assert 0.009 <= t.median < 0.5, "the events time the 10 ms sleep (a busy machine only makes it longer)"


# ---------------------------------------------------------------------------- 7. warm-up epoch reported apart


class SlowFirstEpoch(data.EpochLoader):
    """A loader whose epoch 0 costs an extra second (as cuDNN autotuning or compiling does)."""

    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        if self.epoch == 0:
            time.sleep(1.0)
        return iter(self.loader)


def test_throughput_leaves_the_warm_up_epoch_out():
    torch.manual_seed(0)
    ds = data.synthetic(64, shape=(1, 8, 8))
    net = models.Net(4, in_channels=1, image_size=8)
    h = fit(
        net,
        SlowFirstEpoch(data.make_loader(ds, 32)),
        torch.optim.SGD(net.parameters(), lr=0.1),
        epochs=3,
        progress=False,
    )
    later = sum(e["time_s"] for e in h.epochs[1:])
    assert h.epochs[0]["time_s"] > 1.0, "epoch 0 holds the warm-up"
    assert h.images_per_s == pytest.approx(128 / later, rel=1e-9), "epochs 1 and 2 only"
    assert h.warmup_images_per_s == pytest.approx(64 / h.epochs[0]["time_s"])
    assert h.images_per_s > h.images / h.train_time, "the warm-up epoch does not drag the figure down"
    assert h.step_s == pytest.approx(later / 4, rel=1e-9)
    d = h.to_dict()
    assert d["images_per_s"] == h.images_per_s and d["warmup_images_per_s"] == h.warmup_images_per_s


# ---------------------------------------------------------------------------- 8. GradScaler's sync


def test_amp_costs_need_a_gpu_and_say_so():
    if torch.cuda.is_available():
        pytest.skip("a real GPU: make gpu-check measures it")
    with pytest.raises(ValueError, match="CUDA"):
        bench.amp_step_costs(models.Net(4), 8, device="cpu")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        bench.count_syncs(lambda: None)


# ---------------------------------------------------------------------------- 9. checkpoints load to the CPU


def _adam_run(steps, model=None, opt=None):
    torch.manual_seed(1)
    x, y = torch.randn(16, 5), torch.randint(0, 3, (16,))
    if model is None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt


def test_checkpoint_loads_to_cpu_and_adam_resumes_exactly(tmp_path, monkeypatch, alone):
    full, _ = _adam_run(6)
    model, opt = _adam_run(3)
    parallel.save_checkpoint(tmp_path / "c.pt", model, opt, epoch=1, step=3)
    asked = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: (asked.append(k.get("map_location")), real_load(*a, **k))[1])
    torch.manual_seed(0)
    fresh = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    parallel.load_checkpoint(tmp_path / "c.pt", fresh, fresh_opt)
    assert asked == ["cpu"], "read onto the CPU, then moved by load_state_dict (never a GPU map_location)"
    steps = [s["step"] for s in fresh_opt.state.values()]
    assert steps and all(s.device.type == "cpu" and float(s) == 3 for s in steps), "Adam's step stays on the CPU"
    _adam_run(3, fresh, fresh_opt)
    for a, b in zip(full.parameters(), fresh.parameters()):
        assert torch.equal(a, b), "3 + 3 resumed steps must equal 6 uninterrupted Adam steps"


# ---------------------------------------------------------------------------- 10. channels_last before the DDP wrap


def test_channels_last_is_applied_before_the_ddp_wrap(alone):
    ctx = parallel.setup("gloo")
    torch.manual_seed(0)
    ds = data.synthetic(32, shape=(1, 8, 8))
    late = parallel.ddp(models.Net(4, in_channels=1, image_size=8), ctx)
    with pytest.raises(ValueError, match="before wrapping"):
        fit(
            late,
            data.make_loader(ds, 16),
            torch.optim.SGD(late.parameters(), lr=0.1),
            epochs=1,
            channels_last=True,
            progress=False,
        )
    torch.manual_seed(0)
    serial = models.Net(4, in_channels=1, image_size=8)
    torch.manual_seed(0)
    net = parallel.ddp(models.Net(4, in_channels=1, image_size=8), ctx, channels_last=True)
    assert all(p.is_contiguous(memory_format=torch.channels_last) for p in net.parameters() if p.dim() == 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # DDP warns when grad strides mismatch its buckets
        fit(
            net,
            data.make_loader(ds, 16),
            torch.optim.SGD(net.parameters(), lr=0.1),
            epochs=1,
            channels_last=True,
            progress=False,
        )
    fit(serial, data.make_loader(ds, 16), torch.optim.SGD(serial.parameters(), lr=0.1), epochs=1, progress=False)
    for a, b in zip(serial.parameters(), net.module.parameters()):
        assert torch.allclose(a, b, atol=1e-5), "channels_last DDP (1 rank) trains as the serial model"


# ---------------------------------------------------------------------------- 12. monitor: CUDA -> NVML


class UUIDNVML:
    """pynvml with three GPUs (NVML's PCI order) and one MIG slice."""

    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 1, 2, 0
    UUIDS = ["GPU-aaaa1111", "GPU-bbbb2222", "GPU-cccc3333"]

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return 3

    def nvmlDeviceGetHandleByIndex(self, i):
        if not 0 <= i < 3:
            raise RuntimeError("Invalid Argument")
        return ("gpu", i)

    def nvmlDeviceGetUUID(self, h):
        return self.UUIDS[h[1]].encode()

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid.startswith("MIG-"):
            return ("mig", uuid)
        return ("gpu", self.UUIDS.index(uuid))

    def nvmlDeviceGetName(self, h):
        return "Fake H100 MIG 1g.10gb" if h[0] == "mig" else f"Fake H100 #{h[1]}"

    def nvmlDeviceGetUtilizationRates(self, h):
        if h[0] == "mig":
            raise RuntimeError("Not Supported")  # MIG slices report no utilisation
        return SimpleNamespace(gpu=10 * h[1], memory=5)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=2**30, total=10 * 2**30 if h[0] == "mig" else 80 * 2**30)

    def nvmlDeviceGetPowerUsage(self, h):
        return 100_000

    def nvmlDeviceGetClockInfo(self, h, kind):
        return 1500

    def nvmlDeviceGetTemperature(self, h, kind):
        return 40


@pytest.mark.parametrize(
    "cvd, want",
    [
        ("2,0", [2, 0]),  # indices: cuda:0 is NVML 2
        ("GPU-bbbb2222", [1]),  # a full UUID
        ("GPU-cccc", [2]),  # a UUID prefix, as CUDA accepts
        ("1,-1,0", [1]),  # CUDA stops at the first invalid entry
    ],
)
def test_monitor_maps_cuda_devices_to_nvml(monkeypatch, cvd, want):
    # A process that has not initialised CUDA: the variable alone decides (on a GPU machine an
    # earlier test has initialised it, and the real device's UUID is not one of the fake's).
    monkeypatch.setattr(monitor, "_torch_uuid", lambda i: None)
    monkeypatch.setattr(monitor, "_torch_count", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", cvd)
    got = [d["nvml"] for d in monitor.cuda_to_nvml(UUIDNVML())]
    assert got == want


def test_monitor_watches_a_mig_slice(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-1234abcd-0000-1111-2222-333344445555")
    with monitor.GPUMonitor(interval=0.01, nvml=UUIDNVML()) as mon:
        time.sleep(0.03)
    res = mon.result
    assert res.available and res.devices[0]["mig"] and res.gpus == [(0, "Fake H100 MIG 1g.10gb")]
    s = res.samples[0]
    assert s["util_gpu"] is None and s["mem_total_mib"] == pytest.approx(10 * 1024), (
        "a MIG slice: its own memory, no utilisation counter"
    )


def test_monitor_watches_a_mig_slice_when_cuda_visible_devices_is_unset(monkeypatch):
    """A container handed one MIG slice often has no CUDA_VISIBLE_DEVICES: torch's UUID of cuda:0
    (no prefix) is then the slice's, which is no whole GPU of NVML's."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    FakeCuda(1, uuids=["1234abcd-0000-1111-2222-333344445555"]).install(monkeypatch.setattr)
    (dev,) = monitor.cuda_to_nvml(UUIDNVML())
    assert dev["mig"] and dev["uuid"] == "MIG-1234abcd-0000-1111-2222-333344445555" and dev["nvml"] is None


def test_monitor_uses_torchs_uuids_when_cuda_order_differs(monkeypatch):
    """CUDA_DEVICE_ORDER=FASTEST_FIRST (CUDA's default) can number GPUs unlike NVML's PCI order;
    once torch has initialised CUDA its UUIDs decide. cuda:1 here is NVML's GPU 0."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    FakeCuda(3, uuids=["cccc3333", "aaaa1111", "bbbb2222"]).install(monkeypatch.setattr)
    assert [d["nvml"] for d in monitor.cuda_to_nvml(UUIDNVML())] == [2, 0, 1]
    with monitor.GPUMonitor(interval=0.01, gpus=[1], nvml=UUIDNVML()) as mon:
        time.sleep(0.03)
    assert mon.result.gpus == [(1, "Fake H100 #0")]


# ---------------------------------------------------------------------------- 13. bounded teardown, traceback first


def test_teardown_returns_within_its_bound(monkeypatch, alone):
    parallel.setup("gloo")
    release = threading.Event()
    real_destroy = dist.destroy_process_group
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a: release.wait(60))
    t0 = time.monotonic()
    assert parallel.teardown(timeout=0.3) is False, "a blocked destroy must be reported, not waited out"
    assert time.monotonic() - t0 < 5
    release.set()
    monkeypatch.setattr(dist, "destroy_process_group", real_destroy)


def fail_with_stuck_teardown_worker():
    ctx = parallel.setup()
    dist.destroy_process_group = lambda *a: time.sleep(600)  # an NCCL destroy that never returns
    if ctx.rank == 1:
        raise ValueError("rank 1 broke")
    time.sleep(600)  # rank 0: busy (or stuck in a collective)


@pytest.mark.slow  # 2 ranks
def test_failing_rank_is_reported_although_its_teardown_hangs():
    t0 = time.monotonic()
    with pytest.raises(parallel.LaunchError, match="rank 1 raised ValueError: rank 1 broke") as e:
        parallel.launch(fail_with_stuck_teardown_worker, 2, timeout=300, stream=False)
    assert time.monotonic() - t0 < 90, "the report must not wait for the launch timeout"
    assert e.value.rank == 1 and "rank 1 broke" in e.value.remote_traceback


# ---------------------------------------------------------------------------- FSDP2 on gloo, fewer GPUs than ranks


def fsdp2_one_gpu_worker(kw):
    """A rank of a box with one GPU that nobody has touched yet (CUDA not initialised): two ranks
    share it, so they agree on gloo on the CPU; fully_shard must shard over the CPU ranks."""
    install_in_rank(1, ["the-only-gpu"], initialized=False, accelerator=True)
    from utils.demos import shard_demo

    return shard_demo.worker(["fsdp2"], measure_peak=False, **kw)


@pytest.mark.slow  # 2 ranks
@pytest.mark.skipif(parallel.shard.fully_shard is None, reason="FSDP2 needs torch 2.4+")
def test_fsdp2_under_gloo_with_fewer_gpus_than_ranks_uses_the_ranks_device_mesh():
    """Without a mesh, fully_shard made a CUDA mesh and set cuda:LOCAL_RANK: rank 1 died with
    'invalid device ordinal'. The losses must equal the one-process Adam run (the oracle)."""
    kw = dict(width=16, depth=3, batch_size=8, steps=3)
    res = parallel.launch(fsdp2_one_gpu_worker, 2, kw, timeout=180, stream=False)
    ref = shard_demo.reference_losses(**kw)
    for r in res:
        assert r["backend"] == "gloo", r
        assert r["fsdp2"]["loss"] == pytest.approx(ref, rel=1e-5, abs=1e-6)


# ---------------------------------------------------------------------------- NCCL and Docker's 64 MB /dev/shm


def shm_worker(free_mib):
    os.environ.pop("LAB_DIST_BACKEND", None)  # let the ranks decide, as under torchrun
    install_in_rank(1, [f"gpu-of-rank-{os.environ['RANK']}"])  # one GPU per rank: NCCL
    group.shm_free_bytes = lambda path=group.SHM_DIR: free_mib * 2**20
    ctx = parallel.setup()
    return ctx.backend


@pytest.mark.slow  # 2 ranks
def test_nccl_with_a_small_dev_shm_is_refused_before_the_group_exists():
    """Docker's default --shm-size (64 MB): NCCL would die with 'Error while creating shared memory
    segment'; setup() refuses first and says what to do. Enough shared memory: NCCL as before."""
    with pytest.raises(parallel.LaunchError, match=r"--shm-size.*--ipc=host"):
        parallel.launch(shm_worker, 2, 64, timeout=120, stream=False)
    assert parallel.launch(shm_worker, 2, 8192, timeout=120, stream=False) == ["nccl", "nccl"]


def test_one_nccl_rank_alone_needs_no_shared_memory(one_gpu, alone, monkeypatch):
    monkeypatch.setattr(group, "shm_free_bytes", lambda path=group.SHM_DIR: 64 * 2**20)
    assert parallel.setup().backend == "nccl"


# ---------------------------------------------------------------------------- torchrun of the notebook's interpreter

# A command that starts the `torchrun` found on PATH: a list element "torchrun" before an option, a shell escape
# (!torchrun, %sx torchrun) or a command string that begins with it. PATH's torchrun may belong to
# another Python (another torch, no utils), not the kernel's: use sys.executable -m torch.distributed.run.
BARE_TORCHRUN = re.compile(r"""(?:^\s*[!%]\w*\s*torchrun\b|["']torchrun["']\s*,\s*f?["']-|["']torchrun\s+-)""", re.M)


def _code_cells(path):
    import json

    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        if cell["cell_type"] == "code":
            yield i, "".join(cell["source"])


def test_no_notebook_runs_the_torchrun_on_path():
    found = [
        f"{p.relative_to(ROOT)} cell {i}: {m.group(0).strip()}"
        for p in sorted(ROOT.glob("*/*.ipynb"))
        for i, src in _code_cells(p)
        for m in BARE_TORCHRUN.finditer(src)
    ]
    assert not found, "run torchrun as [sys.executable, '-m', 'torch.distributed.run', ...]:\n" + "\n".join(found)


def test_every_notebook_loads_checkpoints_onto_the_cpu():
    """A checkpoint keeps its tensors' devices: one written by a GPU run loads onto cuda:0, one
    by gloo ranks onto the CPU, and comparing the two raises (seen in notebook 03 on an H100)."""
    found = [
        f"{p.relative_to(ROOT)} cell {i}"
        for p in sorted(ROOT.glob("*/*.ipynb"))
        for i, src in _code_cells(p)
        for call in re.findall(r"torch\.load\((?:[^()]|\([^()]*\))*\)", src)
        if "map_location" not in call
    ]
    assert not found, "torch.load(..., map_location='cpu', weights_only=True) in:\n" + "\n".join(found)


def test_the_torchrun_scan_sees_torchrun_under_nsight_and_a_shell_escape():
    nsys = """nsys = ["nsys", "profile", "-o", str(report), "torchrun", "--standalone", "-m", "utils.ddp_train"]"""
    assert BARE_TORCHRUN.search(nsys) and BARE_TORCHRUN.search("!torchrun --standalone x.py")
    assert BARE_TORCHRUN.search('subprocess.run("torchrun --nproc-per-node 2 x.py", shell=True)')
    assert not BARE_TORCHRUN.search('print("torchrun", " ".join(args))')  # a label, not a command
    assert not BARE_TORCHRUN.search("srun torchrun --nnodes 2 \\\\")  # a cluster's sbatch text


# ---------------------------------------------------------------------------- TF32 off in the equivalence demos


@pytest.mark.parametrize(
    "worker, kw",
    [
        (shard_demo.worker, dict(strategies=["ddp"], width=8, depth=1, batch_size=4, steps=1, measure_peak=False)),
        (tp_demo.worker, dict(width=8, batch_size=4)),
    ],
)
def test_equivalence_workers_turn_tf32_off(worker, kw, alone):
    """cuDNN (and cuBLAS where allowed) compute float32 in TF32 on Ampere+ (10-bit mantissa):
    GPU ranks then miss the CPU oracle's 1e-5. Every worker whose result is compared with one must
    turn TF32 off in its process, as it starts."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # what set_float32_matmul_precision("high") does
    torch.backends.cudnn.allow_tf32 = True  # cuDNN's default
    try:
        worker(**kw)
        assert torch.backends.cuda.matmul.allow_tf32 is False and torch.backends.cudnn.allow_tf32 is False
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def tf32_after_pp_worker(kw):
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    pp_demo.worker(**kw)
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


@pytest.mark.slow  # 2 ranks
def test_the_pipeline_worker_turns_tf32_off():
    """pp_worker needs two stages: two ranks, each starting with TF32 on."""
    kw = dict(width=8, depth=2, batch_size=4, micro_batches=(1,), repeats=1)
    assert parallel.launch(tf32_after_pp_worker, 2, kw, timeout=120, stream=False) == [(False, False)] * 2


# ---------------------------------------------------------------------------- the fake NCCL


def test_the_fake_nccl_refuses_cpu_tensors_as_nccl_does():
    from fake_gpu import NCCL_CPU_ERROR, OnFakeGpu

    assert NCCL_CPU_ERROR == "No backend type associated with device type cpu"
    x = OnFakeGpu(torch.arange(4.0))
    with pytest.raises(RuntimeError, match="same device"):
        x + torch.ones(4)  # mixing devices raises, as on a GPU
    assert torch.equal((x * 2).cpu(), torch.arange(4.0) * 2)


# ---------------------------------------------------------------------------- multi-rank demos sized for the ranks' device


def test_multi_rank_demos_on_one_gpu_take_smoke_sizes_and_say_so(monkeypatch, capsys):
    """Two ranks, one GPU: launch() picks gloo and the ranks run on the CPU, one thread each; the
    gpu profile's sizes there took minutes (notebook 05's pipeline) and timed a CPU."""
    from utils import config

    gpu = config.profile("gpu")
    FakeCuda(1).install(monkeypatch.setattr, nccl_on_gloo=True)
    got = parallel.sizes_for_ranks(gpu, 2)
    assert got.name == "smoke" and got.pp_width == config.profile("smoke").pp_width
    assert "ranks run on gloo on the CPU" in capsys.readouterr().out
    FakeCuda(4).install(monkeypatch.setattr, nccl_on_gloo=True)
    assert parallel.sizes_for_ranks(gpu, 4) is gpu, "a GPU per rank: the gpu sizes, on the GPUs"
    assert parallel.sizes_for_ranks(gpu, 8).name == "smoke"
    assert capsys.readouterr().out.count("note:") == 1


RANK_SIZED = {
    "notebooks/05_memory_and_model_parallel.ipynb": r"\bcfg\.(?:shard|tp|pp)_\w+",
    "notebooks/03_ddp.ipynb": r"\bcfg\.(?:ddp_message_sizes|ddp_timing_repeats|ddp_mlp_width|ddp_bucket_caps_mb)",
    "notebooks/06_clusters_and_profiling.ipynb": r"\bcfg\.(?:prof_ddp_\w+|prof_bucket_caps_mb)",
}


@pytest.mark.parametrize("path", sorted(RANK_SIZED))
def test_notebooks_size_multi_rank_demos_by_the_ranks_device(path):
    """The launched demos of notebooks 03, 05 and 06 read their sizes from parallel.sizes_for_ranks
    (rcfg), never from the notebook's profile directly."""
    found = [
        f"cell {i}: {m}"
        for i, src in _code_cells(ROOT / path)
        for line in src.splitlines()
        if "sizes_for_ranks(" not in line
        for m in re.findall(RANK_SIZED[path], line)
    ]
    assert not found, found
    assert any("parallel.sizes_for_ranks(cfg" in src for _, src in _code_cells(ROOT / path))
