"""``strategy="ring"``: RingAttention (Liu et al., 2023) as its authors describe it.

Blockwise K/V ring with overlap over the contiguous layout (no causal load balancing: with
``causal=True`` the last rank does P times the work of the first), and the backward that
circulates K, V, dK and dV. It is the same engine as ``burst`` with the backward ring pinned, which is
exactly the difference between the two papers: burst's ``check``, ``plan_of``, ``forward``, ``backward``
and ``fake`` serve it (the op finds them here by the strategy's name).
"""
from __future__ import annotations

from dataclasses import replace

from ..call.prepare import prepare
from ..engine.bytes import ring_bytes
from ..ops import run_call
from .burst import backward, check, fake, forward, plan_of  # noqa: F401  (the op's functions of "ring")


def run(q, k, v, keywords):
    """Every layout runs exactly (the paper's is contiguous). With a mask the K/V go only where the mask
    needs them (the same sparse direct schedule as ``burst``), and the backward still moves K/V and dK/dV;
    the other keywords are burst's (cross-attention, score modifiers, sinks, ``return_lse``)."""
    out, lse = run_call(prepare("ring", q, k, v, replace(keywords, backward="kv")), q, k, v)
    return (out, lse) if keywords.return_lse else out


def bytes_formula(*, batch: int, local_seq: int, world_size: int, q_heads: int, kv_heads: int,
                  head_dim: int, dtype, kv_local_seq=None, v_head_dim=None) -> dict:
    """Bytes each rank sends per call (:func:`burstattn.engine.bytes.ring_bytes` with the K/V-ring backward)."""
    return ring_bytes(batch=batch, local_seq=local_seq, world_size=world_size, q_heads=q_heads,
                      kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, backward="kv", kv_local_seq=kv_local_seq,
                      v_head_dim=v_head_dim)
