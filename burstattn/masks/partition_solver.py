"""A partition that balances any mask: :func:`mask_partition` (pure, cached in the mask).

Tokens go to ranks in *blocks* of ``T`` positions (the mask's tile size, or the largest divisor
of ``n = N / P`` below it), so that every rank's shard is made of whole global tiles and the
pair ops the engine will run (:func:`burstattn.masks.blocks.pair_ops`) are exactly the global
tile pairs of the blocks it holds. A query block's cost is then a property of the block alone:

    cost(i) = sum over key tiles j of  weight(class(i, j)) * T * T

with the tile classes of :mod:`burstattn.masks.blocks` (empty 0, full 1, partial/causal/strict
their measured cost relative to full, :class:`TileCosts`). Balancing the mask's work is a
cardinality-constrained number partitioning of these costs (every rank takes ``n / T`` blocks).

The solver is the two-pointer cut of :func:`burstattn.layouts.partition.document_partition`
(``partition_cut.cut_runs``), run on block *streams* instead of token streams: every candidate orders the
blocks (``"contiguous"``: natural order; ``"zigzag"``: the sequence folded end to end;
``"documents"``: block-aligned documents densest first, each folded, document_partition's own
stream; ``"sorted"``: blocks by cost, heaviest first), the cut gives each rank a run from the
dense end and one from the sparse end. The named layouts are candidates as they are (contiguous,
zigzag, striped); one whose chunks are not whole blocks is scored against the kept partition at a block
where both are (:func:`_finer_named`). The candidates are scored by balance (max / mean block
cost per rank) and by traffic: the number of ordered rank pairs ``(r, s)`` whose tiles touch,
which is what the sparse plan's byte formula (:func:`burstattn.masks.mask_bytes`: readers x K/V
bytes) multiplies. The kept one: fewest pairs among those within ``target``, else the best
balance with a warning (or ``ValueError`` with ``strict=True``) naming the balance achieved.

``document_partition`` stays as the token-level fast path: with ``block_size=1`` and the
``"documents"`` candidate alone, ``mask_partition`` returns its partition exactly.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

from ..layouts.cut import cut_runs, stream_owner
from ..layouts.partition import Partition, _stream, balance
from .blocks import CAUSAL, EMPTY, FULL, PARTIAL, STRICT, classify
from .spec import AttnMask
from .partition_pairs import touching_pairs

CANDIDATES = ("layout-contiguous", "layout-zigzag", "layout-striped", "contiguous", "zigzag", "documents", "sorted")
# the named layouts themselves (no cut): so the kept partition is never worse than them on the score
NAMED = {"layout-contiguous": "contiguous", "layout-zigzag": "zigzag", "layout-striped": "striped"}
_MOD_TILES = 1 << 24  # most tiles a mask_mod's summary classifies to score a named layout at a finer block
_CHUNK_ROWS = 1 << 16  # query rows per classify call (bounds its [rows, key tiles] temporaries)


@dataclass(frozen=True)
class TileCosts:
    """Cost of one ``T x T`` tile of each class relative to a full one (the kernel's time, not its
    FLOPs). Defaults measured for ``cpu_flash`` at ``T = 256``, 8 heads of 64, by CPU time of the
    calling thread, median of 15 (under load): a causal tile 0.99-1.10 x a full one (the CPU kernel
    gains nothing from the triangle), an explicit-mask tile 1.19-1.24 x."""

    full: float = 1.0
    partial: float = 1.2
    causal: float = 1.0

    def table(self) -> torch.Tensor:
        """Weights indexed by tile class: float64 ``[5]`` (EMPTY, FULL, PARTIAL, CAUSAL, STRICT)."""
        w = torch.zeros(5, dtype=torch.float64)
        w[FULL], w[PARTIAL], w[CAUSAL], w[STRICT] = self.full, self.partial, self.causal, self.causal
        return w


@dataclass(frozen=True)
class BlockSummary:
    """The mask seen in blocks of ``block`` positions: ``cost [B]`` float64 per query block;
    ``lo, hi [B]`` int64: the first and last key tile any of its rows sees (``lo > hi``: none);
    ``classes [B, Bk]`` int8 tile classes when a ``mask_mod`` made them necessary (else None:
    every tile in ``[lo, hi]`` counts as touched)."""

    block: int
    cost: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    classes: Optional[torch.Tensor]


@dataclass(frozen=True)
class Solution:
    """What :func:`solve_partition` found: the partition, its balance (max / mean block cost),
    the touching rank pairs (off the diagonal), the kept candidate and every candidate's
    ``(balance, pairs)``."""

    partition: Partition
    block: int
    balance: float
    pairs: int
    candidate: str
    scores: dict


def partition_block(seq_len: int, world_size: int, tile: int) -> int:
    """The block size: the largest divisor of ``n = seq_len / world_size`` not above ``tile``."""
    n = seq_len // world_size
    return max(b for b in range(1, min(tile, n) + 1) if n % b == 0)


def block_summary(mask: AttnMask, seq_len: int, causal: bool, block: int, k_len: Optional[int] = None,
                  costs: TileCosts = TileCosts()) -> BlockSummary:
    """The mask's :class:`BlockSummary` at ``block`` (``seq_len`` and ``k_len`` multiples of it).

    Windows, documents and causal give every row one key interval: the tiles a block touches and
    its full tiles follow from its rows' interval ends in O(N) (a segmented sweep merges the rows'
    tile ranges, so gaps between them are not counted). A ``mask_mod`` is evaluated tile by tile
    (:func:`burstattn.masks.blocks.classify`, on the tiles the intervals leave non-empty).
    """
    k_len = seq_len if k_len is None else k_len
    nb, nbk = seq_len // block, -(-k_len // block)
    q = torch.arange(seq_len)
    lo, hi = mask.intervals(q, seq_len, causal, k_len)
    live = lo <= hi
    blk = q // block
    ta, tb = lo.clamp(min=0) // block, hi.clamp(min=0) // block
    big = torch.where(live, ta, nbk + 1)  # empty rows sort last and cover nothing
    first = torch.full((nb,), nbk + 1, dtype=torch.int64).scatter_reduce(0, blk, big, "amin")
    last = torch.full((nb,), -1, dtype=torch.int64).scatter_reduce(0, blk, torch.where(live, tb, -1), "amax")
    if mask.mask_mod is not None:
        classes = _mod_classes(mask, seq_len, causal, block, k_len)
        cost = costs.table()[classes.long()].sum(1) * block * block
        return BlockSummary(block, cost, first, last, classes)
    # touched tiles: the union of the rows' tile ranges per block (sorted by start, running max end)
    key = blk * (nbk + 2)
    starts = key + big
    # intervals' starts rise with the row for every interval mask: sort only when they do not
    order = torch.arange(seq_len) if bool((starts[1:] >= starts[:-1]).all()) else torch.argsort(starts, stable=True)
    a, b, kb = starts[order], (key + torch.where(live, tb, -1))[order], key[order]
    prev = torch.cat([kb[:1] - 1, torch.cummax(b, 0).values[:-1]])
    prev = torch.maximum(prev, kb - 1)  # a block's first row starts a fresh sweep
    new = (b - torch.maximum(a - 1, prev)).clamp(min=0)
    touched = torch.zeros(nb, dtype=torch.int64).index_add_(0, blk[order], new)
    # full tiles: every row covers the tile entirely
    all_live = torch.ones(nb, dtype=torch.bool).scatter_reduce(0, blk, live, "amin")
    max_lo = torch.full((nb,), -1, dtype=torch.int64).scatter_reduce(0, blk, lo, "amax")
    min_hi = torch.full((nb,), k_len, dtype=torch.int64).scatter_reduce(0, blk, hi, "amin")
    j0 = -(-max_lo.clamp(min=0) // block)
    j1 = torch.where(min_hi >= k_len - 1, nbk - 1, (min_hi + 1) // block - 1)
    full = torch.where(all_live, (j1 - j0 + 1).clamp(min=0), 0)
    cost = (full * costs.full + (touched - full) * costs.partial).to(torch.float64) * block * block
    return BlockSummary(block, cost, first, last, None)


def _mod_classes(mask: AttnMask, seq_len: int, causal: bool, block: int, k_len: int) -> torch.Tensor:
    """Tile classes ``[B, Bk]`` of the whole sequence at ``block`` (the mask re-tiled if needed)."""
    if mask.block_size != block:
        mask = AttnMask(window=mask.window, cu_seqlens=mask.bounds, mask_mod=mask.mask_mod, block_size=block,
                        cu_seqlens_k=mask.kv_bounds)
    keys = torch.arange(k_len)
    step = max(block, _CHUNK_ROWS // block * block)
    return torch.cat([classify(mask, torch.arange(s, min(s + step, seq_len)), keys, seq_len, causal, k_len)
                      for s in range(0, seq_len, step)])


def _block_docs(mask: AttnMask, block: int, nb: int) -> torch.Tensor:
    """Block-level document bounds ``[0, ..., B]``: the documents' edges that fall on block edges."""
    edges = {0, nb}
    if mask.bounds is not None:
        edges |= {int(e) // block for e in mask.bounds.tolist() if int(e) % block == 0}
    return torch.tensor(sorted(edges), dtype=torch.int64)


def _named_owner(name: str, nb: int, world_size: int, block: int) -> Optional[torch.Tensor]:
    """Block owners ``[B]`` of a named layout, or None when its chunks are not whole blocks."""
    b = torch.arange(nb)
    if NAMED[name] == "contiguous":
        return b // (nb // world_size)
    if NAMED[name] == "striped":  # token i on rank i % P: whole blocks of one token only
        return b % world_size if block == 1 else None
    if nb % (2 * world_size):
        return None
    k = b // (nb // (2 * world_size))  # zigzag: chunk k on rank k, chunk 2P-1-k on rank k too
    return torch.where(k < world_size, k, 2 * world_size - 1 - k)


def _streams(name: str, cost: torch.Tensor, docs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """One candidate's block order, its boundaries and whether the cut may swap whole units."""
    nb = cost.numel()
    whole = torch.tensor([0, nb])
    if name == "contiguous":
        return (*_stream(whole, cost, fold=False), False)
    if name == "zigzag":
        return (*_stream(whole, cost, fold=True), False)
    if name == "documents":
        return (*_stream(docs, cost, fold=True), True)
    if name == "sorted":
        return torch.sort(-cost, stable=True).indices, torch.ones(nb + 1, dtype=torch.bool), False
    raise ValueError(f"candidates must be among {CANDIDATES}, got {name!r}")


def solve_partition(mask: AttnMask, seq_len: int, world_size: int, *, causal: bool = False,
                    k_len: Optional[int] = None, block_size: Optional[int] = None, target: float = 1.05,
                    tolerance: float = 0.01, costs: TileCosts = TileCosts(),
                    candidates: Sequence[str] = CANDIDATES) -> Solution:
    """Every candidate scored, the best kept (see the module docstring); no warning, no cache."""
    if not isinstance(mask, AttnMask):
        raise TypeError(f"mask must be a burstattn.AttnMask, got {type(mask).__name__}")
    for name, v in (("seq_len", seq_len), ("world_size", world_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if seq_len % world_size:
        raise ValueError(f"seq_len = {seq_len} must be a multiple of world_size = {world_size}")
    k_len = seq_len if k_len is None else k_len
    problem = mask.problem(seq_len, k_len)
    if problem:
        raise ValueError(problem)
    if k_len != seq_len and k_len % world_size:
        raise ValueError(f"k_len = {k_len} must be a multiple of world_size = {world_size} (contiguous keys)")
    if not candidates:
        raise ValueError(f"candidates must name at least one of {CANDIDATES}")
    block = partition_block(seq_len, world_size, mask.block_size if block_size is None else block_size)
    summary = block_summary(mask, seq_len, causal, block, k_len, costs)
    nb, per = seq_len // block, seq_len // world_size // block
    docs = _block_docs(mask, block, nb)
    tried = {}  # name -> (balance, owner [B], stream)
    for name in dict.fromkeys(candidates):
        if name in NAMED:
            owner = _named_owner(name, nb, world_size, block)
            if owner is None:
                continue
            stream = owner.argsort(stable=True)
        else:
            stream, boundary, swaps = _streams(name, summary.cost, docs)
            same = [n for n in tried if n not in NAMED and torch.equal(tried[n][2], stream)]
            if same:  # e.g. "documents" without block-aligned documents is "zigzag"
                tried[name] = tried[same[0]]
                continue
            cut, fronts = cut_runs(stream, summary.cost[stream], boundary, world_size, tolerance, allow_swaps=swaps)
            owner = torch.empty(nb, dtype=torch.int64)
            owner[cut] = stream_owner(fronts, per, world_size)
        same = [n for n in tried if torch.equal(tried[n][1], owner)]
        if same:  # the same placement scores the same: count its pairs once
            tried[name] = tried[same[0]]
            continue
        work = torch.zeros(world_size, dtype=torch.float64).index_add_(0, owner, summary.cost)
        tried[name] = (balance(work), owner, stream)
    finer = [f for f in (_named_block(c, seq_len // world_size, block) for c in candidates if c in NAMED) if f]
    if not tried and finer:  # only named layouts asked for, finer than the block: solve at their block
        return solve_partition(mask, seq_len, world_size, causal=causal, k_len=k_len, block_size=min(finer),
                               target=target, tolerance=tolerance, costs=costs, candidates=candidates)
    if not tried:
        raise ValueError(f"candidates {tuple(candidates)}: none applies ({world_size} ranks of {seq_len // world_size} "
                         "tokens: zigzag needs an even number of tokens per rank)")
    within = [n for n in tried if tried[n][0] <= target]
    scores = {n: (tried[n][0], None) for n in tried}
    counted: dict[int, int] = {}  # id of a tried entry -> its pairs (shared entries counted once)
    for n in within if len(within) > 1 else []:  # traffic decides among the balanced ones only
        owner = tried[n][1]
        if id(tried[n]) not in counted:
            counted[id(tried[n])] = touching_pairs(summary, owner, _key_owner(owner, seq_len, k_len, world_size, block),
                                                     world_size)
        scores[n] = (tried[n][0], counted[id(tried[n])])
    name = min(within, key=lambda n: (scores[n][1], scores[n][0])) if within else min(tried, key=lambda n: tried[n][0])
    if scores[name][1] is None:
        owner = tried[name][1]
        scores[name] = (tried[name][0], touching_pairs(summary, owner,
                                                       _key_owner(owner, seq_len, k_len, world_size, block), world_size))
    kept = Solution(Partition(_positions(tried[name][1], block, world_size), name=f"mask-{name}"), block,
                    scores[name][0], scores[name][1], name, scores)
    tile = mask.block_size if block_size is None else block_size
    if seq_len // world_size > tile:  # striped's scattered tiles cost more than its tokens: offered at small shards
        candidates = [c for c in candidates if c != "layout-striped"]
    return _finer_named(kept, mask, seq_len, world_size, causal, k_len, costs, target, candidates)


def _positions(owner: torch.Tensor, block: int, world_size: int) -> tuple[torch.Tensor, ...]:
    """Every rank's positions from block owners ``[B]``: its blocks in increasing order (one stable sort)."""
    per = owner.numel() // world_size
    blocks = torch.argsort(owner, stable=True).view(world_size, per)
    return tuple((blocks[:, :, None] * block + torch.arange(block)).view(world_size, per * block).unbind(0))


def _key_owner(owner: torch.Tensor, seq_len: int, k_len: int, world_size: int, block: int) -> torch.Tensor:
    """Key tile owners: the queries' own placement (self-attention), else contiguous keys."""
    if k_len == seq_len:
        return owner
    kb = torch.arange(-(-k_len // block))
    return torch.clamp(kb * block // max(k_len // world_size, 1), max=world_size - 1)


def _named_block(name: str, n: int, block: int) -> Optional[int]:
    """The block at which the named layout ``name`` and a placement in blocks of ``block`` are both whole
    blocks (``n`` tokens per rank), or None: zigzag's chunks are ``n / 2``, striped's one token."""
    if NAMED[name] == "zigzag":
        return math.gcd(block, n // 2) if n % 2 == 0 else None
    return 1 if NAMED[name] == "striped" else block


def _finer_named(kept: Solution, mask: AttnMask, seq_len: int, world_size: int, causal: bool, k_len: int,
                 costs: TileCosts, target: float, candidates: Sequence[str]) -> Solution:
    """``kept``, or a named layout whose chunks are not whole blocks of ``kept.block`` (zigzag at small
    shards, striped) where it scores better: both scored at a block where both are whole blocks, by the
    rule of :func:`solve_partition` (fewest touching pairs within ``target``, else the better balance).
    A named layout's score is added to ``scores`` (measured at its block)."""
    for name in dict.fromkeys(c for c in candidates if c in NAMED and c not in kept.scores):
        fine = _named_block(name, seq_len // world_size, kept.block)
        if fine is None or (mask.mask_mod is not None and (seq_len // fine) * -(-k_len // fine) > _MOD_TILES):
            continue
        summary = block_summary(mask, seq_len, causal, fine, k_len, costs)
        ours = torch.empty(seq_len // fine, dtype=torch.int64)
        for rank, pos in enumerate(kept.partition.positions):
            ours[pos[::fine] // fine] = rank
        owners = (ours, _named_owner(name, seq_len // fine, world_size, fine))
        scored = [[balance(torch.zeros(world_size, dtype=torch.float64).index_add_(0, o, summary.cost)), None]
                  for o in owners]
        pairs = lambda o: touching_pairs(summary, o, _key_owner(o, seq_len, k_len, world_size, fine), world_size)  # noqa: E731
        if scored[0][0] <= target and scored[1][0] <= target:
            scored[0][1], scored[1][1] = pairs(owners[0]), pairs(owners[1])
            wins = (scored[1][1], scored[1][0]) < (scored[0][1], scored[0][0])
        else:
            wins = scored[1][0] <= target or (scored[0][0] > target and scored[1][0] < scored[0][0])
        if not wins:
            kept = replace(kept, scores={**kept.scores, name: tuple(scored[1])})
            continue
        mine = scored[1][1] if scored[1][1] is not None else pairs(owners[1])
        kept = Solution(Partition(_positions(owners[1], fine, world_size), name=f"mask-{name}"), fine, scored[1][0],
                        mine, name, {**kept.scores, name: (scored[1][0], mine)})
    return kept


def mask_partition(mask: AttnMask, seq_len: int, world_size: int, *, causal: bool = False,
                   k_len: Optional[int] = None, block_size: Optional[int] = None, target: float = 1.05,
                   tolerance: float = 0.01, costs: TileCosts = TileCosts(),
                   candidates: Sequence[str] = CANDIDATES, strict: bool = False) -> Partition:
    """A :class:`~burstattn.layouts.partition.Partition` of ``seq_len`` queries over ``world_size`` ranks that
    balances ``mask``'s work (usable as ``layout=`` wherever a layout is taken).

    Every rank holds ``n = seq_len / world_size`` positions, in whole blocks of ``T`` (``block_size``,
    default the mask's tile size, lowered to a divisor of n). Among the candidate block orders (module
    docstring) the one within ``target`` (max / mean work) with the fewest touching rank pairs (the
    sparse plan's K/V traffic) is kept; with none within ``target``, the best balanced one.

    Args:
        mask: any :class:`~burstattn.masks.AttnMask` (windows, documents, ``mask_mod``, cross-attention
            with ``cu_seqlens_k``).
        seq_len: N, the global number of queries; a multiple of ``world_size``.
        causal: the call's ``causal`` flag.
        k_len: the global number of keys (cross-attention; default N). Keys other than the queries'
            are held ``kv_layout="contiguous"``; k_len must then divide by ``world_size``.
        target: the balance (max / mean work) asked for; ``tolerance``: the cut's band (trading
            balance for fewer document cuts, as in ``document_partition``).
        costs: the tile classes' relative costs (:class:`TileCosts`).
        candidates: block orders tried (a subset of ``CANDIDATES``).
        strict: raise instead of warn when ``target`` is not reached.
    Returns:
        The partition (named ``"mask-<candidate>"``), cached in ``mask.cache`` per arguments.
    Raises:
        ValueError: a mask that does not fit ``seq_len`` / ``k_len``, N not divisible by P, an unknown
            candidate; with ``strict``, a balance above ``target`` (naming the balance achieved).
        TypeError: ``mask`` not an AttnMask.
    Warns:
        UserWarning: no candidate reaches ``target`` (naming the balance achieved), unless ``strict``.
    """
    key = ("mask_partition", seq_len, world_size, bool(causal), k_len, block_size, float(target),
           float(tolerance), costs, tuple(candidates))
    sol = mask.cache.get(key) if isinstance(mask, AttnMask) else None
    if sol is None:
        sol = solve_partition(mask, seq_len, world_size, causal=causal, k_len=k_len, block_size=block_size,
                              target=target, tolerance=tolerance, costs=costs, candidates=candidates)
        mask.cache[key] = sol
    if sol.balance > target:
        text = (f"mask_partition: no partition of {seq_len} tokens over {world_size} ranks in blocks of "
                f"{sol.block} "
                f"balances this mask within target = {target}: the best achieved max/mean work = "
                f"{sol.balance:.3f} ({sol.candidate})")
        if strict:
            raise ValueError(text)
        warnings.warn(text, UserWarning, stacklevel=2)
    return sol.partition
