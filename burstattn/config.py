"""Typed configuration shared by the public API, the autograd function and the engine."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch

LAYOUTS = ("contiguous", "zigzag", "striped")
BACKENDS = ("auto", "reference", "cpu_flash", "sdpa", "flash_attn")
BACKWARDS = ("auto", "burst", "kv")
SCHEDULES = ("ring", "distflash", "double")
LOW_DTYPES = ("float32", "bfloat16", "float16")  # what models train and benchmarks run in, by name
DTYPE_NAMES = LOW_DTYPES + ("float64",)          # float64: the exact checks


def torch_dtype(name: str) -> "torch.dtype":
    """The torch dtype named ``name`` (one of :data:`DTYPE_NAMES`); ``ValueError`` otherwise."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {list(DTYPE_NAMES)}, got {name!r}")
    import torch

    return getattr(torch, name)


@dataclass(frozen=True)
class AttnConfig:
    """What one distributed attention call does (everything but the tensors and the group).

    Attributes:
        causal: query at global position i sees keys at global positions j <= i.
        softmax_scale: multiplier of q @ k^T; ``None`` means ``head_dim ** -0.5``.
        layout: how the global sequence is split over ranks: ``"contiguous"``,
            ``"zigzag"`` or ``"striped"`` (see :mod:`burstattn.layout`), or an explicit
            :class:`burstattn.partition.Partition` (e.g. from ``document_partition``).
        backend: local kernel name, resolved (never ``"auto"`` once inside the engine).
        backward: ``"burst"`` (query ring: Q, dO, lse, D travel, dQ partials follow),
            ``"kv"`` (RingAttention: K, V travel, dK/dV partials follow) or ``"auto"``.
        schedule: ``"ring"`` (neighbour ring, every layout), ``"distflash"`` (DistFlashAttn's
            load-balanced direct schedule: causal, contiguous layout only) or ``"double"`` (the
            two-level ring over ``topology``: nodes x ranks per node).
    """

    causal: bool = False
    softmax_scale: Optional[float] = None
    layout: str = "zigzag"
    backend: str = "auto"
    backward: str = "auto"
    schedule: str = "ring"
    mask: Optional[object] = None  # a burstattn.AttnMask (None: no mask beyond ``causal``)
    topology: Optional[object] = None  # TwoLevelGroups of schedule="double"

    @property
    def layout_name(self) -> str:
        """The layout's name (a partition's ``name``, e.g. ``"documents"``)."""
        return self.layout if isinstance(self.layout, str) else self.layout.name

    @property
    def sparse(self) -> bool:
        """Whether the call runs the masked engine (a mask, or an explicit partition layout)."""
        return self.mask is not None or not isinstance(self.layout, str)

    def mask_key(self, seq_len: Optional[int] = None) -> int:
        """31-bit checksum of the mask (its values, probed at ``seq_len``: see
        :meth:`burstattn.AttnMask.fingerprint`) and of an explicit partition (0: neither), for the
        cross-rank check."""
        parts = [self.mask.fingerprint(seq_len) if self.mask is not None else 0,
                 0 if isinstance(self.layout, str) else self.layout.fingerprint,
                 self.topology.ranks_per_node if self.topology is not None else 0]
        return ((parts[0] * 1_000_003 + parts[1]) * 1009 + parts[2]) & 0x7FFFFFFF

    def scale_for(self, head_dim: int) -> float:
        """The softmax scale actually used for ``head_dim``."""
        return float(self.softmax_scale) if self.softmax_scale is not None else head_dim ** -0.5
