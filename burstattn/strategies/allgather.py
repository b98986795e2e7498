"""``strategy="allgather"``: all-gather context parallelism (the Llama 3 style).

Forward: one all-gather brings every rank's K/V (at kv heads, packed, op ``kv``) to every
rank; the local queries then attend to each rank's block with the same per-pair plan as the
ring (:func:`burstattn.engine.schedule.block_ops` for ``(this rank, j)``, so every layout and
the causal mask are exact and fully masked blocks are skipped), the partials folded by the
one log-sum-exp merge in float32 (float64 for float64 inputs).

Backward: the K/V are gathered again (op ``kv``, phase backward: the gathered copy is not
kept between forward and backward, so a layer holds only its own shard meanwhile), dQ
accumulates locally, and the dK/dV partials of every block are reduce-scattered to their
owners (op ``dkv``, summed in the accumulator dtype).

Bytes per rank: forward ``(P-1) * 2*B*n*Hkv*d*e``; backward the same plus
``(P-1) * 2*B*n*Hkv*d*a`` (a = 4, or 8 for float64). Memory: O(N*Hkv*d) per rank for the
gathered K/V (plus the float32 dK/dV partials of the whole sequence in the backward).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from ..autograd import RingContext, masked_call, refuse_double_backward, without_autocast
from ..comm.collectives import Collectives
from ..comm.stats import CommStats, active_stats
from ..config import AttnConfig
from ..engine.masked import backward_lse
from ..engine.merge import merge_
from ..engine.ring import op_slices
from ..engine.schedule import block_ops
from ..formulas import accum_dtype, byte_totals, element_size, meta_bytes
from ..kernels import get_kernel, resolve_backend
from .base import start_masked


def _pairs(ring: RingContext, cfg: AttnConfig, n: int):
    """``(j, q rows, k rows, causal)`` for every kernel call of this rank's queries against rank j's K/V
    (dense calls; masked calls use the plan's ops)."""
    for j in range(ring.world_size):
        for op in block_ops(ring.rank, j, ring.world_size, cfg.layout, cfg.causal, n):
            sl = op_slices(op)
            if sl is not None:
                yield (j, *sl)


def _gather_kv(ring: RingContext, k: torch.Tensor, v: torch.Tensor, phase: str,
               stats: Optional[CommStats]) -> torch.Tensor:
    """``k, v [B, Hkv, n, D]`` of this rank -> ``[P, 2, B, Hkv, n, D]`` of every rank."""
    kv = torch.stack([k, v])  # (2, B, Hkv, n, D)
    if ring.world_size == 1:
        return kv.unsqueeze(0)
    return Collectives(ring.group, phase, stats).all_gather(kv, "kv")


class _AllGatherAttn(torch.autograd.Function):
    """``out = f(q, k, v)``; ``cfg`` resolved (concrete backend)."""

    @staticmethod
    @without_autocast
    def forward(ctx, q, k, v, ring: RingContext, cfg: AttnConfig, plan=None):
        qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))  # [B, n, H, D] -> [B, H, n, D] views
        b, hq, n, d = qh.shape
        scale, kernel, stats = cfg.scale_for(d), get_kernel(cfg.backend), active_stats()
        kv = _gather_kv(ring, kh, vh, "forward", stats)
        acc = accum_dtype(q.dtype)
        out32 = torch.zeros(b, hq, n, d, dtype=acc, device=q.device)
        lse = torch.full((b, hq, n), float("-inf"), dtype=acc, device=q.device)
        if plan is not None:  # masked: only the block ops the mask leaves non-empty
            call = masked_call(cfg, plan, n, scale)
            for j in range(ring.world_size):
                for op in plan.row[j]:
                    res = call.forward_op(op, qh, kv[j, 0], kv[j, 1], ring.rank, j)
                    if res is not None:
                        merge_(out32[:, :, res[0]], lse[:, :, res[0]], res[1], res[2])
        for j, qs, ks, causal in (() if plan is not None else _pairs(ring, cfg, n)):
            o_j, lse_j = kernel.forward(qh[:, :, qs], kv[j, 0][:, :, ks], kv[j, 1][:, :, ks], scale, causal)
            merge_(out32[:, :, qs], lse[:, :, qs], o_j, lse_j)
        out = out32.transpose(1, 2).to(q.dtype).contiguous()  # (B, n, Hq, D)
        if any(ctx.needs_input_grad[:3]):
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.ring, ctx.cfg, ctx.stats, ctx.plan = ring, cfg, stats, plan
        return out

    @staticmethod
    @without_autocast
    def backward(ctx, dout):
        refuse_double_backward()
        q, k, v, out, lse = ctx.saved_tensors
        ring, cfg = ctx.ring, ctx.cfg
        stats = active_stats() or ctx.stats
        qh, kh, vh, oh, doh = (x.transpose(1, 2) for x in (q, k, v, out, dout.to(q.dtype)))
        scale, kernel, acc = cfg.scale_for(q.shape[-1]), get_kernel(cfg.backend), accum_dtype(q.dtype)
        kv = _gather_kv(ring, kh, vh, "backward", stats)
        dq = torch.zeros(qh.shape, dtype=acc, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)  # (P, 2, B, Hkv, n, D)
        if ctx.plan is not None:
            call, lse_b = masked_call(cfg, ctx.plan, q.shape[1], scale), backward_lse(lse)
            blocks = ((j, g) for j in range(ring.world_size)
                      for g in call.backward_ops(ctx.plan.row[j], doh, qh, kv[j, 0], kv[j, 1], oh, lse_b, ring.rank, j))
        else:
            blocks = ((j, (qs, ks, *kernel.backward(doh[:, :, qs], qh[:, :, qs], kv[j, 0][:, :, ks], kv[j, 1][:, :, ks],
                                                    oh[:, :, qs], lse[:, :, qs], scale, causal)))
                      for j, qs, ks, causal in _pairs(ring, cfg, q.shape[1]))
        for j, (qs, ks, dq_j, dk_j, dv_j) in blocks:
            dq[:, :, qs] += dq_j
            dkv[j, 0][:, :, ks] += dk_j
            dkv[j, 1][:, :, ks] += dv_j
        mine = dkv[0] if ring.world_size == 1 else Collectives(ring.group, "backward", stats).reduce_scatter(dkv, "dkv")
        return (dq.transpose(1, 2).to(q.dtype), mine[0].transpose(1, 2).to(k.dtype),
                mine[1].transpose(1, 2).to(v.dtype), None, None, None)


def run(q, k, v, *, group, causal, softmax_scale, layout, backend="auto", **mask_args) -> torch.Tensor:
    """``q [B, n, Hq, D]``, ``k, v [B, n, Hkv, D]`` (this rank's shard in ``layout``) ->
    ``[B, n, Hq, D]`` in q's dtype. Raises on every rank for invalid inputs (``check_inputs``).
    With a mask (``mask_args``) only the non-empty block ops are computed; the gathers move the
    same bytes (an all-gather cannot skip ranks)."""
    ring, cfg, plan = start_masked("allgather", q, k, v, group=group, causal=causal, softmax_scale=softmax_scale,
                                   layout=layout, backend=backend, mask_args=mask_args)
    cfg = replace(cfg, backend=resolve_backend(backend, q.device, q.dtype))
    return _AllGatherAttn.apply(q, k, v, ring, cfg, plan)


def bytes_formula(*, batch: int, local_seq: int, world_size: int, q_heads: int, kv_heads: int,
                  head_dim: int, dtype: torch.dtype) -> dict:
    """Bytes each rank sends per call: ``{"forward", "backward", "ops": {(phase, op): bytes}}``."""
    p, e, a = world_size, element_size(dtype), element_size(accum_dtype(dtype))
    kv = (p - 1) * 2 * batch * local_seq * kv_heads * head_dim  # elements of the other ranks' K/V
    return byte_totals({("forward", "kv"): kv * e, ("forward", "meta"): meta_bytes(p),
                        ("backward", "kv"): kv * e, ("backward", "dkv"): kv * a})
