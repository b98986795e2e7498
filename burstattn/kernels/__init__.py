"""Local attention kernels behind one seam; :func:`get_kernel` resolves a backend name."""
from __future__ import annotations

import torch

from .base import Kernel
from .cpu_flash import CpuFlashKernel, cpu_flash_available
from .flash_attn import FlashAttnKernel, flash_attn_available
from .plain import PlainKernel, ReferenceKernel  # noqa: F401
from .sdpa import SdpaKernel, sdpa_cuda_available

__all__ = ["Kernel", "available_backends", "resolve_backend", "get_kernel"]


def available_backends(device: torch.device) -> list[str]:
    """Backend names usable on ``device``, fastest first (``reference`` always last)."""
    names = []
    if device.type == "cuda":
        if flash_attn_available():
            names.append("flash_attn")
        if sdpa_cuda_available():
            names.append("sdpa")
    elif device.type == "cpu" and cpu_flash_available():
        names.append("cpu_flash")
    return names + ["reference"]


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """The concrete backend for a call; raises ``ValueError`` naming what is available."""
    avail = available_backends(device)
    if backend == "auto":
        if dtype == torch.float64:
            return "reference"
        if avail[0] == "flash_attn" and dtype == torch.float32:
            return avail[1]  # flash-attn has no float32 kernel
        return avail[0]
    if backend not in avail:
        raise ValueError(f"backend {backend!r} is not available on device {device.type!r}; "
                         f"available: {avail} (or 'auto')")
    if backend in ("cpu_flash", "flash_attn", "sdpa") and dtype == torch.float64:
        raise ValueError(f"backend {backend!r} does not support float64; use backend='reference'")
    if backend == "flash_attn" and dtype == torch.float32:
        raise ValueError("backend 'flash_attn' needs float16 or bfloat16 inputs; use 'sdpa' for float32")
    return backend


def get_kernel(name: str) -> Kernel:
    """A kernel instance for a resolved backend name."""
    factories = {"reference": PlainKernel, "cpu_flash": CpuFlashKernel,
                 "sdpa": SdpaKernel, "flash_attn": FlashAttnKernel}
    return factories[name]()
