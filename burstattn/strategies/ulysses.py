"""``strategy="ulysses"``: DeepSpeed-Ulysses (Jacobs et al., 2023).

One all-to-all turns sequence shards into head shards: rank j gets query heads
``[j*Hq/P, (j+1)*Hq/P)`` (and the kv heads they read) over the whole sequence, reordered from
the layout's shards into global token order (:func:`burstattn.layouts.named.local_positions`); it
runs single-device attention (:func:`~burstattn.strategies.local.local_forward`: the engine at a
world of one, causal on the global order, so every layout is exact); a second all-to-all returns
the output to sequence shards. The backward mirrors it: the adjoint of each all-to-all is the
same all-to-all of the gradients (phase ``"backward"``). It runs as the custom op
``torch.ops.burstattn.attention_fwd`` (:mod:`burstattn.ops`).

Requires ``q_heads % P == 0``. GQA: with ``kv_heads % P == 0`` the kv heads are split like
the query heads; otherwise each kv head is repeated ``lcm(kv_heads, P) / kv_heads`` times
before the all-to-all, so every rank receives exactly the kv heads its query heads read
(e.g. 8 query / 2 kv heads on 4 ranks: each kv head twice, one kv head per rank). The kv
bytes grow by that factor.

Bytes per rank and pass: ``(P-1)/P * B*n*(2*Hq + 2*Hkv')*d*e`` with ``Hkv' = lcm(Hkv, P)``
(q, k, v in one all-to-all, op ``qkv``; the output, op ``out``), the same in the backward:
independent of P for a fixed local length n. Memory: the full sequence for Hq/P heads.
"""
from __future__ import annotations

import torch

from ..comm.collectives import Collectives
from ..comm.stats import active_stats
from ..engine.bytes import accum_dtype, byte_totals, meta_bytes
from ..ops import strategy_call
from .base import check_call
from .heads import (a2a_bytes, from_global, heads_problem, heads_to_seq, kv_repeats, rank_order, repeat_kv,
                    seq_to_heads, to_global, unrepeat_kv)
from .local import local_backward, local_forward, local_plan


def run(q, k, v, keywords) -> torch.Tensor:
    """``q [B, n, Hq, D]``, ``k, v [B, n, Hkv, D]`` (this rank's shard in ``layout``) ->
    ``[B, n, Hq, D]`` in q's dtype. ``keywords``: a :class:`~burstattn.call.options.Keywords`. With a mask the local attention over the whole
    sequence computes only the block ops the mask leaves non-empty (the all-to-alls are unchanged).

    Raises:
        ValueError / TypeError on every rank: invalid inputs or mask (see ``check_inputs``), or
        ``q_heads`` not divisible by the group size.
    """
    return strategy_call("ulysses", q, k, v, keywords)


def check(call, q, k, v):
    """The input check (shapes, mask, ``q_heads % P``) on every rank; the call with its local mask plan."""
    from dataclasses import replace

    problem = heads_problem(q.shape[2], call.where.world_size, "ulysses")
    check_call(call, q, k, v, problem and (ValueError, problem), group_plan=False)
    return replace(call, plan=plan_of(call, q, k))


def plan_of(call, q, k):
    """The world-of-one mask plan of the whole sequence (``None`` without a mask)."""
    return local_plan(call, q.shape[1] * call.where.world_size)


def _coll(call, phase: str):
    return Collectives(call.where.group, phase, active_stats()) if call.where.world_size > 1 else None


def forward(call, q, k, v):
    """``out [B, n, Hq, D]`` and the saved ``[q, k, v, out, lse]`` of the local attention (head shards
    in global order: ``[B, N, Hq/P, D]``, ``[B, N, Hkv'/P, D]``, LSE ``[B, Hq/P, N]``)."""
    p = call.where.world_size
    coll, reps = _coll(call, "forward"), kv_repeats(k.shape[2], p)
    # (B, n, Hkv, D) -> (B, n, Hkv*reps, D); then each -> (B, N, H/P, D) in rank order
    heads = seq_to_heads([q, repeat_kv(k, reps), repeat_kv(v, reps)], coll, p, "qkv")
    order = rank_order(q.shape[1] * p, p, call.layout)
    qg, kg, vg = (to_global(x, order).contiguous() for x in heads)
    del heads  # every intermediate goes as soon as it is used: the peak is what the model counts
    og, lse = local_forward(call, qg, kg, vg, call.plan)
    # (B, N, Hq/P, D) in global order -> rank order -> (B, n, Hq, D)
    (out,) = heads_to_seq([from_global(og, order)], coll, p, "out")
    return out, [qg, kg, vg, og, lse]


BACKWARD_READS_INPUTS = False  # only the shapes and dtypes of q, k, v, out (the op keeps no copy of them)


def backward(call, dout, q, k, v, out, saved):
    """``dq, dk, dv``: the output's all-to-all in reverse (op ``out``), the local backward, the q/k/v
    all-to-all in reverse (op ``qkv``), the repeated kv heads' gradients summed."""
    p = call.where.world_size
    qg, kg, vg, og, lse = saved
    coll, reps = _coll(call, "backward"), kv_repeats(k.shape[2], p)
    order = rank_order(q.shape[1] * p, p, call.layout)
    (dog,) = seq_to_heads([dout.to(q.dtype)], coll, p, "out")  # (B, n, Hq, D) -> (B, N, Hq/P, D)
    dog = to_global(dog, order)
    grads = local_backward(call, dog, qg, kg, vg, og, lse, call.plan)
    del dog, saved, qg, kg, vg, og, lse
    grads = [from_global(g, order) for g in grads]
    dq, dk, dv = heads_to_seq(grads, coll, p, "qkv")
    del grads
    return dq, unrepeat_kv(dk, reps, k.dtype), unrepeat_kv(dv, reps, v.dtype)


def fake(call, q, k, v):
    """Empty ``[out, *saved]`` of :func:`forward` (shapes only)."""
    b, n, hq, d = q.shape
    p = call.where.world_size
    kvh = k.shape[2] * kv_repeats(k.shape[2], p) // p
    return [q.new_empty(b, n, hq, d), q.new_empty(b, n * p, hq // p, d), k.new_empty(b, n * p, kvh, d),
            v.new_empty(b, n * p, kvh, d), q.new_empty(b, n * p, hq // p, d),
            q.new_empty(b, hq // p, n * p, dtype=accum_dtype(q.dtype))]


def bytes_formula(*, batch: int, local_seq: int, world_size: int, q_heads: int, kv_heads: int,
                  head_dim: int, dtype: torch.dtype) -> dict:
    """Bytes each rank sends per call: ``{"forward", "backward", "ops": {(phase, op): bytes}}``."""
    return byte_totals(a2a_bytes(batch=batch, local_seq=local_seq, degree=world_size, q_heads=q_heads,
                                 kv_heads=kv_heads, head_dim=head_dim, dtype=dtype),
                       {("forward", "meta"): meta_bytes(world_size)})
