"""Link and collective cost models (pure): who sends how much over which link, and for how long.

A group of ranks sits on the cluster as a :class:`Placement`: ``size`` members, ``per_node`` of them
in each node (ranks are numbered node by node, a group's members ``stride`` apart), and
``concurrent`` groups of the same kind sharing every node (all of them communicate at once: the tp
groups of a node all run their cp rings at the same time). A link level is either per device
(``bytes / bw``: every device has its own port) or shared by the node (``flows * bytes / bw``).

Every pattern is priced as the most loaded link plus one latency (alpha-beta):

* ``shift(s)``: every member sends ``b`` bytes to the member ``s`` places on (a ring step is
  ``s = 1``; DistFlashAttn's steps are shifts by ``t`` and ``P - t``). Of a node's ``per_node``
  members ``min(s, per_node)`` send across nodes, the rest inside.
* ring all-gather / reduce-scatter of a ``b``-byte shard per rank: ``(P-1)`` shifts of ``b``;
  ring all-reduce of ``b`` bytes: ``2(P-1)`` shifts of ``b/P``; tree all-reduce:
  ``2*ceil(log2 P)`` latencies plus ``2b`` over the slowest link;
* all-to-all with ``b`` bytes sent per rank (``b/(P-1)`` to each other member): the busiest link
  carries ``(per_node-1)`` (inside) or ``(P-per_node)`` (across) such pieces per device, times
  the members of the node when the link is shared.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .hardware import ClusterHW


@dataclass(frozen=True)
class Placement:
    """A group of ``size`` ranks: ``per_node`` per node, ``concurrent`` such groups per node."""

    hw: ClusterHW
    size: int
    per_node: int
    concurrent: int

    @property
    def nodes(self) -> int:
        return max(1, self.size // self.per_node)


def placement(hw: ClusterHW, size: int, stride: int = 1) -> Placement:
    """The placement of a group whose members are ``stride`` global ranks apart (node-major
    numbering, every device busy)."""
    r = hw.devices_per_node
    per_node = 1 if stride >= r else max(1, min(size, r // stride))
    return Placement(hw, size, per_node, max(1, r // per_node))


def _level_time(bw: float, shared: bool, flows_per_node: float, nbytes: float) -> float:
    if flows_per_node <= 0 or nbytes <= 0:
        return 0.0
    return (flows_per_node if shared else 1.0) * nbytes / bw


def shift_time(pl: Placement, nbytes: float, shift: int = 1) -> float:
    """Every member sends ``nbytes`` to the member ``shift`` places on (one step of a pattern)."""
    if pl.size <= 1 or nbytes <= 0:
        return 0.0
    hw, g, c = pl.hw, pl.per_node, pl.concurrent
    s = shift % pl.size
    cross = 0 if pl.nodes == 1 else min(s, g)
    t_intra = _level_time(hw.intra_bw, hw.intra_shared, c * (g - cross), nbytes)
    t_inter = _level_time(hw.inter_bw, hw.inter_shared, c * cross, nbytes)
    lat = hw.inter_lat if cross else hw.intra_lat
    return lat + max(t_intra, t_inter)


def p2p_time(hw: ClusterHW, nbytes: float, same_node: bool) -> float:
    """One message of ``nbytes`` between two devices with nothing else on the link."""
    return (hw.intra_lat + nbytes / hw.intra_bw) if same_node else (hw.inter_lat + nbytes / hw.inter_bw)


def all_gather_time(pl: Placement, shard_bytes: float) -> float:
    """Ring all-gather: every rank ends with all ``size`` shards of ``shard_bytes``."""
    return (pl.size - 1) * shift_time(pl, shard_bytes) if pl.size > 1 else 0.0


def reduce_scatter_time(pl: Placement, shard_bytes: float) -> float:
    """Ring reduce-scatter (the all-gather's mirror; the additions ride on memory bandwidth)."""
    if pl.size <= 1:
        return 0.0
    return all_gather_time(pl, shard_bytes) + (pl.size - 1) * 3 * shard_bytes / pl.hw.mem_bw


def ring_all_reduce_time(pl: Placement, nbytes: float) -> float:
    """Ring all-reduce of ``nbytes``: reduce-scatter then all-gather of ``nbytes / P`` shards."""
    if pl.size <= 1:
        return 0.0
    return reduce_scatter_time(pl, nbytes / pl.size) + all_gather_time(pl, nbytes / pl.size)


def tree_all_reduce_time(pl: Placement, nbytes: float) -> float:
    """Pipelined (double binary) tree all-reduce: ``2*ceil(log2 P)`` latencies, ``2 * nbytes``
    through the slowest link the group uses."""
    if pl.size <= 1:
        return 0.0
    hops = math.ceil(math.log2(pl.size))
    lat = pl.hw.inter_lat if pl.nodes > 1 else pl.hw.intra_lat
    return 2 * hops * lat + 2 * (shift_time(pl, nbytes) - lat)


def all_reduce_time(pl: Placement, nbytes: float) -> float:
    """The faster of ring and tree (what NCCL picks by size)."""
    return min(ring_all_reduce_time(pl, nbytes), tree_all_reduce_time(pl, nbytes))


def all_to_all_time(pl: Placement, sent_bytes: float) -> float:
    """All-to-all where every rank sends ``sent_bytes`` in all, evenly to the other members."""
    p = pl.size
    if p <= 1 or sent_bytes <= 0:
        return 0.0
    hw, g, c = pl.hw, pl.per_node, pl.concurrent
    piece = sent_bytes / (p - 1)
    t_intra = _level_time(hw.intra_bw, hw.intra_shared, c * g, (g - 1) * piece) if g > 1 else 0.0
    t_inter = _level_time(hw.inter_bw, hw.inter_shared, c * g, (p - g) * piece) if p > g else 0.0
    lat = hw.inter_lat if p > g else hw.intra_lat
    return lat * (1 + math.log2(p)) + max(t_intra, t_inter)
