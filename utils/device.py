"""Choosing a device, and describing the hardware a result was measured on."""

from __future__ import annotations

import contextlib
import os
import platform

import torch

_NULL = contextlib.nullcontext()  # reusable: entering it does nothing


def get_device(prefer: str | None = None) -> torch.device:
    """The device to train on: ``prefer`` if given ("cpu", "cuda", "cuda:1", "mps"), else the
    first CUDA GPU, else Apple's MPS, else the CPU."""
    if prefer:
        dev = torch.device(prefer)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(
                f"device {prefer!r} was asked for but CUDA is not available here; "
                "use get_device() to fall back to the CPU"
            )
        return dev
    if torch.cuda.is_available():
        return torch.device("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def bf16_supported(device: torch.device | str | None = None) -> bool:
    """True where bf16 runs natively: any CPU, and NVIDIA GPUs from Ampere on (compute
    capability 8.0: A100, RTX 30xx, H100). Older GPUs (V100, T4, RTX 20xx) only emulate it,
    slower than fp32, and cuDNN has no bf16 convolutions there; use fp16 with a GradScaler."""
    device = torch.device(device) if device is not None else get_device()
    if device.type != "cuda":
        return device.type == "cpu"
    try:
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # torch < 2.5: no emulation argument
        return bool(torch.cuda.is_bf16_supported())


_AMP_DTYPES = {
    "fp32": None,
    "float32": None,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def resolve_amp_dtype(amp: torch.dtype | str | None) -> tuple[torch.dtype | None, str]:
    """(autocast dtype or None for fp32, its short name) from None, a torch dtype or a name
    ("fp32", "bf16", "fp16", or the long names)."""
    if isinstance(amp, str):
        if amp.lower() not in _AMP_DTYPES:
            raise ValueError(f"unknown dtype {amp!r}; use one of fp32, bf16, fp16")
        amp = _AMP_DTYPES[amp.lower()]
    if amp is None or amp == torch.float32:
        return None, "fp32"
    if amp not in (torch.bfloat16, torch.float16):
        raise ValueError(f"autocast dtype must be torch.bfloat16 or torch.float16, got {amp}")
    return amp, "bf16" if amp == torch.bfloat16 else "fp16"


def autocast(device: torch.device, amp_dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to ``amp_dtype`` on ``device``'s type, or a reusable no-op context when
    ``amp_dtype`` is None (fp32): the one autocast helper of the package."""
    if amp_dtype is None:
        return _NULL
    return torch.autocast(device_type=torch.device(device).type, dtype=amp_dtype)


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued work on ``device`` (a no-op on the CPU). Every caller is a sync point."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type == "cuda":
        if torch.cuda.is_available():
            torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


CUBLAS_WORKSPACE = ":4096:8"  # cuBLAS's deterministic workspace setting (see CUDA's docs)


def set_deterministic() -> dict:
    """Make GPU training repeat bit for bit (what a checkpoint resume is compared against).

    * ``torch.backends.cudnn.deterministic = True``: cuDNN picks only deterministic
      convolution algorithms (some fast backward ones add in a run-dependent order);
    * ``torch.backends.cudnn.benchmark = False``: no autotuning, which may pick a different
      algorithm in each process;
    * ``CUBLAS_WORKSPACE_CONFIG=:4096:8``: cuBLAS reductions in a fixed order. cuBLAS reads it
      when it starts, so call this before the first matrix multiply on the GPU (a fresh
      process: each DDP rank calls it first thing).

    ``torch.use_deterministic_algorithms(True)`` is not switched on: it makes every op without
    a deterministic kernel raise (e.g. NLL loss on CUDA), where these settings suffice for the
    layers of this series. On the CPU these settings change nothing; CPU training repeats
    exactly anyway. Returns the settings as they were before."""
    before = {
        "cudnn.deterministic": torch.backends.cudnn.deterministic,
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    return before


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else v
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


def describe_hardware() -> dict:
    """Everything a measurement depends on: CPU, GPUs, torch and CUDA versions."""
    info = {
        "cpu": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "gpus": [],
        "driver": None,
    }
    if torch.cuda.is_available():
        info["driver"] = _driver_version()
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["gpus"].append(
                {
                    "index": i,
                    "name": p.name,
                    "memory_gib": round(p.total_memory / 2**30, 1),
                    "capability": f"{p.major}.{p.minor}",
                    "multiprocessors": p.multi_processor_count,
                }
            )
    return info


def hardware_summary(info: dict | None = None) -> str:
    """A few printable lines for a notebook's setup cell."""
    info = info or describe_hardware()
    lines = [
        f"CPU    {info['cpu']} ({info['cpu_cores']} cores, torch uses {info['torch_threads']} threads)",
        f"torch  {info['torch']}  python {info['python']}  CUDA {info['cuda'] or '-'}  cuDNN {info['cudnn'] or '-'}",
    ]
    if info["gpus"]:
        for g in info["gpus"]:
            lines.append(
                f"GPU {g['index']}  {g['name']}, {g['memory_gib']} GiB, compute {g['capability']},"
                f" {g['multiprocessors']} SMs, driver {info['driver'] or 'unknown'}"
            )
    else:
        lines.append("GPU    none (CUDA not available): runs use the CPU")
    return "\n".join(lines)
