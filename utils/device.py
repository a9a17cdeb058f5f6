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
    """True where bf16 autocast is worth using: every CPU (PyTorch's CPU kernels accept bf16 on
    any x86 or Arm CPU; they are native and fast only with AVX512-BF16 or AMX, see
    :func:`cpu_bf16_features`, and converted to and from fp32 elsewhere), and NVIDIA GPUs from
    Ampere on (compute capability 8.0: A100, RTX 30xx, H100). Older GPUs (V100, T4, RTX 20xx)
    only emulate it, slower than fp32, and cuDNN has no bf16 convolutions there; use fp16 with
    a GradScaler."""
    device = torch.device(device) if device is not None else get_device()
    if device.type != "cuda":
        return device.type == "cpu"
    try:
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # torch < 2.5: no emulation argument
        return bool(torch.cuda.is_bf16_supported())


def cpu_bf16_features(cpuinfo: str | None = None) -> dict:
    """Which native bf16 instructions this CPU has: ``avx512_bf16`` (AVX512-BF16 dot products,
    Intel Cooper Lake and Sapphire Rapids on, AMD Zen 4 on) and ``amx_bf16`` (AMX tile
    multiplies, Intel Sapphire Rapids on), and on Arm ``arm_bf16`` (the BF16 extension,
    ARMv8.6). Each is True, False, or None when unknown.
    ``source`` says where they were read: the kernel's ``/proc/cpuinfo`` flags (Linux; pass
    its text as ``cpuinfo`` to parse another), else PyTorch's own CPU detection (``cpuinfo``
    library, any OS), else nothing. ``native`` is True when either is present."""
    flags = None
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = None
    if cpuinfo is not None:
        for line in cpuinfo.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):  # x86 / Arm
                flags = set(value.split())
                break
    if flags is not None:
        out = {
            "avx512_bf16": "avx512_bf16" in flags,
            "amx_bf16": "amx_bf16" in flags,
            "arm_bf16": "bf16" in flags,  # Arm's BF16 extension (ARMv8.6), listed as "bf16"
            "source": "/proc/cpuinfo",
        }
    else:
        avx = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
        amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
        out = {
            "avx512_bf16": bool(avx()) if avx else None,
            "amx_bf16": bool(amx()) if amx else None,
            "arm_bf16": None,
            "source": "PyTorch's CPU detection" if (avx or amx) else "unknown",
        }
    out["native"] = bool(out["avx512_bf16"] or out["amx_bf16"] or out["arm_bf16"])
    return out


def tf32_settings(device: torch.device | str | None = None) -> dict:
    """The switches that decide whether "fp32" work runs as TF32 (a 19-bit format with fp32's
    range and 10 stored mantissa bits) on tensor cores: ``cudnn_allow_tf32`` (convolutions,
    default True), ``matmul_allow_tf32`` and ``float32_matmul_precision`` (matrix multiplies,
    default off / "highest"), and ``tensor_cores_tf32``, True on an NVIDIA GPU of compute
    capability 8.0 or later (Ampere on), which has TF32 tensor cores. ``convs_tf32`` and
    ``matmuls_tf32`` are True where that work really runs in TF32 on ``device``. On torch 2.9+
    ``cudnn_conv_fp32_precision`` is the newer switch for convolutions ("tf32" or "ieee"; the
    two stay in step)."""
    device = torch.device(device) if device is not None else get_device()
    ampere = device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] >= 8
    out = {
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "tensor_cores_tf32": bool(ampere),
    }
    conv = getattr(torch.backends.cudnn, "conv", None)  # torch 2.9+ also has the newer per-backend switch
    if conv is not None and hasattr(conv, "fp32_precision"):
        out["cudnn_conv_fp32_precision"] = conv.fp32_precision
    out["convs_tf32"] = out["cudnn_allow_tf32"] and out["tensor_cores_tf32"]
    out["matmuls_tf32"] = out["matmul_allow_tf32"] and out["tensor_cores_tf32"]
    return out


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
        "gpu_share": os.environ.get("LAB_GPU_SHARE"),  # set by the class's JupyterHub (utils/hub.py)
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
    if info.get("gpu_share"):
        lines.append(f"share  {info['gpu_share']}")
    return "\n".join(lines)
