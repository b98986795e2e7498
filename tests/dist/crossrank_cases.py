"""Rank-side functions of tests/dist/test_crossrank.py: arguments whose VALUES differ between ranks
(ALiBi slopes, sink logits) and a ``requires_grad`` that differs between ranks.
Each returns ``(exception type name, message)`` or ``("no error", "")``."""
from __future__ import annotations

import torch

import burstattn


def _qkv(rank: int, world: int, grad: bool, heads: int = 4):
    g = torch.Generator().manual_seed(11 + rank)
    n = 4  # tokens per rank (zigzag: two chunks of 2)
    q, k, v = (torch.randn(1, n, heads, 8, generator=g, dtype=torch.float64).requires_grad_(grad)
               for _ in range(3))
    return q, k, v


def differing(rank: int, world: int, kind: str, strategy: str = "burst_attn_func") -> tuple[str, str]:
    """One call whose ``kind`` (``alibi``, ``sinks``, ``requires_grad``, ``same``) differs on rank 0:
    the forward (and, where this rank asks for one, the backward) of ``strategy``."""
    q, k, v = _qkv(rank, world, grad=(rank == 0) if kind == "requires_grad" else False)
    kw = {}
    if kind == "alibi":
        kw["alibi_slopes"] = torch.full((4,), 0.5 if rank == 0 else 1.5, dtype=torch.float64)
    elif kind == "sinks":
        kw["sinks"] = torch.full((4,), 0.25 if rank == 0 else -1.0, dtype=torch.float64)
    try:
        if strategy == "burst_attn_func":
            out = burstattn.burst_attn_func(q, k, v, causal=True, backend="reference", **kw)
        else:
            out = burstattn.attention(q, k, v, strategy=strategy, causal=True, **kw)
        if out.requires_grad:
            out.sum().backward()
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e)
    return "no error", ""
