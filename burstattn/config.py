"""Typed configuration shared by the public API, the autograd function and the engine."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

LAYOUTS = ("contiguous", "zigzag", "striped")
BACKENDS = ("auto", "reference", "cpu_flash", "sdpa", "flash_attn")
BACKWARDS = ("auto", "burst", "kv")
SCHEDULES = ("ring", "distflash")


@dataclass(frozen=True)
class AttnConfig:
    """What one distributed attention call does (everything but the tensors and the group).

    Attributes:
        causal: query at global position i sees keys at global positions j <= i.
        softmax_scale: multiplier of q @ k^T; ``None`` means ``head_dim ** -0.5``.
        layout: how the global sequence is split over ranks: ``"contiguous"``,
            ``"zigzag"`` or ``"striped"`` (see :mod:`burstattn.layout`).
        backend: local kernel name, resolved (never ``"auto"`` once inside the engine).
        backward: ``"burst"`` (query ring: Q, dO, lse, D travel, dQ partials follow),
            ``"kv"`` (RingAttention: K, V travel, dK/dV partials follow) or ``"auto"``.
        schedule: ``"ring"`` (neighbour ring, every layout) or ``"distflash"``
            (DistFlashAttn's load-balanced direct schedule: causal, contiguous layout only).
    """

    causal: bool = False
    softmax_scale: Optional[float] = None
    layout: str = "zigzag"
    backend: str = "auto"
    backward: str = "auto"
    schedule: str = "ring"

    def scale_for(self, head_dim: int) -> float:
        """The softmax scale actually used for ``head_dim``."""
        return float(self.softmax_scale) if self.softmax_scale is not None else head_dim ** -0.5
