"""Argument checks shared by the sequence-parallel recurrences: every input a floating-point tensor on one
device (what the shape checks of :mod:`.passing` and :mod:`.families` then read), and shapes read
without failing on a malformed input (so that the rank with the problem still joins the agreement
exchange, and every rank raises the same ``ValueError``)."""
from __future__ import annotations

from typing import Optional

import torch


def tensors_problem(named: dict, optional: tuple = ()) -> Optional[str]:
    """``named``: name -> input; those named in ``optional`` may be ``None``. Every other entry must be
    a floating-point tensor with at least one dim, all on one device."""
    devices = {}
    for name, t in named.items():
        if t is None and name in optional:
            continue
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a tensor, got {type(t).__name__}"
        if not t.is_floating_point():
            return f"{name} must be floating point, got {t.dtype}"
        if t.dim() == 0:
            return f"{name} must have at least one dim, got a scalar tensor"
        devices.setdefault(str(t.device), name)
    if len(devices) > 1:
        return f"inputs must be on one device, got {', '.join(f'{n} on {d}' for d, n in devices.items())}"
    return None


def shape(t) -> tuple:
    """``t``'s shape, ``()`` for anything that is not a tensor."""
    return tuple(t.shape) if isinstance(t, torch.Tensor) else ()


def dim(t, i: int) -> int:
    """``t.shape[i]``, 0 where ``t`` has no such dim (a malformed input: its rank raises anyway)."""
    s = shape(t)
    return s[i] if -len(s) <= i < len(s) else 0
