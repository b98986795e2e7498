"""The two ways the segments' summaries reach the ranks that read them (:mod:`.passing`).

A summary is the affine map ``S -> A S + B`` of a segment (``A [b, H, dk, dk]`` for a matrix
transition, ``[b, H]`` for a scalar decay; ``B [b, H, dk, dv]``). Both schemes give every local
segment its initial state and return the final state; both are exact and differentiable (autograd
does the backward through the collectives' adjoints).

* ``"allgather"``: only the summaries another rank reads travel (:meth:`SegmentPlan.sent`: the
  segments whose document continues on another rank, at most two per rank under ``zigzag``,
  whatever the number of packed documents), all-gathered in one collective; every rank folds them
  in position order. One round, but every rank holds ``P x`` that many summaries (and the fold's
  states) until the backward: memory and fold work grow with ``P``.
* ``"scan"``: the log-depth prefix scan over point-to-point rounds (:mod:`.scan`): a rank holds its
  own runs' values and what it received, ``O(log P)`` summaries, and composes ``O(log P)`` times;
  ``ceil(log2 E) + 1`` rounds (``E`` runs: ``2P - 1`` under zigzag), fewer with packed documents.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .comm import all_gather, broadcast, exchange
from .scan import ScanPlan, scan_plan
from .segments import SegmentPlan

SCHEMES = ("auto", "allgather", "scan")
SCAN_MIN_WORLD = 8
"""``scheme="auto"`` takes the scan from this many ranks on: what the simulator derives for the
reference shapes on an H100 cluster (:func:`burstattn.sim.recurrent.derived_min_world`, tested equal)."""


def then(v, w, matrix: bool):
    """The map ``v`` then ``w``: ``v`` is ``None`` (identity) or ``(A or None, B or None)`` (``A``
    None: a constant; ``B`` None: zero); ``w = (A, B)`` or a constant."""
    if v is None or w[0] is None:
        return w
    (A1, B1), (A2, B2) = v, w
    B = B2 if B1 is None else (A2 @ B1 if matrix else A2[..., None, None] * B1) + B2
    A = None if A1 is None else (A2 @ A1 if matrix else A2 * A1)
    return A, B


def walk(pieces: list, v, initial: Optional[torch.Tensor], matrix: bool):
    """Fold ``pieces`` ``(slot, A, B, reset, at_zero)`` after ``v``: ``({slot: map before it}, map after)``.
    A reset starts from zero, or from ``initial`` at position 0."""
    before = {}
    for slot, A, B, reset, at_zero in pieces:
        if reset:
            v = (None, initial if at_zero else None)
        before[slot] = v
        v = then(v, (A, B), matrix)
    return before, v


@dataclass(frozen=True)
class Route:
    """What one rank's fold reads of the plans, as plain Python (built once on the host side: the
    dry run's fake tensors cannot be read).

    Attributes:
        scheme: ``"allgather"`` or ``"scan"``.
        resets: per rank, per slot: the segment starts a document.
        at_zero: per rank, per slot: the segment starts at position 0.
        order: every segment as ``(rank, slot)`` in position order.
        sent: per rank, the slots it all-gathers (``"allgather"``).
        scan: the :class:`~.scan.ScanPlan` (``"scan"``).
    """

    scheme: str
    resets: tuple
    at_zero: tuple
    order: tuple
    sent: tuple = ()
    scan: Optional[ScanPlan] = None


def route(seg: SegmentPlan, scheme: str, final: bool) -> Route:
    """The :class:`Route` of ``seg`` under a resolved ``scheme`` (pure)."""
    P = len(seg.offsets)
    return Route(scheme, tuple(tuple(r.tolist()) for r in seg.resets), tuple(tuple((s == 0).tolist()) for s in seg.starts),
                 seg.order, tuple(seg.sent(r, final) for r in range(P)) if scheme == "allgather" else (),
                 scan_plan(seg, final) if scheme == "scan" else None)


def resolve_scheme(scheme: str, world_size: int) -> str:
    """``"auto"``: the scan from :data:`SCAN_MIN_WORLD` ranks on, else the all-gather."""
    if scheme == "auto":
        return "scan" if world_size >= SCAN_MIN_WORLD else "allgather"
    return scheme


def _pieces(rt: Route, rank: int, slots, summaries: dict) -> list:
    return [(i, *summaries[i], rt.resets[rank][i], rt.at_zero[rank][i]) for i in slots]


class Packer:
    """Flat messages of maps: ``full`` carries ``[A | B]``, else ``B`` alone."""

    def __init__(self, batch: int, heads: int, a_shape: tuple, dk: int, dv: int) -> None:
        self.b, self.h, self.a_shape, self.dk, self.dv = batch, heads, a_shape, dk, dv
        self.a = 1
        for n in a_shape:
            self.a *= n

    def size(self, full: bool) -> int:
        return self.b * self.h * ((self.a if full else 0) + self.dk * self.dv)

    def pack(self, v, full: bool) -> torch.Tensor:
        A, B = v
        parts = ([A.reshape(self.b, self.h, -1)] if full else []) + [B.reshape(self.b, self.h, -1)]
        return torch.cat(parts, -1).reshape(-1)

    def unpack(self, flat: torch.Tensor, full: bool):
        x = flat.view(self.b, self.h, -1)
        B = x[..., x.shape[-1] - self.dk * self.dv:].reshape(self.b, self.h, self.dk, self.dv)
        return (x[..., :self.a].reshape(self.b, self.h, *self.a_shape) if full else None), B


def fold_allgather(rt: Route, ctx, summaries: dict, pk: Packer, *, final: bool, initial, token):
    """``(before {slot: state or None}, final state or None, tie)`` through one all-gather."""
    rank, matrix, sent = ctx.rank, bool(pk.a_shape), rt.sent
    K, gathered, tie = max(len(s) for s in sent), None, None
    if ctx.world_size > 1 and K:
        rows = [pk.pack(summaries[i], True) for i in sent[rank]]
        pad = next(iter(summaries.values()))[1].new_zeros(pk.size(True))
        summary = torch.stack(rows + [pad] * (K - len(rows)))  # [K, b * H * (a + dk dv)]
        if token is not None and token.requires_grad:
            summary = summary + token * 0  # the gather's backward before the initial state's all-reduce
        gathered = all_gather(summary, ctx.group, "state")  # [P, K, b * H * (a + dk dv)]
        if gathered.requires_grad:
            # every rank's backward must join the reduce-scatter, also a rank whose outputs read no
            # other rank's summary (rank 0 under contiguous): a zero term keeps the gather in its graph
            tie = gathered.sum() * 0.0
    # one unbind: its backward stacks every row's gradient into one [P * K, ...] buffer (a row
    # indexed on its own would give each use a zero-filled buffer of the whole gather)
    rows = gathered.reshape(ctx.world_size * K, -1).unbind(0) if gathered is not None else ()
    where = [{i: j for j, i in enumerate(s)} for s in sent]
    before, v = {}, None
    last_local = max(j for j, (r, _) in enumerate(rt.order) if r == rank)
    for r, i in rt.order[:len(rt.order) if final else last_local + 1]:
        if rt.resets[r][i]:
            v = (None, initial if rt.at_zero[r][i] else None)
        if r == rank:
            before[i], piece = v[1], summaries[i]
        elif i in where[r]:
            piece = pk.unpack(rows[r * K + where[r][i]], True)
        else:  # read by nobody: its document ends with it, the next segment starts from zero
            v = (None, None)
            continue
        v = then(v, piece, matrix)
    return before, (v[1] if final else None), tie


def fold_scan(rt: Route, ctx, summaries: dict, pk: Packer, *, final: bool, initial, token):
    """``(before, final state or None, tie)`` through the prefix scan's rounds (:mod:`.scan`)."""
    rank, matrix, sp = ctx.rank, bool(pk.a_shape), rt.scan
    mine = sp.runs_of(rank)
    vals = {e: walk(_pieces(rt, rank, sp.slots[e], summaries), None, initial, matrix)[1]
            for e in mine if e in sp.needed}
    steps = [r.moves for r in sp.rounds] + [tuple((s, d, False) for s, d in sp.shift)]
    s_in = {}
    for k, moves in enumerate(steps):
        out, inc = {}, {}
        for src, dst, full in moves:
            a, b = sp.owner[src], sp.owner[dst]
            if a == rank and b != rank:
                out.setdefault(b, []).append(pk.pack(vals[src], full))
            elif b == rank and a != rank:
                inc.setdefault(a, []).append((src, dst, full))
        got = {}
        if out or inc:
            token, flat = exchange(token, [(p, torch.cat(t)) for p, t in out.items()],
                                   [(p, sum(pk.size(f) for *_, f in m)) for p, m in inc.items()], ctx.group, "state")
            for (peer, m), buf in zip(inc.items(), flat):
                for (src, dst, full), part in zip(m, buf.split([pk.size(f) for *_, f in m])):
                    got[src, dst] = pk.unpack(part, full)
        shift = k == len(steps) - 1
        new = dict(vals)
        for src, dst, _ in moves:
            if sp.owner[dst] == rank:
                v = vals[src] if sp.owner[src] == rank else got[src, dst]
                if shift:
                    s_in[dst] = v[1]
                else:
                    new[dst] = then(v, vals[dst], matrix)
        vals = new
    before = {}
    for e in mine:
        start = (None, s_in.get(e))
        before.update(walk(_pieces(rt, rank, sp.slots[e], summaries), start, initial, matrix)[0])
    before = {i: v[1] for i, v in before.items()}
    S = None
    if final:
        S = vals[sp.final_run][1] if rank == sp.owner[sp.final_run] else \
            token.new_zeros(pk.b, pk.h, pk.dk, pk.dv)
        if ctx.world_size > 1:
            copy = broadcast(S, sp.owner[sp.final_run], ctx.group, "state")
            S = S if rank == sp.owner[sp.final_run] else copy
    tie = token * 0 if token is not None and token.requires_grad else None
    return before, S, tie
