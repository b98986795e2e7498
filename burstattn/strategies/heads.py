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
import torch.distributed as dist

from ..comm.autograd import all_to_all
from ..formulas import element_size
from ..groups import GroupContext
from ..layout import local_positions
from .base import label, start


def heads_problem(q_heads: int, degree: int, strategy: str, what: str = "group size") -> Optional[str]:
    """Why ``q_heads`` cannot be split over ``degree`` ranks, or ``None``."""
    if q_heads % degree:
        return (f"strategy {strategy!r} splits query heads across the {what} ({degree}): q_heads "
                f"({q_heads}) must be divisible by it; use a divisible {what} or another strategy "
                f"(burst, ring, rsa, allgather split the sequence only)")
    return None


def start_heads(name: str, q, k, v, *, group, causal, softmax_scale, layout, backend) -> GroupContext:
    """:func:`~burstattn.strategies.base.start` for a strategy that splits query heads over the
    whole group (ulysses, tp): also raises ``ValueError`` (on every rank alike, the shapes being
    equal by then) when ``q_heads`` is not divisible by the group size."""
    ring, _ = start(name, q, k, v, group=group, causal=causal, softmax_scale=softmax_scale, layout=layout,
                    backend=backend)
    problem = heads_problem(q.shape[2], ring.world_size, name)
    if problem:
        raise ValueError(f"{label(name)}: {problem}")
    return ring


def kv_repeats(kv_heads: int, degree: int) -> int:
    """How often each kv head is repeated before the all-to-all: ``lcm(kv_heads, degree) / kv_heads``
    (1 when ``kv_heads % degree == 0``)."""
    return math.lcm(kv_heads, degree) // kv_heads


def repeat_kv(x: torch.Tensor, repeats: int) -> torch.Tensor:
    """``[B, n, Hkv, D] -> [B, n, Hkv*repeats, D]``, adjacent copies (differentiable: the
    backward sums the copies' gradients)."""
    return x if repeats == 1 else x.repeat_interleave(repeats, dim=2)


def seq_to_heads(xs: list[torch.Tensor], group: Optional[dist.ProcessGroup], degree: int,
                 op: str) -> list[torch.Tensor]:
    """Sequence shards -> head shards, all tensors in ONE all-to-all.

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
    recv = all_to_all(packed.permute(2, 0, 1, 3, 4), group, op)
    # (P, B, n, h, D) -> (B, P, n, h, D) -> (B, P*n, h, D): rank i's tokens at rows [i*n, (i+1)*n)
    rows = recv.permute(1, 0, 2, 3, 4).reshape(b, degree * n, sum(widths), d)
    return list(rows.split(widths, dim=2))


def heads_to_seq(x: torch.Tensor, group: Optional[dist.ProcessGroup], degree: int, op: str) -> torch.Tensor:
    """Head shards -> sequence shards (the inverse of :func:`seq_to_heads` for one tensor).

    ``x [B, degree*n, h, D]`` (rows in rank order) -> ``[B, n, degree*h, D]``.
    """
    if degree == 1:
        return x
    b, rows, h, d = x.shape
    n = rows // degree
    # (B, P*n, h, D) -> (B, P, n, h, D) -> (P, B, n, h, D): rank i's rows go back to rank i
    recv = all_to_all(x.reshape(b, degree, n, h, d).transpose(0, 1), group, op)
    # (P, B, n, h, D) -> (B, n, P, h, D) -> (B, n, P*h, D): head slice j came from rank j
    return recv.permute(1, 2, 0, 3, 4).reshape(b, n, degree * h, d)


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
