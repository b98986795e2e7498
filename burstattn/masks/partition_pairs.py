"""The traffic score of a placement: how many ordered rank pairs ``(r, s)`` must exchange K/V because a query
block of r touches a key tile of s (:func:`touching_pairs`), from a mask's block summary
(:class:`burstattn.partition_solver.BlockSummary`: its ``lo, hi`` key-tile spans or its tile ``classes``).
This is what the sparse plan's byte formula multiplies (readers x K/V bytes)."""
from __future__ import annotations

from typing import Optional

import torch

from .blocks import EMPTY


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
