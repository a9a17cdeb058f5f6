"""Datasets and loaders.

Datasets come back as ``torch.utils.data.TensorDataset`` of float32 images (N, C, H, W),
normalised per channel with the training split's statistics, and int64 labels:

* ``digits``: scikit-learn's bundled 8x8 handwritten digits (1,797 images): the offline default;
* ``fashion_mnist`` (4 IDX gz files) and ``cifar10`` (``cifar-10-python.tar.gz``): downloaded
  from their canonical mirrors into ``DATA_DIR`` (default ``~/.cache/scaling-labs``),
  MD5-verified, written atomically (a partial download never has the final name);
* ``synthetic``: random tensors of any image shape, for throughput work.

Text, for the language model, as bytes (one token per byte, a vocabulary of 256: no tokenizer):

* ``stdlib``: the Python standard library's own source files, on every machine
  (:func:`stdlib_text`: the top-level ``.py`` files in name order, cut at a byte count);
* ``shakespeare``: Tiny Shakespeare (Karpathy's char-rnn, 1,115,394 bytes), downloaded and
  MD5-verified like the image datasets (:func:`shakespeare_text`).

:func:`load_tokens` splits a corpus into train and validation token tensors, and
:class:`TokenBatches` samples random windows of them as (input, shifted target) batches.

Stand-ins, for machines without the internet: ``python -m utils.data standins [--root DIR]``
writes learnable synthetic look-alikes of Fashion-MNIST, CIFAR-10 and Tiny Shakespeare (the real
sizes, shapes, class counts and file formats) into ``DATA_DIR/standin/``. They are used ONLY when asked:
``LAB_DATA=standin``; the loaders then say so in one printed line. Without it nothing reads them.

Loaders: :class:`DeviceLoader` keeps the whole dataset on the device and serves index slices
(the airbench pattern); :func:`make_loader` builds it or the standard ``DataLoader``. Both
shard by rank exactly as ``DistributedSampler`` does (same permutation, same padding), and
both need ``set_epoch(epoch)`` to reshuffle, as ``DistributedSampler`` does (``fit`` calls it).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import math
import os
import pickle
import shutil
import sysconfig
import tarfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from .files import SHM_DIR, atomic_open, shm_free_bytes

NUM_CLASSES = 10


# ----------------------------------------------------------------------------------------
# Downloads: verified and atomic
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteFile:
    name: str  # file name in the data directory
    urls: tuple[str, ...]  # mirrors, tried in order
    md5: str


FASHION_MNIST_FILES = tuple(
    RemoteFile(
        name,
        (
            "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/" + name,
            "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/" + name,
        ),
        md5,
    )
    for name, md5 in [
        ("train-images-idx3-ubyte.gz", "8d4fb7e6c68d591d4c3dfef9ec88bf0d"),
        ("train-labels-idx1-ubyte.gz", "25c81989df183df01b3e8a0aad5dffbe"),
        ("t10k-images-idx3-ubyte.gz", "bef4ecab320f06d8554ea6380940ec79"),
        ("t10k-labels-idx1-ubyte.gz", "bb300cfdad3c16e7a12a480ee83cd310"),
    ]
)

CIFAR10_FILES = (
    RemoteFile(
        "cifar-10-python.tar.gz",
        ("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",),
        "c58f30108f718f92721af3b95e74349a",
    ),
)


SHAKESPEARE_FILE = RemoteFile(
    "input.txt",
    ("https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",),
    "6fb458f1232090904fb40fe944165e91",  # the blob of karpathy/char-rnn's only commit of the file
)
SHAKESPEARE_BYTES = 1_115_394


class DatasetUnavailable(RuntimeError):
    """A dataset file is missing (offline) or failed its checksum."""


def data_dir(path: str | os.PathLike | None = None) -> Path:
    """Where datasets live: ``path``, else ``$DATA_DIR``, else ``~/.cache/scaling-labs``."""
    p = path or os.environ.get("DATA_DIR") or Path.home() / ".cache" / "scaling-labs"
    return Path(p).expanduser()


def md5sum(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def _by_hand(files, directory: Path) -> str:
    return (
        "\n".join(f"  {f.name}  (md5 {f.md5})  from {f.urls[0]}" for f in files)
        + f"\nDownload them on a machine with internet access and place them in {directory}/ "
        "(or set DATA_DIR to the folder that holds them)."
    )


def fetch(remote: RemoteFile, directory: str | os.PathLike, *, download: bool = True, timeout: float = 60.0) -> Path:
    """Return the verified local copy of ``remote``, downloading it if needed.

    The download goes to ``NAME.part`` and is renamed only after its MD5 matches, so a file
    under its final name is always complete and verified.
    """
    directory = Path(directory)
    final = directory / remote.name
    if final.exists():
        if md5sum(final) == remote.md5:
            return final
        raise DatasetUnavailable(
            f"{final} exists but its MD5 is {md5sum(final)}, not {remote.md5}: the file is corrupt "
            f"or a different version. Delete it to download again, or replace it by hand:\n"
            + _by_hand([remote], directory)
        )
    if not download:
        raise DatasetUnavailable(f"{final} is missing and downloading is off:\n" + _by_hand([remote], directory))
    directory.mkdir(parents=True, exist_ok=True)
    part = directory / f"{remote.name}.part{os.getpid()}"
    errors = []
    for url in remote.urls:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r, open(part, "wb") as out:
                shutil.copyfileobj(r, out, 1 << 20)
            got = md5sum(part)
            if got != remote.md5:
                errors.append(f"{url}: MD5 {got} does not match {remote.md5}")
                continue
            os.replace(part, final)  # atomic on one file system
            return final
        except (urllib.error.URLError, OSError, ValueError) as e:
            errors.append(f"{url}: {e}")
        finally:
            part.unlink(missing_ok=True)
    raise DatasetUnavailable(
        f"could not download {remote.name} ({'; '.join(errors)}).\n" + _by_hand([remote], directory)
    )


# ----------------------------------------------------------------------------------------
# Parsers
# ----------------------------------------------------------------------------------------

_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (the MNIST format), gzipped or not."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path} is not an IDX file (bad magic number {raw[:4].hex()})")
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    offset = 4 + 4 * ndim
    expected = offset + int(np.prod(shape)) * dtype.itemsize
    if len(raw) != expected:
        raise ValueError(f"{path}: header says {shape} ({expected} bytes) but the file has {len(raw)}")
    return np.frombuffer(raw, dtype=dtype, offset=offset).reshape(shape).copy()  # writable


def read_cifar10(archive: str | os.PathLike) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test) from ``cifar-10-python.tar.gz``; x is uint8 NCHW."""
    parts: dict[str, dict] = {}
    with tarfile.open(archive, "r:gz") as tar:
        for m in tar.getmembers():
            base = os.path.basename(m.name)
            if m.isfile() and (base.startswith("data_batch_") or base == "test_batch"):
                # Trusted input: the archive's MD5 was verified before we got here.
                parts[base] = pickle.load(tar.extractfile(m), encoding="bytes")
    train_names = sorted(k for k in parts if k.startswith("data_batch_"))
    if not train_names or "test_batch" not in parts:
        raise ValueError(f"{archive} holds no data_batch_* / test_batch: not the CIFAR-10 python archive")

    def xy(names):
        x = np.concatenate([np.asarray(parts[n][b"data"], dtype=np.uint8) for n in names])
        y = np.concatenate([np.asarray(parts[n][b"labels"], dtype=np.int64) for n in names])
        return x.reshape(-1, 3, 32, 32), y

    return (*xy(train_names), *xy(["test_batch"]))


# ----------------------------------------------------------------------------------------
# Datasets
# ----------------------------------------------------------------------------------------


@dataclass
class Splits:
    train: TensorDataset
    val: TensorDataset
    name: str
    num_classes: int = NUM_CLASSES

    @property
    def shape(self) -> tuple[int, ...]:
        """(C, H, W) of one image."""
        return tuple(self.train.tensors[0].shape[1:])

    def __repr__(self):
        return (
            f"Splits({self.name}: train {len(self.train)}, val {len(self.val)}, "
            f"image {self.shape}, {self.num_classes} classes)"
        )


def _subset(x, y, n, seed):
    if n is None or n >= len(y):
        return x, y
    idx = np.random.default_rng(seed).permutation(len(y))[:n]
    return x[idx], y[idx]


def _to_splits(name, x_tr, y_tr, x_va, y_va) -> Splits:
    x_tr = torch.as_tensor(np.ascontiguousarray(x_tr), dtype=torch.float32)
    x_va = torch.as_tensor(np.ascontiguousarray(x_va), dtype=torch.float32)
    dims = (0, 2, 3)
    mean = x_tr.mean(dims, keepdim=True)
    std = x_tr.std(dims, keepdim=True).clamp_min(1e-6)
    norm = lambda x: ((x - mean) / std).contiguous()  # noqa: E731
    return Splits(
        TensorDataset(norm(x_tr), torch.as_tensor(y_tr, dtype=torch.int64)),
        TensorDataset(norm(x_va), torch.as_tensor(y_va, dtype=torch.int64)),
        name,
    )


def load_digits(n_train: int | None = None, n_val: int | None = 397, seed: int = 0) -> Splits:
    """scikit-learn's 8x8 digits: a fixed shuffled split, ``n_val`` held out, the rest for training."""
    from sklearn.datasets import load_digits as _sk

    d = _sk()
    x = d.images.astype(np.float32)[:, None]  # (1797, 1, 8, 8), values 0..16
    y = d.target.astype(np.int64)
    order = np.random.default_rng(1234).permutation(len(y))  # fixed: val never leaks into train
    n_val = n_val or DIGITS_DEFAULT_N_VAL
    va, tr = order[:n_val], order[n_val:]
    x_tr, y_tr = _subset(x[tr], y[tr], n_train, seed)
    return _to_splits("digits", x_tr, y_tr, x[va], y[va])


def load_fashion_mnist(
    n_train: int | None = None,
    n_val: int | None = None,
    seed: int = 0,
    root: str | os.PathLike | None = None,
    download: bool = True,
) -> Splits:
    if use_standins():
        paths = _standin_paths("fashion_mnist", root)
        print(standin_notice("fashion_mnist"), flush=True)
    else:
        d = data_dir(root) / "fashion_mnist"
        try:
            paths = [fetch(f, d, download=download) for f in FASHION_MNIST_FILES]
        except DatasetUnavailable as e:
            raise DatasetUnavailable(
                f"Fashion-MNIST is not available: {str(e).splitlines()[0]}\n"
                "All four files:\n" + _by_hand(FASHION_MNIST_FILES, d)
            ) from None
    xtr, ytr, xte, yte = (read_idx(p) for p in paths)
    x_tr, y_tr = _subset(xtr[:, None], ytr.astype(np.int64), n_train, seed)
    x_va, y_va = _subset(xte[:, None], yte.astype(np.int64), n_val, seed + 1)
    return _to_splits("fashion_mnist", x_tr, y_tr, x_va, y_va)


def load_cifar10(
    n_train: int | None = None,
    n_val: int | None = None,
    seed: int = 0,
    root: str | os.PathLike | None = None,
    download: bool = True,
) -> Splits:
    if use_standins():
        (archive,) = _standin_paths("cifar10", root)
        print(standin_notice("cifar10"), flush=True)
    else:
        archive = fetch(CIFAR10_FILES[0], data_dir(root) / "cifar10", download=download)
    xtr, ytr, xte, yte = read_cifar10(archive)
    x_tr, y_tr = _subset(xtr, ytr, n_train, seed)
    x_va, y_va = _subset(xte, yte, n_val, seed + 1)
    return _to_splits("cifar10", x_tr, y_tr, x_va, y_va)


def synthetic(
    n: int, shape: tuple[int, ...] = (3, 32, 32), num_classes: int = NUM_CLASSES, seed: int = 0
) -> TensorDataset:
    """Random images and labels of any shape, for throughput work where content doesn't matter."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, *shape, generator=g), torch.randint(0, num_classes, (n,), generator=g))


DATASETS = {"digits": load_digits, "fashion_mnist": load_fashion_mnist, "cifar10": load_cifar10}

# Images each dataset can give: (training split, held-out split); digits is one pool of 1,797 that
# load_digits cuts into n_val held out and the rest for training.
DATASET_SIZES = {"digits": (1797, None), "fashion_mnist": (60_000, 10_000), "cifar10": (50_000, 10_000)}
DIGITS_DEFAULT_N_VAL = 397


def check_sizes(name: str, n_train: int | None, n_val: int | None) -> None:
    """Refuse sizes ``name`` cannot give, naming the profile row to change (a silent cap would
    hand a notebook fewer images than its profile promises, or none at all for training)."""
    fix = "lower the profile's n_train/n_val row in utils/config.py"
    for what, n in (("n_train", n_train), ("n_val", n_val)):
        if n is not None and n < 0:
            raise ValueError(f"{what} = {n:,} is negative: {fix}")
    n_tr, n_va = DATASET_SIZES[name]
    if n_va is None:  # one pool
        val = n_val or DIGITS_DEFAULT_N_VAL
        if n_train and n_train + val > n_tr:
            raise ValueError(f"n_train + n_val = {n_train + val:,} but {name} has {n_tr:,} images: {fix}")
        if val >= n_tr:
            raise ValueError(f"n_val = {val:,} but {name} has {n_tr:,} images, none left for training: {fix}")
        return
    if n_train is not None and n_train > n_tr:
        raise ValueError(f"n_train = {n_train:,} but {name} has {n_tr:,} training images: {fix}")
    if n_val is not None and n_val > n_va:
        raise ValueError(f"n_val = {n_val:,} but {name} has {n_va:,} held-out images: {fix}")


def load(name: str, n_train: int | None = None, n_val: int | None = None, seed: int = 0, **kw) -> Splits:
    """Load a dataset by name (``digits``, ``fashion_mnist``, ``cifar10``).

    ``n_train`` / ``n_val`` larger than the dataset are refused (:func:`check_sizes`), never capped."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    check_sizes(name, n_train, n_val)
    return DATASETS[name](n_train=n_train, n_val=n_val, seed=seed, **kw)


# ----------------------------------------------------------------------------------------
# Text: byte-level tokens for the language model
# ----------------------------------------------------------------------------------------

TEXT_CORPORA = ("stdlib", "shakespeare")
VOCAB_SIZE = 256  # one token per byte


def stdlib_text(n_bytes: int | None = None) -> bytes:
    """The first ``n_bytes`` (None: all) of the Python standard library's top-level ``.py`` files
    (``sysconfig.get_paths()["stdlib"]``), read whole in file-name order and concatenated, the
    last one cut. No packages: neither ``site-packages`` nor the test suites. The same bytes every
    call with one Python; another Python version has other sources."""
    folder = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(folder.glob("*.py"), key=lambda p: p.name)
    total = sum(p.stat().st_size for p in files)
    if n_bytes is None:
        n_bytes = total
    if not 1 <= n_bytes <= total:
        raise ValueError(
            f"stdlib_text: {n_bytes:,} bytes asked, but the standard library's top-level sources in "
            f"{folder} hold {total:,}. Try: a size between 1 and {total:,} (the gpt_corpus_bytes row)."
        )
    parts, have = [], 0
    for p in files:
        chunk = p.read_bytes()[: n_bytes - have]
        parts.append(chunk)
        have += len(chunk)
        if have == n_bytes:
            break
    return b"".join(parts)


def shakespeare_text(root: str | os.PathLike | None = None, download: bool = True) -> bytes:
    """Tiny Shakespeare's 1,115,394 bytes, downloaded into ``DATA_DIR/shakespeare/`` and
    MD5-verified (:func:`fetch`); with ``LAB_DATA=standin``, its stand-in instead."""
    if use_standins():
        (path,) = _standin_paths("shakespeare", root)
        print(standin_notice("shakespeare"), flush=True)
    else:
        path = fetch(SHAKESPEARE_FILE, data_dir(root) / "shakespeare", download=download)
    return path.read_bytes()


def load_text(name: str, n_bytes: int | None = None, **kw: Any) -> bytes:
    """A corpus by name: ``stdlib`` (``n_bytes`` of it, None: all) or ``shakespeare`` (all of
    it, or its first ``n_bytes``); ``kw`` go to :func:`shakespeare_text` (``root``, ``download``).
    More bytes than the corpus has are refused, never capped."""
    if name == "stdlib":
        return stdlib_text(n_bytes)
    if name == "shakespeare":
        text = shakespeare_text(**kw)
        if n_bytes is not None and not 1 <= n_bytes <= len(text):
            raise ValueError(
                f"load_text: {n_bytes:,} bytes asked, but Tiny Shakespeare has {len(text):,}. "
                "Try: None for all of it (the gpt_corpus_bytes row)."
            )
        return text if n_bytes is None else text[:n_bytes]
    raise ValueError(f"load_text: unknown corpus {name!r}. Try: one of {', '.join(TEXT_CORPORA)}.")


@dataclass
class TextSplits:
    """Byte tokens of a corpus (uint8: every byte is its own token id), split in two contiguous
    parts: the first for training, the rest held out."""

    train: torch.Tensor
    val: torch.Tensor
    name: str
    vocab_size: int = VOCAB_SIZE

    def __repr__(self):
        return f"TextSplits({self.name}: train {len(self.train):,} tokens, val {len(self.val):,} tokens)"


def encode(text: str | bytes) -> torch.Tensor:
    """Bytes (a ``str`` as UTF-8) as a uint8 token tensor."""
    raw = text.encode() if isinstance(text, str) else bytes(text)
    return torch.tensor(np.frombuffer(raw, dtype=np.uint8))


def decode(tokens: torch.Tensor) -> str:
    """Token ids back to text (UTF-8; a sequence cut inside a character shows U+FFFD there)."""
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def load_tokens(name: str, n_bytes: int | None = None, val_fraction: float = 0.1, **kw: Any) -> TextSplits:
    """:func:`load_text`, as tokens: the first ``1 - val_fraction`` for training, the rest held out."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"load_tokens: val_fraction must be in (0, 1), got {val_fraction}. Try: 0.1.")
    tokens = encode(load_text(name, n_bytes, **kw))
    cut = len(tokens) - max(1, int(len(tokens) * val_fraction))
    return TextSplits(tokens[:cut], tokens[cut:], name)


class TokenBatches:
    """Random windows of a token tensor as language-model batches, forever: each ``next()`` draws
    ``batch`` start positions uniformly and returns ``(x, y)``, both (batch, context) int64 on
    ``device``, with ``y`` the ``context + 1``-token window shifted by one (``y[:, t]`` is the
    token after ``x[:, t]``).

    The tokens are copied to ``device`` once; the starts come from a generator on ``device``
    seeded with ``seed`` (the same seed, the same batches; give each rank its own), and the
    windows are gathered there: no host synchronisation per batch."""

    def __init__(
        self,
        tokens: torch.Tensor,
        batch: int,
        context: int,
        *,
        device: str | torch.device | None = None,
        seed: int = 0,
    ):
        if batch < 1 or context < 1:
            raise ValueError(f"TokenBatches: batch and context must be >= 1, got {batch} and {context}")
        if len(tokens) < context + 1:
            raise ValueError(
                f"TokenBatches: {len(tokens):,} tokens cannot give a window of context + 1 = {context + 1}. "
                "Try: a shorter context or more text."
            )
        self.device = torch.device(device) if device is not None else tokens.device
        self.tokens = tokens.to(self.device)
        self.batch, self.context = batch, context
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._offsets = torch.arange(context + 1, device=self.device)

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        high = len(self.tokens) - self.context  # the last window ends on the last token
        starts = torch.randint(0, high, (self.batch, 1), device=self.device, generator=self.generator)
        window = self.tokens[starts + self._offsets]  # (batch, context + 1)
        return window[:, :-1].long().contiguous(), window[:, 1:].long().contiguous()


# ----------------------------------------------------------------------------------------
# Stand-ins: learnable synthetic look-alikes, for machines without the internet
# ----------------------------------------------------------------------------------------

STANDIN_ENV = "LAB_DATA"  # LAB_DATA=standin switches them on; unset or "real": real data
STANDIN_COMMAND = "python -m utils.data standins"
STANDIN_NAMES = {"fashion_mnist": "Fashion-MNIST", "cifar10": "CIFAR-10", "shakespeare": "Tiny Shakespeare"}
STANDIN_FILES = {
    "fashion_mnist": tuple(f.name for f in FASHION_MNIST_FILES),
    "cifar10": (CIFAR10_FILES[0].name,),
    "shakespeare": (SHAKESPEARE_FILE.name,),
}
CIFAR10_LABEL_NAMES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


def use_standins() -> bool:
    """True when ``LAB_DATA=standin``; an unknown value is an error, not a silent fallback."""
    v = os.environ.get(STANDIN_ENV, "").strip().lower()
    if v in ("", "real"):
        return False
    if v == "standin":
        return True
    raise ValueError(
        f"{STANDIN_ENV}={v!r}: use {STANDIN_ENV}=standin for the synthetic stand-ins "
        f"(made by `{STANDIN_COMMAND}`), or leave it unset for the real datasets"
    )


def standin_dir(root: str | os.PathLike | None = None) -> Path:
    """Where the stand-ins live: ``DATA_DIR/standin`` (never where the real files go)."""
    return data_dir(root) / "standin"


def standin_notice(name: str) -> str:
    what = "text" if name == "shakespeare" else "images"
    return f"{STANDIN_NAMES[name]}: STAND-IN data (synthetic, made by `{STANDIN_COMMAND}`), not the real {what}"


def _standin_paths(name: str, root=None) -> list[Path]:
    d = standin_dir(root) / name
    paths = [d / f for f in STANDIN_FILES[name]]
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        raise DatasetUnavailable(
            f"{STANDIN_ENV}=standin but the {STANDIN_NAMES[name]} stand-in is missing from {d}/ "
            f"({', '.join(missing)}): run `{STANDIN_COMMAND}`"
            + (f" --root {data_dir(root)}" if root or os.environ.get("DATA_DIR") else "")
            + f", or unset {STANDIN_ENV} for the real data"
        )
    return paths


def _class_templates(rng, shape, shift: int) -> np.ndarray:
    """(10, 2s+1, 2s+1, C, H, W) float32 in [0, 1]: per class a few soft blobs, and every shift of it
    by -s..s pixels. Blobs in a C-channel image get a class colour; each class is distinct."""
    c, h, w = shape
    H, W = h + 2 * shift, w + 2 * shift
    yy, xx = np.mgrid[0:H, 0:W].astype(np.float32)
    out = np.zeros((NUM_CLASSES, 2 * shift + 1, 2 * shift + 1, c, h, w), np.float32)
    for k in range(NUM_CLASSES):
        big = np.zeros((c, H, W), np.float32)
        for _ in range(rng.integers(2, 5)):
            cy, cx = rng.uniform(shift + 0.2 * h, shift + 0.8 * h), rng.uniform(shift + 0.2 * w, shift + 0.8 * w)
            sy, sx = rng.uniform(0.06, 0.22) * h, rng.uniform(0.06, 0.22) * w
            blob = np.exp(-0.5 * (((yy - cy) / sy) ** 2 + ((xx - cx) / sx) ** 2))
            colour = rng.uniform(0.3, 1.0, c).astype(np.float32)[:, None, None]
            big += colour * blob
        big /= big.max()
        for dy in range(2 * shift + 1):
            for dx in range(2 * shift + 1):
                out[k, dy, dx] = big[:, dy : dy + h, dx : dx + w]
    return out


def standin_images(
    n: int,
    shape: tuple[int, ...],
    seed: int,
    *,
    shift: int = 3,
    blend: float = 0.45,
    noise: float = 0.25,
    templates_seed: int = 20,
) -> tuple[np.ndarray, np.ndarray]:
    """``n`` uint8 images of ``shape`` (C, H, W) and balanced int64 labels 0..9.

    Image = (1 - a) * template[label] + a * template[other] (a uniform in [0, blend]), shifted by up
    to ``shift`` pixels, random contrast and background, plus Gaussian pixel noise: a CNN learns it
    well, but near a = 0.5 the classes overlap, so it cannot be learnt perfectly."""
    tmpl = _class_templates(np.random.default_rng(templates_seed + shape[0]), shape, shift)
    rng = np.random.default_rng(seed)
    y = rng.permutation(np.arange(n) % NUM_CLASSES).astype(np.int64)
    x = np.empty((n, *shape), np.uint8)
    s = 2 * shift + 1
    for lo in range(0, n, 5000):
        m = min(n, lo + 5000) - lo
        yb = y[lo : lo + m]
        other = (yb + rng.integers(1, NUM_CLASSES, m)) % NUM_CLASSES
        dy, dx = rng.integers(0, s, m), rng.integers(0, s, m)
        a = rng.uniform(0, blend, m).astype(np.float32)[:, None, None, None]
        img = (1 - a) * tmpl[yb, dy, dx] + a * tmpl[other, dy, dx]
        contrast = rng.uniform(0.5, 1.0, (m, 1, 1, 1)).astype(np.float32)
        background = rng.uniform(0.0, 0.3, (m, shape[0], 1, 1)).astype(np.float32)
        img = background + contrast * img + noise * rng.standard_normal(img.shape, dtype=np.float32)
        x[lo : lo + m] = np.clip(img * 255, 0, 255).astype(np.uint8)
    return x, y


def _pseudo_words(rng, n: int) -> list[str]:
    """``n`` distinct pronounceable made-up words of one to three syllables, two letters or more."""
    onsets = ["", "b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "w", "br", "st", "th", "sh", "gr"]
    vowels = ["a", "e", "i", "o", "u", "ea", "ou", "ai", "ee", "y"]
    codas = ["", "", "n", "r", "s", "t", "d", "l", "ng", "st", "th", "ll"]
    words: dict[str, None] = {}
    while len(words) < n:
        syllables = rng.integers(1, 4)
        w = "".join(onsets[rng.integers(len(onsets))] + vowels[rng.integers(len(vowels))] for _ in range(syllables))
        w += codas[rng.integers(len(codas))]
        if len(w) > 1:
            words[w] = None
    return list(words)


def standin_text(n_bytes: int = SHAKESPEARE_BYTES, seed: int = 5) -> bytes:
    """``n_bytes`` of ASCII in Tiny Shakespeare's format: speeches of one to eight lines, each under
    its speaker's name in capitals and a colon, separated by blank lines, the last byte a newline.
    The words are made up (a few thousand, drawn with Zipf-like frequencies), the speakers too:
    a model learns the spelling, the layout and which words are frequent, as on the real text."""
    rng = np.random.default_rng(seed)
    words = sorted(_pseudo_words(rng, 3000), key=len)  # the short words the most frequent
    weights = 1.0 / np.arange(1, len(words) + 1)
    names = [" ".join(w.upper() for w in _pseudo_words(rng, 1 + (k % 3 == 0))) for k in range(60)]
    stops = [",", ",", ".", ".", ".", ";", "?", "!", ":"]
    speeches, size, drawn = [], 0, iter(())
    while size < n_bytes:
        lines = [names[rng.integers(len(names))] + ":"]
        for _ in range(rng.integers(1, 9)):
            line = []
            for _ in range(rng.integers(3, 11)):
                i = next(drawn, None)
                if i is None:  # draw word ids 100,000 at a time: one draw per word is slow
                    drawn = iter(rng.choice(len(words), 100_000, p=weights / weights.sum()).tolist())
                    i = next(drawn)
                line.append(words[i])
            line[0] = line[0].capitalize()
            lines.append(" ".join(line) + stops[rng.integers(len(stops))])
        speeches.append("\n".join(lines) + "\n")
        size += len(speeches[-1]) + 1
    return "\n".join(speeches).encode("ascii")[: n_bytes - 1] + b"\n"


def _idx_bytes(a: np.ndarray) -> bytes:
    assert a.dtype == np.uint8
    return bytes([0, 0, 0x08, a.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in a.shape) + a.tobytes()


def _write_atomic(path: Path, write) -> None:
    with atomic_open(path, fsync=False) as f:  # an archive of tens of MB, rewritten on demand
        write(f)


def _gzip_to(f, payload: bytes) -> None:
    with gzip.GzipFile(fileobj=f, mode="wb", compresslevel=1, mtime=0, filename="") as g:
        g.write(payload)


def write_standins(
    root: str | os.PathLike | None = None, *, which: tuple[str, ...] = ("fashion_mnist", "cifar10", "shakespeare")
) -> list[Path]:
    """Write the stand-ins (deterministic: the same bytes every time) into ``standin_dir(root)``:
    Fashion-MNIST's four IDX gz files (60,000 + 10,000 images, 1x28x28), CIFAR-10's
    ``cifar-10-python.tar.gz`` (data_batch_1..5 + test_batch pickles, 10,000 3x32x32 images each)
    and Tiny Shakespeare's ``input.txt`` (1,115,394 bytes of text, :func:`standin_text`)."""
    out = []
    if "shakespeare" in which:
        d = standin_dir(root) / "shakespeare"
        d.mkdir(parents=True, exist_ok=True)
        text = standin_text()
        _write_atomic(d / SHAKESPEARE_FILE.name, lambda f: f.write(text))
        out.append(d / SHAKESPEARE_FILE.name)
    if "fashion_mnist" in which:
        d = standin_dir(root) / "fashion_mnist"
        d.mkdir(parents=True, exist_ok=True)
        xtr, ytr = standin_images(60_000, (1, 28, 28), seed=1)
        xte, yte = standin_images(10_000, (1, 28, 28), seed=2)
        for name, a in zip(
            STANDIN_FILES["fashion_mnist"], (xtr[:, 0], ytr.astype(np.uint8), xte[:, 0], yte.astype(np.uint8))
        ):
            _write_atomic(d / name, lambda f, a=a: _gzip_to(f, _idx_bytes(a)))
            out.append(d / name)
    if "cifar10" in which:
        d = standin_dir(root) / "cifar10"
        d.mkdir(parents=True, exist_ok=True)
        xtr, ytr = standin_images(50_000, (3, 32, 32), seed=3)
        xte, yte = standin_images(10_000, (3, 32, 32), seed=4)
        batches = [
            (f"data_batch_{i + 1}", xtr[i * 10_000 : (i + 1) * 10_000], ytr[i * 10_000 : (i + 1) * 10_000])
            for i in range(5)
        ] + [("test_batch", xte, yte)]
        meta = {
            b"label_names": [n.encode() for n in CIFAR10_LABEL_NAMES],
            b"num_cases_per_batch": 10_000,
            b"num_vis": 3072,
        }

        def write(f):
            with (
                gzip.GzipFile(fileobj=f, mode="wb", compresslevel=1, mtime=0, filename="") as g,
                tarfile.open(fileobj=g, mode="w", format=tarfile.USTAR_FORMAT) as tar,
            ):

                def add(name, obj):
                    raw = pickle.dumps(obj, protocol=2)
                    info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
                    info.size, info.mtime, info.mode = len(raw), 0, 0o644
                    tar.addfile(info, io.BytesIO(raw))

                add("batches.meta", meta)
                for name, x, y in batches:
                    add(
                        name,
                        {
                            b"batch_label": f"STAND-IN {name}".encode(),
                            b"labels": y.tolist(),
                            b"data": x.reshape(len(y), -1),
                            b"filenames": [b"standin_%05d.png" % i for i in range(len(y))],
                        },
                    )

        _write_atomic(d / CIFAR10_FILES[0].name, write)
        out.append(d / CIFAR10_FILES[0].name)
    readme = standin_dir(root) / "README.txt"
    readme.write_text(
        f"Synthetic STAND-INS for Fashion-MNIST, CIFAR-10 and Tiny Shakespeare, made by `{STANDIN_COMMAND}`:\n"
        "images from class templates + blending + shifts + noise, text of made-up words in the play's "
        f"layout; NOT the real data. Used only with {STANDIN_ENV}=standin.\n"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m utils.data", description="dataset tools")
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser(
        "standins", help=f"write the synthetic stand-ins into DIR/standin/ (used only with {STANDIN_ENV}=standin)"
    )
    st.add_argument("--root", default=None, help="data directory (default: $DATA_DIR, else ~/.cache/scaling-labs)")
    args = ap.parse_args(argv)
    for p in write_standins(args.root):
        print(p)
    print(
        f"stand-ins written; use them with {STANDIN_ENV}=standin"
        + (f" DATA_DIR={data_dir(args.root)}" if args.root else "")
    )
    return 0


# ----------------------------------------------------------------------------------------
# Loaders
# ----------------------------------------------------------------------------------------


def shard_indices(
    n: int, *, epoch: int = 0, seed: int = 0, shuffle: bool = True, rank: int = 0, world_size: int = 1
) -> torch.Tensor:
    """The indices ``DistributedSampler(num_replicas=world_size, rank=rank)`` yields for ``epoch``:
    one permutation seeded by ``seed + epoch``, padded by wrapping to a multiple of
    ``world_size``, then every ``world_size``-th index from ``rank``."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    if shuffle:
        g = torch.Generator().manual_seed(seed + epoch)
        idx = torch.randperm(n, generator=g)
    else:
        idx = torch.arange(n)
    total = math.ceil(n / world_size) * world_size
    if total > n:
        idx = torch.cat([idx, idx.repeat(math.ceil((total - n) / n))[: total - n]])
    return idx[rank:total:world_size]


def set_epoch(loader: Any, epoch: int) -> None:
    """Tell ``loader`` (or its sampler / batch sampler) which epoch starts: a rank-sharded or
    shuffled loader draws that epoch's order from it. Loaders without ``set_epoch`` are left alone."""
    for obj in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)):
        if obj is not None and hasattr(obj, "set_epoch"):
            obj.set_epoch(epoch)
            return


class EpochLoader:
    """The one small base of the course's loaders and loader wrappers (:class:`DeviceLoader`,
    ``bench.TimedLoader``): ``set_epoch(epoch)`` keeps ``self.epoch`` and, in a wrapper
    (``self.loader`` set), passes it on to the wrapped loader with :func:`set_epoch` (the loader,
    else its sampler or batch sampler). ``len`` of a wrapper is its loader's."""

    loader = None  # the wrapped loader; None in a loader that owns its order
    epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        if self.loader is not None:
            set_epoch(self.loader, self.epoch)

    def __len__(self):
        return len(self.loader)


class DeviceLoader(EpochLoader):
    """The whole dataset on ``device``; each epoch a permutation; batches are index slices.

    No worker processes, no host-to-device copies after the first: the fastest input pipeline
    when the dataset fits in device memory.
    """

    def __init__(
        self,
        dataset: TensorDataset,
        batch_size: int,
        *,
        shuffle: bool = True,
        drop_last: bool = False,
        device: str | torch.device | None = None,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        x, y = dataset.tensors
        self.device = torch.device(device) if device is not None else x.device
        self.x, self.y = x.to(self.device), y.to(self.device)  # the one copy
        self.batch_size, self.shuffle, self.drop_last = batch_size, shuffle, drop_last
        self.rank, self.world_size, self.seed, self.epoch = rank, world_size, seed, 0
        self.dataset = dataset

    def indices(self) -> torch.Tensor:
        return shard_indices(
            len(self.y),
            epoch=self.epoch,
            seed=self.seed,
            shuffle=self.shuffle,
            rank=self.rank,
            world_size=self.world_size,
        )

    def __len__(self):
        n = math.ceil(len(self.y) / self.world_size)  # shard size, as DistributedSampler pads
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self):
        idx = self.indices().to(self.device)
        stop = len(idx) - len(idx) % self.batch_size if self.drop_last else len(idx)
        for start in range(0, stop, self.batch_size):
            b = idx[start : start + self.batch_size]
            yield self.x[b], self.y[b]


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask: taskset, cgroups, SLURM
    ``--cpus-per-task``), which can be far fewer than ``os.cpu_count()`` on a shared server."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def _check_shm(dataset, batch_size: int, workers: int, prefetch: int = 2) -> None:
    """Workers hand batches to the trainer through shared memory (/dev/shm). Docker gives a
    container 64 MB by default: a few batches of images fill it, and the workers then die with a
    bus error that names nothing useful. Check first, and say what to do."""
    free = shm_free_bytes()
    if free is None:
        return
    try:
        sample = dataset[0]
        item = sum(t.numel() * t.element_size() for t in sample if isinstance(t, torch.Tensor))
    except Exception:  # noqa: BLE001 - an unusual dataset: no estimate
        return
    need = item * batch_size * workers * prefetch  # batches in flight through shared memory
    if need > free:
        raise RuntimeError(
            f"{SHM_DIR} has {free / 2**20:,.0f} MiB free, but {workers} DataLoader workers keep about "
            f"{need / 2**20:,.0f} MiB of batches in it ({prefetch} batches of {batch_size} x "
            f"{item / 2**10:,.1f} KiB each per worker). In Docker, start the container with a bigger "
            f"--shm-size (e.g. --shm-size=8g) or --ipc=host; or use fewer workers, num_workers=0, or "
            f"kind='device' (no workers at all)."
        )


def make_loader(
    dataset: TensorDataset,
    batch_size: int,
    *,
    kind: str = "device",
    shuffle: bool = True,
    device: str | torch.device | None = None,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    num_workers: int = 0,
    pin_memory: bool | None = None,
    drop_last: bool = False,
    multiprocessing_context: str | None = None,
) -> DeviceLoader | DataLoader:
    """A loader of either kind, sharded for ``rank`` of ``world_size``.

    ``kind="device"``: :class:`DeviceLoader`. ``kind="dataloader"``: ``DataLoader`` over a
    ``DistributedSampler``, with:

    * at most as many workers as the cores this process may use (:func:`usable_cores`; more
      only queue for the same cores) -- the loader's ``num_workers`` says how many it got;
    * ``persistent_workers``: the workers live across epochs instead of restarting every epoch;
    * pinned memory only where there is CUDA to copy to (``pin_memory`` default: the device is CUDA);
    * the platform's start method (fork on Linux). Workers index a CPU dataset and collate on
      the CPU; they never call CUDA, so fork is safe even after this process initialised CUDA
      (what is unsafe is *using* CUDA in a forked child), and it starts workers without
      re-importing everything and pickling the dataset as spawn does. A dataset whose tensors
      live on a GPU would make the workers use CUDA: that is refused with a message.
      ``multiprocessing_context`` overrides the start method.
    * a clear error, before any worker starts, when /dev/shm is too small for the batches.
    """
    if kind == "device":
        return DeviceLoader(
            dataset,
            batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            device=device,
            rank=rank,
            world_size=world_size,
            seed=seed,
        )
    if kind != "dataloader":
        raise ValueError(f"unknown loader kind {kind!r}; use 'device' or 'dataloader'")
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed)
    if pin_memory is None:
        pin_memory = device is not None and torch.device(device).type == "cuda"
    pin_memory = bool(pin_memory) and torch.cuda.is_available()
    workers = max(0, min(int(num_workers), usable_cores()))
    if workers > 0:
        tensors = getattr(dataset, "tensors", None) or getattr(getattr(dataset, "dataset", None), "tensors", ())
        if any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in tensors):
            raise ValueError(
                "this dataset's tensors are on the GPU, so DataLoader workers would have to use "
                "CUDA in child processes; use kind='device' (batches are slices on the GPU, no "
                "workers needed) or num_workers=0"
            )
        _check_shm(dataset, batch_size, workers)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        pin_memory=pin_memory,
        drop_last=drop_last,
        persistent_workers=workers > 0,
        multiprocessing_context=multiprocessing_context if workers > 0 else None,
    )


if __name__ == "__main__":
    raise SystemExit(main())
