"""``strategy="burst"``: BurstAttention (the core ring; see :func:`burstattn.burst_attn_func`)."""
from __future__ import annotations

from ..api import attend
from ..formulas import choose_backward, ring_bytes
from .base import label, split_options


def run(q, k, v, *, group, causal, softmax_scale, layout, backend="auto", backward="auto", schedule="ring",
        topology=None, **options):
    """K/V ring forward, query-ring or K/V-ring backward (fewer bytes wins with ``"auto"``);
    ``options``: the masks (``window`` / ``cu_seqlens`` / ``document_ids`` / ``mask_mod`` / ``mask``:
    the sparse direct schedule of :mod:`burstattn.masks.plan`) and every keyword of today's models
    (``kv_layout``, ``cu_seqlens_k``, ``softcap``, ``alibi_slopes``, ``sinks``, ...). The custom op of
    :func:`burstattn.burst_attn_func`."""
    mask_args, model_args = split_options(options)
    return attend(label("burst"), q, k, v, group=group, causal=causal, softmax_scale=softmax_scale, layout=layout,
                  backend=backend, backward=backward, schedule=schedule, topology=topology, mask_args=mask_args,
                  **model_args)[0]


def bytes_formula(*, batch: int, local_seq: int, world_size: int, q_heads: int, kv_heads: int,
                  head_dim: int, dtype, backward: str = "auto", kv_local_seq=None, v_head_dim=None) -> dict:
    """Bytes each rank sends per call (:func:`burstattn.formulas.ring_bytes`, ``"auto"`` resolved
    as :func:`burst_attn_func` resolves it)."""
    kw = dict(batch=batch, local_seq=local_seq, world_size=world_size, q_heads=q_heads, kv_heads=kv_heads,
              head_dim=head_dim, dtype=dtype, kv_local_seq=kv_local_seq, v_head_dim=v_head_dim)
    return ring_bytes(backward=choose_backward(**kw) if backward == "auto" else backward, **kw)
