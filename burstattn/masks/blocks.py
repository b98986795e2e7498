"""Block-level summary of a mask for one pair of shards, compiled into kernel calls (pure).

The queries of one rank and the keys of another (both as increasing global positions, ``[n]``
each) are cut into tiles of ``T = mask.block_size`` rows. Each tile pair is classified:

* empty: no query of the tile sees a key of the tile -> never computed;
* full: every query sees every key -> the unmasked kernel;
* causal / strict: exactly the lower triangle (``j <= i`` / ``j < i`` in tile-local indices) ->
  the kernel's own causal mode (no mask tensor);
* partial: anything else -> the kernel with an explicit bool mask of that block.

Because causal, window and documents give each query an interval of visible global positions,
and key positions increase, each query row sees a contiguous *index* range ``[a, b)`` of the key
shard; the classification is then O(n * n/T) integer work, no dense mask. ``mask_mod`` is
evaluated only on tiles the interval leaves non-empty. Consecutive tiles of one tile row with
the same class merge into one call (full runs, partial runs), and consecutive tile rows with
identical calls merge vertically, so a dense region is one kernel call.

The result for a pair is a tuple of :class:`~burstattn.engine.pairs.BlockOp` (mask kinds
FULL, CAUSAL, STRICT, PARTIAL): :class:`MaskBlocks` is that summary as the engine's producer of block
ops from positions (like the dense :func:`~burstattn.engine.pairs.position_ops`), cached in the mask
object per pair of positions; :func:`pair_ops` is the same for a pair of ranks of a layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..engine.pairs import BlockOp, MaskKind, positions_key
from ..layouts.named import local_positions
from .spec import AttnMask

EMPTY, FULL, PARTIAL, CAUSAL, STRICT = 0, 1, 2, 3, 4
_KIND = {FULL: MaskKind.FULL, PARTIAL: MaskKind.PARTIAL, CAUSAL: MaskKind.CAUSAL, STRICT: MaskKind.STRICT}


def visible_ranges(mask: AttnMask, q_pos: torch.Tensor, k_pos: torch.Tensor, seq_len: int,
                   causal: bool, k_len: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row, the index range ``[a, b)`` of the key shard its interval covers.
    ``q_pos [n_q], k_pos [n_k]`` LongTensor (increasing; ``seq_len`` queries, ``k_len`` keys in all)
    -> ``a, b`` LongTensor ``[n_q]``."""
    lo, hi = mask.intervals(q_pos, seq_len, causal, k_len)
    a = torch.searchsorted(k_pos, lo)
    b = torch.maximum(torch.searchsorted(k_pos, hi, right=True), a)
    return a, b


def _tri_pattern(a, b, q0, k0, m, shift: int) -> bool:
    """Whether rows ``q0..q0+m`` see exactly tile-local keys ``0..r-shift`` (shift 0: causal,
    1: strict) of the key tile starting at ``k0``."""
    rows = torch.arange(m)
    return bool((a[q0:q0 + m] <= k0).all() and (b[q0:q0 + m] == k0 + rows + 1 - shift).all())


def classify(mask: AttnMask, q_pos: torch.Tensor, k_pos: torch.Tensor, seq_len: int,
             causal: bool, k_len: Optional[int] = None) -> torch.Tensor:
    """Tile classes ``[ceil(n_q/T), ceil(n_k/T)]`` (int8: EMPTY, FULL, PARTIAL, CAUSAL, STRICT)."""
    t = mask.block_size
    nq, nk = q_pos.numel(), k_pos.numel()
    a, b = visible_ranges(mask, q_pos, k_pos, seq_len, causal, k_len)
    k0s = torch.arange(0, nk, t)
    k1s = torch.clamp(k0s + t, max=nk)
    overlap = (torch.minimum(b[:, None], k1s[None, :]) - torch.maximum(a[:, None], k0s[None, :])).clamp_min(0)
    tq = -(-nq // t)
    cls = torch.empty(tq, k0s.numel(), dtype=torch.int8)
    width = k1s - k0s
    for i in range(tq):
        q0, q1 = i * t, min(i * t + t, nq)
        rows = overlap[q0:q1]
        row_cls = torch.where(rows.max(0).values == 0, EMPTY, torch.where(rows.min(0).values == width, FULL, PARTIAL))
        if mask.mask_mod is not None:
            live = torch.nonzero(row_cls != EMPTY).flatten()
            if live.numel():
                k_lo, k_hi = int(k0s[live[0]]), int(k1s[live[-1]])
                dense = mask.dense(q_pos[q0:q1], k_pos[k_lo:k_hi], seq_len, causal, k_len)
                for j in live.tolist():
                    blk = dense[:, int(k0s[j]) - k_lo:int(k1s[j]) - k_lo]
                    row_cls[j] = EMPTY if not blk.any() else (FULL if blk.all() else PARTIAL)
                    if row_cls[j] == PARTIAL and blk.shape[0] == blk.shape[1]:
                        tri = torch.ones_like(blk).tril_()
                        row_cls[j] = CAUSAL if torch.equal(blk, tri) else (
                            STRICT if torch.equal(blk, tri.tril_(-1)) else PARTIAL)
        else:
            for j in torch.nonzero(row_cls == PARTIAL).flatten().tolist():
                k0, m = int(k0s[j]), int(width[j])
                if m == q1 - q0:
                    if _tri_pattern(a, b, q0, k0, m, 0):
                        row_cls[j] = CAUSAL
                    elif _tri_pattern(a, b, q0, k0, m, 1):
                        row_cls[j] = STRICT
        cls[i] = row_cls
    return cls


def compile_ops(cls: torch.Tensor, n_q: int, n_k: int, tile: int) -> tuple[BlockOp, ...]:
    """Kernel calls from tile classes (see the module docstring for the merging rules)."""
    rows = []
    for i in range(cls.shape[0]):
        calls, run = [], None  # run: [kind, k_start, k_stop]
        for j, c in enumerate(cls[i].tolist()):
            k0, k1 = j * tile, min(j * tile + tile, n_k)
            if run is not None and c == run[0] and c in (FULL, PARTIAL) and run[2] == k0:
                run[2] = k1
                continue
            if run is not None:
                calls.append(tuple(run))
                run = None
            if c != EMPTY:
                run = [c, k0, k1]
        if run is not None:
            calls.append(tuple(run))
        rows.append(tuple(calls))
    ops, i = [], 0
    while i < len(rows):
        j = i + 1
        mergeable = all(c[0] in (FULL, PARTIAL) for c in rows[i])
        while mergeable and j < len(rows) and rows[j] == rows[i]:
            j += 1
        q0, q1 = i * tile, min(j * tile, n_q)
        ops.extend(BlockOp(q0, q1, k0, k1, _KIND[c]) for c, k0, k1 in rows[i])
        i = j
    return tuple(ops)


@dataclass(frozen=True)
class MaskBlocks:
    """A mask's block summary as the engine's producer of block ops (:data:`~burstattn.engine.pairs.Blocks`):
    ``blocks(q_pos, k_pos, causal)`` are the kernel calls of queries at ``q_pos [n_q]`` against keys at
    ``k_pos [n_k]`` (global positions in the queries' own and the keys' coordinates; ``seq_len`` queries
    and ``k_len`` keys in all), built once per pair of position values and kept in the mask object
    (``mask.cache``), so every call and plan with those positions finds them. Equal (and hashed) by the
    mask object and the two lengths: a plan memo keys on it."""

    mask: AttnMask
    seq_len: int
    k_len: int

    def __call__(self, q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool) -> tuple[BlockOp, ...]:
        key = ("ops", bool(causal), self.seq_len, self.k_len, positions_key(q_pos), positions_key(k_pos))
        ops = self.mask.cache.get(key)
        if ops is None:
            ops = mask_ops(self.mask, causal, q_pos, k_pos, self.seq_len, self.k_len)
            self.mask.cache[key] = ops
        return ops


def layout_key(layout):
    """A hashable, process-independent key of a layout name or a partition (what positions are a pure
    function of, with the lengths and the world size): the memos' key in place of position values."""
    return layout if isinstance(layout, str) else ("partition", layout.fingerprint)


def mask_blocks(mask: AttnMask, seq_len: int, k_len: Optional[int] = None) -> MaskBlocks:
    """The :class:`MaskBlocks` of ``mask`` over ``seq_len`` queries and ``k_len`` keys (default as many)."""
    return MaskBlocks(mask, seq_len, seq_len if k_len is None else k_len)


def pair_ops(mask: AttnMask, causal: bool, seq_len: int, world_size: int, layout, q_rank: int,
             k_rank: int, k_len: Optional[int] = None, kv_layout=None) -> tuple[BlockOp, ...]:
    """The kernel calls for the queries of ``q_rank`` against the keys of ``k_rank`` (cached, by their
    positions: :class:`MaskBlocks`): ``seq_len`` queries in ``layout``, ``k_len`` keys (default as many)
    in ``kv_layout`` (default ``layout``); the layouts only produce the positions."""
    k_len = seq_len if k_len is None else k_len
    kv_layout = layout if kv_layout is None else kv_layout
    return MaskBlocks(mask, seq_len, k_len)(local_positions(seq_len, q_rank, world_size, layout),
                                            local_positions(k_len, k_rank, world_size, kv_layout), causal)


def mask_ops(mask: AttnMask, causal: bool, q_pos: torch.Tensor, k_pos: torch.Tensor, seq_len: int,
             k_len: Optional[int] = None) -> tuple[BlockOp, ...]:
    """The kernel calls of queries at ``q_pos [n_q]`` against keys at ``k_pos [n_k]`` (global
    positions, keys increasing; ``seq_len`` queries and ``k_len`` keys in all) under ``mask``:
    positions of any lengths, as :func:`burstattn.engine.pairs.position_ops` takes them."""
    cls = classify(mask, q_pos, k_pos, seq_len, causal, k_len)
    return compile_ops(cls, q_pos.numel(), k_pos.numel(), mask.block_size)


def op_mask(mask: AttnMask, causal: bool, seq_len: int, q_pos: torch.Tensor, k_pos: torch.Tensor,
            op: BlockOp, k_len: Optional[int] = None) -> torch.Tensor:
    """The explicit bool mask ``[q rows, k rows]`` of a PARTIAL op."""
    return mask.dense(q_pos[op.q_start:op.q_stop], k_pos[op.k_start:op.k_stop], seq_len, causal, k_len)
