"""Rank-side functions of tests/dist/test_head_chunks.py (module-level so they pickle by reference)."""
from __future__ import annotations

import torch

import burstattn
from burstattn.meter.memory import measure_peak
from burstattn.models.head_chunks import head_chunked_attention
from tests.dist.strategy_cases import _leaves, _usp_options, destroy_usp_groups, positions
from tests.helpers import Case


def run_chunked(rank: int, world: int, rows: list) -> list[dict]:
    """Every ``(case, strategy, chunks, ulysses_degree, extras)`` row: forward + backward through
    :func:`head_chunked_attention` on this rank's shard, with the byte meter. ``extras``: per-head
    options to pass (``"alibi"``: slopes ``[Hq]``, ``"sinks"``: sinks ``[Hq]``, both differentiable)."""
    out = []
    for case, strategy, chunks, u, extras in rows:
        assert world == case.world
        pos = positions(case, strategy, u, rank)
        q, k, v, dout = _leaves(case, pos)
        opts = _usp_options(world, u, "degrees") if strategy == "usp" else {}
        gen = torch.Generator().manual_seed(7)
        per_head = {}
        if "alibi" in extras:
            per_head["alibi_slopes"] = torch.rand(case.q_heads, generator=gen, dtype=torch.float32)
        if "sinks" in extras:
            per_head["sinks"] = torch.randn(case.q_heads, generator=gen, dtype=torch.float32).requires_grad_()
        try:
            with burstattn.comm_stats() as stats:
                o = head_chunked_attention(q, k, v, chunks=chunks, strategy=strategy, causal=case.causal,
                                           layout=case.layout, backend=case.backend, **opts, **per_head)
                o.backward(dout)
        finally:
            destroy_usp_groups(opts)
        sinks = per_head.get("sinks")
        out.append(dict(out=o.detach(), dq=q.grad, dk=k.grad, dv=v.grad, positions=pos, stats=stats.as_dict(),
                        dsinks=None if sinks is None else sinks.grad))
    return out


def call_peak(rank: int, world: int, strategy: str, chunks: int, local_seq: int, heads: tuple, head_dim: int) -> int:
    """Peak bytes of one forward + backward through :func:`head_chunked_attention` beyond its inputs
    (``bench.memory.measure_peak``: the allocator's peak over the call, float32), the smallest of 3
    repeats (tests/helpers.py's band rule: gloo's worker thread frees the all-to-all buffers late at
    times; one full CI run measured ulysses' 4 groups 2 shards above the usual)."""
    gen = torch.Generator().manual_seed(rank)
    hq, hkv = heads
    q = torch.randn(1, local_seq, hq, head_dim, generator=gen).requires_grad_()
    k = torch.randn(1, local_seq, hkv, head_dim, generator=gen).requires_grad_()
    v = torch.randn(1, local_seq, hkv, head_dim, generator=gen).requires_grad_()
    dout = torch.randn(1, local_seq, hq, head_dim, generator=gen)

    def step():
        o = head_chunked_attention(q, k, v, chunks=chunks, strategy=strategy, causal=True, layout="zigzag",
                                   backend="cpu_flash")
        o.backward(dout)
        return None

    step()  # warm: communicators and caches exist before the measured call
    peaks = []
    for _ in range(3):
        q.grad = k.grad = v.grad = None
        peaks.append(measure_peak(step)[1].peak_bytes)
    return int(min(peaks))


