"""The cut of :func:`burstattn.document_partition` and :func:`burstattn.mask_partition`: two pointers
walk a stream of units (tokens or blocks, each with its work) in from both ends; rank r takes one run
from the dense end and one from the sparse end, sized so that its work lands within ``tolerance`` of
the mean, preferring sizes that cut no document (and swapping whole documents of the sparse end in and
out to land on one). Pure functions of tensors; imports only torch.

The choice of rank r depends on every earlier rank's (the pointers and the running surplus), so the
ranks are a sequential loop. With few units per rank (``n + 1 <= SCALAR_UNITS``: ``mask_partition``'s
blocks) each rank's ``n + 1`` candidate sizes are scored on Python floats, which are the same IEEE
doubles, added in the same order, as the float64 tensors of the vectorised scoring used for long runs
(token-level ``document_partition``): the same choice either way, without a dozen tensor calls per rank.
"""
from __future__ import annotations

from typing import Optional

import torch

_SWAP_REACH = 8  # units past the back run tried as the one swapped in
SCALAR_UNITS = 64  # at most this many candidate sizes per rank: scored on Python floats


def _pick(g: torch.Tensor, cuts: torch.Tensor, target: float, mean: float, surplus: float,
          band: float) -> tuple[int, bool]:
    """Best of K candidate rank works ``g`` [K] with new-cut counts ``cuts`` [K]: (index, in band).

    In the band (the rank's work and the running surplus of all ranks so far within ``band``
    of the mean, so that the last rank, which takes the rest, is too): fewest new cuts, then
    closest to ``target``. If no candidate is in the band: the closest. Ties: the first index.
    """
    err = (g - target).abs()
    ok = ((g - mean).abs() <= band) & ((surplus + g - mean).abs() <= band)
    if not bool(ok.any()):
        return int(torch.argmin(err)), False
    key = torch.where(ok, cuts, 3)
    return int(torch.argmin(torch.where(key == key.min(), err, torch.inf))), True


def _swaps(cum: torch.Tensor, boundary: torch.Tensor, f: int, b: int, n: int,
           c: int) -> Optional[tuple[torch.Tensor, ...]]:
    """Back sets made of whole units only, close to ``c`` tokens: the ``k`` units that fit in the
    back run, with unit ``x`` (or none) swapped out for a unit ``y`` just past it.

    A unit is a remaining document (or the remaining piece of one) between two boundaries of
    the stream; unit j = ``[edges[j+1], edges[j])`` counting inwards from ``b``. Returns flat
    candidates ``(tokens [K], work [K], x [K] (-1 = none), y [K], edges, k)`` or ``None``.
    """
    lo = max(f, b - 2 * n)
    edges = torch.cat([torch.tensor([b]), (torch.nonzero(boundary[lo:b]).flatten() + lo).flip(0)])
    length = edges[:-1] - edges[1:]  # [m]
    unit_work = cum[edges[:-1]] - cum[edges[1:]]  # [m]
    k = int((b - edges <= c).sum()) - 1  # units wholly inside the back run
    if k >= length.numel():
        return None
    x = torch.arange(-1, k)  # -1: swap nothing out
    y = torch.arange(k, min(k + _SWAP_REACH, length.numel()))
    xx, yy = (t.flatten() for t in torch.meshgrid(x, y, indexing="ij"))
    out_len = torch.where(xx >= 0, length[xx.clamp(min=0)], 0)
    out_work = torch.where(xx >= 0, unit_work[xx.clamp(min=0)], 0.0)
    tokens = (b - edges[k]) - out_len + length[yy]
    work = (cum[b] - cum[edges[k]]) - out_work + unit_work[yy]
    valid = (tokens <= n) & (f + n - tokens <= edges[yy + 1])  # the front run ends before them
    return tokens[valid], work[valid], xx[valid], yy[valid], edges, k


def _reorder(state: tuple[torch.Tensor, ...], edges: torch.Tensor, x: int, y: int, k: int) -> None:
    """Move unit ``x`` inwards and unit ``y`` next to units ``0..k-1`` (in place), so that the
    back run of the stream is exactly units ``0..k-1`` without ``x``, plus ``y``."""
    stream, ws, cum, boundary = state
    lo, b = int(edges[y + 1]), int(edges[0])
    order = list(range(y - 1, k - 1, -1)) + ([x] if x >= 0 else []) + [y] \
        + [j for j in range(k - 1, -1, -1) if j != x]  # units inner -> outer
    starts, lens = edges[1:][order], (edges[:-1] - edges[1:])[order]
    new_starts = lo + torch.cumsum(lens, 0) - lens
    src = torch.repeat_interleave(starts - new_starts, lens) + torch.arange(lo, b)
    stream[lo:b], ws[lo:b] = stream[src], ws[src]
    cum[lo + 1:b + 1] = cum[lo] + ws[lo:b].cumsum(0)
    boundary[lo:b] = False
    boundary[new_starts] = True


def _pick_scalar(cum: list, bound: list, f: int, b: int, n: int, target: float, mean: float, surplus: float,
                 band: float) -> tuple[int, bool, float, int]:
    """:func:`_pick` on Python floats over the ``n + 1`` sizes of the front run: ``(a, in band, work,
    new cuts)``. The same doubles and comparisons, so the same choice, ties to the first index."""
    base, top = cum[f], cum[b]
    best, fallback = None, None
    for a in range(n + 1):
        g = (cum[f + a] - base) + (top - cum[b - n + a])
        err = abs(g - target)
        cuts = int(a > 0 and not bound[f + a]) + int(a < n and not bound[b - n + a])
        if fallback is None or err < fallback[0]:
            fallback = (err, a, g, cuts)
        if abs(g - mean) <= band and abs(surplus + g - mean) <= band and (
                best is None or (cuts, err) < (best[0], best[1])):
            best = (cuts, err, a, g)
    if best is None:
        return fallback[1], False, fallback[2], fallback[3]
    return best[2], True, best[3], best[0]


def cut_runs(stream: torch.Tensor, ws: torch.Tensor, boundary: torch.Tensor, world_size: int, tolerance: float,
             allow_swaps: bool = True, scalar_units: int = SCALAR_UNITS) -> tuple[torch.Tensor, list[int]]:
    """The cut of the stream ``[N]`` with works ``ws`` (see :func:`_cut`): ``(stream, fronts)``, the
    stream after any swaps and the front-run sizes ``a`` of ranks ``0 .. P-2`` (rank r's back run is
    the ``n - a`` units before rank r-1's; the last rank takes what remains in the middle)."""
    state = (stream.clone(), ws.clone(), torch.cat([ws.new_zeros(1), ws.cumsum(0)]), boundary.clone())
    stream, ws, cum, boundary = state  # cum [N+1]: exact integers in float64
    n = stream.numel() // world_size
    scalar = n + 1 <= scalar_units
    cum_l, bound_l = (cum.tolist(), boundary.tolist()) if scalar else (None, None)
    mean = float(cum[-1]) / world_size
    band, a_all = tolerance * mean, torch.arange(n + 1)
    f, b, surplus, fronts = 0, stream.numel(), 0.0, []
    for r in range(world_size - 1):
        if scalar:
            target = (cum_l[b] - cum_l[f]) / (world_size - r)
            a, in_band, work, cut_a = _pick_scalar(cum_l, bound_l, f, b, n, target, mean, surplus, band)
        else:
            target = float(cum[b] - cum[f]) / (world_size - r)
            g = (cum[f + a_all] - cum[f]) + (cum[b] - cum[b - n + a_all])  # [n+1] work for each a
            cuts = ((a_all > 0) & ~boundary[f + a_all]).long() + ((a_all < n) & ~boundary[b - n + a_all]).long()
            a, in_band = _pick(g, cuts, target, mean, surplus, band)
            work, cut_a = float(g[a]), int(cuts[a])
        swaps = _swaps(cum, boundary, f, b, n, n - a) if allow_swaps and in_band and cut_a > 0 else None
        if swaps is not None and swaps[0].numel():
            tokens, back_work, x, y, edges, k = swaps
            a2 = n - tokens
            g2 = (cum[f + a2] - cum[f]) + back_work
            cuts2 = ((a2 > 0) & ~boundary[f + a2]).long()
            i, ok = _pick(g2, cuts2, target, mean, surplus, band)
            if ok and int(cuts2[i]) < cut_a:
                _reorder(state, edges, int(x[i]), int(y[i]), k)
                if scalar:  # the reordered span [edges[y + 1], b) of the tensors, into the lists
                    lo = int(edges[int(y[i]) + 1])
                    cum_l[lo:b + 1], bound_l[lo:b + 1] = cum[lo:b + 1].tolist(), boundary[lo:b + 1].tolist()
                a, work = int(a2[i]), float(g2[i])
        surplus += work - mean
        fronts.append(a)
        f, b = f + a, b - n + a
    return stream, fronts


def stream_owner(fronts: list[int], n: int, world_size: int) -> torch.Tensor:
    """The rank of every stream position ``[N]`` from :func:`cut_runs`'s front sizes (no loop over ranks)."""
    a = torch.tensor(fronts, dtype=torch.int64)
    ranks = torch.arange(world_size - 1)
    front = torch.repeat_interleave(ranks, a)  # rank 0's front run first
    back = torch.repeat_interleave(ranks.flip(0), (n - a).flip(0))  # rank 0's back run last
    middle = torch.full((n * world_size - front.numel() - back.numel(),), world_size - 1, dtype=torch.int64)
    return torch.cat([front, middle, back])


def _cut(stream: torch.Tensor, ws: torch.Tensor, boundary: torch.Tensor, world_size: int,
         tolerance: float, allow_swaps: bool = True, scalar_units: int = SCALAR_UNITS) -> list[torch.Tensor]:
    """Global positions of every rank (unsorted), cut from the stream ``[N]`` with works ``ws``.

    Two pointers walk in from both ends: rank r takes the run ``[f, f+a)`` from the dense end
    and ``[b-n+a, b)`` from the sparse end, ``a`` chosen by :func:`_pick` among all ``n+1``
    values. If that cuts a document although a back run of whole units (:func:`_swaps`) is in
    the band with fewer cuts, the stream's back is reordered to take that one instead (only with
    ``allow_swaps``: streams whose units are not documents skip that search).
    """
    stream, fronts = cut_runs(stream, ws, boundary, world_size, tolerance, allow_swaps, scalar_units)
    n = stream.numel() // world_size
    f, b, parts = 0, stream.numel(), []
    for a in fronts:
        parts.append(torch.cat([stream[f:f + a], stream[b - n + a:b]]))
        f, b = f + a, b - n + a
    parts.append(stream[f:b].clone())
    return parts
