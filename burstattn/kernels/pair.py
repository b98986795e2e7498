"""A masked block pair in one kernel call per rule (:class:`VarlenPair`): its :class:`~.bands.PairBands`
run on PyTorch's CUDA flash kernel (16-bit), its memory-efficient kernel (float32) or flash-attn's varlen
functions, with the plain-PyTorch reference of :mod:`.varlen` standing in on real CPU tensors (a step
modelled on CUDA, the tests). Engine tensors are ``[B, h, n, D]``; the pair's results cover its span of
rows (``bands.rows``) and keys (``bands.keys``).
"""
from __future__ import annotations

import importlib.util
import inspect

import torch

from ..config import accum_dtype
from . import varlen as vl
from .bands import PairBands

PAIR_KERNELS = ("aten_flash", "aten_efficient", "flash_attn")


def on_device(x: torch.Tensor) -> bool:
    """Whether ``x`` runs the CUDA kernels: a CUDA tensor, or a fake tensor (their shape functions)."""
    from torch._subclasses.fake_tensor import is_fake

    return x.is_cuda or is_fake(x)


def _fix_blind(lse: torch.Tensor) -> torch.Tensor:
    """flash writes LSE ``+inf`` for a row that sees nothing; the merge reads ``-inf``."""
    return lse.masked_fill(lse == float("inf"), float("-inf"))


class VarlenPair:
    """One masked pair as varlen calls of ``kernel`` (one of :data:`PAIR_KERNELS`)."""

    def __init__(self, kernel: str) -> None:
        if kernel not in PAIR_KERNELS:
            raise ValueError(f"kernel must be one of {PAIR_KERNELS}, got {kernel!r}")
        self.kernel = kernel

    def supports(self, bands: PairBands) -> bool:
        """Whether every call of ``bands`` runs on this kernel (the efficient kernel takes no window)."""
        return self.kernel != "aten_efficient" or all(vl.efficient_mask_type(c) is not None for c in bands.calls)

    # -- one call -------------------------------------------------------------------------------------
    def _fwd(self, call, q, k, v, scale, batch):
        if not on_device(q):
            return vl.reference_forward(call, q, k, v, scale, batch)
        if self.kernel == "aten_efficient":
            g = q.shape[1] // k.shape[1]
            k, v = (x.repeat_interleave(g, dim=1) for x in (k, v))
            args, kw = vl.efficient_forward_args(call, q[None], k[None], v[None], scale, batch)
            res = torch.ops.aten._efficient_attention_forward(*args, **kw)
            return res[0][0], vl.efficient_rows(res[1], call, batch)
        if self.kernel == "flash_attn":
            return _flash_attn_forward(call, q, k, v, scale, batch)
        args, kw = vl.flash_forward_args(call, q, k, v, scale, batch)
        res = torch.ops.aten._flash_attention_forward(*args, **kw)
        return res[0], res[1]

    def _bwd(self, call, dout, q, k, v, out, lse, scale, batch):
        if not on_device(q):
            return vl.reference_backward(call, dout, q, k, v, out, lse, scale, batch)
        if self.kernel == "aten_efficient":
            hk, g = k.shape[1], q.shape[1] // k.shape[1]
            ke, ve = (x.repeat_interleave(g, dim=1) for x in (k, v))
            args, kw = vl.efficient_backward_args(call, dout[None], q[None], ke[None], ve[None], out[None],
                                                  vl.efficient_lse(lse, call, batch), scale, batch)
            dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(*args, **kw)
            # (1, T, Hq, D) -> (T, Hkv, g, D) summed over g
            return dq[0], *(x[0].view(x.shape[1], hk, g, x.shape[-1]).sum(2) for x in (dk, dv))
        if self.kernel == "flash_attn":
            return _flash_attn_backward(call, dout, q, k, v, out, lse, scale, batch)
        args, kw = vl.flash_backward_args(call, dout, q, k, v, out, lse, scale, batch)
        return torch.ops.aten._flash_attention_backward(*args, **kw)

    # -- one pair -------------------------------------------------------------------------------------
    def forward(self, bands: PairBands, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
        """``(rows, out [B, h, R, Dv], lse [B, h, R])`` over the span ``rows`` of ``q [B, h, n, D]`` against
        ``k, v [B, hk, n_k, D]``: one kernel call per :class:`~.bands.BandCall`; rows no call covers get 0
        and ``-inf``."""
        batch, h, acc = q.shape[0], q.shape[1], accum_dtype(q.dtype)
        r0, r1 = bands.rows
        single = len(bands.calls) == 1 and bands.calls[0].q_runs == ((r0, r1),)
        if not single:
            out = q.new_zeros(batch, h, r1 - r0, v.shape[-1])
            lse = torch.full((batch, h, r1 - r0), float("-inf"), dtype=acc, device=q.device)
        for c in bands.calls:
            o, l = self._fwd(c, vl.pack(q, c.q_runs), vl.pack(k, c.k_runs), vl.pack(v, c.k_runs), scale, batch)
            o = vl.unpack(o, batch)                                           # [B, h, T, Dv]
            l = _fix_blind(l.to(acc)).view(h, batch, -1).transpose(0, 1)      # [H, B*T] -> [B, h, T]
            if single:
                return slice(r0, r1), o, l
            idx = _index(c.q_runs, r0, q.device)
            out.index_copy_(2, idx, o.to(out.dtype))
            lse.index_copy_(2, idx, l)
        return slice(r0, r1), out, lse

    def backward(self, bands: PairBands, dout, q, k, v, out, lse, scale: float):
        """``(rows, keys, dq [B, h, R, D], dk, dv [B, hk, K, D])`` over the pair's spans; ``dout, out``
        ``[B, h, n, Dv]``, ``lse [B, h, n]`` (the rows' global LSE; huge for rows that see nothing)."""
        batch, hk, acc = q.shape[0], k.shape[1], accum_dtype(q.dtype)
        r0, r1 = bands.rows
        k0, k1 = bands.keys
        dq = torch.zeros(batch, q.shape[1], r1 - r0, q.shape[-1], dtype=acc, device=q.device)
        dk = torch.zeros(batch, hk, k1 - k0, k.shape[-1], dtype=acc, device=q.device)
        dv = torch.zeros(batch, hk, k1 - k0, v.shape[-1], dtype=acc, device=q.device)
        for c in bands.calls:
            # the rows' LSE [B, h, n] -> [H, B*T] (float32: the kernels' own; float64 for the reference)
            rows_lse = vl.pack(lse.unsqueeze(-1), c.q_runs)[..., 0].transpose(0, 1).to(acc).contiguous()
            g = self._bwd(c, vl.pack(dout, c.q_runs), vl.pack(q, c.q_runs), vl.pack(k, c.k_runs),
                          vl.pack(v, c.k_runs), vl.pack(out, c.q_runs), rows_lse, scale, batch)
            dq.index_copy_(2, _index(c.q_runs, r0, q.device), vl.unpack(g[0], batch).to(acc))
            kidx = _index(c.k_runs, k0, q.device)
            dk.index_add_(2, kidx, vl.unpack(g[1], batch).to(acc))  # boxes may overlap: add
            dv.index_add_(2, kidx, vl.unpack(g[2], batch).to(acc))
        return slice(r0, r1), slice(k0, k1), dq, dk, dv


def _index(runs: tuple, base: int, device) -> torch.Tensor:
    return torch.cat([torch.arange(a - base, b - base, device=device) for a, b in runs])


def flash_attn_varlen_available() -> bool:
    """Whether flash-attn's varlen functions can run (CUDA and the package)."""
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def _flash_attn_kwargs(fn, call, scale: float) -> dict:
    """Keywords of flash-attn's low-level varlen functions, built from their signature (the window's
    spelling changed across 2.x: ``window_size`` became ``window_size_left`` / ``_right``)."""
    params = set(inspect.signature(fn).parameters)
    left, right = call.window
    kw = dict(dropout_p=0.0, softmax_scale=scale, causal=call.causal)
    if "window_size_left" in params:
        kw.update(window_size_left=left, window_size_right=right)
    else:
        kw["window_size"] = (left, right)
    for name, value in (("softcap", 0.0), ("alibi_slopes", None), ("return_softmax", False),
                        ("deterministic", False)):
        if name in params:
            kw[name] = value
    return kw


def _flash_attn_forward(call, q, k, v, scale, batch):
    from flash_attn.flash_attn_interface import _flash_attn_varlen_forward as fwd

    cq, ck = vl.cumulative(call.cu_q, batch, q.device), vl.cumulative(call.cu_k, batch, q.device)
    kw = {n: x for n, x in _flash_attn_kwargs(fwd, call, scale).items() if n != "deterministic"}
    res = fwd(q, k, v, cq, ck, call.max_q, call.max_k, **kw)
    return res[0], res[1]


def _flash_attn_backward(call, dout, q, k, v, out, lse, scale, batch):
    from flash_attn.flash_attn_interface import _flash_attn_varlen_backward as bwd

    cq, ck = vl.cumulative(call.cu_q, batch, q.device), vl.cumulative(call.cu_k, batch, q.device)
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    kw = {n: x for n, x in _flash_attn_kwargs(bwd, call, scale).items() if n != "return_softmax"}
    bwd(dout, q, k, v, out, lse, dq, dk, dv, cq, ck, call.max_q, call.max_k, **kw)
    return dq, dk, dv
