"""The backend seam: what a local attention kernel must provide.

All tensors are in the engine's internal layout ``[batch, heads, seq, head_dim]``:
``q [B, Hq, Sq, D]``, ``k, v [B, Hkv, Sk, D]`` with ``Hq % Hkv == 0`` (query head h uses
kv head ``h // (Hq // Hkv)``). ``causal=True`` is only asked for with ``Sq == Sk`` and means
key j is visible to query i iff ``j <= i``. ``mask`` (optional, bool ``[Sq, Sk]``, True =
visible, shared by every batch and head) is the explicit mask of a partially masked block; it
is never combined with ``causal``. Kernels with ``supports_mask = False`` are never given one.
A row that sees no key returns output 0; its LSE is undefined (the engine sets ``-inf``).
"""
from __future__ import annotations

from typing import Optional, Protocol

import torch


class Kernel(Protocol):
    """A local flash-style attention kernel that exposes the log-sum-exp."""

    name: str
    supports_mask: bool

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                causal: bool, mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``out [B, Hq, Sq, D]`` (q.dtype or float32) and ``lse [B, Hq, Sq]`` float32."""
        ...

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, scale: float,
                 causal: bool, mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients of one block given the *global* ``out`` and ``lse`` of these query rows.

        Uses ``P = exp(scale * q k^T - lse)`` and ``D = rowsum(dout * out)``, so the block's
        forward is never recomputed in full. A row whose global LSE is huge (``1e30``, the engine's
        marker for a row that sees no key anywhere) gets zero gradients. Returns ``dq [B, Hq, Sq, D]``,
        ``dk, dv [B, Hkv, Sk, D]`` (any float dtype; the engine accumulates in float32).
        """
        ...


def expand_kv(x: torch.Tensor, q_heads: int) -> torch.Tensor:
    """``[B, Hkv, S, D] -> [B, Hq, S, D]`` by repeating each kv head ``Hq // Hkv`` times."""
    groups = q_heads // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def reduce_kv_grad(g: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, Hq, S, D] -> [B, Hkv, S, D]``: sum the gradients of the repeated kv heads."""
    b, hq, s, d = g.shape
    if hq == kv_heads:
        return g
    # (B, Hq, S, D) -> (B, Hkv, g, S, D) -> sum over g
    return g.view(b, kv_heads, hq // kv_heads, s, d).sum(dim=2)


def mask_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask ``[Sq, Sk]`` -> additive bias ``[Sq, Sk]`` of ``dtype`` (0 visible, -inf masked)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
