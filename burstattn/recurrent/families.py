"""The recurrences of the hybrid families, as calls of the two sequence-parallel schemes.

* Mamba2's SSD (Mamba2, Bamba, Nemotron-H, Falcon-H1, Zamba2, Granite-MoE-hybrid):
  ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T``, ``y_t = C_t @ h_t + D x_t``: linear attention with
  ``q = C, k = dt * B, v = x, g = dt * A``.
* Lightning attention (MiniMax-01): ``S_t = exp(-slope) S_{t-1} + k_t v_t^T``, ``o_t = q_t @ S_t``.
* KDA (Kimi Linear): the gated delta rule with a per-channel decay ``g [B, n, H, dk]``.
"""
from __future__ import annotations

from typing import Optional

import torch

from .passing import sp_gated_delta_rule, sp_linear_attention


def sp_ssd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
           D: Optional[torch.Tensor] = None, **kw):
    """Sequence-parallel Mamba2 SSD.

    Args:
        x: ``[b, n, H, P]`` (P the head dim); dt: ``[b, n, H]``, positive (after softplus and clamp);
        A: ``[H]``, negative (``-exp(A_log)``); B, C: ``[b, n, G, N]`` with ``H % G == 0`` (groups);
        D: ``[H]`` skip or ``None``. ``kw``: as :func:`~burstattn.recurrent.sp_linear_attention`
        (``initial_state`` in this function's layout, ``[b, H, N, P]``).
    Returns:
        ``(y [b, n, H, P], final state [b, H, N, P] or None)`` (transformers keeps ``[b, H, P, N]``).
    """
    rep = x.shape[2] // B.shape[2] if B.dim() == 4 and B.shape[2] else 1
    Bh = B.repeat_interleave(rep, dim=2) if rep > 1 else B
    k = Bh * dt.unsqueeze(-1).to(B.dtype) if Bh.dim() == 4 and dt.dim() == 3 else Bh
    C = C.repeat_interleave(rep, dim=2) if rep > 1 else C
    y, state = sp_linear_attention(C, k, x, dt * A.to(dt.dtype), **kw)
    if D is not None:
        y = y + x * D.to(x.dtype).view(1, 1, -1, 1)
    return y, state


def sp_lightning_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor, **kw):
    """Sequence-parallel lightning attention: a constant decay ``exp(-slope[h])`` per head.

    Args:
        q, k: ``[b, n, H, dk]``; v: ``[b, n, H, dv]``; slope: ``[H]``, >= 0.
    Returns:
        ``(o [b, n, H, dv], final state [b, H, dk, dv] or None)``.
    """
    g = (-slope).to(q.dtype).view(1, 1, -1).expand(q.shape[0], q.shape[1], -1)
    return sp_linear_attention(q, k, v, g, **kw)


def sp_kda(q, k, v, g, beta, **kw):
    """Sequence-parallel Kimi delta attention: :func:`sp_gated_delta_rule` with ``g [b, n, H, dk]``."""
    if g.dim() != 4:
        raise ValueError(f"sp_kda: g must be per channel [batch, local_seq, heads, head_dim], got {tuple(g.shape)}")
    return sp_gated_delta_rule(q, k, v, g, beta, **kw)
