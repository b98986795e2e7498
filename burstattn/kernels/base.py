"""The backend seam: what a local attention kernel must provide.

All tensors are in the engine's internal layout ``[batch, heads, seq, head_dim]``:
``q [B, Hq, Sq, D]``, ``k [B, Hkv, Sk, D]``, ``v [B, Hkv, Sk, Dv]`` with ``Hq % Hkv == 0`` (query
head h uses kv head ``h // (Hq // Hkv)``; ``Dv`` may differ from ``D``, as in MLA).
``causal=True`` is only asked for with ``Sq == Sk`` and means key j is visible to query i iff
``j <= i``. ``mask`` (optional, bool ``[Sq, Sk]``, True = visible, shared by every batch and head)
is the explicit mask of a partially masked block; it is never combined with ``causal``.
``mods`` (optional :class:`ScoreMods`) are score modifiers: softcapping and ALiBi. A kernel
declares what it takes in ``supports`` (a frozenset of ``"mask"``, ``"softcap"``, ``"alibi"``,
``"v_head_dim"``); the engine never hands it anything else (see
:func:`burstattn.kernels.resolve_backend`).

A row that sees no key returns output 0; its LSE is undefined (the engine sets ``-inf``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from ..config import accum_dtype


@dataclass(frozen=True)
class ScoreMods:
    """Score modifiers of one kernel call; ``None`` fields are off.

    The score of query row i and key j is ``s = scale * q_i . k_j``, then
    ``s = softcap * tanh(s / softcap)`` (Gemma 2, Grok), then ``s -= slope_h * |qp_i - kp_j|``
    (ALiBi) with ``alibi [B or 1, Hq]`` float32 slopes and the rows' and keys' GLOBAL positions
    ``q_pos [Sq]`` / ``k_pos [Sk]`` (int64; the queries' positions already aligned to the keys'
    coordinates, see :meth:`burstattn.AttnMask.aligned`). Masks apply after both.
    """

    softcap: Optional[float] = None
    alibi: Optional[torch.Tensor] = None
    q_pos: Optional[torch.Tensor] = None
    k_pos: Optional[torch.Tensor] = None


class Kernel(Protocol):
    """A local flash-style attention kernel that exposes the log-sum-exp."""

    name: str
    supports: frozenset  # of "mask", "softcap", "alibi", "v_head_dim"
    fp32_grads: bool  # whether backward returns float32 gradients for 16-bit inputs
    float32: bool  # whether it takes float32 inputs (the engine's float32 partials upcast to them)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                mask: Optional[torch.Tensor] = None,
                mods: Optional[ScoreMods] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``out [B, Hq, Sq, Dv]`` (q.dtype or float32) and ``lse [B, Hq, Sq]`` float32."""
        ...

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool,
                 mask: Optional[torch.Tensor] = None,
                 mods: Optional[ScoreMods] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients of one block given the *global* ``out`` and ``lse`` of these query rows.

        Uses ``P = exp(S - lse)`` (S the modified, masked scores) and ``D = rowsum(dout * out)``, so
        the block's forward is never recomputed in full. A row whose global LSE is huge (``1e30``,
        the engine's marker for a row that sees no key anywhere) gets zero gradients. Returns
        ``dq [B, Hq, Sq, D]``, ``dk [B, Hkv, Sk, D]``, ``dv [B, Hkv, Sk, Dv]`` (any float dtype; the
        engine accumulates in float32).
        """
        ...


ROW_CHUNK = 1024  # the fewest rows per chunk of the row-wise float32 helpers and the float32 tiles
# Elements per chunk (32 MiB in float32): a chunk of rows bounds the float32 copies by bytes, not by rows,
# so thin rows (one head group of a long sequence) take few, large chunks: each chunk is a dozen kernel
# launches on a GPU (and a dozen traced ops in a dry run), 1,024-row chunks of 32K rows were 32 of them.
CHUNK_ELEMENTS = 1 << 23


def chunk_rows(per_row: int, elements: int = CHUNK_ELEMENTS) -> int:
    """Rows per chunk of rows of ``per_row`` elements each: as many as ``elements`` hold, at least
    :data:`ROW_CHUNK`."""
    return max(ROW_CHUNK, elements // max(int(per_row), 1))


def row_dot(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The one ``D = rowsum(dO * O)``: ``rowsum(a * b)`` in ``dtype`` for ``a, b [..., n, D]`` ->
    ``[..., n]``, a chunk of :func:`chunk_rows` rows at a time, so the upcast copies stay small."""
    out = torch.empty(a.shape[:-1], dtype=dtype, device=a.device)
    step = chunk_rows(a.numel() // max(a.shape[-2], 1))
    for i in range(0, a.shape[-2], step):
        rows = slice(i, i + step)
        out[..., rows] = (a[..., rows, :].to(dtype) * b[..., rows, :].to(dtype)).sum(-1)
    return out


def expand_kv(x: torch.Tensor, q_heads: int) -> torch.Tensor:
    """``[B, Hkv, S, D] -> [B, Hq, S, D]`` by repeating each kv head ``Hq // Hkv`` times."""
    groups = q_heads // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def reduce_kv_grad(g: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, Hq, S, D] -> [B, Hkv, S, D]``: sum the gradients of the repeated kv heads (in float32
    for 16-bit inputs, then back: one rounding, not one per head)."""
    b, hq, s, d = g.shape
    if hq == kv_heads:
        return g
    # (B, Hq, S, D) -> (B, Hkv, g, S, D) -> sum over g
    return g.view(b, kv_heads, hq // kv_heads, s, d).sum(dim=2, dtype=accum_dtype(g.dtype)).to(g.dtype)


def mask_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask ``[Sq, Sk]`` -> additive bias ``[Sq, Sk]`` of ``dtype`` (0 visible, -inf masked)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def pad_head_dims(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """For fused kernels that need one head size: zero-pad q/k or v on the head dimension to the
    larger of ``D`` and ``Dv`` (zeros change no score and no output column). A copy of the block
    only when the sizes differ; the wire never carries the padding."""
    d, dv = q.shape[-1], v.shape[-1]
    if d == dv:
        return q, k, v
    if dv > d:
        return (torch.nn.functional.pad(q, (0, dv - d)), torch.nn.functional.pad(k, (0, dv - d)), v)
    return q, k, torch.nn.functional.pad(v, (0, d - dv))
