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

import torch

from ..call.engine_adapter import block_calls, call_positions
from ..comm.collectives import Collectives
from ..comm.host import host_side
from ..comm.stats import active_stats
from ..engine.bytes import accum_dtype, byte_totals, element_size, meta_bytes
from ..engine.run import build_plan, gathered_backward, gathered_forward
from ..layouts.named import local_positions
from ..ops import strategy_call
from .base import check_call


def run(q, k, v, keywords) -> torch.Tensor:
    """``q [B, n, Hq, D]``, ``k, v [B, n, Hkv, D]`` (this rank's shard in ``layout``) ->
    ``[B, n, Hq, D]`` in q's dtype. Raises on every rank for invalid inputs (``check_inputs``).
    ``keywords``: a :class:`~burstattn.call.options.Keywords`. With a mask only the non-empty block ops are computed; the gathers move the
    same bytes (an all-gather cannot skip ranks). ``grad_partials``: as for :func:`burstattn.burst_attn_func`
    (its block calls are the engine's)."""
    return strategy_call("allgather", q, k, v, keywords)


def check(call, q, k, v):
    """The input check on every rank; the call with this rank's mask plan over the group."""
    return replace(call, plan=check_call(call, q, k, v))


def plan_of(call, q, k):
    """This rank's mask plan over the group (``None`` for a dense call)."""
    from ..masks.setup import plan_for

    return plan_for(q, call, call.where.rank, call.where.world_size, k.shape[1])[0]


def _setup(call, q, v):
    """The one-step plan over every rank's gathered K/V and its kernel calls."""
    where, n = call.where, q.shape[1]  # the call's backend was resolved once, by prepare
    with host_side():  # positions and plans are host-side (real tensors in a dry run too, as engine_pass's)
        pos = [local_positions(n * where.world_size, r, where.world_size, call.layout) for r in range(where.world_size)]
        plan = build_plan(where.rank, where.world_size, positions=pos, causal=call.causal, travelling="kv",
                          schedule="gathered", blocks=None if call.plan is None else call.plan.blocks)
    calls = block_calls(call, call.plan is not None, call_positions(call, where.world_size, n, n), call.scale_for(q.shape[3]),
                        q, v)
    return plan, calls


def _gather_kv(call, k: torch.Tensor, v: torch.Tensor, phase: str) -> torch.Tensor:
    """``k, v [B, n, Hkv, D]`` of this rank -> ``[P, 2, B, Hkv, n, D]`` of every rank."""
    kv = torch.stack([k.transpose(1, 2), v.transpose(1, 2)])  # (2, B, Hkv, n, D)
    if call.where.world_size == 1:
        return kv.unsqueeze(0)
    return Collectives(call.where.group, phase, active_stats()).all_gather(kv, "kv")


def forward(call, q, k, v):
    """``out [B, n, Hq, D]`` and the saved ``[lse]`` (``[B, Hq, n]``)."""
    kv = _gather_kv(call, k, v, "forward")
    plan, calls = _setup(call, q, v)
    out, lse = gathered_forward(plan, calls, q, dict(enumerate(kv.unbind(0))))
    return out, [lse]


def backward(call, dout, q, k, v, out, saved):
    """``dq, dk, dv``: K/V gathered again (op ``kv``), the local backward, the dK/dV partials of every
    owner reduce-scattered to it in float32 (op ``dkv``)."""
    (lse,) = saved
    kv = _gather_kv(call, k, v, "backward")
    plan, calls = _setup(call, q, v)
    dq, per_owner = gathered_backward(plan, calls, dout, q, dict(enumerate(kv.unbind(0))), out, lse)
    dkv = torch.zeros(kv.shape, dtype=accum_dtype(q.dtype), device=q.device)  # (P, 2, B, Hkv, n, D)
    for j, (dk_j, dv_j) in per_owner.items():
        dkv[j, 0], dkv[j, 1] = dk_j, dv_j
    where = call.where
    mine = dkv[0] if where.world_size == 1 else Collectives(where.group, "backward", active_stats()).reduce_scatter(
        dkv, "dkv")
    return dq.to(q.dtype), mine[0].transpose(1, 2).to(k.dtype), mine[1].transpose(1, 2).to(v.dtype)


def fake(call, q, k, v):
    """Empty ``[out, lse]`` of :func:`forward` (shapes only)."""
    b, n, hq, d = q.shape
    return [q.new_empty(b, n, hq, v.shape[-1]), q.new_empty(b, hq, n, dtype=accum_dtype(q.dtype))]


def bytes_formula(*, batch: int, local_seq: int, world_size: int, q_heads: int, kv_heads: int,
                  head_dim: int, dtype: torch.dtype) -> dict:
    """Bytes each rank sends per call: ``{"forward", "backward", "ops": {(phase, op): bytes}}``."""
    p, e, a = world_size, element_size(dtype), element_size(accum_dtype(dtype))
    kv = (p - 1) * 2 * batch * local_seq * kv_heads * head_dim  # elements of the other ranks' K/V
    return byte_totals({("forward", "kv"): kv * e, ("forward", "meta"): meta_bytes(p),
                        ("backward", "kv"): kv * e, ("backward", "dkv"): kv * a})
