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
dense end and one from the sparse end. The candidates are scored by balance (max / mean block
cost per rank) and by traffic: the number of ordered rank pairs ``(r, s)`` whose tiles touch,
which is what the sparse plan's byte formula (:func:`burstattn.masks.mask_bytes`: readers x K/V
bytes) multiplies. The kept one: fewest pairs among those within ``target``, else the best
balance with a warning (or ``ValueError`` with ``strict=True``) naming the balance achieved.

``document_partition`` stays as the token-level fast path: with ``block_size=1`` and the
``"documents"`` candidate alone, ``mask_partition`` returns its partition exactly.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..layouts.cut import cut_runs, stream_owner
from ..layouts.partition import Partition, _stream, balance
from .blocks import CAUSAL, EMPTY, FULL, PARTIAL, STRICT, classify
from .spec import AttnMask

CANDIDATES = ("layout-contiguous", "layout-zigzag", "contiguous", "zigzag", "documents", "sorted")
# the named layouts themselves (no cut): so the kept partition is never worse than them on the score
NAMED = {"layout-contiguous": "contiguous", "layout-zigzag": "zigzag"}
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


def touching_pairs(summary: BlockSummary, owner_q: torch.Tensor, owner_k: torch.Tensor, world_size: int) -> int:
    """Ordered rank pairs ``(r, s)``, ``r != s``, where a query block of r touches a key tile of s."""
    p = world_size
    if summary.classes is not None:
        ne = (summary.classes != EMPTY).to(torch.float32)  # [B, Bk]
        by_rank = torch.zeros(p, ne.shape[1]).index_add_(0, owner_q, ne)  # [P, Bk]
        need = torch.zeros(p, p).index_add_(1, owner_k, by_rank) > 0
    else:
        lo, hi = summary.lo.clamp(max=owner_k.numel()), summary.hi.clamp(min=-1)
        owner_q, lo, hi = _merged_spans(owner_q, lo, hi)
        need = _pairs_by_runs(owner_q, lo, hi, owner_k, p)
        if need is None:
            need = _pairs_by_table(owner_q, lo, hi, owner_k, p)
    need.fill_diagonal_(False)
    return int(need.sum())


def _merged_spans(owner_q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each rank's query blocks' key spans merged where they overlap or abut: ``(owner, lo, hi)`` per
    merged span, empty spans dropped. The tiles a rank touches are the same, in fewer spans (causal: one
    per rank instead of one per block), so the pair counts below scan fewer rows."""
    live = lo <= hi
    owner_q, lo, hi = owner_q[live], lo[live], hi[live]
    if owner_q.numel() == 0:
        return owner_q, lo, hi
    shift = owner_q * (int(hi.max()) + 2)  # ranks' spans apart on one axis: one sort, one running max
    order = torch.argsort(shift + lo, stable=True)
    a, b, own = (shift + lo)[order], (shift + hi)[order], owner_q[order]
    reach = torch.cummax(b, 0).values  # the furthest tile covered so far (of this rank: ranks lie apart)
    start = torch.ones(a.numel(), dtype=torch.bool)
    start[1:] = a[1:] > reach[:-1] + 1
    seg = torch.cumsum(start.long(), 0) - 1
    top = torch.full((int(seg[-1]) + 1,), -1, dtype=torch.int64).scatter_reduce(0, seg, b, "amax")
    first = own[start]
    base = first * (int(hi.max()) + 2)
    return first, a[start] - base, top - base


def _pairs_by_runs(owner_q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, owner_k: torch.Tensor,
                   p: int) -> Optional[torch.Tensor]:
    """``need [P, P]`` from the runs of equal key owners each block's key span overlaps (cheap when the
    owners come in long runs: a contiguous-like placement); None when that would visit more entries
    than the ``[B, P]`` table of :func:`_pairs_by_table`."""
    change = torch.ones(owner_k.numel(), dtype=torch.bool)
    change[1:] = owner_k[1:] != owner_k[:-1]
    run_start = torch.nonzero(change).flatten()
    q = torch.nonzero(lo <= hi).flatten()
    ra = torch.searchsorted(run_start, lo[q], right=True) - 1
    count = torch.searchsorted(run_start, hi[q], right=True) - ra  # runs overlapped, >= 1
    total = int(count.sum())
    if total * 8 > owner_q.numel() * p:  # an entry here costs several of the table's
        return None
    first = torch.repeat_interleave(ra - (count.cumsum(0) - count), count)
    runs = first + torch.arange(total)
    flat = torch.repeat_interleave(owner_q[q], count) * p + owner_k[run_start[runs]]
    need = torch.zeros(p * p, dtype=torch.bool)
    need[flat] = True
    return need.view(p, p)


def _pairs_by_table(owner_q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, owner_k: torch.Tensor,
                    p: int) -> torch.Tensor:
    """``need [P, P]`` from a ``[B, P]`` table: does block i's key span hold a tile of rank s."""
    # the key tiles sorted by (owner, tile) on one axis: rank s's tiles in [lo, hi] are the entries
    # between two binary searches (B x P of them, no [Bk, P] prefix-count table to build)
    stride = owner_k.numel() + 1
    keys = torch.sort(owner_k * stride + torch.arange(owner_k.numel())).values
    base = torch.arange(p) * stride  # [P]
    hits = (torch.searchsorted(keys, base + hi[:, None], right=True)
            > torch.searchsorted(keys, base + lo[:, None])) & (lo <= hi)[:, None]  # [B, P]
    order = torch.argsort(owner_q, stable=True)
    if owner_q.numel() % p == 0 and bool((owner_q[order] == torch.arange(p).repeat_interleave(owner_q.numel() // p)).all()):
        need = hits[order].view(p, -1, p).any(1)  # every rank holds B / P query blocks (or spans)
    else:
        need = torch.zeros(p, p).index_add_(0, owner_q, hits.to(torch.float32)) > 0
    return need


def _block_docs(mask: AttnMask, block: int, nb: int) -> torch.Tensor:
    """Block-level document bounds ``[0, ..., B]``: the documents' edges that fall on block edges."""
    edges = {0, nb}
    if mask.bounds is not None:
        edges |= {int(e) // block for e in mask.bounds.tolist() if int(e) % block == 0}
    return torch.tensor(sorted(edges), dtype=torch.int64)


def _named_owner(name: str, nb: int, world_size: int) -> Optional[torch.Tensor]:
    """Block owners ``[B]`` of a named layout, or None when its chunks are not whole blocks."""
    b = torch.arange(nb)
    if NAMED[name] == "contiguous":
        return b // (nb // world_size)
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
    kb = torch.arange(-(-k_len // block))
    owner_kc = torch.clamp(kb * block // max(k_len // world_size, 1), max=world_size - 1)  # contiguous keys
    docs = _block_docs(mask, block, nb)
    tried = {}  # name -> (balance, owner [B], stream)
    for name in dict.fromkeys(candidates):
        if name in NAMED:
            owner = _named_owner(name, nb, world_size)
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
    if not tried:
        raise ValueError(f"candidates {tuple(candidates)}: none applies ({world_size} ranks, {nb} blocks of {block}: "
                         "zigzag's chunks are not whole blocks)")
    within = [n for n in tried if tried[n][0] <= target]
    scores = {n: (tried[n][0], None) for n in tried}
    counted: dict[int, int] = {}  # id of a tried entry -> its pairs (shared entries counted once)
    for n in within if len(within) > 1 else []:  # traffic decides among the balanced ones only
        owner = tried[n][1]
        if id(tried[n]) not in counted:
            counted[id(tried[n])] = touching_pairs(summary, owner, owner if k_len == seq_len else owner_kc, world_size)
        scores[n] = (tried[n][0], counted[id(tried[n])])
    name = min(within, key=lambda n: (scores[n][1], scores[n][0])) if within else min(tried, key=lambda n: tried[n][0])
    if scores[name][1] is None:
        owner = tried[name][1]
        scores[name] = (tried[name][0], touching_pairs(summary, owner, owner if k_len == seq_len else owner_kc,
                                                       world_size))
    owner = tried[name][1]
    # blocks by rank, increasing inside each (a stable sort of the owners): one op for all ranks
    blocks = torch.argsort(owner, stable=True).view(world_size, per)
    positions = tuple((blocks[:, :, None] * block + torch.arange(block)).view(world_size, per * block).unbind(0))
    return Solution(Partition(positions, name=f"mask-{name}"), block, scores[name][0], scores[name][1], name, scores)


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
