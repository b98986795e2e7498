"""The two-level ("double") ring for clusters of nodes: most ring traffic stays inside nodes.

With P = M nodes x R ranks per node (rank ``r = m*R + i``), the flat ring crosses a node boundary on
every step, so every step waits for the slow inter-node link. The double ring (as in LoongTrain's
double-ring attention) nests two rings:

* an *outer* ring over the ranks with the same index ``i`` on every node (one inter-node hop per
  outer step): at outer step d, rank (m, i) holds the outer block of rank ((m-d) mod M, i);
* an *inner* ring inside each node (R ranks, intra-node links only) that circulates the outer
  blocks: at inner step s of outer step d, rank (m, i) holds the block of ((m-d) mod M, (i-s) mod R).

Over (d, s) every rank meets every block exactly once. The outer transfer that brings the next
outer block is posted before the R inner steps and waited for after them, so the inter-node link
has R steps of compute to hide behind instead of one. Accumulators (dK/dV or dQ) follow the same
two levels: each inner ring returns its partial to the rank that held the outer block, which folds
it into the outer accumulator travelling one outer step behind (home after the last).

This is the one loop nested in itself (:func:`burstattn.engine.run.double_nested`: the outer ring's
step runs the inner ring), so the passes run unchanged on it and a :class:`TwoLevelComm`.
Bytes per rank: the same ``P - 1`` travelling blocks as the flat ring (``(R-1)*M`` inside nodes,
``M-1`` across), accumulators ``R*M`` hops inside nodes (when R > 1) and ``M`` across (when M > 1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..comm.ring import RingComm
from ..groups import TwoLevelGroups, two_level_groups  # noqa: F401  (moved to burstattn.groups; kept importable)
from .schedule import StepPlan, block_ops


@dataclass
class TwoLevelComm:
    """The inner and outer ring communicators of one pass (``None`` for a level of size 1)."""

    inner: Optional[RingComm]
    outer: Optional[RingComm]


@dataclass(frozen=True)
class DoublePlan:
    """``outer[d]`` is the inner plan (R :class:`StepPlan`) of outer step ``d``."""

    outer: tuple[tuple[StepPlan, ...], ...]
    world_size: int


def double_plan(rank: int, world_size: int, ranks_per_node: int, layout: str, causal: bool, local_len: int,
                travelling: str) -> DoublePlan:
    """The double ring's plan of ``rank`` (pure): who pairs with whom at each (outer, inner) step."""
    r_, m_ = ranks_per_node, world_size // ranks_per_node
    m, i = divmod(rank, r_)
    outer = []
    for d in range(m_):
        inner = []
        for s in range(r_):
            src = ((m - d) % m_) * r_ + (i - s) % r_
            q_rank, k_rank = (rank, src) if travelling == "kv" else (src, rank)
            inner.append(StepPlan(s, q_rank, k_rank, block_ops(q_rank, k_rank, world_size, layout, causal, local_len),
                                  prefetch=s < r_ - 1))
        outer.append(tuple(inner))
    return DoublePlan(tuple(outer), world_size)
