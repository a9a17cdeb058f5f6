import gzip
import io
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from utils import data

# ---------------------------------------------------------------- datasets


def test_digits_split_is_normalised_and_disjoint():
    s = data.load("digits", n_val=397)
    assert s.shape == (1, 8, 8) and len(s.train) == 1400 and len(s.val) == 397
    x = s.train.tensors[0]
    assert abs(x.mean().item()) < 1e-4 and abs(x.std().item() - 1) < 0.05
    y = torch.cat([s.train.tensors[1], s.val.tensors[1]])
    assert sorted(y.unique().tolist()) == list(range(10))
    small = data.load("digits", n_train=100)
    assert len(small.train) == 100 and torch.equal(small.val.tensors[1], s.val.tensors[1]), (
        "the validation split must not depend on n_train"
    )


def test_unknown_dataset_names_the_choices():
    with pytest.raises(ValueError, match="digits"):
        data.load("mnist-ish")


def test_synthetic_any_shape():
    ds = data.synthetic(10, shape=(5, 7, 3), num_classes=4)
    x, y = ds.tensors
    assert x.shape == (10, 5, 7, 3) and y.max() < 4
    assert torch.equal(x, data.synthetic(10, shape=(5, 7, 3), num_classes=4).tensors[0])


# ---------------------------------------------------------------- parsers on tiny files


def _idx_bytes(arr: np.ndarray) -> bytes:
    code = {np.uint8: 0x08}[arr.dtype.type]
    head = bytes([0, 0, code, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    return head + arr.tobytes()


def test_read_idx_gz_roundtrip(tmp_path):
    arr = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    p = tmp_path / "x-idx3-ubyte.gz"
    p.write_bytes(gzip.compress(_idx_bytes(arr)))
    assert np.array_equal(data.read_idx(p), arr)
    bad = tmp_path / "bad.gz"
    bad.write_bytes(gzip.compress(b"\x01\x02\x03\x04rest"))
    with pytest.raises(ValueError, match="not an IDX file"):
        data.read_idx(bad)
    short = tmp_path / "short.gz"
    short.write_bytes(gzip.compress(_idx_bytes(arr)[:-3]))
    with pytest.raises(ValueError, match="header says"):
        data.read_idx(short)


def _cifar_tar(path: Path, n_per_batch=4, seed=0):
    rng = np.random.default_rng(seed)
    batches = {}
    with tarfile.open(path, "w:gz") as tar:
        for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
            d = {
                b"data": rng.integers(0, 256, (n_per_batch, 3072), dtype=np.uint8),
                b"labels": rng.integers(0, 10, n_per_batch).tolist(),
            }
            batches[name] = d
            raw = pickle.dumps(d)
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return batches


def test_read_cifar10_tiny_archive(tmp_path):
    p = tmp_path / "cifar-10-python.tar.gz"
    b = _cifar_tar(p)
    xtr, ytr, xte, yte = data.read_cifar10(p)
    assert xtr.shape == (20, 3, 32, 32) and xte.shape == (4, 3, 32, 32)
    assert np.array_equal(xtr[:4].reshape(4, -1), b[b"data_batch_1".decode()][b"data"])
    assert ytr[4:8].tolist() == b["data_batch_2"][b"labels"]


# ---------------------------------------------------------------- verified, atomic downloads


def _remote(tmp_path, payload: bytes, name="f.bin", md5=None):
    src = tmp_path / "mirror" / name
    src.parent.mkdir(exist_ok=True)
    src.write_bytes(payload)
    import hashlib

    return data.RemoteFile(name, (src.as_uri(),), md5 or hashlib.md5(payload).hexdigest())


def test_fetch_downloads_verifies_and_reuses(tmp_path):
    rf = _remote(tmp_path, b"hello dataset")
    dest = tmp_path / "data"
    p = data.fetch(rf, dest)
    assert p.read_bytes() == b"hello dataset"
    (tmp_path / "mirror" / "f.bin").unlink()  # now "offline": the verified copy is reused
    assert data.fetch(rf, dest) == p
    assert [f.name for f in dest.iterdir()] == ["f.bin"], "no partial files may be left behind"


def test_corrupted_download_raises_and_leaves_nothing_marked_complete(tmp_path):
    rf = _remote(tmp_path, b"corrupted bytes", md5="0" * 32)
    dest = tmp_path / "data"
    with pytest.raises(data.DatasetUnavailable) as e:
        data.fetch(rf, dest)
    msg = str(e.value)
    assert "MD5" in msg and "f.bin" in msg and str(dest) in msg and rf.urls[0] in msg
    assert list(dest.iterdir()) == [], "a corrupt download must not keep the final name (nor a .part)"


def test_existing_corrupt_file_is_reported_not_trusted(tmp_path):
    rf = _remote(tmp_path, b"good")
    dest = tmp_path / "data"
    dest.mkdir()
    (dest / "f.bin").write_bytes(b"bad")
    with pytest.raises(data.DatasetUnavailable, match="Delete it"):
        data.fetch(rf, dest)


def test_offline_error_names_files_url_and_where_to_put_them(tmp_path):
    rf = data.RemoteFile("f.bin", ("http://127.0.0.1:9/f.bin",), "0" * 32)
    with pytest.raises(data.DatasetUnavailable) as e:
        data.fetch(rf, tmp_path / "d", timeout=2)
    assert "f.bin" in str(e.value) and "http://127.0.0.1:9/f.bin" in str(e.value) and "place them" in str(e.value)
    with pytest.raises(data.DatasetUnavailable, match="downloading is off"):
        data.fetch(rf, tmp_path / "d", download=False)


def test_fashion_mnist_end_to_end_on_tiny_files(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    arrays = [
        rng.integers(0, 256, (12, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, 12, dtype=np.uint8),
        rng.integers(0, 256, (5, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, 5, dtype=np.uint8),
    ]
    files = []
    for rf, arr in zip(data.FASHION_MNIST_FILES, arrays):
        payload = gzip.compress(_idx_bytes(arr))
        files.append(_remote(tmp_path, payload, name=rf.name))
    monkeypatch.setattr(data, "FASHION_MNIST_FILES", tuple(files))
    s = data.load("fashion_mnist", root=tmp_path / "cache")
    assert s.shape == (1, 28, 28) and len(s.train) == 12 and len(s.val) == 5
    assert s.train.tensors[1].tolist() == arrays[1].tolist()


# ---------------------------------------------------------------- sizes a dataset cannot give


def test_load_refuses_sizes_the_dataset_cannot_give():
    with pytest.raises(ValueError, match=r"n_train \+ n_val = 12,000 but digits has 1,797 images: lower"):
        data.load("digits", n_train=10_000, n_val=2_000)
    with pytest.raises(ValueError, match="n_train/n_val row in utils/config.py"):
        data.load("digits", n_val=1_797)  # nothing left for training
    with pytest.raises(ValueError, match="60,000 training images"):
        data.load("fashion_mnist", n_train=60_001)
    with pytest.raises(ValueError, match="10,000 held-out images"):
        data.load("cifar10", n_val=12_000)
    assert len(data.load("digits", n_train=1_400, n_val=397).train) == 1_400  # exactly all 1,797


# ---------------------------------------------------------------- stand-ins


@pytest.fixture(scope="module")
def standin_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("standin-data")
    data.write_standins(root)
    return root


@pytest.mark.slow
def test_standins_have_the_real_formats_sizes_and_classes(standin_root):
    d = standin_root / "standin"
    fm = {f.name: data.read_idx(d / "fashion_mnist" / f.name) for f in data.FASHION_MNIST_FILES}
    xtr, ytr, xte, yte = (fm[f.name] for f in data.FASHION_MNIST_FILES)
    # Fashion-MNIST: 60,000 + 10,000 28x28 uint8 images, uint8 labels 0..9 (IDX magic 0x803 / 0x801)
    assert (xtr.shape, xtr.dtype, ytr.shape, ytr.dtype) == ((60_000, 28, 28), np.uint8, (60_000,), np.uint8)
    assert (xte.shape, yte.shape) == ((10_000, 28, 28), (10_000,))
    with gzip.open(d / "fashion_mnist" / "train-images-idx3-ubyte.gz") as f:
        assert f.read(16) == bytes.fromhex("00000803 0000ea60 0000001c 0000001c")
    with gzip.open(d / "fashion_mnist" / "t10k-labels-idx1-ubyte.gz") as f:
        assert f.read(8) == bytes.fromhex("00000801 00002710")
    # CIFAR-10: data_batch_1..5 and test_batch of 10,000 rows of 3,072 bytes, labels a list, batches.meta
    archive = d / "cifar10" / "cifar-10-python.tar.gz"
    with tarfile.open(archive) as tar:
        names = sorted(m.name for m in tar.getmembers())
        b1 = pickle.load(tar.extractfile("cifar-10-batches-py/data_batch_1"), encoding="bytes")
        meta = pickle.load(tar.extractfile("cifar-10-batches-py/batches.meta"), encoding="bytes")
    assert names == sorted(
        [f"cifar-10-batches-py/data_batch_{i}" for i in range(1, 6)]
        + ["cifar-10-batches-py/test_batch", "cifar-10-batches-py/batches.meta"]
    )
    assert b1[b"data"].shape == (10_000, 3072) and b1[b"data"].dtype == np.uint8
    assert isinstance(b1[b"labels"], list) and len(b1[b"labels"]) == 10_000
    assert meta[b"label_names"][0] == b"airplane" and len(meta[b"label_names"]) == 10
    ctr, cytr, cte, cyte = data.read_cifar10(archive)
    assert ctr.shape == (50_000, 3, 32, 32) and cte.shape == (10_000, 3, 32, 32) and ctr.dtype == np.uint8
    for y in (ytr, yte, cytr, cyte):
        counts = np.bincount(y, minlength=10)
        assert len(counts) == 10 and counts.min() == counts.max() == len(y) // 10, "balanced, 10 classes"
    for x in (xtr, ctr):  # images, not constants: a spread of grey levels in every class
        assert 40 < x.std() < 100 and len(np.unique(x[:100])) > 200


def test_standins_are_deterministic():
    a = data.standin_images(300, (3, 32, 32), seed=7)
    b = data.standin_images(300, (3, 32, 32), seed=7)
    c = data.standin_images(300, (3, 32, 32), seed=8)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and not np.array_equal(a[0], c[0])


@pytest.mark.slow
def test_standin_files_are_the_same_bytes_every_time(standin_root, tmp_path):
    data.write_standins(tmp_path, which=("fashion_mnist",))
    for f in data.FASHION_MNIST_FILES:
        assert data.md5sum(tmp_path / "standin/fashion_mnist" / f.name) == data.md5sum(
            standin_root / "standin/fashion_mnist" / f.name
        ), f.name


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fashion_mnist", "cifar10"])
def test_a_small_cnn_learns_the_standin_but_not_perfectly(standin_root, name, monkeypatch, capsys):
    from utils import models, train

    monkeypatch.setenv("LAB_DATA", "standin")
    splits = data.load(name, n_train=3000, n_val=1000, root=standin_root)
    assert data.standin_notice(name) in capsys.readouterr().out
    assert "STAND-IN" in data.standin_notice(name)
    torch.manual_seed(0)
    net = models.net_for(splits.shape, width=16)
    h = train.fit(
        net,
        data.make_loader(splits.train, 64),
        torch.optim.Adam(net.parameters(), lr=2e-3),
        epochs=2,
        val_loader=data.make_loader(splits.val, 500, shuffle=False),
        progress=False,
    )
    assert 0.4 < h.val_acc < 0.98, f"{name} stand-in: {h.val_acc:.3f} (chance 0.1; learnable, not trivial)"


@pytest.mark.slow
def test_without_the_switch_nothing_reads_the_standins(standin_root, monkeypatch, capsys):
    monkeypatch.delenv("LAB_DATA", raising=False)
    monkeypatch.setenv("DATA_DIR", str(standin_root))  # the stand-ins are right there...
    with pytest.raises(data.DatasetUnavailable, match="Fashion-MNIST is not available"):
        data.load("fashion_mnist", download=False)  # ...but the real path ignores them
    with pytest.raises(data.DatasetUnavailable, match="downloading is off"):
        data.load("cifar10", download=False)
    assert "STAND-IN" not in capsys.readouterr().out
    monkeypatch.setenv("LAB_DATA", "real")
    with pytest.raises(data.DatasetUnavailable):
        data.load("fashion_mnist", download=False)


def test_the_switch_is_explicit_and_a_missing_standin_says_how_to_make_it(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_DATA", "stand-in-please")
    with pytest.raises(ValueError, match="LAB_DATA=standin"):
        data.load("fashion_mnist", root=tmp_path)
    monkeypatch.setenv("LAB_DATA", "standin")
    with pytest.raises(data.DatasetUnavailable, match=r"python -m utils.data standins"):
        data.load("cifar10", root=tmp_path)
    assert len(data.load("digits").train) == 1400  # digits is bundled: no stand-in involved


def test_standins_command_line(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "write_standins", lambda root: [Path(root) / "standin" / "x"])
    assert data.main(["standins", "--root", str(tmp_path)]) == 0
    with pytest.raises(SystemExit):
        data.main([])


# ---------------------------------------------------------------- loaders


@pytest.mark.parametrize("kind", ["device", "dataloader"])
@pytest.mark.parametrize("n,batch", [(23, 5), (20, 4)])
def test_every_sample_exactly_once_per_epoch(kind, n, batch):
    ds = torch.utils.data.TensorDataset(torch.arange(n).float()[:, None], torch.arange(n))
    loader = data.make_loader(ds, batch, kind=kind, seed=3)
    orders = []
    for epoch in range(2):
        loader.set_epoch(epoch) if hasattr(loader, "set_epoch") else loader.sampler.set_epoch(epoch)
        seen = torch.cat([y for _, y in loader])
        assert sorted(seen.tolist()) == list(range(n)), f"{kind}: epoch {epoch} did not yield each sample once"
        orders.append(seen.tolist())
    assert orders[0] != orders[1], "set_epoch must reshuffle"
    assert len(loader) == -(-n // batch)


@pytest.mark.parametrize("kind", ["device", "dataloader"])
@pytest.mark.parametrize("n,world", [(24, 4), (23, 3), (10, 4)])
def test_rank_shards_are_disjoint_and_cover(kind, n, world):
    ds = torch.utils.data.TensorDataset(torch.zeros(n, 1), torch.arange(n))
    shards = []
    for rank in range(world):
        loader = data.make_loader(ds, 4, kind=kind, rank=rank, world_size=world, seed=7)
        shards.append(torch.cat([y for _, y in loader]).tolist())
    sizes = {len(s) for s in shards}
    assert sizes == {-(-n // world)}, "every rank must get the same number of samples (padding)"
    union = set().union(*shards)
    assert union == set(range(n)), "the shards together must cover the dataset"
    if n % world == 0:
        for i in range(world):
            for j in range(i + 1, world):
                assert not set(shards[i]) & set(shards[j]), "shards must be disjoint"
    else:  # padding repeats exactly total - n samples, as DistributedSampler does
        assert sum(len(s) for s in shards) - n == -(-n // world) * world - n


@pytest.mark.parametrize("n,world,rank,epoch", [(23, 3, 1, 0), (23, 3, 2, 5), (10, 4, 3, 1), (16, 1, 0, 2)])
def test_device_loader_matches_distributed_sampler(n, world, rank, epoch):
    ds = torch.utils.data.TensorDataset(torch.zeros(n, 1), torch.arange(n))
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=11)
    sampler.set_epoch(epoch)
    loader = data.DeviceLoader(ds, 3, rank=rank, world_size=world, seed=11)
    loader.set_epoch(epoch)
    assert loader.indices().tolist() == list(sampler)


def test_device_loader_drop_last_and_bad_batch():
    ds = torch.utils.data.TensorDataset(torch.zeros(10, 1), torch.arange(10))
    loader = data.DeviceLoader(ds, 4, drop_last=True)
    assert [len(y) for _, y in loader] == [4, 4] and len(loader) == 2
    with pytest.raises(ValueError, match="batch_size"):
        data.DeviceLoader(ds, 0)
    with pytest.raises(ValueError, match="loader kind"):
        data.make_loader(ds, 4, kind="magic")
