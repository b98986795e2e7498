"""Attention chunked over heads (Untied Ulysses' idea, arXiv 2602.21196), for every strategy.

:func:`head_chunked_attention` runs ``burstattn.attention`` over ``chunks`` groups of heads, one group
after another, each group its own complete call (forward, and in the backward its own backward), so
what one call allocates on top of its inputs (received K/V, travelling dQ/dK/dV partials, the
float32 tiles and accumulators, an all-to-all's buffers) scales with ``1 / chunks`` of the heads and
is freed before the next group starts. The bytes sent stay the same; the messages are ``chunks``
times more and ``chunks`` times smaller.

Groups respect GQA: group ``j`` holds query heads ``[j Hq/G, (j+1) Hq/G)`` and kv heads
``[j Hkv/G, (j+1) Hkv/G)``; query head ``h`` reads kv head ``h // (Hq/Hkv)`` inside its group as in
the whole call, so ``chunks`` must divide ``Hkv``, or be a multiple of ``Hkv`` dividing ``Hq``: then a kv
head is shared by ``chunks / Hkv`` groups and its K/V (and dK/dV partials) travel once per group: the
bytes of K/V grow by that factor (MQA models such as ``small-l3``). Per-head options (``alibi_slopes [Hq]`` or
``[B, Hq]``, ``sinks [Hq]``) are sliced with their group. The result is exact: attention is
independent across heads.

What stays whole: the inputs, the output (concatenated along heads) and the gradients dQ, dK, dV
(each group's parts live until the last group's backward is done). Autograd runs the groups'
backwards one after another (the last group first: its nodes are the newest), so their buffers do
not overlap either.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..strategies import attention

PER_HEAD = ("alibi_slopes", "sinks")  # options with one entry per query head (last dimension)


def head_chunks_problem(chunks, q_heads: int, kv_heads: int) -> Optional[str]:
    """Why ``chunks`` cannot split ``q_heads`` / ``kv_heads`` into groups, or ``None``."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        return f"head_chunks must be a positive int (groups of heads run one after another), got {chunks!r}"
    if q_heads % chunks or (kv_heads % chunks and chunks % kv_heads):
        return (f"head_chunks ({chunks}) must divide the kv heads ({kv_heads}), or be a multiple of them that divides "
                f"the query heads ({q_heads}): each group reads whole kv heads (query head h reads kv head "
                f"h // {max(1, q_heads // kv_heads)})")
    return None


def head_slices(q_heads: int, kv_heads: int, chunks: int) -> list[tuple[slice, slice]]:
    """``[(query-head slice, kv-head slice)]`` of each group, in order. With more groups than kv heads
    (``chunks % kv_heads == 0``) each group's query heads read one kv head, which ``chunks / kv_heads``
    groups share: its K/V travel once per group (that many times the K/V bytes)."""
    gq = q_heads // chunks
    if chunks > kv_heads:
        return [(slice(j * gq, (j + 1) * gq), slice(j * kv_heads // chunks, j * kv_heads // chunks + 1))
                for j in range(chunks)]
    gkv = kv_heads // chunks
    return [(slice(j * gq, (j + 1) * gq), slice(j * gkv, (j + 1) * gkv)) for j in range(chunks)]


def head_chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, chunks: int,
                           **attention_kwargs) -> torch.Tensor:
    """``burstattn.attention(q, k, v, **attention_kwargs)`` computed over ``chunks`` groups of heads,
    one call per group (see the module docstring).

    Args:
        q: ``[B, n, Hq, D]``; k, v: ``[B, n_k, Hkv, D]`` (this rank's shards, as for ``attention``).
        chunks: groups of heads (1: one plain call); divides ``Hkv`` (and so ``Hq``), or is a multiple
            of ``Hkv`` that divides ``Hq``.
        attention_kwargs: ``strategy``, ``group``, ``causal``, ``softmax_scale`` (``None``: ``D ** -0.5``,
            the same for every group), ``layout`` and the strategy's options; ``alibi_slopes`` and
            ``sinks`` are split by query head.
    Returns:
        ``[B, n, Hq, D]`` in q's dtype, differentiable with respect to q, k, v (and the per-head options).
    Raises:
        ValueError: ``chunks`` splits the heads in neither way (the same on every rank, since
            every rank has the same heads); whatever ``attention`` raises for a group.
    """
    if chunks == 1:
        return attention(q, k, v, **attention_kwargs)
    problem = head_chunks_problem(chunks, q.shape[2], k.shape[2])
    if problem:
        raise ValueError(problem)
    outs = []
    for qs, kvs in head_slices(q.shape[2], k.shape[2], chunks):
        kw = dict(attention_kwargs)
        for name in PER_HEAD:
            if kw.get(name) is not None:
                kw[name] = kw[name][..., qs]
        outs.append(attention(q[:, :, qs], k[:, :, kvs], v[:, :, kvs], **kw))  # [B, n, Hq/G, D]
    return torch.cat(outs, dim=2)  # [B, n, Hq, D]
