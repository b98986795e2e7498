"""``strategy="ulysses"``: DeepSpeed-Ulysses (Jacobs et al., 2023).

One all-to-all turns sequence shards into head shards: rank j gets query heads
``[j*Hq/P, (j+1)*Hq/P)`` (and the kv heads they read) over the whole sequence, reordered from
the layout's shards into global token order (:func:`burstattn.layout.local_positions`); it
runs ordinary single-device attention (:func:`~burstattn.strategies.local.local_attention`,
causal on the global order, so every layout is exact); a second all-to-all returns the
output to sequence shards. The backward is plain autograd: the adjoint of each all-to-all is
the same all-to-all of the gradients (phase ``"backward"``).

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

from ..formulas import byte_totals, meta_bytes
from .base import label, start_masked
from .heads import (a2a_bytes, from_global, heads_problem, heads_to_seq, kv_repeats, rank_order, repeat_kv,
                    seq_to_heads, to_global)
from .local import local_attention, masked_local_attention


def run(q, k, v, *, group, causal, softmax_scale, layout, backend="auto", **mask_args) -> torch.Tensor:
    """``q [B, n, Hq, D]``, ``k, v [B, n, Hkv, D]`` (this rank's shard in ``layout``) ->
    ``[B, n, Hq, D]`` in q's dtype. With a mask (``mask_args``) the local attention over the whole
    sequence computes only the block ops the mask leaves non-empty (the all-to-alls are unchanged).

    Raises:
        ValueError / TypeError on every rank: invalid inputs or mask (see ``check_inputs``), or
        ``q_heads`` not divisible by the group size.
    """
    ring, cfg, _ = start_masked("ulysses", q, k, v, group=group, causal=causal, softmax_scale=softmax_scale,
                                layout=layout, backend=backend, mask_args=mask_args)
    problem = heads_problem(q.shape[2], ring.world_size, "ulysses")
    if problem:
        raise ValueError(f"{label('ulysses')}: {problem}")
    p = ring.world_size
    reps = kv_repeats(k.shape[2], p)
    # (B, n, Hkv, D) -> (B, n, Hkv*reps, D); then each -> (B, N, H/P, D) in rank order
    qh, kh, vh = seq_to_heads([q, repeat_kv(k, reps), repeat_kv(v, reps)], ring.group, p, "qkv")
    order = rank_order(q.shape[1] * p, p, layout)
    qg, kg, vg = to_global(qh, order), to_global(kh, order), to_global(vh, order)
    if cfg.mask is None:
        out = local_attention(qg, kg, vg, causal=causal, softmax_scale=softmax_scale, backend=backend)
    else:
        out = masked_local_attention(qg, kg, vg, cfg)
    # (B, N, Hq/P, D) in global order -> rank order -> (B, n, Hq, D)
    return heads_to_seq(from_global(out, order), ring.group, p, "out")


def bytes_formula(*, batch: int, local_seq: int, world_size: int, q_heads: int, kv_heads: int,
                  head_dim: int, dtype: torch.dtype) -> dict:
    """Bytes each rank sends per call: ``{"forward", "backward", "ops": {(phase, op): bytes}}``."""
    return byte_totals(a2a_bytes(batch=batch, local_seq=local_seq, degree=world_size, q_heads=q_heads,
                                 kv_heads=kv_heads, head_dim=head_dim, dtype=dtype),
                       {("forward", "meta"): meta_bytes(world_size)})
