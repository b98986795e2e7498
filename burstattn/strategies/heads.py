"""Head sharding shared by the head-parallel strategies (ulysses, usp, tp).

A head-parallel rank j of a group of P owns query heads ``[j*Hq/P, (j+1)*Hq/P)`` over a
whole (sub)sequence. Moving between sequence shards (every rank: its n tokens, all heads)
and head shards (every rank: all P*n tokens, its heads) is one all-to-all; the rows of the
result are the P ranks' shards concatenated in rank order (``rank_order`` maps them to
global positions when the layout is not contiguous).

GQA: the kv heads are split like the query heads. When ``kv_heads`` is not a multiple of P
each kv head is first repeated ``lcm(kv_heads, P) / kv_heads`` times (adjacent copies), so
that rank j receives exactly the kv heads its query heads read (query head h reads kv head
``h // (Hq/Hkv)`` before and after the repetition); the kv bytes grow by that factor.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..comm.collectives import Collectives
from ..engine.bytes import accum_dtype, element_size
from ..layouts.named import local_positions


def heads_problem(q_heads: int, degree: int, strategy: str, what: str = "group size") -> Optional[str]:
    """Why ``q_heads`` cannot be split over ``degree`` ranks, or ``None``."""
    if q_heads % degree:
        return (f"strategy {strategy!r} splits query heads across the {what} ({degree}): q_heads "
                f"({q_heads}) must be divisible by it; use a divisible {what} or another strategy "
                f"(burst, ring, rsa, allgather split the sequence only)")
    return None


def kv_repeats(kv_heads: int, degree: int) -> int:
    """How often each kv head is repeated before the all-to-all: ``lcm(kv_heads, degree) / kv_heads``
    (1 when ``kv_heads % degree == 0``)."""
    return math.lcm(kv_heads, degree) // kv_heads


def repeat_kv(x: torch.Tensor, repeats: int) -> torch.Tensor:
    """``[B, n, Hkv, D] -> [B, n, Hkv*repeats, D]``, adjacent copies."""
    return x if repeats == 1 else x.repeat_interleave(repeats, dim=2)


def unrepeat_kv(g: torch.Tensor, repeats: int, dtype: torch.dtype) -> torch.Tensor:
    """The adjoint of :func:`repeat_kv`: ``[B, n, Hkv*repeats, D] -> [B, n, Hkv, D]``, the copies'
    gradients summed (in the accumulator dtype), in ``dtype``."""
    if repeats == 1:
        return g.to(dtype)
    b, n, h, d = g.shape
    # (B, n, Hkv*r, D) -> (B, n, Hkv, r, D) -> sum over r
    return g.reshape(b, n, h // repeats, repeats, d).sum(3, dtype=accum_dtype(dtype)).to(dtype)


def seq_to_heads(xs: list[torch.Tensor], coll: Optional[Collectives], degree: int, op: str) -> list[torch.Tensor]:
    """Sequence shards -> head shards, all tensors in ONE all-to-all (``coll``: of the group, in the
    pass's phase; ``None`` when ``degree == 1``).

    Args:
        xs: ``[B, n, H_i, D]`` each (one dtype), ``H_i % degree == 0``.
    Returns:
        ``[B, degree*n, H_i/degree, D]`` each: this rank's head slice of every rank's shard,
        rows ``[i*n, (i+1)*n)`` from rank i.
    """
    if degree == 1:
        return list(xs)
    b, n, _, d = xs[0].shape
    widths = [x.shape[2] // degree for x in xs]
    # (B, n, H_i, D) -> (B, n, P, H_i/P, D), then joined on the head axis: (B, n, P, h, D)
    packed = torch.cat([x.reshape(b, n, degree, w, d) for x, w in zip(xs, widths)], dim=3)
    # (B, n, P, h, D) -> (P, B, n, h, D): chunk j goes to rank j
    recv = coll.all_to_all(packed.permute(2, 0, 1, 3, 4), op)
    # (P, B, n, h, D) -> (B, P, n, h, D) -> (B, P*n, h, D): rank i's tokens at rows [i*n, (i+1)*n)
    rows = recv.permute(1, 0, 2, 3, 4).reshape(b, degree * n, sum(widths), d)
    return list(rows.split(widths, dim=2))


def heads_to_seq(xs: list[torch.Tensor], coll: Optional[Collectives], degree: int, op: str) -> list[torch.Tensor]:
    """Head shards -> sequence shards, all tensors in ONE all-to-all: the inverse of
    :func:`seq_to_heads`, and its adjoint (the same bytes).

    ``xs``: ``[B, degree*n, h_i, D]`` each (rows in rank order) -> ``[B, n, degree*h_i, D]`` each.
    """
    if degree == 1:
        return list(xs)
    b, rows, _, d = xs[0].shape
    n, widths = rows // degree, [x.shape[2] for x in xs]
    # (B, P*n, h, D) -> (B, P, n, h, D) -> (P, B, n, h, D): rank i's rows go back to rank i
    x = torch.cat(xs, dim=2) if len(xs) > 1 else xs[0]
    recv = coll.all_to_all(x.reshape(b, degree, n, sum(widths), d).transpose(0, 1), op)
    # (P, B, n, h, D) -> (B, n, P, h, D): head slice j came from rank j; then each (B, n, P*h_i, D)
    heads = recv.permute(1, 2, 0, 3, 4)
    return [part.reshape(b, n, degree * w, d) for part, w in zip(heads.split(widths, dim=3), widths)]


def rank_order(seq_len: int, world_size: int, layout: str) -> Optional[torch.Tensor]:
    """Global positions of the rows of the rank-ordered concatenation of all shards:
    LongTensor ``[seq_len]``; ``None`` when that is already the global order (contiguous)."""
    if layout == "contiguous":
        return None
    return torch.cat([local_positions(seq_len, r, world_size, layout) for r in range(world_size)])


def to_global(x: torch.Tensor, order: Optional[torch.Tensor]) -> torch.Tensor:
    """``[B, N, H, D]`` rows in rank order -> global order."""
    return x if order is None else x.index_select(1, torch.argsort(order).to(x.device))


def from_global(x: torch.Tensor, order: Optional[torch.Tensor]) -> torch.Tensor:
    """``[B, N, H, D]`` rows in global order -> rank order (inverse of :func:`to_global`)."""
    return x if order is None else x.index_select(1, order.to(x.device))


def a2a_bytes(*, batch: int, local_seq: int, degree: int, q_heads: int, kv_heads: int, head_dim: int,
              dtype: torch.dtype) -> dict:
    """``{(phase, op): bytes}`` one rank sends in :func:`seq_to_heads` of q, k, v (op ``qkv``, kv
    heads repeated per :func:`kv_repeats`) and :func:`heads_to_seq` of the output (op ``out``),
    forward and backward (the adjoint all-to-alls move the same bytes)."""
    p, kv = degree, kv_heads * kv_repeats(kv_heads, degree)
    head = batch * local_seq * head_dim * element_size(dtype) * (p - 1)  # one head of the shard, to P-1 ranks
    return {(phase, op): head * heads // p for phase in ("forward", "backward")
            for op, heads in (("qkv", q_heads + 2 * kv), ("out", q_heads))}
