"""``strategy="burst"``: BurstAttention (the core ring; see :func:`burstattn.burst_attn_func`)."""
from __future__ import annotations

from ..api import burst_attn_func


def run(q, k, v, *, group, causal, softmax_scale, layout, backend="auto", backward="auto"):
    """K/V ring forward, query-ring or K/V-ring backward (fewer bytes wins with ``"auto"``)."""
    return burst_attn_func(q, k, v, group=group, causal=causal, softmax_scale=softmax_scale,
                           layout=layout, backend=backend, backward=backward)
