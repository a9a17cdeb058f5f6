"""A faithful fake of a CUDA machine, for testing the GPU paths on a CPU-only CI box.

``FakeCuda(n).install(setattr)`` makes ``torch.cuda`` look like a machine with ``n`` visible GPUs
where the calls keep torch's real semantics where it matters:

* ``set_device`` goes through torch's own ``_get_device_index``: an index is required (a bare
  ``torch.device("cuda")`` raises ``ValueError``, as on a real GPU), a CPU device raises, and an
  index beyond the visible GPUs raises "invalid device ordinal";
* ``torch.cuda.device(d)`` is a context that switches the current device and restores it;
* events remember the device current when they were made, and the stream they were recorded on;
* ``get_device_properties(i).uuid`` is the GPU's own, so ranks that see different GPUs (a
  per-rank CUDA_VISIBLE_DEVICES) can tell them apart.

NCCL-only logic runs on gloo through the same code path: with ``nccl_on_gloo=True``,
``dist.is_nccl_available()`` is True and ``init_process_group("nccl", ...)`` creates a gloo
group, recording that NCCL was asked for. Use with pytest's ``monkeypatch.setattr`` in the test
process, or with plain ``setattr`` in a spawned rank (``install_in_rank``).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.cuda._utils import _get_device_index


class FakeCuda:
    def __init__(self, n: int = 1, *, uuids=None, capability=(9, 0), name="Fake H100", initialized=True):
        self.n = n
        self.initialized = initialized  # False: CUDA not initialised until set_device (a CPU rank)
        self.uuids = list(uuids or [f"fake-gpu-{i}" for i in range(n)])
        self.capability, self.name = capability, name
        self.current = 0
        self.set_device_calls = []
        self.backends_asked = []
        self.events = []
        self.synced = []

    # -- torch.cuda -----------------------------------------------------------------------
    def set_device(self, device):
        idx = _get_device_index(device)  # torch's own check: ValueError without an index
        if idx >= self.n:
            raise RuntimeError("CUDA error: invalid device ordinal")
        if idx >= 0:
            self.current = idx
        self.initialized = True  # torch._C._cuda_setDevice initialises CUDA
        self.set_device_calls.append(idx)

    def current_device(self):
        return self.current

    def get_device_properties(self, i):
        i = _get_device_index(i, optional=True)
        if not 0 <= i < self.n:
            raise AssertionError("Invalid device id")
        return SimpleNamespace(
            name=self.name,
            major=self.capability[0],
            minor=self.capability[1],
            total_memory=80 * 2**30,
            multi_processor_count=132,
            uuid=self.uuids[i],
        )

    def is_bf16_supported(self, including_emulation: bool = True):
        return self.capability >= (8, 0) or including_emulation

    def synchronize(self, device=None):
        self.synced.append(_get_device_index(device, optional=True) if device is not None else self.current)

    def make_device_class(self):
        """``torch.cuda.device``: a class (torch checks ``isinstance(x, torch.cuda.device)``)
        whose instances switch the current device for a ``with`` block."""
        fake = self

        class device:
            def __init__(self, device):
                self.idx = _get_device_index(device, optional=True)

            def __enter__(self):
                self.prev = fake.current
                if self.idx >= 0:
                    fake.current = self.idx
                return self

            def __exit__(self, *exc):
                fake.current = self.prev
                return False

        return device

    def current_stream(self, device=None):
        idx = self.current if device is None else _get_device_index(device, optional=True)
        return SimpleNamespace(device_index=idx, kind="stream")

    def make_event_class(self):
        fake = self

        class FakeEvent:
            def __init__(self, enable_timing=False):
                assert enable_timing, "CUDA events need enable_timing=True to be timed"
                self.device = fake.current  # a CUDA event belongs to the current device
                self.stream = None
                self.t = None
                self.synced = False
                fake.events.append(self)

            def record(self, stream=None):
                import time

                self.stream = stream if stream is not None else fake.current_stream()
                if self.stream.device_index != self.device:
                    raise RuntimeError("Event device does not match recording stream's device")
                self.t = time.perf_counter()

            def synchronize(self):
                self.synced = True

            def elapsed_time(self, other):
                assert other.synced, "read an event's time only after synchronising on it"
                return (other.t - self.t) * 1e3  # milliseconds, as CUDA does

        return FakeEvent

    # -- installing -----------------------------------------------------------------------
    def install(self, setattr_, *, nccl_on_gloo: bool = False, accelerator: bool = False):
        """Patch torch.cuda (and optionally NCCL, and the current accelerator) with
        ``setattr_(obj, name, value)``."""
        c = torch.cuda
        setattr_(c, "is_available", lambda: True)
        setattr_(c, "is_initialized", lambda: self.initialized)
        setattr_(c, "device_count", lambda: self.n)
        setattr_(c, "set_device", self.set_device)
        setattr_(c, "current_device", self.current_device)
        setattr_(c, "get_device_properties", self.get_device_properties)
        setattr_(c, "is_bf16_supported", self.is_bf16_supported)
        setattr_(c, "synchronize", self.synchronize)
        setattr_(c, "device", self.make_device_class())
        setattr_(c, "current_stream", self.current_stream)
        setattr_(c, "Event", self.make_event_class())
        if accelerator:  # torch.accelerator / the default DeviceMesh see CUDA, as on a GPU box
            setattr_(torch._C, "_get_accelerator", lambda *a, **k: torch.device("cuda"))
        if nccl_on_gloo:
            real_init = dist.init_process_group

            def init_process_group(backend=None, *args, **kwargs):
                self.backends_asked.append(backend)
                return real_init("gloo" if backend == "nccl" else backend, *args, **kwargs)

            setattr_(dist, "is_nccl_available", lambda: True)
            setattr_(dist, "init_process_group", init_process_group)
        return self


def install_in_rank(n: int, uuids, **kw) -> FakeCuda:
    """In a spawned rank: this process sees ``n`` fake GPUs with these UUIDs, NCCL runs on gloo.
    ``kw``: ``initialized`` (FakeCuda) and ``accelerator`` (install)."""
    init = {k: kw.pop(k) for k in ("initialized",) if k in kw}
    return FakeCuda(n, uuids=uuids, **init).install(setattr, nccl_on_gloo=True, **kw)


# ----------------------------------------------------------------------------------------
# A fake NCCL that, like NCCL, takes only tensors on the GPU
# ----------------------------------------------------------------------------------------

NCCL_CPU_ERROR = "No backend type associated with device type cpu"  # torch's words, NCCL-only group


class OnFakeGpu(torch.Tensor):
    """A tensor "on the fake GPU": real values in a CPU tensor (``inner``), every op run on those.
    A CPU build runs autograd only on CPU and ``meta`` devices, so it reports ``device == meta``
    (not cuda): what matters is that it is not a CPU tensor. Mixing it with a CPU tensor in an op
    raises as mixing devices does on a GPU; ``.cpu()`` gives the plain values back."""

    @staticmethod
    def __new__(cls, inner):
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            inner.shape,
            strides=inner.stride(),
            storage_offset=inner.storage_offset(),
            dtype=inner.dtype,
            device=torch.device("meta"),
            requires_grad=inner.requires_grad,
        )
        r.inner = inner
        return r

    def __repr__(self):
        return f"OnFakeGpu({self.inner!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_leaves, tree_map

        kwargs = kwargs or {}
        cpu = [
            a
            for a in tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor) and not isinstance(a, OnFakeGpu) and a.dim() > 0
        ]
        if cpu:
            raise RuntimeError(
                "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"
            )
        to_cpu = (
            func is torch.ops.aten._to_copy.default
            and kwargs.get("device") is not None
            and torch.device(kwargs["device"]).type == "cpu"
        )

        def unwrap(a):
            if isinstance(a, OnFakeGpu):
                return a.inner
            return torch.device("cpu") if isinstance(a, torch.device) and a.type in ("cuda", "meta") else a

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if to_cpu:
            return out
        if func._schema.is_mutable and args and isinstance(args[0], OnFakeGpu):
            return args[0]  # in place: the tensor itself
        return tree_map(lambda t: OnFakeGpu(t) if isinstance(t, torch.Tensor) else t, out)


def _check_on_gpu(tensors):
    for t in tensors:
        if isinstance(t, torch.Tensor) and not isinstance(t, OnFakeGpu):
            raise RuntimeError(NCCL_CPU_ERROR)


def _inner(t):
    if isinstance(t, (list, tuple)):
        return type(t)(_inner(x) for x in t)
    return t.inner if isinstance(t, OnFakeGpu) else t


def install_nccl_device_rule(setattr_) -> None:
    """Tensors moved to a CUDA device (``.to("cuda:i")``, ``.cuda()``, ``module.to(ctx.device)``)
    become :class:`OnFakeGpu`; the collectives and point-to-point ops refuse any other tensor
    with NCCL's error, then run on gloo with the values. Use in a rank with ``install_in_rank``."""
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        dev = torch._C._nn._parse_to(*args, **kwargs)[0]
        if dev is not None and dev.type == "cuda" and not isinstance(self, OnFakeGpu):
            rest = [a for a in args if not isinstance(a, (str, torch.device))]
            t = real_to(self, "cpu", *rest, **{k: v for k, v in kwargs.items() if k != "device"})
            return OnFakeGpu(t.detach().clone())
        return real_to(self, *args, **kwargs)

    setattr_(torch.Tensor, "to", to)
    setattr_(torch.Tensor, "cuda", lambda self, device=None, **kw: to(self, torch.device("cuda", device or 0)))

    def wrap(name):
        fn = getattr(dist, name)

        def op(*args, **kwargs):
            from torch.utils._pytree import tree_leaves

            _check_on_gpu(tree_leaves((args, kwargs)))
            return fn(*[_inner(a) for a in args], **{k: _inner(v) for k, v in kwargs.items()})

        op.__name__ = name
        setattr_(dist, name, op)
        return op

    for name in (
        "all_reduce",
        "broadcast",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "reduce",
        "send",
        "recv",
    ):
        wrap(name)
    real_batch = dist.batch_isend_irecv  # (isend / irecv stay torch's own: P2POp accepts only those)

    def batch_isend_irecv(ops):
        _check_on_gpu([o.tensor for o in ops])
        return real_batch([dist.P2POp(o.op, o.tensor.inner, o.peer, o.group, o.tag) for o in ops])

    setattr_(dist, "batch_isend_irecv", batch_isend_irecv)
