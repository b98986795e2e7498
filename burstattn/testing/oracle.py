"""The float64 dense attention oracle the tests compare everything against.

Plain differentiable torch ops, computed in float64 whatever the input dtype, so autograd on
these functions gives exact float64 gradients. ``exact_attention`` materialises the full
``[B, Hq, N, N]`` score matrix on purpose (O(N^2) memory); ``exact_rows`` computes a subset
of query rows against the full key/value sequence in O(R N) memory.

Mask semantics (global positions): non-causal, every query sees every key; causal, the query at
position i sees the keys at positions j <= i. GQA: query head h uses key/value head
``h // (Hq // Hkv)``. Query and key sequences may differ in length (``Nq``, ``Nk``); causal is then
flash-attn's bottom-right alignment (query i sees keys ``j <= i + Nk - Nq``), and v may have a head
size of its own. Score modifiers as :class:`burstattn.kernels.ScoreMods` describes them: softcap,
ALiBi (``-slope * |i + Nk - Nq - j|``), and attention sinks (a logit per query head that joins
every row's softmax denominator, with no value).
"""
from __future__ import annotations

import torch

__all__ = ["exact_attention", "exact_rows"]


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """Validate shapes; return the GQA group size Hq // Hkv."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim != 4:
            raise ValueError(f"{name} must be [batch, seq, heads, head_dim], got shape {tuple(t.shape)}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree in batch, seq and heads, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head_dim")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"q heads ({q.shape[2]}) must be a multiple of kv heads ({k.shape[2]})")
    return q.shape[2] // k.shape[2]


def _attend(q, k, v, q_pos, k_pos, causal, softmax_scale, visible_mask=None, softcap=None, alibi_slopes=None,
            sinks=None):
    """Dense attention of q [B, R, Hq, D] at q_pos [R] (in the keys' coordinates) against k [B, N, Hkv, D],
    v [B, N, Hkv, Dv] at k_pos [N]."""
    group = _check(q, k, v)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    q64, k64, v64 = q.double(), k.double(), v.double()
    # GQA: (B, N, Hkv, D) -> (B, N, Hq, D); query head h reads kv head h // group
    k64 = k64.repeat_interleave(group, dim=2)
    v64 = v64.repeat_interleave(group, dim=2)
    scores = torch.einsum("brhd,bnhd->bhrn", q64, k64) * scale  # (B, Hq, R, N)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        slopes = alibi_slopes.double().reshape(-1, q.shape[2], 1, 1)  # [B or 1, Hq, 1, 1]
        dist = (q_pos.to(k_pos.device)[:, None] - k_pos[None, :]).abs().double()  # (R, N)
        scores = scores - slopes.to(scores.device) * dist
    if causal:
        visible = q_pos.to(k_pos.device)[:, None] >= k_pos[None, :]  # (R, N)
        scores = scores.masked_fill(~visible, float("-inf"))
    if visible_mask is not None:
        scores = scores.masked_fill(~visible_mask.to(scores.device), float("-inf"))
    if sinks is not None:  # a column per head with the sink logit and no value
        sink = sinks.double().reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        scores = torch.cat([scores, sink.to(scores.device)], dim=-1)
        v64 = torch.cat([v64, v64.new_zeros(v64.shape[0], 1, *v64.shape[2:])], dim=1)
    lse = torch.logsumexp(scores, dim=-1)  # (B, Hq, R); -inf for a row that sees no key
    # rows that see no key get probability 0 everywhere (output 0), not NaN
    safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - safe_lse[..., None])
    out = torch.einsum("bhrn,bnhd->brhd", probs, v64)  # (B, R, Hq, D)
    return out, lse


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                        softmax_scale: float | None = None, mask: torch.Tensor | None = None,
                        softcap: float | None = None, alibi_slopes: torch.Tensor | None = None,
                        sinks: torch.Tensor | None = None,
                        q_positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over the full sequences, in float64.

    Args:
        q: [B, Nq, Hq, D]; k: [B, Nk, Hkv, D], v: [B, Nk, Hkv, Dv] with Hq % Hkv == 0. Any floating dtype.
        causal: query i sees keys j <= i + Nk - Nq (bottom-right aligned, as flash-attn).
        softmax_scale: defaults to D ** -0.5.
        mask: optional bool [Nq, Nk] (True: query i may see key j), ANDed with ``causal``; e.g.
            ``AttnMask.dense(arange(N), arange(N), N, causal)``.
        softcap, alibi_slopes ([Hq] or [B, Hq]), sinks ([Hq]): see the module docstring.
        q_positions: the queries' positions in the keys' coordinates ([Nq], for ``causal`` and ALiBi;
            default ``arange(Nq) + Nk - Nq``; packed documents align per document).

    Returns:
        out [B, Nq, Hq, Dv] float64 and lse [B, Hq, Nq] float64 (log-sum-exp of the modified scores,
        sinks included; a row that sees no key: output 0, LSE -inf, or the sink's logit).

    Raises:
        ValueError: on shapes that do not fit together.
    """
    nk = k.shape[1] if k.ndim == 4 else 0
    nq = q.shape[1] if q.ndim == 4 else 0
    k_pos = torch.arange(nk, device=k.device)
    q_pos = torch.arange(nq, device=k.device) + nk - nq if q_positions is None else q_positions.to(k.device)
    return _attend(q, k, v, q_pos, k_pos, causal, softmax_scale, mask, softcap, alibi_slopes, sinks)


def exact_rows(q_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row_positions: torch.Tensor, *,
                   causal: bool = False, softmax_scale: float | None = None,
                   mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention for some query rows against the full key/value sequence, in float64.

    Args:
        q_rows: [B, R, Hq, D], the queries at global positions ``row_positions``.
        k, v: [B, N, Hkv, D], the full sequence.
        row_positions: LongTensor [R] of global positions in [0, N).
        causal, softmax_scale: as in :func:`exact_attention`.
        mask: optional bool [R, N] (True: row r may see key j), ANDed with ``causal``.

    Returns:
        out_rows [B, R, Hq, D] float64 and lse_rows [B, Hq, R] float64.

    Raises:
        ValueError: on shapes that do not fit together or positions out of range.
    """
    row_positions = torch.as_tensor(row_positions)
    if row_positions.ndim != 1 or (q_rows.ndim == 4 and row_positions.shape[0] != q_rows.shape[1]):
        raise ValueError(f"row_positions must be [R] with R = q_rows.shape[1], got {tuple(row_positions.shape)}")
    if k.ndim == 4 and row_positions.numel() and not (0 <= int(row_positions.min()) <= int(row_positions.max()) < k.shape[1]):
        raise ValueError(f"row_positions must lie in [0, {k.shape[1]})")
    k_pos = torch.arange(k.shape[1] if k.ndim == 4 else 0, device=k.device)
    return _attend(q_rows, k, v, row_positions.long(), k_pos, causal, softmax_scale, mask)
