"""The ``"reference"`` backend: a plain PyTorch tiled attention kernel, the fallback everywhere and
the one kernel that takes every score modifier (softcap, ALiBi), masks and a V head size of its own.

(Not to be confused with :func:`burstattn.testing.oracle.exact_attention`, the float64 test
oracle over whole sequences; this is a kernel of the local-attention seam.)

Keys are processed in tiles of ``tile`` rows with an online softmax, so memory is
``O(Sq * tile)`` per head, never ``O(Sq * Sk)``; each K/V tile is upcast on its own (no float32
copy of the whole block), and GQA query heads are grouped over their kv head instead of
repeating K/V. Computes in float32 (float64 for float64 inputs) on every device and dtype, and
returns float32 gradients.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..config import accum_dtype
from .base import ScoreMods, row_dot


def _grouped(x: torch.Tensor, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, Hq, S, D] -> [B, Hkv, g, S, D]`` in ``dtype`` (query heads grouped by their kv head)."""
    b, hq, s, d = x.shape
    return x.reshape(b, kv_heads, hq // kv_heads, s, d).to(dtype)


def _slopes(mods: Optional[ScoreMods], b: int, hkv: int, g: int) -> Optional[torch.Tensor]:
    """ALiBi slopes ``[B or 1, Hq] -> [B or 1, Hkv, g, 1, 1]`` (float32), or ``None``."""
    if mods is None or mods.alibi is None:
        return None
    a = mods.alibi
    return a.reshape(a.shape[0], hkv, g, 1, 1).float()


def _tile_scores(q: torch.Tensor, kt: torch.Tensor, scale: float, causal: bool, k0: int,
                 mask: Optional[torch.Tensor], mods: Optional[ScoreMods],
                 slopes: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Modified, masked scores ``[B, Hkv, g, Sq, T]`` of one key tile starting at key ``k0`` (``kt``
    ``[B, Hkv, T, D]``), and ``tanh(x / softcap)`` for the backward (``None`` without softcap)."""
    s = torch.matmul(q, kt.unsqueeze(2).transpose(-1, -2)).mul_(scale)
    t = None
    if mods is not None and mods.softcap is not None:
        t = torch.tanh(s.div_(mods.softcap))
        s = t * mods.softcap
    if slopes is not None:
        qp = mods.q_pos.to(q.device, torch.float32)
        kp = mods.k_pos[k0:k0 + kt.shape[-2]].to(q.device, torch.float32)
        dist = (qp[:, None] - kp[None, :]).abs_()  # [Sq, T]
        s = s - slopes.to(s.dtype) * dist.to(s.dtype)
    if mask is not None:
        s = s.masked_fill(~mask[:, k0:k0 + kt.shape[-2]], -math.inf)
    if causal:
        rows = torch.arange(q.shape[-2], device=q.device).unsqueeze(1)
        cols = torch.arange(k0, k0 + kt.shape[-2], device=q.device).unsqueeze(0)
        s = s.masked_fill(cols > rows, -math.inf)
    return s, t


class PlainKernel:
    """Tiled online-softmax attention in plain PyTorch (backend name ``"reference"``).

    NaN in q, k or v gives NaN out (as in ``cpu_flash`` and PyTorch): only the ``-inf - -inf`` of
    rows that see no key so far is defined away (as 0), never a NaN of the data."""

    name = "reference"
    supports = frozenset({"mask", "softcap", "alibi", "v_head_dim"})
    supports_mask = True
    fp32_grads = True
    float32 = True

    def __init__(self, tile: int = 512) -> None:
        self.tile = tile

    def forward(self, q, k, v, scale, causal, mask=None, mods=None):
        acc = accum_dtype(q.dtype)
        b, hq, sq, _ = q.shape
        hkv, dv = k.shape[1], v.shape[-1]
        g = hq // hkv
        qf = _grouped(q, hkv, acc)  # (B, Hkv, g, Sq, D)
        slopes = _slopes(mods, b, hkv, g)
        out = torch.zeros(b, hkv, g, sq, dv, dtype=acc, device=q.device)
        lse = torch.full((b, hkv, g, sq), -math.inf, dtype=acc, device=q.device)
        for k0 in range(0, k.shape[-2], self.tile):
            kt, vt = (x[:, :, k0:k0 + self.tile].to(acc) for x in (k, v))  # (B, Hkv, T, D): one tile upcast
            s, _ = _tile_scores(qf, kt, scale, causal, k0, mask, mods, slopes)
            new_lse = torch.logaddexp(lse, torch.logsumexp(s, dim=-1))
            blind = new_lse == -math.inf  # rows that see no key yet: weights 0 (not exp(-inf + inf) = NaN)
            keep = torch.exp(lse - new_lse).masked_fill_(blind, 0.0).unsqueeze(-1)
            p = torch.exp(s - new_lse.unsqueeze(-1)).masked_fill_(blind.unsqueeze(-1), 0.0)
            out = out * keep + torch.matmul(p, vt.unsqueeze(2))
            lse = new_lse
        # (B, Hkv, g, Sq, Dv) -> (B, Hq, Sq, Dv); float32 (float64 for float64 inputs)
        return out.reshape(b, hq, sq, dv), lse.reshape(b, hq, sq)

    def backward(self, dout, q, k, v, out, lse, scale, causal, mask=None, mods=None):
        acc = accum_dtype(q.dtype)
        b, hq, sq, d = q.shape
        hkv, sk = k.shape[1], k.shape[-2]
        g = hq // hkv
        qf, dof = _grouped(q, hkv, acc), _grouped(dout, hkv, acc)
        lse_f = lse.to(acc).reshape(b, hkv, g, sq, 1)
        delta = row_dot(dout, out, acc).reshape(b, hkv, g, sq, 1)
        slopes = _slopes(mods, b, hkv, g)
        dq = torch.zeros_like(qf)
        dk = torch.zeros(b, hkv, sk, d, dtype=acc, device=q.device)
        dv = torch.zeros(b, hkv, sk, v.shape[-1], dtype=acc, device=q.device)
        for k0 in range(0, sk, self.tile):
            sl = slice(k0, k0 + self.tile)
            kt, vt = k[:, :, sl].to(acc), v[:, :, sl].to(acc)
            s, t = _tile_scores(qf, kt, scale, causal, k0, mask, mods, slopes)
            # rows with lse = -inf saw no key: P = 0 there (masked, not nan_to_num: a NaN of the data stays)
            p = torch.exp(s - lse_f).masked_fill_(lse_f == -math.inf, 0.0)  # (B, Hkv, g, Sq, T)
            dv[:, :, sl] = torch.matmul(p.transpose(-1, -2), dof).sum(2)
            ds = p * (torch.matmul(dof, vt.unsqueeze(2).transpose(-1, -2)) - delta)
            if t is not None:  # d softcap*tanh(x/softcap) / dx = 1 - tanh^2
                ds = ds * (1 - t * t)
            dq += torch.matmul(ds, kt.unsqueeze(2)) * scale
            dk[:, :, sl] = torch.matmul(ds.transpose(-1, -2), qf).sum(2) * scale
        return dq.reshape(b, hq, sq, d), dk, dv
