"""The recurrences of the hybrid families, as calls of the two sequence-parallel schemes.

* Mamba2's SSD (Mamba2, Bamba, Nemotron-H, Falcon-H1, Zamba2, Granite-MoE-hybrid):
  ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T``, ``y_t = C_t @ h_t + D x_t``: linear attention with
  ``q = C, k = dt * B, v = x, g = dt * A``.
* Lightning attention (MiniMax-01): ``S_t = exp(-slope) S_{t-1} + k_t v_t^T``, ``o_t = q_t @ S_t``.
* KDA (Kimi Linear): the gated delta rule with a per-channel decay ``g [B, n, H, dk]``.

Each checks its own arguments (heads a multiple of the groups, the shapes of ``dt``, ``A``, ``D``, ``slope``)
before forming any product, so that a bad input raises ``ValueError`` on every rank, and forms its products
(``dt * A``, ``B * dt``, the D term, the decay from ``slope``) in float32 for 16-bit inputs.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..config import accum_dtype
from .checks import shape, tensors_problem
from .passing import delta_rule_op, linear_attention_op

# the options of sp_linear_attention / sp_gated_delta_rule, with their defaults (the families pass them on)
LINEAR_OPTIONS = dict(group=None, layout="zigzag", cu_seqlens=None, chunk_size=64, scale=1.0, output_final_state=False,
                      initial_state=None, scheme="auto", kernel="auto", check=True)


def _options(fn: str, kw: dict, allowed: dict) -> dict:
    unknown = sorted(set(kw) - set(allowed))
    if unknown:  # a keyword error, the same on every rank (every rank passes the same code)
        raise TypeError(f"{fn}: unexpected keyword arguments {unknown}; accepted: {sorted(allowed)}")
    return {**allowed, **kw}


def _ssd_problem(x, dt, A, B, C, D) -> Optional[str]:
    problem = tensors_problem(dict(x=x, dt=dt, A=A, B=B, C=C, D=D), optional=("D",))
    if problem:
        return problem
    if x.dim() != 4:
        return f"x must be [batch, local_seq, heads, head_dim], got {shape(x)}"
    b, n, H, _ = x.shape
    if B.dim() != 4 or shape(B)[:2] != (b, n) or shape(C) != shape(B):
        return f"B and C must be [{b}, {n}, groups, state] of one shape, got {shape(B)} and {shape(C)}"
    if B.shape[2] < 1 or H % B.shape[2]:
        return f"heads ({H}) must be a multiple of the groups of B and C ({B.shape[2]})"
    if shape(dt) != (b, n, H):
        return f"dt must be [{b}, {n}, {H}], got {shape(dt)}"
    if shape(A) != (H,):
        return f"A must be [{H}], got {shape(A)}"
    if D is not None and shape(D) != (H,):
        return f"D must be [{H}] or None, got {shape(D)}"
    return None


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
    o = _options("sp_ssd", kw, LINEAR_OPTIONS)
    problem = _ssd_problem(x, dt, A, B, C, D)
    extra = dict(skip=int(D is not None))
    if problem:  # no product formed: every rank raises in the agreement exchange
        return linear_attention_op("sp_ssd", problem, C, B, x, dt, extra=extra, **o)
    up = accum_dtype(x.dtype)  # dt * A, B * dt and the D term in float32 for 16-bit inputs
    rep = x.shape[2] // B.shape[2]
    Bh, Ch = (t.repeat_interleave(rep, dim=2) if rep > 1 else t for t in (B, C))  # [b, n, H, N]
    dt_ = dt.to(up)
    y, state = linear_attention_op("sp_ssd", None, Ch.to(up), Bh.to(up) * dt_.unsqueeze(-1), x, dt_ * A.to(up),
                                   extra=extra, **o)
    if D is not None:
        y = y + x.to(up) * D.to(up).view(1, 1, -1, 1)
    return y.to(x.dtype), state


def sp_lightning_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor, **kw):
    """Sequence-parallel lightning attention: a constant decay ``exp(-slope[h])`` per head.

    Args:
        q, k: ``[b, n, H, dk]``; v: ``[b, n, H, dv]``; slope: ``[H]``, >= 0.
    Returns:
        ``(o [b, n, H, dv], final state [b, H, dk, dv] or None)``.
    """
    o = _options("sp_lightning_attention", kw, LINEAR_OPTIONS)
    problem = tensors_problem(dict(q=q, k=k, v=v, slope=slope))
    if problem is None and (q.dim() != 4 or shape(slope) != (q.shape[2],)):
        problem = f"q must be [batch, local_seq, heads, head_dim] and slope [heads], got {shape(q)} and {shape(slope)}"
    if problem:
        return linear_attention_op("sp_lightning_attention", problem, q, k, v, slope, **o)
    g = (-slope).to(accum_dtype(q.dtype)).view(1, 1, -1).expand(q.shape[0], q.shape[1], -1)  # float32 decay
    return linear_attention_op("sp_lightning_attention", None, q, k, v, g, **o)


def sp_kda(q, k, v, g, beta, **kw):
    """Sequence-parallel Kimi delta attention: :func:`sp_gated_delta_rule` with ``g [b, n, H, dk]``
    (``kw`` as there; ``kernel="fla"``: flash-linear-attention's ``chunk_kda``)."""
    o = _options("sp_kda", kw, DELTA_OPTIONS)
    problem = None
    if len(shape(g)) != 4:
        problem = f"g must be per channel [batch, local_seq, heads, head_dim], got {shape(g)}"
    return delta_rule_op("sp_kda", problem, q, k, v, g, beta, **o)


DELTA_OPTIONS = {**LINEAR_OPTIONS, "scale": None, "use_qk_l2norm": False}
