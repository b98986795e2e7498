"""What one pair of shards computes: the block ops of a query shard against a key shard, from their
global positions (pure).

A *pair* is the queries of one owner (a rank, or a decode step's replicated query) against the keys
of another. :func:`position_ops` turns the two shards' global positions (integer tensors of any
lengths: training shards of any layout, a one-token decode query, a continuation's chunk) into
:class:`BlockOp` s, each a query slice x key slice with a mask kind:

* ``FULL``: no mask.
* ``CAUSAL``: key ``j`` visible to query ``i`` iff ``j <= i`` (slices of equal length).
* ``STRICT``: iff ``j < i``.
* ``PARTIAL``: an explicit bool mask (masks only, see :mod:`burstattn.masks.blocks`).

For the three layouts at equal lengths this gives one op per pair: contiguous, the diagonal pair
``CAUSAL`` and a key rank before the query rank ``FULL``; zigzag (rank r holds chunks r and 2P-1-r,
c = n/2 tokens each), ``k < q``: every query against the first key chunk, ``k > q``: the second
query chunk against every key, so every pair costs the same, which is what balances the ring;
striped (token i on rank i mod P), ``CAUSAL`` for ``k <= q`` and ``STRICT`` for ``k > q``. A fully
masked pair has no op and is skipped (its data may still pass by on a ring).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Optional

import torch


class MaskKind(str, Enum):
    """Mask inside one block op; see the module docstring."""

    FULL = "full"
    CAUSAL = "causal"
    STRICT = "strict"
    PARTIAL = "partial"  # an explicit mask block (masks, see burstattn.masks.blocks)


@dataclass(frozen=True)
class BlockOp:
    """One local kernel call: rows ``[q_start, q_stop)`` of the query shard against rows
    ``[k_start, k_stop)`` of the key/value shard, with ``mask``."""

    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    mask: MaskKind

    @property
    def cost(self) -> float:
        """Score-matrix entries computed (the attention FLOPs up to a constant)."""
        area = (self.q_stop - self.q_start) * (self.k_stop - self.k_start)
        return area / 2 if self.mask in (MaskKind.CAUSAL, MaskKind.STRICT) else float(area)


OpsOf = Callable[[int, int], tuple[BlockOp, ...]]  # (query owner, key owner) -> block ops
Blocks = Callable[[torch.Tensor, torch.Tensor, bool], tuple[BlockOp, ...]]
"""A producer of block ops: ``(q_pos [n_q], k_pos [n_k], causal) -> ops`` from two shards' global positions
(:func:`position_ops`, or a mask's block summary, :class:`burstattn.masks.blocks.MaskBlocks`)."""


def tile_op(op: BlockOp, size: int) -> tuple[BlockOp, ...]:
    """``op`` cut into tiles of at most ``size x size`` (pure). FULL and PARTIAL ops become a grid
    of tiles of their kind; a CAUSAL or STRICT square keeps its lower triangle of tiles: the
    diagonal tiles keep the kind (the rows and keys of such a tile start together), the tiles
    below it are FULL and the ones above it are dropped."""
    nq, nk = op.q_stop - op.q_start, op.k_stop - op.k_start
    if nq <= size and nk <= size:
        return (op,)
    tri = op.mask in (MaskKind.CAUSAL, MaskKind.STRICT)
    tiles = []
    for i in range(0, nq, size):
        for j in range(0, (i + 1 if tri else nk), size):
            kind = (op.mask if i == j else MaskKind.FULL) if tri else op.mask
            tiles.append(BlockOp(op.q_start + i, min(op.q_start + i + size, op.q_stop),
                                 op.k_start + j, min(op.k_start + j + size, op.k_stop), kind))
    return tuple(tiles)


def _runs(b: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(first row, end row, step)`` runs of ``b`` (the visible key count per query row): rows
    ``i..j-1`` with ``b`` constant (step 0) or growing by one per row (step 1); any other row is a
    run of one (step 0). Greedy from the first row, as the ops are read: a run takes every following
    row while the difference stays its step; the row that breaks it starts the next run."""
    nq = int(b.numel())
    if nq == 1:
        return [(0, 1, 0)]
    d = b[1:] - b[:-1]
    vals, counts = torch.unique_consecutive(d, return_counts=True)
    vals, counts = vals.tolist(), counts.tolist()
    out, i, r, left = [], 0, 0, counts[0]  # row i; d[i] lies in RLE run r with `left` entries from i on
    while i < nq:
        if i == nq - 1:
            out.append((i, nq, 0))
            break
        step = vals[r]
        if step in (0, 1):
            j = i + left + 1  # the rest of this run of differences, plus the row it ends on
            out.append((i, j, step))
            r += 1  # d[j - 1] breaks the run: the next run starts at row j, at d[j]
            if r < len(vals):
                left = counts[r] - 1
                while left == 0 and r + 1 < len(vals):
                    r += 1
                    left = counts[r]
            i = j
        else:
            out.append((i, i + 1, 0))
            left -= 1
            while left == 0 and r + 1 < len(vals):
                r += 1
                left = counts[r]
            i += 1
    return out


def position_ops(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool) -> tuple[BlockOp, ...]:
    """The block ops of a query shard against a key shard from their *global positions* (pure).

    ``q_pos [nq]`` and ``k_pos [nk]`` are integer tensors of any lengths; ``k_pos`` must increase
    (every layout's shards and every cache shard do). Causal: query i sees the keys at positions
    <= its own, i.e. the index range ``[0, b_i)`` with ``b = searchsorted(k_pos, q_pos, right=True)``.
    Rows with a constant ``b`` are one FULL op on ``[0, b)``; rows where ``b`` grows by one per row
    are a FULL op on the keys all of them see plus a CAUSAL square (STRICT when the first row sees
    nothing). Raises ``ValueError`` when ``k_pos`` does not increase.
    """
    nq, nk = int(q_pos.numel()), int(k_pos.numel())
    if nq == 0 or nk == 0:
        return ()
    if not causal:
        return (BlockOp(0, nq, 0, nk, MaskKind.FULL),)
    if nk > 1 and not bool((k_pos[1:] > k_pos[:-1]).all()):
        raise ValueError("position_ops: key positions must increase")
    b = torch.searchsorted(k_pos.to(torch.int64), q_pos.to(torch.int64), right=True)
    ops: list[BlockOp] = []
    firsts = b.tolist()
    for i, j, step in _runs(b):
        bi = firsts[i]
        if step == 0:
            if bi > 0:
                ops.append(BlockOp(i, j, 0, bi, MaskKind.FULL))
        elif bi == 0:  # row i sees nothing, row i+s the first s keys: j < i
            ops.append(BlockOp(i, j, 0, j - i, MaskKind.STRICT) if j - i <= nk else
                       BlockOp(i + 1, j, 0, j - i - 1, MaskKind.CAUSAL))
        else:
            if bi > 1:
                ops.append(BlockOp(i, j, 0, bi - 1, MaskKind.FULL))
            ops.append(BlockOp(i, j, bi - 1, bi - 1 + j - i, MaskKind.CAUSAL))
    return tuple(ops)


def ops_from_positions(q_pos: list, k_pos: list, causal: bool, blocks: Optional[Blocks] = None) -> OpsOf:
    """``ops_of(q_owner, k_owner)`` from each owner's global query and key positions (lists of
    ``[n_i]`` integer tensors, any lengths) by ``blocks`` (default :func:`position_ops`: no mask beyond
    ``causal``); each pair is computed once, on first use. The one producer of every plan's block ops."""
    blocks = position_ops if blocks is None else blocks
    cache: dict = {}

    def ops_of(q: int, k: int) -> tuple[BlockOp, ...]:
        if (q, k) not in cache:
            cache[(q, k)] = blocks(q_pos[q], k_pos[k], causal)
        return cache[(q, k)]
    return ops_of


def positions_key(x: torch.Tensor) -> tuple[int, bytes]:
    """A key of a (host) position tensor's values: its length and a 16-byte digest (plans and block
    summaries are pure functions of positions, cached by these keys)."""
    return int(x.numel()), hashlib.blake2b(x.to(torch.int64).numpy().tobytes(), digest_size=16).digest()
