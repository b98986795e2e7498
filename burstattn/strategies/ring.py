"""``strategy="ring"``: RingAttention (Liu et al., 2023) as its authors describe it.

Blockwise K/V ring with overlap over the contiguous layout (no causal load balancing: with
``causal=True`` the last rank does P times the work of the first), and the backward that
circulates K, V, dK and dV. It is the same engine as ``burst`` with the layout and the
backward ring pinned, which is exactly the difference between the two papers.
"""
from __future__ import annotations

from ..api import burst_attn_func


def run(q, k, v, *, group, causal, softmax_scale, layout, backend="auto"):
    """``layout`` must be ``"contiguous"`` (checked by the registry)."""
    return burst_attn_func(q, k, v, group=group, causal=causal, softmax_scale=softmax_scale,
                           layout=layout, backend=backend, backward="kv")
