"""``strategy="tp"``: the Megatron-LM tensor-parallel attention baseline.

Mirrors the attention of Megatron-LM with sequence parallelism ("Megatron-V3", Korthikanti
et al., 2022): the layer input arrives as sequence shards; Megatron all-gathers it along the
sequence, the column-parallel QKV projection gives each rank its Hq/P heads over the full
sequence, attention runs per head, and after the row-parallel output projection a
reduce-scatter returns sequence shards. Here there are no projections (inputs are q, k, v
already), so:

* forward: all-gather q, k, v along the sequence (all heads, one all-gather, op ``qkv``:
  ``(P-1) * B*n*(Hq + 2*Hkv)*d*e``; Megatron gathers the hidden input once instead, which for
  multi-head attention is a third of that), keep this rank's query heads
  ``[r*Hq/P, (r+1)*Hq/P)`` and the kv heads they read, run single-device attention over the
  full sequence (global order, every layout exact);
* return to sequence shards with an all-to-all of the attention output (op ``out``:
  ``(P-1)/P * B*n*Hq*d*e``), which moves 1/P of what Megatron's reduce-scatter of the
  projected hidden state moves: without a projection no rank holds partial sums to reduce.
* backward: the all-to-all's adjoint is the same all-to-all (op ``out``); the all-gather's adjoint
  is a reduce-scatter of dq, dk, dv (op ``qkv``), as Megatron's sequence-parallel backward
  reduce-scatters the input gradient; summed in float32 (``(P-1) * B*n*(Hq + 2*Hkv)*d*4`` bytes).

Requires ``q_heads % P == 0``. Memory: q, k, v of the full sequence on every rank during the
forward; this rank's heads of them are kept for the backward. Runs as the custom op
``torch.ops.burstattn.attention_fwd`` (:mod:`burstattn.ops`).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..comm.collectives import Collectives
from ..comm.stats import active_stats
from ..engine.bytes import accum_dtype, byte_totals, element_size, meta_bytes
from ..ops import strategy_call
from .base import check_call
from .heads import from_global, heads_problem, heads_to_seq, rank_order, seq_to_heads, to_global
from .local import local_backward, local_forward


def kv_index(first_head: int, heads: int, group_size: int) -> list[int]:
    """Indices of the kv heads that query heads ``[first_head, first_head + heads)`` read, one
    entry per kv head a local GQA call can use: the distinct ones when every kv head serves the
    same number of these query heads (ratio ``heads / len``), else one per query head.
    ``group_size`` = Hq / Hkv. Plain integers (also for the op's shapes under the compiler)."""
    per_q = [(first_head + i) // group_size for i in range(heads)]
    distinct = sorted(set(per_q))
    if heads % len(distinct) == 0 and [d for d in distinct for _ in range(heads // len(distinct))] == per_q:
        return distinct
    return per_q


def run(q, k, v, keywords) -> torch.Tensor:
    """``q [B, n, Hq, D]``, ``k, v [B, n, Hkv, D]`` (this rank's shard in ``layout``) ->
    ``[B, n, Hq, D]`` in q's dtype.

    Raises:
        ValueError / TypeError on every rank: invalid inputs (see ``check_inputs``), or
        ``q_heads`` not divisible by the group size.
    """
    return strategy_call("tp", q, k, v, keywords)


def check(call, q, k, v):
    """The input check (shapes, ``q_heads % P``) on every rank."""
    problem = heads_problem(q.shape[2], call.where.world_size, "tp")
    check_call(call, q, k, v, problem and (ValueError, problem), group_plan=False)
    return replace(call, plan=None)


def plan_of(call, q, k):
    return None


def _heads(call, q, k):
    """``(first query head, query heads, kv head indices)`` of this rank (kv indices on q's device)."""
    hq, hkv, p = q.shape[2], k.shape[2], call.where.world_size
    mine = hq // p
    return call.where.rank * mine, mine, torch.tensor(kv_index(call.where.rank * mine, mine, hq // hkv),
                                                      device=q.device)


def _coll(call, phase: str):
    return Collectives(call.where.group, phase, active_stats()) if call.where.world_size > 1 else None


def forward(call, q, k, v):
    """``out [B, n, Hq, D]`` and the saved ``[q, k, v, out, lse]`` of this rank's heads over the whole
    sequence in global order."""
    p = call.where.world_size
    b, n, hq, d = q.shape
    hkv = k.shape[2]
    first, mine, kv = _heads(call, q, k)
    qkv = torch.cat([q, k, v], dim=2)  # (B, n, Hq + 2*Hkv, D)
    if p > 1:
        # (B, n, H', D) -> (P, B, n, H', D) -> (B, P, n, H', D) -> (B, N, H', D): rank order
        qkv = _coll(call, "forward").all_gather(qkv, "qkv").transpose(0, 1).reshape(b, p * n, -1, d)
    order = rank_order(p * n, p, call.layout)
    full = to_global(qkv, order)  # (B, N, H', D) in global order
    qh = full[:, :, first:first + mine].contiguous()
    kh, vh = full.index_select(2, hq + kv), full.index_select(2, hq + hkv + kv)
    del qkv, full
    oh, lse = local_forward(call, qh, kh, vh)
    # (B, N, Hq/P, D) in global order -> rank order -> (B, n, Hq, D)
    (out,) = heads_to_seq([from_global(oh, order)], _coll(call, "forward"), p, "out")
    return out, [qh, kh, vh, oh, lse]


BACKWARD_READS_INPUTS = False  # only the shapes and dtypes of q, k, v, out (the op keeps no copy of them)


def backward(call, dout, q, k, v, out, saved):
    """``dq, dk, dv``: the output's all-to-all in reverse (op ``out``), the local backward, and the
    all-gather's adjoint, a reduce-scatter of the full-sequence gradients in float32 (op ``qkv``)."""
    p = call.where.world_size
    b, n, hq, d = q.shape
    hkv, acc = k.shape[2], accum_dtype(q.dtype)
    qh, kh, vh, oh, lse = saved
    first, mine, kv = _heads(call, q, k)
    order = rank_order(p * n, p, call.layout)
    (doh,) = seq_to_heads([dout.to(q.dtype)], _coll(call, "backward"), p, "out")
    doh = to_global(doh, order)
    dqh, dkh, dvh = local_backward(call, doh, qh, kh, vh, oh, lse)
    del doh, saved, qh, kh, vh, oh, lse
    grad = torch.zeros(b, p * n, hq + 2 * hkv, d, dtype=acc, device=q.device)  # (B, N, H', D), global order
    grad[:, :, first:first + mine] = dqh
    grad.index_add_(2, hq + kv, dkh.to(acc))
    grad.index_add_(2, hq + hkv + kv, dvh.to(acc))
    del dqh, dkh, dvh
    grad = from_global(grad, order)  # rank order
    if p > 1:
        # (B, N, H', D) -> (B, P, n, H', D) -> (P, B, n, H', D): the gradient of every rank's shard
        grad = _coll(call, "backward").reduce_scatter(grad.reshape(b, p, n, -1, d).transpose(0, 1), "qkv")
    dq, dk, dv = grad.split([hq, hkv, hkv], dim=2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def fake(call, q, k, v):
    """Empty ``[out, *saved]`` of :func:`forward` (shapes only)."""
    b, n, hq, d = q.shape
    p = call.where.world_size
    mine = hq // p
    kvh = len(kv_index(call.where.rank * mine, mine, hq // k.shape[2]))
    big = n * p
    return [q.new_empty(b, n, hq, d), q.new_empty(b, big, mine, d), k.new_empty(b, big, kvh, d),
            v.new_empty(b, big, kvh, d), q.new_empty(b, big, mine, d),
            q.new_empty(b, mine, big, dtype=accum_dtype(q.dtype))]


def bytes_formula(*, batch: int, local_seq: int, world_size: int, q_heads: int, kv_heads: int,
                  head_dim: int, dtype: torch.dtype) -> dict:
    """Bytes each rank sends per call: ``{"forward", "backward", "ops": {(phase, op): bytes}}``."""
    p, e, a = world_size, element_size(dtype), element_size(accum_dtype(dtype))
    shard = batch * local_seq * head_dim * (q_heads + 2 * kv_heads)  # elements of this rank's q, k, v
    out = batch * local_seq * head_dim * q_heads * e * (p - 1) // p
    return byte_totals({("forward", "qkv"): (p - 1) * shard * e, ("forward", "out"): out,
                        ("forward", "meta"): meta_bytes(p),
                        ("backward", "out"): out, ("backward", "qkv"): (p - 1) * shard * a})
