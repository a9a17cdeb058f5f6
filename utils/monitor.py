"""Watching the GPU: the ``nvidia-smi --query-gpu=... --loop`` of a notebook.

:class:`GPUMonitor` samples, in a background thread and through NVML (the ``nvidia-ml-py``
package, imported as ``pynvml``), each GPU's utilisation, memory, power, clocks and
temperature every ``interval`` seconds::

    with utils.monitor.GPUMonitor(interval=0.1) as mon:
        fit(...)
    result = mon.result            # MonitorResult: .samples (list of dicts), .available, .reason
    utils.monitor.plot(result)

Where there is no NVIDIA GPU (or no driver), no thread is started and the result says so:
``result.available`` is False and ``result.reason`` explains why. Sampling itself never
synchronises the GPU: NVML reads the driver's counters from another thread.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["GPUMonitor", "MonitorResult", "monitor", "plot", "FIELDS", "cuda_to_nvml", "visible_entries"]

# sample key -> (unit, what it is, the matching nvidia-smi --query-gpu field)
FIELDS = {
    "util_gpu": ("%", "GPU utilisation: time a kernel was running", "utilization.gpu"),
    "util_mem": ("%", "memory-controller utilisation", "utilization.memory"),
    "mem_used_mib": ("MiB", "memory used (all processes)", "memory.used"),
    "mem_total_mib": ("MiB", "memory total", "memory.total"),
    "power_w": ("W", "power draw", "power.draw"),
    "sm_clock_mhz": ("MHz", "SM clock", "clocks.sm"),
    "mem_clock_mhz": ("MHz", "memory clock", "clocks.mem"),
    "temperature_c": ("C", "GPU temperature", "temperature.gpu"),
}


@dataclass
class MonitorResult:
    """What a monitor saw. ``samples``: one dict per GPU per tick with ``t`` (seconds since
    start), ``gpu`` (the CUDA index, as in ``cuda:0``), ``name`` and the keys of :data:`FIELDS` (None where the GPU
    does not report a value)."""

    available: bool
    reason: str = ""
    interval: float = 0.0
    samples: list = field(default_factory=list)
    gpus: list = field(default_factory=list)  # [(CUDA index, name)]
    devices: list = field(default_factory=list)  # [{cuda, nvml, uuid, mig}]: the CUDA -> NVML mapping
    errors: list = field(default_factory=list)  # sampling errors, at most a few

    def series(self, key: str, gpu: int | None = None) -> tuple[list[float], list]:
        """(times, values) of ``key`` for one GPU (default: the first monitored)."""
        if key not in FIELDS:
            raise KeyError(f"unknown key {key!r}; known: {', '.join(FIELDS)}")
        gpu = self.gpus[0][0] if gpu is None and self.gpus else gpu
        rows = [s for s in self.samples if s["gpu"] == gpu]
        return [s["t"] for s in rows], [s[key] for s in rows]

    def summary(self) -> str:
        if not self.available:
            return f"no GPU samples: {self.reason}"
        lines = []
        for idx, name in self.gpus:
            rows = [s for s in self.samples if s["gpu"] == idx]
            parts = [f"GPU {idx} {name}: {len(rows)} samples every {self.interval:g} s"]
            for key in ("util_gpu", "mem_used_mib", "power_w", "sm_clock_mhz"):
                vals = [s[key] for s in rows if s[key] is not None]
                if vals:
                    parts.append(f"{key} mean {sum(vals) / len(vals):,.0f} max {max(vals):,.0f} {FIELDS[key][0]}")
            lines.append("; ".join(parts))
        return "\n".join(lines)

    def __repr__(self):
        if not self.available:
            return f"MonitorResult(unavailable: {self.reason})"
        return f"MonitorResult({len(self.samples)} samples of {len(self.gpus)} GPU(s), every {self.interval:g} s)"


def _load_nvml():
    try:
        import pynvml
    except ImportError:
        return None, (
            "the nvidia-ml-py package is not installed (pip install nvidia-ml-py); "
            "without it there is nothing to read the GPU's counters with"
        )
    return pynvml, ""


def visible_entries(env: str | None = None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as CUDA reads it: a list of entries (indices, ``GPU-...`` UUIDs or
    prefixes of them, ``MIG-...`` UUIDs), cut at the first entry that is not valid, as CUDA
    does (``0,2,-1,1`` shows GPUs 0 and 2). None when the variable is not set: every GPU."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES") if env is None else env
    if env is None:
        return None
    out = []
    for item in env.split(","):
        item = item.strip()
        if item.isdigit() or item.startswith(("GPU-", "MIG-")):
            out.append(item)
        else:
            break  # "-1", "", "none": CUDA sees nothing from here on
    return out


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _torch_uuid(cuda_index: int) -> str | None:
    """The UUID torch reports for cuda:i, only if this process has already initialised CUDA
    (the monitor never initialises CUDA itself). Exact whatever CUDA_DEVICE_ORDER says."""
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return str(torch.cuda.get_device_properties(cuda_index).uuid)
    except Exception:  # noqa: BLE001 - fall back to CUDA_VISIBLE_DEVICES
        pass
    return None


def _torch_count() -> int:
    """How many CUDA devices torch sees, only if it has initialised CUDA (0 otherwise)."""
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - fall back to NVML's count
        pass
    return 0


def _prefixed(nvml: ModuleType, tu: str, entry: str, uuids: Callable[[], list[str]]) -> str:
    """torch's UUID of a device as NVML spells it. torch drops the prefix: a whole GPU is ``GPU-``
    and a MIG slice ``MIG-``, which CUDA_VISIBLE_DEVICES names when it is set. When it is unset
    (a MIG slice handed to a container, say), a UUID that is no whole GPU of NVML's is a slice."""
    if tu.startswith(("GPU-", "MIG-")):
        return tu
    if entry.startswith("MIG-") or not any(u == "GPU-" + tu for u in uuids()):
        with contextlib.suppress(Exception):  # noqa: BLE001 - pynvml raises its own error types
            nvml.nvmlDeviceGetHandleByUUID("MIG-" + tu)
            return "MIG-" + tu
    return "GPU-" + tu


def cuda_to_nvml(nvml: ModuleType, cuda_indices: Iterable[int] | None = None) -> list[dict]:
    """Map CUDA device numbers (``cuda:i`` as torch numbers them) to NVML devices.

    NVML numbers every GPU of the machine, in PCI order, and knows nothing of
    CUDA_VISIBLE_DEVICES; CUDA numbers only the devices that variable lists, in its order. So
    ``cuda:0`` under ``CUDA_VISIBLE_DEVICES=2,3`` is NVML's GPU 2. Entries are matched by index,
    by UUID (``GPU-...``, or a unique prefix of it, as CUDA allows) or as a MIG slice
    (``MIG-...``: its own NVML handle; a slice reports memory but not utilisation). When torch
    has initialised CUDA, its device UUIDs decide (exact even under CUDA_DEVICE_ORDER=FASTEST_FIRST).
    Returns one dict per device: ``cuda`` (index), ``nvml`` (NVML index, None for a MIG
    slice), ``uuid``, ``mig`` (bool), ``handle``."""
    count = nvml.nvmlDeviceGetCount()
    entries = visible_entries()
    if entries is None:  # every device; torch counts MIG slices where NVML counts whole GPUs
        entries = [str(i) for i in range(_torch_count() or count)]
    if cuda_indices is None:
        cuda_indices = range(len(entries))
    all_uuids = None

    def uuids():
        nonlocal all_uuids
        if all_uuids is None:
            all_uuids = [_text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i))) for i in range(count)]
        return all_uuids

    out = []
    for c in cuda_indices:
        if not 0 <= c < len(entries):
            raise ValueError(
                f"cuda:{c} does not exist: this process sees {len(entries)} CUDA device(s) "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
            )
        entry = entries[c]
        tu = _torch_uuid(c)
        if tu:
            entry = _prefixed(nvml, tu, entry, uuids)
        if entry.startswith("MIG-"):
            h = nvml.nvmlDeviceGetHandleByUUID(entry)
            out.append({"cuda": c, "nvml": None, "uuid": entry, "mig": True, "handle": h})
            continue
        if entry.isdigit():
            i = int(entry)
            if i >= count:
                raise ValueError(f"CUDA_VISIBLE_DEVICES names GPU {i} but NVML sees {count} GPU(s)")
        else:
            matches = [i for i, u in enumerate(uuids()) if u.startswith(entry)]
            if len(matches) != 1:
                raise ValueError(
                    f"CUDA_VISIBLE_DEVICES entry {entry!r} matches {len(matches)} GPU(s) of "
                    f"this machine; NVML sees {uuids()}"
                )
            i = matches[0]
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        out.append(
            {"cuda": c, "nvml": i, "uuid": uuids()[i] if all_uuids is not None else None, "mig": False, "handle": h}
        )
    return out


class GPUMonitor:
    """Sample GPU counters every ``interval`` seconds in a background thread.

    gpus: the CUDA devices to watch, numbered as torch numbers them (``[0]`` is ``cuda:0``);
        default every device this process can see. They are mapped to NVML's devices through
        CUDA_VISIBLE_DEVICES (indices, UUIDs, MIG slices): see :func:`cuda_to_nvml`. Samples
        and ``result.gpus`` use the CUDA numbers; ``result.devices`` holds the mapping.
    nvml: the NVML module (default ``pynvml``); tests pass a fake one.
    ``start()`` then ``stop()`` (returns the :class:`MonitorResult`), or use it as a context
    manager; the thread is always joined by ``stop``. Where NVML cannot start (no NVIDIA
    driver or GPU), ``start`` starts no thread and ``stop`` returns an unavailable result.
    """

    def __init__(
        self,
        interval: float = 0.2,
        gpus: list[int] | None = None,
        nvml: ModuleType | None = None,
        max_samples: int = 100_000,
    ):
        if interval <= 0:
            raise ValueError(f"interval must be > 0 seconds, got {interval}")
        self.interval, self.gpus, self.max_samples = interval, gpus, max_samples
        self._nvml = nvml
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._handles = []
        self._nvml_active = None
        self._t0 = 0.0
        self.result = MonitorResult(False, "not started", interval)

    @property
    def available(self) -> bool:
        return self.result.available

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> GPUMonitor:
        if self.running:
            raise RuntimeError("this monitor is already running; call stop() first")
        nvml, reason = (self._nvml, "") if self._nvml is not None else _load_nvml()
        self.result = MonitorResult(False, reason, self.interval)
        if nvml is None:
            return self
        try:
            nvml.nvmlInit()
        except Exception as e:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
            self.result.reason = (
                f"no NVIDIA GPU to monitor: NVML could not start ({e}). On a machine "
                "with an NVIDIA GPU and driver this samples utilisation, memory, "
                "power and clocks, as nvidia-smi --query-gpu ... --loop does."
            )
            return self
        try:
            devices = cuda_to_nvml(nvml, self.gpus)
            if not devices:
                count = nvml.nvmlDeviceGetCount()
                nvml.nvmlShutdown()
                self.result.reason = (
                    f"NVML started but this process sees no GPU to watch (NVML sees {count}; "
                    f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
                )
                return self
        except ValueError:
            nvml.nvmlShutdown()
            raise
        except Exception as e:
            nvml.nvmlShutdown()
            self.result.reason = f"NVML could not list the GPUs: {e}"
            return self
        handles = [(d["cuda"], d["handle"]) for d in devices]
        names = []
        for i, h in handles:
            try:
                n = nvml.nvmlDeviceGetName(h)
                names.append((i, n.decode() if isinstance(n, bytes) else n))
            except Exception:
                names.append((i, "unknown"))
        self._nvml_active = nvml
        self._handles = handles
        self.result = MonitorResult(True, "", self.interval, [], names)
        self.result.devices = [{k: v for k, v in d.items() if k != "handle"} for d in devices]
        self._stop.clear()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="GPUMonitor", daemon=True)
        self._thread.start()
        return self

    def _read(self, nvml, h) -> dict:
        def q(fn, *args, scale=1.0, attr=None):
            try:
                v = fn(h, *args)
                v = getattr(v, attr) if attr else v
                return v * scale if scale != 1.0 else v
            except Exception:  # e.g. power not supported on this board
                return None

        return {
            "util_gpu": q(nvml.nvmlDeviceGetUtilizationRates, attr="gpu"),
            "util_mem": q(nvml.nvmlDeviceGetUtilizationRates, attr="memory"),
            "mem_used_mib": q(nvml.nvmlDeviceGetMemoryInfo, attr="used", scale=1 / 2**20),
            "mem_total_mib": q(nvml.nvmlDeviceGetMemoryInfo, attr="total", scale=1 / 2**20),
            "power_w": q(nvml.nvmlDeviceGetPowerUsage, scale=1e-3),  # NVML reports mW
            "sm_clock_mhz": q(nvml.nvmlDeviceGetClockInfo, nvml.NVML_CLOCK_SM),
            "mem_clock_mhz": q(nvml.nvmlDeviceGetClockInfo, nvml.NVML_CLOCK_MEM),
            "temperature_c": q(nvml.nvmlDeviceGetTemperature, nvml.NVML_TEMPERATURE_GPU),
        }

    def _run(self):
        nvml = self._nvml_active
        while True:
            t = time.perf_counter() - self._t0
            for (i, h), (_, name) in zip(self._handles, self.result.gpus):
                try:
                    s = {"t": t, "gpu": i, "name": name, **self._read(nvml, h)}
                except Exception as e:  # keep sampling; remember the first few failures
                    if len(self.result.errors) < 5:
                        self.result.errors.append(repr(e))
                    continue
                if len(self.result.samples) < self.max_samples:
                    self.result.samples.append(s)
            if self._stop.wait(self.interval):
                return

    def stop(self) -> MonitorResult:
        """Stop sampling, join the thread, shut NVML down; return the :class:`MonitorResult`."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            try:
                self._nvml_active.nvmlShutdown()
            except Exception:
                pass
        return self.result

    def __enter__(self) -> GPUMonitor:
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def monitor(fn: Callable[..., Any], *args: Any, interval: float = 0.2, **kwargs: Any) -> tuple[Any, MonitorResult]:
    """Run ``fn(*args, **kwargs)`` under a :class:`GPUMonitor`; return (its result, MonitorResult)."""
    with GPUMonitor(interval) as mon:
        out = fn(*args, **kwargs)
    return out, mon.result


def plot(
    result: MonitorResult,
    keys: Sequence[str] = ("util_gpu", "mem_used_mib", "power_w", "sm_clock_mhz"),
    title: str = "GPU counters over the run",
) -> Figure:
    """One panel per counter against time, one line per GPU. Without samples, a figure that
    says why (so a notebook cell still shows something meaningful on a CPU-only machine)."""
    import matplotlib.pyplot as plt

    if not result.available or not result.samples:
        fig, ax = plt.subplots(figsize=(8, 1.6))
        ax.axis("off")
        msg = result.reason if not result.available else "the monitor took no samples (run too short?)"
        ax.text(0.0, 0.5, "No GPU samples:\n" + _wrap(msg), va="center", fontsize=9)
        ax.set_title(title)
        return fig
    fig, axes = plt.subplots(1, len(keys), figsize=(3.6 * len(keys), 3.2), squeeze=False)
    for ax, key in zip(axes[0], keys):
        unit, what, _ = FIELDS[key]
        for idx, _name in result.gpus:
            ts, vs = result.series(key, idx)
            pts = [(t, v) for t, v in zip(ts, vs) if v is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"GPU {idx}")
        ax.set(title=what, xlabel="time since start (s)", ylabel=f"{key} ({unit})")
        ax.grid(alpha=0.3)
        if len(result.gpus) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(f"{title} ({result.gpus[0][1]}, every {result.interval:g} s)")
    fig.tight_layout()
    return fig


def _wrap(text: str, width: int = 100) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width))
