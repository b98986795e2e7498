"""The ``"reference"`` backend: a plain PyTorch tiled attention kernel, the fallback everywhere.

(Not to be confused with :func:`burstattn.testing.reference.reference_attention`, the float64 test oracle
over whole sequences; this is a kernel of the local-attention seam.)

Keys are processed in tiles of ``tile`` rows with an online softmax, so memory is
``O(Sq * tile)`` per head, never ``O(Sq * Sk)``. Computes in float32 (float64 for float64
inputs) and works on every device and dtype.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .base import expand_kv, reduce_kv_grad


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tile_scores(q: torch.Tensor, kt: torch.Tensor, scale: float, causal: bool, k0: int,
                 mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Scaled scores ``[B, H, Sq, T]`` of one key tile starting at key ``k0``, masked."""
    s = torch.matmul(q, kt.transpose(-1, -2)).mul_(scale)
    if mask is not None:
        s.masked_fill_(~mask[:, k0:k0 + kt.shape[-2]], -math.inf)
    if causal:
        rows = torch.arange(q.shape[-2], device=q.device).unsqueeze(1)
        cols = torch.arange(k0, k0 + kt.shape[-2], device=q.device).unsqueeze(0)
        s.masked_fill_(cols > rows, -math.inf)
    return s


class PlainKernel:
    """Tiled online-softmax attention in plain PyTorch (backend name ``"reference"``).

    NaN in q, k or v gives NaN out (as in ``cpu_flash`` and PyTorch): only the ``-inf - -inf`` of
    rows that see no key so far is defined away (as 0), never a NaN of the data."""

    name = "reference"
    supports_mask = True

    def __init__(self, tile: int = 512) -> None:
        self.tile = tile

    def forward(self, q, k, v, scale, causal, mask=None):
        acc = _acc_dtype(q.dtype)
        hq = q.shape[1]
        qf = q.to(acc)
        kf, vf = expand_kv(k, hq).to(acc), expand_kv(v, hq).to(acc)
        b, h, sq, d = qf.shape
        out = torch.zeros(b, h, sq, d, dtype=acc, device=q.device)
        lse = torch.full((b, h, sq), -math.inf, dtype=acc, device=q.device)
        for k0 in range(0, kf.shape[-2], self.tile):
            kt, vt = kf[:, :, k0:k0 + self.tile], vf[:, :, k0:k0 + self.tile]
            s = _tile_scores(qf, kt, scale, causal, k0, mask)
            tile_lse = torch.logsumexp(s, dim=-1)
            new_lse = torch.logaddexp(lse, tile_lse)
            blind = new_lse == -math.inf  # rows that see no key yet: weights 0 (not exp(-inf + inf) = NaN)
            keep = torch.exp(lse - new_lse).masked_fill_(blind, 0.0).unsqueeze(-1)
            p = torch.exp(s - new_lse.unsqueeze(-1)).masked_fill_(blind.unsqueeze(-1), 0.0)
            out = out * keep + torch.matmul(p, vt)
            lse = new_lse
        return out, lse  # float32 (float64 for float64 inputs)

    def backward(self, dout, q, k, v, out, lse, scale, causal, mask=None):
        acc = _acc_dtype(q.dtype)
        hq, hkv = q.shape[1], k.shape[1]
        qf, dof = q.to(acc), dout.to(acc)
        kf, vf = expand_kv(k, hq).to(acc), expand_kv(v, hq).to(acc)
        lse_f = lse.to(acc).unsqueeze(-1)
        delta = (dof * out.to(acc)).sum(-1, keepdim=True)  # D = rowsum(dO * O)
        dq = torch.zeros_like(qf)
        dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
        for k0 in range(0, kf.shape[-2], self.tile):
            sl = slice(k0, k0 + self.tile)
            kt, vt = kf[:, :, sl], vf[:, :, sl]
            # rows with lse = -inf saw no key: P = 0 there (masked, not nan_to_num: a NaN of the data stays)
            p = torch.exp(_tile_scores(qf, kt, scale, causal, k0, mask) - lse_f).masked_fill_(lse_f == -math.inf, 0.0)
            dv[:, :, sl] = torch.matmul(p.transpose(-1, -2), dof)
            ds = p * (torch.matmul(dof, vt.transpose(-1, -2)) - delta)
            dq += torch.matmul(ds, kt) * scale
            dk[:, :, sl] = torch.matmul(ds.transpose(-1, -2), qf) * scale
        return dq, reduce_kv_grad(dk, hkv), reduce_kv_grad(dv, hkv)


ReferenceKernel = PlainKernel  # the name it had; the backend is still called "reference"
