"""Local attention kernels behind one seam; :func:`resolve_backend` picks one that supports the call
and :func:`get_kernel` makes it."""
from __future__ import annotations

import torch

from .base import Kernel, ScoreMods
from .cpu_flash import CpuFlashKernel, cpu_flash_available
from .flash_attn import FlashAttnKernel, flash_attn_available
from .plain import PlainKernel
from .sdpa import SdpaKernel, sdpa_cuda_available

__all__ = ["Kernel", "ScoreMods", "available_backends", "resolve_backend", "get_kernel", "KERNELS"]

KERNELS = {"reference": PlainKernel, "cpu_flash": CpuFlashKernel, "sdpa": SdpaKernel, "flash_attn": FlashAttnKernel}
# what a call can need beyond plain attention (see kernels.base); "deterministic": bitwise repeatable
# results (PyTorch's CUDA SDPA backwards use atomics; flash-attn has a deterministic mode)
NEEDS = ("softcap", "alibi", "v_head_dim", "deterministic")


def _supports(name: str, device: torch.device) -> frozenset:
    sup = KERNELS[name].supports
    if name != "sdpa" or device.type != "cuda":
        sup = sup | {"deterministic"}
    return sup


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


def _dtype_ok(name: str, dtype: torch.dtype) -> bool:
    if dtype == torch.float64:
        return name == "reference"
    return not (name == "flash_attn" and dtype == torch.float32)


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype, needs=frozenset()) -> str:
    """The concrete backend for a call: ``"auto"`` is the fastest available one that takes ``dtype``
    and supports everything in ``needs`` (names from :data:`NEEDS`), so no modifier is ever dropped;
    a named backend that cannot raises ``ValueError`` naming what is available and what supports it."""
    avail = available_backends(device)
    needs = frozenset(needs)
    if backend == "auto":
        return next(n for n in avail if _dtype_ok(n, dtype) and needs <= _supports(n, device))
    if backend not in avail:
        raise ValueError(f"backend {backend!r} is not available on device {device.type!r}; "
                         f"available: {avail} (or 'auto')")
    if dtype == torch.float64 and backend != "reference":
        raise ValueError(f"backend {backend!r} does not support float64; use backend='reference'")
    if backend == "flash_attn" and dtype == torch.float32:
        raise ValueError("backend 'flash_attn' needs float16 or bfloat16 inputs; use 'sdpa' for float32")
    missing = sorted(needs - _supports(backend, device))
    if missing:
        able = [n for n in avail if needs <= _supports(n, device) and _dtype_ok(n, dtype)]
        raise ValueError(f"backend {backend!r} does not support {', '.join(missing)} on {device.type!r}; "
                         f"backends that do: {able} (or 'auto', which picks one)")
    return backend


def get_kernel(name: str, deterministic: bool = False) -> Kernel:
    """A kernel instance for a resolved backend name."""
    if name == "flash_attn":
        return FlashAttnKernel(deterministic=deterministic)
    return KERNELS[name]()
