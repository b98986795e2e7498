"""Peer libraries behind one adapter shape, for ``burstattn bench grid`` (optional extra ``burstattn[peers]``).

Each adapter module has ``VARIANTS`` (names) and ``make(variant, *, causal, group) -> Contender``,
raising :class:`PeerUnavailable` (with the exact reason) when the library is missing or cannot run
this point. A contender is a differentiable ``fn(q, k, v) -> out`` on this rank's shard in
burstattn's convention (``[B, n, H, D]``) plus the layout its shard follows, so every peer is fed
the same inputs and checked against the same float64 reference as burstattn's strategies.
Nothing is imported here: the peers are imported only when their adapter runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from typing import Callable, Optional

__all__ = ["Contender", "PeerUnavailable", "PEERS", "make_peer"]


class PeerUnavailable(RuntimeError):
    """A peer cannot run here (not installed, needs CUDA, unsupported option): the message says why."""


@dataclass(frozen=True)
class Contender:
    """One thing to benchmark.

    Attributes:
        name: row label (``"burst"``, ``"torch-cp allgather lb"``, ...).
        fn: ``fn(q, k, v) -> out`` on local shards ``[B, n, H, D]``, differentiable.
        positions: ``positions(seq_len, rank, world) -> LongTensor [n]``: the global token positions
            this rank's shard holds (how the reference check slices the global inputs).
        family: ``"ring"`` (O(seq) bytes per rank), ``"a2a"`` (Ulysses-like, O(local_seq)) or ``"gather"``.
        formula: ``formula(batch, local_seq, world, heads, kv_heads, head_dim, dtype) -> bytes per
            rank per fwd+bwd`` or ``None`` when the library states none.
        ours: a burstattn strategy (then ``comm_stats`` must agree with the meter).
    """

    name: str
    fn: Callable
    positions: Callable
    family: str
    formula: Optional[Callable] = None
    ours: bool = False


PEERS = {"torch_cp": "torch_cp", "deepspeed": "deepspeed_ulysses", "yunchang": "yunchang_peer"}


def make_peer(peer: str, variant: str, *, causal: bool, group) -> Contender:
    """The contender of ``peer``'s ``variant`` (raises :class:`PeerUnavailable` with the reason)."""
    if peer not in PEERS:
        raise ValueError(f"unknown peer {peer!r}; known: {sorted(PEERS)}")
    return import_module(f"bench.peers.{PEERS[peer]}").make(variant, causal=causal, group=group)
