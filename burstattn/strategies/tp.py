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
* backward (autograd): the all-to-all's adjoint is the same all-to-all (op ``out``); the
  all-gather's adjoint is a reduce-scatter of dq, dk, dv (op ``qkv``), as Megatron's
  sequence-parallel backward reduce-scatters the input gradient; summed in float32
  (``(P-1) * B*n*(Hq + 2*Hkv)*d*4`` bytes).

Requires ``q_heads % P == 0``. Memory: q, k, v of the full sequence on every rank.
"""
from __future__ import annotations

import torch

from ..comm.autograd import all_gather
from ..formulas import accum_dtype, byte_totals, element_size, meta_bytes
from .heads import from_global, heads_to_seq, rank_order, start_heads, to_global
from .local import local_attention


def kv_index(first_head: int, heads: int, group_size: int) -> torch.Tensor:
    """Indices of the kv heads that query heads ``[first_head, first_head + heads)`` read, one
    entry per kv head a local GQA call can use: the distinct ones when every kv head serves the
    same number of these query heads (ratio ``heads / len``), else one per query head.
    ``group_size`` = Hq / Hkv."""
    per_q = torch.arange(first_head, first_head + heads) // group_size
    distinct = torch.unique_consecutive(per_q)
    if heads % len(distinct) == 0 and torch.equal(distinct.repeat_interleave(heads // len(distinct)), per_q):
        return distinct
    return per_q


def run(q, k, v, *, group, causal, softmax_scale, layout, backend="auto") -> torch.Tensor:
    """``q [B, n, Hq, D]``, ``k, v [B, n, Hkv, D]`` (this rank's shard in ``layout``) ->
    ``[B, n, Hq, D]`` in q's dtype.

    Raises:
        ValueError / TypeError on every rank: invalid inputs (see ``check_inputs``), or
        ``q_heads`` not divisible by the group size.
    """
    ring = start_heads("tp", q, k, v, group=group, causal=causal, softmax_scale=softmax_scale,
                       layout=layout, backend=backend)
    p = ring.world_size
    b, n, hq, d = q.shape
    hkv, mine = k.shape[2], hq // p
    qkv = torch.cat([q, k, v], dim=2)  # (B, n, Hq + 2*Hkv, D)
    if p > 1:
        # (B, n, H', D) -> (P, B, n, H', D) -> (B, P, n, H', D) -> (B, N, H', D): rank order
        qkv = all_gather(qkv, ring.group, "qkv").transpose(0, 1).reshape(b, p * n, -1, d)
    order = rank_order(p * n, p, layout)
    full = to_global(qkv, order)  # (B, N, H', D) in global order
    kv = kv_index(ring.rank * mine, mine, hq // hkv).to(q.device)
    out = local_attention(full[:, :, ring.rank * mine:(ring.rank + 1) * mine],
                          full.index_select(2, hq + kv), full.index_select(2, hq + hkv + kv),
                          causal=causal, softmax_scale=softmax_scale, backend=backend)
    # (B, N, Hq/P, D) in global order -> rank order -> (B, n, Hq, D)
    return heads_to_seq(from_global(out, order), ring.group, p, "out")


def bytes_formula(*, batch: int, local_seq: int, world_size: int, q_heads: int, kv_heads: int,
                  head_dim: int, dtype: torch.dtype) -> dict:
    """Bytes each rank sends per call: ``{"forward", "backward", "ops": {(phase, op): bytes}}``."""
    p, e, a = world_size, element_size(dtype), element_size(accum_dtype(dtype))
    shard = batch * local_seq * head_dim * (q_heads + 2 * kv_heads)  # elements of this rank's q, k, v
    out = batch * local_seq * head_dim * q_heads * e * (p - 1) // p
    return byte_totals({("forward", "qkv"): (p - 1) * shard * e, ("forward", "out"): out,
                        ("forward", "meta"): meta_bytes(p),
                        ("backward", "out"): out, ("backward", "qkv"): (p - 1) * shard * a})
