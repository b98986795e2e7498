"""``strategy="allgather"``: all-gather context parallelism (the Llama 3 style).

Forward: one all-gather brings every rank's K/V (at kv heads, packed, op ``kv``) to every
rank; the local queries then attend to each rank's block with the same per-pair plan as the
ring (:func:`burstattn.engine.pairs.position_ops` for ``(this rank, j)``, so every layout and
the causal mask are exact and fully masked blocks are skipped), the partials folded by the
one log-sum-exp merge in float32 (float64 for float64 inputs): the engine's
:func:`~burstattn.engine.run.gathered_forward` over a one-step plan.

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

from ..autograd import block_calls, call_positions, refuse_double_backward, without_autocast
from ..comm.collectives import Collectives
from ..comm.stats import CommStats, active_stats
from ..config import AttnConfig
from ..engine.pairs import ops_from_positions
from ..engine.plan import local
from ..engine.run import gathered_backward, gathered_forward
from ..formulas import accum_dtype, byte_totals, element_size, meta_bytes
from ..groups import GroupContext
from ..kernels import resolve_backend
from ..layout import local_positions
from .base import start_masked


def _local_plan(ring: GroupContext, cfg: AttnConfig, n: int, plan):
    """One step, no transfers: this rank's queries against every rank's gathered K/V (the mask
    plan's ops with a mask, else the ops from the positions)."""
    p = ring.world_size
    if plan is not None:
        ops_of = lambda q, k: plan.row[k]  # noqa: E731 - q is always this rank
    else:
        pos = [local_positions(n * p, r, p, cfg.layout) for r in range(p)]
        ops_of = ops_from_positions(pos, pos, cfg.causal)
    return local(ring.rank, list(range(p)), ops_of)


def _gather_kv(ring: GroupContext, k: torch.Tensor, v: torch.Tensor, phase: str,
               stats: Optional[CommStats]) -> torch.Tensor:
    """``k, v [B, Hkv, n, D]`` of this rank -> ``[P, 2, B, Hkv, n, D]`` of every rank."""
    kv = torch.stack([k, v])  # (2, B, Hkv, n, D)
    if ring.world_size == 1:
        return kv.unsqueeze(0)
    return Collectives(ring.group, phase, stats).all_gather(kv, "kv")


class _AllGatherAttn(torch.autograd.Function):
    """``out = f(q, k, v)``; ``cfg`` resolved (concrete backend). The local pass is the engine's
    (:func:`burstattn.engine.loop.run_plan` on a one-step plan)."""

    @staticmethod
    @without_autocast
    def forward(ctx, q, k, v, ring: GroupContext, cfg: AttnConfig, plan=None):
        kh, vh = (x.transpose(1, 2) for x in (k, v))  # [B, n, H, D] -> [B, H, n, D] views
        n, d = q.shape[1], q.shape[3]
        stats = active_stats()
        kv = _gather_kv(ring, kh, vh, "forward", stats)
        calls = block_calls(cfg, plan is not None, call_positions(cfg, ring.world_size, n, n), cfg.scale_for(d), q, v)
        out, lse = gathered_forward(_local_plan(ring, cfg, n, plan), calls, q, dict(enumerate(kv.unbind(0))))
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
        kh, vh = (x.transpose(1, 2) for x in (k, v))
        n, acc = q.shape[1], accum_dtype(q.dtype)
        kv = _gather_kv(ring, kh, vh, "backward", stats)
        calls = block_calls(cfg, ctx.plan is not None, call_positions(cfg, ring.world_size, n, n), cfg.scale_for(q.shape[-1]),
                            q, v)
        dq, per_owner = gathered_backward(_local_plan(ring, cfg, n, ctx.plan), calls, dout, q,
                                          dict(enumerate(kv.unbind(0))), out, lse)
        dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)  # (P, 2, B, Hkv, n, D)
        for j, (dk_j, dv_j) in per_owner.items():
            dkv[j, 0], dkv[j, 1] = dk_j, dv_j
        mine = dkv[0] if ring.world_size == 1 else Collectives(ring.group, "backward", stats).reduce_scatter(dkv, "dkv")
        return (dq.to(q.dtype), mine[0].transpose(1, 2).to(k.dtype),
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
